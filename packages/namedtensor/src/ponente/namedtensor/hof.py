"""Higher-order functions over named axes: ``vmap``, ``scan``, ``fold``, ``map`` and a module-friendly ``jit``."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypeVar, overload

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .axis import Axis, AxisSelector
from .core import NamedArray
from .jax_utils import tree_checkpoint_name
from .scan_checkpoint import ScanCheckpointPolicy, ScanCheckpointSpec

__all__ = ["fold", "jit", "map", "scan", "vmap"]

F = TypeVar("F", bound=Callable[..., Any])
RematSpec = ScanCheckpointSpec | Callable[..., Any]
"""A :data:`ScanCheckpointSpec`, the name of a ``jax.checkpoint_policies`` policy, or a policy function."""
BoolAxisSpec = bool | Callable[[Any], bool]
"""Which leaves a scan slices: a predicate on the leaf, or a bool for all/none."""
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
    """Separates a pytree's leaves into traced arrays (with their mapped dimension) and static values.

    NamedArrays are mapped along ``axis_name`` when they have it, plain arrays along ``plain_dim`` (None:
    not mapped; scalars never are); ``is_mapped``, when given, must also accept the leaf.
    """

    def __init__(
        self, tree: Any, axis_name: str, plain_dim: int | None, is_mapped: Callable[[Any], bool] | None = None
    ):
        with_paths, self.treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_named)
        self.paths = [path for path, _ in with_paths]
        self.leaves = [leaf for _, leaf in with_paths]
        self.dims: list[int | None] = []
        self.raw: list[Any] = []
        self.inner: list[Any] = []  # inner axes of NamedArrays, None for plain arrays, the value for statics
        self.slots: list[int] = []
        for i, leaf in enumerate(self.leaves):
            if isinstance(leaf, NamedArray):
                names = [ax.name for ax in leaf.axes]
                dim = names.index(axis_name) if axis_name in names else None
                if is_mapped is not None and not is_mapped(leaf):
                    dim = None
                self.dims.append(dim)
                self.inner.append(leaf.axes if dim is None else leaf.axes[:dim] + leaf.axes[dim + 1 :])
            elif _is_array(leaf):
                mapped = np.ndim(leaf) > 0 and (is_mapped is None or is_mapped(leaf))
                self.dims.append(plain_dim if mapped else None)
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


def _resolve_remat(remat: RematSpec) -> ScanCheckpointPolicy | Callable[..., Any]:
    """A :class:`ScanCheckpointPolicy`, or a ``jax.checkpoint_policies`` policy function."""
    if callable(remat):
        return remat
    if isinstance(remat, str) and hasattr(jax.checkpoint_policies, remat):
        return getattr(jax.checkpoint_policies, remat)
    try:
        return ScanCheckpointPolicy.from_bool_or_str(remat)
    except ValueError as e:
        raise ValueError(f"remat={remat!r}: {e}, or the name of a policy in jax.checkpoint_policies") from None


def _is_scannable(leaf: Any) -> bool:
    return isinstance(leaf, NamedArray) or np.ndim(leaf) > 0


def _as_predicate(spec: BoolAxisSpec) -> Callable[[Any], bool]:
    if isinstance(spec, bool):
        return lambda _: spec
    return spec


def _positional_names(fn: Callable[..., Any], skip: int) -> tuple[list[str], str | None]:
    """Names of ``fn``'s positional parameters after the first ``skip``, and of its ``*args`` (for messages)."""
    try:
        params = list(inspect.signature(fn).parameters.values())[skip:]
    except (TypeError, ValueError):
        return [], None
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names = [p.name for p in params if p.kind in kinds]
    star = next((p.name for p in params if p.kind is inspect.Parameter.VAR_POSITIONAL), None)
    return names, star


def _describe(path: Sequence[Any], names: list[str], star: str | None) -> str:
    """``(args, kwargs)`` key path -> ``"foo.my_array"`` (an argument by its parameter name, then attributes)."""
    head, rest = path[:2], path[2:]
    if head[0].idx == 0:
        i = head[1].idx
        if i < len(names):
            text = names[i]
        else:
            text = f"{star}[{i - len(names)}]" if star else f"argument {i}"
    else:
        text = str(head[1].key)
    for key in rest:
        if isinstance(key, jax.tree_util.GetAttrKey):
            text += f".{key.name}"
        elif isinstance(key, jax.tree_util.DictKey):
            text += f"[{key.key!r}]"
        elif isinstance(key, jax.tree_util.SequenceKey):
            text += f"[{key.idx}]"
        else:
            text += str(key)
    return text


