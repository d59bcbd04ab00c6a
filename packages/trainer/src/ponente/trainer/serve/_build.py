"""The app of a loaded model: its engine, the token ids that end a completion, its chat template and limits."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ._app import create_app
from ._chat import ChatTemplate
from ._protocol import ServerLimits

__all__ = ["app_for_model", "stop_token_ids", "tokenizer_folder"]

logger = logging.getLogger(__name__)


def app_for_model(
    model: Any,
    tokenizer: Any,
    *,
    folder: str | None,
    model_name: str,
    eos_ids: Sequence[int] = (),
    stop_tokens: Sequence[str] = (),
    chat_template: str | None = None,
    max_batch_size: int = 8,
    max_seq_len: int | None = None,
    max_tokens: int = 1024,
    default_max_tokens: int = 64,
    max_pending: int = 256,
    api_key: str | None = None,
    max_tokenizations: int = 4,
    docs: bool = False,
    engine_options: dict[str, Any] | None = None,
) -> Any:
    """The app serving ``model``: its :class:`~ponente.trainer.inference.Engine`, stop ids, chat template, limits.

    Args:
        model: a language model.
        tokenizer: its ``tokenizers.Tokenizer``.
        folder: the tokenizer's folder (:func:`tokenizer_folder`: ``tokenizer_config.json``'s ``eos_token``, the
            chat template of ``chat_template.jinja`` or ``tokenizer_config.json``; None: none).
        model_name: the model id clients name.
        eos_ids: the model's end-of-sequence ids.
        stop_tokens: more tokens that end a completion.
        chat_template: Jinja text or a ``.jinja`` file (None: the folder's; without one, chat requests get 400).
        max_batch_size: prompts generated together, at most.
        max_seq_len: prompt plus completion tokens, at most (None: the model's ``seq_len``).
        max_tokens: the largest ``max_tokens`` a request may ask for.
        default_max_tokens: ``max_tokens`` of requests that set none.
        max_pending: requests waiting for a batch, at most.
        api_key: require ``Authorization: Bearer <api_key>`` (None: no key).
        max_tokenizations: requests tokenized at the same time, at most.
        docs: serve ``/docs``, ``/redoc`` and ``/openapi.json``.
        engine_options: more arguments of the :class:`~ponente.trainer.inference.Engine` (``continuous``,
            ``page_size``, ``max_pages``, ``prefill_chunk``, ``prefix_caching``, ...).

    Returns:
        The FastAPI app (:func:`create_app`).

    Raises:
        ValueError: naming the key: a stop token not in the vocabulary, a bad chat template.
    """
    from ponente.trainer.inference import Engine

    engine = Engine(model, tokenizer, max_batch_size=max_batch_size, max_seq_len=max_seq_len, **(engine_options or {}))
    stops = stop_token_ids(tokenizer, folder, eos_ids=eos_ids, stop_tokens=stop_tokens)
    template = ChatTemplate.load(tokenizer, folder, chat_template)
    if template is None:
        logger.warning("no chat template (pass --chat_template): /v1/chat/completions will answer 400")
    limits = ServerLimits(
        model_name=model_name,
        max_seq_len=engine.max_seq_len,
        max_tokens=max_tokens,
        default_max_tokens=default_max_tokens,
        max_prompts=max_batch_size,
    )
    return create_app(
        engine,
        tokenizer,
        limits=limits,
        chat_template=template,
        stop_token_ids=stops,
        api_key=api_key,
        max_pending=max_pending,
        max_tokenizations=max_tokenizations,
        docs=docs,
    )


def tokenizer_folder(spec: str) -> str | None:
    """The local folder of the tokenizer files (``tokenizer_config.json``, ``chat_template.jinja``), if any.

    Args:
        spec: a ``tokenizer.json`` file, a folder holding one, or a model folder (an fsspec URL or hub id that is
            not a local folder gives None).
    """
    from ponente.trainer.data import resolve_url

    path = Path(resolve_url(spec))
    if path.is_file():
        path = path.parent
    return str(path) if path.is_dir() else None


def stop_token_ids(
    tokenizer: Any, folder: str | None, *, eos_ids: Sequence[int] = (), stop_tokens: Sequence[str] = ()
) -> list[int]:
    """The token ids that end a completion: ``eos_ids``, the ``eos_token`` of ``folder``'s
    ``tokenizer_config.json`` (when the tokenizer knows it) and each of ``stop_tokens``; sorted, without repeats.

    Args:
        tokenizer: a ``tokenizers.Tokenizer``.
        folder: the tokenizer's folder (:func:`tokenizer_folder`; None: no ``tokenizer_config.json``).
        eos_ids: the model's end-of-sequence ids (e.g. ``ponente.trainer.inference.eos_token_ids``).
        stop_tokens: more tokens that end a completion (the key ``stop_tokens``).

    Raises:
        ValueError: naming ``stop_tokens``, for a token that is not in the vocabulary.
    """
    from ponente.trainer.data.templates import tokenizer_chat_defaults

    stops = list(eos_ids)
    eos = None if folder is None else tokenizer_chat_defaults(folder).eos_token
    if eos is not None and tokenizer.token_to_id(eos) is not None:
        stops.append(int(tokenizer.token_to_id(eos)))
    for token in stop_tokens:
        token_id = tokenizer.token_to_id(token)
        if token_id is None:
            raise ValueError(f"stop_tokens: {token!r} is not a token of the tokenizer")
        stops.append(int(token_id))
    return sorted(set(stops))
