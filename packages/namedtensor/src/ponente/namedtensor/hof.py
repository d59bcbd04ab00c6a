"""Higher-order functions over named axes: ``vmap``, ``scan``, ``fold``, ``map`` and a module-friendly ``jit``."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypeVar, overload

import equinox as eqx
import jax
import numpy as np

from .axis import Axis, AxisSelector
from .core import NamedArray

__all__ = ["fold", "jit", "map", "scan", "vmap"]

F = TypeVar("F", bound=Callable[..., Any])
RematSpec = bool | str | Callable[..., Any]
Donate = Literal["all", "all-except-first", "warn", "warn-except-first", "none"]


def _is_named(x: Any) -> bool:
    return isinstance(x, NamedArray)


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray))


def _name(axis: AxisSelector) -> str:
    return axis if isinstance(axis, str) else axis.name


def _find_axis(axis: AxisSelector, leaves: Sequence[Any], what: str) -> Axis:
    """The full :class:`Axis` for ``axis``, resolving a bare name from the NamedArrays among ``leaves``."""
    name = _name(axis)
    for leaf in leaves:
        if isinstance(leaf, NamedArray):
            for ax in leaf.axes:
                if ax.name == name:
                    if isinstance(axis, Axis) and ax.size != axis.size:
                        raise ValueError(f"{what}: axis {axis} does not match {ax} of an argument")
                    return ax
    if isinstance(axis, Axis):
        return axis
    raise ValueError(f"{what}: no argument has axis {name!r}, so its size is unknown; pass an Axis(name, size)")


class _Split:
    """Separates a pytree's leaves into traced arrays (with their mapped dimension) and static values."""

    def __init__(self, tree: Any, axis_name: str, plain_dim: int | None):
        self.leaves, self.treedef = jax.tree_util.tree_flatten(tree, is_leaf=_is_named)
        self.dims: list[int | None] = []
        self.raw: list[Any] = []
        self.inner: list[Any] = []  # inner axes of NamedArrays, None for plain arrays, the value for statics
        self.slots: list[int] = []
        for i, leaf in enumerate(self.leaves):
            if isinstance(leaf, NamedArray):
                names = [ax.name for ax in leaf.axes]
                dim = names.index(axis_name) if axis_name in names else None
                self.dims.append(dim)
                self.inner.append(leaf.axes if dim is None else leaf.axes[:dim] + leaf.axes[dim + 1 :])
            elif _is_array(leaf):
                self.dims.append(plain_dim if np.ndim(leaf) > 0 else None)
                self.inner.append(None)
            else:
                continue
            self.raw.append(leaf.array if isinstance(leaf, NamedArray) else leaf)
            self.slots.append(i)

    def rebuild(self, raw: Sequence[Any]) -> Any:
        leaves = list(self.leaves)
        for slot, value, inner in zip(self.slots, raw, self.inner):
            leaves[slot] = value if inner is None else NamedArray.tree_unflatten(inner, [value])
        return jax.tree_util.tree_unflatten(self.treedef, leaves)


class _Outputs:
    """Records a function's output structure while tracing and rebuilds it with the axis in front."""

    def __init__(self) -> None:
        self.treedef: Any = None
        self.leaves: list[Any] = []
        self.traced: list[int] = []

    def flatten(self, out: Any) -> list[Any]:
        leaves, self.treedef = jax.tree_util.tree_flatten(out, is_leaf=_is_named)
        self.leaves = leaves
        self.traced = [i for i, leaf in enumerate(leaves) if _is_named(leaf) or _is_array(leaf)]
        return [leaves[i].array if _is_named(leaves[i]) else leaves[i] for i in self.traced]

    def unflatten(self, raw: Sequence[Any], axis: Axis | None) -> Any:
        leaves = list(self.leaves)
        for i, value in zip(self.traced, raw):
            template = self.leaves[i]
            if _is_named(template):
                axes = template.axes if axis is None else (axis, *template.axes)
                leaves[i] = NamedArray.tree_unflatten(axes, [value])
            else:
                leaves[i] = value
        return jax.tree_util.tree_unflatten(self.treedef, leaves)