def _nested_scan(
    body: Callable[..., Any],
    init: Any,
    xs: list[Any],
    *,
    groups: int,
    length: int,
    reverse: bool,
    unroll: int | bool,
    prevent_cse: bool,
) -> tuple[Any, list[Any]]:
    """``lax.scan(body, ...)`` as an outer scan over ``groups`` checkpointed groups of inner scans.

    Only the carries entering each group are kept for the backward pass; a group's steps are recomputed from it.
    """
    inner = length // groups
    grouped = [jnp.reshape(x, (groups, inner, *x.shape[1:])) for x in xs]

    def group(carry: Any, group_xs: list[Any]) -> tuple[Any, list[Any]]:
        return jax.lax.scan(body, carry, group_xs, length=inner, reverse=reverse, unroll=unroll)

    outer = eqx.filter_checkpoint(group, prevent_cse=prevent_cse)
    carry, ys = jax.lax.scan(outer, init, grouped, length=groups, reverse=reverse)
    return carry, [jnp.reshape(y, (length, *y.shape[2:])) for y in ys]


def _scan(
    f: Callable[..., tuple[Any, Any]],
    axis: AxisSelector,
    *,
    remat: RematSpec,
    reverse: bool,
    unroll: int | bool,
    is_scanned: BoolAxisSpec,
    described: Callable[..., Any],
    skip: int,
) -> Callable[..., tuple[Any, Any]]:
    """:func:`scan`; error messages name the parameters of ``described`` after its first ``skip``."""
    policy = _resolve_remat(remat)
    predicate = _as_predicate(is_scanned)
    name = _name(axis)
    carry_tag, input_tag = f"scan({name}):carry", f"scan({name}):inputs"

    def scanned(init: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        split = _Split((args, kwargs), name, 0, predicate)
        full = _find_axis(axis, split.leaves, "scan")
        swept = [i for i, d in enumerate(split.dims) if d is not None]
        wrong = [i for i in swept if np.shape(split.raw[i])[split.dims[i]] != full.size]
        if wrong:
            names, star = _positional_names(described, skip)
            details = ", ".join(
                f"{_describe(split.paths[split.slots[i]], names, star)} has leading dimension "
                f"{np.shape(split.raw[i])[split.dims[i]]}"
                for i in wrong
            )
            raise ValueError(f"scan over {full}: every scanned argument needs {full.size} entries, but {details}")
        outputs = _Outputs()

        def step(carry: Any, xs: list[Any]) -> tuple[Any, list[Any]]:
            carry = tree_checkpoint_name(carry, carry_tag)
            raw = list(split.raw)
            for i, x in zip(swept, tree_checkpoint_name(xs, input_tag)):
                raw[i] = x
            call_args, call_kwargs = split.rebuild(raw)
            out = f(carry, *call_args, **call_kwargs)
            if not isinstance(out, (tuple, list)) or len(out) != 2:
                raise ValueError(
                    f"scan over {full}: the step function must return a pair (carry, output), got {type(out).__name__}"
                    " (use fold for a function that returns only the carry)"
                )
            return out[0], outputs.flatten(out[1])

        xs = [jnp.moveaxis(split.raw[i], split.dims[i], 0) for i in swept]  # type: ignore[arg-type]
        if not isinstance(policy, ScanCheckpointPolicy):
            body = eqx.filter_checkpoint(step, policy=policy)
            groups = None
        else:
            body = policy.checkpoint(step, carry_tag, input_tag)
            groups = policy.nested_groups(full.size)
        with jax.named_scope(f"scan({name})"):
            if groups is None:
                carry, ys = jax.lax.scan(body, init, xs, length=full.size, reverse=reverse, unroll=unroll)
            else:
                prevent_cse = policy.prevent_cse  # type: ignore[union-attr]
                carry, ys = _nested_scan(
                    body,
                    init,
                    xs,
                    groups=groups,
                    length=full.size,
                    reverse=reverse,
                    unroll=unroll,
                    prevent_cse=prevent_cse,
                )
        return carry, outputs.unflatten(ys, full)

    return scanned


def scan(
    f: Callable[..., tuple[Any, Any]],
    axis: AxisSelector,
    *,
    remat: RematSpec = False,
    reverse: bool = False,
    unroll: int | bool = 1,
    is_scanned: BoolAxisSpec = _is_scannable,
) -> Callable[..., tuple[Any, Any]]:
    """Curried ``jax.lax.scan`` over a named axis.

    ``scan(f, axis)(init, *args, **kwargs)`` calls ``f(carry, *xs, **kws) -> (carry, y)`` once per
    position of ``axis``: NamedArrays in the arguments that have ``axis`` are sliced along it,
    NamedArrays without it are passed whole, plain arrays (not scalars) are sliced along dimension 0,
    and other values (Python numbers, strings...) are passed unchanged. ``is_scanned`` narrows this
    down. The ``y`` outputs are stacked with ``axis`` as their first axis.

    Args:
        f: the step function.
        axis: the axis to scan over (a bare name takes its size from the arguments).
        remat: gradient checkpointing of the step: a :class:`ScanCheckpointPolicy` or one of its shortcuts
            (``True`` keeps only the carries, ``"nested"`` only every ``sqrt(N)``-th one...), or the name of a
            ``jax.checkpoint_policies`` policy (e.g. ``"dots_saveable"``) or a policy function.
        reverse: scan from the last position to the first.
        unroll: steps unrolled per loop iteration (True: all of them).
        is_scanned: which array leaves are sliced: a predicate on the leaf, or a bool for all/none
            (NamedArrays must also have ``axis``).

    Returns:
        A function ``(init, *args, **kwargs) -> (final_carry, stacked_ys)``.

    Raises:
        ValueError: at call time, if a scanned argument does not have ``axis.size`` entries (the message
            names it, e.g. ``layer.weight``), or if ``f`` does not return a pair.

    Example:
        >>> import ponente.namedtensor as hax
        >>> x = hax.arange({"time": 4})
        >>> carry, ys = hax.scan(lambda c, xt: (c + xt.scalar(), c), "time")(0, x)
        >>> int(carry), ys.tolist()
        (6, [0, 0, 1, 3])
    """
    return _scan(f, axis, remat=remat, reverse=reverse, unroll=unroll, is_scanned=is_scanned, described=f, skip=1)


def fold(
    fn: Callable[..., Any],
    axis: AxisSelector,
    *,
    remat: RematSpec = False,
    reverse: bool = False,
    unroll: int | bool = 1,
    is_scanned: BoolAxisSpec = _is_scannable,
) -> Callable[..., Any]:
    """Curried fold (a scan without outputs) over a named axis.

    ``fold(fn, axis)(init, *args, **kwargs)`` calls ``fn(carry, *xs, **kws) -> carry`` once per
    position of ``axis`` with the same argument rules as :func:`scan`, and returns the final carry.

    Args:
        fn: the step function.
        axis: the axis to fold over.
        remat: see :func:`scan`.
        reverse: fold from the last position to the first.
        unroll: steps unrolled per loop iteration (True: all of them).
        is_scanned: see :func:`scan`.

    Returns:
        A function ``(init, *args, **kwargs) -> final_carry``.

    Example:
        >>> import ponente.namedtensor as hax
        >>> x = hax.ones({"layer": 3, "embed": 2})
        >>> hax.fold(lambda acc, row: acc + row, "layer")(hax.zeros({"embed": 2}), x).array.tolist()
        [3.0, 3.0]
    """
    body = _scan(
        lambda c, *a, **k: (fn(c, *a, **k), None),
        axis,
        remat=remat,
        reverse=reverse,
        unroll=unroll,
        is_scanned=is_scanned,
        described=fn,
        skip=1,
    )

    def folded(init: Any, *args: Any, **kwargs: Any) -> Any:
        return body(init, *args, **kwargs)[0]

    return folded


def map(
    fn: Callable[..., Any],
    axis: AxisSelector,
    *,
    remat: RematSpec = False,
    reverse: bool = False,
    unroll: int | bool = 1,
    is_mapped: BoolAxisSpec = _is_scannable,
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
        unroll: steps unrolled per loop iteration (True: all of them).
        is_mapped: which array leaves are sliced (see ``is_scanned`` in :func:`scan`).

    Returns:
        A function ``(*args, **kwargs) -> stacked results``.

    Example:
        >>> import ponente.namedtensor as hax
        >>> hax.map(lambda row: row.sum(), "batch")(hax.ones({"batch": 2, "embed": 3})).tolist()
        [3.0, 3.0]
    """
    body = _scan(
        lambda c, *a, **k: (c, fn(*a, **k)),
        axis,
        remat=remat,
        reverse=reverse,
        unroll=unroll,
        is_scanned=is_mapped,
        described=fn,
        skip=0,
    )

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
