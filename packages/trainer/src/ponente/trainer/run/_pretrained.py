"""Pretrained weights of a run: the model config of a Hugging Face checkpoint, and its weights put in a state.

A checkpoint is a local folder or a Hub id (``org/name``, ``org/name@revision``), read from the local Hugging Face
cache first and downloaded only when missing (never with ``HF_HUB_OFFLINE=1``): see
:func:`ponente.models.hf.resolve_checkpoint`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ponente.models import LmConfig

__all__ = ["hf_model_config", "hf_vocab_size", "load_hf_weights", "replace_model"]


def hf_model_config(path: str, *, key: str = "initialize_from_hf") -> LmConfig:
    """The model config of a Hugging Face checkpoint (its ``config.json``), without loading the weights.

    Args:
        path: a local checkpoint folder or a hub id, optionally ``@revision`` (read from the local hub cache, else
            downloaded: only its ``config.json`` and tokenizer files).
        key: the config key that named ``path``, for the error message.

    Returns:
        The config (its ``seq_len`` is the checkpoint's ``max_position_embeddings`` or equivalent).

    Raises:
        FileNotFoundError: if ``path`` is neither a checkpoint folder nor a cached or reachable hub id.
        KeyError: if ``config.json`` has no known ``model_type`` (``UnsupportedModelError``, also a ``ValueError``;
            custom code in ``auto_map`` is never run).
        ValueError: if ``config.json`` has no ``vocab_size``.
    """
    return _hf_checkpoint(path, key)[0]


def hf_vocab_size(path: str, *, key: str = "initialize_from_hf") -> int:
    """The vocabulary size of a Hugging Face checkpoint: its ``config.json``'s ``vocab_size``.

    It may exceed its tokenizer's (Qwen2.5 pads 151,665 tokens to 151,936 rows); a run that starts from the
    checkpoint keeps the checkpoint's size.
    """
    return _hf_checkpoint(path, key)[1]


def _hf_checkpoint(path: str, key: str) -> tuple[LmConfig, int]:
    from ponente.models.hf import hf_config_class, resolve_checkpoint

    if Path(path).exists() and not (Path(path) / "config.json").is_file():
        raise FileNotFoundError(f"{key}: {path} has no config.json, so it is not a Hugging Face checkpoint")
    config_file = resolve_checkpoint(path, weights=False, key=key) / "config.json"
    hf_config = json.loads(config_file.read_text(encoding="utf-8"))
    if "vocab_size" not in hf_config:
        raise ValueError(f"{key}: {config_file} has no 'vocab_size'")
    config_class = hf_config_class(hf_config, config_file, key)
    return config_class.from_hf_config(hf_config), int(hf_config["vocab_size"])


def load_hf_weights(
    path: str, model_config: LmConfig, mp: Any, *, allow_pickle: bool = False, key: str = "initialize_from_hf"
) -> Any:
    """The model of a Hugging Face checkpoint, its vocabulary padded like ``model_config``'s, in ``mp``'s param dtype.

    Args:
        path: a local checkpoint folder or a hub id, optionally ``@revision``.
        model_config: the run's model config (its ``vocab_padding_multiple`` is used).
        mp: the run's ``jmp`` mixed-precision policy.
        allow_pickle: read ``pytorch_model*.bin`` weights (torch, ``weights_only=True``) when there are no
            safetensors (the config key ``allow_pickle``).
        key: the config key that named ``path``, for error messages.

    Raises:
        FileNotFoundError: if ``path`` is neither a checkpoint folder nor a cached or reachable hub id.
        ValueError: if the weights are only pickle files and ``allow_pickle`` is false (one line naming ``key``).
    """
    from ponente.models.hf import load_pretrained

    model = load_pretrained(
        path, pad_vocab_to_multiple=model_config.vocab_padding_multiple, allow_pickle=allow_pickle, key=key
    )
    return mp.cast_to_param(model)


def replace_model(state: Any, model: Any, *, what: str) -> Any:
    """``state`` with its model's arrays replaced by ``model``'s, placed as the state's are (same shardings).

    The state keeps its own model structure (configs, axes); only array values come from ``model``, so a
    training step compiled for ``state`` runs on the result without compiling again.

    Args:
        state: a :class:`~ponente.trainer.state.TrainerState` (e.g. from ``Trainer.initial_state``).
        model: a model with the same parameters (names aside) and shapes.
        what: the config key the weights came from, for the error message.

    Returns:
        The new state.

    Raises:
        ValueError: if the number of arrays or a shape differs (naming ``what`` and the first mismatch).
    """
    import equinox as eqx
    import jax
    import numpy as np

    template_leaves, treedef = jax.tree_util.tree_flatten_with_path(state.model)
    new_leaves = jax.tree_util.tree_leaves(model)
    if len(new_leaves) != len(template_leaves):
        raise ValueError(
            f"{what}: the checkpoint has {len(new_leaves)} arrays but the run's model has {len(template_leaves)}"
        )
    placed = []
    for (where, old), new in zip(template_leaves, new_leaves, strict=True):
        if not isinstance(old, jax.Array):
            placed.append(new)
            continue
        if tuple(new.shape) != tuple(old.shape):
            raise ValueError(
                f"{what}: {jax.tree_util.keystr(where)} has shape {tuple(new.shape)} in the checkpoint but "
                f"{tuple(old.shape)} in the run's model (check data.tokenizer / data.vocab_size and the model config)"
            )
        placed.append(jax.make_array_from_callback(old.shape, old.sharding, _slicer(np.asarray(new, dtype=old.dtype))))
    model = jax.tree_util.tree_unflatten(treedef, placed)
    return eqx.tree_at(lambda s: s.model, state, model)


def _slicer(host: Any) -> Any:
    """``index -> host[index]``: the callback that gives each device its shard of a host array."""

    def shard(index: Any) -> Any:
        return host[index]

    return shard
