"""Gemma 1, and the modules the Gemma family shares: ``(1 + w)`` RMSNorm, GeGLU, scaled embeddings, and an
attention whose layers may alternate sliding-window/global masks and rotary bases (used by Gemma 2 and 3)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp

import ponente.namedtensor as hax
from ponente.namedtensor import Axis, NamedArray
from ponente.namedtensor.nn import Embedding, Linear, Stacked
from ponente.namedtensor.state_dict import ModuleWithStateDictSerialization

from ._layer_types import FULL, SLIDING, layer_kinds, select_by_kind, with_sliding_window
from .attention import Attention, AttentionMask, attention, decode_attention
from .attention.backends import check_soft_cap_backend
from .attention.kv_cache import KvCache, take_positions
from .config import LmConfig, _require, mask_padded_vocab, register_config
from .lm import LmHeadModel
from .remat import tag
from .rotary import RotaryConfig, apply_rotary

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
            sandwich_norms=False,
            qk_norm=False,
        )

    def attention_windows(self) -> tuple[int | None, ...]:
        """The layout's window on sliding layers, None on global ones (see :meth:`LmConfig.attention_windows`)."""
        layout = self.layout()
        return tuple(layout.sliding_window if t == SLIDING else None for t in layout.layer_types)

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


class GemmaRmsNorm(eqx.Module):
    """Gemma's RMSNorm: ``x / sqrt(mean(x²) + eps) * (1 + weight)``, computed in float32, returned in ``x``'s dtype.

    Attributes:
        weight: the learned offset of the scale (zeros: the identity scale).
        axis: the normalized axis.
        eps: added to the mean square.

    Example:
        >>> import jax.numpy as jnp, ponente.namedtensor as hax
        >>> norm = GemmaRmsNorm.init(hax.Axis("embed", 2), eps=0.0)
        >>> norm(hax.named(jnp.array([3.0, 4.0]), "embed")).array.round(4).tolist()
        [0.8485, 1.1314]
    """

    weight: NamedArray
    axis: Axis = eqx.field(static=True)
    eps: float = eqx.field(static=True, default=1e-6)

    @staticmethod
    def init(axis: Axis, *, eps: float) -> GemmaRmsNorm:
        """A norm over ``axis`` with zero weight (unit scale).

        Args:
            axis: the normalized axis.
            eps: added to the mean square.

        Returns:
            The layer.
        """
        return GemmaRmsNorm(hax.zeros(axis), axis, eps)

    def __call__(self, x: NamedArray) -> NamedArray:
        """Normalize ``x`` over ``axis`` (other axes are batch axes)."""
        xf = x.astype(jnp.float32)
        inv_rms = 1.0 / hax.sqrt(hax.mean(xf * xf, axis=self.axis.name) + self.eps)
        return (xf * inv_rms * (1.0 + self.weight.astype(jnp.float32))).astype(x.dtype)


class GemmaMlp(eqx.Module):
    """GeGLU: ``down_proj(gelu(gate_proj(x)) * up_proj(x))``.

    Attributes:
        gate_proj: ``Embed -> Mlp``.
        up_proj: ``Embed -> Mlp``.
        down_proj: ``Mlp -> Embed``.
        approximate: use the tanh approximation of GELU (static).
    """

    gate_proj: Linear
    up_proj: Linear
    down_proj: Linear
    approximate: bool = eqx.field(static=True, default=True)

    def __call__(self, x: NamedArray) -> NamedArray:
        """Apply the MLP to ``(..., embed)``."""
        gate, up = tag((self.gate_proj(x), self.up_proj(x)), "mlp_in")
        return tag(self.down_proj(hax.nn.gelu(gate, approximate=self.approximate) * up), "mlp_out")


