"""``load_pretrained`` / ``save_pretrained``: local Hugging Face checkpoint directories."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ponente.namedtensor import Axis

from ..config import LmConfig, config_for_type
from ..lm import LmHeadModel

logger = logging.getLogger(__name__)

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
_DTYPE_KEYS = ("dtype", "torch_dtype")  # transformers 5 spelling first, then transformers 4


def _config_from_hf(hf_config: Mapping[str, Any], where: Path) -> LmConfig:
    model_type = hf_config.get("model_type")
    if model_type is None:
        raise KeyError(f"load_pretrained: {where} has no 'model_type' key, so the architecture is unknown")
    return config_for_type(str(model_type)).from_hf_config(hf_config)


def _read_json(path: Path) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        data: dict[str, Any] = json.load(f)
    return data


def _read_safetensors(directory: Path) -> dict[str, Any]:
    from safetensors.flax import load_file  # lazy: only needed for checkpoints; flax loader handles bfloat16

    index = directory / INDEX_NAME
    single = directory / WEIGHTS_NAME
    if index.is_file():
        weight_map: dict[str, str] = _read_json(index)["weight_map"]
        state: dict[str, Any] = {}
        for shard in sorted(set(weight_map.values())):
            shard_path = directory / shard
            if not shard_path.is_file():
                raise FileNotFoundError(f"load_pretrained: shard {shard_path} listed in {index} does not exist")
            state.update(load_file(os.fspath(shard_path)))
        return state
    if single.is_file():
        return dict(load_file(os.fspath(single)))
    raise FileNotFoundError(f"load_pretrained: {directory} has neither {WEIGHTS_NAME} nor {INDEX_NAME}")


def _resolve_dtype(dtype: Any, hf_config: Mapping[str, Any]) -> Any:
    if dtype is not None:
        return jnp.dtype(dtype)
    for key in _DTYPE_KEYS:
        if hf_config.get(key):
            return jnp.dtype(str(hf_config[key]).removeprefix("torch."))
    return jnp.dtype(jnp.float32)


def load_pretrained(path: str | os.PathLike[str], *, dtype: Any = None) -> LmHeadModel:
    """Load a Hugging Face causal-LM checkpoint directory into a ponente model.

    The architecture comes from ``config.json``'s ``model_type`` (through the config registry); both
    the transformers-4 (``rope_theta``, ``torch_dtype``) and -5 (``rope_parameters``, ``dtype``)
    spellings are read. Weights come from ``model.safetensors`` or from the shards listed in
    ``model.safetensors.index.json``.

    Args:
        path: a local checkpoint directory.
        dtype: parameter dtype (None: the config's ``dtype``/``torch_dtype``, else float32).

    Returns:
        The model.

    Raises:
        FileNotFoundError: if ``path`` is not a local directory (Hub ids are not downloaded) or files are missing.
        KeyError: for an unknown ``model_type`` or a missing parameter.
        ValueError: if a parameter has the wrong shape.
    """
    directory = Path(path)
    if not directory.is_dir():
        raise FileNotFoundError(
            f"load_pretrained: {os.fspath(path)!r} is not a local directory; downloading from the Hugging Face Hub "
            "is not supported (download the checkpoint first, e.g. with `huggingface-cli download`, and pass its path)"
        )
    config_path = directory / CONFIG_NAME
    if not config_path.is_file():
        raise FileNotFoundError(f"load_pretrained: {config_path} does not exist")
    hf_config = _read_json(config_path)
    config = _config_from_hf(hf_config, config_path)
    if "vocab_size" not in hf_config:
        raise KeyError(f"load_pretrained: {config_path} has no 'vocab_size' key")
    Vocab = Axis("vocab", int(hf_config["vocab_size"]))
    target = _resolve_dtype(dtype, hf_config)

    def template_fn(key: jax.Array) -> LmHeadModel:
        model = config.build(Vocab, key=key)
        return jax.tree_util.tree_map(
            lambda x: x.astype(target) if jnp.issubdtype(x.dtype, jnp.floating) else x, model
        )

    template = eqx.filter_eval_shape(template_fn, jax.random.key(0))
    state = _read_safetensors(directory)
    logger.info(
        "load_pretrained: %s (%s, %d tensors, dtype %s)", directory, hf_config["model_type"], len(state), target
    )
    return template.from_hf_state_dict(state)


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


def save_pretrained(
    model: LmHeadModel,
    path: str | os.PathLike[str],
    *,
    tokenizer: Any = None,
    max_shard_size: int = 5 * 1024**3,
) -> None:
    """Write ``model`` as a Hugging Face checkpoint directory that ``transformers.AutoModelForCausalLM`` loads.

    Args:
        model: the model.
        path: the output directory (created if needed; existing files of the same names are overwritten).
        tokenizer: optional object with a ``save_pretrained(path)`` method (e.g. a transformers tokenizer).
        max_shard_size: the largest safetensors shard in bytes; larger checkpoints are sharded with an index file.

    Raises:
        ValueError: if ``max_shard_size`` is not positive.
    """
    from safetensors.numpy import save_file  # lazy: only needed for checkpoints

    if max_shard_size <= 0:
        raise ValueError(f"save_pretrained: max_shard_size must be positive, got {max_shard_size}")
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: np.ascontiguousarray(v) for k, v in model.to_hf_state_dict().items()}
    hf_config = model.config.to_hf_config(model.Vocab.size)
    dtypes = {
        str(v.dtype) for v in state.values() if np.issubdtype(v.dtype, np.floating) or v.dtype.name == "bfloat16"
    }
    hf_config["dtype"] = dtypes.pop() if len(dtypes) == 1 else "float32"
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
    logger.info("save_pretrained: wrote %d tensors in %d file(s) to %s", len(state), len(shards), directory)
