"""Whisper checkpoints in Hugging Face's format (``WhisperForConditionalGeneration``): read and write."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..whisper import WhisperConfig, WhisperModel
from ._checkpoint import CONFIG_NAME, INDEX_NAME, WEIGHTS_NAME, _read_json, _read_weights, _shards
from ._hub import resolve_checkpoint

__all__ = ["load_whisper_pretrained", "save_whisper_pretrained"]

logger = logging.getLogger(__name__)


def load_whisper_pretrained(
    path: str | os.PathLike[str],
    *,
    revision: str | None = None,
    dtype: Any = None,
    allow_pickle: bool = False,
    config: WhisperConfig | None = None,
) -> WhisperModel:
    """Load a Hugging Face Whisper checkpoint (a local folder, or a Hub id resolved offline-first).

    Args:
        path: the folder (``config.json`` + safetensors) or a Hub id such as ``openai/whisper-tiny`` (``@rev`` ok).
        revision: the Hub revision.
        dtype: the parameter dtype (None: float32).
        allow_pickle: accept ``pytorch_model.bin`` weights when there are no safetensors (needs torch).
        config: use this configuration instead of the checkpoint's (its shapes must match).

    Returns:
        The model.

    Raises:
        ValueError: if ``config.json`` is not a Whisper configuration, or a parameter's shape differs (named).
        KeyError: if a parameter is missing (named).
    """
    directory = resolve_checkpoint(path, revision=revision, allow_pickle=allow_pickle, key="load_whisper_pretrained")
    hf_config = _read_json(directory / CONFIG_NAME)
    if hf_config.get("model_type") != "whisper":
        raise ValueError(
            f"load_whisper_pretrained: {directory / CONFIG_NAME} has model_type {hf_config.get('model_type')!r}, "
            "expected 'whisper'"
        )
    cfg = config if config is not None else WhisperConfig.from_hf_config(hf_config)
    state = _read_weights(directory, allow_pickle=allow_pickle, key="load_whisper_pretrained")
    target = jnp.float32 if dtype is None else dtype
    template = jax.eval_shape(lambda: cfg.build(key=jax.random.key(0)))
    model = template.from_hf_state_dict({k: np.asarray(v) for k, v in state.items()})
    return jax.tree_util.tree_map(
        lambda x: jnp.asarray(x, target) if jnp.issubdtype(x.dtype, jnp.floating) else x, model
    )


def save_whisper_pretrained(
    model: WhisperModel, path: str | os.PathLike[str], *, max_shard_size: int = 5 * 1024**3
) -> None:
    """Write ``model`` as a folder ``transformers.WhisperForConditionalGeneration.from_pretrained`` loads.

    Args:
        model: the model.
        path: the output folder (created if needed).
        max_shard_size: the largest safetensors file in bytes.
    """
    from safetensors.numpy import save_file

    if max_shard_size <= 0:
        raise ValueError(f"save_whisper_pretrained: max_shard_size must be positive, got {max_shard_size}")
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: np.ascontiguousarray(v) for k, v in model.to_hf_state_dict().items()}
    state.pop("proj_out.weight")  # tied to model.decoder.embed_tokens.weight; transformers re-ties it
    hf_config = model.config.to_hf_config()
    hf_config["dtype"] = str(state["model.decoder.embed_tokens.weight"].dtype)
    (directory / CONFIG_NAME).write_text(json.dumps(hf_config, indent=2, sort_keys=True), encoding="utf-8")
    shards = _shards(state, max_shard_size)
    if len(shards) == 1:
        save_file(shards[0], os.fspath(directory / WEIGHTS_NAME), metadata={"format": "pt"})
    else:
        weight_map: dict[str, str] = {}
        for i, shard in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, os.fspath(directory / name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, name))
        index = {"metadata": {"total_size": int(sum(v.nbytes for v in state.values()))}, "weight_map": weight_map}
        (directory / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True), encoding="utf-8")
    logger.info("save_whisper_pretrained: wrote %d tensors to %s", len(state), directory)
