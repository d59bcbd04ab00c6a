"""Llama 1/2/3: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU MLP, tied or untied output."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import jax

from ponente.namedtensor import Axis
from ponente.namedtensor.nn import RmsNorm

from .attention import Attention
from .config import LmConfig, _require, register_config
from .decoder import DecoderLM, GatedMlp, Norm, NormPlacement, QkNormAttention, grouped_attention
from .moe import MoeMlp
from .rotary import RotaryConfig

__all__ = ["LlamaConfig", "LlamaLMHeadModel"]


@register_config("llama")
@dataclasses.dataclass(frozen=True)
class LlamaConfig(LmConfig):
    """Llama (Hugging Face ``LlamaForCausalLM``), covering Llama 1, 2 and 3.

    Attributes:
        rope: rotary settings (``rope_theta`` and scaling).
        layer_norm_epsilon: RMSNorm epsilon (``rms_norm_eps``).
        tie_word_embeddings: share the output projection with the token embedding.
        initializer_range: standard deviation of the embedding initialization.
        qk_norm: RMS-normalize queries and keys over ``head_size`` (learned scale, no bias) after the
            projections and before the rotary embedding, as Qwen3 and OLMo2 do. Hugging Face Llama has no
            QK-norm, so such a config cannot be exported as ``model_type: llama``.

    Example:
        >>> import jax, ponente.namedtensor as hax
        >>> cfg = LlamaConfig(seq_len=8, hidden_dim=16, intermediate_dim=32, num_layers=2, num_heads=4, num_kv_heads=2)
        >>> model = cfg.build(hax.Axis("vocab", 11), key=jax.random.key(0))
        >>> model(hax.zeros({"position": 8}, dtype=int)).shape
        {'position': 8, 'vocab': 11}
    """

    rope: RotaryConfig = dataclasses.field(default_factory=RotaryConfig)
    layer_norm_epsilon: float = 1e-6
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    qk_norm: bool = False

    norm_placement: ClassVar[NormPlacement] = "pre"
    """Where the blocks' norms sit (see :class:`~ponente.models.decoder.DecoderBlock`)."""
    feed_forward_keys: ClassVar[int] = 3
    """How many PRNG keys :meth:`init_feed_forward` takes."""

    def build(self, Vocab: Axis, *, key: jax.Array) -> LlamaLMHeadModel:
        """Build a randomly initialized Llama (see :meth:`LmConfig.build`)."""
        return LlamaLMHeadModel.init(self, Vocab, key=key)

    def sliding_layers(self) -> tuple[bool, ...]:
        """Per layer, whether it attends over a sliding window (has a window in :meth:`attention_windows`)."""
        return tuple(w is not None for w in self.attention_windows())

    def init_norm(self, axis: Axis) -> Norm:
        """A block's (and the final) normalization over ``axis``: RMSNorm with a learned scale, no bias."""
        return RmsNorm.init(axis, eps=self.layer_norm_epsilon, use_bias=False)

    def init_attention(self, *, key: jax.Array) -> Attention | QkNormAttention:
        """One block's self-attention: no biases, rotary, a per-head QK-norm if ``qk_norm`` (families override)."""
        attn = grouped_attention(self, self.rope, key=key)
        return QkNormAttention.init(attn, eps=self.layer_norm_epsilon) if self.qk_norm else attn

    def init_feed_forward(self, keys: jax.Array) -> GatedMlp | MoeMlp:
        """The feed-forward network of one block, from :attr:`feed_forward_keys` keys: SwiGLU (families override)."""
        return GatedMlp.init(self.Embed, self.Mlp, keys)

    def to_hf_config(self, vocab_size: int) -> dict[str, Any]:
        """The Hugging Face ``LlamaConfig`` dict, transformers-5 spelling (see :meth:`LmConfig.to_hf_config`).

        Raises:
            ValueError: if ``qk_norm`` is set (transformers' Llama would silently ignore the norm weights).
        """
        if self.qk_norm:
            raise ValueError(
                "LlamaConfig.to_hf_config: qk_norm=True has no Hugging Face Llama equivalent (transformers' Llama "
                "has no QK-norm); export it through an architecture that has one (e.g. a Qwen3 config)"
            )
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": vocab_size,
            "max_position_embeddings": self.seq_len,
            "hidden_size": self.hidden_dim,
            "intermediate_size": self.intermediate_dim,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.HeadSize.size,
            "hidden_act": "silu",
            "rms_norm_eps": self.layer_norm_epsilon,
            "rope_parameters": self.rope.to_hf(),
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": False,
            "mlp_bias": False,
            "initializer_range": self.initializer_range,
        }

    @classmethod
    def from_hf_config(cls, hf_config: Mapping[str, Any]) -> LlamaConfig:
        """Read a Hugging Face ``LlamaConfig`` dict, transformers-4 or -5 spelling (see ``LmConfig.from_hf_config``).

        Raises:
            KeyError: if a required key is missing.
            ValueError: for options this implementation does not support.
        """
        where = "LlamaConfig.from_hf_config"
        act = hf_config.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{where}: hidden_act {act!r} is not supported (expected 'silu')")
        for flag in ("attention_bias", "mlp_bias"):
            if hf_config.get(flag):
                raise ValueError(f"{where}: {flag}=true is not supported yet")
        heads = int(_require(hf_config, "num_attention_heads", where))
        hidden = int(_require(hf_config, "hidden_size", where))
        head_dim = hf_config.get("head_dim")
        if head_dim is not None and int(head_dim) * heads == hidden:
            head_dim = None  # the default, kept implicit so configs compare equal
        return cls(
            seq_len=int(_require(hf_config, "max_position_embeddings", where)),
            hidden_dim=hidden,
            intermediate_dim=int(_require(hf_config, "intermediate_size", where)),
            num_layers=int(_require(hf_config, "num_hidden_layers", where)),
            num_heads=heads,
            num_kv_heads=int(hf_config.get("num_key_value_heads") or heads),
            head_dim=int(head_dim) if head_dim is not None else None,
            rope=RotaryConfig.from_hf(hf_config),
            layer_norm_epsilon=float(hf_config.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
            initializer_range=float(hf_config.get("initializer_range", 0.02)),
        )


class LlamaLMHeadModel(DecoderLM):
    """Llama: the shared :class:`~ponente.models.decoder.DecoderLM` with pre-RMSNorm SwiGLU blocks.

    Its Hugging Face parameter names are ``model.embed_tokens``, ``model.layers.L.{input_layernorm,
    self_attn.{q,k,v,o}_proj, post_attention_layernorm, mlp.{gate,up,down}_proj}``, ``model.norm`` and
    ``lm_head`` (absent when tied); with ``qk_norm``, also ``self_attn.{q,k}_norm``.
    """