def vmap(fn: Callable[..., Any], axis: AxisSelector | Sequence[AxisSelector], *, default: int | None = 0) -> Any:
    """Vectorize ``fn`` over the named axis ``axis``.

    Every NamedArray argument that has ``axis`` is mapped over it (``fn`` sees it without that axis);
    NamedArrays without it are passed whole to every call. Plain JAX/NumPy arrays are mapped along
    dimension ``default`` (``None``: not mapped). Other values are passed through unchanged. In the
    result, ``axis`` is the first axis of every NamedArray and dimension 0 of every plain array.
    Several axes map in turn (the first becomes outermost).

    Args:
        fn: the function to vectorize.
        axis: the axis (or axes) to map over; a bare name takes its size from the arguments.
        default: the dimension along which plain arrays are mapped.

    Returns:
        The vectorized function.

    Raises:
        ValueError: at call time, if ``axis`` is a bare name that no argument has.

    Example:
        >>> import ponente.namedtensor as hax
        >>> x = hax.ones({"batch": 3, "embed": 4})
        >>> hax.vmap(lambda row: row.sum(), "batch")(x).axes
        (Axis(name='batch', size=3),)
    """
    if not isinstance(axis, (str, Axis)):
        axes = tuple(axis)
        if not axes:
            return fn
        return vmap(vmap(fn, axes[1:], default=default), axes[0], default=default)

    @functools.wraps(fn)
    def mapped(*args: Any, **kwargs: Any) -> Any:
        split = _Split((args, kwargs), _name(axis), default)
        full = _find_axis(axis, split.leaves, "vmap")
        outputs = _Outputs()

        def inner(*raw: Any) -> list[Any]:
            call_args, call_kwargs = split.rebuild(raw)
            return outputs.flatten(fn(*call_args, **call_kwargs))

        out = jax.vmap(inner, in_axes=(*split.dims,), out_axes=0, axis_size=full.size)(*split.raw)
        return outputs.unflatten(out, full)

    return mapped


def _checkpointed(step: Callable[..., Any], remat: RematSpec) -> Callable[..., Any]:
    if remat is False:
        return step
    if remat is True:
        return jax.checkpoint(step)
    if isinstance(remat, str):
        policy = getattr(jax.checkpoint_policies, remat, None)
        if policy is None:
            raise ValueError(f"remat={remat!r} is not a policy in jax.checkpoint_policies")
        return jax.checkpoint(step, policy=policy)
    return jax.checkpoint(step, policy=remat)


