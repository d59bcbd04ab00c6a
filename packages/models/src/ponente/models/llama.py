"""Llama 1/2/3: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU MLP, tied or untied output."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import equinox as eqx
import jax

import ponente.namedtensor as hax
from ponente.namedtensor import Axis, NamedArray
from ponente.namedtensor.nn import Embedding, Linear, RmsNorm, Stacked

from .attention import Attention, AttentionMask
from .config import LmConfig, _require, register_config
from .lm import LmHeadModel
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

    def build(self, Vocab: Axis, *, key: jax.Array) -> LlamaLMHeadModel:
        """Build a randomly initialized Llama (see :meth:`LmConfig.build`)."""
        return LlamaLMHeadModel.init(self, Vocab, key=key)

    def to_hf_config(self, vocab_size: int) -> dict[str, Any]:
        """The Hugging Face ``LlamaConfig`` dict, transformers-5 spelling (see :meth:`LmConfig.to_hf_config`)."""
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


class LlamaMlp(eqx.Module):
    """SwiGLU: ``down_proj(silu(gate_proj(x)) * up_proj(x))``."""

    gate_proj: Linear
    up_proj: Linear
    down_proj: Linear

    def __call__(self, x: NamedArray) -> NamedArray:
        """Apply the MLP to ``(..., embed)``."""
        return self.down_proj(hax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(eqx.Module):
    """A pre-RMSNorm block: ``x + self_attn(input_layernorm(x))`` then ``x + mlp(post_attention_layernorm(x))``."""

    input_layernorm: RmsNorm
    self_attn: Attention
    post_attention_layernorm: RmsNorm
    mlp: LlamaMlp

    @staticmethod
    def init(config: LlamaConfig, *, key: jax.Array) -> LlamaDecoderLayer:
        """Create one block."""
        k_attn, k_gate, k_up, k_down = jax.random.split(key, 4)
        Embed, Mlp, eps = config.Embed, config.Mlp, config.layer_norm_epsilon
        return LlamaDecoderLayer(
            input_layernorm=RmsNorm.init(Embed, eps=eps, use_bias=False),
            self_attn=Attention.init(
                Embed,
                config.KVHeads,
                config.QHeadsPerGroup,
                config.HeadSize,
                use_bias=False,
                rotary=config.rope,
                key=k_attn,
            ),
            post_attention_layernorm=RmsNorm.init(Embed, eps=eps, use_bias=False),
            mlp=LlamaMlp(
                Linear.init(Embed, Mlp, key=k_gate, use_bias=False),
                Linear.init(Embed, Mlp, key=k_up, use_bias=False),
                Linear.init(Mlp, Embed, key=k_down, use_bias=False),
            ),
        )

    def __call__(self, x: NamedArray, mask: AttentionMask | NamedArray | None) -> NamedArray:
        """Apply the block to ``(..., position, embed)``."""
        x = x + self.self_attn(self.input_layernorm(x), mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaTransformer(eqx.Module):
    """Token embedding, stacked decoder layers and the final norm (HF ``model``)."""

    embed_tokens: Embedding
    layers: Stacked[LlamaDecoderLayer]
    norm: RmsNorm


class LlamaLMHeadModel(LmHeadModel):
    """Llama with an untied ``lm_head`` or the output tied to the token embedding.

    Attributes:
        transformer: embeddings, layers and final norm (state-dict key ``model``).
        lm_head: ``Embed -> Vocab`` without bias, or None when tied.
        config: the config (static).
    """

    transformer: LlamaTransformer
    lm_head: Linear | None
    config: LlamaConfig = eqx.field(static=True)

    def _state_dict_key_map(self) -> dict[str, str | None]:
        return {"transformer": "model"}

    @staticmethod
    def init(config: LlamaConfig, Vocab: Axis, *, key: jax.Array) -> LlamaLMHeadModel:
        """Create a randomly initialized model.

        Args:
            config: the config.
            Vocab: the vocabulary axis.
            key: the PRNG key.

        Returns:
            The model.
        """
        k_emb, k_layers, k_head = jax.random.split(key, 3)
        layers = Stacked.init(config.Layers, LlamaDecoderLayer, gradient_checkpointing=config.gradient_checkpointing)(
            config, key=jax.random.split(k_layers, config.num_layers)
        )
        transformer = LlamaTransformer(
            embed_tokens=Embedding.init(Vocab, config.Embed, key=k_emb, initializer_range=config.initializer_range),
            layers=layers,
            norm=RmsNorm.init(config.Embed, eps=config.layer_norm_epsilon, use_bias=False),
        )
        lm_head = None if config.tie_word_embeddings else Linear.init(config.Embed, Vocab, key=k_head, use_bias=False)
        return LlamaLMHeadModel(transformer=transformer, lm_head=lm_head, config=config)

    @property
    def Vocab(self) -> Axis:
        """The vocabulary axis."""
        return self.transformer.embed_tokens.Vocab

    def __call__(
        self,
        input_ids: NamedArray,
        attn_mask: AttentionMask | NamedArray | None = None,
        *,
        key: jax.Array | None = None,
    ) -> NamedArray:
        """Logits ``(..., position, vocab)`` for ``input_ids`` ``(..., position)`` (see :class:`LmHeadModel`)."""
        del key
        mask = AttentionMask.causal() if attn_mask is None else attn_mask
        x = self.transformer.embed_tokens.embed(input_ids)
        x = self.transformer.layers.fold(x, mask)
        x = self.transformer.norm(x)
        if self.lm_head is None:
            return self.transformer.embed_tokens.unembed(x)
        return self.lm_head(x)
