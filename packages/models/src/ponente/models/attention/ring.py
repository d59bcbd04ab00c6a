"""Attention under context parallelism: each device of the context axis computes its own query rows.

The ``position`` axis of query, key and value is split over a mesh axis (the one the current axis mapping names for
``position``, e.g. ``context``). Inside ``shard_map`` each of the ``n`` devices keeps its query rows and sees the keys
and values of the others in one of two ways (``model.attention_context_parallel``):

* ``"allgather"``: keys, values, their token indices and segment ids are gathered over the axis, and the device
  attends to all of them at once.
* ``"ring"``: ``n`` times, the device attends to the key/value block it holds, merges the result into its running
  output with the online softmax (as flash attention does), and hands the block to the next device (``ppermute``);
  no device ever holds more than one block. Blockwise, the whole ring has its own VJP: the forward pass keeps only
  the device's queries, its own key/value block, the output and the final log-sum-exp (nothing per step, so the
  activation memory falls as ``1 / n``); the backward pass runs the ring again, each block's probabilities
  recomputed from the final log-sum-exp, and the key/value gradients travel with their block back to its device.

The attention to the keys at hand is blockwise (the :mod:`.flash` kernel with token indices; ring steps merge by the
kernel's log-sum-exp) or computed from materialized scores (the ``reference`` backend). The mask is built from the
original token indices (:attr:`~ponente.models.AttentionMask.token_index`, so the zig-zag order is exact) and the
segment ids that travel with the keys: causal, sliding windows and packed documents are exact; soft caps too.

Without a mesh, or with ``position`` not split, the same code runs on one block (one device).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec

import ponente.namedtensor as hax
from ponente.namedtensor import Axis, NamedArray
from ponente.namedtensor.partitioning import pspec_for_axis

from .._mesh_axis import current_or_abstract_mesh, split_axis
from ._mask import AttentionMask
from .flash import (
    UNSEEN_LSE,
    _flash_arrays,
    _forward,
    _key_block_grads,
    _padded,
    _pair,
    _sink_grad,
    _Spec,
    _with_sinks,
)

__all__ = ["ATTENTION_CONTEXT_PARALLEL", "context_axis", "context_parallel_attention", "ring_attention"]

ATTENTION_CONTEXT_PARALLEL = ("allgather", "ring")
"""The attention strategies under context parallelism (``model.attention_context_parallel``): ``"allgather"``
(keys and values gathered over the context axis by the compiler) or ``"ring"`` (:func:`ring_attention`)."""

_NEG = -1e30  # a finite "minus infinity": a block with no visible key adds nothing once a visible one is merged


def context_axis(Pos: Axis) -> tuple[str | None, int]:
    """The mesh axis ``Pos`` is split over under the current mapping and mesh, and its size (``(None, 1)`` when
    there is no mesh or ``Pos`` is not split).

    Raises:
        ValueError: if ``Pos`` maps to several mesh axes.
    """
    return split_axis(Pos.name, "context-parallel attention")


def _ring_local(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_idx: jax.Array,
    k_idx: jax.Array,
    q_seg: jax.Array | None,
    k_seg: jax.Array | None,
    *,
    axis: str | None,
    devices: int,
    n_shared: int,
    scale: float,
    causal: bool,
    window: int | None,
    soft_cap: float | None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """One device's part, from materialized scores (the ``reference`` backend). ``q``: ``(shared..., Lq, rest...,
    D)``; ``k``/``v``: ``(shared..., Lk, D)``; indices ``(L,)``; segment ids ``(shared..., L)`` or None. Returns
    ``q``'s shape, in ``v``'s dtype.

    This is the exact reference path, differentiated by JAX's autodiff: each step's merge is rematerialized, but the
    running statistics and the received key/value block of every step are kept for the backward pass, so its memory
    does not fall with the number of devices as the blockwise ring's (:func:`_ring_flash`) does."""
    shared_shape = q.shape[:n_shared]
    lq, d = q.shape[n_shared], q.shape[-1]
    rest_shape = q.shape[n_shared + 1 : -1]
    s = 1
    for n in shared_shape:
        s *= n
    qf = q.reshape(s, lq, -1, d).astype(jnp.float32)
    kf = k.reshape(s, -1, d)
    vf = v.reshape(s, -1, d)
    qs = None if q_seg is None else q_seg.reshape(s, lq)
    ks = None if k_seg is None else k_seg.reshape(s, -1)
    r = qf.shape[2]

    perm = [(i, (i + 1) % devices) for i in range(devices)]

    # one block's merge, recomputed in the backward pass: only the running statistics and the blocks are kept, never
    # the (queries x block) probabilities of every step
    @jax.checkpoint
    def merge(carry: tuple[jax.Array, ...], kb: jax.Array, vb: jax.Array, ki: jax.Array, kseg: Any) -> Any:
        m, l_sum, acc = carry
        logits = jnp.einsum("sqrd,skd->sqrk", qf, kb.astype(jnp.float32)) * scale
        if soft_cap is not None:
            logits = soft_cap * jnp.tanh(logits / soft_cap)
        allowed = jnp.ones((1, lq, 1, ki.shape[0]), jnp.bool_)
        if causal or window is not None:
            allowed = allowed & (ki[None, None, None, :] <= q_idx[None, :, None, None])
        if window is not None:
            allowed = allowed & (q_idx[None, :, None, None] - ki[None, None, None, :] < window)
        if qs is not None and kseg is not None:
            allowed = allowed & (qs[:, :, None, None] == kseg[:, None, None, :])
        logits = jnp.where(allowed, logits, _NEG)
        m_new = jnp.maximum(m, jnp.max(logits, axis=-1))
        p = jnp.exp(logits - m_new[..., None])
        corr = jnp.exp(m - m_new)
        l_sum = l_sum * corr + jnp.sum(p, axis=-1)
        acc = acc * corr[..., None] + jnp.einsum("sqrk,skd->sqrd", p, vb.astype(jnp.float32))
        return m_new, l_sum, acc

    carry = (
        jnp.full((s, lq, r), _NEG, jnp.float32),
        jnp.zeros((s, lq, r), jnp.float32),
        jnp.zeros((s, lq, r, d), jnp.float32),
    )
    for step in range(devices):
        carry = merge(carry, kf, vf, k_idx, ks)
        if axis is not None and step < devices - 1:
            kf, vf, k_idx = (jax.lax.ppermute(x, axis, perm) for x in (kf, vf, k_idx))
            if ks is not None:
                ks = jax.lax.ppermute(ks, axis, perm)
    m, l_sum, acc = carry
    if sinks is not None:  # one more logit per (row, head) in the denominator, attending to nothing
        sink = sinks.reshape(s, 1, r).astype(jnp.float32)
        top = jnp.maximum(m, sink)
        l_sum = l_sum * jnp.exp(m - top) + jnp.exp(sink - top)
        acc = acc * jnp.exp(m - top)[..., None]
    out = acc / l_sum[..., None]
    return out.reshape(*shared_shape, lq, *rest_shape, d).astype(v.dtype)


