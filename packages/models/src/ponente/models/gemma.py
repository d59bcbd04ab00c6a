"""Gemma 1, and what the Gemma family shares: its config (the layout of a generation's blocks) and its model, the
shared :class:`~ponente.models.decoder.DecoderLM` with ``(1 + w)`` RMSNorms, GeGLU, scaled embeddings, an attention
whose layers may alternate sliding-window/global masks and rotary bases, and soft-capped logits (Gemma 2 and 3)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

import ponente.namedtensor as hax
from ponente.namedtensor import Axis, NamedArray

from ._layer_types import FULL, SLIDING
from .attention.backends import check_soft_cap_backend
from .config import LmConfig, _require, register_config
from .decoder import Activation, DecoderLM, GatedMlp, GemmaRmsNorm, NormPlacement, QkNormAttention, grouped_attention
from .rotary import RotaryConfig

__all__ = ["GemmaConfig", "GemmaLMHeadModel", "GemmaLayout", "GemmaRmsNorm"]

_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu")
"""Hugging Face activation names the Gemma MLP supports: the tanh approximation of GELU, and the exact GELU."""


@dataclasses.dataclass(frozen=True)
class GemmaLayout:
    """What distinguishes the Gemma generations inside a block (derived from a config; see ``GemmaConfig.layout``).

    Attributes:
        layer_types: per layer, ``"sliding_attention"`` or ``"full_attention"``.
        rope: the rotary settings of full-attention layers.
        local_rope: the rotary settings of sliding-window layers.
        sliding_window: how many keys (itself included) a query of a sliding layer sees.
        scaling: multiplies the attention logits.
        attn_logit_softcapping: attention logits become ``cap * tanh(logits / cap)`` (None: not capped).
        final_logit_softcapping: output logits become ``cap * tanh(logits / cap)`` (None: not capped).
        sandwich_norms: normalize the attention and MLP outputs too (Gemma 2/3), not only their inputs.
        qk_norm: RMS-normalize queries and keys over ``head_size`` before rotary (Gemma 3).
    """

    layer_types: tuple[str, ...]
    rope: RotaryConfig
    local_rope: RotaryConfig
    sliding_window: int | None
    scaling: float
    attn_logit_softcapping: float | None
    final_logit_softcapping: float | None
    sandwich_norms: bool
    qk_norm: bool


@register_config("gemma")
@dataclasses.dataclass(frozen=True)
class GemmaConfig(LmConfig):
    """Gemma 1 (Hugging Face ``GemmaForCausalLM``).

    A Llama-like decoder with three differences: the MLP is GeGLU (``hidden_act``), the token
    embeddings are multiplied by ``sqrt(hidden_dim)`` (in the model dtype), and RMSNorm scales by
    ``1 + weight`` (weights start at zero). The output is tied to the embedding by default, and
    ``head_dim`` is usually explicit (256 for the released models).

    Attributes:
        rope: rotary settings (``rope_parameters``).
        layer_norm_epsilon: RMSNorm epsilon (``rms_norm_eps``).
        tie_word_embeddings: share the output projection with the token embedding.
        initializer_range: standard deviation of the embedding initialization.
        hidden_act: ``"gelu_pytorch_tanh"`` (the tanh approximation, what Gemma uses) or ``"gelu"`` (exact).

    Example:
        >>> import jax, ponente.namedtensor as hax
        >>> cfg = GemmaConfig(
        ...     seq_len=8, hidden_dim=16, intermediate_dim=32, num_layers=2, num_heads=4, num_kv_heads=1, head_dim=8
        ... )
        >>> model = cfg.build(hax.Axis("vocab", 11), key=jax.random.key(0))
        >>> model(hax.zeros({"position": 8}, dtype=int)).shape
        {'position': 8, 'vocab': 11}
    """

    hf_architecture: ClassVar[str] = "GemmaForCausalLM"
    hf_model_type: ClassVar[str] = "gemma"
    hf_activation_key: ClassVar[str] = "hidden_act"

    rope: RotaryConfig = dataclasses.field(default_factory=RotaryConfig)
    layer_norm_epsilon: float = 1e-6
    tie_word_embeddings: bool = True
    initializer_range: float = 0.02
    hidden_act: str = "gelu_pytorch_tanh"

    norm_placement: ClassVar[NormPlacement] = "pre"
    """Where the blocks' norms sit (see :class:`~ponente.models.decoder.DecoderBlock`; Gemma 2/3: ``"sandwich"``)."""
    feed_forward_keys: ClassVar[int] = 3
    """How many PRNG keys :meth:`init_feed_forward` takes."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.hidden_act not in _ACTIVATIONS:
            raise ValueError(
                f"{type(self).__name__}: hidden_act {self.hidden_act!r} is not supported; "
                f"expected one of {_ACTIVATIONS}"
            )

    def layout(self) -> GemmaLayout:
        """The per-block settings of this generation (Gemma 1: global attention everywhere, no capping).

        Returns:
            The layout.
        """
        return GemmaLayout(
            layer_types=(FULL,) * self.num_layers,
            rope=self.rope,
            local_rope=self.rope,
            sliding_window=None,
            scaling=self.HeadSize.size**-0.5,
            attn_logit_softcapping=None,
            final_logit_softcapping=None,
            sandwich_norms=self.norm_placement == "sandwich",
            qk_norm=False,
        )

    def attention_windows(self) -> tuple[int | None, ...]:
        """The layout's window on sliding layers, None on global ones (see :meth:`LmConfig.attention_windows`)."""
        layout = self.layout()
        return tuple(layout.sliding_window if t == SLIDING else None for t in layout.layer_types)

    def sliding_layers(self) -> tuple[bool, ...]:
        """Per layer, whether it is a sliding layer (its own rotary, and the window if there is one)."""
        return tuple(t == SLIDING for t in self.layout().layer_types)

    def init_norm(self, axis: Axis) -> GemmaRmsNorm:
        """A block's (and the final) normalization over ``axis``: Gemma's ``(1 + w)`` RMSNorm."""
        return GemmaRmsNorm.init(axis, eps=self.layer_norm_epsilon)

    def init_attention(self, *, key: jax.Array) -> QkNormAttention:
        """One block's attention: no biases, the layout's rotary bases, scaling, soft cap and QK-norm.

        Raises:
            ValueError: if attention soft-capping is combined with a backend that never soft-caps.
        """
        layout = self.layout()
        if layout.attn_logit_softcapping is not None:
            check_soft_cap_backend(self.attn_backend, f"{type(self).__name__}: attn_logit_softcapping")
        attn = grouped_attention(self, layout.rope, key=key)
        return QkNormAttention(
            attn=attn,
            q_norm=self.init_norm(self.HeadSize) if layout.qk_norm else None,
            k_norm=self.init_norm(self.HeadSize) if layout.qk_norm else None,
            local_rotary=layout.local_rope,
            scaling=layout.scaling,
            soft_cap=layout.attn_logit_softcapping,
        )

    def init_feed_forward(self, keys: jax.Array) -> GatedMlp:
        """The GeGLU of one block (``hidden_act``: the tanh approximation of GELU, or the exact one)."""
        activation: Activation = "gelu_tanh" if self.hidden_act == "gelu_pytorch_tanh" else "gelu"
        return GatedMlp.init(self.Embed, self.Mlp, keys, activation=activation)

    def build(self, Vocab: Axis, *, key: jax.Array) -> GemmaLMHeadModel:
        """Build a randomly initialized model (see :meth:`LmConfig.build`)."""
        return GemmaLMHeadModel.init(self, Vocab, key=key)

    def _hf_rope(self) -> dict[str, Any]:
        """The ``rope_parameters`` entry of the Hugging Face config."""
        return self.rope.to_hf()

    def to_hf_config(self, vocab_size: int) -> dict[str, Any]:
        """The Hugging Face config dict, transformers-5 spelling (see :meth:`LmConfig.to_hf_config`).

        Raises:
            ValueError: for Gemma 1 with ``hidden_act="gelu"`` (transformers' Gemma reads it as the tanh
                approximation).
        """
        if self.hf_activation_key == "hidden_act" and self.hidden_act == "gelu":
            raise ValueError(
                f"{type(self).__name__}.to_hf_config: hidden_act='gelu' (exact GELU) cannot be exported: "
                "transformers' Gemma reads 'gelu' as the tanh approximation ('gelu_pytorch_tanh')"
            )
        return {
            "architectures": [self.hf_architecture],
            "model_type": self.hf_model_type,
            "vocab_size": vocab_size,
            "max_position_embeddings": self.seq_len,
            "hidden_size": self.hidden_dim,
            "intermediate_size": self.intermediate_dim,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.HeadSize.size,
            self.hf_activation_key: self.hidden_act,
            "rms_norm_eps": self.layer_norm_epsilon,
            "rope_parameters": self._hf_rope(),
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": False,
            "initializer_range": self.initializer_range,
        }

    @classmethod
    def _hf_common(cls, hf_config: Mapping[str, Any]) -> dict[str, Any]:
        """The constructor arguments shared by the Gemma generations, read from a Hugging Face config dict."""
        where = f"{cls.__name__}.from_hf_config"
        if hf_config.get("attention_bias"):
            raise ValueError(f"{where}: attention_bias=true is not supported (Gemma has no attention biases)")
        if hf_config.get("use_bidirectional_attention"):
            raise ValueError(f"{where}: use_bidirectional_attention=true is not supported (causal models only)")
        act = str(hf_config.get(cls.hf_activation_key, "gelu_pytorch_tanh"))
        if cls.hf_activation_key == "hidden_act" and act == "gelu":
            act = "gelu_pytorch_tanh"  # as transformers: Gemma 1's legacy "gelu" means the tanh approximation
        heads = int(_require(hf_config, "num_attention_heads", where))
        hidden = int(_require(hf_config, "hidden_size", where))
        head_dim = hf_config.get("head_dim")
        if head_dim is not None and int(head_dim) * heads == hidden:
            head_dim = None  # the default, kept implicit so configs compare equal
        return {
            "seq_len": int(_require(hf_config, "max_position_embeddings", where)),
            "hidden_dim": hidden,
            "intermediate_dim": int(_require(hf_config, "intermediate_size", where)),
            "num_layers": int(_require(hf_config, "num_hidden_layers", where)),
            "num_heads": heads,
            "num_kv_heads": int(hf_config.get("num_key_value_heads") or heads),
            "head_dim": int(head_dim) if head_dim is not None else None,
            "layer_norm_epsilon": float(hf_config.get("rms_norm_eps", 1e-6)),
            "tie_word_embeddings": bool(hf_config.get("tie_word_embeddings", True)),
            "initializer_range": float(hf_config.get("initializer_range", 0.02)),
            "hidden_act": act,
        }

    @classmethod
    def from_hf_config(cls, hf_config: Mapping[str, Any]) -> GemmaConfig:
        """Read a Hugging Face Gemma config dict, transformers-4 or -5 spelling (see ``LmConfig.from_hf_config``).

        Raises:
            KeyError: if a required key is missing.
            ValueError: for options this implementation does not support (attention biases, bidirectional
                attention, an activation other than GELU).
        """
        return cls(rope=RotaryConfig.from_hf(hf_config), **cls._hf_common(hf_config))


