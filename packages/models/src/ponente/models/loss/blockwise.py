"""The blockwise cross-entropy: one vocabulary block at a time, the logits recomputed in the backward pass.

:func:`blockwise_cross_entropy_loss` never holds the ``(tokens, vocab)`` logits: an online log-sum-exp walks the
vocabulary ``block_size`` columns at a time, and its custom VJP walks them again for the gradient. It returns the
per-token loss (unreduced), so it also serves ``compute_next_token_loss(..., reduction="none")``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from ponente.namedtensor import NamedArray

from ._axes import loss_axes

__all__ = ["blockwise_cross_entropy_loss"]


@dataclasses.dataclass(frozen=True)
class _LossSpec:
    """Static settings of the blockwise cross-entropy (a ``nondiff`` argument of its custom VJP)."""

    block: int
    vocab: int  # the vocabulary size (columns of ``w``)
    z_loss_weight: float
    dtype: Any  # of logits, softmax statistics, loss and accumulated gradients

    @property
    def num_blocks(self) -> int:
        return -(-self.vocab // self.block)


def _vocab_tile(
    spec: _LossSpec, h: jax.Array, w: jax.Array, t: jax.Array, j: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Block ``j`` of the vocabulary: its logits ``[..., block]``, target indicator, first column and ``w`` slice.

    The last block is shifted left to end at the last column (no padded copy of ``w``, which is vocabulary-sized);
    its columns that the previous block already covered get ``-inf`` logits and are never the target.
    """
    start = jnp.minimum(j * spec.block, spec.vocab - spec.block)
    cols = start + jnp.arange(spec.block)
    fresh = cols >= j * spec.block
    # no cast of ``w``: XLA would hoist it out of the loop as a vocabulary-sized copy; the products accumulate in
    # ``spec.dtype`` instead
    w_j = lax.dynamic_slice_in_dim(w, start, spec.block, axis=1)
    logits = jnp.where(fresh, jnp.matmul(h, w_j, preferred_element_type=spec.dtype), -jnp.inf)
    return logits, fresh & (cols == t[..., None]), start, w_j


