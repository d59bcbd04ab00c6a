"""``dot``: tensor contraction over named axes."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from types import EllipsisType
from typing import Any

import jax
import jax.numpy as jnp

from .axis import Axis, PartialAxisSpec, rearrange_for_partial_order
from .core import NamedArray

__all__ = ["dot"]

_MISSING: Any = object()


def _name(ax: Axis | str) -> str:
    return ax if isinstance(ax, str) else ax.name


def _all_axes(arrays: Sequence[NamedArray]) -> list[Axis]:
    """Union of the arrays' axes in order of first appearance; a name with two sizes is an error."""
    seen: dict[str, Axis] = {}
    for i, a in enumerate(arrays):
        for ax in a.axes:
            if ax.name in seen and seen[ax.name].size != ax.size:
                raise ValueError(
                    f"axis {ax.name!r} has size {seen[ax.name].size} in one operand but {ax.size} in operand {i}"
                )
            seen.setdefault(ax.name, ax)
    return list(seen.values())


def _partial_order(spec: PartialAxisSpec, natural: Sequence[Axis], what: str) -> list[Axis]:
    """Order ``natural`` to follow ``spec`` (see :func:`rearrange_for_partial_order`), with errors naming ``what``."""
    by_name = {ax.name: ax for ax in natural}
    named: list[str] = []
    for entry in spec:
        if entry is Ellipsis:
            continue
        assert not isinstance(entry, EllipsisType)
        name = _name(entry)
        if name not in by_name:
            raise ValueError(f"{what}: axis {name!r} is not among the result axes {tuple(by_name)}")
        if isinstance(entry, Axis) and entry.size != by_name[name].size:
            raise ValueError(f"{what}: axis {name!r} has size {by_name[name].size}, not {entry.size}")
        if name in named:
            raise ValueError(f"{what}: axis {name!r} is listed twice in {tuple(spec)!r}")
        named.append(name)
    unnamed = [ax for ax in natural if ax.name not in named]
    if unnamed and Ellipsis not in spec:
        raise ValueError(
            f"{what}: result axes {tuple(a.name for a in unnamed)} are not listed in {tuple(spec)!r}; add '...'"
        )
    return list(rearrange_for_partial_order(spec, tuple(natural)))


def _contract(
    arrays: Sequence[NamedArray],
    out_axes: Sequence[Axis],
    *,
    precision: Any,
    preferred_element_type: Any,
    scope: str,
) -> NamedArray:
    """Einsum by axis name: equal names are one index; names not in ``out_axes`` are summed."""
    labels: dict[str, int] = {}
    operands: list[Any] = []
    for a in arrays:
        operands.append(a.array)
        operands.append([labels.setdefault(ax.name, len(labels)) for ax in a.axes])
    operands.append([labels[ax.name] for ax in out_axes])
    with jax.named_scope(scope):
        raw = jnp.einsum(*operands, precision=precision, preferred_element_type=preferred_element_type)
    return NamedArray(raw, tuple(out_axes))


def dot(
    *arrays: Any,
    axis: Any = _MISSING,
    out_axes: PartialAxisSpec | None = None,
    precision: Any = None,
    preferred_element_type: Any = None,
) -> NamedArray:
    """Contract ``arrays`` over ``axis``; axes shared by several arrays and not contracted are batched.

    The result has the union of the input axes minus the contracted ones, each in the order it first
    occurs in the inputs, unless ``out_axes`` says otherwise. ``axis=None`` contracts every axis (the
    result is a NamedArray without axes); ``axis=()`` contracts nothing (an outer product over
    differently named axes, an element-wise product over shared ones).

    The legacy form ``dot(axis, *arrays)`` still works but warns with a ``DeprecationWarning``.

    Args:
        *arrays: the NamedArrays to contract.
        axis: the axis or axes to contract over (names or :class:`Axis`), or None for all axes.
        out_axes: the order of the result axes, possibly partial with ``...`` standing for the axes
            not listed, e.g. ``(..., "embed")``.
        precision: passed to ``jax.lax.dot_general`` (through ``jnp.einsum``).
        preferred_element_type: the accumulation/result dtype, passed to ``jax.lax.dot_general``.

    Returns:
        The contracted NamedArray.

    Raises:
        ValueError: if no array is given, an axis in ``axis`` is in none of the arrays, an axis name
            has different sizes in different arrays, or ``out_axes`` does not fit the result.

    Example:
        >>> import ponente.namedtensor as hax
        >>> x = hax.ones({"batch": 2, "embed": 3})
        >>> w = hax.ones({"embed": 3, "mlp": 4})
        >>> hax.dot(x, w, axis="embed").axes
        (Axis(name='batch', size=2), Axis(name='mlp', size=4))
    """
    if axis is _MISSING:
        if not arrays or isinstance(arrays[0], NamedArray):
            raise TypeError("dot: pass the axes to contract as a keyword, e.g. dot(x, y, axis='embed')")
        warnings.warn(
            "dot(axis, *arrays) is deprecated; pass the axes as a keyword: dot(*arrays, axis=...)",
            DeprecationWarning,
            stacklevel=2,
        )
        axis, arrays = arrays[0], arrays[1:]
    if not arrays:
        raise ValueError("dot: needs at least one array")
    for i, a in enumerate(arrays):
        if not isinstance(a, NamedArray):
            raise TypeError(f"dot: operand {i} is a {type(a).__name__}, not a NamedArray")
    natural = _all_axes(arrays)
    names = {ax.name: ax for ax in natural}
    if axis is None:
        contracted = [ax.name for ax in natural]
    else:
        selection = (axis,) if isinstance(axis, (str, Axis)) else tuple(axis)
        contracted = []
        for sel in selection:
            name = _name(sel)
            if name not in names:
                raise ValueError(f"dot: axis {name!r} is in none of the arrays, whose axes are {tuple(names)}")
            if isinstance(sel, Axis) and sel.size != names[name].size:
                raise ValueError(f"dot: axis {name!r} has size {names[name].size}, but {sel} was requested")
            contracted.append(name)
    result_axes = [ax for ax in natural if ax.name not in contracted]
    if out_axes is not None:
        result_axes = _partial_order(tuple(out_axes), result_axes, "dot")
    scope = f"dot {','.join(contracted)} -> {','.join(ax.name for ax in result_axes)}"
    return _contract(
        arrays, result_axes, precision=precision, preferred_element_type=preferred_element_type, scope=scope
    )
