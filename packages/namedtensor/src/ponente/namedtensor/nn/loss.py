"""Losses over named arrays: cross-entropy (with log-normalizers for z-loss), binary cross-entropy, reduction."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from .. import reductions
from ..axis import AxisSelection, AxisSelector
from ..core import NamedArray
from ..dot import dot
from ..ops import where as _hwhere
from .functional import logsumexp

__all__ = [
    "binary_cross_entropy_loss",
    "cross_entropy_loss",
    "cross_entropy_loss_and_log_normalizers",
    "maybe_reduce_loss",
    "reduce_loss",
]

ReductionFunction = Callable[..., NamedArray]
"""A reduction called as ``fn(array, axis=..., where=...)``, e.g. ``hax.mean`` or ``hax.sum``."""

_UNSPECIFIED: Any = object()


def cross_entropy_loss_and_log_normalizers(
    pred_y: NamedArray, Label: AxisSelector, target_y: NamedArray
) -> tuple[NamedArray, NamedArray]:
    """Per-example cross-entropy and the log-normalizers ``logsumexp(logits)`` (for a z-loss).

    Args:
        pred_y: the logits, with the ``Label`` axis.
        Label: the class axis.
        target_y: the target distribution (e.g. one-hot) over ``Label``.

    Returns:
        ``(loss, log_normalizers)``, both with the axes of ``pred_y`` minus ``Label``. A z-loss is
        ``z_weight * log_normalizers ** 2``.

    Raises:
        ValueError: if ``Label`` is missing from ``pred_y``.
    """
    if not pred_y.has_axis(Label):
        raise ValueError(f"cross_entropy_loss: the logits have no axis {Label!r}; their axes are {pred_y.axis_names}")
    log_normalizers = logsumexp(pred_y, Label)
    loss = dot(target_y, log_normalizers - pred_y, axis=Label)
    return loss, log_normalizers


def maybe_reduce_loss(
    arr: NamedArray,
    reduction: ReductionFunction | None,
    reduction_axis: AxisSelection | None,
    where: NamedArray | None,
) -> NamedArray:
    """Reduces a per-example loss unless ``reduction`` is None or ``reduction_axis`` is ``()``.

    Args:
        arr: the per-example loss.
        reduction: the reduction (``hax.mean``, ``hax.sum``...), or None for no reduction.
        reduction_axis: the axes to reduce (None: all of them).
        where: optional boolean mask of the elements to include; without a reduction, masked-out
            elements are set to 0.

    Returns:
        The reduced (or masked) loss.
    """
    if reduction is not None and reduction_axis != ():
        return reduction(arr, axis=reduction_axis, where=where)
    if where is not None:
        return _hwhere(where, arr, 0)
    return arr


def reduce_loss(
    arr: NamedArray,
    reduction: ReductionFunction | None = reductions.mean,
    reduction_axis: AxisSelection | None = None,
    where: NamedArray | None = None,
) -> NamedArray:
    """Reduces a loss with ``reduction`` (default: mean) over ``reduction_axis`` (default: all axes).

    Args:
        arr: the per-example loss.
        reduction: the reduction function; None leaves the loss unreduced.
        reduction_axis: the axes to reduce; None reduces all axes.
        where: optional boolean mask of the elements to include.

    Returns:
        The reduced loss.
    """
    return maybe_reduce_loss(arr, reduction, reduction_axis, where)


def cross_entropy_loss(
    logits: NamedArray,
    Label: AxisSelector,
    targets: NamedArray,
    reduction: ReductionFunction | None = _UNSPECIFIED,
    where: NamedArray | None = None,
    reduction_axis: AxisSelection | None = None,
) -> NamedArray:
    """Cross-entropy between ``softmax(logits)`` and a target distribution over ``Label``.

    Args:
        logits: the logits, with the ``Label`` axis.
        Label: the class axis.
        targets: target probabilities (e.g. :func:`one_hot` labels) over ``Label``.
        reduction: how to reduce the per-example loss (default ``hax.mean``; None for no reduction).
        where: optional boolean mask of the examples to include.
        reduction_axis: the axes to reduce (default all).

    Returns:
        The (reduced) loss.

    Raises:
        ValueError: if ``Label`` is missing from the logits.

    Example:
        >>> import jax.numpy as jnp
        >>> import ponente.namedtensor as hax
        >>> V = hax.Axis("vocab", 4)
        >>> logits = hax.zeros({"b": 2, "vocab": 4})
        >>> targets = hax.nn.one_hot(hax.named(jnp.array([1, 3]), "b"), V)
        >>> round(float(cross_entropy_loss(logits, V, targets).scalar()), 4)  # log(4)
        1.3863
    """
    if reduction is _UNSPECIFIED:
        reduction = reductions.mean
    loss, _ = cross_entropy_loss_and_log_normalizers(logits, Label, targets)
    return maybe_reduce_loss(loss, reduction, reduction_axis, where)


def binary_cross_entropy_loss(
    logits: NamedArray,
    targets: NamedArray,
    reduction: ReductionFunction | None = _UNSPECIFIED,
    where: NamedArray | None = None,
    reduction_axis: AxisSelection | None = None,
) -> NamedArray:
    """Binary cross-entropy ``-t log sigmoid(x) - (1 - t) log sigmoid(-x)``, element-wise, then reduced.

    Args:
        logits: the logits.
        targets: targets in ``[0, 1]`` (axes a subset of the logits').
        reduction: how to reduce (default ``hax.mean``; None for no reduction).
        where: optional boolean mask of the elements to include.
        reduction_axis: the axes to reduce (default all).

    Returns:
        The (reduced) loss.
    """
    if reduction is _UNSPECIFIED:
        reduction = reductions.mean
    log_p = NamedArray(jax.nn.log_sigmoid(logits.array), logits.axes)
    log_not_p = NamedArray(jax.nn.log_sigmoid(-logits.array), logits.axes)
    loss = -(targets * log_p) - (1 - targets) * log_not_p
    return maybe_reduce_loss(loss, reduction, reduction_axis, where)
