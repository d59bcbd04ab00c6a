"""Cumulative operations along a named axis: ``cumsum``, ``cumprod``, ``cummax``, ``cummin`` and ``nan*``.

As in ``jax.numpy``, ``axis=None`` (``cumsum``, ``cumprod`` and their ``nan*`` forms) works on the flattened
array and returns a plain one-dimensional array.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from .axis import AxisSelector
from .core import NamedArray
from .wrap import wrap_axiswise_call

__all__ = ["cummax", "cummin", "cumprod", "cumsum", "nancumprod", "nancumsum"]


def cumsum(a: NamedArray, axis: AxisSelector | None, *, dtype: Any = None) -> NamedArray:
    """Cumulative sum along ``axis`` (same axes as ``a``).

    Example:
        >>> import jax.numpy as jnp, ponente.namedtensor as hax
        >>> hax.cumsum(hax.named(jnp.arange(4), "a"), "a").array.tolist()
        [0, 1, 3, 6]
    """
    return wrap_axiswise_call(jnp.cumsum, a, axis, dtype=dtype)


def cumprod(a: NamedArray, axis: AxisSelector | None, *, dtype: Any = None) -> NamedArray:
    """Cumulative product along ``axis`` (same axes as ``a``)."""
    return wrap_axiswise_call(jnp.cumprod, a, axis, dtype=dtype)


def nancumsum(a: NamedArray, axis: AxisSelector | None, *, dtype: Any = None) -> NamedArray:
    """Cumulative sum along ``axis``, treating NaNs as zero."""
    return wrap_axiswise_call(jnp.nancumsum, a, axis, dtype=dtype)


def nancumprod(a: NamedArray, axis: AxisSelector | None, *, dtype: Any = None) -> NamedArray:
    """Cumulative product along ``axis``, treating NaNs as one."""
    return wrap_axiswise_call(jnp.nancumprod, a, axis, dtype=dtype)


def cummax(a: NamedArray, axis: AxisSelector, *, reverse: bool = False) -> NamedArray:
    """Running maximum along ``axis`` (from the end if ``reverse``)."""
    return wrap_axiswise_call(jax.lax.cummax, a, axis, reverse=reverse)


def cummin(a: NamedArray, axis: AxisSelector, *, reverse: bool = False) -> NamedArray:
    """Running minimum along ``axis`` (from the end if ``reverse``)."""
    return wrap_axiswise_call(jax.lax.cummin, a, axis, reverse=reverse)
