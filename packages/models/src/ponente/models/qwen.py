"""Qwen2: Llama with biases on the query, key and value projections and an optional sliding window."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, cast

import equinox as eqx
import jax

import ponente.namedtensor as hax
from ponente.namedtensor import Axis
from ponente.namedtensor.nn import Linear

from .attention import Attention
from .config import register_config
from .llama import LlamaConfig, LlamaDecoderLayer, QkNormAttention
from .mistral import MistralConfig, MistralLMHeadModel

__all__ = ["QwenConfig", "QwenLMHeadModel"]

_SLIDING, _FULL = "sliding_attention", "full_attention"
_HF_MAX_WINDOW_LAYERS = 28  # transformers' default ``max_window_layers`` of Qwen2 and Qwen3
_HF_SLIDING_WINDOW = 4096  # transformers' default ``sliding_window`` of Qwen2 and Qwen3


def _qwen_window_to_hf(sliding_window: int | None, num_layers: int) -> dict[str, Any]:
    """The Qwen2/Qwen3 ``config.json`` keys saying that all layers (or none) attend over ``sliding_window``."""
    sliding = sliding_window is not None
    return {
        "use_sliding_window": sliding,
        "sliding_window": sliding_window,
        "max_window_layers": 0 if sliding else num_layers,
        "layer_types": [_SLIDING if sliding else _FULL] * num_layers,
    }


def _qwen_window_from_hf(hf_config: Mapping[str, Any], num_layers: int, where: str) -> int | None:
    """The sliding window shared by all layers of a Qwen2/Qwen3 ``config.json`` (None: full attention everywhere).

    Transformers slides layer ``i`` when ``use_sliding_window`` is set and ``layer_types[i]`` is
    ``sliding_attention`` (by default, when ``i >= max_window_layers``).

    Raises:
        ValueError: if only some layers slide (not supported: one stacked scan shares one mask), or for an unknown
            layer type.
    """
    if not hf_config.get("use_sliding_window", False):
        return None
    window = hf_config.get("sliding_window", _HF_SLIDING_WINDOW)
    if window is None:
        return None
    types: Sequence[str] | None = hf_config.get("layer_types")
    if types is None:
        first_sliding = int(hf_config.get("max_window_layers", _HF_MAX_WINDOW_LAYERS))
        types = [_SLIDING if i >= first_sliding else _FULL for i in range(num_layers)]
    unknown = sorted(set(types) - {_SLIDING, _FULL})
    if unknown:
        raise ValueError(f"{where}: unknown layer_types {unknown}; expected {_SLIDING!r} or {_FULL!r}")
    sliding = [i for i, t in enumerate(types) if t == _SLIDING]
    if not sliding:
        return None
    if len(sliding) != len(types):
        raise ValueError(
            f"{where}: only layers {sliding} of {len(types)} use the sliding window ({window}); ponente supports a "
            "window on all layers or on none (set max_window_layers to 0 or to num_hidden_layers)"
        )
    return int(window)


def _with_zero_biases(attn: Attention | QkNormAttention, projections: Sequence[str]) -> Attention | QkNormAttention:
    """``attn`` with zero biases (as Hugging Face initializes them) on the named projections (e.g. ``"q_proj"``)."""
    inner = attn.attn if isinstance(attn, QkNormAttention) else attn
    linears: list[Linear] = [getattr(inner, name) for name in projections]
    biased = [dataclasses.replace(lin, bias=hax.zeros(lin.Out, dtype=lin.weight.dtype)) for lin in linears]
    inner = eqx.tree_at(lambda a: [getattr(a, name) for name in projections], inner, biased)
    return dataclasses.replace(attn, attn=inner) if isinstance(attn, QkNormAttention) else inner


@register_config("qwen", aliases=("qwen2",))
@dataclasses.dataclass(frozen=True)
class QwenConfig(MistralConfig):
    """Qwen2 (Hugging Face ``Qwen2ForCausalLM``, ``model_type: qwen2``): Llama plus query/key/value biases.

    All :class:`~ponente.models.LlamaConfig` fields apply; the query, key and value projections have
    biases (the output projection has none), as in every Qwen2 and Qwen2.5 checkpoint.

    Attributes:
        sliding_window: None (the default, as in released Qwen2 checkpoints) for full causal attention, or
            a window applied to every layer (Hugging Face ``use_sliding_window`` with ``max_window_layers: 0``).

    Example:
        >>> import jax, ponente.namedtensor as hax
        >>> cfg = QwenConfig(seq_len=8, hidden_dim=16, intermediate_dim=32, num_layers=2, num_heads=4, num_kv_heads=2)
        >>> model = cfg.build(hax.Axis("vocab", 11), key=jax.random.key(0))
        >>> model.to_hf_state_dict()["model.layers.0.self_attn.k_proj.bias"].shape
        (8,)
    """

    sliding_window: int | None = None

    def build(self, Vocab: Axis, *, key: jax.Array) -> QwenLMHeadModel:
        """Build a randomly initialized Qwen2 (see :meth:`LmConfig.build`)."""
        return QwenLMHeadModel.init(self, Vocab, key=key)

    def to_hf_config(self, vocab_size: int) -> dict[str, Any]:
        """The Hugging Face ``Qwen2Config`` dict, transformers-5 spelling (see :meth:`LmConfig.to_hf_config`).

        Raises:
            ValueError: if ``qk_norm`` is set (transformers' Qwen2 has no QK-norm).
        """
        hf = self._llama_hf_config(vocab_size)
        del hf["attention_bias"], hf["mlp_bias"]  # keys of Llama only (Qwen2's biases are fixed)
        hf.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2")
        hf.update(_qwen_window_to_hf(self.sliding_window, self.num_layers))
        return hf

    @classmethod
    def from_hf_config(cls, hf_config: Mapping[str, Any]) -> QwenConfig:
        """Read a Hugging Face ``Qwen2Config`` dict (transformers-4 or -5 spelling).

        Raises:
            KeyError: if a required key is missing.
            ValueError: for unsupported options, e.g. a sliding window on only some layers.
        """
        config = cast(QwenConfig, super().from_hf_config(hf_config))
        window = _qwen_window_from_hf(hf_config, config.num_layers, f"{cls.__name__}.from_hf_config")
        return dataclasses.replace(config, sliding_window=window)


class QwenDecoderLayer(LlamaDecoderLayer):
    """A Llama block whose query, key and value projections have biases (Qwen2)."""

    @staticmethod
    def _init_attention(config: LlamaConfig, *, key: jax.Array) -> Attention | QkNormAttention:
        return _with_zero_biases(LlamaDecoderLayer._init_attention(config, key=key), ("q_proj", "k_proj", "v_proj"))


class QwenLMHeadModel(MistralLMHeadModel):
    """Qwen2: :class:`~ponente.models.MistralLMHeadModel` (Llama + optional sliding window) with Q/K/V biases.

    Its Hugging Face parameter names are Llama's plus ``model.layers.L.self_attn.{q,k,v}_proj.bias``.
    """

    _decoder_layer: ClassVar[type[LlamaDecoderLayer]] = QwenDecoderLayer
