"""Gemma 3 (text): Gemma 2's block with QK-norm, local/global rotary bases and a 5:1 sliding:global pattern."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any, ClassVar

from .config import register_config
from .gemma import GemmaLayout
from .gemma2 import Gemma2Config
from .rotary import RotaryConfig

__all__ = ["Gemma3Config"]

logger = logging.getLogger(__name__)

_GLOBAL_THETA = 1_000_000.0
_LOCAL_THETA = 10_000.0


@register_config("gemma3", aliases=("gemma3_text",))
@dataclasses.dataclass(frozen=True)
class Gemma3Config(Gemma2Config):
    """Gemma 3 text model (Hugging Face ``Gemma3ForCausalLM``, ``model_type: gemma3_text``).

    It builds a :class:`~ponente.models.GemmaLMHeadModel`. On top of :class:`Gemma2Config`: queries
    and keys are RMS-normalized over ``head_size`` (``q_norm``, ``k_norm``, ``(1 + w)`` scales) before
    rotary; sliding layers use ``rope_local`` (base 10 000) and global layers ``rope`` (base 1 000 000,
    optionally scaled, e.g. linear factor 8 for the 128K-context models); by default five sliding layers
    alternate with one global layer; there is no soft-capping by default.

    transformers' Gemma 3 ignores ``attn_logit_softcapping``, so a config that sets it is read with the
    cap dropped (logged) and this config cannot export one (``to_hf_config`` raises).

    Attributes:
        rope_local: the rotary settings of sliding layers (``rope_parameters["sliding_attention"]``, or
            ``rope_local_base_freq`` in the transformers-4 spelling).

    Example:
        >>> import jax, ponente.namedtensor as hax
        >>> cfg = Gemma3Config(
        ...     seq_len=8,
        ...     hidden_dim=16,
        ...     intermediate_dim=32,
        ...     num_layers=7,
        ...     num_heads=4,
        ...     num_kv_heads=2,
        ...     head_dim=8,
        ...     sliding_window=4,
        ... )
        >>> [t[0] for t in cfg.layout().layer_types]  # s: sliding, f: full
        ['s', 's', 's', 's', 's', 'f', 's']
        >>> model = cfg.build(hax.Axis("vocab", 11), key=jax.random.key(0))
        >>> model(hax.zeros({"position": 8}, dtype=int)).shape
        {'position': 8, 'vocab': 11}
    """

    hf_architecture: ClassVar[str] = "Gemma3ForCausalLM"
    hf_model_type: ClassVar[str] = "gemma3_text"

    rope: RotaryConfig = dataclasses.field(default_factory=lambda: RotaryConfig(theta=_GLOBAL_THETA))
    rope_local: RotaryConfig = dataclasses.field(default_factory=lambda: RotaryConfig(theta=_LOCAL_THETA))
    sliding_window_pattern: int = 6
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None

    def _local_rope(self) -> RotaryConfig:
        return self.rope_local

    def layout(self) -> GemmaLayout:
        """The per-block settings (see :meth:`GemmaConfig.layout`): Gemma 2's, with QK-norm."""
        return dataclasses.replace(super().layout(), qk_norm=True)

    def _hf_rope(self) -> dict[str, Any]:
        return {"full_attention": self.rope.to_hf(), "sliding_attention": self.rope_local.to_hf()}

    def to_hf_config(self, vocab_size: int) -> dict[str, Any]:
        """The Hugging Face ``Gemma3TextConfig`` dict, transformers-5 spelling (see :meth:`LmConfig.to_hf_config`).

        Raises:
            ValueError: if ``attn_logit_softcapping`` is set (transformers' Gemma 3 would ignore it).
        """
        if self.attn_logit_softcapping is not None:
            raise ValueError(
                f"Gemma3Config.to_hf_config: attn_logit_softcapping={self.attn_logit_softcapping} cannot be exported: "
                "transformers' Gemma 3 ignores it, so the exported model would compute different logits"
            )
        return super().to_hf_config(vocab_size)

    @classmethod
    def from_hf_config(cls, hf_config: Mapping[str, Any]) -> Gemma3Config:
        """Read a Hugging Face ``Gemma3TextConfig`` dict, transformers-4 or -5 spelling.

        transformers 5 keeps one ``rope_parameters`` entry per layer type (``full_attention``,
        ``sliding_attention``); transformers 4 has ``rope_theta`` + ``rope_scaling`` (global layers),
        ``rope_local_base_freq`` (sliding layers) and an integer ``sliding_window_pattern``.

        Raises:
            KeyError: if a required key is missing.
            ValueError: for options this implementation does not support.
        """
        where = "Gemma3Config.from_hf_config"
        params = hf_config.get("rope_parameters")
        if isinstance(params, Mapping) and ("full_attention" in params or "sliding_attention" in params):
            full = dict(params.get("full_attention") or {})
            local = dict(params.get("sliding_attention") or {})
        else:
            full = dict(params or hf_config.get("rope_scaling") or {})
            full.setdefault("rope_theta", hf_config.get("rope_theta", _GLOBAL_THETA))
            local = {"rope_type": "default", "rope_theta": hf_config.get("rope_local_base_freq", _LOCAL_THETA)}
        full.setdefault("rope_theta", _GLOBAL_THETA)
        local.setdefault("rope_theta", _LOCAL_THETA)
        max_pos = hf_config.get("max_position_embeddings")
        cap = hf_config.get("attn_logit_softcapping")
        if cap is not None:
            logger.warning(
                "%s: ignoring attn_logit_softcapping=%s, as transformers' Gemma 3 does (it never applies it)",
                where,
                cap,
            )
        return cls(
            rope=RotaryConfig.from_hf({"rope_parameters": full, "max_position_embeddings": max_pos}),
            rope_local=RotaryConfig.from_hf({"rope_parameters": local, "max_position_embeddings": max_pos}),
            attn_logit_softcapping=None,
            **cls._hf_layering(hf_config, default_pattern=6),
            **cls._hf_common(hf_config),
        )