def _gathered_local(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_idx: jax.Array,
    k_idx: jax.Array,
    q_seg: jax.Array | None,
    k_seg: jax.Array | None,
    *,
    axis: str | None,
    devices: int,
    n_shared: int,
    scale: float,
    causal: bool,
    window: int | None,
    soft_cap: float | None,
    block_size: int | None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """One device's part of all-gather attention: its queries against every key and value of the context axis.

    Keys, values, their token indices and segment ids are gathered over ``axis``; then either the blockwise kernel
    (``block_size`` set: :mod:`.flash` with token indices, O(queries x block) memory, float32) or the materialized
    scores (``block_size`` None: one merge of :func:`_ring_local`)."""
    if axis is not None:
        k, v = (jax.lax.all_gather(x, axis, axis=n_shared, tiled=True) for x in (k, v))
        k_idx = jax.lax.all_gather(k_idx, axis, axis=0, tiled=True)
        if k_seg is not None:
            k_seg = jax.lax.all_gather(k_seg, axis, axis=n_shared, tiled=True)
    if block_size is None:
        return _ring_local(
            q,
            k,
            v,
            q_idx,
            k_idx,
            q_seg,
            k_seg,
            axis=None,
            devices=1,
            n_shared=n_shared,
            scale=scale,
            causal=causal,
            window=window,
            soft_cap=soft_cap,
            sinks=sinks,
        )
    qf, back = _flash_layout(q, n_shared)
    out = _flash_arrays(
        qf,
        k.astype(jnp.float32),
        v.astype(jnp.float32),
        q_seg if k_seg is not None else None,
        k_seg,
        block_size=block_size,
        causal=causal or window is not None,
        window=window,
        scale=scale,
        soft_cap=soft_cap,
        q_idx=q_idx,
        k_idx=k_idx,
        sinks=_sink_rows(sinks, n_shared),
    )
    return back(out).astype(v.dtype)


def _sink_rows(sinks: jax.Array | None, n_shared: int) -> jax.Array | None:
    """Sink logits ``(shared..., rest...)`` in the blockwise kernel's layout ``(shared..., g, 1)`` (float32)."""
    if sinks is None:
        return None
    return sinks.reshape(*sinks.shape[:n_shared], -1, 1).astype(jnp.float32)


def _flash_layout(q: jax.Array, n_shared: int) -> tuple[jax.Array, Any]:
    """``q`` ``(shared..., Lq, rest..., D)`` in the blockwise kernel's layout ``(shared..., g, Lq, D)`` (the query-only
    axes folded into ``g``, float32), and the function that puts an output ``(shared..., g, Lq, Dv)`` back."""
    lq, d = q.shape[n_shared], q.shape[-1]
    n_rest = q.ndim - n_shared - 2
    order = (*range(n_shared), *range(n_shared + 1, n_shared + 1 + n_rest), n_shared, q.ndim - 1)
    qt = jnp.transpose(q, order)
    rest_shape = qt.shape[n_shared : n_shared + n_rest]
    inverse = tuple(int(i) for i in np.argsort(order))

    def back(out: jax.Array) -> jax.Array:
        return jnp.transpose(out.reshape(*q.shape[:n_shared], *rest_shape, lq, out.shape[-1]), inverse)

    return qt.reshape(*q.shape[:n_shared], -1, lq, d).astype(jnp.float32), back


@dataclasses.dataclass(frozen=True)
class _Ring:
    """The static part of a blockwise ring (hashable: a ``nondiff`` argument of :func:`_ring_flash`)."""

    spec: _Spec  # the blockwise kernel's tiles and mask, the same at every step
    axis: str | None  # the mesh axis the blocks travel along (None: one device, no transfer)
    devices: int

    def pass_on(self, *xs: jax.Array | None) -> tuple[Any, ...]:
        """Each array handed to the next device of the ring (device ``i`` gets device ``i - 1``'s); None stays None."""
        if self.axis is None:
            return xs
        perm = [(i, (i + 1) % self.devices) for i in range(self.devices)]
        return tuple(None if x is None else jax.lax.ppermute(x, self.axis, perm) for x in xs)


def _ring_forward(ring: _Ring, q: jax.Array, k: jax.Array, v: jax.Array, *ids: jax.Array | None) -> Any:
    """The output and log-sum-exp of the queries against every block of the ring, merged step by step."""
    q_seg, k_seg, q_idx, k_idx = ids

    def attend(out: jax.Array, lse: jax.Array, k: jax.Array, v: jax.Array, k_idx: Any, k_seg: Any) -> Any:
        seg, idx = _pair(q_seg, k_seg), _pair(q_idx, k_idx)
        out_b, lse_b = _forward(ring.spec, q, k.astype(q.dtype), v.astype(q.dtype), seg, idx)
        merged = jnp.logaddexp(lse, lse_b)
        return out * jnp.exp(lse - merged)[..., None] + out_b * jnp.exp(lse_b - merged)[..., None], merged

    def step(_: Any, carry: tuple[Any, ...]) -> tuple[Any, ...]:
        out, lse, *block = carry
        # the block goes on to the next device while this one attends to it
        return *attend(out, lse, *block), *ring.pass_on(*block)

    # a loop, not unrolled steps, so that the compiler reuses one step's buffers for the next; the last step, which
    # passes nothing on, is outside it
    out = jnp.zeros((*q.shape[:-1], v.shape[-1]), q.dtype)
    lse = jnp.full(q.shape[:-1], UNSEEN_LSE, q.dtype)  # merged with a block's, gives exactly the block's
    out, lse, *block = lax.fori_loop(0, ring.devices - 1, step, (out, lse, k, v, k_idx, k_seg))
    return attend(out, lse, *block)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring_flash(
    ring: _Ring, q: jax.Array, k: jax.Array, v: jax.Array, sinks: jax.Array | None, *ids: jax.Array | None
) -> jax.Array:
    """One device's blockwise ring attention: ``q [..., g, Lq, D]`` (float32) against the ``k``/``v``
    ``[..., Lk, D]`` blocks of all devices, with segment ids and token indices ``(q_seg, k_seg, q_idx, k_idx)``
    (None where the mask does not use them), all padded to the block as :func:`.flash._padded` does. ``sinks``
    (``[..., g, 1]`` or None) join the final softmax's denominator (gpt-oss), as in the blockwise kernel.

    Its VJP keeps only the inputs, the output and the final log-sum-exp, whatever the number of devices; the backward
    pass runs the ring again, recomputing each block's probabilities from the final log-sum-exp, and the key/value
    gradients travel with their block back to the device that owns it.
    """
    return _ring_flash_fwd(ring, q, k, v, sinks, *ids)[0]


def _ring_flash_fwd(
    ring: _Ring, q: jax.Array, k: jax.Array, v: jax.Array, sinks: jax.Array | None, *ids: jax.Array | None
) -> Any:
    out, lse = _ring_forward(ring, q, k, v, *ids)
    out, lse = _with_sinks(out, lse, sinks)
    return out, (q, k, v, sinks, ids, out, lse)


def _ring_flash_bwd(ring: _Ring, res: tuple[Any, ...], dout: jax.Array) -> tuple[Any, ...]:
    q, k, v, sinks, ids, out, lse = res
    q_seg, k_seg, q_idx, k_idx = ids
    delta = jnp.sum(dout * out, axis=-1)  # the final output's: every block's probabilities are the final ones

    def grads(dq: jax.Array, dk: jax.Array, dv: jax.Array, k: jax.Array, v: jax.Array, k_idx: Any, k_seg: Any) -> Any:
        """The accumulated gradients plus this block's share: ``dk``/``dv`` are the block's own, from the devices
        it has visited before."""
        seg, idx = _pair(q_seg, k_seg), _pair(q_idx, k_idx)
        dq_b, dk_b, dv_b = _key_block_grads(
            ring.spec, q, k.astype(q.dtype), v.astype(q.dtype), seg, idx, dout, lse, delta
        )
        return dq + dq_b, dk + dk_b, dv + dv_b

    def step(_: Any, carry: tuple[Any, ...]) -> tuple[Any, ...]:
        dq, dk, dv, *block = carry
        dq, dk, dv = grads(dq, dk, dv, *block)
        # the block goes on while its gradients are computed; its gradients follow it
        return dq, *ring.pass_on(dk, dv), *ring.pass_on(*block)

    # the key/value gradients accumulate (float32) in buffers that travel around the ring with their block
    init = (jnp.zeros_like(q), jnp.zeros(k.shape, q.dtype), jnp.zeros(v.shape, q.dtype), k, v, k_idx, k_seg)
    dq, dk, dv, *block = lax.fori_loop(0, ring.devices - 1, step, init)
    dq, dk, dv = grads(dq, dk, dv, *block)
    dk, dv = ring.pass_on(dk, dv)  # one more hop: back to the device the block came from
    return dq, dk.astype(k.dtype), dv.astype(v.dtype), _sink_grad(sinks, lse, delta), *(None for _ in ids)


_ring_flash.defvjp(_ring_flash_fwd, _ring_flash_bwd)


def _ring_blockwise_local(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_idx: jax.Array,
    k_idx: jax.Array,
    q_seg: jax.Array | None,
    k_seg: jax.Array | None,
    *,
    axis: str | None,
    devices: int,
    n_shared: int,
    scale: float,
    causal: bool,
    window: int | None,
    soft_cap: float | None,
    block_size: int,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """:func:`_ring_local` with each step computed by the blockwise kernel (float32): its output and log-sum-exp per
    query row merge into the running ones (``lse = logaddexp(lse, lse_b)``), so no step materializes its scores, and
    the custom VJP of :func:`_ring_flash` keeps nothing per step (activation memory falls as ``1 / devices``)."""
    qf, back = _flash_layout(q, n_shared)
    lq = qf.shape[-2]
    spec, (qf, k, v, q_seg, k_seg, q_idx, k_idx) = _padded(
        qf,
        k,
        v,
        q_seg if k_seg is not None else None,
        k_seg,
        block_size=block_size,
        causal=causal or window is not None,
        window=window,
        scale=scale,
        soft_cap=soft_cap,
        q_idx=q_idx,
        k_idx=k_idx,
    )
    ring = _Ring(spec, axis, devices)
    out = _ring_flash(ring, qf, k, v, _sink_rows(sinks, n_shared), q_seg, k_seg, q_idx, k_idx)
    return back(out[..., :lq, :]).astype(v.dtype)


def context_parallel_attention(
    Pos: Axis,
    HeadSize: Axis,
    query: NamedArray,
    key: NamedArray,
    value: NamedArray,
    mask: AttentionMask | NamedArray | None,
    *,
    mode: str = "ring",
    blockwise: bool = False,
    block_size: int = 128,
    scaling_factor: float | None = None,
    logit_soft_cap: float | None = None,
    sinks: NamedArray | None = None,
) -> NamedArray:
    """Attention with the contract of :func:`~ponente.models.attention.attention` with ``Pos`` split over a mesh
    axis (context parallelism), each device computing its own query rows inside ``shard_map``.

    ``mode="ring"`` passes the key/value blocks around the devices (see the module). ``mode="allgather"`` gathers
    the keys and values (small with grouped-query attention) with their token indices and segment ids, then
    attends the device's queries to all of them. Either way the attention to the keys at hand is blockwise
    (``blockwise=True``: the ``flash`` kernel with token indices, O(queries x ``block_size``) memory; the ring merges
    each step's output by its log-sum-exp) or computed from materialized ``(queries, keys)`` scores.

    Args:
        Pos: the position axis of query, key and value.
        HeadSize: the contracted per-head axis.
        query: ``(..., Pos, heads..., HeadSize)``.
        key: ``(..., Pos, kv heads..., HeadSize)``.
        value: like ``key``.
        mask: an :class:`~ponente.models.AttentionMask` or None.
        mode: ``"ring"`` or ``"allgather"``.
        blockwise: compute each device's part with the blockwise kernel.
        block_size: its tile size.
        scaling_factor: multiplies the scores (None: ``1/sqrt(HeadSize.size)``).
        logit_soft_cap: caps the scaled logits (``cap * tanh(logits / cap)``) before masking; None: no cap.
        sinks: per-head sink logits over the query's head axes, added to each softmax's denominator (gpt-oss); None:
            none.

    Returns:
        The attended values with the query's axes (the value's dtype).

    Raises:
        ValueError: for an explicit boolean mask (the mask is built per device from its description), an unknown
            ``mode``, or sinks over an axis the query's heads lack.
    """
    if mask is not None and not isinstance(mask, AttentionMask):
        raise ValueError(
            "context-parallel attention: pass an AttentionMask (causal, sliding window, segment ids, token index)"
        )
    if mode not in ATTENTION_CONTEXT_PARALLEL:
        raise ValueError(f"context-parallel attention: mode must be one of {ATTENTION_CONTEXT_PARALLEL}, got {mode!r}")
    scale = 1.0 / (HeadSize.size**0.5) if scaling_factor is None else scaling_factor
    shared = tuple(ax for ax in key.axes if ax.name not in (Pos.name, HeadSize.name))
    rest = tuple(ax for ax in query.axes if ax.name not in (Pos.name, HeadSize.name) and not key.has_axis(ax.name))
    D = query.resolve_axis(HeadSize.name)
    q = query.rearrange((*shared, Pos, *rest, D))
    k = key.rearrange((*shared, Pos, D))
    v = value.rearrange((*shared, Pos, D))
    index = hax.arange(Pos) if mask is None or mask.token_index is None else mask.token_index
    if index.axes != (Pos,):
        raise ValueError(f"context-parallel attention: token_index must be over {Pos.name!r} alone, got {index.axes}")
    seg = None
    if mask is not None and mask.segment_ids is not None:
        seg = hax.broadcast_to(mask.segment_ids, (*shared, Pos)).rearrange((*shared, Pos)).array
    sink = None
    if sinks is not None:
        heads = (*shared, *rest)
        outside = [ax.name for ax in sinks.axes if ax.name not in {h.name for h in heads}]
        if outside:
            raise ValueError(f"context-parallel attention: sinks axes {outside} are not head axes of the query")
        sink = hax.broadcast_to(sinks, heads).rearrange(heads).array  # as q's (shared..., rest...), for shard_map
    axis, devices = context_axis(Pos)
    kwargs: dict[str, Any] = {
        "n_shared": len(shared),
        "scale": scale,
        "causal": mask is not None and mask.is_causal,
        "window": None if mask is None else mask.sliding_window,
        "soft_cap": logit_soft_cap,
    }
    if mode == "allgather":
        local: Any = functools.partial(_gathered_local, block_size=block_size if blockwise else None)
    elif blockwise:
        local = functools.partial(_ring_blockwise_local, block_size=block_size)
    else:
        local = _ring_local
    if axis is None:
        out = local(
            q.array, k.array, v.array, index.array, index.array, seg, seg, axis=None, devices=1, sinks=sink, **kwargs
        )
    else:
        q_spec, k_spec = pspec_for_axis(q.axes), pspec_for_axis(k.axes)
        idx_spec = PartitionSpec(axis)
        optional = [  # (array, spec) of the inputs a call may lack
            (seg, pspec_for_axis((*shared, Pos))),
            (sink, pspec_for_axis((*shared, *rest))),
        ]
        given = [(x, spec) for x, spec in optional if x is not None]

        def body(qa: Any, ka: Any, va: Any, ia: Any, *more: Any) -> Any:
            it = iter(more)
            s, sk = (next(it) if x is not None else None for x, _ in optional)
            return local(qa, ka, va, ia, ia, s, s, axis=axis, devices=devices, sinks=sk, **kwargs)

        out = jax.shard_map(
            body,
            mesh=current_or_abstract_mesh(),
            in_specs=(q_spec, k_spec, k_spec, idx_spec, *(spec for _, spec in given)),
            out_specs=q_spec,
            check_vma=False,
        )(q.array, k.array, v.array, index.array, *(x for x, _ in given))
    return hax.named(out, q.axes).rearrange(query.axes)


def ring_attention(
    Pos: Axis,
    HeadSize: Axis,
    query: NamedArray,
    key: NamedArray,
    value: NamedArray,
    mask: AttentionMask | NamedArray | None,
    *,
    scaling_factor: float | None = None,
    logit_soft_cap: float | None = None,
) -> NamedArray:
    """Ring attention: :func:`context_parallel_attention` with ``mode="ring"`` (see the module)."""
    return context_parallel_attention(
        Pos,
        HeadSize,
        query,
        key,
        value,
        mask,
        mode="ring",
        scaling_factor=scaling_factor,
        logit_soft_cap=logit_soft_cap,
    )
