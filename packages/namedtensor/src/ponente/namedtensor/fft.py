"""Discrete Fourier transforms over named axes: the ``jax.numpy.fft`` family with axes chosen by name.

One function per transform covers the 1-D and n-D forms: its ``axis`` argument says what to transform.

- ``None``: the last axis.
- an axis name: that axis, at its current length.
- an :class:`~ponente.namedtensor.Axis`: the axis of that name, transformed at that length (the input is
  cropped or zero-padded, as with ``n=`` in ``jax.numpy.fft``); the result carries this axis.
- a sequence of axes: an n-dimensional transform over them, in that order.
- a mapping ``{axis: length}``: an n-dimensional transform; a length is ``None`` (keep), an ``int`` (the
  axis keeps its name at the new length) or an :class:`~ponente.namedtensor.Axis` (which replaces it).

Example:
    >>> import jax.numpy as jnp, ponente.namedtensor as hax
    >>> x = hax.named(jnp.array([1.0, 0.0, 0.0, 0.0]), "time")
    >>> hax.fft(x, axis="time").array.real.tolist()
    [1.0, 1.0, 1.0, 1.0]
    >>> hax.rfft(x).axes
    (Axis(name='time', size=3),)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import jax.numpy.fft as jfft

from .axis import Axis, AxisSelection, AxisSelector, axis_name
from .core import NamedArray

__all__ = ["fft", "fftfreq", "fftshift", "hfft", "ifft", "ifftshift", "ihfft", "irfft", "rfft", "rfftfreq"]

FftAxes = AxisSelector | Sequence[AxisSelector] | Mapping[AxisSelector, int | Axis | None] | None
"""What an FFT transforms: see the module documentation."""


def _requests(a: NamedArray, axis: FftAxes) -> list[tuple[int, Axis | None]]:
    """Per transformed axis: its position in ``a`` and the requested output-length axis (None: unchanged)."""
    if axis is None:
        if a.ndim == 0:
            raise ValueError("an FFT needs an array with at least one axis")
        return [(a.ndim - 1, None)]
    if isinstance(axis, Mapping):
        items: list[tuple[AxisSelector, Any]] = list(axis.items())
    elif isinstance(axis, Axis):
        items = [(axis, axis)]
    elif isinstance(axis, str):
        items = [(axis, None)]
    else:
        items = [(ax, None) for ax in axis]
    out: list[tuple[int, Axis | None]] = []
    for key, length in items:
        name = axis_name(key)
        if name not in a.axis_names:
            raise ValueError(f"FFT axis {name!r} is not in the array's axes {a.axis_names}")
        pos = a.axis_names.index(name)
        if length is None or isinstance(length, Axis):
            out.append((pos, length))
        else:
            out.append((pos, a.axes[pos].resize(int(length))))
    if not out:
        raise ValueError("an FFT needs at least one axis to transform")
    return out


def _transform(
    fn_1d: Callable[..., Any],
    fn_nd: Callable[..., Any],
    a: NamedArray,
    plan: list[tuple[int, Axis]],
    norm: str | None,
    out_axes: list[Axis],
) -> NamedArray:
    """Calls the 1-D or n-D ``jax.numpy.fft`` function with lengths ``plan`` and names the result."""
    positions = [pos for pos, _ in plan]
    lengths = [ax.size for _, ax in plan]
    if len(plan) == 1:
        arr = fn_1d(a.array, n=lengths[0], axis=positions[0], norm=norm)
    else:
        arr = fn_nd(a.array, s=lengths, axes=positions, norm=norm)
    axes = list(a.axes)
    for (pos, _), ax in zip(plan, out_axes):
        axes[pos] = ax
    return NamedArray(arr, tuple(axes))


def _keep_or(a: NamedArray, requests: list[tuple[int, Axis | None]]) -> list[tuple[int, Axis]]:
    return [(pos, req if req is not None else a.axes[pos]) for pos, req in requests]


def fft(a: NamedArray, axis: FftAxes = None, norm: str | None = None) -> NamedArray:
    """Discrete Fourier transform over one or several named axes (``jnp.fft.fft``/``fftn``).

    Args:
        a: the named array.
        axis: what to transform (see the module documentation); default the last axis.
        norm: ``None``/``"backward"``, ``"ortho"`` or ``"forward"``, as in ``jax.numpy.fft``.

    Returns:
        The complex transform; a transformed axis takes its requested length (or replacement axis).

    Example:
        >>> import jax.numpy as jnp, ponente.namedtensor as hax
        >>> x = hax.named(jnp.ones((2, 4)), ("row", "col"))
        >>> hax.fft(x, axis={"col": 8}).axes
        (Axis(name='row', size=2), Axis(name='col', size=8))
    """
    plan = _keep_or(a, _requests(a, axis))
    return _transform(jfft.fft, jfft.fftn, a, plan, norm, [ax for _, ax in plan])


def ifft(a: NamedArray, axis: FftAxes = None, norm: str | None = None) -> NamedArray:
    """Inverse discrete Fourier transform (``jnp.fft.ifft``/``ifftn``); ``axis`` as in :func:`fft`.

    Example:
        >>> import jax.numpy as jnp, ponente.namedtensor as hax
        >>> x = hax.named(jnp.arange(4.0), "t")
        >>> hax.ifft(hax.fft(x)).array.real.round(5).tolist()
        [0.0, 1.0, 2.0, 3.0]
    """
    plan = _keep_or(a, _requests(a, axis))
    return _transform(jfft.ifft, jfft.ifftn, a, plan, norm, [ax for _, ax in plan])


def rfft(a: NamedArray, axis: FftAxes = None, norm: str | None = None) -> NamedArray:
    """Fourier transform of a real array (``jnp.fft.rfft``/``rfftn``); ``axis`` as in :func:`fft`.

    The last transformed axis keeps only the non-negative frequencies: its length becomes ``n // 2 + 1``
    for an input length ``n``.

    Example:
        >>> import jax.numpy as jnp, ponente.namedtensor as hax
        >>> hax.rfft(hax.named(jnp.ones(6), "t")).axes
        (Axis(name='t', size=4),)
    """
    plan = _keep_or(a, _requests(a, axis))
    out = [ax for _, ax in plan]
    out[-1] = out[-1].resize(out[-1].size // 2 + 1)
    return _transform(jfft.rfft, jfft.rfftn, a, plan, norm, out)


def irfft(a: NamedArray, axis: FftAxes = None, norm: str | None = None) -> NamedArray:
    """Inverse of :func:`rfft` (``jnp.fft.irfft``/``irfftn``): a real array.

    ``axis`` is as in :func:`fft`, but the lengths are those of the *output*; the last transformed axis
    defaults to ``2 * (m - 1)`` for a half spectrum of length ``m``, the others keep their length.

    Example:
        >>> import jax.numpy as jnp, ponente.namedtensor as hax
        >>> x = hax.named(jnp.arange(6.0), "t")
        >>> y = hax.irfft(hax.rfft(x))
        >>> y.axes, y.array.round(5).tolist()
        ((Axis(name='t', size=6),), [0.0, 1.0, 2.0, 3.0, 4.0, 5.0])
    """
    requests = _requests(a, axis)
    last_pos, last_req = requests[-1]
    if last_req is None:
        requests[-1] = (last_pos, a.axes[last_pos].resize(2 * (a.axes[last_pos].size - 1)))
    plan = _keep_or(a, requests)
    return _transform(jfft.irfft, jfft.irfftn, a, plan, norm, [ax for _, ax in plan])


def _single(a: NamedArray, axis: FftAxes, what: str) -> tuple[int, Axis | None]:
    requests = _requests(a, axis)
    if len(requests) != 1:
        raise ValueError(f"{what} transforms exactly one axis, got {len(requests)}: {axis!r}")
    return requests[0]


def hfft(a: NamedArray, axis: FftAxes = None, norm: str | None = None) -> NamedArray:
    """Fourier transform of a Hermitian-symmetric signal given by its half (``jnp.fft.hfft``): a real array.

    One axis only. The output length defaults to ``2 * (m - 1)`` for an input of length ``m``; request
    another with an :class:`~ponente.namedtensor.Axis` or ``{axis: length}``.

    Example:
        >>> import jax.numpy as jnp, ponente.namedtensor as hax
        >>> hax.hfft(hax.named(jnp.array([1.0, 0.0, 0.0]), "f")).array.tolist()
        [1.0, 1.0, 1.0, 1.0]
    """
    pos, req = _single(a, axis, "hfft")
    out = req if req is not None else a.axes[pos].resize(2 * (a.axes[pos].size - 1))
    return _transform(jfft.hfft, jfft.hfft, a, [(pos, out)], norm, [out])


def ihfft(a: NamedArray, axis: FftAxes = None, norm: str | None = None) -> NamedArray:
    """Inverse of :func:`hfft` (``jnp.fft.ihfft``): the half spectrum of a real signal.

    One axis only; for an input (or requested) length ``n`` the result has length ``n // 2 + 1``.

    Example:
        >>> import jax.numpy as jnp, ponente.namedtensor as hax
        >>> hax.ihfft(hax.named(jnp.ones(4), "t")).axes
        (Axis(name='t', size=3),)
    """
    pos, req = _single(a, axis, "ihfft")
    length = req if req is not None else a.axes[pos]
    return _transform(jfft.ihfft, jfft.ihfft, a, [(pos, length)], norm, [length.resize(length.size // 2 + 1)])


def _shift(fn: Callable[..., Any], x: NamedArray, axes: AxisSelection | None) -> NamedArray:
    if axes is None:
        return NamedArray(fn(x.array), x.axes)
    selected = (axes,) if isinstance(axes, Axis | str) else tuple(axes)
    return NamedArray(fn(x.array, axes=tuple(x._index_of(ax) for ax in selected)), x.axes)


def fftshift(x: NamedArray, axes: AxisSelection | None = None) -> NamedArray:
    """Moves the zero-frequency term to the centre of the given axes (all if None), like ``jnp.fft.fftshift``.

    Example:
        >>> import ponente.namedtensor as hax
        >>> hax.fftshift(hax.fftfreq(hax.Axis("f", 4))).array.tolist()
        [-0.5, -0.25, 0.0, 0.25]
    """
    return _shift(jfft.fftshift, x, axes)


def ifftshift(x: NamedArray, axes: AxisSelection | None = None) -> NamedArray:
    """Inverse of :func:`fftshift` (``jnp.fft.ifftshift``)."""
    return _shift(jfft.ifftshift, x, axes)


def fftfreq(axis: Axis, d: float = 1.0, *, dtype: Any = None) -> NamedArray:
    """The sample frequencies of an FFT of length ``axis.size`` and sample spacing ``d`` (``jnp.fft.fftfreq``).

    Example:
        >>> import ponente.namedtensor as hax
        >>> hax.fftfreq(hax.Axis("f", 4)).array.tolist()
        [0.0, 0.25, -0.5, -0.25]
    """
    return NamedArray(jnp.asarray(jfft.fftfreq(axis.size, d, dtype=dtype)), (axis,))


def rfftfreq(axis: Axis, d: float = 1.0, *, dtype: Any = None) -> NamedArray:
    """The non-negative sample frequencies of :func:`rfft` for length ``axis.size`` (``jnp.fft.rfftfreq``).

    The result's axis keeps the name, with length ``axis.size // 2 + 1``.

    Example:
        >>> import ponente.namedtensor as hax
        >>> hax.rfftfreq(hax.Axis("f", 4)).array.tolist()
        [0.0, 0.25, 0.5]
    """
    return NamedArray(jnp.asarray(jfft.rfftfreq(axis.size, d, dtype=dtype)), (axis.resize(axis.size // 2 + 1),))
