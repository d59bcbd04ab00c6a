"""OLMo 2: Llama with post-norm blocks (norms on the attention and MLP outputs) and full-width QK-norm."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import equinox as eqx
import jax

from ponente.namedtensor import Axis, NamedArray
from ponente.namedtensor.nn import Linear, RmsNorm

from .attention import Attention, AttentionMask
from .attention.kv_cache import KvCache
from .config import register_config
from .llama import LlamaConfig, LlamaLMHeadModel, LlamaMlp, QkNormAttention

__all__ = ["Olmo2Config", "Olmo2LMHeadModel"]


@register_config("olmo2")
@dataclasses.dataclass(frozen=True)
class Olmo2Config(LlamaConfig):
    """OLMo 2 (Hugging Face ``Olmo2ForCausalLM``).

    Differs from Llama in two ways: each block is ``x + norm(attn(x))`` then ``x + norm(mlp(x))``
    (the norms act on the sub-layer *outputs*; inputs are not normalized), and queries and keys are
    RMS-normalized over the whole projection (all heads together, learned scale of size
    ``heads * head_size``) before the rotary embedding. Inherits the :class:`LlamaConfig` fields; its
    per-head ``qk_norm`` must stay False (OLMo 2's own QK-norm is always on).

    Attributes:
        attention_bias: whether the Q/K/V/O projections have biases.

    Example:
        >>> import jax, ponente.namedtensor as hax
        >>> cfg = Olmo2Config(seq_len=8, hidden_dim=16, intermediate_dim=32, num_layers=2, num_heads=4, num_kv_heads=2)
        >>> model = cfg.build(hax.Axis("vocab", 11), key=jax.random.key(0))
        >>> model(hax.zeros({"position": 8}, dtype=int)).shape
        {'position': 8, 'vocab': 11}
    """

    attention_bias: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.qk_norm:
            raise ValueError(
                "Olmo2Config: qk_norm=True (per-head QK-norm) is not applicable; OLMo 2 always normalizes the full "
                "query and key projections"
            )

    def build(self, Vocab: Axis, *, key: jax.Array) -> Olmo2LMHeadModel:
        """Build a randomly initialized OLMo 2 (see :meth:`LmConfig.build`)."""
        return Olmo2LMHeadModel.init(self, Vocab, key=key)

    def to_hf_config(self, vocab_size: int) -> dict[str, Any]:
        """The Hugging Face ``Olmo2Config`` dict, transformers-5 spelling (see :meth:`LmConfig.to_hf_config`)."""
        out = super().to_hf_config(vocab_size)
        del out["mlp_bias"]
        out.update(architectures=["Olmo2ForCausalLM"], model_type="olmo2", attention_bias=self.attention_bias)
        return out

    @classmethod
    def from_hf_config(cls, hf_config: Mapping[str, Any]) -> Olmo2Config:
        """Read a Hugging Face ``Olmo2Config`` dict, transformers-4 or -5 spelling.

        Raises:
            KeyError: if a required key is missing.
            ValueError: for options this implementation does not support.
        """
        base = LlamaConfig.from_hf_config({**hf_config, "attention_bias": False})
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(LlamaConfig)}
        return cls(**fields, attention_bias=bool(hf_config.get("attention_bias", False)))


class Olmo2DecoderLayer(eqx.Module):
    """A post-norm block: ``x + post_attention_layernorm(attn(x))``, ``x + post_feedforward_layernorm(mlp(x))``."""

    self_attn: QkNormAttention
    post_attention_layernorm: RmsNorm
    mlp: LlamaMlp
    post_feedforward_layernorm: RmsNorm

    @staticmethod
    def init(config: Olmo2Config, *, key: jax.Array) -> Olmo2DecoderLayer:
        """Create one block."""
        k_attn, k_gate, k_up, k_down = jax.random.split(key, 4)
        Embed, Mlp, eps = config.Embed, config.Mlp, config.layer_norm_epsilon
        attn = Attention.init(
            Embed,
            config.KVHeads,
            config.QHeadsPerGroup,
            config.HeadSize,
            use_bias=config.attention_bias,
            rotary=config.rope,
            key=k_attn,
            backend=config.attn_backend,
            block_size=config.flash_attention_block_size,
        )
        # QK-norm over the whole projection: the norms' axes are all of q's (k's) head axes
        self_attn = QkNormAttention(
            attn=attn,
            q_norm=RmsNorm.init((config.KVHeads, config.QHeadsPerGroup, config.HeadSize), eps=eps, use_bias=False),
            k_norm=RmsNorm.init((config.KVHeads, config.HeadSize), eps=eps, use_bias=False),
        )
        return Olmo2DecoderLayer(
            self_attn=self_attn,
            post_attention_layernorm=RmsNorm.init(Embed, eps=eps, use_bias=False),
            mlp=LlamaMlp(
                Linear.init(Embed, Mlp, key=k_gate, use_bias=False),
                Linear.init(Embed, Mlp, key=k_up, use_bias=False),
                Linear.init(Mlp, Embed, key=k_down, use_bias=False),
            ),
            post_feedforward_layernorm=RmsNorm.init(Embed, eps=eps, use_bias=False),
        )

    def __call__(
        self, x: NamedArray, mask: AttentionMask | NamedArray | None, *, pos_ids: NamedArray | None = None
    ) -> NamedArray:
        """Apply the block to ``(..., position, embed)`` (``pos_ids``: the rotary positions, None: ``0 .. n - 1``)."""
        x = x + self.post_attention_layernorm(self.self_attn(x, mask, pos_ids=pos_ids))
        return x + self.post_feedforward_layernorm(self.mlp(x))

    def decode(
        self, x: NamedArray, cache: KvCache, pos_ids: NamedArray, *, window: int | None = None
    ) -> tuple[NamedArray, KvCache]:
        """The block over cached keys and values (see :meth:`~ponente.models.LmHeadModel.decode`)."""
        attn_out, cache = self.self_attn.decode(x, cache, pos_ids, window=window)
        x = x + self.post_attention_layernorm(attn_out)
        return x + self.post_feedforward_layernorm(self.mlp(x)), cache


class Olmo2LMHeadModel(LlamaLMHeadModel):
    """OLMo 2: Llama's embeddings, final norm and output projection around :class:`Olmo2DecoderLayer` blocks.

    The QK-norm scales are stored over the head axes; in Hugging Face state dicts they are flat
    vectors of size ``heads * head_size`` (``kv_heads * head_size`` for keys), as transformers has them.

    Attributes:
        transformer: embeddings, layers and final norm (state-dict key ``model``).
        lm_head: ``Embed -> Vocab`` without bias, or None when tied.
        config: the config (static).
        vocab_size: the real vocabulary size when the vocabulary axis is padded (static).
    """

    config: Olmo2Config = eqx.field(static=True)

    # Olmo2DecoderLayer is not a LlamaDecoderLayer (no input norm), but Llama's init only stacks it
    _decoder_layer = Olmo2DecoderLayer  # type: ignore[assignment]
