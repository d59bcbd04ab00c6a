"""Gemma 2: Gemma with logit soft-capping, alternating sliding-window/global layers and sandwich norms."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from ._layer_types import FULL, SLIDING, check_layer_types
from .attention.backends import check_soft_cap_backend
from .config import _require, register_config
from .decoder import NormPlacement
from .gemma import GemmaConfig, GemmaLayout
from .rotary import RotaryConfig

__all__ = ["Gemma2Config"]


@register_config("gemma2")
@dataclasses.dataclass(frozen=True)
class Gemma2Config(GemmaConfig):
    """Gemma 2 (Hugging Face ``Gemma2ForCausalLM``); it builds a :class:`~ponente.models.GemmaLMHeadModel`.

    On top of :class:`~ponente.models.GemmaConfig`: attention and output logits are soft-capped
    (``cap * tanh(logits / cap)``), layers alternate between a sliding window and global attention
    (``layer_types``, by default sliding, global, sliding, ...), attention and MLP outputs are normalized
    too (``post_attention_layernorm``, ``pre_feedforward_layernorm``, ``post_feedforward_layernorm``), and
    attention logits are scaled by ``query_pre_attn_scalar ** -0.5``.

    Attributes:
        query_pre_attn_scalar: the attention logits are multiplied by its inverse square root (None: the head size).
        sliding_window: how many keys (the query's own included) a sliding layer sees (None: no window).
        layer_types: per layer ``"sliding_attention"`` or ``"full_attention"`` (None: from ``sliding_window_pattern``).
        sliding_window_pattern: without ``layer_types``, every ``sliding_window_pattern``-th layer is global, the
            others are sliding (layer ``i`` is global when ``(i + 1) % sliding_window_pattern == 0``).
        attn_logit_softcapping: the attention logit cap (None: none); needs a backend that soft-caps (``"auto"``,
            ``"reference"``, or ``"pallas"`` on TPU).
        final_logit_softcapping: the output logit cap (None: none). With it, the blockwise loss is unavailable.

    Example:
        >>> import jax, ponente.namedtensor as hax
        >>> cfg = Gemma2Config(
        ...     seq_len=8,
        ...     hidden_dim=16,
        ...     intermediate_dim=32,
        ...     num_layers=2,
        ...     num_heads=4,
        ...     num_kv_heads=2,
        ...     head_dim=8,
        ...     sliding_window=4,
        ... )
        >>> cfg.layout().layer_types
        ('sliding_attention', 'full_attention')
        >>> model = cfg.build(hax.Axis("vocab", 11), key=jax.random.key(0))
        >>> model(hax.zeros({"position": 8}, dtype=int)).shape
        {'position': 8, 'vocab': 11}
    """

    hf_architecture: ClassVar[str] = "Gemma2ForCausalLM"
    hf_model_type: ClassVar[str] = "gemma2"
    hf_activation_key: ClassVar[str] = "hidden_activation"
    norm_placement: ClassVar[NormPlacement] = "sandwich"

    query_pre_attn_scalar: int | None = None
    sliding_window: int | None = 4096
    layer_types: tuple[str, ...] | None = None
    sliding_window_pattern: int = 2
    attn_logit_softcapping: float | None = 50.0
    final_logit_softcapping: float | None = 30.0

    def __post_init__(self) -> None:
        super().__post_init__()
        name = type(self).__name__
        if self.layer_types is not None:
            check_layer_types(self.layer_types, self.num_layers, name)
        if self.sliding_window_pattern < 1:
            raise ValueError(f"{name}: sliding_window_pattern must be at least 1, got {self.sliding_window_pattern}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"{name}: sliding_window must be at least 1 (or None), got {self.sliding_window}")
        for cap_name in ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar"):
            value = getattr(self, cap_name)
            if value is not None and not value > 0:
                raise ValueError(f"{name}: {cap_name} must be positive (or None), got {value}")
        if self.attn_logit_softcapping is not None:
            check_soft_cap_backend(self.attn_backend, f"{name}: attn_logit_softcapping={self.attn_logit_softcapping}")

    def resolved_layer_types(self) -> tuple[str, ...]:
        """``layer_types``, or the pattern ``sliding_window_pattern`` describes.

        Returns:
            One ``"sliding_attention"`` or ``"full_attention"`` per layer.
        """
        if self.layer_types is not None:
            return tuple(self.layer_types)
        return tuple(FULL if (i + 1) % self.sliding_window_pattern == 0 else SLIDING for i in range(self.num_layers))

    def _local_rope(self) -> RotaryConfig:
        """The rotary settings of sliding layers (Gemma 2: the same as global layers)."""
        return self.rope

    def layout(self) -> GemmaLayout:
        """The per-block settings (see :meth:`GemmaConfig.layout`)."""
        scalar = self.query_pre_attn_scalar if self.query_pre_attn_scalar is not None else self.HeadSize.size
        return GemmaLayout(
            layer_types=self.resolved_layer_types(),
            rope=self.rope,
            local_rope=self._local_rope(),
            sliding_window=self.sliding_window,
            scaling=float(scalar) ** -0.5,
            attn_logit_softcapping=self.attn_logit_softcapping,
            final_logit_softcapping=self.final_logit_softcapping,
            sandwich_norms=self.norm_placement == "sandwich",
            qk_norm=False,
        )

    def to_hf_config(self, vocab_size: int) -> dict[str, Any]:
        """The Hugging Face config dict, transformers-5 spelling (see :meth:`LmConfig.to_hf_config`).

        ``sliding_window=None`` is written as ``seq_len`` (transformers needs a number; for sequences of at
        most ``seq_len`` positions it is the same).
        """
        out = super().to_hf_config(vocab_size)
        out.update(
            query_pre_attn_scalar=self.query_pre_attn_scalar or self.HeadSize.size,
            # transformers' Gemma 2 needs a window: `seq_len` keys is the same as none for sequences that fit
            sliding_window=self.sliding_window if self.sliding_window is not None else self.seq_len,
            layer_types=list(self.resolved_layer_types()),
            attn_logit_softcapping=self.attn_logit_softcapping,
            final_logit_softcapping=self.final_logit_softcapping,
        )
        return out

    @classmethod
    def _hf_layering(cls, hf_config: Mapping[str, Any], default_pattern: int) -> dict[str, Any]:
        """The window, layer types, scaling and caps of a Hugging Face Gemma 2/3 config dict."""
        where = f"{cls.__name__}.from_hf_config"
        num_layers = int(_require(hf_config, "num_hidden_layers", where))
        layer_types = hf_config.get("layer_types")
        if layer_types is None:
            # transformers-4 spelling (Gemma 3: an int pattern; Gemma 2: even layers slide)
            pattern = int(hf_config.get("sliding_window_pattern") or default_pattern)
            layer_types = [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers)]
        types: tuple[str, ...] | None = tuple(str(t) for t in layer_types)
        default = tuple(FULL if (i + 1) % default_pattern == 0 else SLIDING for i in range(num_layers))
        if types == default:
            types = None  # the default, kept implicit so configs compare equal
        window = hf_config.get("sliding_window")
        return {
            "query_pre_attn_scalar": int(hf_config.get("query_pre_attn_scalar", 256)),
            "sliding_window": int(window) if window is not None else None,
            "layer_types": types,
            "final_logit_softcapping": _optional_float(hf_config.get("final_logit_softcapping")),
        }

    @classmethod
    def from_hf_config(cls, hf_config: Mapping[str, Any]) -> Gemma2Config:
        """Read a Hugging Face Gemma 2 config dict, transformers-4 or -5 spelling (see ``LmConfig.from_hf_config``).

        Raises:
            KeyError: if a required key is missing.
            ValueError: for options this implementation does not support.
        """
        return cls(
            rope=RotaryConfig.from_hf(hf_config),
            attn_logit_softcapping=_optional_float(hf_config.get("attn_logit_softcapping")),
            **cls._hf_layering(hf_config, default_pattern=2),
            **cls._hf_common(hf_config),
        )


def _optional_float(value: Any) -> float | None:
    return float(value) if value is not None else None