def _blockwise_forward(spec: _LossSpec, h: jax.Array, w: jax.Array, t: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-token loss and log-sum-exp (``t``'s shape) with an online softmax over vocabulary blocks."""

    def visit(j: jax.Array, carry: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array, jax.Array]:
        m, total, target = carry
        logits, is_target, _, _ = _vocab_tile(spec, h, w, t, j)
        m_new = jnp.maximum(m, logits.max(-1))
        total = total * jnp.exp(m - m_new) + jnp.exp(logits - m_new[..., None]).sum(-1)
        target = target + jnp.sum(jnp.where(is_target, logits, 0.0), axis=-1)
        return m_new, total, target

    init = (jnp.full(t.shape, -jnp.inf, spec.dtype), jnp.zeros(t.shape, spec.dtype), jnp.zeros(t.shape, spec.dtype))
    m, total, target = lax.fori_loop(0, spec.num_blocks, visit, init)
    lse = m + jnp.log(total)
    return lse - target + spec.z_loss_weight * lse * lse, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _blockwise_ce(spec: _LossSpec, h: jax.Array, w: jax.Array, t: jax.Array) -> jax.Array:
    return _blockwise_forward(spec, h, w, t)[0]


def _blockwise_ce_fwd(
    spec: _LossSpec, h: jax.Array, w: jax.Array, t: jax.Array
) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    loss, lse = _blockwise_forward(spec, h, w, t)
    return loss, (h, w, t, lse)


def _blockwise_ce_bwd(spec: _LossSpec, res: tuple[jax.Array, ...], g: jax.Array) -> tuple[Any, ...]:
    h, w, t, lse = res
    # d loss / d logits = softmax * (1 + 2 z lse) - onehot(target)
    coef = g * (1.0 + 2.0 * spec.z_loss_weight * lse)

    def block_grads(carry: tuple[jax.Array, jax.Array], j: jax.Array) -> tuple[tuple[jax.Array, jax.Array], None]:
        dh, dw = carry
        logits, is_target, start, w_j = _vocab_tile(spec, h, w, t, j)
        dlogits = coef[..., None] * jnp.exp(logits - lse[..., None]) - jnp.where(is_target, g[..., None], 0.0)
        dlogits_in = dlogits.astype(h.dtype)
        # 0 on the columns a shifted last block repeats
        dw_j = jnp.einsum("...e,...v->ev", h, dlogits_in, preferred_element_type=spec.dtype)
        # accumulated in place into the gradient buffer (no stack of per-block gradients, no f32 copy of ``w``)
        dw_j = (lax.dynamic_slice_in_dim(dw, start, spec.block, axis=1).astype(spec.dtype) + dw_j).astype(w.dtype)
        dh = dh + jnp.matmul(dlogits_in, w_j.T, preferred_element_type=spec.dtype)
        return (dh, lax.dynamic_update_slice_in_dim(dw, dw_j, start, axis=1)), None

    blocks = jnp.arange(spec.num_blocks)
    init = (jnp.zeros(h.shape, spec.dtype), jnp.zeros_like(w))
    (dh, dw), _ = lax.scan(block_grads, init, blocks)
    return dh.astype(h.dtype), dw, None


_blockwise_ce.defvjp(_blockwise_ce_fwd, _blockwise_ce_bwd)


def blockwise_cross_entropy_loss(
    hidden: NamedArray,
    lm_head: NamedArray,
    targets: NamedArray,
    *,
    block_size: int,
    z_loss_weight: float = 0.0,
    dtype: Any = jnp.float32,
) -> NamedArray:
    """Per-position cross-entropy of ``logits = hidden · lm_head`` without materializing the logits.

    The vocabulary is processed ``block_size`` columns at a time with an online log-sum-exp; the
    backward pass (a custom VJP) recomputes each block, so memory is O(tokens * block_size) instead of
    O(tokens * vocab). The loss at a position is ``lse - logits[target] + z_loss_weight * lse**2``.

    Args:
        hidden: ``(..., Embed)`` hidden states (e.g. :meth:`~ponente.models.LmHeadModel.activations`).
        lm_head: the output projection over ``(Embed, Vocab)`` in either order; ``Embed`` is the axis it
            shares with ``hidden``.
        targets: integer target ids with exactly ``hidden``'s axes minus ``Embed`` (ids outside the
            vocabulary contribute a target logit of 0).
        block_size: vocabulary columns per block (clipped to the vocabulary size; the last block overlaps the one
            before it when the size is not a multiple).
        z_loss_weight: the z-loss weight (0: none).
        dtype: the computation dtype of logits and loss.

    Returns:
        The unreduced, unmasked loss with ``targets``' axes.

    Raises:
        ValueError: if ``lm_head`` is not two axes, one shared with ``hidden``, if ``targets``' axes are
            not ``hidden``'s minus ``Embed``, or if ``block_size`` is below 1.

    Example:
        >>> import jax, ponente.namedtensor as hax
        >>> Pos, Embed, Vocab = hax.make_axes(position=4, embed=8, vocab=50)
        >>> h = hax.random.normal(jax.random.key(0), (Pos, Embed))
        >>> w = hax.random.normal(jax.random.key(1), (Embed, Vocab))
        >>> blockwise_cross_entropy_loss(h, w, hax.arange(Pos), block_size=16).shape
        {'position': 4}
    """
    if block_size < 1:
        raise ValueError(f"blockwise_cross_entropy_loss: block_size must be >= 1, got {block_size}")
    Embed, Vocab, token_axes = loss_axes("blockwise_cross_entropy_loss", hidden, lm_head, targets)
    # token (batch, position) dimensions stay separate: no reshape of possibly sharded axes
    # inputs keep their (common) dtype, e.g. bfloat16: a float32 copy of ``lm_head`` would be vocabulary-sized;
    # products accumulate in ``dtype``
    common = jnp.promote_types(hidden.dtype, lm_head.dtype)
    h = hidden.rearrange((*token_axes, Embed)).array.astype(common)
    w = lm_head.rearrange((Embed, Vocab)).array.astype(common)
    t = targets.rearrange(token_axes).array.astype(jnp.int32)
    blk = min(block_size, Vocab.size)
    spec = _LossSpec(block=blk, vocab=Vocab.size, z_loss_weight=float(z_loss_weight), dtype=jnp.dtype(dtype))
    loss = _blockwise_ce(spec, h, w, t)
    return NamedArray(loss, token_axes)
