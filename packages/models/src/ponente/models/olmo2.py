"""OLMo 2: Llama with post-norm blocks (norms on the attention and MLP outputs) and full-width QK-norm."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import jax

from ponente.namedtensor import Axis
from ponente.namedtensor.nn import RmsNorm

from .config import register_config
from .decoder import NormPlacement, QkNormAttention, grouped_attention
from .llama import LlamaConfig, LlamaLMHeadModel

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

    norm_placement: ClassVar[NormPlacement] = "post"

    def build(self, Vocab: Axis, *, key: jax.Array) -> Olmo2LMHeadModel:
        """Build a randomly initialized OLMo 2 (see :meth:`LmConfig.build`)."""
        return Olmo2LMHeadModel.init(self, Vocab, key=key)

    def init_attention(self, *, key: jax.Array) -> QkNormAttention:
        """Attention (biases if ``attention_bias``) with a QK-norm over the whole projection (all head axes)."""
        attn = grouped_attention(self, self.rope, key=key, use_bias=self.attention_bias)
        eps = self.layer_norm_epsilon
        return QkNormAttention(
            attn=attn,
            q_norm=RmsNorm.init((self.KVHeads, self.QHeadsPerGroup, self.HeadSize), eps=eps, use_bias=False),
            k_norm=RmsNorm.init((self.KVHeads, self.HeadSize), eps=eps, use_bias=False),
        )

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


class Olmo2LMHeadModel(LlamaLMHeadModel):
    """OLMo 2: Llama with post-norm blocks (``norm_placement="post"``) and a QK-norm over all heads.

    The QK-norm scales are stored over the head axes; in Hugging Face state dicts they are flat
    vectors of size ``heads * head_size`` (``kv_heads * head_size`` for keys), as transformers has them.
    """
