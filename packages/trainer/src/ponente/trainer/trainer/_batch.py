"""Batches inside the step: their static layout, size checks, token counts, and micro-batching.

A batch is any pytree of NamedArrays (a ``batch`` axis) and arrays (batch first). The step receives it as
plain arrays plus a static :class:`BatchLayout`, splits it into microbatches for gradient accumulation
(:func:`split_microbatches`) and weights each microbatch by its loss tokens (:func:`default_loss_weight`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import ponente.namedtensor as hax
from ponente.namedtensor import NamedArray


def is_named(x: Any) -> bool:
    return isinstance(x, NamedArray)


def _leaves(batch: Any) -> list[Any]:
    return jax.tree_util.tree_leaves(batch, is_leaf=is_named)


def _batch_size_of(leaf: Any, batch_axis: str) -> int | None:
    if isinstance(leaf, NamedArray):
        return leaf.resolve_axis(batch_axis).size if leaf.has_axis(batch_axis) else None
    return int(np.shape(leaf)[0]) if np.ndim(leaf) > 0 else None


def default_loss_weight(batch: Any, batch_axis: str = "batch") -> jax.Array:
    """How much a microbatch counts when gradients are accumulated: its number of loss tokens.

    Uses ``batch.loss_mask`` (e.g. an ``LmExample``) or ``batch["loss_mask"]`` if present (the sum of the
    mask), else the number of examples along ``batch_axis``. Accumulating ``weight * grad(mean loss)`` and
    dividing by the total weight then gives exactly the gradient of the full batch's mean loss.

    Args:
        batch: the microbatch.
        batch_axis: the name of the batch axis.

    Returns:
        A float32 scalar.

    Raises:
        ValueError: if there is no loss mask and no leaf has the batch axis.
    """
    mask = batch.get("loss_mask") if isinstance(batch, Mapping) else getattr(batch, "loss_mask", None)
    if mask is not None:
        raw = mask.array if isinstance(mask, NamedArray) else jnp.asarray(mask)
        return jnp.sum(raw.astype(jnp.float32))
    for leaf in _leaves(batch):
        size = _batch_size_of(leaf, batch_axis)
        if size is not None:
            return jnp.asarray(size, dtype=jnp.float32)
    raise ValueError(f"cannot weight a microbatch: it has no loss_mask and no leaf with axis {batch_axis!r}")


def _renamed(x: jax.Array, *, axes: tuple[Any, ...], index: int) -> NamedArray:
    return hax.named(jnp.moveaxis(x, 0, index), axes)


def _identity(x: Any) -> Any:
    return x


def _constant(value: Any, _: Any) -> Any:
    return value


def split_microbatches(batch: Any, batch_axis: str, num_micro: int) -> tuple[Any, Callable[[Any], Any]]:
    """Stack ``batch`` into ``num_micro`` microbatches along a new leading axis.

    Microbatch ``j`` holds examples ``j, j + n, j + 2n, ...`` (n = ``num_micro``): with the batch split
    over devices in contiguous blocks, every microbatch then keeps the same share of each device's
    examples, so no data moves between devices. Returns the stacked arrays and a function that turns
    one slice of them back into a batch. Leaves without the batch axis are shared by all microbatches.
    """
    leaves, treedef = jax.tree_util.tree_flatten(batch, is_leaf=is_named)
    stacked: list[Any] = []
    rebuild: list[Callable[[Any], Any]] = []
    for leaf in leaves:
        if isinstance(leaf, NamedArray) and leaf.has_axis(batch_axis):
            index = leaf.axis_indices(batch_axis)
            Micro = leaf.axes[index].resize(leaf.axes[index].size // num_micro)
            axes = (*leaf.axes[:index], Micro, *leaf.axes[index + 1 :])
            moved = jnp.moveaxis(leaf.array, index, 0)
            per = moved.reshape((Micro.size, num_micro, *moved.shape[1:])).swapaxes(0, 1)
            stacked.append(per)
            rebuild.append(functools.partial(_renamed, axes=axes, index=index))
        elif not isinstance(leaf, NamedArray) and np.ndim(leaf) > 0:
            arr = jnp.asarray(leaf)
            per = arr.reshape((arr.shape[0] // num_micro, num_micro, *arr.shape[1:])).swapaxes(0, 1)
            stacked.append(per)
            rebuild.append(_identity)
        else:
            stacked.append(None)
            rebuild.append(functools.partial(_constant, leaf))

    def unstack(slices: list[Any]) -> Any:
        return jax.tree_util.tree_unflatten(treedef, [f(s) for f, s in zip(rebuild, slices)])

    return stacked, unstack


def check_batch(batch: Any, batch_axis: str, expected: int) -> None:
    for leaf in _leaves(batch):
        size = _batch_size_of(leaf, batch_axis)
        if size is not None and size != expected:
            raise ValueError(
                f"batch has {size} examples along axis {batch_axis!r}, but trainer.train_batch_size is {expected}"
            )


def tokens_in(batch: Any) -> int:
    """Tokens of a batch: the size of its first array (e.g. ``LmExample.tokens`` of shape batch x position)."""
    leaves = _leaves(batch)
    if not leaves:
        return 0
    first = leaves[0]
    return int(first.size if isinstance(first, NamedArray) else np.size(first))


@dataclasses.dataclass(frozen=True)
class BatchLayout:
    """The static part of a batch: its tree structure and the axes of each NamedArray leaf."""

    treedef: Any
    axes: tuple[Any, ...]

    @staticmethod
    def strip(batch: Any) -> tuple[list[Any], BatchLayout]:
        leaves, treedef = jax.tree_util.tree_flatten(batch, is_leaf=is_named)
        arrays = [leaf.array if isinstance(leaf, NamedArray) else leaf for leaf in leaves]
        axes = tuple(leaf.axes if isinstance(leaf, NamedArray) else None for leaf in leaves)
        return arrays, BatchLayout(treedef, axes)

    def restore(self, arrays: Sequence[Any]) -> Any:
        leaves = [a if axes is None else hax.named(a, axes) for a, axes in zip(arrays, self.axes)]
        return jax.tree_util.tree_unflatten(self.treedef, leaves)
