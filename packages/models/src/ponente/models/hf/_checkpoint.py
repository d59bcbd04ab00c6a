"""``load_pretrained`` / ``save_pretrained``: Hugging Face checkpoint directories (local, or Hub ids via ``_hub``)."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from ponente.namedtensor import Axis

from ..config import LmConfig, config_for_type
from ..lm import LmHeadModel
from ..whisper import WhisperConfig, WhisperModel
from ._files import CONFIG_NAME, _read_json, _read_weights, write_checkpoint
from ._hub import resolve_checkpoint
from ._whisper import load_whisper_pretrained, whisper_state_and_config

logger = logging.getLogger(__name__)

_DTYPE_KEYS = ("dtype", "torch_dtype")  # transformers 5 spelling first, then transformers 4


class UnsupportedModelError(KeyError, ValueError):
    """A ``config.json`` whose ``model_type`` Ponente does not implement (or that has none).

    A ``KeyError`` (an unknown registry key) and a ``ValueError`` (a bad input file); its message is one line.
    """

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def hf_config_class(hf_config: Mapping[str, Any], where: Path, key: str = "load_pretrained") -> type[LmConfig]:
    """The Ponente config class of a ``config.json``, from its ``model_type`` alone.

    Its ``auto_map`` (custom modelling code of the repository) is ignored and never run: a checkpoint with custom
    code loads only when its ``model_type`` is an architecture Ponente implements.

    Raises:
        UnsupportedModelError: if ``model_type`` is missing or not a registered architecture.
    """
    model_type = hf_config.get("model_type")
    if model_type is None:
        raise UnsupportedModelError(f"{key}: {where} has no 'model_type' key, so the architecture is unknown")
    try:
        return config_for_type(str(model_type))
    except KeyError as e:
        custom = " (its auto_map names custom code, which Ponente never runs)" if "auto_map" in hf_config else ""
        raise UnsupportedModelError(f"{key}: {where} has model_type {model_type!r}{custom}: {e.args[0]}") from None


def _config_from_hf(hf_config: Mapping[str, Any], where: Path, key: str = "load_pretrained") -> LmConfig:
    return hf_config_class(hf_config, where, key).from_hf_config(hf_config)


def _resolve_dtype(dtype: Any, hf_config: Mapping[str, Any]) -> Any:
    if dtype is not None:
        return jnp.dtype(dtype)
    for key in _DTYPE_KEYS:
        if hf_config.get(key):
            return jnp.dtype(str(hf_config[key]).removeprefix("torch."))
    return jnp.dtype(jnp.float32)


def _vocab_keys(model: LmHeadModel) -> tuple[str, ...]:
    """The Hugging Face names of the parameters whose first dimension is the vocabulary (e.g. embeddings)."""
    keys: tuple[str, ...] = getattr(type(model), "_hf_vocab_keys", ())
    return keys


def _pad_vocab(state: dict[str, Any], keys: tuple[str, ...], real: int, padded: int) -> dict[str, Any]:
    """Zero rows appended to the vocabulary (first) dimension of ``keys`` present in ``state``."""
    out = dict(state)
    for name in keys:
        if name in out and padded > real:
            value = out[name]
            pad = jnp.zeros((padded - real, *value.shape[1:]), dtype=value.dtype)
            out[name] = jnp.concatenate([jnp.asarray(value), pad], axis=0)
    return out


def load_pretrained(
    path: str | os.PathLike[str],
    *,
    dtype: Any = None,
    revision: str | None = None,
    pad_vocab_to_multiple: int = 1,
    config_overrides: Mapping[str, Any] | None = None,
    allow_pickle: bool = False,
    key: str = "load_pretrained",
) -> LmHeadModel | WhisperModel:
    """Load a Hugging Face checkpoint (a local directory or a Hub repository id) into a ponente model.

    The architecture comes from ``config.json``'s ``model_type``: a causal LM through the config registry, or
    Whisper (``"whisper"``: a :class:`~ponente.models.whisper.WhisperModel`, as :func:`load_whisper_pretrained`
    loads it). Both the transformers-4 (``rope_theta``, ``rope_scaling``, ``torch_dtype``) and -5
    (``rope_parameters``, ``dtype``) spellings are read. Weights come from ``model.safetensors`` or from the shards
    listed in ``model.safetensors.index.json``.

    A ``path`` that is not a local directory is taken as a Hub id (``"org/name"``, optionally ``"org/name@rev"``)
    and read from the local Hugging Face cache, or else downloaded (config, safetensors and tokenizer files only;
    see :func:`resolve_checkpoint`). Offline (``HF_HUB_OFFLINE=1``) with an id that is not cached, without
    ``huggingface_hub``, or when the download fails, the one-line error names the repository and what to do.

    Only safetensors are read unless ``allow_pickle``: then a checkpoint with only ``pytorch_model*.bin`` is read
    with ``torch.load(weights_only=True)``. Custom modelling code (``auto_map``) is never run: the architecture
    comes from ``model_type`` alone.

    Args:
        path: a local checkpoint directory or a Hub repository id.
        dtype: parameter dtype (None: the config's ``dtype``/``torch_dtype``, else float32).
        revision: the Hub revision (branch, tag or commit) to use (None: the one after ``@`` in ``path``, else the
            default branch).
        pad_vocab_to_multiple: pad the vocabulary axis to a multiple of this (padded embedding / output rows are
            zeros and their logits are masked); :func:`save_pretrained` drops the padding again. Not for Whisper.
        config_overrides: fields of the model config to replace after reading ``config.json`` (e.g.
            ``{"attn_backend": "flash", "gradient_checkpointing": True}``).
        allow_pickle: read ``pytorch_model*.bin`` weights (with torch, ``weights_only=True``) when the checkpoint
            has no safetensors.
        key: the config key (or function) that named ``path``, at the start of error messages.

    Returns:
        The model.

    Raises:
        FileNotFoundError: if ``path`` is neither a local directory nor a downloadable Hub id, or files are missing
            (:class:`HubUnavailableError`, a subclass, for a Hub id not cached and not downloadable).
        PickleCheckpointError: (a ``ValueError``) if the weights are only pickle files and ``allow_pickle`` is false.
        ImportError: if a Hub id needs ``huggingface_hub``, or pickle weights need torch, and it is not installed.
        KeyError: for an unknown ``model_type`` (:class:`UnsupportedModelError`) or a missing parameter.
        ValueError: if a parameter has the wrong shape, an override names no config field, or a Whisper checkpoint
            is given ``pad_vocab_to_multiple``.

    Example:
        ```python
        model = load_pretrained("checkpoints/llama-tiny", pad_vocab_to_multiple=128)
        ```
    """
    # a local folder's weights are checked when they are read, after its config.json
    local = Path(path).is_dir()
    directory = resolve_checkpoint(path, revision=revision, allow_pickle=allow_pickle, weights=not local, key=key)
    config_path = directory / CONFIG_NAME
    hf_config = _read_json(config_path)
    target = _resolve_dtype(dtype, hf_config)
    if hf_config.get("model_type") == "whisper":  # an encoder-decoder: not in the registry of causal LMs
        if pad_vocab_to_multiple != 1:
            raise ValueError(f"{key}: {directory} is a Whisper checkpoint, whose vocabulary is not padded")
        whisper = _with_overrides(WhisperConfig.from_hf_config(hf_config), config_overrides or {}, key)
        return load_whisper_pretrained(directory, dtype=target, allow_pickle=allow_pickle, config=whisper)
    config = _config_from_hf(hf_config, config_path, key)
    overrides = {**(config_overrides or {}), "vocab_padding_multiple": pad_vocab_to_multiple}
    config = _with_overrides(config, overrides, key)
    if "vocab_size" not in hf_config:
        raise KeyError(f"{key}: {config_path} has no 'vocab_size' key")
    Vocab = Axis("vocab", int(hf_config["vocab_size"]))

    def template_fn(key: jax.Array) -> LmHeadModel:
        model = config.build(Vocab, key=key)
        return jax.tree_util.tree_map(
            lambda x: x.astype(target) if jnp.issubdtype(x.dtype, jnp.floating) else x, model
        )

    template = eqx.filter_eval_shape(template_fn, jax.random.key(0))
    state = _read_weights(directory, allow_pickle=allow_pickle, key=key)
    state = _pad_vocab(state, _vocab_keys(template), Vocab.size, template.Vocab.size)
    logger.info(
        "load_pretrained: %s (%s, %d tensors, dtype %s)", directory, hf_config["model_type"], len(state), target
    )
    return template.from_hf_state_dict(state)


def _with_overrides(config: Any, overrides: Mapping[str, Any], key: str) -> Any:
    """``config`` (a dataclass) with the fields of ``overrides`` replaced; an unknown field is a ``ValueError``."""
    unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(config)})
    if unknown:
        raise ValueError(f"{key}: config_overrides {unknown} are not fields of {type(config).__name__}")
    return dataclasses.replace(config, **overrides)


def save_pretrained(
    model: LmHeadModel | WhisperModel,
    path: str | os.PathLike[str],
    *,
    tokenizer: Any = None,
    max_shard_size: int = 5 * 1024**3,
    vocab_size: int | None = None,
) -> None:
    """Write ``model`` as a Hugging Face checkpoint directory that ``transformers`` loads.

    A causal LM loads with ``transformers.AutoModelForCausalLM``; a Whisper model (written as
    :func:`save_whisper_pretrained` writes it) with ``transformers.WhisperForConditionalGeneration``.

    Args:
        model: the model.
        path: the output directory (created if needed; existing files of the same names are overwritten).
        tokenizer: optional object with a ``save_pretrained(path)`` method (e.g. a transformers tokenizer).
        max_shard_size: the largest safetensors shard in bytes; larger checkpoints are sharded with an index file.
        vocab_size: the vocabulary size to export; rows of the embedding / output projection beyond it are dropped
            (None: the model's real vocabulary size, i.e. without ``vocab_padding_multiple`` padding). Not for
            Whisper.

    Raises:
        ValueError: if ``max_shard_size`` is not positive, ``vocab_size`` is not in ``1 .. model.Vocab.size`` (or
            given for Whisper), or the model still has LoRA adapters (merge them with
            ``ponente.models.lora.merge_lora``, or save them with ``save_peft_pretrained``).
    """
    from ..lora import has_lora

    if isinstance(model, WhisperModel):
        if vocab_size is not None:
            raise ValueError("save_pretrained: vocab_size is not for a Whisper model (its vocabulary is not padded)")
        state, hf_config = whisper_state_and_config(model)
        write_checkpoint(path, state, hf_config, max_shard_size=max_shard_size, tokenizer=tokenizer)
        return
    if has_lora(model):
        raise ValueError(
            "save_pretrained: the model has LoRA adapters, which a plain Hugging Face checkpoint cannot hold; "
            "merge them first (ponente.models.lora.merge_lora) or save them with save_peft_pretrained"
        )
    real = vocab_size if vocab_size is not None else getattr(model, "vocab_size", None) or model.Vocab.size
    if not 0 < real <= model.Vocab.size:
        raise ValueError(
            f"save_pretrained: vocab_size must be in 1..{model.Vocab.size} (the model's vocab axis), got {real}"
        )
    vocab_keys = _vocab_keys(model)
    state = {k: v[:real] if k in vocab_keys else v for k, v in model.to_hf_state_dict().items()}
    write_checkpoint(path, state, model.config.to_hf_config(real), max_shard_size=max_shard_size, tokenizer=tokenizer)
