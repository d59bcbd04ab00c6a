"""GPT-2 on the shared decoder: learned position embeddings, pre-LayerNorm blocks, fused QKV, GELU (tanh) MLP,
tied output embedding.

The model is :class:`~ponente.models.decoder.DecoderLM` (one forward, with or without a KV cache) whose config
chooses LayerNorm, :class:`~ponente.models.decoder.FusedQkvAttention` and the plain
:class:`~ponente.models.decoder.Mlp`; this module adds the position embeddings (the ``_embed`` hook), GPT-2's
attention options and dropout, and keeps GPT-2's parameter names (``transformer.{wte, wpe, h, ln_f}``, blocks
``ln_1``, ``attn.{c_attn, c_proj}``, ``ln_2``, ``mlp.{c_fc, c_proj}``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp

import ponente.namedtensor as hax
from ponente.namedtensor import Axis, NamedArray
from ponente.namedtensor.nn import Embedding, LayerNorm, Stacked
from ponente.namedtensor.nn import attention as hattn

from .attention import KEY_POSITION, AttentionMask
from .attention.kv_cache import KvCache
from .config import LmConfig, _require, register_config
from .decoder import (
    DecoderConfig,
    DecoderLM,
    FusedQkvAttention,
    Mlp,
    NormPlacement,
    _dropout,
    block_forward,
    init_blocks,
    init_embedding,
)
from .moe import RouterOutput
from .remat import tag

__all__ = ["Gpt2Config", "Gpt2LMHeadModel"]


@register_config("gpt2")
@dataclasses.dataclass(frozen=True)
class Gpt2Config(LmConfig):
    """GPT-2 (Hugging Face ``GPT2LMHeadModel``).

    Attributes:
        layer_norm_epsilon: LayerNorm epsilon.
        initializer_range: standard deviation of the embedding initialization.
        embed_pdrop: dropout after the token + position embeddings (HF ``embd_pdrop``).
        resid_pdrop: dropout on the attention and MLP outputs before each residual add.
        attn_pdrop: dropout on the attention probabilities (``"reference"`` or ``"auto"`` backend only; with dropout
            in training, or ``upcast_attn``, the scores are always materialized).
        scale_attn_weights: divide the attention scores by ``sqrt(head_size)``.
        scale_attn_by_inverse_layer_idx: also divide the scores of layer ``i`` (from 0) by ``i + 1`` (a
            stability option for deep models).
        upcast_attn: compute the attention scores and softmax in float32 whatever the compute dtype (HF
            ``reorder_and_upcast_attn``).

    Dropout is applied only when the model is called with a ``key``; without one the model is deterministic.

    Example:
        >>> import jax, ponente.namedtensor as hax
        >>> cfg = Gpt2Config(seq_len=8, hidden_dim=16, intermediate_dim=64, num_layers=2, num_heads=2, num_kv_heads=2)
        >>> model = cfg.build(hax.Axis("vocab", 11), key=jax.random.key(0))
        >>> model(hax.zeros({"position": 8}, dtype=int)).shape
        {'position': 8, 'vocab': 11}
    """

    glu_mlp: ClassVar[bool] = False  # GPT-2's MLP is two matrices with a GELU between them
    norm_placement: ClassVar[NormPlacement] = "pre"
    """Where the blocks' norms sit (see :class:`~ponente.models.decoder.DecoderBlock`)."""
    feed_forward_keys: ClassVar[int] = 2
    """How many PRNG keys :meth:`init_feed_forward` takes."""

    layer_norm_epsilon: float = 1e-5
    initializer_range: float = 0.02
    embed_pdrop: float = 0.0
    resid_pdrop: float = 0.0
    attn_pdrop: float = 0.0
    scale_attn_weights: bool = True
    scale_attn_by_inverse_layer_idx: bool = False
    upcast_attn: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_kv_heads != self.num_heads:
            raise ValueError(
                f"Gpt2Config: GPT-2 has no grouped-query attention; num_kv_heads ({self.num_kv_heads}) must equal "
                f"num_heads ({self.num_heads})"
            )
        for name in ("embed_pdrop", "resid_pdrop", "attn_pdrop"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"Gpt2Config: {name} must be in [0, 1), got {getattr(self, name)}")
        if self.attn_backend not in ("reference", "auto") and (self.attn_pdrop > 0 or self.upcast_attn):
            raise ValueError(
                f"Gpt2Config: attn_backend={self.attn_backend!r} does not materialize attention probabilities, so "
                f"attn_pdrop ({self.attn_pdrop}) must be 0 and upcast_attn ({self.upcast_attn}) False; "
                "use attn_backend='reference' for them"
            )

    @property
    def tie_word_embeddings(self) -> bool:
        """GPT-2 always ties its output projection to the token embedding."""
        return True

    def sliding_layers(self) -> tuple[bool, ...]:
        """No layer slides."""
        return (False,) * self.num_layers

    def init_norm(self, axis: Axis) -> LayerNorm:
        """A block's (and the final) normalization over ``axis``: LayerNorm with a scale and a bias."""
        return LayerNorm.init(axis, eps=self.layer_norm_epsilon)

    def init_attention(self, *, key: jax.Array) -> Gpt2Attention:
        """One block's attention: fused ``c_attn``, ``c_proj``, with biases and GPT-2's options."""
        return Gpt2Attention.init(self, key=key)

    def init_feed_forward(self, keys: jax.Array) -> Mlp:
        """One block's MLP, ``c_fc`` then ``gelu_new`` (tanh-approximated GELU) then ``c_proj``, with biases."""
        return Mlp.init(self.Embed, self.Mlp, keys, activation="gelu_tanh")

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
            "embd_pdrop": self.embed_pdrop,
            "resid_pdrop": self.resid_pdrop,
            "attn_pdrop": self.attn_pdrop,
            "scale_attn_weights": self.scale_attn_weights,
            "scale_attn_by_inverse_layer_idx": self.scale_attn_by_inverse_layer_idx,
            "reorder_and_upcast_attn": self.upcast_attn,
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
        if hf_config.get("tie_word_embeddings", True) is False:
            raise ValueError(f"{where}: tie_word_embeddings=false is not supported (GPT-2 ties its output embedding)")
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
            embed_pdrop=float(hf_config.get("embd_pdrop", 0.0)),
            resid_pdrop=float(hf_config.get("resid_pdrop", 0.0)),
            attn_pdrop=float(hf_config.get("attn_pdrop", 0.0)),
            scale_attn_weights=bool(hf_config.get("scale_attn_weights", True)),
            scale_attn_by_inverse_layer_idx=bool(hf_config.get("scale_attn_by_inverse_layer_idx", False)),
            upcast_attn=bool(hf_config.get("reorder_and_upcast_attn", False)),
        )


