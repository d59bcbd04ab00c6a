"""The ``"expert_parallel"`` dispatch of a mixture of experts: tokens travel to the devices that hold their experts.

The ``experts`` axis of the expert weights is split over a mesh axis (the one the current axis mapping names for
``experts``, e.g. ``expert``). Inside ``shard_map``, each device

1. sorts its tokens' ``k`` assignments by expert, so by destination device, and writes them into one fixed-size
   buffer per destination (``capacity`` rows each);
2. exchanges the buffers with one ``all_to_all`` over the expert mesh axis;
3. runs its local experts on the rows it received with grouped matrix products (``jax.lax.ragged_dot``);
4. sends the results back with the reverse ``all_to_all`` and adds them, weighted, to its tokens.

``jax.lax.ragged_all_to_all`` would send only the rows used, but XLA:CPU does not implement it; the fixed-size
buffers work everywhere. *Dropless* (``capacity_factor=None``) sizes each buffer for the worst case, every local
assignment bound for one device (``tokens * k`` rows); a ``capacity_factor`` ``c`` sizes it
``ceil(c * tokens * k / devices)`` and drops the assignments that do not fit (their weight is lost, the token keeps
its residual), which are counted and returned.

Tensor parallelism composes: when ``mlp`` maps to a mesh axis the expert weights are split over it too, each device
computes its slice of the hidden units, and the partial outputs are summed (``psum``) over that axis. With no mesh,
or an ``experts`` axis that is not split, the same code runs on the local tokens with no communication.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

import ponente.namedtensor as hax
from ponente.namedtensor import NamedArray
from ponente.namedtensor.partitioning import (
    axis_mapping,
    current_thread_local_mapping,
    physical_axis_name,
    pspec_for_axis,
)

from ._mesh_axis import current_or_abstract_mesh, split_axis
from .remat import tag

__all__ = ["expert_axis", "expert_parallel_dispatch", "token_mapping"]


def expert_axis() -> tuple[str | None, int]:
    """The mesh axis the ``experts`` logical axis maps to under the current mapping and mesh, and its size
    (``(None, 1)`` when there is no mesh or ``experts`` is not split)."""
    return split_axis("experts", "moe_dispatch 'expert_parallel'")


@contextlib.contextmanager
def token_mapping() -> Iterator[None]:
    """The current axis mapping without its ``experts`` entry, for the arrays that carry both token axes and an
    ``experts`` axis (router logits, the dense dispatch's products).

    Under expert parallelism the batch is split over the expert mesh axis too (it is a data axis for everything but
    the expert weights), and JAX cannot split two dimensions of one array over one mesh axis: those arrays keep their
    tokens split and their ``experts`` axis whole. Outside any mapping, or when ``experts`` is not mapped, nothing
    changes.
    """
    mapping = current_thread_local_mapping()
    if mapping is None or "experts" not in mapping:
        yield
        return
    with axis_mapping({k: v for k, v in mapping.items() if k != "experts"}):
        yield


def _local_dispatch(
    x: jax.Array,
    indices: jax.Array,
    weights: jax.Array,
    w1: jax.Array,
    w3: jax.Array,
    w2: jax.Array,
    *,
    axis: str | None,
    devices: int,
    capacity_factor: float | None,
    psum_axes: tuple[str, ...],
    activation: Callable[[jax.Array, jax.Array], jax.Array],
    b1: jax.Array | None = None,
    b3: jax.Array | None = None,
    b2: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """One device's part: ``x`` ``[..., embed]``, ``indices``/``weights`` ``[..., k]``, local expert weights
    ``w1``/``w3`` ``[local experts, embed, mlp]``, ``w2`` ``[local experts, mlp, embed]``, optional local biases
    ``b1``/``b3`` ``[local experts, mlp]`` and the down bias of *every* expert ``b2`` ``[experts, embed]`` (added by
    the sender, after the sum over the tensor-parallel axes).

    Returns the output (``x``'s shape) and a ``[..., k]`` mask of the dropped assignments.
    """
    token_shape, embed = x.shape[:-1], x.shape[-1]
    k = indices.shape[-1]
    local = w1.shape[0]
    tokens = x.reshape(-1, embed)
    n_assign = tokens.shape[0] * k
    chosen = indices.reshape(-1)
    capacity = (
        n_assign if capacity_factor is None else max(1, min(n_assign, math.ceil(capacity_factor * n_assign / devices)))
    )

    # 1. per destination buffers; sorting by expert sorts by destination too (destination = expert // local)
    order = jnp.argsort(chosen, stable=True)
    expert_sorted = chosen[order]
    dest = expert_sorted // local
    counts = jnp.bincount(dest, length=devices)
    starts = jnp.cumsum(counts) - counts
    slot = jnp.arange(n_assign) - starts[dest]  # the row of each sorted assignment in its destination's buffer
    kept = slot < capacity
    source = order // k  # the token of each sorted assignment
    send_x = jnp.zeros((devices, capacity, embed), x.dtype).at[dest, slot].set(tokens[source], mode="drop")
    send_e = jnp.full((devices, capacity), local, jnp.int32).at[dest, slot].set(expert_sorted % local, mode="drop")

    # 2. exchange: row block s of what a device receives came from device s
    if axis is not None:
        recv_x = jax.lax.all_to_all(send_x, axis, 0, 0)
        recv_e = jax.lax.all_to_all(send_e, axis, 0, 0)
    else:
        recv_x, recv_e = send_x, send_e

    # 3. grouped matrix products over the received rows sorted by local expert; empty rows (id ``local``) go last,
    # past the groups, and are never read back
    flat_e = recv_e.reshape(-1)
    order2 = jnp.argsort(flat_e, stable=True)
    xs = recv_x.reshape(-1, embed)[order2]
    group_sizes = jnp.bincount(flat_e, length=local + 1)[:local].astype(jnp.int32)
    gate, up = tag((jax.lax.ragged_dot(xs, w1, group_sizes), jax.lax.ragged_dot(xs, w3, group_sizes)), "mlp_in")
    row_expert = jnp.minimum(flat_e[order2], local - 1)  # empty rows read any bias: they are never read back
    if b1 is not None:
        gate = gate + b1[row_expert]
    if b3 is not None:
        up = up + b3[row_expert]
    ys_sorted = jax.lax.ragged_dot(activation(gate, up), w2, group_sizes)
    ys = jnp.zeros_like(ys_sorted).at[order2].set(ys_sorted).reshape(devices, capacity, embed)

    # 4. results back to the devices that sent the rows, weighted and added to their tokens
    back = jax.lax.all_to_all(ys, axis, 0, 0) if axis is not None else ys
    w_kept = jnp.where(kept, weights.reshape(-1)[order].astype(x.dtype), 0)[:, None].astype(x.dtype)
    y = back[dest, jnp.minimum(slot, capacity - 1)] * w_kept
    out = jnp.zeros_like(tokens).at[source].add(y)
    if psum_axes:
        out = jax.lax.psum(out, psum_axes)
    if b2 is not None:
        out = out.at[source].add(b2[expert_sorted] * w_kept)
    dropped = jnp.zeros((n_assign,), jnp.bool_).at[order].set(~kept)
    return out.reshape(*token_shape, embed), dropped.reshape(*token_shape, k)


def expert_parallel_dispatch(
    x: NamedArray,
    indices: NamedArray,
    weights: NamedArray,
    gate_proj: NamedArray,
    up_proj: NamedArray,
    down_proj: NamedArray,
    *,
    capacity_factor: float | None = None,
    activation: Callable[[jax.Array, jax.Array], jax.Array] | None = None,
    gate_bias: NamedArray | None = None,
    up_bias: NamedArray | None = None,
    down_bias: NamedArray | None = None,
) -> tuple[NamedArray, NamedArray]:
    """The SwiGLU experts applied to ``x`` by all-to-all over the mesh axis ``experts`` maps to (see the module).

    Args:
        x: the input ``(..., embed)``.
        indices: the chosen experts ``(..., top_k)`` (the token axes of ``x``).
        weights: their combination weights ``(..., top_k)``.
        gate_proj: ``(experts, mlp, embed)``.
        up_proj: ``(experts, mlp, embed)``.
        down_proj: ``(experts, embed, mlp)``.
        capacity_factor: None (dropless) or the size of each per-destination buffer relative to an even split of
            the device's assignments.
        activation: the gated activation ``activation(gate, up)`` (None: SwiGLU, ``silu(gate) * up``).
        gate_bias: ``(experts, mlp)`` or None.
        up_bias: ``(experts, mlp)`` or None.
        down_bias: ``(experts, embed)`` or None.

    Returns:
        ``(output with x's axes, a boolean (..., top_k) mask of the dropped assignments)``.

    Raises:
        ValueError: if the number of experts is not divisible by the size of the expert mesh axis.
    """
    Embed = x.resolve_axis("embed")
    token_axes = tuple(ax for ax in x.axes if ax.name != Embed.name)
    x = x.rearrange((*token_axes, Embed))
    indices = indices.rearrange((*token_axes, "top_k"))
    weights = weights.rearrange((*token_axes, "top_k"))
    w1 = gate_proj.rearrange(("experts", "embed", "mlp"))
    w3 = up_proj.rearrange(("experts", "embed", "mlp"))
    w2 = down_proj.rearrange(("experts", "mlp", "embed"))
    n_experts = w1.resolve_axis("experts").size
    act = activation if activation is not None else (lambda g, u: jax.nn.silu(g) * u)
    biases = [
        None if b is None else b.rearrange(names).array
        for b, names in (
            (gate_bias, ("experts", "mlp")),
            (up_bias, ("experts", "mlp")),
            (down_bias, ("experts", "embed")),
        )
    ]
    axis, devices = expert_axis()
    if n_experts % devices:
        raise ValueError(
            f"moe_dispatch 'expert_parallel': {n_experts} experts do not split over the {devices} devices of mesh "
            f"axis {axis!r} (trainer.expert_axis_size must divide num_experts)"
        )
    if axis is None:
        out, dropped = _local_dispatch(
            x.array,
            indices.array,
            weights.array,
            w1.array,
            w3.array,
            w2.array,
            axis=None,
            devices=1,
            capacity_factor=capacity_factor,
            psum_axes=(),
            activation=act,
            b1=biases[0],
            b3=biases[1],
            b2=biases[2],
        )
    else:
        mesh = current_or_abstract_mesh()
        token_spec = pspec_for_axis(token_axes)
        mlp_axis = physical_axis_name("mlp")
        mlp_axes = () if mlp_axis is None else ((mlp_axis,) if isinstance(mlp_axis, str) else tuple(mlp_axis))
        mlp_spec = None if not mlp_axes else (mlp_axes[0] if len(mlp_axes) == 1 else mlp_axes)
        up_spec = PartitionSpec(axis, None, mlp_spec)
        down_spec = PartitionSpec(axis, mlp_spec, None)

        bias_specs = (PartitionSpec(axis, mlp_spec), PartitionSpec(axis, mlp_spec), PartitionSpec(None, None))
        present = [i for i, b in enumerate(biases) if b is not None]

        def body(xa: Any, ia: Any, wa: Any, a1: Any, a3: Any, a2: Any, *bs: Any) -> Any:
            given: list[Any] = [None, None, None]
            for i, b in zip(present, bs, strict=True):
                given[i] = b
            return _local_dispatch(
                xa,
                ia,
                wa,
                a1,
                a3,
                a2,
                axis=axis,
                devices=devices,
                capacity_factor=capacity_factor,
                psum_axes=mlp_axes,
                activation=act,
                b1=given[0],
                b3=given[1],
                b2=given[2],
            )

        out, dropped = jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(
                PartitionSpec(*token_spec, None),
                PartitionSpec(*token_spec, None),
                PartitionSpec(*token_spec, None),
                up_spec,
                up_spec,
                down_spec,
                *(bias_specs[i] for i in present),
            ),
            out_specs=(PartitionSpec(*token_spec, None), PartitionSpec(*token_spec, None)),
            check_vma=False,
        )(x.array, indices.array, weights.array, w1.array, w3.array, w2.array, *(biases[i] for i in present))
    return hax.named(out, (*token_axes, Embed)), hax.named(dropped, indices.axes)