def scan(
    f: Callable[..., tuple[Any, Any]],
    axis: AxisSelector,
    *,
    remat: RematSpec = False,
    reverse: bool = False,
    unroll: int = 1,
) -> Callable[..., tuple[Any, Any]]:
    """Curried ``jax.lax.scan`` over a named axis.

    ``scan(f, axis)(init, *args, **kwargs)`` calls ``f(carry, *xs, **kws) -> (carry, y)`` once per
    position of ``axis``: NamedArrays in the arguments that have ``axis`` are sliced along it,
    NamedArrays without it are passed whole, plain arrays are sliced along dimension 0. The ``y``
    outputs are stacked with ``axis`` as their first axis.

    Args:
        f: the step function.
        axis: the axis to scan over (a bare name takes its size from the arguments).
        remat: rematerialize the step in the backward pass: ``True`` (save nothing), the name of a
            ``jax.checkpoint_policies`` policy (e.g. ``"dots_saveable"``), or a policy function.
        reverse: scan from the last position to the first.
        unroll: steps unrolled per loop iteration.

    Returns:
        A function ``(init, *args, **kwargs) -> (final_carry, stacked_ys)``.

    Example:
        >>> import ponente.namedtensor as hax
        >>> x = hax.arange({"time": 4})
        >>> carry, ys = hax.scan(lambda c, xt: (c + xt.scalar(), c), "time")(0, x)
        >>> int(carry), ys.tolist()
        (6, [0, 0, 1, 3])
    """

    def scanned(init: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        split = _Split((args, kwargs), _name(axis), 0)
        full = _find_axis(axis, split.leaves, "scan")
        outputs = _Outputs()
        carry_out = _Outputs()
        swept = [i for i, d in enumerate(split.dims) if d is not None]

        def step(carry: Any, xs: list[Any]) -> tuple[Any, list[Any]]:
            raw = list(split.raw)
            for i, x in zip(swept, xs):
                raw[i] = x
            call_args, call_kwargs = split.rebuild(raw)
            new_carry, y = f(carry, *call_args, **call_kwargs)
            carry_out.flatten(new_carry)
            return new_carry, outputs.flatten(y)

        xs = [jax.numpy.moveaxis(split.raw[i], split.dims[i], 0) for i in swept]  # type: ignore[arg-type]
        body = _checkpointed(step, remat)
        carry, ys = jax.lax.scan(body, init, xs, length=full.size, reverse=reverse, unroll=unroll)
        return carry, outputs.unflatten(ys, full)

    return scanned


def fold(
    fn: Callable[..., Any],
    axis: AxisSelector,
    *,
    remat: RematSpec = False,
    reverse: bool = False,
    unroll: int = 1,
) -> Callable[..., Any]:
    """Curried fold (a scan without outputs) over a named axis.

    ``fold(fn, axis)(init, *args, **kwargs)`` calls ``fn(carry, *xs, **kws) -> carry`` once per
    position of ``axis`` with the same argument rules as :func:`scan`, and returns the final carry.

    Args:
        fn: the step function.
        axis: the axis to fold over.
        remat: see :func:`scan`.
        reverse: fold from the last position to the first.
        unroll: steps unrolled per loop iteration.

    Returns:
        A function ``(init, *args, **kwargs) -> final_carry``.

    Example:
        >>> import ponente.namedtensor as hax
        >>> x = hax.ones({"layer": 3, "embed": 2})
        >>> hax.fold(lambda acc, row: acc + row, "layer")(hax.zeros({"embed": 2}), x).array.tolist()
        [3.0, 3.0]
    """
    body = scan(lambda c, *a, **k: (fn(c, *a, **k), None), axis, remat=remat, reverse=reverse, unroll=unroll)

    def folded(init: Any, *args: Any, **kwargs: Any) -> Any:
        return body(init, *args, **kwargs)[0]

    return folded


def map(
    fn: Callable[..., Any],
    axis: AxisSelector,
    *,
    remat: RematSpec = False,
    reverse: bool = False,
    unroll: int = 1,
) -> Callable[..., Any]:
    """Curried sequential map (``jax.lax.map``-like) over a named axis.

    ``map(fn, axis)(*args, **kwargs)`` calls ``fn(*xs, **kws)`` once per position of ``axis`` (one at a
    time, unlike :func:`vmap`) with the argument rules of :func:`scan`, and stacks the results with
    ``axis`` first.

    Args:
        fn: the function.
        axis: the axis to map over.
        remat: see :func:`scan`.
        reverse: process positions from last to first (results stay in order).
        unroll: steps unrolled per loop iteration.

    Returns:
        A function ``(*args, **kwargs) -> stacked results``.
    """
    body = scan(lambda c, *a, **k: (c, fn(*a, **k)), axis, remat=remat, reverse=reverse, unroll=unroll)

    def mapped(*args: Any, **kwargs: Any) -> Any:
        return body(None, *args, **kwargs)[1]

    return mapped


@overload
def jit(fn: F, *, donate: Donate = "none") -> F: ...


@overload
def jit(fn: None = None, *, donate: Donate = "none") -> Callable[[F], F]: ...


def jit(fn: Any = None, *, donate: Donate = "none") -> Any:
    """``equinox.filter_jit``-style jit: arrays (also inside NamedArrays and modules) are traced, the rest is static.

    Works as ``jit(fn)``, ``@jit`` and ``@jit(donate="all")``. Modules, axes, Python numbers and
    strings may be passed directly. Only JAX/NumPy arrays are traced; every other value (including a
    Python float, and the axes of NamedArrays) is static, so a call with a new such value recompiles.

    Args:
        fn: the function to compile.
        donate: buffer donation, as in ``equinox.filter_jit``: ``"none"``, ``"all"``,
            ``"all-except-first"``, ``"warn"`` or ``"warn-except-first"``.

    Returns:
        The compiled function (or a decorator when ``fn`` is omitted).

    Example:
        >>> import ponente.namedtensor as hax
        >>> double = hax.jit(lambda x, scale: x * scale)
        >>> double(hax.ones({"embed": 2}), 2.0).array.tolist()
        [2.0, 2.0]
    """
    if fn is None:
        return functools.partial(jit, donate=donate)
    return eqx.filter_jit(fn, donate=donate)