class Gpt2Attention(FusedQkvAttention):
    """GPT-2's attention: the decoder's fused ``c_attn`` / ``c_proj`` attention with GPT-2's options.

    Adds to :class:`~ponente.models.decoder.FusedQkvAttention` the scores divided by ``layer + 1``
    (``scale_attn_by_inverse_layer_idx``), float32 scores (``upcast_attn``) and dropout on the probabilities
    (``attn_pdrop``) and on the output (``resid_pdrop``), applied only with a PRNG key.

    Attributes:
        config: the config (static): scaling, upcasting, dropout and backend options.
    """

    config: Gpt2Config = eqx.field(static=True, kw_only=True)

    @staticmethod
    def init(config: Gpt2Config, *, key: jax.Array) -> Gpt2Attention:
        """Create the projections."""
        c_attn, c_proj = FusedQkvAttention.init_projections(config.Embed, config.Heads, config.HeadSize, key=key)
        return Gpt2Attention(
            c_attn=c_attn,
            c_proj=c_proj,
            scaling=config.HeadSize.size**-0.5 if config.scale_attn_weights else 1.0,
            backend=config.attn_backend,
            block_size=config.flash_attention_block_size,
            context_parallel=config.attention_context_parallel,
            config=config,
        )

    def project(self, x: NamedArray, layer: NamedArray | None) -> tuple[NamedArray, NamedArray, NamedArray]:
        """The queries (divided by ``layer + 1`` with ``scale_attn_by_inverse_layer_idx``), keys and values."""
        q, k, v = super().project(x, layer)
        if self.config.scale_attn_by_inverse_layer_idx:
            # scaling q scales the scores; the layer index is traced in the scan, so it cannot be a static factor
            index = 0 if layer is None else layer.array
            q = q / (jnp.asarray(index) + 1).astype(q.dtype)
        return q, k, v

    def attend(
        self,
        Pos: Axis,
        q: NamedArray,
        k: NamedArray,
        v: NamedArray,
        mask: AttentionMask | NamedArray | None,
        *,
        key: jax.Array | None,
    ) -> NamedArray:
        """Attention over the positions; materialized with ``upcast_attn`` or with attention dropout."""
        cfg = self.config
        if cfg.upcast_attn or (cfg.attn_pdrop > 0 and key is not None):
            HeadSize = q.resolve_axis("head_size")
            scale = HeadSize.size**-0.5 if cfg.scale_attn_weights else 1.0
            q, k, v = tag((q, k, v), "attn_qkv")
            return tag(_materialized_attention(Pos, HeadSize, q, k, v, mask, scale, cfg, key), "attn_context")
        return super().attend(Pos, q, k, v, mask, key=None)

    def decode_backend(self) -> str:
        """A prefill attends like the forward pass: upcast attention materializes the scores (``"reference"``)."""
        return "reference" if self.config.upcast_attn else self.backend

    def output(self, out: NamedArray, *, key: jax.Array | None) -> NamedArray:
        """``c_proj``, then residual dropout (with a key)."""
        return _dropout(super().output(out, key=None), self.config.resid_pdrop, key)


