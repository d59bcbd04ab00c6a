"""The fused cross-entropy: chunks of positions over the whole vocabulary, the gradient computed with the loss.

:func:`fused_cross_entropy_loss` reduces (``"mean"`` or ``"sum"``) in the same pass that computes each chunk's
logits, loss and gradients, so its backward pass only scales the gradients it kept: three matrix products over the
vocabulary, the plain loss's count, with at most one chunk's logits alive at a time.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import ponente.namedtensor as hax
from ponente.namedtensor import Axis, AxisSelector, NamedArray

from ._axes import loss_axes

__all__ = ["FUSED_LOSS_CHUNK_ELEMENTS", "fused_cross_entropy_loss"]

FUSED_LOSS_CHUNK_ELEMENTS = 2**27
"""Logits per position chunk of :func:`fused_cross_entropy_loss` (its default ``chunk_size``).

``2**27`` logits are 1024 tokens of a 128k vocabulary (256 MiB in bfloat16), matrix products still large enough to
keep an accelerator busy. On an H100 (bfloat16, batch 4 x 2048, vocabulary 128256) the fused loss's forward and
backward take 22.6 ms against the plain loss's 21.3 ms in 0.13 of its scratch memory; ``2**28`` takes 21.1 ms in
0.25 of it.
"""


@dataclasses.dataclass(frozen=True)
class _FusedSpec:
    """Static settings of the position-chunked fused cross-entropy (a ``nondiff`` argument of its custom VJP)."""

    chunk: int  # positions per chunk
    positions: int  # the length of the position axis (the second-to-last of ``h``)
    z_loss_weight: float
    dtype: Any  # of the softmax, its statistics and the loss
    groups: int = 1  # > 1: ``h`` and the token arrays have a leading group axis of this size

    @property
    def num_chunks(self) -> int:
        return -(-self.positions // self.chunk)


def _fused_chunks(
    spec: _FusedSpec, h: jax.Array, w: jax.Array, t: jax.Array, wt: jax.Array, *, grads: bool
) -> tuple[jax.Array, ...]:
    """``sum(wt * loss)`` over ``h [..., position, embed]``, one chunk of positions (all vocabulary columns) at a time.

    With ``grads`` the same pass also returns the gradients of that sum wrt ``h`` and ``w`` (in their dtype) and the
    per-token loss (the gradient wrt ``wt``): each chunk's logits serve its loss and its gradient, so the loss and
    its gradient cost three matrix products over the vocabulary instead of four.

    Each matrix product accumulates in float32 (on accelerators; XLA:CPU upcasts bfloat16) and returns the inputs'
    dtype, as the plain loss's logits and gradients are in the compute dtype. With bfloat16 inputs this is what keeps
    the fused loss about as fast as the plain one on an H100 (:data:`FUSED_LOSS_CHUNK_ELEMENTS`): float32 logits and a
    float32 accumulator of the projection's gradient cost a pass over 4-byte chunk logits and a read and write of a
    float32 ``[embed, vocab]`` array per chunk (27.6 ms instead of 22.6 at batch 4 x 2048, vocabulary 128256), and
    the accumulator alone would be 1 GiB at that size.

    With ``spec.groups > 1``, ``h`` is ``[group, ..., position, embed]``: the loss and the projection's gradient are
    summed per group inside the loop and over the groups once after it. With one group per shard of a sharded batch,
    each device adds up its own share and the shares are reduced once, not once per chunk (see
    :func:`fused_cross_entropy_loss`). With one group the arrays have no group axis (the program measured on one GPU).
    """
    axis = h.ndim - 2
    vocab_ids = jnp.arange(w.shape[1])
    grouped = spec.groups > 1
    per_group = tuple(range(1, h.ndim - 1)) if grouped else None  # the token axes summed inside a group
    dw_product = "g...ce,g...cv->gev" if grouped else "...ce,...cv->ev"

    def visit(c: jax.Array, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        # the last chunk is shifted left to end at the last position (no padded copy of ``h``); the positions it
        # repeats weigh 0 there, so nothing is counted twice
        start = jnp.minimum(c * spec.chunk, spec.positions - spec.chunk)
        fresh = start + jnp.arange(spec.chunk) >= c * spec.chunk
        h_c = lax.dynamic_slice_in_dim(h, start, spec.chunk, axis=axis)
        t_c = lax.dynamic_slice_in_dim(t, start, spec.chunk, axis=axis)
        wt_c = jnp.where(fresh, lax.dynamic_slice_in_dim(wt, start, spec.chunk, axis=axis), 0.0)
        # no cast of ``w`` (a float32 copy would be vocabulary-sized); the softmax is computed in ``spec.dtype``
        logits = jnp.matmul(h_c, w, preferred_element_type=h.dtype).astype(spec.dtype)
        lse = jax.nn.logsumexp(logits, axis=-1)
        is_target = vocab_ids == t_c[..., None]  # never true for ids outside the vocabulary: target logit 0
        loss_c = lse - jnp.sum(jnp.where(is_target, logits, 0.0), axis=-1) + spec.z_loss_weight * lse * lse
        total = carry[0] + jnp.sum(wt_c * loss_c, axis=per_group)
        if not grads:
            return (total,)
        _, dh, dw, loss = carry
        # d loss / d logits = softmax * (1 + 2 z lse) - onehot(target), times the token's weight
        coef = wt_c * (1.0 + 2.0 * spec.z_loss_weight * lse)
        dlogits = coef[..., None] * jnp.exp(logits - lse[..., None]) - jnp.where(is_target, wt_c[..., None], 0.0)
        dlogits = dlogits.astype(h.dtype)
        dh_c = jnp.einsum("...cv,ev->...ce", dlogits, w, preferred_element_type=spec.dtype).astype(dh.dtype)
        # the repeated positions of a shifted chunk have dh_c = 0: adding keeps what the previous chunk wrote
        dh_c = lax.dynamic_slice_in_dim(dh, start, spec.chunk, axis=axis) + dh_c
        dh = lax.dynamic_update_slice_in_dim(dh, dh_c, start, axis=axis)
        # fused into the matrix product as its accumulator (C += A B) by XLA:GPU
        dw = dw + jnp.einsum(dw_product, h_c, dlogits, preferred_element_type=dw.dtype)
        loss_c = jnp.where(fresh, loss_c, lax.dynamic_slice_in_dim(loss, start, spec.chunk, axis=axis))
        return total, dh, dw, lax.dynamic_update_slice_in_dim(loss, loss_c, start, axis=axis)

    lead = (spec.groups,) if grouped else ()
    init: tuple[jax.Array, ...] = (jnp.zeros(lead, spec.dtype),)
    if grads:
        init = (*init, jnp.zeros_like(h), jnp.zeros((*lead, *w.shape), w.dtype), jnp.zeros(t.shape, spec.dtype))
    out = lax.fori_loop(0, spec.num_chunks, visit, init)
    if not grouped:
        return tuple(out)
    total = jnp.sum(out[0])
    if not grads:
        return (total,)
    # the groups' gradients are added in their dtype: across devices, one all-reduce of the size of ``w`` (bfloat16 for
    # a bfloat16 model, like the other weights' gradients)
    return total, out[1], jnp.sum(out[2], axis=0, dtype=w.dtype), out[3]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused_ce(spec: _FusedSpec, h: jax.Array, w: jax.Array, t: jax.Array, wt: jax.Array) -> jax.Array:
    return _fused_chunks(spec, h, w, t, wt, grads=False)[0]


def _fused_ce_fwd(
    spec: _FusedSpec, h: jax.Array, w: jax.Array, t: jax.Array, wt: jax.Array
) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    total, dh, dw, loss = _fused_chunks(spec, h, w, t, wt, grads=True)
    # the gradients are the residuals: the backward pass only scales them by the (scalar) cotangent
    return total, (dh, dw, loss)


def _fused_ce_bwd(spec: _FusedSpec, res: tuple[jax.Array, ...], g: jax.Array) -> tuple[Any, ...]:
    dh, dw, loss = res

    def scaled(x: jax.Array) -> jax.Array:
        return (x.astype(spec.dtype) * g).astype(x.dtype)

    return scaled(dh), scaled(dw), None, scaled(loss)


_fused_ce.defvjp(_fused_ce_fwd, _fused_ce_bwd)


def _axis_shards(axis: Axis) -> int:
    """How many shards ``axis`` is split into under the current axis mapping and mesh (1 without either)."""
    try:
        return hax.partitioning.physical_axis_size(axis) or 1
    except ValueError:  # no mesh (nothing is split), or a mapping the mesh lacks (sharding the inputs reports it)
        return 1


def _fused_groups(where: str, others: tuple[Axis, ...], groups: int | None) -> tuple[Axis | None, int]:
    """The token axis to split into groups and the number of groups of :func:`fused_cross_entropy_loss`."""
    if groups is None:
        for ax in others:
            shards = _axis_shards(ax)
            if shards > 1 and ax.size % shards == 0:
                return ax, shards
        return None, 1
    if groups < 1:
        raise ValueError(f"{where}: groups must be >= 1, got {groups}")
    if groups == 1:
        return None, 1
    if not others or others[0].size % groups:
        raise ValueError(
            f"{where}: groups={groups} must divide the first token axis other than the positions; got {others}"
        )
    return others[0], groups


def _fused_chunk_size(vocab: int, tokens_per_position: int, positions: int) -> int:
    """The default positions per chunk: ``FUSED_LOSS_CHUNK_ELEMENTS`` logits, rounded down to a power of two."""
    budget = max(1, FUSED_LOSS_CHUNK_ELEMENTS // vocab // tokens_per_position)
    return min(1 << (budget.bit_length() - 1), positions)


def fused_cross_entropy_loss(
    hidden: NamedArray,
    lm_head: NamedArray,
    targets: NamedArray,
    *,
    weights: NamedArray | None = None,
    reduction: str = "mean",
    z_loss_weight: float = 0.0,
    chunk_size: int | None = None,
    Pos: AxisSelector = "position",
    dtype: Any = jnp.float32,
    groups: int | None = None,
) -> NamedArray:
    """The reduced cross-entropy of ``logits = hidden · lm_head``, its gradient computed with the loss.

    The positions are processed ``chunk_size`` at a time over the whole vocabulary. For each chunk the forward pass
    of the gradient computes the logits, the loss and at once the gradient wrt the logits, and from it the chunk's
    gradient wrt ``hidden`` and its share of the gradient wrt ``lm_head``: three matrix products over the vocabulary
    in all (the plain loss's count), where :func:`~ponente.models.loss.blockwise_cross_entropy_loss` recomputes the
    logits in its backward pass (four). At most one chunk's logits exist at a time; the gradients wrt ``hidden`` and
    ``lm_head`` are kept from the forward to the backward pass (the backward pass scales them by the cotangent).
    Without a gradient only the loss is computed. The loss of a token is
    ``lse - logits[target] + z_loss_weight * lse**2``.

    Args:
        hidden: ``(..., Pos, ..., Embed)`` hidden states (e.g. :meth:`~ponente.models.LmHeadModel.activations`), of
            any float dtype (kept: with bfloat16 inputs the matrix products accumulate in float32 and return bfloat16,
            like the plain loss's logits; the softmax is computed in ``dtype``).
        lm_head: the output projection over ``(Embed, Vocab)`` in either order; ``Embed`` is the axis it shares with
            ``hidden``. Its gradient has its dtype and is summed over the chunks in it.
        targets: integer target ids with exactly ``hidden``'s axes minus ``Embed`` (ids outside the vocabulary
            contribute a target logit of 0).
        weights: per-token weights with ``targets``' axes or some of them (broadcast), e.g. the loss mask
            (None: all 1).
        reduction: ``"sum"`` (of ``weights * loss``) or ``"mean"`` (that sum divided by ``sum(weights)``, at least
            1: with a 0/1 mask, the mean over the unmasked tokens).
        z_loss_weight: the z-loss weight (0: none).
        chunk_size: positions per chunk (clipped to the length of ``Pos``; the last chunk overlaps the one before it
            when the length is not a multiple, its repeated positions weighing 0). None:
            :data:`FUSED_LOSS_CHUNK_ELEMENTS` logits per chunk, i.e. that divided by the vocabulary size and by the
            tokens per position (the other token axes, e.g. the batch), rounded down to a power of two.
        Pos: the position axis, the one sliced into chunks (the others, e.g. a sharded batch, are never sliced).
        dtype: the computation dtype of the softmax and the loss.
        groups: how many groups to split the first sharded token axis into (e.g. the batch over data-parallel
            devices), each summing its own loss and projection gradient over all chunks, the groups' sums added once
            at the end. With one group per shard no device waits on another inside the loop: with a single group, a
            batch sharded over devices has its projection gradient (``[embed, vocab]``) reduced across them once per
            chunk. None: the number of shards of the token axes under the current
            :func:`ponente.namedtensor.partitioning.axis_mapping` and mesh (the first token axis other than ``Pos``
            that is split, if its size is a multiple of its shards), else 1. The default chunk then counts the tokens
            per position of one group.

    Returns:
        The loss, a scalar NamedArray of ``dtype``.

    Raises:
        ValueError: if ``lm_head`` is not two axes, one shared with ``hidden``, if ``targets``' axes are not
            ``hidden``'s minus ``Embed``, if ``weights`` has other axes, if ``Pos`` is not one of them, for a
            ``reduction`` other than ``"mean"``/``"sum"``, for a ``chunk_size`` below 1, or for ``groups`` below 1 or
            not dividing the first token axis other than ``Pos``.

    Example:
        >>> import jax, ponente.namedtensor as hax
        >>> Batch, Pos, Embed, Vocab = hax.make_axes(batch=2, position=5, embed=8, vocab=50)
        >>> h = hax.random.normal(jax.random.key(0), (Batch, Pos, Embed))
        >>> w = hax.random.normal(jax.random.key(1), (Embed, Vocab))
        >>> t = hax.random.randint(jax.random.key(2), (Batch, Pos), 0, Vocab.size)
        >>> fused_cross_entropy_loss(h, w, t, chunk_size=2).shape
        {}
    """
    where = "fused_cross_entropy_loss"
    if reduction not in ("mean", "sum"):
        raise ValueError(f"{where}: reduction must be 'mean' or 'sum', got {reduction!r}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"{where}: chunk_size must be >= 1, got {chunk_size}")
    Embed, Vocab, token_axes = loss_axes(where, hidden, lm_head, targets)
    pos_name = Pos if isinstance(Pos, str) else Pos.name
    Position = next((ax for ax in token_axes if ax.name == pos_name), None)
    if Position is None:
        raise ValueError(f"{where}: Pos {pos_name!r} must be one of hidden's token axes {token_axes}")
    if weights is None:
        weights = hax.ones(token_axes, dtype=dtype)
    elif not {ax.name for ax in weights.axes} <= {ax.name for ax in token_axes}:
        raise ValueError(f"{where}: weights must have (some of) targets' axes {token_axes}; got {weights.axes}")
    else:
        weights = hax.broadcast_to(weights, token_axes)
    # the position axis last among the token axes (a no-op for the usual (batch, position, embed) layout); the other
    # token axes stay separate dimensions
    others = tuple(ax for ax in token_axes if ax.name != Position.name)
    Split, n_groups = _fused_groups(where, others, groups)
    if Split is not None:
        others = (Split, *(ax for ax in others if ax.name != Split.name))
    order = (*others, Position)
    common = jnp.promote_types(hidden.dtype, lm_head.dtype)
    h = hidden.rearrange((*order, Embed)).array.astype(common)
    w = lm_head.rearrange((Embed, Vocab)).array.astype(common)
    t = targets.rearrange(order).array.astype(jnp.int32)
    wt = weights.rearrange(order).array.astype(dtype)
    if reduction == "mean":
        wt = wt / jnp.maximum(jnp.sum(wt), 1.0)
    per_position = int(np.prod([ax.size for ax in others], dtype=np.int64))
    # one leading group axis, split off the first token axis (the one that is sharded; ``order`` puts it first)
    if n_groups > 1:
        h, t, wt = (x.reshape(n_groups, x.shape[0] // n_groups, *x.shape[1:]) for x in (h, t, wt))
    chunk = (
        _fused_chunk_size(Vocab.size, per_position // n_groups, Position.size)
        if chunk_size is None
        else min(chunk_size, Position.size)
    )
    spec = _FusedSpec(
        chunk=chunk,
        positions=Position.size,
        z_loss_weight=float(z_loss_weight),
        dtype=jnp.dtype(dtype),
        groups=n_groups,
    )
    return NamedArray(_fused_ce(spec, h, w, t, wt), ())
