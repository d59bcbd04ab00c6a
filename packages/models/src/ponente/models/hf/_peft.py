"""``save_peft_pretrained`` / ``load_peft_pretrained``: LoRA adapters in Hugging Face PEFT's format.

A PEFT adapter directory holds ``adapter_config.json`` (``peft_type: LORA``, the rank, ``lora_alpha``, the
target modules...) and ``adapter_model.safetensors``, whose keys are
``base_model.model.<module path>.lora_A.weight`` (``[r, in]``) and ``...lora_B.weight`` (``[out, r]``), the
module path being the one of the ``transformers`` model (``model.layers.3.self_attn.q_proj``).
``peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter_dir)`` loads it.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import numpy as np

from ponente.namedtensor.state_dict import from_torch_compatible_state_dict, to_torch_compatible_state_dict

from ..lm import LmHeadModel
from ..lora import LoraConfig, LoraLinear, LoraSite, adapters_only, has_lora, lora_sites, loraize

logger = logging.getLogger(__name__)

ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
_LORA_SUFFIXES = (".lora_A.weight", ".lora_B.weight")
# PEFT options that change what an adapter computes, and the value this implementation supports
_SUPPORTED = {
    "use_dora": False,
    "use_rslora": False,
    "bias": "none",
    "lora_bias": False,
    "use_qalora": False,
    "rank_pattern": {},
    "alpha_pattern": {},
    "modules_to_save": None,
    "layer_replication": None,
    "target_parameters": None,
}


def _lora_layers(model: Any) -> list[LoraLinear]:
    leaves = jax.tree_util.tree_leaves(model, is_leaf=lambda x: isinstance(x, LoraLinear))
    return [leaf for leaf in leaves if isinstance(leaf, LoraLinear)]


def _target_modules(adapted: list[LoraSite], every: list[LoraSite]) -> list[str] | str:
    """PEFT's ``target_modules``: the short names if they select exactly the adapted modules, else a regex."""
    chosen = {p for s in adapted for p in s.hf_paths}
    names = sorted({n for s in adapted for n in s.short_names})
    selected = {p for s in every for p in s.hf_paths if p.rsplit(".", 1)[-1] in names}
    if selected == chosen:
        return names
    return "^(?:" + "|".join(re.escape(p) for p in sorted(chosen)) + ")$"


def save_peft_pretrained(
    model: LmHeadModel,
    config: LoraConfig,
    path: str | os.PathLike[str],
    *,
    base_model_name_or_path: str | None = None,
) -> None:
    """Write the adapters of ``model`` as a PEFT LoRA adapter directory.

    ``adapter_config.json`` gets PEFT's fields (``peft_type: LORA``, ``task_type: CAUSAL_LM``, ``r``,
    ``lora_alpha``, ``lora_dropout``, ``target_modules`` as Hugging Face short names, or as a regular expression
    of the exact module paths when short names would select more, ``fan_in_fan_out`` for GPT-2's ``Conv1D``
    layers, ``bias: none``, ...); ``adapter_model.safetensors`` the adapter weights under PEFT's key names. Only
    the adapters are gathered to host memory, not the base weights.

    Args:
        model: an adapted model (see :func:`ponente.models.lora.loraize`).
        config: the LoRA settings the model was adapted with.
        path: the output directory (created if needed; existing files of the same names are overwritten).
        base_model_name_or_path: recorded in ``adapter_config.json`` (the base checkpoint's directory or Hub id).

    Raises:
        ValueError: if ``model`` has no adapters, or if its adapters' rank or scale differ from ``config``'s
            (``lora.r``, ``lora.alpha``).

    Example:
        ```python
        save_peft_pretrained(model, LoraConfig(r=8), "out/adapter", base_model_name_or_path="meta-llama/Llama-2-7b-hf")
        ```
    """
    from safetensors.numpy import save_file  # lazy: only needed for files

    if not has_lora(model):
        raise ValueError("save_peft_pretrained: the model has no LoRA adapters; call ponente.models.lora.loraize")
    for layer in _lora_layers(model):
        if layer.r != config.r:
            raise ValueError(f"lora.r: the model's adapters have rank {layer.r}, the config says {config.r}")
        if not np.isclose(layer.scale, config.scale):
            raise ValueError(
                f"lora.alpha: the model's adapters are scaled by {layer.scale} (alpha {layer.scale * layer.r}), "
                f"the config says alpha {config.alpha} (scale {config.scale})"
            )
    every = lora_sites(model)
    adapted = lora_sites(model, adapted=True)
    state = to_torch_compatible_state_dict(adapters_only(model))
    tensors = {PEFT_PREFIX + k: np.ascontiguousarray(v) for k, v in state.items()}
    transposed: tuple[str, ...] = getattr(type(model), "_hf_transposed_suffixes", ())
    fan_in_fan_out = bool(transposed) and all(f"{p}.weight".endswith(transposed) for s in adapted for p in s.hf_paths)
    adapter_config: dict[str, Any] = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "revision": None,
        "inference_mode": True,
        "r": config.r,
        "lora_alpha": config.alpha,
        "lora_dropout": config.dropout,
        "target_modules": _target_modules(adapted, every),
        "exclude_modules": None,
        "fan_in_fan_out": fan_in_fan_out,
        "init_lora_weights": True,
        "layers_to_transform": None,
        "layers_pattern": None,
        **_SUPPORTED,
    }
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ADAPTER_CONFIG_NAME, "w", encoding="utf-8") as f:
        json.dump(adapter_config, f, indent=2, sort_keys=True)
    save_file(tensors, os.fspath(directory / ADAPTER_WEIGHTS_NAME), metadata={"format": "pt"})
    logger.info("save_peft_pretrained: wrote %d adapter tensors to %s", len(tensors), directory)