class GemmaAttention(ModuleWithStateDictSerialization):
    """Grouped-query attention of the Gemma family, for both sliding-window and global layers.

    The projections (and backend) are an :class:`~ponente.models.Attention`; queries and keys are
    optionally RMS-normalized over ``head_size`` (Gemma 3), rotated with the global or the local rotary
    settings, and attended under the full causal mask or a sliding window. Whether a layer is a sliding
    one is an argument of ``__call__`` (a Python bool, or a scalar boolean array inside a scan over
    layers of both kinds, in which case ``jax.lax.cond`` runs only the chosen variant). State-dict keys
    are Hugging Face's: ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` (and ``q_norm``, ``k_norm``).

    Attributes:
        attn: the projections and the attention backend (its own ``rotary`` is unused, None).
        q_norm: the query norm over ``head_size``, or None.
        k_norm: the key norm over ``head_size``, or None.
        rope: rotary settings of global layers.
        local_rope: rotary settings of sliding-window layers.
        sliding_window: the window of sliding layers (None: sliding layers see all earlier keys).
        scaling: multiplies the attention logits.
        soft_cap: caps the attention logits with ``cap * tanh(logits / cap)`` (None: no cap; only the backends that
            support it, see :mod:`ponente.models.attention.backends`; ``"auto"`` picks one).
    """

    attn: Attention
    q_norm: GemmaRmsNorm | None
    k_norm: GemmaRmsNorm | None
    rope: RotaryConfig = eqx.field(static=True)
    local_rope: RotaryConfig = eqx.field(static=True)
    sliding_window: int | None = eqx.field(static=True)
    scaling: float = eqx.field(static=True)
    soft_cap: float | None = eqx.field(static=True, default=None)

    def _state_dict_key_map(self) -> dict[str, str | None]:
        return {"attn": None}

    @staticmethod
    def init(config: GemmaConfig, *, key: jax.Array) -> GemmaAttention:
        """Create the layer for ``config`` (see :meth:`GemmaConfig.layout`).

        Args:
            config: the model config.
            key: the PRNG key.

        Returns:
            The layer.

        Raises:
            ValueError: if attention soft-capping is combined with a backend that never soft-caps.
        """
        layout = config.layout()
        if layout.attn_logit_softcapping is not None:
            check_soft_cap_backend(config.attn_backend, f"{type(config).__name__}: attn_logit_softcapping")
        attn = Attention.init(
            config.Embed,
            config.KVHeads,
            config.QHeadsPerGroup,
            config.HeadSize,
            use_bias=False,
            rotary=None,
            key=key,
            backend=config.attn_backend,
            block_size=config.flash_attention_block_size,
        )
        eps = config.layer_norm_epsilon
        return GemmaAttention(
            attn=attn,
            q_norm=GemmaRmsNorm.init(config.HeadSize, eps=eps) if layout.qk_norm else None,
            k_norm=GemmaRmsNorm.init(config.HeadSize, eps=eps) if layout.qk_norm else None,
            rope=layout.rope,
            local_rope=layout.local_rope,
            sliding_window=layout.sliding_window,
            scaling=layout.scaling,
            soft_cap=layout.attn_logit_softcapping,
        )

    def __call__(
        self,
        x: NamedArray,
        mask: AttentionMask | NamedArray | None,
        sliding: bool | NamedArray = False,
        *,
        pos_ids: NamedArray | None = None,
    ) -> NamedArray:
        """Attend over the ``position`` axis of ``x`` (``(..., position, embed)``).

        Args:
            x: the input.
            mask: the attention mask (None: causal).
            sliding: whether this is a sliding-window layer (a bool, or a scalar boolean NamedArray).
            pos_ids: the rotary positions over ``position`` (and some batch axes); None: ``0 .. n - 1``.

        Returns:
            ``(..., position, embed)``.
        """
        a = self.attn
        Pos = x.resolve_axis("position")
        HeadSize = a.o_proj.weight.resolve_axis("head_size")
        q, k, v = a.q_proj(x), a.k_proj(x), a.v_proj(x)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)

        def attend(rope: RotaryConfig, window: int | None) -> NamedArray:
            qr, kr = apply_rotary(q, Pos, HeadSize, rope, pos_ids), apply_rotary(k, Pos, HeadSize, rope, pos_ids)
            m = with_sliding_window(mask, window, Pos)
            return attention(
                Pos,
                HeadSize,
                qr,
                kr,
                v,
                m,
                scaling_factor=self.scaling,
                backend=a.backend,
                block_size=a.block_size,
                logit_soft_cap=self.soft_cap,
            )

        def local() -> NamedArray:
            return attend(self.local_rope, self.sliding_window)

        def full() -> NamedArray:
            return attend(self.rope, None)

        return tag(a.o_proj(select_by_kind(sliding, local, full)), "attn_out")

    def decode(
        self, x: NamedArray, cache: KvCache, pos_ids: NamedArray, sliding: bool | NamedArray = False
    ) -> tuple[NamedArray, KvCache]:
        """Attend from the tokens of ``x`` over the cache, after writing their keys and values to it.

        Args:
            x: ``(batch, position, embed)``.
            cache: this layer's cache (see :meth:`~ponente.models.LmHeadModel.decode`).
            pos_ids: the tokens' positions over ``(batch, position)``.
            sliding: whether this is a sliding-window layer (a bool, or a scalar boolean NamedArray).

        Returns:
            ``((batch, position, embed), the updated cache)``.
        """
        a = self.attn
        Pos = x.resolve_axis("position")
        HeadSize = a.o_proj.weight.resolve_axis("head_size")
        q, k, v = a.q_proj(x), a.k_proj(x), a.v_proj(x)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)

        def attend(rope: RotaryConfig, window: int | None) -> tuple[NamedArray, KvCache]:
            qr, kr = apply_rotary(q, Pos, HeadSize, rope, pos_ids), apply_rotary(k, Pos, HeadSize, rope, pos_ids)
            new_cache = cache.update(kr, v, pos_ids)
            out = decode_attention(
                HeadSize,
                qr,
                new_cache,
                pos_ids,
                window=window,
                scaling_factor=self.scaling,
                logit_soft_cap=self.soft_cap,
                backend=a.backend,
                block_size=a.block_size,
            )
            return out, new_cache

        out, cache = select_by_kind(
            sliding, lambda: attend(self.local_rope, self.sliding_window), lambda: attend(self.rope, None)
        )
        return a.o_proj(out), cache


