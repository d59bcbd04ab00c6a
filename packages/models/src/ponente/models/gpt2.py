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
from ponente.namedtensor.nn import attention as hattn

from .attention import KEY_POSITION, AttentionMask, attention, decode_attention
from .attention.kv_cache import KvCache, take_positions
from .config import LmConfig, _real_vocab_rows, _require, mask_padded_vocab, register_config
from .lm import LmHeadModel
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


def _dropout(x: NamedArray, pdrop: float, key: jax.Array | None) -> NamedArray:
    """Dropout when a key is given and ``pdrop > 0``, else the identity."""
    if key is None or pdrop == 0.0:
        return x
    return hax.nn.dropout(x, pdrop, inference=False, key=key)


class Gpt2Attention(eqx.Module):
    """Causal self-attention with a fused ``c_attn`` (Q, K, V) projection and ``c_proj`` output projection.

    Attributes:
        c_attn: ``Embed -> (qkv, Heads, HeadSize)``.
        c_proj: ``(Heads, HeadSize) -> Embed``.
        config: the config (static): scaling, upcasting, dropout and backend options.
    """

    c_attn: Linear
    c_proj: Linear
    config: Gpt2Config = eqx.field(static=True)

    @staticmethod
    def init(config: Gpt2Config, *, key: jax.Array) -> Gpt2Attention:
        """Create the projections."""
        k1, k2 = jax.random.split(key)
        Qkv = Axis("qkv", 3)
        return Gpt2Attention(
            c_attn=Linear.init(config.Embed, (Qkv, config.Heads, config.HeadSize), key=k1),
            c_proj=Linear.init((config.Heads, config.HeadSize), config.Embed, key=k2),
            config=config,
        )

    def __call__(
        self,
        x: NamedArray,
        mask: AttentionMask | NamedArray | None,
        layer_idx: NamedArray | int = 0,
        *,
        key: jax.Array | None = None,
    ) -> NamedArray:
        """Attend over ``position``.

        Args:
            x: ``(..., position, embed)``.
            mask: the attention mask.
            layer_idx: this block's index in the stack (a scalar, traced inside the layer scan); used by
                ``scale_attn_by_inverse_layer_idx``.
            key: PRNG key for attention and residual dropout (None: no dropout).

        Returns:
            ``(..., position, embed)``.
        """
        cfg = self.config
        Pos = x.resolve_axis("position")
        qkv = self.c_attn(x)
        HeadSize = qkv.resolve_axis("head_size")
        q, k, v = (qkv["qkv", i] for i in range(3))
        scale = HeadSize.size**-0.5 if cfg.scale_attn_weights else 1.0
        q = self._scaled_query(q, layer_idx)
        k_attn, k_resid = (None, None) if key is None else jax.random.split(key)
        if cfg.upcast_attn or (cfg.attn_pdrop > 0 and k_attn is not None):
            q, k, v = tag((q, k, v), "attn_qkv")
            out = tag(_materialized_attention(Pos, HeadSize, q, k, v, mask, scale, cfg, k_attn), "attn_context")
        else:
            out = attention(
                Pos,
                HeadSize,
                q,
                k,
                v,
                mask,
                scaling_factor=scale,
                backend=cfg.attn_backend,
                block_size=cfg.flash_attention_block_size,
            )
        return _dropout(tag(self.c_proj(out), "attn_out"), cfg.resid_pdrop, k_resid)

    def decode(
        self, x: NamedArray, cache: KvCache, pos_ids: NamedArray, layer_idx: NamedArray | int = 0
    ) -> tuple[NamedArray, KvCache]:
        """Attend from the tokens of ``x`` over the cache, after writing their keys and values to it (no dropout).

        Args:
            x: ``(batch, position, embed)``.
            cache: this layer's cache (see :meth:`~ponente.models.LmHeadModel.decode`).
            pos_ids: the tokens' positions over ``(batch, position)``.
            layer_idx: this block's index in the stack (see :meth:`__call__`).

        Returns:
            ``((batch, position, embed), the updated cache)``.
        """
        qkv = self.c_attn(x)
        HeadSize = qkv.resolve_axis("head_size")
        q, k, v = (qkv["qkv", i] for i in range(3))
        q = self._scaled_query(q, layer_idx)
        cache = cache.update(k, v, pos_ids)
        cfg = self.config
        scale = HeadSize.size**-0.5 if cfg.scale_attn_weights else 1.0
        # a prefill attends like the forward pass: upcast attention materializes the scores (in float32)
        backend = "reference" if cfg.upcast_attn else cfg.attn_backend
        block = cfg.flash_attention_block_size
        out = decode_attention(HeadSize, q, cache, pos_ids, scaling_factor=scale, backend=backend, block_size=block)
        return self.c_proj(out), cache

    def _scaled_query(self, q: NamedArray, layer_idx: NamedArray | int) -> NamedArray:
        """``q``, divided by ``layer_idx + 1`` with ``scale_attn_by_inverse_layer_idx``."""
        if not self.config.scale_attn_by_inverse_layer_idx:
            return q
        # scaling q scales the scores; layer_idx is traced in the scan, so it cannot be a static factor
        index = layer_idx.array if isinstance(layer_idx, NamedArray) else layer_idx
        return q / (jnp.asarray(index) + 1).astype(q.dtype)


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


