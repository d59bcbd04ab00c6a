"""Export a model as a Hugging Face folder (``transformers`` loads it), with its tokenizer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ._outputs import resolve_path

__all__ = ["export_hf", "hf_exporter"]


def export_hf(model: Any, path: str, *, tokenizer: Any | None, seq_len: int, max_shard_size: int | None = None) -> str:
    """Write ``model`` (safetensors + ``config.json``) and, if given, ``tokenizer`` to the folder ``path``.

    Args:
        model: a ``ponente.models`` language model.
        path: the output folder (created; files of the same names are overwritten).
        tokenizer: a ``tokenizers.Tokenizer`` to save alongside (None: the model only).
        seq_len: the tokenizer's ``model_max_length``.
        max_shard_size: the largest safetensors file in bytes (None: ``save_pretrained``'s default).

    Returns:
        ``path``.
    """
    from ponente.models.hf import save_pretrained
    from ponente.trainer.hf_tokenizer import HfTokenizerFiles

    files = HfTokenizerFiles(tokenizer, model_max_length=seq_len) if tokenizer is not None else None
    options = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    save_pretrained(model, path, tokenizer=files, **options)
    return path


def hf_exporter(path: str, *, tokenizer: Any | None, seq_len: int) -> Callable[[Any, str | None], dict[str, str]]:
    """An ``export(model, subfolder)`` for :class:`~ponente.trainer.run.LmRecipe`: a Hugging Face folder at ``path``.

    Args:
        path: the export folder (relative paths are made absolute); ``subfolder`` (``"step-N"``) goes under it.
        tokenizer: the tokenizer saved alongside (None: none).
        seq_len: the tokenizer's ``model_max_length``.

    Returns:
        The exporter; it returns ``{"hugging face export": folder}``.
    """

    def export(model: Any, subfolder: str | None) -> dict[str, str]:
        where = resolve_path(path if subfolder is None else f"{path}/{subfolder}")
        return {"hugging face export": export_hf(model, where, tokenizer=tokenizer, seq_len=seq_len)}

    return export