class GemmaDecoderLayer(eqx.Module):
    """A Gemma block.

    Gemma 1 (no sandwich norms): ``x + attn(input_layernorm(x))`` then ``x + mlp(post_attention_layernorm(x))``.
    Gemma 2/3: ``x + post_attention_layernorm(attn(input_layernorm(x)))`` then
    ``x + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))``.
    """

    input_layernorm: GemmaRmsNorm
    self_attn: GemmaAttention
    post_attention_layernorm: GemmaRmsNorm
    pre_feedforward_layernorm: GemmaRmsNorm | None
    post_feedforward_layernorm: GemmaRmsNorm | None
    mlp: GemmaMlp

    @staticmethod
    def init(config: GemmaConfig, *, key: jax.Array) -> GemmaDecoderLayer:
        """Create one block."""
        k_attn, k_gate, k_up, k_down = jax.random.split(key, 4)
        Embed, Mlp, eps = config.Embed, config.Mlp, config.layer_norm_epsilon
        sandwich = config.layout().sandwich_norms
        return GemmaDecoderLayer(
            input_layernorm=GemmaRmsNorm.init(Embed, eps=eps),
            self_attn=GemmaAttention.init(config, key=k_attn),
            post_attention_layernorm=GemmaRmsNorm.init(Embed, eps=eps),
            pre_feedforward_layernorm=GemmaRmsNorm.init(Embed, eps=eps) if sandwich else None,
            post_feedforward_layernorm=GemmaRmsNorm.init(Embed, eps=eps) if sandwich else None,
            mlp=GemmaMlp(
                Linear.init(Embed, Mlp, key=k_gate, use_bias=False),
                Linear.init(Embed, Mlp, key=k_up, use_bias=False),
                Linear.init(Mlp, Embed, key=k_down, use_bias=False),
                approximate=config.hidden_act == "gelu_pytorch_tanh",
            ),
        )

    def __call__(
        self,
        x: NamedArray,
        mask: AttentionMask | NamedArray | None,
        sliding: bool | NamedArray = False,
        *,
        pos_ids: NamedArray | None = None,
    ) -> NamedArray:
        """Apply the block to ``(..., position, embed)`` (``sliding``, ``pos_ids``: see :class:`GemmaAttention`)."""
        attn_out = self.self_attn(self.input_layernorm(x), mask, sliding, pos_ids=pos_ids)
        return self._finish(x, attn_out)

    def decode(
        self, x: NamedArray, cache: KvCache, pos_ids: NamedArray, *, sliding: bool | NamedArray = False
    ) -> tuple[NamedArray, KvCache]:
        """The block over cached keys and values (see :meth:`~ponente.models.LmHeadModel.decode`)."""
        attn_out, cache = self.self_attn.decode(self.input_layernorm(x), cache, pos_ids, sliding)
        return self._finish(x, attn_out), cache

    def _finish(self, x: NamedArray, attn_out: NamedArray) -> NamedArray:
        """The residual additions and the MLP around an attention output."""
        if self.pre_feedforward_layernorm is None or self.post_feedforward_layernorm is None:
            x = x + attn_out
            return x + self.mlp(self.post_attention_layernorm(x))
        x = x + self.post_attention_layernorm(attn_out)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class GemmaTransformer(eqx.Module):
    """Token embedding, stacked decoder layers and the final norm (HF ``model``)."""

    embed_tokens: Embedding
    layers: Stacked[GemmaDecoderLayer]
    norm: GemmaRmsNorm


