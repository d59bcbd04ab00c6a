"""``load_pretrained`` / ``save_pretrained``: Hugging Face checkpoint directories (local, or Hub ids via ``_hub``)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ponente.namedtensor import Axis

from ..config import LmConfig, config_for_type
from ..lm import LmHeadModel
from ._hub import missing_weights_error, resolve_checkpoint

if TYPE_CHECKING:
    from ..whisper import WhisperModel

logger = logging.getLogger(__name__)

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
PICKLE_WEIGHTS_NAME = "pytorch_model.bin"
PICKLE_INDEX_NAME = "pytorch_model.bin.index.json"
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


def _read_json(path: Path) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        data: dict[str, Any] = json.load(f)
    return data


def _shard_files(directory: Path, single: str, index_name: str, key: str) -> list[Path] | None:
    """The weight files of ``directory``: the shards its index lists, or the single file; None if neither."""
    index = directory / index_name
    if index.is_file():
        weight_map: dict[str, str] = _read_json(index)["weight_map"]
        shards = [directory / shard for shard in sorted(set(weight_map.values()))]
        for shard_path in shards:
            if not shard_path.is_file():
                raise FileNotFoundError(f"{key}: shard {shard_path} listed in {index} does not exist")
        return shards
    return [directory / single] if (directory / single).is_file() else None


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
        from ..whisper import WhisperConfig
        from ._whisper import load_whisper_pretrained  # (that module imports this one)

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
    from ..whisper import WhisperModel

    if isinstance(model, WhisperModel):
        from ._whisper import whisper_state_and_config  # (that module imports this one)

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