def _materialized_attention(
    Pos: Axis,
    HeadSize: Axis,
    q: NamedArray,
    k: NamedArray,
    v: NamedArray,
    mask: AttentionMask | NamedArray | None,
    scale: float,
    cfg: Gpt2Config,
    key: jax.Array | None,
) -> NamedArray:
    """Reference attention with GPT-2's extras: float32 scores (``upcast_attn``) and dropout on the probabilities."""
    KPos = Pos.alias(KEY_POSITION)
    k, v = k.rename({Pos.name: KPos.name}), v.rename({Pos.name: KPos.name})
    explicit = mask.materialize(Pos, KPos) if isinstance(mask, AttentionMask) else mask
    weights = hattn.dot_product_attention_weights(
        HeadSize,
        KPos,
        q,
        k,
        explicit,
        attention_dtype=jnp.float32 if cfg.upcast_attn else None,
        scaling_factor=scale,
    )
    weights = _dropout(weights, cfg.attn_pdrop, key)
    return hax.dot(weights, v, axis=KPos.name)


class Gpt2Block(eqx.Module):
    """A pre-LayerNorm block, ``x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))``: the decoder's block forward
    (:func:`~ponente.models.decoder.block_forward`) under GPT-2's parameter names."""

    ln_1: LayerNorm
    attn: Gpt2Attention
    ln_2: LayerNorm
    mlp: Mlp

    @staticmethod
    def init(config: Gpt2Config, *, key: jax.Array) -> Gpt2Block:
        """Create one block."""
        keys = jax.random.split(key, 1 + config.feed_forward_keys)
        return Gpt2Block(
            ln_1=config.init_norm(config.Embed),
            attn=config.init_attention(key=keys[0]),
            ln_2=config.init_norm(config.Embed),
            mlp=config.init_feed_forward(keys[1:]),
        )

    def __call__(
        self,
        x: NamedArray,
        mask: AttentionMask | NamedArray | None,
        sliding_mask: AttentionMask | NamedArray | None = None,
        sliding: bool | NamedArray = False,
        *,
        window: int | None = None,
        pos_ids: NamedArray | None = None,
        cache: KvCache | None = None,
        layer: NamedArray | None = None,
        key: jax.Array | None = None,
    ) -> tuple[NamedArray, KvCache | None, RouterOutput | None]:
        """Apply the block (see :meth:`~ponente.models.decoder.DecoderBlock.__call__`)."""
        return block_forward(
            x,
            self.attn,
            self.mlp,
            (self.ln_1, self.ln_2, None, None),
            "pre",
            mask,
            sliding_mask,
            sliding,
            window=window,
            pos_ids=pos_ids,
            cache=cache,
            layer=layer,
            key=key,
            resid_pdrop=self.attn.config.resid_pdrop,
        )


