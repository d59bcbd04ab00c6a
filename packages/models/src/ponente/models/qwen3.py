"""Qwen3: Llama with a QK-norm (RMSNorm over each head of the queries and keys), an explicit head size and optional
attention biases."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar, cast

import jax

from ponente.namedtensor import Axis

from ._layer_types import SLIDING
from .attention import Attention
from .config import register_config
from .decoder import QkNormAttention
from .mistral import MistralConfig
from .qwen import (
    QwenLMHeadModel,
    _check_qwen_layer_types,
    _qwen_layer_types,
    _qwen_window_from_hf,
    _qwen_window_to_hf,
    _with_zero_biases,
)

__all__ = ["Qwen3Config", "Qwen3LMHeadModel"]

_HF_HEAD_DIM = 128  # transformers' default ``head_dim`` of Qwen3


@register_config("qwen3")
@dataclasses.dataclass(frozen=True)
class Qwen3Config(MistralConfig):
    """Qwen3 (Hugging Face ``Qwen3ForCausalLM``): Llama with QK-norm and optional attention biases.

    All :class:`~ponente.models.LlamaConfig` fields apply. Queries and keys are RMS-normalized over
    ``head_size`` (one learned scale per norm, shared by the heads) after their projections and before
    the rotary embedding (:class:`~ponente.models.QkNormAttention`). Qwen3 checkpoints set ``head_dim``
    independently of ``hidden_dim / num_heads`` (e.g. 128).

    Attributes:
        qk_norm: must stay True to export to Hugging Face (every Qwen3 has a QK-norm).
        attention_bias: biases on the query, key, value and output projections (Hugging Face
            ``attention_bias``; False in released checkpoints).
        sliding_window: how many keys (the query's own included) a sliding layer sees; None (the default) for
            full causal attention everywhere.
        layer_types: per layer ``"sliding_attention"`` or ``"full_attention"`` (Hugging Face ``layer_types``);
            None: every layer slides when ``sliding_window`` is set.

    Example:
        >>> import jax, ponente.namedtensor as hax
        >>> cfg = Qwen3Config(
        ...     seq_len=8, hidden_dim=16, intermediate_dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8
        ... )
        >>> model = cfg.build(hax.Axis("vocab", 11), key=jax.random.key(0))
        >>> model.to_hf_state_dict()["model.layers.0.self_attn.q_norm.weight"].shape
        (8,)
    """

    qk_norm: bool = True
    attention_bias: bool = False
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None

    _hf_qk_norm: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_qwen_layer_types(self.layer_types, self.sliding_window, self.num_layers, type(self).__name__)

    def resolved_layer_types(self) -> tuple[str, ...]:
        """``layer_types``, or every layer ``"sliding_attention"`` (with a window) or ``"full_attention"``.

        Returns:
            One entry per layer.
        """
        return _qwen_layer_types(self.num_layers, self.sliding_window, self.layer_types)

    def attention_windows(self) -> tuple[int | None, ...]:
        """``sliding_window`` for the sliding layers, None for the others (see :meth:`LmConfig.attention_windows`)."""
        return tuple(self.sliding_window if t == SLIDING else None for t in self.resolved_layer_types())

    def build(self, Vocab: Axis, *, key: jax.Array) -> Qwen3LMHeadModel:
        """Build a randomly initialized Qwen3 (see :meth:`LmConfig.build`)."""
        return Qwen3LMHeadModel.init(self, Vocab, key=key)

    def init_attention(self, *, key: jax.Array) -> Attention | QkNormAttention:
        """Llama's attention (QK-norm on), with zero biases on all four projections if ``attention_bias``."""
        attn = super().init_attention(key=key)
        if self.attention_bias:
            return _with_zero_biases(attn, ("q_proj", "k_proj", "v_proj", "o_proj"))
        return attn

    def to_hf_config(self, vocab_size: int) -> dict[str, Any]:
        """The Hugging Face ``Qwen3Config`` dict, transformers-5 spelling (see :meth:`LmConfig.to_hf_config`).

        Raises:
            ValueError: if ``qk_norm`` is False (transformers' Qwen3 always has a QK-norm).
        """
        hf = self._llama_hf_config(vocab_size)
        del hf["mlp_bias"]  # a key of Llama only
        hf.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3", attention_bias=self.attention_bias)
        hf.update(_qwen_window_to_hf(self.sliding_window, self.layer_types, self.num_layers))
        return hf

    @classmethod
    def from_hf_config(cls, hf_config: Mapping[str, Any]) -> Qwen3Config:
        """Read a Hugging Face ``Qwen3Config`` dict (transformers-4 or -5 spelling).

        A missing ``head_dim`` means transformers' default, 128. ``layer_types`` takes precedence over
        ``max_window_layers``, as for :meth:`QwenConfig.from_hf_config`.

        Raises:
            KeyError: if a required key is missing.
            ValueError: for unsupported options, or a ``layer_types`` of the wrong length, with an unknown entry,
                or with sliding layers but no window.
        """
        # Llama's reader rejects attention biases, which Qwen3 supports: hand it the rest
        llama_keys = {**hf_config, "attention_bias": False, "head_dim": hf_config.get("head_dim", _HF_HEAD_DIM)}
        config = cast(Qwen3Config, super().from_hf_config(llama_keys))
        window, types = _qwen_window_from_hf(hf_config, config.num_layers, f"{cls.__name__}.from_hf_config")
        bias = bool(hf_config.get("attention_bias", False))
        return dataclasses.replace(config, sliding_window=window, layer_types=types, attention_bias=bias)


class Qwen3LMHeadModel(QwenLMHeadModel):
    """Qwen3: :class:`~ponente.models.QwenLMHeadModel` (a sliding window on all or some layers) with QK-norm.

    Its Hugging Face parameter names are Llama's plus ``model.layers.L.self_attn.{q,k}_norm.weight``
    (and ``{q,k,v,o}_proj.bias`` with ``attention_bias``).
    """
