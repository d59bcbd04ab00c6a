"""Whisper checkpoints in Hugging Face's format (``WhisperForConditionalGeneration``): read and write."""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..whisper import WhisperConfig, WhisperModel
from ._files import CONFIG_NAME, _read_json, _read_weights, write_checkpoint
from ._hub import resolve_checkpoint

__all__ = ["load_whisper_pretrained", "save_whisper_pretrained"]


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

    Every tensor is written as the model holds it, the encoder's position table included, so a checkpoint read
    by :func:`load_whisper_pretrained` and written again is the same bit for bit.

    Args:
        model: the model.
        path: the output folder (created if needed).
        max_shard_size: the largest safetensors file in bytes.
    """
    state, hf_config = whisper_state_and_config(model)
    write_checkpoint(path, state, hf_config, max_shard_size=max_shard_size, key="save_whisper_pretrained")


def whisper_state_and_config(model: WhisperModel) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The tensors (under Hugging Face's names) and the ``config.json`` of a Whisper checkpoint of ``model``."""
    state = model.to_hf_state_dict()
    state.pop("proj_out.weight")  # tied to model.decoder.embed_tokens.weight; transformers re-ties it
    return state, model.config.to_hf_config()