class Gpt2Transformer(eqx.Module):
    """Token and position embeddings, the stacked blocks and the final LayerNorm (HF ``transformer``).

    Exposes them under the decoder's names (:class:`~ponente.models.decoder.DecoderStackParts`).
    """

    wte: Embedding
    wpe: Embedding
    h: Stacked[Gpt2Block]
    ln_f: LayerNorm

    @property
    def embed_tokens(self) -> Embedding:
        """The token embedding ``wte``."""
        return self.wte

    @property
    def layers(self) -> Stacked[Gpt2Block]:
        """The blocks ``h``."""
        return self.h

    @property
    def norm(self) -> LayerNorm:
        """The final norm ``ln_f``."""
        return self.ln_f


class Gpt2LMHeadModel(DecoderLM):
    """GPT-2 with the output projection tied to the token embedding: the shared decoder
    (:class:`~ponente.models.decoder.DecoderLM`) with learned position embeddings added to the token embeddings.

    Attributes:
        transformer: the embeddings, blocks and final norm.
        lm_head: always None (tied to ``transformer.wte``).
        config: the config (static).
        vocab_size: the real vocabulary size when the vocabulary axis is padded (``config.vocab_padding_multiple``);
            logits of the padded entries are masked (static).
    """

    transformer: Gpt2Transformer
    config: Gpt2Config = eqx.field(static=True)

    _hf_transposed_suffixes: ClassVar[tuple[str, ...]] = ("c_attn.weight", "c_proj.weight", "c_fc.weight")
    _hf_vocab_keys: ClassVar[tuple[str, ...]] = ("transformer.wte.weight",)

    def _state_dict_key_map(self) -> dict[str, str | None]:
        return {}

    @classmethod
    def _init_stack(cls, config: DecoderConfig, Vocab: Axis, keys: jax.Array) -> Gpt2Transformer:
        """``wte`` from ``keys[0]``, ``wpe`` from ``keys[1]``, the blocks from ``keys[2]`` (the output projection is
        tied, so :meth:`DecoderLM.init <ponente.models.decoder.DecoderLM.init>` uses no key of its own).

        Raises:
            TypeError: if ``config`` is not a :class:`Gpt2Config`.
        """
        if not isinstance(config, Gpt2Config):
            raise TypeError(f"Gpt2LMHeadModel.init: expected a Gpt2Config, got {type(config).__name__}")
        return Gpt2Transformer(
            wte=init_embedding(config, Vocab, key=keys[0]),
            wpe=init_embedding(config, Axis("n_positions", config.seq_len), key=keys[1]),
            h=init_blocks(config, Gpt2Block, key=keys[2]),
            ln_f=config.init_norm(config.Embed),
        )

    def _embed(
        self, input_ids: NamedArray, pos_ids: NamedArray | None = None, *, key: jax.Array | None = None
    ) -> NamedArray:
        """Token embeddings plus the learned position embeddings ``wpe`` of ``pos_ids``, then dropout (with a key).

        ``pos_ids`` are rows of ``wpe``, over ``position`` (and some batch axes), each below ``config.seq_len``;
        None: ``0 .. n - 1``.

        Raises:
            ValueError: if the sequence is longer than ``config.seq_len``.
        """
        Pos = input_ids.resolve_axis("position")
        if Pos.size > self.config.seq_len:
            raise ValueError(
                f"Gpt2LMHeadModel: the 'position' axis has size {Pos.size}, more than seq_len={self.config.seq_len}"
            )
        positions = hax.arange(Pos, dtype=jnp.int32) if pos_ids is None else pos_ids
        x = self.transformer.wte.embed(input_ids) + self.transformer.wpe.embed(positions)
        return _dropout(x, self.config.embed_pdrop, key)

    def init_cache(self, Batch: Axis, max_len: int, *, dtype: Any = None) -> KvCache:
        """An empty cache over ``(layers, batch, heads, cache_position, head_size)`` (see :class:`LmHeadModel`).

        Raises:
            ValueError: if ``max_len`` is below 1 or above ``config.seq_len`` (the learned positions end there).
        """
        config = self.config
        if max_len > config.seq_len:
            raise ValueError(
                f"Gpt2LMHeadModel.init_cache: max_len={max_len} is more than seq_len={config.seq_len}, the number of "
                "learned position embeddings"
            )
        dtype = self.transformer.wte.weight.dtype if dtype is None else dtype
        return KvCache.init((config.Layers, Batch, config.Heads), config.HeadSize, max_len, dtype=dtype)
