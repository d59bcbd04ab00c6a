"""Dropout: zero elements at random (scaling the rest) during training, identity at inference."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from ..axis import AxisSpec, axis_name
from ..core import NamedArray
from ..random import bernoulli

__all__ = ["Dropout", "dropout"]


def dropout(
    x: NamedArray,
    pdrop: float,
    broadcast_axes: AxisSpec | None = None,
    *,
    inference: bool,
    key: jax.Array | None = None,
) -> NamedArray:
    """Zeroes each element with probability ``pdrop`` and scales the others by ``1 / (1 - pdrop)``.

    Args:
        x: the input.
        pdrop: the drop probability, in ``[0, 1]``.
        broadcast_axes: axes along which the same mask is shared (e.g. the position axis).
        inference: if True, return ``x`` unchanged.
        key: the PRNG key (required when not in inference mode and ``0 < pdrop``).

    Returns:
        The array with dropout applied (same axes).

    Raises:
        ValueError: if ``pdrop`` is outside ``[0, 1]``, or no key is given when one is needed.

    Example:
        >>> import jax
        >>> import ponente.namedtensor as hax
        >>> y = dropout(hax.ones({"b": 4}), 0.5, inference=False, key=jax.random.key(0))
        >>> sorted(set(y.array.tolist())) in ([0.0, 2.0], [0.0], [2.0])
        True
    """
    if isinstance(pdrop, (int, float)) and not 0.0 <= pdrop <= 1.0:
        raise ValueError(f"dropout: pdrop must be in [0, 1], got {pdrop}")
    if inference or (isinstance(pdrop, (int, float)) and pdrop == 0.0):
        return x
    if isinstance(pdrop, (int, float)) and pdrop == 1.0:
        return NamedArray(jnp.zeros_like(x.array), x.axes)
    if key is None:
        raise ValueError("dropout: a key is required when not in inference mode (pass key=..., or inference=True)")
    if broadcast_axes is None:
        mask_axes = x.axes
    else:
        b = axis_name(broadcast_axes)
        names = (b,) if isinstance(b, str) else b
        missing = [n for n in names if not x.has_axis(n)]
        if missing:
            raise ValueError(f"dropout: broadcast axes {missing} are not in the input, whose axes are {x.axis_names}")
        mask_axes = tuple(ax for ax in x.axes if ax.name not in names)
    q = 1.0 - pdrop
    keep = bernoulli(key, mask_axes, q)
    return NamedArray(jnp.where(_aligned_mask(keep, x), x.array / jnp.asarray(q, x.dtype), 0), x.axes)


def _aligned_mask(mask: NamedArray, x: NamedArray) -> Any:
    shape = tuple(ax.size if mask.has_axis(ax.name) else 1 for ax in x.axes)
    return mask.array.reshape(shape)


class Dropout(eqx.Module):
    """Dropout as a layer. ``inference`` may be set on the module or per call.

    Attributes:
        pdrop: the drop probability (static).
        broadcast_axes: axes sharing one mask (static).
        inference: default mode; True disables dropout.

    Example:
        >>> import jax
        >>> import ponente.namedtensor as hax
        >>> Dropout(0.1)(hax.ones({"b": 3}), inference=True).array.tolist()
        [1.0, 1.0, 1.0]
    """

    pdrop: float = eqx.field(default=0.5, static=True)
    broadcast_axes: AxisSpec | None = eqx.field(default=None, static=True)
    inference: bool = False

    def __call__(self, x: NamedArray, *, inference: bool | None = None, key: jax.Array | None = None) -> NamedArray:
        """Applies dropout.

        Args:
            x: the input.
            inference: overrides the module's ``inference`` flag when given.
            key: the PRNG key (needed in training mode).

        Returns:
            The array with dropout applied.

        Raises:
            ValueError: if a key is needed and missing.
        """
        inf = self.inference if inference is None else inference
        return dropout(x, self.pdrop, self.broadcast_axes, inference=inf, key=key)
