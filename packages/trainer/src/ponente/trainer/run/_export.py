"""Export a model as a Hugging Face folder (``transformers`` loads it), with its tokenizer."""

from __future__ import annotations

from typing import Any

__all__ = ["export_hf"]


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
