"""A sparse mixture-of-experts MLP: top-k routing, capacity-free dispatch with named ops, load-balancing loss.

The experts are SwiGLU MLPs whose weights carry an ``experts`` axis, so sharding them over a mesh axis
(expert parallelism) is one entry of an axis mapping, e.g. ``{"experts": "data"}``; no model code changes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

import ponente.namedtensor as hax
from ponente.namedtensor import Axis, NamedArray
from ponente.namedtensor.nn import Linear
from ponente.namedtensor.state_dict import ModuleWithStateDictSerialization

from .config import lm_flops_per_token, padded_vocab_size
from .remat import tag

__all__ = [
    "MOE_DISPATCHES",
    "ClampedSwiGlu",
    "MoeMlp",
    "RouterOutput",
    "check_moe_fields",
    "load_balancing_loss",
    "route_top_k",
    "route_top_k_softmax",
    "sparse_flops_per_token",
]

MOE_DISPATCHES = ("dense", "sorted")
"""The expert dispatch strategies of :class:`MoeMlp`."""

TOP_K = "top_k"
"""The name of the axis of the ``k`` experts chosen per token."""


class RouterOutput(eqx.Module):
    """What the router decided for every token.

    Attributes:
        probs: the softmax of the router logits over ``experts`` (float32), ``(..., experts)``.
        weights: the combination weights of the chosen experts (renormalized to sum to 1 unless the layer says
            otherwise), ``(..., top_k)``.
        indices: the chosen experts (integer ids, best first), ``(..., top_k)``.
    """

    probs: NamedArray
    weights: NamedArray
    indices: NamedArray


def route_top_k(router_logits: NamedArray, Experts: Axis, k: int, *, normalize: bool = True) -> RouterOutput:
    """Top-k routing as Mixtral does it: softmax over experts, keep the ``k`` best, renormalize their weights
    (``normalize=False``: keep their probabilities, as Qwen3-MoE without ``norm_topk_prob``).

    The softmax is computed in float32 whatever the logits' dtype (as ``transformers`` does).

    Args:
        router_logits: ``(..., Experts)`` router logits.
        Experts: the experts axis.
        k: experts per token (``num_experts_per_tok``), between 1 and ``Experts.size``.
        normalize: renormalize the ``k`` chosen probabilities to sum to 1.

    Returns:
        The probabilities, the chosen experts and their combination weights (axis ``top_k`` of size ``k``).

    Raises:
        ValueError: if ``k`` is not in ``1 .. Experts.size``.

    Example:
        >>> import jax.numpy as jnp, ponente.namedtensor as hax
        >>> E = hax.Axis("experts", 3)
        >>> r = route_top_k(hax.named(jnp.log(jnp.array([0.2, 0.5, 0.3])), "experts"), E, 2)
        >>> r.indices.array.tolist(), [round(w, 4) for w in r.weights.array.tolist()]
        ([1, 2], [0.625, 0.375])
    """
    if not 1 <= k <= Experts.size:
        raise ValueError(f"route_top_k: k must be in 1..{Experts.size} (the size of axis {Experts.name!r}), got {k}")
    probs = hax.nn.softmax(router_logits.astype(jnp.float32), Experts)
    top, indices = hax.top_k(probs, Experts, k, new_axis=TOP_K)
    return RouterOutput(probs=probs, weights=top / hax.sum(top, TOP_K) if normalize else top, indices=indices)


def route_top_k_softmax(router_logits: NamedArray, Experts: Axis, k: int) -> RouterOutput:
    """Top-k routing as gpt-oss does it: keep the ``k`` highest logits, and softmax over those ``k`` alone.

    The weights are the softmax of the chosen logits (summing to 1); ``probs`` is the softmax over every expert, as
    the load-balancing loss reads it (transformers' ``load_balancing_loss_func``). Computed in float32.

    Args:
        router_logits: ``(..., Experts)`` router logits.
        Experts: the experts axis.
        k: experts per token (``num_experts_per_tok``), between 1 and ``Experts.size``.

    Returns:
        The probabilities, the chosen experts and their combination weights (axis ``top_k`` of size ``k``).

    Raises:
        ValueError: if ``k`` is not in ``1 .. Experts.size``.

    Example:
        >>> import jax.numpy as jnp, ponente.namedtensor as hax
        >>> E = hax.Axis("experts", 3)
        >>> r = route_top_k_softmax(hax.named(jnp.log(jnp.array([0.2, 0.5, 0.3])), "experts"), E, 2)
        >>> r.indices.array.tolist(), [round(w, 4) for w in r.weights.array.tolist()]
        ([1, 2], [0.625, 0.375])
    """
    if not 1 <= k <= Experts.size:
        raise ValueError(
            f"route_top_k_softmax: k must be in 1..{Experts.size} (the size of axis {Experts.name!r}), got {k}"
        )
    logits = router_logits.astype(jnp.float32)
    top, indices = hax.top_k(logits, Experts, k, new_axis=TOP_K)
    return RouterOutput(probs=hax.nn.softmax(logits, Experts), weights=hax.nn.softmax(top, TOP_K), indices=indices)


@dataclasses.dataclass(frozen=True)
class ClampedSwiGlu:
    """gpt-oss's expert activation: a SwiGLU with a sigmoid gain and clamped inputs, and ``up`` shifted by one.

    ``(clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, limit)``.

    Attributes:
        alpha: the sigmoid's gain (``swiglu_alpha``).
        limit: the clamp (``swiglu_limit``): ``gate`` from above, ``up`` on both sides.

    Example:
        >>> import jax.numpy as jnp
        >>> ClampedSwiGlu(alpha=1.0, limit=1.0)(jnp.array([0.0, 9.0]), jnp.array([5.0, -1.0])).tolist()
        [0.0, 0.0]
    """

    alpha: float = 1.702
    limit: float = 7.0

    def __call__(self, gate: jax.Array, up: jax.Array) -> jax.Array:
        """The activation of the experts' ``gate`` and ``up`` projections (same shapes)."""
        gate = jnp.minimum(gate, self.limit)
        up = jnp.clip(up, -self.limit, self.limit)
        return (up + 1) * gate * jax.nn.sigmoid(self.alpha * gate)


def _assignments(indices: NamedArray, Experts: Axis) -> NamedArray:
    """``(..., experts)``: how many of a token's top-k slots chose each expert (0 or 1 each)."""
    return hax.sum(hax.nn.one_hot(indices, Experts, dtype=jnp.float32), TOP_K)


def load_balancing_loss(probs: NamedArray, indices: NamedArray, Experts: Axis) -> NamedArray:
    """The Switch-Transformer load-balancing loss, as ``transformers``' ``load_balancing_loss_func`` computes it.

    ``E * sum_e f_e * P_e``, where ``f_e`` is the number of top-k assignments to expert ``e`` divided
    by the number of tokens and ``P_e`` the mean router probability of ``e``; both are averaged over
    every axis but ``Experts`` (tokens of every batch row, position and layer, as transformers
    concatenates the layers' router logits). Its minimum, ``k``, is reached by a perfectly balanced router.

    Args:
        probs: router probabilities ``(..., Experts)`` (e.g. stacked over layers).
        indices: the chosen experts ``(..., top_k)`` with the same other axes.
        Experts: the experts axis.

    Returns:
        A scalar NamedArray (float32).

    Example:
        >>> import jax.numpy as jnp, ponente.namedtensor as hax
        >>> E = hax.Axis("experts", 2)
        >>> r = route_top_k(hax.named(jnp.array([[1.0, 0.0], [0.0, 1.0]]), ("position", "experts")), E, 1)
        >>> float(load_balancing_loss(r.probs, r.indices, E).scalar())
        1.0
    """
    f = hax.mean(_assignments(indices, Experts), axis=tuple(ax for ax in indices.axes if ax.name != TOP_K))
    p = hax.mean(probs.astype(jnp.float32), axis=tuple(ax for ax in probs.axes if ax.name != Experts.name))
    return hax.sum(f * p) * Experts.size


class MoeMlp(ModuleWithStateDictSerialization):
    """A sparse mixture of SwiGLU experts with top-k routing (Mixtral's ``block_sparse_moe``).

    Each token goes to the ``k`` experts its router scores highest; the output is the sum of their
    outputs weighted by the renormalized router probabilities. Dispatch is *capacity-free* (no token
    is ever dropped), by one of two strategies:

    - ``"dense"`` (default), written with named ops: every expert computes every token, and the
      combination weights (zero outside the top-k) are contracted over the ``experts`` axis, so the
      experts shard over any mesh axis the ``experts`` axis maps to. It costs ``num_experts / k`` times
      the expert FLOPs of a sparse dispatch: ``6 * E * embed * mlp`` per token instead of
      ``6 * k * embed * mlp`` (plus ``2 * E * embed`` for the router).
    - ``"sorted"``: the ``tokens * k`` assignments are sorted by expert, each expert multiplies only
      its own tokens (``jax.lax.ragged_dot``, grouped matrix products), and the weighted results are
      scattered back: ``6 * k * embed * mlp`` FLOPs per token. Meant for one device (or replicated
      experts); under an ``experts`` sharding the compiler may gather the expert weights.

    Attributes:
        router: ``Embed -> Experts``, with a bias or not (state-dict key ``gate``).
        gate_proj: ``(experts, mlp, embed)``, the experts' gate projections (key ``experts.w1``).
        up_proj: ``(experts, mlp, embed)``, the experts' up projections (key ``experts.w3``).
        down_proj: ``(experts, embed, mlp)``, the experts' down projections (key ``experts.w2``).
        num_experts_per_tok: ``k`` (static).
        dispatch: ``"dense"`` or ``"sorted"`` (static).
        norm_topk_prob: renormalize the chosen experts' probabilities to sum to 1 (Mixtral; static).
        gate_bias: ``(experts, mlp)``, the gate projections' biases (key ``experts.b1``), or None (gpt-oss has them).
        up_bias: ``(experts, mlp)``, the up projections' biases (key ``experts.b3``), or None.
        down_bias: ``(experts, embed)``, the down projections' biases (key ``experts.b2``), or None.
        activation: the experts' gated activation: None for SwiGLU (``silu(gate) * up``), or a
            :class:`ClampedSwiGlu` (gpt-oss) (static).
        softmax_after_top_k: route with :func:`route_top_k_softmax` (softmax over the ``k`` chosen logits, gpt-oss)
            instead of :func:`route_top_k` (static).
    """

    router: Linear
    gate_proj: NamedArray
    up_proj: NamedArray
    down_proj: NamedArray
    num_experts_per_tok: int = eqx.field(static=True)
    dispatch: str = eqx.field(static=True, default="dense")
    norm_topk_prob: bool = eqx.field(static=True, default=True)
    gate_bias: NamedArray | None = None
    up_bias: NamedArray | None = None
    down_bias: NamedArray | None = None
    activation: ClampedSwiGlu | None = eqx.field(static=True, default=None)
    softmax_after_top_k: bool = eqx.field(static=True, default=False)

    def _state_dict_key_map(self) -> dict[str, str | None]:
        return {
            "router": "gate",
            "gate_proj": "experts.w1",
            "up_proj": "experts.w3",
            "down_proj": "experts.w2",
            "gate_bias": "experts.b1",
            "up_bias": "experts.b3",
            "down_bias": "experts.b2",
        }

    @staticmethod
    def init(
        Embed: Axis,
        Mlp: Axis,
        Experts: Axis,
        num_experts_per_tok: int,
        *,
        key: jax.Array,
        dispatch: str = "dense",
        norm_topk_prob: bool = True,
        bias: bool = False,
        activation: ClampedSwiGlu | None = None,
        softmax_after_top_k: bool = False,
    ) -> MoeMlp:
        """Create a randomly initialized layer (normal weights scaled by ``1/sqrt(fan_in)``).

        Args:
            Embed: the model-width axis.
            Mlp: one expert's hidden axis.
            Experts: the experts axis.
            num_experts_per_tok: ``k``, the experts per token.
            key: the PRNG key.
            dispatch: ``"dense"`` or ``"sorted"`` (see the class docstring).
            norm_topk_prob: renormalize the chosen experts' probabilities (see :func:`route_top_k`).
            bias: give the router and the experts' projections biases (zeros).
            activation: the experts' activation (None: SwiGLU; see the class docstring).
            softmax_after_top_k: route with :func:`route_top_k_softmax` (see the class docstring).

        Returns:
            The layer.

        Raises:
            ValueError: if ``num_experts_per_tok`` is not in ``1 .. Experts.size``, or for an unknown ``dispatch``.
        """
        if dispatch not in MOE_DISPATCHES:
            raise ValueError(f"MoeMlp.init: dispatch must be one of {MOE_DISPATCHES}, got {dispatch!r}")
        if not 1 <= num_experts_per_tok <= Experts.size:
            raise ValueError(
                f"MoeMlp.init: num_experts_per_tok must be in 1..{Experts.size} (the number of experts), "
                f"got {num_experts_per_tok}"
            )
        k_router, k_gate, k_up, k_down = jax.random.split(key, 4)
        return MoeMlp(
            router=Linear.init(Embed, Experts, key=k_router, use_bias=bias),
            gate_proj=hax.random.normal(k_gate, (Experts, Mlp, Embed)) * (Embed.size**-0.5),
            up_proj=hax.random.normal(k_up, (Experts, Mlp, Embed)) * (Embed.size**-0.5),
            down_proj=hax.random.normal(k_down, (Experts, Embed, Mlp)) * (Mlp.size**-0.5),
            num_experts_per_tok=num_experts_per_tok,
            dispatch=dispatch,
            norm_topk_prob=norm_topk_prob,
            gate_bias=hax.zeros((Experts, Mlp)) if bias else None,
            up_bias=hax.zeros((Experts, Mlp)) if bias else None,
            down_bias=hax.zeros((Experts, Embed)) if bias else None,
            activation=activation,
            softmax_after_top_k=softmax_after_top_k,
        )

    @property
    def Experts(self) -> Axis:
        """The experts axis."""
        return self.gate_proj.resolve_axis("experts")

    def route(self, x: NamedArray) -> RouterOutput:
        """The routing decision for ``x`` ``(..., embed)`` (see :func:`route_top_k`, :func:`route_top_k_softmax`)."""
        if self.softmax_after_top_k:
            return route_top_k_softmax(self.router(x), self.Experts, self.num_experts_per_tok)
        return route_top_k(self.router(x), self.Experts, self.num_experts_per_tok, normalize=self.norm_topk_prob)

    def __call__(self, x: NamedArray) -> tuple[NamedArray, RouterOutput]:
        """Apply the experts to ``x`` ``(..., embed)``.

        Args:
            x: the input.

        Returns:
            ``(output with x's axes, the routing decision)``; the latter feeds :func:`load_balancing_loss`.
        """
        routing = self.route(x)
        if self.dispatch == "sorted":
            return tag(self._sorted(x, routing), "mlp_out"), routing
        Experts = self.Experts
        # dense [tokens..., experts] combination weights, zero outside each token's top-k
        combine = hax.sum(
            hax.nn.one_hot(routing.indices, Experts, dtype=x.dtype) * routing.weights.astype(x.dtype), TOP_K
        )
        Embed = x.resolve_axis("embed")
        gate, up = tag((hax.dot(x, self.gate_proj, axis=Embed), hax.dot(x, self.up_proj, axis=Embed)), "mlp_in")
        gate = gate if self.gate_bias is None else gate + self.gate_bias
        up = up if self.up_bias is None else up + self.up_bias
        hidden = NamedArray(self._activate(gate.array, up.rearrange(gate.axes).array), gate.axes)
        out = hax.dot(hidden * combine, self.down_proj, axis=(Experts.name, "mlp"))
        if self.down_bias is not None:
            out = out + hax.dot(combine, self.down_bias, axis=Experts.name)
        return tag(out, "mlp_out"), routing

    def _activate(self, gate: jax.Array, up: jax.Array) -> jax.Array:
        """The experts' gated activation of ``gate`` and ``up`` (same shapes): SwiGLU, or ``self.activation``."""
        return jax.nn.silu(gate) * up if self.activation is None else self.activation(gate, up)

    def _bias_rows(self, bias: NamedArray | None, experts: jax.Array, Out: str) -> jax.Array | float:
        """``bias`` (``(experts, Out)``) of the expert of each row (``experts``: expert ids), or 0 without bias."""
        return 0.0 if bias is None else bias.rearrange(("experts", Out)).array[experts]

    def _sorted(self, x: NamedArray, routing: RouterOutput) -> NamedArray:
        """The ``"sorted"`` dispatch: grouped matrix products over the assignments sorted by expert."""
        Embed = x.resolve_axis("embed")
        token_axes = tuple(ax for ax in x.axes if ax.name != Embed.name)
        k, n_experts = self.num_experts_per_tok, self.Experts.size
        tokens = x.rearrange((*token_axes, Embed)).array.reshape(-1, Embed.size)
        chosen = routing.indices.rearrange((*token_axes, TOP_K)).array.reshape(-1)
        weights = routing.weights.rearrange((*token_axes, TOP_K)).array.reshape(-1)
        order = jnp.argsort(chosen, stable=True)
        source = order // k  # the token of each sorted assignment
        group_sizes = jnp.bincount(chosen, length=n_experts).astype(jnp.int32)
        xs = tokens[source]
        w1 = self.gate_proj.rearrange(("experts", "embed", "mlp")).array
        w3 = self.up_proj.rearrange(("experts", "embed", "mlp")).array
        w2 = self.down_proj.rearrange(("experts", "mlp", "embed")).array
        gate, up = tag((jax.lax.ragged_dot(xs, w1, group_sizes), jax.lax.ragged_dot(xs, w3, group_sizes)), "mlp_in")
        expert = chosen[order]  # the expert of each sorted assignment
        gate = gate + self._bias_rows(self.gate_bias, expert, "mlp")
        up = up + self._bias_rows(self.up_bias, expert, "mlp")
        hidden = self._activate(gate, up)
        ys = jax.lax.ragged_dot(hidden, w2, group_sizes) + self._bias_rows(self.down_bias, expert, "embed")
        ys = ys * weights[order][:, None].astype(x.dtype)
        out = jnp.zeros_like(tokens).at[source].add(ys)
        return NamedArray(out.reshape([ax.size for ax in token_axes] + [Embed.size]), (*token_axes, Embed))


def check_moe_fields(name: str, num_experts: int, num_experts_per_tok: int, dispatch: str) -> None:
    """Raise ``ValueError`` naming the config ``name`` for ``num_experts_per_tok`` outside ``1..num_experts`` or an
    unknown ``moe_dispatch``."""
    if not 1 <= num_experts_per_tok <= num_experts:
        raise ValueError(
            f"{name}: num_experts_per_tok must be in 1..num_experts ({num_experts}), got {num_experts_per_tok}"
        )
    if dispatch not in MOE_DISPATCHES:
        raise ValueError(f"{name}: moe_dispatch must be one of {MOE_DISPATCHES}, got {dispatch!r}")


def sparse_flops_per_token(config: Any, vocab_size: int, expert_dim: int) -> float:
    """Forward FLOPs per token of a mixture-of-experts decoder *as a sparse model*: attention and head as a dense
    model's, ``num_experts_per_tok`` experts of hidden size ``expert_dim`` per token, plus the router.

    This is the usual MoE convention for MFU; the ``"dense"`` dispatch executes ``num_experts /
    num_experts_per_tok`` times the expert FLOPs counted here, ``"sorted"`` executes them.

    Args:
        config: the model config (``hidden_dim``, ``num_layers``, heads, ``seq_len``, ``num_experts``,
            ``num_experts_per_tok``, ``vocab_padding_multiple``, ``attention_windows()``).
        vocab_size: the real vocabulary size.
        expert_dim: one expert's hidden size.
    """
    dense = lm_flops_per_token(
        hidden_dim=config.hidden_dim,
        intermediate_dim=expert_dim * config.num_experts_per_tok,
        num_layers=config.num_layers,
        num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        head_size=config.HeadSize.size,
        seq_len=config.seq_len,
        vocab_size=padded_vocab_size(vocab_size, config.vocab_padding_multiple),
        glu=True,
        attention_windows=config.attention_windows(),
    )
    return dense + config.num_layers * 2.0 * config.hidden_dim * config.num_experts
