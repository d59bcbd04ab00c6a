"""Llama 1/2/3: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU MLP, tied or untied output."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar, Self

import equinox as eqx
import jax

import ponente.namedtensor as hax
from ponente.namedtensor import Axis, NamedArray
from ponente.namedtensor.nn import Embedding, Linear, RmsNorm, Stacked
from ponente.namedtensor.state_dict import ModuleWithStateDictSerialization

from .attention import Attention, AttentionMask, attention
from .attention.kv_cache import KvCache, take_positions
from .config import LmConfig, _real_vocab_rows, _require, mask_padded_vocab, register_config
from .lm import LmHeadModel
from .remat import tag
from .rotary import RotaryConfig, apply_rotary

__all__ = ["LlamaConfig", "LlamaLMHeadModel", "QkNormAttention"]


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

    def build(self, Vocab: Axis, *, key: jax.Array) -> LlamaLMHeadModel:
        """Build a randomly initialized Llama (see :meth:`LmConfig.build`)."""
        return LlamaLMHeadModel.init(self, Vocab, key=key)

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


class LlamaMlp(eqx.Module):
    """SwiGLU: ``down_proj(silu(gate_proj(x)) * up_proj(x))``."""

    gate_proj: Linear
    up_proj: Linear
    down_proj: Linear

    def __call__(self, x: NamedArray) -> NamedArray:
        """Apply the MLP to ``(..., embed)``."""
        gate, up = tag((self.gate_proj(x), self.up_proj(x)), "mlp_in")
        return tag(self.down_proj(hax.nn.silu(gate) * up), "mlp_out")


class QkNormAttention(ModuleWithStateDictSerialization):
    """Grouped-query attention whose queries and keys are RMS-normalized over ``head_size`` before rotary.

    Reuses :class:`Attention`'s projections, rotary settings and backend; the norms are the QK-norm of
    Qwen3 and OLMo2 (one learned scale of size ``head_size`` shared by all heads). Its state-dict keys
    are ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``q_norm`` and ``k_norm`` (as Hugging Face's).

    Attributes:
        attn: the projections, rotary settings and backend.
        q_norm: the query norm over ``head_size``.
        k_norm: the key norm over ``head_size``.
    """

    attn: Attention
    q_norm: RmsNorm
    k_norm: RmsNorm

    def _state_dict_key_map(self) -> dict[str, str | None]:
        return {"attn": None}

    @staticmethod
    def init(attn: Attention, *, eps: float) -> QkNormAttention:
        """Add QK-norm (unit scales) to ``attn``.

        Args:
            attn: the attention layer.
            eps: the norms' epsilon.

        Returns:
            The layer.
        """
        HeadSize = attn.o_proj.weight.resolve_axis("head_size")
        return QkNormAttention(
            attn=attn,
            q_norm=RmsNorm.init(HeadSize, eps=eps, use_bias=False),
            k_norm=RmsNorm.init(HeadSize, eps=eps, use_bias=False),
        )

    def __call__(
        self,
        x: NamedArray,
        mask: AttentionMask | NamedArray | None,
        *,
        key: jax.Array | None = None,
        pos_ids: NamedArray | None = None,
    ) -> NamedArray:
        """Attend over the ``position`` axis of ``x`` (``(..., position, embed)``), like :class:`Attention`."""
        del key
        a = self.attn
        Pos = x.resolve_axis("position")
        HeadSize = a.o_proj.weight.resolve_axis("head_size")
        q, k, v = self.q_norm(a.q_proj(x)), self.k_norm(a.k_proj(x)), a.v_proj(x)
        if a.rotary is not None:
            q = apply_rotary(q, Pos, HeadSize, a.rotary, pos_ids)
            k = apply_rotary(k, Pos, HeadSize, a.rotary, pos_ids)
        out = attention(Pos, HeadSize, q, k, v, mask, backend=a.backend, block_size=a.block_size)
        return tag(a.o_proj(out), "attn_out")

    def decode(
        self, x: NamedArray, cache: KvCache, pos_ids: NamedArray, *, window: int | None = None
    ) -> tuple[NamedArray, KvCache]:
        """Cached attention of ``x``'s tokens (see :meth:`Attention.decode`), with the QK-norm."""
        a = self.attn
        q, k, v = self.q_norm(a.q_proj(x)), self.k_norm(a.k_proj(x)), a.v_proj(x)
        return a.decode_projected(q, k, v, cache, pos_ids, window=window)


class LlamaDecoderLayer(eqx.Module):
    """A pre-RMSNorm block: ``x + self_attn(input_layernorm(x))`` then ``x + mlp(post_attention_layernorm(x))``."""

    input_layernorm: RmsNorm
    self_attn: Attention | QkNormAttention
    post_attention_layernorm: RmsNorm
    mlp: LlamaMlp

    @staticmethod
    def _init_attention(config: LlamaConfig, *, key: jax.Array) -> Attention | QkNormAttention:
        """The self-attention of one block (subclasses override it, e.g. to add biases)."""
        attn = Attention.init(
            config.Embed,
            config.KVHeads,
            config.QHeadsPerGroup,
            config.HeadSize,
            use_bias=False,
            rotary=config.rope,
            key=key,
            backend=config.attn_backend,
            block_size=config.flash_attention_block_size,
        )
        return QkNormAttention.init(attn, eps=config.layer_norm_epsilon) if config.qk_norm else attn

    @classmethod
    def init(cls, config: LlamaConfig, *, key: jax.Array) -> Self:
        """Create one block (of this class, with :meth:`_init_attention`'s attention)."""
        k_attn, k_gate, k_up, k_down = jax.random.split(key, 4)
        Embed, Mlp, eps = config.Embed, config.Mlp, config.layer_norm_epsilon
        return cls(
            input_layernorm=RmsNorm.init(Embed, eps=eps, use_bias=False),
            self_attn=cls._init_attention(config, key=k_attn),
            post_attention_layernorm=RmsNorm.init(Embed, eps=eps, use_bias=False),
            mlp=LlamaMlp(
                Linear.init(Embed, Mlp, key=k_gate, use_bias=False),
                Linear.init(Embed, Mlp, key=k_up, use_bias=False),
                Linear.init(Mlp, Embed, key=k_down, use_bias=False),
            ),
        )

    def __call__(
        self, x: NamedArray, mask: AttentionMask | NamedArray | None, *, pos_ids: NamedArray | None = None
    ) -> NamedArray:
        """Apply the block to ``(..., position, embed)`` (``pos_ids``: the rotary positions, None: ``0 .. n - 1``)."""
        x = x + self.self_attn(self.input_layernorm(x), mask, pos_ids=pos_ids)
        return x + self.mlp(self.post_attention_layernorm(x))

    def decode(
        self, x: NamedArray, cache: KvCache, pos_ids: NamedArray, *, window: int | None = None
    ) -> tuple[NamedArray, KvCache]:
        """The block over cached keys and values (see :meth:`LlamaLMHeadModel.decode`); ``window``: sliding window."""
        attn_out, cache = self.self_attn.decode(self.input_layernorm(x), cache, pos_ids, window=window)
        x = x + attn_out
        return x + self.mlp(self.post_attention_layernorm(x)), cache


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
        vocab_size: the real vocabulary size when the vocabulary axis is padded (``config.vocab_padding_multiple``);
            logits of the padded entries are masked (static).
    """

    transformer: LlamaTransformer
    lm_head: Linear | None
    config: LlamaConfig = eqx.field(static=True)
    vocab_size: int | None = eqx.field(static=True, default=None)

    _hf_vocab_keys: ClassVar[tuple[str, ...]] = ("model.embed_tokens.weight", "lm_head.weight")
    _decoder_layer: ClassVar[type[LlamaDecoderLayer]] = LlamaDecoderLayer
    """The block class :meth:`init` stacks (subclasses such as Qwen's set their own)."""

    def _state_dict_key_map(self) -> dict[str, str | None]:
        return {"transformer": "model"}

    @classmethod
    def init(cls, config: LlamaConfig, Vocab: Axis, *, key: jax.Array) -> Self:
        """Create a randomly initialized model (of this class, stacking ``_decoder_layer`` blocks).

        Args:
            config: the config.
            Vocab: the (real) vocabulary axis; the model's is padded to ``config.vocab_padding_multiple``.
            key: the PRNG key.

        Returns:
            The model.
        """
        k_emb, k_layers, k_head = jax.random.split(key, 3)
        PaddedVocab = config.padded_vocab(Vocab)
        layers = Stacked.init(config.Layers, cls._decoder_layer, gradient_checkpointing=config.gradient_checkpointing)(
            config, key=jax.random.split(k_layers, config.num_layers)
        )
        transformer = LlamaTransformer(
            embed_tokens=Embedding.init(
                PaddedVocab, config.Embed, key=k_emb, initializer_range=config.initializer_range
            ),
            layers=layers,
            norm=RmsNorm.init(config.Embed, eps=config.layer_norm_epsilon, use_bias=False),
        )
        lm_head = None
        if not config.tie_word_embeddings:
            lm_head = Linear.init(config.Embed, PaddedVocab, key=k_head, use_bias=False)
        return cls(transformer=transformer, lm_head=lm_head, config=config, vocab_size=Vocab.size)

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
            attn_mask: the attention mask (None: causal).
            key: unused (Llama has no dropout).
            pos_ids: the rotary positions ``(..., position)`` (None: ``0 .. n - 1``; see :class:`LmHeadModel`).

        Returns:
            The hidden states after the final norm.
        """
        del key
        mask = AttentionMask.causal() if attn_mask is None else attn_mask
        x = self.transformer.embed_tokens.embed(input_ids)
        x = self.transformer.layers.fold(x, mask, pos_ids=pos_ids, unroll=self.config.layer_unroll)
        return self.transformer.norm(x)

    def get_lm_head(self) -> NamedArray:
        """The output projection (``embed``, ``vocab``): ``lm_head``'s, or the token embedding if tied.

        With a padded vocabulary only the real entries are returned, so a loss computed from it (the
        blockwise loss) never sees the padding.
        """
        weight = self.transformer.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return _real_vocab_rows(weight, self.Vocab, self.vocab_size)

    def __call__(
        self,
        input_ids: NamedArray,
        attn_mask: AttentionMask | NamedArray | None = None,
        *,
        key: jax.Array | None = None,
        pos_ids: NamedArray | None = None,
    ) -> NamedArray:
        """Logits ``(..., position, vocab)`` for ``input_ids`` ``(..., position)`` (see :class:`LmHeadModel`).

        Padded vocabulary entries hold the dtype's most negative value.
        """
        return self._logits(self.activations(input_ids, attn_mask, key=key, pos_ids=pos_ids))

    def _logits(self, x: NamedArray) -> NamedArray:
        """The output projection of final hidden states; padded vocabulary entries get the most negative value."""
        logits = self.transformer.embed_tokens.unembed(x) if self.lm_head is None else self.lm_head(x)
        return mask_padded_vocab(logits, self.Vocab, self.vocab_size)

    def init_cache(self, Batch: Axis, max_len: int, *, dtype: Any = None) -> KvCache:
        """An empty cache over ``(layers, batch, kv_heads, cache_position, head_size)`` (see :class:`LmHeadModel`).

        Raises:
            ValueError: if ``max_len`` is below 1.
        """
        config = self.config
        dtype = self.transformer.embed_tokens.weight.dtype if dtype is None else dtype
        return KvCache.init((config.Layers, Batch, config.KVHeads), config.HeadSize, max_len, dtype=dtype)

    def _decode_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of every block's ``decode`` (e.g. the sliding window; subclasses add theirs)."""
        return {}

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
        x = self.transformer.embed_tokens.embed(tokens)
        # the stacked cache is the fold's carry and each layer writes its slots in place (no per-layer copies)
        layer_ids = hax.arange(cache.keys.resolve_axis("layers"))
        x, cache = self.transformer.layers.fold_via(_decode_layer, unroll=self.config.layer_unroll)(
            (x, cache.at_layer(0)), layer_ids, pos_ids, **self._decode_kwargs()
        )
        cache = cache.at_layer(None).for_prefill(False)
        return self._logits(self.transformer.norm(take_positions(x, logits_at))), cache


def _decode_layer(
    block: Any, carry: tuple[NamedArray, KvCache], layer: NamedArray, *args: Any, **kwargs: Any
) -> tuple[NamedArray, KvCache]:
    """``block.decode`` on layer ``layer`` of the stacked cache (the fold step of :meth:`LlamaLMHeadModel.decode`)."""
    x, cache = carry
    out: tuple[NamedArray, KvCache] = block.decode(x, cache.at_layer(layer.array), *args, **kwargs)
    return out