class Gpt2Mlp(eqx.Module):
    """``c_proj(gelu_tanh(c_fc(x)))``."""

    c_fc: Linear
    c_proj: Linear

    def __call__(self, x: NamedArray) -> NamedArray:
        """Apply the MLP to ``(..., embed)``."""
        return tag(self.c_proj(hax.nn.gelu(tag(self.c_fc(x), "mlp_in"), approximate=True)), "mlp_out")


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

    def __call__(
        self,
        x: NamedArray,
        mask: AttentionMask | NamedArray | None,
        layer_idx: NamedArray | int = 0,
        key: jax.Array | None = None,
    ) -> NamedArray:
        """Apply the block to ``(..., position, embed)``.

        Args:
            x: the residual stream.
            mask: the attention mask.
            layer_idx: this block's index in the stack.
            key: PRNG key for dropout (None: no dropout).

        Returns:
            The updated residual stream.
        """
        k_attn, k_mlp = (None, None) if key is None else jax.random.split(key)
        x = x + self.attn(self.ln_1(x), mask, layer_idx, key=k_attn)
        return x + _dropout(self.mlp(self.ln_2(x)), self.attn.config.resid_pdrop, k_mlp)

    def decode(
        self, x: NamedArray, cache: KvCache, pos_ids: NamedArray, layer_idx: NamedArray | int = 0
    ) -> tuple[NamedArray, KvCache]:
        """The block over cached keys and values (see :meth:`~ponente.models.LmHeadModel.decode`), no dropout."""
        attn_out, cache = self.attn.decode(self.ln_1(x), cache, pos_ids, layer_idx)
        x = x + attn_out
        return x + self.mlp(self.ln_2(x)), cache


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
        vocab_size: the real vocabulary size when the vocabulary axis is padded (``config.vocab_padding_multiple``);
            logits of the padded entries are masked (static).
    """

    transformer: Gpt2Transformer
    config: Gpt2Config = eqx.field(static=True)
    vocab_size: int | None = eqx.field(static=True, default=None)

    _hf_transposed_suffixes: ClassVar[tuple[str, ...]] = ("c_attn.weight", "c_proj.weight", "c_fc.weight")
    _hf_vocab_keys: ClassVar[tuple[str, ...]] = ("transformer.wte.weight",)

    @staticmethod
    def init(config: Gpt2Config, Vocab: Axis, *, key: jax.Array) -> Gpt2LMHeadModel:
        """Create a randomly initialized model.

        Args:
            config: the config.
            Vocab: the (real) vocabulary axis; the model's is padded to ``config.vocab_padding_multiple``.
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
            wte=Embedding.init(config.padded_vocab(Vocab), config.Embed, key=k_wte, initializer_range=std),
            wpe=Embedding.init(Axis("n_positions", config.seq_len), config.Embed, key=k_wpe, initializer_range=std),
            h=blocks,
            ln_f=LayerNorm.init(config.Embed, eps=config.layer_norm_epsilon),
        )
        return Gpt2LMHeadModel(transformer=transformer, config=config, vocab_size=Vocab.size)

    @property
    def Vocab(self) -> Axis:
        """The vocabulary axis of the logits (padded if ``config.vocab_padding_multiple > 1``)."""
        return self.transformer.wte.Vocab

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
            attn_mask: the attention mask (None: causal).
            key: PRNG key for dropout (None: deterministic).
            pos_ids: the rows of the learned position embedding ``wpe`` to add, over ``position`` (and some batch
                axes), each below ``config.seq_len``; None: ``0 .. n - 1``.

        Returns:
            The hidden states after ``ln_f``.

        Raises:
            ValueError: if the sequence is longer than ``config.seq_len``.
        """
        Pos = input_ids.resolve_axis("position")
        if Pos.size > self.config.seq_len:
            raise ValueError(
                f"Gpt2LMHeadModel: the 'position' axis has size {Pos.size}, more than seq_len={self.config.seq_len}"
            )
        k_embed, k_layers = (None, None) if key is None else jax.random.split(key)
        mask = AttentionMask.causal() if attn_mask is None else attn_mask
        positions = hax.arange(Pos, dtype=jnp.int32) if pos_ids is None else pos_ids
        x = self.transformer.wte.embed(input_ids) + self.transformer.wpe.embed(positions)
        x = _dropout(x, self.config.embed_pdrop, k_embed)
        layer_ids = hax.arange(self.config.Layers, dtype=jnp.int32)
        layer_keys = None if k_layers is None else jax.random.split(k_layers, self.config.num_layers)
        x = self.transformer.h.fold(x, mask, layer_ids, layer_keys, unroll=self.config.layer_unroll)
        return self.transformer.ln_f(x)

    def get_lm_head(self) -> NamedArray:
        """The output projection ``(vocab, embed)``: the token embedding (tied), without padded vocabulary rows."""
        return _real_vocab_rows(self.transformer.wte.weight, self.Vocab, self.vocab_size)

    def __call__(
        self,
        input_ids: NamedArray,
        attn_mask: AttentionMask | NamedArray | None = None,
        *,
        key: jax.Array | None = None,
        pos_ids: NamedArray | None = None,
    ) -> NamedArray:
        """Logits ``(..., position, vocab)`` for ``input_ids`` ``(..., position)`` (see :class:`LmHeadModel`).

        Args:
            input_ids: integer ids ``(..., position)``.
            attn_mask: the attention mask (None: causal).
            key: PRNG key for dropout (None: deterministic).
            pos_ids: the position-embedding rows (see :meth:`activations`).

        Returns:
            The logits; padded vocabulary entries hold the dtype's most negative value.

        Raises:
            ValueError: if the sequence is longer than ``config.seq_len``.
        """
        logits = self.transformer.wte.unembed(self.activations(input_ids, attn_mask, key=key, pos_ids=pos_ids))
        return mask_padded_vocab(logits, self.Vocab, self.vocab_size)

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

    def decode(
        self,
        tokens: NamedArray,
        cache: KvCache,
        pos_ids: NamedArray,
        *,
        key: jax.Array | None = None,
        logits_at: NamedArray | None = None,
    ) -> tuple[NamedArray, KvCache]:
        """Logits of ``tokens`` over the cached earlier tokens, and the updated cache (see :class:`LmHeadModel`).

        ``pos_ids`` also select the learned position embeddings (rows ``< config.seq_len``). No dropout.
        """
        del key
        pos_ids = hax.broadcast_to(pos_ids, tokens.axes)
        x = self.transformer.wte.embed(tokens) + self.transformer.wpe.embed(pos_ids)
        layer_ids = hax.arange(self.config.Layers, dtype=jnp.int32)
        # the stacked cache is the fold's carry and each layer writes its slots in place (no per-layer copies)
        x, cache = self.transformer.h.fold_via(_decode_block, unroll=self.config.layer_unroll)(
            (x, cache.at_layer(0)), pos_ids, layer_ids
        )
        logits = self.transformer.wte.unembed(self.transformer.ln_f(take_positions(x, logits_at)))
        return mask_padded_vocab(logits, self.Vocab, self.vocab_size), cache.at_layer(None).for_prefill(False)


def _decode_block(
    block: Gpt2Block, carry: tuple[NamedArray, KvCache], pos_ids: NamedArray, layer_idx: NamedArray
) -> tuple[NamedArray, KvCache]:
    """``block.decode`` on layer ``layer_idx`` of the stacked cache (the fold step of ``Gpt2LMHeadModel.decode``)."""
    x, cache = carry
    return block.decode(x, cache.at_layer(layer_idx.array), pos_ids, layer_idx)
