"""Prompt and chat templates of supervised data: inline Jinja text or a file, and a tokenizer's own chat template."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, NamedTuple

from ponente.trainer.data.cache_build import resolve_url

__all__ = ["ChatDefaults", "read_template", "tokenizer_chat_defaults"]

logger = logging.getLogger(__name__)

TEMPLATE_FILE = "chat_template.jinja"
"""The file newer ``transformers`` versions save a tokenizer's chat template to, next to ``tokenizer_config.json``."""


def read_template(value: str | None, key: str) -> str | None:
    """The Jinja text of a template config value: inline text, or a file.

    A value with no ``{`` and no newline is a file: a path or a ``package://<module>/<file>`` URL (e.g. a
    ``.jinja`` file); anything else is the template itself.

    Args:
        value: The config value, or ``None``.
        key: The config key, for errors (e.g. ``data.chat_template``).

    Returns:
        The template text, or ``None`` for ``None``.

    Raises:
        ValueError: Naming ``key`` if the file cannot be read.

    Example:
        ```python
        from ponente.trainer.data.templates import read_template

        text = read_template("package://ponente.trainer.assets/tiny_chat_template.jinja", "data.chat_template")
        assert "<|im_start|>" in text
        assert read_template("{{ instruction }}", "data.prompt_template") == "{{ instruction }}"
        ```
    """
    if value is None:
        return None
    if "{" in value or "\n" in value:
        return value
    try:
        return Path(resolve_url(value)).read_text(encoding="utf-8")
    except (OSError, ImportError, ValueError) as exc:
        raise ValueError(
            f"{key}: {value!r} has no '{{' so it is read as a template file, which cannot be read: {exc}"
        ) from exc


class ChatDefaults(NamedTuple):
    """What a tokenizer's folder says about chat: its template and special tokens (each ``None`` if absent)."""

    chat_template: str | None
    bos_token: str | None
    eos_token: str | None


def _token(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _hub_file(repo: str, name: str) -> Path | None:
    from ponente.datacache import hub_file  # the local hub cache first, ``org/name@revision`` ids, no retry noise

    try:
        return hub_file(repo, name, what="tokenizer")
    except FileNotFoundError as exc:  # absent file, unknown id, offline and not cached: no default from the hub
        logger.info("no %s for the tokenizer %r on the Hugging Face hub: %s", name, repo, exc)
        return None


def tokenizer_chat_defaults(tokenizer: str | os.PathLike[str]) -> ChatDefaults:
    """The chat template and BOS/EOS tokens saved with a tokenizer, as ``transformers`` saves them.

    Looks next to the tokenizer (the folder of a ``tokenizer.json`` file, or the folder given) for
    ``chat_template.jinja``, then for the ``chat_template`` of ``tokenizer_config.json`` (a string, or a list of
    named templates of which ``default`` is used), and reads ``bos_token``/``eos_token`` from
    ``tokenizer_config.json``. For a Hugging Face hub id, the same files are fetched (offline: nothing).

    Args:
        tokenizer: A ``tokenizer.json`` path, a folder, or a hub id (``package://`` URLs resolved by the caller).

    Returns:
        The defaults found.

    Raises:
        ValueError: Naming ``data.chat_template`` if ``tokenizer_config.json`` is not valid JSON or lists several
            templates and none is named ``default``.
    """
    path = Path(tokenizer)
    if path.is_file() or path.is_dir():
        folder = path.parent if path.is_file() else path
        template_file: Path | None = folder / TEMPLATE_FILE
        config_file: Path | None = folder / "tokenizer_config.json"
    else:
        template_file = _hub_file(str(tokenizer), TEMPLATE_FILE)
        config_file = _hub_file(str(tokenizer), "tokenizer_config.json")
    config: dict[str, Any] = {}
    if config_file is not None and config_file.is_file():
        try:
            config = json.loads(config_file.read_text(encoding="utf-8"))
        except ValueError as exc:
            raise ValueError(f"data.chat_template: cannot read {str(config_file)!r}: {exc}") from exc
    template: Any = None
    if template_file is not None and template_file.is_file():
        template = template_file.read_text(encoding="utf-8")
    else:
        template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if "default" not in named:
            raise ValueError(
                f"data.chat_template: {str(config_file)!r} has several chat templates {sorted(map(str, named))} and "
                "none named 'default'; set data.chat_template to the one to use"
            )
        template = named["default"]
    return ChatDefaults(
        template if isinstance(template, str) and template.strip() else None,
        _token(config.get("bos_token")),
        _token(config.get("eos_token")),
    )