class GemmaLMHeadModel(LmHeadModel):
    """A Gemma 1, 2 or 3 causal language model (the generation is the config's: :meth:`GemmaConfig.layout`).

    Attributes:
        transformer: embeddings, layers and final norm (state-dict key ``model``).
        lm_head: ``Embed -> Vocab`` without bias, or None when tied (the default).
        config: the config (static).
        vocab_size: the real vocabulary size when the vocabulary axis is padded (static).
    """

    transformer: GemmaTransformer
    lm_head: Linear | None
    config: GemmaConfig = eqx.field(static=True)
    vocab_size: int | None = eqx.field(static=True, default=None)

    _hf_vocab_keys: ClassVar[tuple[str, ...]] = ("model.embed_tokens.weight", "lm_head.weight")

    def _state_dict_key_map(self) -> dict[str, str | None]:
        return {"transformer": "model"}

    @staticmethod
    def init(config: GemmaConfig, Vocab: Axis, *, key: jax.Array) -> GemmaLMHeadModel:
        """Create a randomly initialized model.

        Args:
            config: the config.
            Vocab: the (real) vocabulary axis; the model's is padded to ``config.vocab_padding_multiple``.
            key: the PRNG key.

        Returns:
            The model.
        """
        k_emb, k_layers, k_head = jax.random.split(key, 3)
        PaddedVocab = config.padded_vocab(Vocab)
        layers = Stacked.init(config.Layers, GemmaDecoderLayer, gradient_checkpointing=config.gradient_checkpointing)(
            config, key=jax.random.split(k_layers, config.num_layers)
        )
        transformer = GemmaTransformer(
            embed_tokens=Embedding.init(
                PaddedVocab, config.Embed, key=k_emb, initializer_range=config.initializer_range
            ),
            layers=layers,
            norm=GemmaRmsNorm.init(config.Embed, eps=config.layer_norm_epsilon),
        )
        lm_head = None
        if not config.tie_word_embeddings:
            lm_head = Linear.init(config.Embed, PaddedVocab, key=k_head, use_bias=False)
        return GemmaLMHeadModel(transformer=transformer, lm_head=lm_head, config=config, vocab_size=Vocab.size)

    @property
    def Vocab(self) -> Axis:
        """The vocabulary axis of the logits (padded if ``config.vocab_padding_multiple > 1``)."""
        return self.transformer.embed_tokens.Vocab

    def activations(
        self,
        input_ids: NamedArray,
        attn_mask: AttentionMask | NamedArray | None = None,
        *,
        key: jax.Array | None = None,
        pos_ids: NamedArray | None = None,
    ) -> NamedArray:
        """The final hidden states ``(..., position, embed)``, before the output projection.

        Args:
            input_ids: integer ids ``(..., position)``.
            attn_mask: the attention mask (None: causal); sliding layers further restrict it to their window.
            key: unused (no dropout).
            pos_ids: the rotary positions ``(..., position)`` (None: ``0 .. n - 1``; see :class:`LmHeadModel`).

        Returns:
            The hidden states after the final norm.
        """
        del key
        mask = AttentionMask.causal() if attn_mask is None else attn_mask
        kinds = layer_kinds(self.config.layout().layer_types, self.config.Layers)
        x = self.transformer.layers.fold(
            self._embed(input_ids), mask, kinds, pos_ids=pos_ids, unroll=self.config.layer_unroll
        )
        return self.transformer.norm(x)

    def _embed(self, input_ids: NamedArray) -> NamedArray:
        """Token embeddings times ``sqrt(hidden_dim)`` (the scale rounded to the embeddings' dtype)."""
        x = self.transformer.embed_tokens.embed(input_ids)
        return x * jnp.asarray(math.sqrt(self.config.hidden_dim), dtype=x.dtype)

    def init_cache(self, Batch: Axis, max_len: int, *, dtype: Any = None) -> KvCache:
        """An empty cache over ``(layers, batch, kv_heads, cache_position, head_size)`` (see :class:`LmHeadModel`).

        Raises:
            ValueError: if ``max_len`` is below 1.
        """
        config = self.config
        dtype = self.transformer.embed_tokens.weight.dtype if dtype is None else dtype
        return KvCache.init((config.Layers, Batch, config.KVHeads), config.HeadSize, max_len, dtype=dtype)

    def decode(
        self,
        tokens: NamedArray,
        cache: KvCache,
        pos_ids: NamedArray,
        *,
        key: jax.Array | None = None,
        logits_at: NamedArray | None = None,
    ) -> tuple[NamedArray, KvCache]:
        """Logits of ``tokens`` over the cached earlier tokens, and the updated cache (see :class:`LmHeadModel`)."""
        del key
        pos_ids = hax.broadcast_to(pos_ids, tokens.axes)
        kinds = layer_kinds(self.config.layout().layer_types, self.config.Layers)
        # the stacked cache is the fold's carry and each layer writes its slots in place (no per-layer copies)
        layer_ids = hax.arange(cache.keys.resolve_axis("layers"))
        x, cache = self.transformer.layers.fold_via(_decode_block, unroll=self.config.layer_unroll)(
            (self._embed(tokens), cache.at_layer(0)), layer_ids, pos_ids, sliding=kinds
        )
        return self._logits(self.transformer.norm(take_positions(x, logits_at))), cache.at_layer(None).for_prefill(
            False
        )

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
        """The output projection weight (``embed``, ``vocab``): ``lm_head``'s, or the token embedding if tied.

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
        if self.lm_head is None:
            return self.transformer.embed_tokens.weight
        return self.lm_head.weight

    def __call__(
        self,
        input_ids: NamedArray,
        attn_mask: AttentionMask | NamedArray | None = None,
        *,
        key: jax.Array | None = None,
        pos_ids: NamedArray | None = None,
    ) -> NamedArray:
        """Logits ``(..., position, vocab)`` for ``input_ids`` ``(..., position)`` (see :class:`LmHeadModel`).

        With ``final_logit_softcapping``, logits are ``cap * tanh(logits / cap)``. Padded vocabulary
        entries hold the dtype's most negative value.
        """
        return self._logits(self.activations(input_ids, attn_mask, key=key, pos_ids=pos_ids))

    def _logits(self, x: NamedArray) -> NamedArray:
        """The output projection of final hidden states, soft-capped if configured; padded entries masked."""
        logits = self.transformer.embed_tokens.unembed(x) if self.lm_head is None else self.lm_head(x)
        cap = self.config.layout().final_logit_softcapping
        if cap is not None:
            logits = cap * hax.tanh(logits / cap)
        return mask_padded_vocab(logits, self.Vocab, self.vocab_size)


def _decode_block(
    block: GemmaDecoderLayer,
    carry: tuple[NamedArray, KvCache],
    layer: NamedArray,
    pos_ids: NamedArray,
    *,
    sliding: bool | NamedArray,
) -> tuple[NamedArray, KvCache]:
    """``block.decode`` on layer ``layer`` of the stacked cache (the fold step of :meth:`GemmaLMHeadModel.decode`)."""
    x, cache = carry
    return block.decode(x, cache.at_layer(layer.array), pos_ids, sliding=sliding)
