"""Mistral: Llama whose causal attention only looks back over a sliding window of positions."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar, cast

import jax

from ponente.namedtensor import Axis

from .config import register_config
from .llama import LlamaConfig, LlamaLMHeadModel

__all__ = ["MistralConfig", "MistralLMHeadModel"]


@register_config("mistral")
@dataclasses.dataclass(frozen=True)
class MistralConfig(LlamaConfig):
    """Mistral (Hugging Face ``MistralForCausalLM``): a Llama whose every layer attends over a sliding window.

    All :class:`~ponente.models.LlamaConfig` fields apply (RMSNorm, rotary, grouped-query attention,
    SwiGLU, tied or untied output); ``qk_norm`` must stay False to export to Hugging Face.

    Attributes:
        sliding_window: each query sees itself and the ``sliding_window - 1`` positions before it
            (Hugging Face's ``sliding_window``); None is full causal attention (Mistral v0.2 and later).

    Example:
        >>> import jax, ponente.namedtensor as hax
        >>> cfg = MistralConfig(
        ...     seq_len=8,
        ...     hidden_dim=16,
        ...     intermediate_dim=32,
        ...     num_layers=2,
        ...     num_heads=4,
        ...     num_kv_heads=2,
        ...     sliding_window=3,
        ... )
        >>> model = cfg.build(hax.Axis("vocab", 11), key=jax.random.key(0))
        >>> model(hax.zeros({"position": 8}, dtype=int)).shape
        {'position': 8, 'vocab': 11}
    """

    sliding_window: int | None = 4096

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(
                f"{type(self).__name__}: sliding_window must be at least 1 (or None for full attention), "
                f"got {self.sliding_window}"
            )

    def attention_windows(self) -> tuple[int | None, ...]:
        """Every layer attends over ``sliding_window`` (see :meth:`LmConfig.attention_windows`)."""
        return (self.sliding_window,) * self.num_layers

    def build(self, Vocab: Axis, *, key: jax.Array) -> MistralLMHeadModel:
        """Build a randomly initialized Mistral (see :meth:`LmConfig.build`)."""
        return MistralLMHeadModel.init(self, Vocab, key=key)

    _hf_qk_norm: ClassVar[bool] = False
    """Whether the Hugging Face architecture has a QK-norm (``qk_norm`` must equal it to export)."""

    def _llama_hf_config(self, vocab_size: int) -> dict[str, Any]:
        """Llama's ``config.json`` keys; a ValueError if ``qk_norm`` differs from the Hugging Face architecture."""
        if self.qk_norm != self._hf_qk_norm:
            has = "always has" if self._hf_qk_norm else "has no"
            raise ValueError(
                f"{type(self).__name__}.to_hf_config: qk_norm={self.qk_norm} cannot be exported, Hugging Face "
                f"{self.model_type} {has} QK-norm"
            )
        return LlamaConfig.to_hf_config(dataclasses.replace(self, qk_norm=False), vocab_size)

    def to_hf_config(self, vocab_size: int) -> dict[str, Any]:
        """The Hugging Face ``MistralConfig`` dict, transformers-5 spelling (see :meth:`LmConfig.to_hf_config`).

        Raises:
            ValueError: if ``qk_norm`` is set (transformers' Mistral has no QK-norm).
        """
        hf = self._llama_hf_config(vocab_size)
        del hf["attention_bias"], hf["mlp_bias"]  # keys of Llama only
        hf.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=self.sliding_window)
        return hf

    @classmethod
    def from_hf_config(cls, hf_config: Mapping[str, Any]) -> MistralConfig:
        """Read a Hugging Face ``MistralConfig`` dict (transformers-4 or -5 spelling).

        A missing ``sliding_window`` key means transformers' default, 4096; ``null`` means full attention.

        Raises:
            KeyError: if a required key is missing.
            ValueError: for options this implementation does not support (e.g. ``hidden_act`` other than silu).
        """
        config = cast(MistralConfig, super().from_hf_config(hf_config))
        window = hf_config.get("sliding_window", 4096)
        return dataclasses.replace(config, sliding_window=int(window) if window is not None else None)


class MistralLMHeadModel(LlamaLMHeadModel):
    """Mistral: :class:`~ponente.models.LlamaLMHeadModel` whose layers attend over the config's sliding window.

    The parameters, their Hugging Face names and the blocks are Llama's; only the attention mask differs (the
    decoder reads the window from ``config.attention_windows()``). A mask passed by the caller (segment ids, an
    explicit boolean mask) is intersected with the window, never replaced.
    """