class GemmaLMHeadModel(DecoderLM):
    """A Gemma 1, 2 or 3 causal language model (the generation is the config's: :meth:`GemmaConfig.layout`).

    The shared :class:`~ponente.models.decoder.DecoderLM` with the parts its config chooses (``(1 + w)`` RMSNorms,
    GeGLU, the layout's attention and norm placement), token embeddings multiplied by ``sqrt(hidden_dim)``, and with
    ``final_logit_softcapping`` logits ``cap * tanh(logits / cap)`` (before padded vocabulary entries are masked).
    Its Hugging Face parameter names are ``model.embed_tokens``, ``model.layers.L.{input_layernorm,
    self_attn.{q,k,v,o}_proj, post_attention_layernorm, mlp.{gate,up,down}_proj}``, ``model.norm`` and ``lm_head``
    (absent when tied); Gemma 2/3 add ``pre_feedforward_layernorm`` and ``post_feedforward_layernorm``, Gemma 3
    ``self_attn.{q,k}_norm``.
    """

    def _embed(
        self, input_ids: NamedArray, pos_ids: NamedArray | None = None, *, key: jax.Array | None = None
    ) -> NamedArray:
        """Token embeddings times ``sqrt(hidden_dim)`` (the scale rounded to the embeddings' dtype)."""
        x = super()._embed(input_ids, pos_ids, key=key)
        return x * jnp.asarray(math.sqrt(self.config.hidden_dim), dtype=x.dtype)

    def _project_out(self, x: NamedArray) -> NamedArray:
        """The output projection, soft-capped if the layout says so."""
        logits = super()._project_out(x)
        cap = self.config.layout().final_logit_softcapping
        if cap is not None:
            logits = cap * hax.tanh(logits / cap)
        return logits

    def blockwise_loss_support(self) -> str | None:
        """Why the blockwise loss cannot compute this model's loss (a final logit soft cap), or None."""
        cap = self.config.layout().final_logit_softcapping
        if cap is not None:
            return (
                f"{type(self.config).__name__}: final_logit_softcapping={cap} caps the logits after the output "
                "projection"
            )
        return None

    def get_lm_head(self) -> NamedArray:
        """The output projection weight (``embed``, ``vocab``) without padded vocabulary rows (see
        :meth:`DecoderLM.get_lm_head`), for the blockwise and fused losses.

        Raises:
            NotImplementedError: with final logit soft-capping, as logits are then not ``activations · lm_head``
                (so the blockwise loss, which relies on that, is unavailable; ``block_size="auto"`` keeps the
                plain loss for such models).
        """
        reason = self.blockwise_loss_support()
        if reason is not None:
            raise NotImplementedError(
                f"{reason}, so the blockwise loss (compute_next_token_loss(..., block_size=...)) cannot be used; "
                "use block_size=None"
            )
        return super().get_lm_head()
