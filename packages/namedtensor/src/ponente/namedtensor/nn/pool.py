"""Pooling over named spatial axes: ``max_pool``, ``min_pool``, ``mean_pool`` (and the general ``pool``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp

from ..axis import Axis, AxisSpec
from ..core import NamedArray
from ..partitioning import auto_sharded
from ..util import ensure_tuple

__all__ = ["Padding", "max_pool", "mean_pool", "min_pool", "pool"]

Padding = Literal["SAME", "VALID"] | int | Sequence[int] | Sequence[tuple[int, int]]
"""``"SAME"``, ``"VALID"``, one int for every side, one int per axis, or ``(low, high)`` per axis."""


def _window_axes(Window: AxisSpec) -> tuple[Axis, ...]:
    if isinstance(Window, dict):
        return tuple(Axis(k, v) for k, v in Window.items())
    return tuple(ensure_tuple(Window))  # type: ignore[arg-type]


def _per_axis(value: int | Sequence[int] | None, n: int, default: int, what: str) -> tuple[int, ...]:
    if value is None:
        return (default,) * n
    if isinstance(value, int):
        return (value,) * n
    out = tuple(int(v) for v in value)
    if len(out) != n:
        raise ValueError(f"pool: {what} has {len(out)} entries but the window has {n} axes")
    return out


def _pads(
    padding: Padding, sizes: tuple[int, ...], window: tuple[int, ...], stride: tuple[int, ...]
) -> list[tuple[int, int]]:
    n = len(window)
    if isinstance(padding, str):
        return [tuple(p) for p in jax.lax.padtype_to_pads(sizes, window, stride, padding)]  # type: ignore[misc]
    if isinstance(padding, int):
        return [(padding, padding)] * n
    items: list[Any] = list(padding)
    if len(items) != n:
        raise ValueError(f"pool: padding has {len(items)} entries but the window has {n} axes")
    return [(p, p) if isinstance(p, int) else (int(p[0]), int(p[1])) for p in items]


def _prepare(
    Window: AxisSpec, inputs: NamedArray, stride: int | Sequence[int] | None, padding: Padding, use_ceil: bool
) -> tuple[tuple[int, ...], tuple[int, ...], list[tuple[int, int]], list[tuple[int, int]]]:
    """Full-rank window dims, strides, requested pads and pads including the ``use_ceil`` extra."""
    axes = _window_axes(Window)
    for ax in axes:
        if not inputs.has_axis(ax.name):
            raise ValueError(f"pool: window axis {ax.name!r} is not in the input, whose axes are {inputs.axis_names}")
    win = tuple(ax.size for ax in axes)
    st = _per_axis(stride, len(axes), 1, "stride")
    sizes = tuple(inputs.axis_size(ax.name) for ax in axes)
    pads = _pads(padding, sizes, win, st)
    full_pads = list(pads)
    if use_ceil:
        for i, (n, w, s) in enumerate(zip(sizes, win, st, strict=True)):
            total = n + pads[i][0] + pads[i][1]
            out_ceil = -(-(total - w) // s) + 1
            extra = (out_ceil - 1) * s + w - total
            if extra > 0:
                full_pads[i] = (pads[i][0], pads[i][1] + extra)
    positions = {inputs._index_of(ax.name): i for i, ax in enumerate(axes)}
    dims = tuple(win[positions[d]] if d in positions else 1 for d in range(inputs.ndim))
    strides = tuple(st[positions[d]] if d in positions else 1 for d in range(inputs.ndim))
    req = [pads[positions[d]] if d in positions else (0, 0) for d in range(inputs.ndim)]
    full = [full_pads[positions[d]] if d in positions else (0, 0) for d in range(inputs.ndim)]
    return dims, strides, req, full


def _extreme(dtype: Any, highest: bool) -> Any:
    """The identity of ``min`` (``highest``) or ``max`` for ``dtype``: ±inf for floats, the range ends otherwise."""
    if jnp.issubdtype(dtype, jnp.inexact):
        return jnp.inf if highest else -jnp.inf
    if jnp.issubdtype(dtype, jnp.bool_):
        return highest
    info = jnp.iinfo(dtype)
    return info.max if highest else info.min


def _named_result(inputs: NamedArray, out: jax.Array) -> NamedArray:
    return auto_sharded(NamedArray(out, tuple(ax.resize(n) for ax, n in zip(inputs.axes, out.shape, strict=True))))


def pool(
    Window: AxisSpec,
    inputs: NamedArray,
    init: Any,
    reduce_fn: Callable[[Any, Any], Any],
    stride: int | Sequence[int] | None = None,
    padding: Padding = "VALID",
    use_ceil: bool = False,
) -> NamedArray:
    """Reduces sliding windows with ``reduce_fn`` (``jax.lax.reduce_window``) over named spatial axes.

    Args:
        Window: the window: axes named like the input's spatial axes, sized like the window.
        inputs: the input; axes not in ``Window`` are batch/channel axes.
        init: the reduction's identity (also the value of padding).
        reduce_fn: the binary reduction, e.g. ``jax.lax.max``.
        stride: the stride per window axis (an int for all); default 1.
        padding: ``"VALID"`` (default), ``"SAME"``, or explicit padding.
        use_ceil: round the output size up (pad the high side so the last partial window counts).

    Returns:
        The pooled array: same axes, the window axes with their new sizes.

    Raises:
        ValueError: if a window axis is not in the input or the stride/padding length is wrong.
    """
    dims, strides, _, full = _prepare(Window, inputs, stride, padding, use_ceil)
    out = jax.lax.reduce_window(inputs.array, jnp.asarray(init, inputs.dtype), reduce_fn, dims, strides, full)
    return _named_result(inputs, out)


def max_pool(
    Window: AxisSpec,
    inputs: NamedArray,
    stride: int | Sequence[int] | None = None,
    padding: Padding = "VALID",
    use_ceil: bool = False,
) -> NamedArray:
    """Maximum over sliding windows (padding never wins: it is the dtype's lowest value); see :func:`pool`.

    Example:
        >>> import jax.numpy as jnp
        >>> import ponente.namedtensor as hax
        >>> x = hax.named(jnp.array([1.0, 3.0, 2.0, 5.0]), "t")
        >>> max_pool(hax.Axis("t", 2), x, stride=2).array.tolist()
        [3.0, 5.0]
    """
    return pool(Window, inputs, _extreme(inputs.dtype, highest=False), jax.lax.max, stride, padding, use_ceil)


def min_pool(
    Window: AxisSpec,
    inputs: NamedArray,
    stride: int | Sequence[int] | None = None,
    padding: Padding = "VALID",
    use_ceil: bool = False,
) -> NamedArray:
    """Minimum over sliding windows (padding never wins: it is the dtype's highest value); see :func:`pool`.

    Example:
        >>> import jax.numpy as jnp
        >>> import ponente.namedtensor as hax
        >>> x = hax.named(jnp.array([4, 3, 2, 5], dtype=jnp.int32), "t")
        >>> min_pool(hax.Axis("t", 2), x, stride=2, padding=1).array.tolist()
        [4, 2, 5]
    """
    return pool(Window, inputs, _extreme(inputs.dtype, highest=True), jax.lax.min, stride, padding, use_ceil)


def mean_pool(
    Window: AxisSpec,
    inputs: NamedArray,
    stride: int | Sequence[int] | None = None,
    padding: Padding = "VALID",
    use_ceil: bool = False,
    *,
    count_include_pad: bool = False,
) -> NamedArray:
    """Mean over sliding windows; see :func:`pool` for the arguments.

    Args:
        Window: the window axes.
        inputs: the input.
        stride: the stride per window axis.
        padding: the padding.
        use_ceil: round the output size up.
        count_include_pad: divide by the full window size including requested padding (True) or only by
            the number of real elements (False). Extra ``use_ceil`` padding is never counted.

    Returns:
        The pooled array.
    """
    dims, strides, req, full = _prepare(Window, inputs, stride, padding, use_ceil)
    zero = jnp.asarray(0, inputs.dtype)
    sums = jax.lax.reduce_window(inputs.array, zero, jax.lax.add, dims, strides, full)
    if count_include_pad:
        ones = jnp.ones(tuple(n + lo + hi for n, (lo, hi) in zip(inputs.array.shape, req, strict=True)), inputs.dtype)
        extra = [(0, f[1] - r[1]) for f, r in zip(full, req, strict=True)]
        counts = jax.lax.reduce_window(ones, zero, jax.lax.add, dims, strides, extra)
    else:
        counts = jax.lax.reduce_window(jnp.ones_like(inputs.array), zero, jax.lax.add, dims, strides, full)
    return _named_result(inputs, sums / counts)
