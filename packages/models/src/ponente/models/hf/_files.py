"""The files of a Hugging Face checkpoint folder: ``config.json`` and (sharded) safetensors, read and written.

Shared by every architecture's loader and saver (``_checkpoint`` for the causal LMs, ``_whisper``).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from ._hub import missing_weights_error

logger = logging.getLogger(__name__)

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
PICKLE_WEIGHTS_NAME = "pytorch_model.bin"
PICKLE_INDEX_NAME = "pytorch_model.bin.index.json"


def _read_json(path: Path) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        data: dict[str, Any] = json.load(f)
    return data


def _shard_files(directory: Path, single: str, index_name: str, key: str) -> list[Path] | None:
    """The weight files of ``directory``: the shards its index lists, or the single file; None if neither."""
    index = directory / index_name
    if index.is_file():
        weight_map: dict[str, str] = _read_json(index)["weight_map"]
        shards = [_confined(directory, shard, index, key) for shard in sorted(set(weight_map.values()))]
        for shard_path in shards:
            if not shard_path.is_file():
                raise FileNotFoundError(f"{key}: shard {shard_path} listed in {index} does not exist")
        return shards
    return [directory / single] if (directory / single).is_file() else None


def _confined(directory: Path, shard: object, index: Path, key: str) -> Path:
    """``directory / shard`` for a shard name of an index file, which must be a file name inside ``directory``.

    Raises:
        ValueError: naming the index and ``key`` for a name that is not a string, is absolute, has a ``..`` part,
            or (through a link) leads outside the folder.
    """
    if not isinstance(shard, str) or not shard:
        raise ValueError(f"{key}: {index} lists a shard that is not a file name: {shard!r}")
    parts = Path(shard).parts
    if Path(shard).is_absolute() or ".." in parts or "\\" in shard:
        raise ValueError(f"{key}: {index} lists the shard {shard!r}, which is not a file inside {directory}")
    path = directory / shard
    if path.exists() and not path.resolve().is_relative_to(directory.resolve()):
        raise ValueError(f"{key}: shard {shard!r} listed in {index} leads outside {directory} ({path.resolve()})")
    return path


def _read_safetensors(directory: Path, key: str = "load_pretrained") -> dict[str, Any]:
    from safetensors.flax import load_file  # lazy: only needed for checkpoints; flax loader handles bfloat16

    files = _shard_files(directory, WEIGHTS_NAME, INDEX_NAME, key)
    if files is None:
        raise missing_weights_error(directory, key)  # names allow_pickle when there are pickle weights
    state: dict[str, Any] = {}
    for file in files:
        state.update(load_file(os.fspath(file)))
    return state


def _read_pickle(directory: Path, key: str) -> dict[str, Any]:
    """The tensors of ``pytorch_model.bin`` (or its shards), read by torch with ``weights_only=True``."""
    try:
        import torch
    except ImportError:
        raise ImportError(
            f"{key}: {directory} has only pickle weights (pytorch_model*.bin), which need torch to read: "
            "pip install 'ponente-models[torch]' (or convert them to safetensors)"
        ) from None
    files = _shard_files(directory, PICKLE_WEIGHTS_NAME, PICKLE_INDEX_NAME, key)
    if files is None:
        raise FileNotFoundError(f"{key}: {directory} has neither {PICKLE_WEIGHTS_NAME} nor {PICKLE_INDEX_NAME}")
    state: dict[str, Any] = {}
    for file in files:
        # weights_only: the unpickler builds tensors and plain containers only, never arbitrary objects (no code runs)
        tensors = torch.load(os.fspath(file), map_location="cpu", weights_only=True)
        if not isinstance(tensors, Mapping):
            raise ValueError(f"{key}: {file} holds a {type(tensors).__name__}, not a state dict of tensors")
        for name, tensor in tensors.items():
            state[str(name)] = _torch_to_jax(tensor)
    return state


def _torch_to_jax(tensor: Any) -> Any:
    import torch

    tensor = tensor.detach().cpu().contiguous()
    if tensor.dtype == torch.bfloat16:  # NumPy has no bfloat16: reinterpret the bits
        return jnp.asarray(tensor.view(torch.int16).numpy().view(jnp.bfloat16))
    return jnp.asarray(tensor.numpy())


def _read_weights(directory: Path, *, allow_pickle: bool, key: str) -> dict[str, Any]:
    """Safetensors weights; pickle ones only when allowed and there are no safetensors."""
    if _shard_files(directory, WEIGHTS_NAME, INDEX_NAME, key) is None and allow_pickle:
        return _read_pickle(directory, key)
    return _read_safetensors(directory, key)


def _shards(state: Mapping[str, np.ndarray], max_shard_size: int) -> list[dict[str, np.ndarray]]:
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(state):
        nbytes = state[name].nbytes
        if shards[-1] and size + nbytes > max_shard_size:
            shards.append({})
            size = 0
        shards[-1][name] = state[name]
        size += nbytes
    return shards


def write_checkpoint(
    path: str | os.PathLike[str],
    state: Mapping[str, np.ndarray],
    hf_config: dict[str, Any],
    *,
    max_shard_size: int,
    tokenizer: Any = None,
    key: str = "save_pretrained",
) -> None:
    """Write ``config.json`` (with the weights' ``dtype``) and ``state`` as (sharded) safetensors into ``path``.

    Raises:
        ValueError: if ``max_shard_size`` is not positive.
    """
    from safetensors.numpy import save_file  # lazy: only needed for checkpoints

    if max_shard_size <= 0:
        raise ValueError(f"{key}: max_shard_size must be positive, got {max_shard_size}")
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: np.ascontiguousarray(v) for k, v in state.items()}
    dtypes = {
        str(v.dtype) for v in state.values() if np.issubdtype(v.dtype, np.floating) or v.dtype.name == "bfloat16"
    }
    hf_config = {**hf_config, "dtype": dtypes.pop() if len(dtypes) == 1 else "float32"}
    with open(directory / CONFIG_NAME, "w", encoding="utf-8") as f:
        json.dump(hf_config, f, indent=2, sort_keys=True)
    metadata = {"format": "pt"}
    shards = _shards(state, max_shard_size)
    if len(shards) == 1:
        save_file(shards[0], os.fspath(directory / WEIGHTS_NAME), metadata=metadata)
    else:
        weight_map: dict[str, str] = {}
        for i, shard in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, os.fspath(directory / name), metadata=metadata)
            weight_map.update(dict.fromkeys(shard, name))
        index = {"metadata": {"total_size": int(sum(v.nbytes for v in state.values()))}, "weight_map": weight_map}
        with open(directory / INDEX_NAME, "w", encoding="utf-8") as f:
            json.dump(index, f, indent=2, sort_keys=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(os.fspath(directory))
    logger.info("%s: wrote %d tensors in %d file(s) to %s", key, len(state), len(shards), directory)