def _read_adapter_config(directory: Path) -> dict[str, Any]:
    config_path = directory / ADAPTER_CONFIG_NAME
    if not config_path.is_file():
        raise FileNotFoundError(f"load_peft_pretrained: {config_path} does not exist")
    with open(config_path, encoding="utf-8") as f:
        data: dict[str, Any] = json.load(f)
    if data.get("peft_type") != "LORA":
        raise ValueError(f"load_peft_pretrained: {config_path} has peft_type {data.get('peft_type')!r}, not 'LORA'")
    for key, supported in _SUPPORTED.items():
        value = data.get(key, supported)
        if value != supported and not (supported in (None, {}) and not value):
            raise ValueError(f"load_peft_pretrained: {config_path} sets {key}={value!r}, which is not supported")
    return data


def load_peft_pretrained(model: LmHeadModel, path: str | os.PathLike[str]) -> LmHeadModel:
    """``model`` adapted with the PEFT LoRA adapter in ``path`` (the inverse of :func:`save_peft_pretrained`).

    The adapted layers are those the weights file has adapters for (``adapter_config.json`` gives the rank,
    ``lora_alpha`` and ``lora_dropout``). The adapter weights take the model's dtype.

    Args:
        model: the base model (without adapters), e.g. from :func:`ponente.models.hf.load_pretrained`.
        path: the adapter directory.

    Returns:
        The adapted model.

    Raises:
        FileNotFoundError: if ``adapter_config.json`` or ``adapter_model.safetensors`` is missing.
        ValueError: if the adapter is not a plain LoRA adapter (DoRA, rank patterns, ...), has keys that are not
            LoRA weights, or does not fit the model (a module it names is not a linear layer of the model, or it
            adapts only some layers of a stack).
        KeyError: if a weight is missing from the file.

    Example:
        ```python
        model = load_peft_pretrained(load_pretrained("meta-llama/Llama-2-7b-hf"), "out/adapter")
        ```
    """
    from safetensors.numpy import load_file  # lazy: only needed for files

    directory = Path(path)
    data = _read_adapter_config(directory)
    weights_path = directory / ADAPTER_WEIGHTS_NAME
    if not weights_path.is_file():
        raise FileNotFoundError(f"load_peft_pretrained: {weights_path} does not exist")
    tensors = load_file(os.fspath(weights_path))
    state: dict[str, np.ndarray] = {}
    modules: set[str] = set()
    for key, value in tensors.items():
        if not key.startswith(PEFT_PREFIX) or not key.endswith(_LORA_SUFFIXES):
            raise ValueError(f"load_peft_pretrained: {weights_path} holds {key!r}, which is not a LoRA weight")
        name = key[len(PEFT_PREFIX) :]
        state[name] = value
        modules.add(name.rsplit(".", 2)[0])
    if not modules:
        raise ValueError(f"load_peft_pretrained: {weights_path} holds no LoRA weights")
    config = LoraConfig(
        r=int(data["r"]),
        alpha=float(data.get("lora_alpha", data["r"])),
        dropout=float(data.get("lora_dropout") or 0.0),
        target_modules="^(?:" + "|".join(re.escape(m) for m in sorted(modules)) + ")$",
    )
    known = {p for s in lora_sites(model) for p in s.hf_paths}
    unknown = sorted(modules - known)
    if unknown:
        raise ValueError(
            f"load_peft_pretrained: {weights_path} has adapters for {unknown[:4]}, which are not linear layers of "
            f"this {type(model).__name__}"
        )
    adapted = loraize(model, config, key=jax.random.key(0))
    loaded = from_torch_compatible_state_dict(adapters_only(adapted), state)
    logger.info("load_peft_pretrained: %d adapter tensors from %s", len(state), directory)
    return eqx.combine(loaded, adapted)
