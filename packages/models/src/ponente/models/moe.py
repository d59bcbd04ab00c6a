"""A sparse mixture-of-experts MLP: top-k routing, dispatch of tokens to experts, load-balancing loss, router metrics.

The experts are SwiGLU MLPs whose weights carry an ``experts`` axis, so sharding them over a mesh axis
(expert parallelism) is one entry of an axis mapping, e.g. ``{"experts": "expert"}``; no model code changes. The
``"expert_parallel"`` dispatch (chosen by ``"auto"`` when ``experts`` is split) then sends each token to the devices
holding its experts by all-to-all (:mod:`ponente.models._expert_parallel`).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp

import ponente.namedtensor as hax
from ponente.namedtensor import Axis, NamedArray
from ponente.namedtensor.nn import Linear
from ponente.namedtensor.state_dict import ModuleWithStateDictSerialization

from ._expert_parallel import expert_axis, expert_parallel_dispatch, token_mapping
from .config import lm_flops_per_token, padded_vocab_size
from .remat import tag

__all__ = [
    "MOE_DISPATCHES",
    "ClampedSwiGlu",
    "MoeMlp",
    "RouterOutput",
    "balance_bias_frozen",
    "balancing_bias",
    "check_moe_fields",
    "expert_load",
    "layer_groups",
    "load_balancing_loss",
    "route_top_k",
    "route_top_k_softmax",
    "router_group_metrics",
    "router_metrics",
    "sparse_flops_per_token",
    "update_balance_bias",
]

MOE_DISPATCHES = ("auto", "dense", "sorted", "expert_parallel")
"""The expert dispatch strategies of :class:`MoeMlp` (``"auto"``: ``"expert_parallel"`` when the ``experts`` axis is
split over a mesh axis of size > 1, else ``"dense"``)."""

TOP_K = "top_k"
"""The name of the axis of the ``k`` experts chosen per token."""


class RouterOutput(eqx.Module):
    """What the router decided for every token.

    Attributes:
        probs: the softmax of the router logits over ``experts`` (float32), ``(..., experts)``.
        weights: the combination weights of the chosen experts (renormalized to sum to 1 unless the layer says
            otherwise), ``(..., top_k)``.
        indices: the chosen experts (integer ids, best first), ``(..., top_k)``.
        logsumexp: the log-sum-exp of the router logits (float32), ``(...)``, for the router z-loss; None if unknown.
        dropped: which assignments the dispatch dropped for lack of capacity (bool), ``(..., top_k)``; None: none
            can be dropped (every dispatch but ``"expert_parallel"`` with a ``capacity_factor``).
    """

    probs: NamedArray
    weights: NamedArray
    indices: NamedArray
    logsumexp: NamedArray | None = None
    dropped: NamedArray | None = None


def route_top_k(
    router_logits: NamedArray, Experts: Axis, k: int, *, normalize: bool = True, bias: NamedArray | None = None
) -> RouterOutput:
    """Top-k routing as Mixtral does it: softmax over experts, keep the ``k`` best, renormalize their weights
    (``normalize=False``: keep their probabilities, as Qwen3-MoE without ``norm_topk_prob``).

    With ``bias`` (DeepSeek-V3's auxiliary-loss-free balancing), the ``k`` experts are those with the highest
    ``probs + bias``, while their weights are still their (renormalized) probabilities: the bias steers the choice
    only.

    The softmax is computed in float32 whatever the logits' dtype (as ``transformers`` does).

    Args:
        router_logits: ``(..., Experts)`` router logits.
        Experts: the experts axis.
        k: experts per token (``num_experts_per_tok``), between 1 and ``Experts.size``.
        normalize: renormalize the ``k`` chosen probabilities to sum to 1.
        bias: ``(Experts,)`` added to the probabilities for the choice only (None: no bias).

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
    logits = router_logits.astype(jnp.float32)
    probs = hax.nn.softmax(logits, Experts)
    if bias is None:
        top, indices = hax.top_k(probs, Experts, k, new_axis=TOP_K)
    else:
        _, indices = hax.top_k(probs + jax.lax.stop_gradient(bias.astype(jnp.float32)), Experts, k, new_axis=TOP_K)
        top = hax.sum(hax.nn.one_hot(indices, Experts, dtype=jnp.float32) * probs, Experts)
    weights = top / hax.sum(top, TOP_K) if normalize else top
    return RouterOutput(probs=probs, weights=weights, indices=indices, logsumexp=hax.nn.logsumexp(logits, Experts))


def route_top_k_softmax(
    router_logits: NamedArray, Experts: Axis, k: int, *, bias: NamedArray | None = None
) -> RouterOutput:
    """Top-k routing as gpt-oss does it: keep the ``k`` highest logits, and softmax over those ``k`` alone.

    The weights are the softmax of the chosen logits (summing to 1); ``probs`` is the softmax over every expert, as
    the load-balancing loss reads it (transformers' ``load_balancing_loss_func``). Computed in float32.

    With ``bias`` (DeepSeek-V3's auxiliary-loss-free balancing), the ``k`` experts are those with the highest
    ``logits + bias``, while their weights are still the softmax of their (unbiased) logits: the bias steers the
    choice only.

    Args:
        router_logits: ``(..., Experts)`` router logits.
        Experts: the experts axis.
        k: experts per token (``num_experts_per_tok``), between 1 and ``Experts.size``.
        bias: ``(Experts,)`` added to the logits for the choice only (None: no bias).

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
    if bias is None:
        top, indices = hax.top_k(logits, Experts, k, new_axis=TOP_K)
    else:
        _, indices = hax.top_k(logits + jax.lax.stop_gradient(bias.astype(jnp.float32)), Experts, k, new_axis=TOP_K)
        top = hax.sum(hax.nn.one_hot(indices, Experts, dtype=jnp.float32) * logits, Experts)
    return RouterOutput(
        probs=hax.nn.softmax(logits, Experts),
        weights=hax.nn.softmax(top, TOP_K),
        indices=indices,
        logsumexp=hax.nn.logsumexp(logits, Experts),
    )


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


def router_metrics(routing: RouterOutput, Experts: Axis) -> dict[str, NamedArray]:
    """Diagnostics of a (stacked) routing decision, averaged over every axis but ``Experts`` (layers included).

    Args:
        routing: the routing of one layer or of a stack of layers.
        Experts: the experts axis.

    Returns:
        Scalars (float32): ``load_balancing_loss`` (unweighted, see :func:`load_balancing_loss`), ``z_loss`` (mean
        squared log-sum-exp of the router logits, ST-MoE's router z-loss, unweighted; only when the routing has
        ``logsumexp``), ``expert_load_max`` (the
        busiest expert's share of the assignments over the mean share, 1 when balanced; the worst layer when
        stacked) and ``dropped_fraction`` (assignments dropped for lack of capacity).

    Example:
        >>> import jax.numpy as jnp, ponente.namedtensor as hax
        >>> E = hax.Axis("experts", 2)
        >>> r = route_top_k(hax.named(jnp.array([[1.0, 0.0], [2.0, 0.0]]), ("position", "experts")), E, 1)
        >>> round(float(router_metrics(r, E)["expert_load_max"].scalar()), 3)
        2.0
    """
    per_expert = expert_load(routing, Experts)  # (layers?, experts)
    load = hax.max(per_expert, Experts) / hax.maximum(hax.mean(per_expert, Experts), 1e-9)
    metrics = {"load_balancing_loss": load_balancing_loss(routing.probs, routing.indices, Experts)}
    if routing.logsumexp is not None:  # a router without a softmax (DeepSeek-V3's sigmoid) has no z-loss
        metrics["z_loss"] = hax.mean(hax.square(routing.logsumexp))
    metrics["expert_load_max"] = hax.max(load)
    dropped = routing.dropped
    metrics["dropped_fraction"] = hax.zeros(()) if dropped is None else hax.mean(dropped.astype(jnp.float32))
    return metrics


def layer_groups(num_layers: int, groups: int) -> list[tuple[int, int]]:
    """``min(groups, num_layers)`` runs of consecutive layers ``[start, stop)`` covering ``0 .. num_layers - 1``, as
    even as possible (the first ones one longer when ``num_layers`` does not divide); ``[]`` when ``groups`` is 0.

    Example:
        >>> layer_groups(5, 2), layer_groups(2, 4)
        ([(0, 3), (3, 5)], [(0, 1), (1, 2)])
    """
    n = min(groups, num_layers)
    if n <= 0:
        return []
    size, extra = divmod(num_layers, n)
    bounds = [0]
    for g in range(n):
        bounds.append(bounds[-1] + size + (1 if g < extra else 0))
    return list(itertools.pairwise(bounds))


def router_group_metrics(routing: RouterOutput, Experts: Axis, groups: int) -> dict[str, NamedArray]:
    """:func:`router_metrics` per group of consecutive MoE layers of a stacked routing (axis ``layers``).

    The layers split into ``min(groups, layers)`` groups by :func:`layer_groups`; each group's metrics are those of
    its layers alone (its own load-balancing loss, z-loss, worst expert load and dropped fraction).

    Args:
        routing: the routing of a stack of MoE layers (every array has the ``layers`` axis first or anywhere).
        Experts: the experts axis.
        groups: the number of groups asked for (0: none).

    Returns:
        ``{"group_<g>/<metric>": scalar}``; empty when ``groups`` is 0 or the routing has no ``layers`` axis.
    """
    Layers = routing.indices.resolve_axis("layers") if "layers" in routing.indices.axis_names else None
    if Layers is None:
        return {}
    out: dict[str, NamedArray] = {}
    for g, (start, stop) in enumerate(layer_groups(Layers.size, groups)):
        part = jax.tree_util.tree_map(
            lambda a, lo=start, hi=stop: a[{"layers": slice(lo, hi)}],
            routing,
            is_leaf=lambda a: isinstance(a, NamedArray),
        )
        out.update({f"group_{g}/{name}": value for name, value in router_metrics(part, Experts).items()})
    return out


class MoeMlp(ModuleWithStateDictSerialization):
    """A sparse mixture of SwiGLU experts with top-k routing (Mixtral's ``block_sparse_moe``).

    Each token goes to the ``k`` experts its router scores highest; the output is the sum of their
    outputs weighted by the renormalized router probabilities. Dispatch is by one of these strategies (all but
    ``"expert_parallel"`` with a ``capacity_factor`` are *capacity-free*: no token is ever dropped):

    - ``"auto"`` (default): ``"expert_parallel"`` when the ``experts`` axis maps to a mesh axis of size > 1 in the
      current axis mapping (e.g. ``trainer.expert_axis_size: 4``), else ``"dense"``.
    - ``"dense"``, written with named ops: every expert computes every token, and the
      combination weights (zero outside the top-k) are contracted over the ``experts`` axis, so the
      experts shard over any mesh axis the ``experts`` axis maps to. It costs ``num_experts / k`` times
      the expert FLOPs of a sparse dispatch: ``6 * E * embed * mlp`` per token instead of
      ``6 * k * embed * mlp`` (plus ``2 * E * embed`` for the router).
    - ``"sorted"``: the ``tokens * k`` assignments are sorted by expert, each expert multiplies only
      its own tokens (``jax.lax.ragged_dot``, grouped matrix products), and the weighted results are
      scattered back: ``6 * k * embed * mlp`` FLOPs per token. Meant for one device (or replicated
      experts); under an ``experts`` sharding the compiler may gather the expert weights.
    - ``"expert_parallel"``: the experts stay where the ``experts`` mesh axis put them and the tokens travel: each
      device sends its assignments to the devices holding their experts (``all_to_all``), runs its local experts
      with grouped matrix products and sends the results back (:mod:`ponente.models._expert_parallel`). Sparse
      FLOPs plus the padding of fixed-size buffers: dropless by default, or buffers of ``capacity_factor`` times an
      even share (assignments beyond it are dropped and counted in :attr:`RouterOutput.dropped`).

    Attributes:
        router: ``Embed -> Experts``, with a bias or not (state-dict key ``gate``).
        gate_proj: ``(experts, mlp, embed)``, the experts' gate projections (key ``experts.w1``).
        up_proj: ``(experts, mlp, embed)``, the experts' up projections (key ``experts.w3``).
        down_proj: ``(experts, embed, mlp)``, the experts' down projections (key ``experts.w2``).
        num_experts_per_tok: ``k`` (static).
        dispatch: ``"auto"``, ``"dense"``, ``"sorted"`` or ``"expert_parallel"`` (static).
        norm_topk_prob: renormalize the chosen experts' probabilities to sum to 1 (Mixtral; static).
        gate_bias: ``(experts, mlp)``, the gate projections' biases (key ``experts.b1``), or None (gpt-oss has them).
        up_bias: ``(experts, mlp)``, the up projections' biases (key ``experts.b3``), or None.
        down_bias: ``(experts, embed)``, the down projections' biases (key ``experts.b2``), or None.
        activation: the experts' gated activation: None for SwiGLU (``silu(gate) * up``), or a
            :class:`ClampedSwiGlu` (gpt-oss) (static).
        softmax_after_top_k: route with :func:`route_top_k_softmax` (softmax over the ``k`` chosen logits, gpt-oss)
            instead of :func:`route_top_k` (static).
        capacity_factor: ``"expert_parallel"`` only: None (dropless) or the per-destination buffer size relative to
            an even split (static).
        balance_bias: ``(experts,)`` bias added to the router probabilities (to the logits with
            ``softmax_after_top_k``) for the top-k choice only (DeepSeek-V3's
            auxiliary-loss-free balancing; not trained by gradient: the trainer updates it after each step), or None.
    """

    router: Linear
    gate_proj: NamedArray
    up_proj: NamedArray
    down_proj: NamedArray
    num_experts_per_tok: int = eqx.field(static=True)
    dispatch: str = eqx.field(static=True, default="auto")
    norm_topk_prob: bool = eqx.field(static=True, default=True)
    gate_bias: NamedArray | None = None
    up_bias: NamedArray | None = None
    down_bias: NamedArray | None = None
    activation: ClampedSwiGlu | None = eqx.field(static=True, default=None)
    softmax_after_top_k: bool = eqx.field(static=True, default=False)
    capacity_factor: float | None = eqx.field(static=True, default=None)
    balance_bias: NamedArray | None = None

    balance_bias_field: ClassVar[str] = "balance_bias"
    """The field holding the balancing bias (a subclass may keep it under another name, e.g. DeepSeek-V3's
    ``e_score_correction_bias``): what :func:`balance_bias_frozen` and :func:`update_balance_bias` read and write."""

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
        dispatch: str = "auto",
        norm_topk_prob: bool = True,
        bias: bool = False,
        activation: ClampedSwiGlu | None = None,
        softmax_after_top_k: bool = False,
        capacity_factor: float | None = None,
        balance_bias: bool = False,
    ) -> MoeMlp:
        """Create a randomly initialized layer (normal weights scaled by ``1/sqrt(fan_in)``).

        Args:
            Embed: the model-width axis.
            Mlp: one expert's hidden axis.
            Experts: the experts axis.
            num_experts_per_tok: ``k``, the experts per token.
            key: the PRNG key.
            dispatch: ``"auto"``, ``"dense"``, ``"sorted"`` or ``"expert_parallel"`` (see the class docstring).
            norm_topk_prob: renormalize the chosen experts' probabilities (see :func:`route_top_k`).
            bias: give the router and the experts' projections biases (zeros).
            activation: the experts' activation (None: SwiGLU; see the class docstring).
            softmax_after_top_k: route with :func:`route_top_k_softmax` (see the class docstring).
            capacity_factor: see the class docstring (None: dropless).
            balance_bias: give the layer a zero :attr:`balance_bias`.

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
            capacity_factor=capacity_factor,
            balance_bias=hax.zeros(Experts) if balance_bias else None,
        )

    @property
    def Experts(self) -> Axis:
        """The experts axis."""
        return self.gate_proj.resolve_axis("experts")

    def route(self, x: NamedArray) -> RouterOutput:
        """The routing decision for ``x`` ``(..., embed)`` (see :func:`route_top_k`, :func:`route_top_k_softmax`)."""
        if self.softmax_after_top_k:
            return route_top_k_softmax(self.router(x), self.Experts, self.num_experts_per_tok, bias=self.balance_bias)
        return route_top_k(
            self.router(x),
            self.Experts,
            self.num_experts_per_tok,
            normalize=self.norm_topk_prob,
            bias=self.balance_bias,
        )

    def __call__(self, x: NamedArray) -> tuple[NamedArray, RouterOutput]:
        """Apply the experts to ``x`` ``(..., embed)``.

        Args:
            x: the input.

        Returns:
            ``(output with x's axes, the routing decision)``; the latter feeds :func:`load_balancing_loss`.
        """
        dispatch = self.dispatch
        if dispatch == "auto":
            dispatch = "expert_parallel" if expert_axis()[1] > 1 else "dense"
        with token_mapping():
            routing = self.route(x)
            if dispatch == "dense":
                return self._dense(x, routing), routing
        if dispatch == "sorted":
            return tag(self._sorted(x, routing), "mlp_out"), routing
        out, dropped = expert_parallel_dispatch(
            x,
            routing.indices,
            routing.weights.astype(x.dtype),
            self.gate_proj,
            self.up_proj,
            self.down_proj,
            capacity_factor=self.capacity_factor,
            activation=self.activation,
            gate_bias=self.gate_bias,
            up_bias=self.up_bias,
            down_bias=self.down_bias,
        )
        if self.capacity_factor is not None:
            routing = dataclasses.replace(routing, dropped=dropped)
        return tag(out, "mlp_out"), routing

    def _dense(self, x: NamedArray, routing: RouterOutput) -> NamedArray:
        """The ``"dense"`` dispatch: every expert computes every token, combined by weights zero outside the top-k."""
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
        return tag(out, "mlp_out")

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


def expert_load(routing: RouterOutput, Experts: Axis) -> NamedArray:
    """The assignments each expert received, summed over the token axes (a ``layers`` axis is kept when stacked)."""
    counts = _assignments(routing.indices, Experts)
    return hax.sum(counts, axis=tuple(ax for ax in counts.axes if ax.name not in (Experts.name, "layers")))


def _is_moe(x: Any) -> bool:
    return isinstance(x, MoeMlp)


def balancing_bias(moe: Any) -> NamedArray | None:
    """The auxiliary-loss-free balancing bias of an MoE layer (:attr:`MoeMlp.balance_bias_field`), or None."""
    return getattr(moe, moe.balance_bias_field, None) if _is_moe(moe) else None


def balance_bias_frozen(mask: Any) -> Any:
    """A trainable mask (a pytree of bools shaped like a model) with every balancing bias (:func:`balancing_bias`)
    set False: the bias is updated by :func:`update_balance_bias`, never by the optimizer."""
    return jax.tree_util.tree_map(
        lambda m: dataclasses.replace(m, **{m.balance_bias_field: False}) if balancing_bias(m) is not None else m,
        mask,
        is_leaf=_is_moe,
    )


def update_balance_bias(model: Any, load: NamedArray, rate: float) -> Any:
    """DeepSeek-V3's auxiliary-loss-free balancing step: every balancing bias (:func:`balancing_bias`) of ``model``
    moves by ``rate * sign(mean load - load_e)`` (underloaded experts up, overloaded down).

    Args:
        model: a model whose MoE layers have a balancing bias (stacked layers: ``(layers, experts)``).
        load: the assignments per expert of the step, with the bias's axes (see :func:`expert_load`).
        rate: the update rate.

    Returns:
        The model with the new biases (in their dtype).
    """

    def update(m: Any) -> Any:
        bias = balancing_bias(m)
        if bias is None:
            return m
        step = rate * hax.sign(hax.mean(load, m.Experts) - load)
        return dataclasses.replace(m, **{m.balance_bias_field: (bias + step.rearrange(bias.axes)).astype(bias.dtype)})

    return jax.tree_util.tree_map(update, model, is_leaf=_is_moe)


def check_moe_fields(name: str, config: Any) -> None:
    """Raise ``ValueError`` naming the config ``name`` for ``num_experts_per_tok`` outside ``1..num_experts``, an
    unknown ``moe_dispatch``, a ``moe_capacity_factor`` that is not positive, a negative
    ``router_bias_update_rate`` or a negative ``router_metrics_groups`` (fields ``config`` lacks are not checked)."""
    num_experts, num_experts_per_tok = config.num_experts, config.num_experts_per_tok
    dispatch = config.moe_dispatch
    capacity_factor = getattr(config, "moe_capacity_factor", None)
    router_bias_update_rate = getattr(config, "router_bias_update_rate", 0.0)
    router_metrics_groups = getattr(config, "router_metrics_groups", 0)
    if not 1 <= num_experts_per_tok <= num_experts:
        raise ValueError(
            f"{name}: num_experts_per_tok must be in 1..num_experts ({num_experts}), got {num_experts_per_tok}"
        )
    if dispatch not in MOE_DISPATCHES:
        raise ValueError(f"{name}: moe_dispatch must be one of {MOE_DISPATCHES}, got {dispatch!r}")
    if capacity_factor is not None and not capacity_factor > 0:
        raise ValueError(f"{name}: moe_capacity_factor must be positive or None (dropless), got {capacity_factor}")
    if not router_bias_update_rate >= 0:
        raise ValueError(f"{name}: router_bias_update_rate must be >= 0 (0: off), got {router_bias_update_rate}")
    if router_metrics_groups < 0:
        raise ValueError(
            f"{name}: router_metrics_groups must be >= 0 (0: no per-group metrics), got {router_metrics_groups}"
        )


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
