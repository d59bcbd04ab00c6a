"""Tokenizer files of Hugging Face Hub ids, offline-first: the local Hub cache before the network.

An id is ``"org/name"`` or ``"org/name@revision"`` (a branch, tag or commit). Its ``tokenizer.json`` is looked
up in the Hub cache (``HF_HUB_CACHE``, else ``HF_HOME/hub``, else ``~/.cache/huggingface/hub``) with no network
access, and downloaded only when missing and ``HF_HUB_OFFLINE`` is not set. The environment is read at each call.
(``ponente.models.hf`` resolves whole checkpoints the same way; datacache keeps its own copy, as it imports none
of the other packages.)
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Iterator
from pathlib import Path

_TRUE = ("1", "true", "yes", "on")


class HubUnavailableError(FileNotFoundError):
    """A Hub id whose file is not in the local cache and cannot be downloaded (offline, unknown id, no network)."""


def hub_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) is set to a true value now."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().lower() in _TRUE


def hub_cache_dir() -> Path:
    """The Hugging Face Hub cache folder as the environment says now (the same rules as ``huggingface_hub``)."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(os.path.expandvars(explicit)).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface"
    )
    return Path(os.path.expandvars(home)).expanduser() / "hub"


def split_revision(reference: str) -> tuple[str, str | None]:
    """``"org/name@rev"`` -> ``("org/name", "rev")``; without ``@``: ``(reference, None)``."""
    repo_id, at, revision = reference.partition("@")
    return repo_id, (revision or None) if at else None


@contextlib.contextmanager
def _quiet_hub() -> Iterator[None]:
    """Silence ``huggingface_hub``'s warnings and retry chatter: a failure reaches the user as one line."""
    hub_logger = logging.getLogger("huggingface_hub")
    level = hub_logger.level
    hub_logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hub_logger.setLevel(level)


def hub_file(reference: str, filename: str, *, what: str) -> Path:
    """The local path of ``filename`` in the Hub repository ``reference`` (``org/name[@revision]``).

    Args:
        reference: the Hub id, optionally with ``@revision``.
        filename: the file in the repository, e.g. ``"tokenizer.json"``.
        what: what the id names, for the message (e.g. ``"tokenizer"``).

    Returns:
        The cached (or just downloaded) file.

    Raises:
        HubUnavailableError: (a ``FileNotFoundError``) if the file is not cached and cannot be downloaded, in one
            line naming the id, the cache folder and ``HF_HUB_OFFLINE`` when it is set.
    """
    repo_id, revision = split_revision(reference)
    where = f"{what} {repo_id!r}" + (f" (revision {revision})" if revision else "")
    try:
        from huggingface_hub import hf_hub_download, try_to_load_from_cache
    except ImportError:
        raise HubUnavailableError(
            f"{where} is not a local file or directory, and reading it from the Hugging Face hub needs the "
            "`huggingface_hub` package (pip install huggingface_hub)"
        ) from None
    cache = hub_cache_dir()
    with _quiet_hub():
        cached = try_to_load_from_cache(repo_id, filename, cache_dir=cache, revision=revision)
    if isinstance(cached, str) and os.path.isfile(cached):
        return Path(cached)
    if hub_offline():
        raise HubUnavailableError(
            f"{where} is not a local file or directory nor in the Hugging Face cache {cache}, and HF_HUB_OFFLINE "
            f"is set, so it cannot be fetched from the hub; download it while online (`hf download {repo_id} "
            f"{filename}`), pass a local {filename}, or unset HF_HUB_OFFLINE"
        )
    try:
        with _quiet_hub():
            local = hf_hub_download(
                repo_id, filename, revision=revision, cache_dir=cache, endpoint=os.environ.get("HF_ENDPOINT") or None
            )
    except Exception as e:  # network, authentication, unknown repository or file: all mean "cannot get it"
        text = " ".join(str(e).split())[:300]
        raise HubUnavailableError(
            f"{where} is not a local file or directory nor in the Hugging Face cache {cache}, and could not be "
            f"fetched from the hub (are you offline, or is the id wrong?): {type(e).__name__}: {text}"
        ) from e
    return Path(local)
