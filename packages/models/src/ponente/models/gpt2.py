"""GPT-2: learned position embeddings, pre-LayerNorm blocks, fused QKV, GELU (tanh) MLP, tied output embedding."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp

import ponente.namedtensor as hax
from ponente.namedtensor import Axis, NamedArray
from ponente.namedtensor.nn import Embedding, LayerNorm, Linear, Stacked

from .attention import AttentionMask, dot_product_attention
from .config import LmConfig, _require, register_config
from .lm import LmHeadModel

__all__ = ["Gpt2Config", "Gpt2LMHeadModel"]


@register_config("gpt2")
@dataclasses.dataclass(frozen=True)
class Gpt2Config(LmConfig):
    """GPT-2 (Hugging Face ``GPT2LMHeadModel``).

    Attributes:
        layer_norm_epsilon: LayerNorm epsilon.
        initializer_range: standard deviation of the embedding initialization.

    Example:
        >>> import jax, ponente.namedtensor as hax
        >>> cfg = Gpt2Config(seq_len=8, hidden_dim=16, intermediate_dim=64, num_layers=2, num_heads=2, num_kv_heads=2)
        >>> model = cfg.build(hax.Axis("vocab", 11), key=jax.random.key(0))
        >>> model(hax.zeros({"position": 8}, dtype=int)).shape
        {'position': 8, 'vocab': 11}
    """

    glu_mlp: ClassVar[bool] = False  # GPT-2's MLP is two matrices with a GELU between them

    layer_norm_epsilon: float = 1e-5
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_kv_heads != self.num_heads:
            raise ValueError(
                f"Gpt2Config: GPT-2 has no grouped-query attention; num_kv_heads ({self.num_kv_heads}) must equal "
                f"num_heads ({self.num_heads})"
            )

    def build(self, Vocab: Axis, *, key: jax.Array) -> Gpt2LMHeadModel:
        """Build a randomly initialized GPT-2 (see :meth:`LmConfig.build`)."""
        return Gpt2LMHeadModel.init(self, Vocab, key=key)

    def to_hf_config(self, vocab_size: int) -> dict[str, Any]:
        """The Hugging Face ``GPT2Config`` dict (see :meth:`LmConfig.to_hf_config`)."""
        return {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "vocab_size": vocab_size,
            "n_positions": self.seq_len,
            "n_embd": self.hidden_dim,
            "n_layer": self.num_layers,
            "n_head": self.num_heads,
            "n_inner": self.intermediate_dim,
            "activation_function": "gelu_new",
            "layer_norm_epsilon": self.layer_norm_epsilon,
            "initializer_range": self.initializer_range,
            "tie_word_embeddings": True,
            "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False,
        }

    @classmethod
    def from_hf_config(cls, hf_config: Mapping[str, Any]) -> Gpt2Config:
        """Read a Hugging Face ``GPT2Config`` dict (see :meth:`LmConfig.from_hf_config`).

        Raises:
            KeyError: if a required key is missing.
            ValueError: for options this implementation does not support.
        """
        where = "Gpt2Config.from_hf_config"
        act = hf_config.get("activation_function", "gelu_new")
        if act not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(f"{where}: activation_function {act!r} is not supported (expected 'gelu_new')")
        if hf_config.get("scale_attn_by_inverse_layer_idx") or hf_config.get("reorder_and_upcast_attn"):
            raise ValueError(f"{where}: scale_attn_by_inverse_layer_idx/reorder_and_upcast_attn are not supported yet")
        hidden = int(_require(hf_config, "n_embd", where))
        heads = int(_require(hf_config, "n_head", where))
        inner = hf_config.get("n_inner")
        return cls(
            seq_len=int(_require(hf_config, "n_positions", where)),
            hidden_dim=hidden,
            intermediate_dim=int(inner) if inner is not None else 4 * hidden,
            num_layers=int(_require(hf_config, "n_layer", where)),
            num_heads=heads,
            num_kv_heads=heads,
            layer_norm_epsilon=float(hf_config.get("layer_norm_epsilon", 1e-5)),
            initializer_range=float(hf_config.get("initializer_range", 0.02)),
        )


class Gpt2Attention(eqx.Module):
    """Causal self-attention with a fused ``c_attn`` (Q, K, V) projection and ``c_proj`` output projection."""

    c_attn: Linear
    c_proj: Linear

    @staticmethod
    def init(config: Gpt2Config, *, key: jax.Array) -> Gpt2Attention:
        """Create the projections."""
        k1, k2 = jax.random.split(key)
        Qkv = Axis("qkv", 3)
        return Gpt2Attention(
            c_attn=Linear.init(config.Embed, (Qkv, config.Heads, config.HeadSize), key=k1),
            c_proj=Linear.init((config.Heads, config.HeadSize), config.Embed, key=k2),
        )

    def __call__(self, x: NamedArray, mask: AttentionMask | NamedArray | None) -> NamedArray:
        """Attend over ``position``; ``x`` is ``(..., position, embed)``."""
        Pos = x.resolve_axis("position")
        qkv = self.c_attn(x)
        HeadSize = qkv.resolve_axis("head_size")
        q, k, v = (qkv["qkv", i] for i in range(3))
        return self.c_proj(dot_product_attention(Pos, HeadSize, q, k, v, mask))


class Gpt2Mlp(eqx.Module):
    """``c_proj(gelu_tanh(c_fc(x)))``."""

    c_fc: Linear
    c_proj: Linear

    def __call__(self, x: NamedArray) -> NamedArray:
        """Apply the MLP to ``(..., embed)``."""
        return self.c_proj(hax.nn.gelu(self.c_fc(x), approximate=True))


class Gpt2Block(eqx.Module):
    """A pre-LayerNorm transformer block: ``x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))``."""

    ln_1: LayerNorm
    attn: Gpt2Attention
    ln_2: LayerNorm
    mlp: Gpt2Mlp

    @staticmethod
    def init(config: Gpt2Config, *, key: jax.Array) -> Gpt2Block:
        """Create one block."""
        k_attn, k_fc, k_proj = jax.random.split(key, 3)
        eps = config.layer_norm_epsilon
        return Gpt2Block(
            ln_1=LayerNorm.init(config.Embed, eps=eps),
            attn=Gpt2Attention.init(config, key=k_attn),
            ln_2=LayerNorm.init(config.Embed, eps=eps),
            mlp=Gpt2Mlp(
                Linear.init(config.Embed, config.Mlp, key=k_fc), Linear.init(config.Mlp, config.Embed, key=k_proj)
            ),
        )

    def __call__(self, x: NamedArray, mask: AttentionMask | NamedArray | None) -> NamedArray:
        """Apply the block to ``(..., position, embed)``."""
        x = x + self.attn(self.ln_1(x), mask)
        return x + self.mlp(self.ln_2(x))


class Gpt2Transformer(eqx.Module):
    """Token and position embeddings, the stacked blocks and the final LayerNorm (HF ``transformer``)."""

    wte: Embedding
    wpe: Embedding
    h: Stacked[Gpt2Block]
    ln_f: LayerNorm


class Gpt2LMHeadModel(LmHeadModel):
    """GPT-2 with the output projection tied to the token embedding.

    Attributes:
        transformer: the embeddings, blocks and final norm.
        config: the config (static).
    """

    transformer: Gpt2Transformer
    config: Gpt2Config = eqx.field(static=True)

    _hf_transposed_suffixes: ClassVar[tuple[str, ...]] = ("c_attn.weight", "c_proj.weight", "c_fc.weight")

    @staticmethod
    def init(config: Gpt2Config, Vocab: Axis, *, key: jax.Array) -> Gpt2LMHeadModel:
        """Create a randomly initialized model.

        Args:
            config: the config.
            Vocab: the vocabulary axis.
            key: the PRNG key.

        Returns:
            The model.
        """
        k_wte, k_wpe, k_blocks = jax.random.split(key, 3)
        std = config.initializer_range
        blocks = Stacked.init(config.Layers, Gpt2Block, gradient_checkpointing=config.gradient_checkpointing)(
            config, key=jax.random.split(k_blocks, config.num_layers)
        )
        transformer = Gpt2Transformer(
            wte=Embedding.init(Vocab, config.Embed, key=k_wte, initializer_range=std),
            wpe=Embedding.init(Axis("n_positions", config.seq_len), config.Embed, key=k_wpe, initializer_range=std),
            h=blocks,
            ln_f=LayerNorm.init(config.Embed, eps=config.layer_norm_epsilon),
        )
        return Gpt2LMHeadModel(transformer=transformer, config=config)

    @property
    def Vocab(self) -> Axis:
        """The vocabulary axis."""
        return self.transformer.wte.Vocab

    def __call__(
        self,
        input_ids: NamedArray,
        attn_mask: AttentionMask | NamedArray | None = None,
        *,
        key: jax.Array | None = None,
    ) -> NamedArray:
        """Logits ``(..., position, vocab)`` for ``input_ids`` ``(..., position)`` (see :class:`LmHeadModel`).

        Raises:
            ValueError: if the sequence is longer than ``config.seq_len``.
        """
        del key
        Pos = input_ids.resolve_axis("position")
        if Pos.size > self.config.seq_len:
            raise ValueError(
                f"Gpt2LMHeadModel: the 'position' axis has size {Pos.size}, more than seq_len={self.config.seq_len}"
            )
        mask = AttentionMask.causal() if attn_mask is None else attn_mask
        positions = hax.arange(Pos, dtype=jnp.int32)
        x = self.transformer.wte.embed(input_ids) + self.transformer.wpe.embed(positions)
        x = self.transformer.h.fold(x, mask)
        x = self.transformer.ln_f(x)
        return self.transformer.wte.unembed(x)
