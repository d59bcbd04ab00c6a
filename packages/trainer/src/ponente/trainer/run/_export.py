"""Export a model as a Hugging Face folder (``transformers`` loads it), with its tokenizer.

The folder may be local or on an object store (``s3://``, ``gs://``): a remote export is written to a local
temporary folder first and then uploaded with fsspec (``s3fs`` / ``gcsfs``, the ``s3`` / ``gcs`` extras), the
``config.json`` last, so a reader that finds ``config.json`` finds the whole folder.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import Any

from ponente.datacache import storage

__all__ = ["export_folder", "export_hf"]


def export_hf(model: Any, path: str, *, tokenizer: Any | None, seq_len: int, max_shard_size: int | None = None) -> str:
    """Write ``model`` (safetensors + ``config.json``) and, if given, ``tokenizer`` to the folder ``path``.

    Args:
        model: a ``ponente.models`` language model.
        path: the output folder (created; files of the same names are overwritten): a local path or an
            ``s3://`` / ``gs://`` URL.
        tokenizer: a ``tokenizers.Tokenizer`` to save alongside (None: the model only).
        seq_len: the tokenizer's ``model_max_length``.
        max_shard_size: the largest safetensors file in bytes (None: ``save_pretrained``'s default).

    Returns:
        ``path``.

    Raises:
        ponente.datacache.storage.StorageError: ``path`` is on an object store whose fsspec extra is not
            installed, or the store refused the upload.
    """
    from ponente.models.hf import save_pretrained
    from ponente.trainer.hf_tokenizer import HfTokenizerFiles

    files = HfTokenizerFiles(tokenizer, model_max_length=seq_len) if tokenizer is not None else None
    options = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    return export_folder(path, lambda folder: save_pretrained(model, folder, tokenizer=files, **options))


def export_folder(path: str, write: Callable[[str], None]) -> str:
    """Run ``write(folder)`` on the folder ``path``, or (an ``s3://`` / ``gs://`` URL) on a local temporary folder
    that is then uploaded, ``config.json`` last, so a reader that finds ``config.json`` finds the whole folder.

    Args:
        path: the output folder: a local path or an object-store URL.
        write: writes the export's files into the folder it is given.

    Returns:
        ``path``.

    Raises:
        ponente.datacache.storage.StorageError: ``path`` is on an object store whose fsspec extra is not
            installed, or the store refused the upload.
    """
    if "://" not in path:
        write(path)
        return path
    fs, remote = storage.filesystem(path)  # before the slow work: a missing s3fs/gcsfs fails at once
    with tempfile.TemporaryDirectory(prefix="ponente-export-") as local:
        write(local)
        _upload(fs, local, remote, path)
    return path


def _upload(fs: Any, local: str, remote: str, url: str) -> None:
    """Copy the files of the folder ``local`` to ``remote`` on ``fs``; ``config.json`` last."""
    names = sorted(
        os.path.relpath(os.path.join(root, name), local) for root, _, found in os.walk(local) for name in found
    )
    names.sort(key=lambda name: name == "config.json")
    try:
        for name in names:
            fs.put_file(os.path.join(local, name), f"{remote.rstrip('/')}/{name}")
    except (OSError, ValueError) as e:
        raise storage.storage_error(url, e, "exporting to") or storage.StorageError(
            f"exporting to {url}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        ) from e
