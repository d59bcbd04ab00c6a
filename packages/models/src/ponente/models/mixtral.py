"""Mixtral: Mistral attention (optional sliding window) with a sparse mixture-of-experts MLP in every block."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any, Self

import equinox as eqx
import jax
import numpy as np

import ponente.namedtensor as hax
from ponente.namedtensor import Axis, NamedArray
from ponente.namedtensor.nn import RmsNorm

from ._layer_types import with_sliding_window
from .attention import Attention, AttentionMask
from .attention.kv_cache import KvCache
from .config import lm_flops_per_token, mask_padded_vocab, padded_vocab_size, register_config
from .llama import LlamaConfig, LlamaDecoderLayer, LlamaLMHeadModel, QkNormAttention
from .moe import MOE_DISPATCHES, MoeMlp, RouterOutput, load_balancing_loss

__all__ = ["MixtralConfig", "MixtralLMHeadModel"]

ROUTER_AUX_LOSS = "router_aux_loss"
"""The key of the weighted load-balancing term in the auxiliary losses of a Mixtral model."""


@register_config("mixtral")
@dataclasses.dataclass(frozen=True)
class MixtralConfig(LlamaConfig):
    """Mixtral (Hugging Face ``MixtralForCausalLM``): Llama-style blocks whose MLP is a sparse mixture of experts.

    Inherits every :class:`LlamaConfig` field (``qk_norm`` must stay False: Hugging Face Mixtral has none).

    Attributes:
        num_experts: experts per block (``num_local_experts``).
        num_experts_per_tok: experts each token is routed to (``k``).
        router_aux_loss_coef: the weight of the load-balancing loss added to the training objective.
        sliding_window: if set, each query attends to at most this many keys (itself included), as Mistral.
        moe_dispatch: how tokens reach their experts (see :class:`~ponente.models.moe.MoeMlp`): ``"dense"``
            (named ops, experts shardable over a mesh axis, ``num_experts / k`` times the expert FLOPs) or
            ``"sorted"`` (grouped matrix products over the assignments sorted by expert, sparse FLOPs).

    Example:
        >>> import jax, ponente.namedtensor as hax
        >>> cfg = MixtralConfig(
        ...     seq_len=8,
        ...     hidden_dim=16,
        ...     intermediate_dim=24,
        ...     num_layers=2,
        ...     num_heads=4,
        ...     num_kv_heads=2,
        ...     num_experts=4,
        ...     num_experts_per_tok=2,
        ... )
        >>> model = cfg.build(hax.Axis("vocab", 11), key=jax.random.key(0))
        >>> model(hax.zeros({"position": 8}, dtype=int)).shape
        {'position': 8, 'vocab': 11}
    """

    num_experts: int = 8
    num_experts_per_tok: int = 2
    router_aux_loss_coef: float = 0.001
    sliding_window: int | None = None
    moe_dispatch: str = "dense"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"MixtralConfig: num_experts_per_tok must be in 1..num_experts ({self.num_experts}), "
                f"got {self.num_experts_per_tok}"
            )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"MixtralConfig: sliding_window must be positive or None, got {self.sliding_window}")
        if self.moe_dispatch not in MOE_DISPATCHES:
            raise ValueError(f"MixtralConfig: moe_dispatch must be one of {MOE_DISPATCHES}, got {self.moe_dispatch!r}")
        if self.qk_norm:
            raise ValueError("MixtralConfig: qk_norm=True is not supported (Hugging Face Mixtral has no QK-norm)")

    @property
    def Experts(self) -> Axis:
        """The experts axis ``experts`` (map it to a mesh axis for expert parallelism)."""
        return Axis("experts", self.num_experts)

    def attention_windows(self) -> tuple[int | None, ...]:
        """Every layer attends over ``sliding_window`` (see :meth:`LmConfig.attention_windows`)."""
        return (self.sliding_window,) * self.num_layers

    def build(self, Vocab: Axis, *, key: jax.Array) -> MixtralLMHeadModel:
        """Build a randomly initialized Mixtral (see :meth:`LmConfig.build`)."""
        return MixtralLMHeadModel.init(self, Vocab, key=key)

    def flops_per_token(self, vocab_size: int) -> float:
        """Forward FLOPs per token *of the sparse model*: ``k`` active experts per token, plus the router.

        This is the usual MoE convention for MFU. The default ``"dense"`` dispatch executes
        ``num_experts / num_experts_per_tok`` times the expert FLOPs counted here; ``"sorted"`` executes them.

        Args:
            vocab_size: the real vocabulary size.

        Returns:
            FLOPs per token.
        """
        dense = lm_flops_per_token(
            hidden_dim=self.hidden_dim,
            intermediate_dim=self.intermediate_dim * self.num_experts_per_tok,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_size=self.HeadSize.size,
            seq_len=self.seq_len,
            vocab_size=padded_vocab_size(vocab_size, self.vocab_padding_multiple),
            glu=True,
            attention_windows=self.attention_windows(),
        )
        return dense + self.num_layers * 2.0 * self.hidden_dim * self.num_experts

    def to_hf_config(self, vocab_size: int) -> dict[str, Any]:
        """The Hugging Face ``MixtralConfig`` dict, transformers-5 spelling (see :meth:`LmConfig.to_hf_config`)."""
        out = super().to_hf_config(vocab_size)
        for key in ("attention_bias", "mlp_bias"):
            del out[key]
        out.update(
            architectures=["MixtralForCausalLM"],
            model_type="mixtral",
            num_local_experts=self.num_experts,
            num_experts_per_tok=self.num_experts_per_tok,
            router_aux_loss_coef=self.router_aux_loss_coef,
            router_jitter_noise=0.0,
            sliding_window=self.sliding_window,
        )
        return out

    @classmethod
    def from_hf_config(cls, hf_config: Mapping[str, Any]) -> MixtralConfig:
        """Read a Hugging Face ``MixtralConfig`` dict, transformers-4 or -5 spelling.

        Raises:
            KeyError: if a required key is missing.
            ValueError: for options this implementation does not support (e.g. router jitter noise).
        """
        jitter = float(hf_config.get("router_jitter_noise") or 0.0)
        if jitter:
            raise ValueError(
                f"MixtralConfig.from_hf_config: router_jitter_noise={jitter} is not supported (expected 0.0)"
            )
        base = LlamaConfig.from_hf_config(hf_config)
        window = hf_config.get("sliding_window")
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(LlamaConfig)}
        return cls(
            **fields,
            num_experts=int(hf_config.get("num_local_experts", hf_config.get("num_experts", 8))),
            num_experts_per_tok=int(hf_config.get("num_experts_per_tok", 2)),
            router_aux_loss_coef=float(hf_config.get("router_aux_loss_coef", 0.001)),
            sliding_window=int(window) if window is not None else None,
        )


class MixtralDecoderLayer(eqx.Module):
    """A pre-RMSNorm block: ``x + self_attn(input_layernorm(x))``, then ``x + moe(post_attention_layernorm(x))``."""

    input_layernorm: RmsNorm
    self_attn: Attention | QkNormAttention
    post_attention_layernorm: RmsNorm
    block_sparse_moe: MoeMlp

    @staticmethod
    def init(config: MixtralConfig, *, key: jax.Array) -> MixtralDecoderLayer:
        """Create one block."""
        k_attn, k_moe = jax.random.split(key)
        Embed, eps = config.Embed, config.layer_norm_epsilon
        return MixtralDecoderLayer(
            input_layernorm=RmsNorm.init(Embed, eps=eps, use_bias=False),
            self_attn=LlamaDecoderLayer._init_attention(config, key=k_attn),
            post_attention_layernorm=RmsNorm.init(Embed, eps=eps, use_bias=False),
            block_sparse_moe=MoeMlp.init(
                Embed, config.Mlp, config.Experts, config.num_experts_per_tok, key=k_moe, dispatch=config.moe_dispatch
            ),
        )

    def __call__(
        self, x: NamedArray, mask: AttentionMask | NamedArray | None, *, pos_ids: NamedArray | None = None
    ) -> tuple[NamedArray, RouterOutput]:
        """Apply the block to ``(..., position, embed)``; also return the routing decision (for the aux loss).

        ``pos_ids`` are the rotary positions (None: ``0 .. n - 1``).
        """
        x = x + self.self_attn(self.input_layernorm(x), mask, pos_ids=pos_ids)
        y, routing = self.block_sparse_moe(self.post_attention_layernorm(x))
        return x + y, routing

    def decode(
        self, x: NamedArray, cache: KvCache, pos_ids: NamedArray, *, window: int | None = None
    ) -> tuple[NamedArray, KvCache]:
        """The block over cached keys and values (see :meth:`~ponente.models.LmHeadModel.decode`), without routing."""
        attn_out, cache = self.self_attn.decode(self.input_layernorm(x), cache, pos_ids, window=window)
        x = x + attn_out
        y, _ = self.block_sparse_moe(self.post_attention_layernorm(x))
        return x + y, cache


# Hugging Face expert layouts: per expert (checkpoint files of transformers 4 and 5), fused (transformers 5 in memory)
_PER_EXPERT = re.compile(r"^(.*)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$")
_FUSED = re.compile(r"^(.*)\.mlp\.experts\.(gate_up_proj|down_proj)$")
_FUSED_ROUTER = re.compile(r"^(.*)\.mlp\.gate\.weight$")
_STACKED = re.compile(r"^(.*)\.block_sparse_moe\.experts\.(w[123])$")


def _to_stacked_experts(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """A Hugging Face Mixtral state dict (any layout) with each block's experts stacked: ``...experts.wN``."""
    out: dict[str, Any] = {}
    per_expert: dict[str, dict[int, Any]] = {}
    for key, value in state_dict.items():
        if m := _PER_EXPERT.match(key):
            per_expert.setdefault(f"{m[1]}.block_sparse_moe.experts.{m[3]}", {})[int(m[2])] = value
        elif m := _FUSED.match(key):
            array = np.asarray(value)
            if m[2] == "down_proj":
                out[f"{m[1]}.block_sparse_moe.experts.w2"] = array
            else:  # gate_up_proj: (experts, 2 * mlp, embed), gate (w1) first
                half = array.shape[1] // 2
                out[f"{m[1]}.block_sparse_moe.experts.w1"] = array[:, :half]
                out[f"{m[1]}.block_sparse_moe.experts.w3"] = array[:, half:]
        elif m := _FUSED_ROUTER.match(key):
            out[f"{m[1]}.block_sparse_moe.gate.weight"] = value
        else:
            out[key] = value
    for key, experts in per_expert.items():
        missing = [e for e in range(max(experts) + 1) if e not in experts]
        if missing:
            raise KeyError(
                f"Mixtral state dict: {key.replace('experts.', f'experts.{missing[0]}.')}.weight is missing"
            )
        out[key] = np.stack([np.asarray(experts[e]) for e in range(len(experts))])
    return out


