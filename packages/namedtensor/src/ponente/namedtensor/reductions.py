"""Reductions over named axes: ``sum``, ``mean``, ``max``, ... with ``where=`` masks, and their ``nan*`` forms.

Every reduction takes ``axis`` (one axis, several, or ``None`` for all) and returns a named array with the
remaining axes in their original order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp

from .axis import AxisSelection, AxisSelector
from .core import NamedArray
from .wrap import wrap_reduction_call

__all__ = [
    "all",
    "amax",
    "amin",
    "any",
    "argmax",
    "argmin",
    "max",
    "mean",
    "min",
    "nanargmax",
    "nanargmin",
    "nanmax",
    "nanmean",
    "nanmin",
    "nanprod",
    "nanstd",
    "nansum",
    "nanvar",
    "prod",
    "product",
    "ptp",
    "std",
    "sum",
    "var",
]

Where = NamedArray | None


def _extreme_initial(dtype: Any, largest: bool) -> Any:
    if jnp.issubdtype(dtype, jnp.floating):
        return -jnp.inf if largest else jnp.inf
    if jnp.issubdtype(dtype, jnp.bool_):
        return not largest
    info = jnp.iinfo(dtype)
    return info.min if largest else info.max


def _masked_extreme(fn: Callable[..., Any], largest: bool) -> Callable[..., Any]:
    """``jnp.max``/``min`` need ``initial`` with ``where=``; supply the identity so masking just works."""

    def call(a: Any, axis: Any, where: Any = None, **kwargs: Any) -> Any:
        if where is not None and "initial" not in kwargs:
            kwargs["initial"] = _extreme_initial(a.dtype, largest)
        return fn(a, axis=axis, where=where, **kwargs)

    call.__name__ = fn.__name__
    return call


def sum(array: NamedArray, axis: AxisSelection | None = None, *, where: Where = None, dtype: Any = None) -> NamedArray:
    """Sum over ``axis`` (all axes if None), counting only elements where ``where`` is true.

    Example:
        >>> import jax.numpy as jnp, ponente.namedtensor as hax
        >>> hax.sum(hax.named(jnp.ones((2, 3)), ("a", "b")), "b").array.tolist()
        [3.0, 3.0]
    """
    return wrap_reduction_call(jnp.sum, array, axis, where, dtype=dtype)


def prod(
    array: NamedArray, axis: AxisSelection | None = None, *, where: Where = None, dtype: Any = None
) -> NamedArray:
    """Product over ``axis`` (all axes if None), of the elements where ``where`` is true."""
    return wrap_reduction_call(jnp.prod, array, axis, where, dtype=dtype)


def product(
    array: NamedArray, axis: AxisSelection | None = None, *, where: Where = None, dtype: Any = None
) -> NamedArray:
    """Alias of :func:`prod`."""
    return prod(array, axis, where=where, dtype=dtype)


def mean(
    array: NamedArray, axis: AxisSelection | None = None, *, where: Where = None, dtype: Any = None
) -> NamedArray:
    """Mean over ``axis`` (all axes if None), of the elements where ``where`` is true."""
    return wrap_reduction_call(jnp.mean, array, axis, where, dtype=dtype)


def max(array: NamedArray, axis: AxisSelection | None = None, *, where: Where = None) -> NamedArray:
    """Maximum over ``axis`` (all axes if None); masked-out elements are ignored (``-inf`` if all are)."""
    return wrap_reduction_call(_masked_extreme(jnp.max, True), array, axis, where)


def min(array: NamedArray, axis: AxisSelection | None = None, *, where: Where = None) -> NamedArray:
    """Minimum over ``axis`` (all axes if None); masked-out elements are ignored (``inf`` if all are)."""
    return wrap_reduction_call(_masked_extreme(jnp.min, False), array, axis, where)


def amax(array: NamedArray, axis: AxisSelection | None = None, *, where: Where = None) -> NamedArray:
    """Alias of :func:`max` (as ``jnp.amax`` is of ``jnp.max``).

    Example:
        >>> import jax.numpy as jnp, ponente.namedtensor as hax
        >>> hax.amax(hax.named(jnp.array([[1, 5], [3, 2]]), ("a", "b")), "a").array.tolist()
        [3, 5]
    """
    return max(array, axis, where=where)


def amin(array: NamedArray, axis: AxisSelection | None = None, *, where: Where = None) -> NamedArray:
    """Alias of :func:`min` (as ``jnp.amin`` is of ``jnp.min``)."""
    return min(array, axis, where=where)


def ptp(array: NamedArray, axis: AxisSelection | None = None, *, where: Where = None) -> NamedArray:
    """Peak to peak (``max - min``) over ``axis`` (all axes if None), of the elements where ``where`` is true."""
    if where is None:
        return wrap_reduction_call(jnp.ptp, array, axis, supports_where=False)
    return max(array, axis, where=where) - min(array, axis, where=where)


def std(
    array: NamedArray, axis: AxisSelection | None = None, *, where: Where = None, ddof: int = 0, dtype: Any = None
) -> NamedArray:
    """Standard deviation over ``axis`` (all axes if None), with ``ddof`` delta degrees of freedom."""
    return wrap_reduction_call(jnp.std, array, axis, where, ddof=ddof, dtype=dtype)


def var(
    array: NamedArray, axis: AxisSelection | None = None, *, where: Where = None, ddof: int = 0, dtype: Any = None
) -> NamedArray:
    """Variance over ``axis`` (all axes if None), with ``ddof`` delta degrees of freedom."""
    return wrap_reduction_call(jnp.var, array, axis, where, ddof=ddof, dtype=dtype)


def all(array: NamedArray, axis: AxisSelection | None = None, *, where: Where = None) -> NamedArray:
    """Whether all elements (where ``where`` is true) are truthy, over ``axis`` (all axes if None)."""
    return wrap_reduction_call(jnp.all, array, axis, where)


def any(array: NamedArray, axis: AxisSelection | None = None, *, where: Where = None) -> NamedArray:
    """Whether any element (where ``where`` is true) is truthy, over ``axis`` (all axes if None)."""
    return wrap_reduction_call(jnp.any, array, axis, where)


def argmax(array: NamedArray, axis: AxisSelector | None) -> NamedArray:
    """Index of the maximum along one axis (or into the flattened array if ``axis`` is None)."""
    return wrap_reduction_call(jnp.argmax, array, axis, single_axis_only=True, supports_where=False)


def argmin(array: NamedArray, axis: AxisSelector | None) -> NamedArray:
    """Index of the minimum along one axis (or into the flattened array if ``axis`` is None)."""
    return wrap_reduction_call(jnp.argmin, array, axis, single_axis_only=True, supports_where=False)


def nansum(
    array: NamedArray, axis: AxisSelection | None = None, *, where: Where = None, dtype: Any = None
) -> NamedArray:
    """Sum ignoring NaNs, over ``axis`` (all axes if None)."""
    return wrap_reduction_call(jnp.nansum, array, axis, where, dtype=dtype)


def nanprod(
    array: NamedArray, axis: AxisSelection | None = None, *, where: Where = None, dtype: Any = None
) -> NamedArray:
    """Product ignoring NaNs, over ``axis`` (all axes if None)."""
    return wrap_reduction_call(jnp.nanprod, array, axis, where, dtype=dtype)


def nanmean(
    array: NamedArray, axis: AxisSelection | None = None, *, where: Where = None, dtype: Any = None
) -> NamedArray:
    """Mean ignoring NaNs, over ``axis`` (all axes if None)."""
    return wrap_reduction_call(jnp.nanmean, array, axis, where, dtype=dtype)


def nanmax(array: NamedArray, axis: AxisSelection | None = None, *, where: Where = None) -> NamedArray:
    """Maximum ignoring NaNs, over ``axis`` (all axes if None)."""
    return wrap_reduction_call(_masked_extreme(jnp.nanmax, True), array, axis, where)


def nanmin(array: NamedArray, axis: AxisSelection | None = None, *, where: Where = None) -> NamedArray:
    """Minimum ignoring NaNs, over ``axis`` (all axes if None)."""
    return wrap_reduction_call(_masked_extreme(jnp.nanmin, False), array, axis, where)


def nanstd(
    array: NamedArray, axis: AxisSelection | None = None, *, where: Where = None, ddof: int = 0, dtype: Any = None
) -> NamedArray:
    """Standard deviation ignoring NaNs, over ``axis`` (all axes if None)."""
    return wrap_reduction_call(jnp.nanstd, array, axis, where, ddof=ddof, dtype=dtype)


def nanvar(
    array: NamedArray, axis: AxisSelection | None = None, *, where: Where = None, ddof: int = 0, dtype: Any = None
) -> NamedArray:
    """Variance ignoring NaNs, over ``axis`` (all axes if None)."""
    return wrap_reduction_call(jnp.nanvar, array, axis, where, ddof=ddof, dtype=dtype)


def nanargmax(array: NamedArray, axis: AxisSelector | None) -> NamedArray:
    """Index of the maximum ignoring NaNs, along one axis (flattened if None)."""
    return wrap_reduction_call(jnp.nanargmax, array, axis, single_axis_only=True, supports_where=False)


def nanargmin(array: NamedArray, axis: AxisSelector | None) -> NamedArray:
    """Index of the minimum ignoring NaNs, along one axis (flattened if None)."""
    return wrap_reduction_call(jnp.nanargmin, array, axis, single_axis_only=True, supports_where=False)