class MixtralLMHeadModel(LlamaLMHeadModel):
    """Mixtral: Llama's embeddings, final norm and output projection around :class:`MixtralDecoderLayer` blocks.

    Besides the logits, a forward pass yields one auxiliary loss, ``router_aux_loss``: the
    load-balancing loss (:func:`~ponente.models.moe.load_balancing_loss` over the routing of all layers)
    times ``config.router_aux_loss_coef``; see :meth:`logits_and_aux`.

    Hugging Face state dicts are read in every layout transformers uses (per-expert
    ``block_sparse_moe.experts.{e}.w1/w2/w3`` as written to files, or the fused in-memory
    ``mlp.experts.gate_up_proj/down_proj`` of transformers 5) and written per expert (both versions load it).

    Attributes:
        transformer: embeddings, layers and final norm (state-dict key ``model``).
        lm_head: ``Embed -> Vocab`` without bias, or None when tied.
        config: the config (static).
        vocab_size: the real vocabulary size when the vocabulary axis is padded (static).
    """

    config: MixtralConfig = eqx.field(static=True)

    # MixtralDecoderLayer is not a LlamaDecoderLayer (an MoE replaces the MLP), but Llama's init only stacks it
    _decoder_layer = MixtralDecoderLayer  # type: ignore[assignment]

    def _mask(self, input_ids: NamedArray, attn_mask: AttentionMask | NamedArray | None) -> AttentionMask | NamedArray:
        """``attn_mask`` (None: causal) restricted to the config's sliding window (as Mistral's)."""
        return with_sliding_window(attn_mask, self.config.sliding_window, input_ids.resolve_axis("position"))

    def _decode_kwargs(self) -> dict[str, Any]:
        """Every block attends over the config's sliding window (see :meth:`LlamaLMHeadModel.decode`)."""
        return {"window": self.config.sliding_window}

    def activations_and_aux(
        self,
        input_ids: NamedArray,
        attn_mask: AttentionMask | NamedArray | None = None,
        *,
        key: jax.Array | None = None,
        pos_ids: NamedArray | None = None,
    ) -> tuple[NamedArray, dict[str, NamedArray]]:
        """The final hidden states ``(..., position, embed)`` and the auxiliary losses.

        Args:
            input_ids: integer ids ``(..., position)``.
            attn_mask: the attention mask (None: causal); the config's sliding window is applied on top of it.
            key: unused (no dropout).
            pos_ids: the rotary positions ``(..., position)`` (None: ``0 .. n - 1``; see :class:`LmHeadModel`).

        Returns:
            ``(hidden states after the final norm, {"router_aux_loss": coef * load-balancing loss})``.
        """
        del key
        x = self.transformer.embed_tokens.embed(input_ids)
        x, routing = self.transformer.layers.scan(
            x, self._mask(input_ids, attn_mask), pos_ids=pos_ids, unroll=self.config.layer_unroll
        )
        balance = load_balancing_loss(routing.probs, routing.indices, self.config.Experts)
        return self.transformer.norm(x), {ROUTER_AUX_LOSS: balance * self.config.router_aux_loss_coef}

    def activations(
        self,
        input_ids: NamedArray,
        attn_mask: AttentionMask | NamedArray | None = None,
        *,
        key: jax.Array | None = None,
        pos_ids: NamedArray | None = None,
    ) -> NamedArray:
        """The final hidden states (see :meth:`activations_and_aux`, whose auxiliary losses this drops)."""
        return self.activations_and_aux(input_ids, attn_mask, key=key, pos_ids=pos_ids)[0]

    def logits_and_aux(
        self,
        input_ids: NamedArray,
        attn_mask: AttentionMask | NamedArray | None = None,
        *,
        key: jax.Array | None = None,
        pos_ids: NamedArray | None = None,
    ) -> tuple[NamedArray, dict[str, NamedArray]]:
        """Logits ``(..., position, vocab)`` and the auxiliary losses (``router_aux_loss``, a weighted scalar).

        Args:
            input_ids: integer ids ``(..., position)``.
            attn_mask: the attention mask (None: causal); the config's sliding window is applied on top of it.
            key: unused (no dropout).
            pos_ids: the rotary positions ``(..., position)`` (None: ``0 .. n - 1``; see :class:`LmHeadModel`).

        Returns:
            ``(logits, {"router_aux_loss": coef * load-balancing loss})``; padded vocabulary entries of the
            logits hold the dtype's most negative value.
        """
        x, aux = self.activations_and_aux(input_ids, attn_mask, key=key, pos_ids=pos_ids)
        logits = hax.dot(x, self.get_lm_head(), axis="embed")
        return mask_padded_vocab(logits, self.Vocab, self.vocab_size), aux

    def routing(
        self,
        input_ids: NamedArray,
        attn_mask: AttentionMask | NamedArray | None = None,
        *,
        pos_ids: NamedArray | None = None,
    ) -> RouterOutput:
        """The routing decision of every layer for ``input_ids`` (arrays with a leading ``layers`` axis).

        Args:
            input_ids: integer ids ``(..., position)``.
            attn_mask: the attention mask (None: causal); the config's sliding window is applied on top of it.
            pos_ids: the rotary positions ``(..., position)`` (None: ``0 .. n - 1``).

        Returns:
            Router probabilities ``(layers, ..., experts)``, chosen experts and weights ``(layers, ..., top_k)``.
        """
        x = self.transformer.embed_tokens.embed(input_ids)
        return self.transformer.layers.scan(
            x, self._mask(input_ids, attn_mask), pos_ids=pos_ids, unroll=self.config.layer_unroll
        )[1]

    def to_hf_state_dict(self) -> dict[str, np.ndarray]:
        """The parameters under their Hugging Face names, experts one by one (``block_sparse_moe.experts.{e}.wN``).

        Returns:
            The state dict that ``transformers`` (4 or 5) loads from a checkpoint file.
        """
        out: dict[str, np.ndarray] = {}
        for key, value in super().to_hf_state_dict().items():
            if m := _STACKED.match(key):
                for e in range(value.shape[0]):
                    out[f"{m[1]}.block_sparse_moe.experts.{e}.{m[2]}.weight"] = value[e]
            else:
                out[key] = value
        return out

    def from_hf_state_dict(self, state_dict: Mapping[str, Any]) -> Self:
        """A copy of this (template) model with parameters read from a Hugging Face Mixtral state dict.

        Args:
            state_dict: per-expert (``block_sparse_moe.experts.{e}.w1/w2/w3.weight``) or fused transformers-5
                (``mlp.experts.gate_up_proj/down_proj``, ``mlp.gate.weight``) layout; extra keys are ignored.

        Returns:
            The loaded model.

        Raises:
            KeyError: if a parameter (or one expert of a block) is missing.
            ValueError: if a parameter has the wrong shape.
        """
        return super().from_hf_state_dict(_to_stacked_experts(state_dict))
