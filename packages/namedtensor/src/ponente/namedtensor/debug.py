"""Debugging helpers: describe arrays, find common mistakes in modules, show how arrays are sharded."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .core import NamedArray

__all__ = ["ModuleProblems", "describe_array", "diagnose_common_issues", "visualize_shardings"]


def describe_array(arr: Any) -> str:
    """A one-line summary of an array: shape (axis names for a NamedArray), dtype and statistics.

    Statistics (min, max, mean, std, counts of NaN and inf) are computed for numeric arrays; under
    tracing (inside ``jit``) only the shape and dtype are shown.

    Args:
        arr: a NamedArray, a JAX/NumPy array, or anything ``jnp.asarray`` accepts.

    Returns:
        The description.

    Example:
        >>> import ponente.namedtensor as hax
        >>> describe_array(hax.ones({"batch": 2}))
        'NamedArray(batch=2, dtype=float32, min=1, max=1, mean=1, std=0, nan=0, inf=0)'
    """
    if isinstance(arr, NamedArray):
        kind, raw = "NamedArray", arr.array
        parts = [f"{ax.name}={ax.size}" for ax in arr.axes]
    else:
        raw = arr if hasattr(arr, "dtype") and hasattr(arr, "shape") else jnp.asarray(arr)
        kind = type(raw).__name__
        parts = [f"shape={tuple(raw.shape)}"]
    parts.append(f"dtype={raw.dtype}")
    try:
        values = np.asarray(raw)
    except Exception:  # a tracer has no concrete values
        parts.append("traced")
        return f"{kind}({', '.join(parts)})"
    if not values.size:
        parts.append("empty")
    elif np.issubdtype(values.dtype, np.number) or values.dtype == np.bool_:
        as_float = values.astype(np.float64)
        finite = as_float[np.isfinite(as_float)]
        if finite.size:
            parts += [f"{stat}={getattr(finite, stat)():.4g}" for stat in ("min", "max", "mean", "std")]
        parts += [f"nan={int(np.isnan(as_float).sum())}", f"inf={int(np.isinf(as_float).sum())}"]
    return f"{kind}({', '.join(parts)})"


def _is_array(x: Any) -> bool:
    return isinstance(x, (NamedArray, jax.Array, np.ndarray, jax.ShapeDtypeStruct))


def _raw(x: Any) -> Any:
    return x.array if isinstance(x, NamedArray) else x


class ModuleProblems(Exception):  # noqa: N818 (Haliax's name)
    """The problems :func:`diagnose_common_issues` found in a module (raised; falsy when there are none).

    Attributes:
        reused_arrays: ``(array, paths)`` for every array stored at more than one place; ``paths`` are
            key paths such as ``".encoder.w"``.
        static_arrays: the paths of static fields that hold arrays.
    """

    def __init__(self) -> None:
        super().__init__()
        self.reused_arrays: list[tuple[Any, list[str]]] = []
        self.static_arrays: list[str] = []

    def __bool__(self) -> bool:
        return bool(self.reused_arrays or self.static_arrays)

    def __str__(self) -> str:
        if not self:
            return "no problems found"
        lines = ["the module has problems:"]
        for array, paths in self.reused_arrays:
            lines.append(
                f"  one array ({describe_array(array)}) is stored at {len(paths)} places: {', '.join(paths)}; "
                "gradients and updates would treat the copies separately (share the module, or copy the array)"
            )
        for path in self.static_arrays:
            lines.append(
                f"  static field {path} holds an array: it is baked into the compiled code as a constant "
                "and never trained (make the field non-static)"
            )
        return "\n".join(lines)


def _reused_arrays(module: Any) -> list[tuple[Any, list[str]]]:
    paths_of: dict[int, tuple[Any, list[str]]] = {}  # id of the underlying buffer: (first leaf, paths)
    for path, leaf in jax.tree_util.tree_leaves_with_path(module, is_leaf=lambda x: isinstance(x, NamedArray)):
        if _is_array(leaf):
            paths_of.setdefault(id(_raw(leaf)), (leaf, []))[1].append(jax.tree_util.keystr(path))
    return [(leaf, paths) for leaf, paths in paths_of.values() if len(paths) > 1]


def _static_arrays(node: Any, prefix: str = "") -> list[str]:
    if isinstance(node, eqx.Module) and not isinstance(node, NamedArray):
        found = []
        for f in dataclasses.fields(node):
            value = getattr(node, f.name, None)
            where = f"{prefix}.{f.name}"
            if f.metadata.get("static", False):
                leaves = jax.tree_util.tree_leaves(value, is_leaf=lambda x: isinstance(x, NamedArray))
                if any(_is_array(leaf) for leaf in leaves):
                    found.append(where)
            else:
                found += _static_arrays(value, where)
        return found
    found = []
    is_module = lambda x: x is not node and isinstance(x, eqx.Module)  # noqa: E731
    for path, child in jax.tree_util.tree_leaves_with_path(node, is_leaf=is_module):
        if isinstance(child, eqx.Module):
            found += _static_arrays(child, prefix + jax.tree_util.keystr(path))
    return found


def diagnose_common_issues(module: Any) -> None:
    """Check a module (any pytree) for common mistakes; raise :class:`ModuleProblems` if there are any.

    Checked: one array stored at several places (after a ``jit`` or a gradient the places no longer share
    it), arrays in static fields (compiled in as constants, so never trained), and what
    ``equinox.tree_check`` rejects (cycles, a submodule reached twice).

    Args:
        module: the module to check.

    Raises:
        ModuleProblems: listing the reused arrays and static fields holding arrays, with their paths.
        ValueError: from ``equinox.tree_check``.

    Example:
        >>> import equinox as eqx, jax.numpy as jnp
        >>> class Tied(eqx.Module):
        ...     a: jnp.ndarray
        ...     b: jnp.ndarray
        >>> w = jnp.zeros(3)
        >>> try:
        ...     diagnose_common_issues(Tied(w, w))
        ... except ModuleProblems as problems:
        ...     array, paths = problems.reused_arrays[0]
        ...     paths
        ['.a', '.b']
    """
    problems = ModuleProblems()
    problems.reused_arrays = _reused_arrays(module)
    problems.static_arrays = _static_arrays(module)
    if problems:
        raise problems
    eqx.tree_check(module)


def _sharding_line(path: str, x: Any, sharding: Any) -> str:
    raw = _raw(x)
    spec = getattr(sharding, "spec", None)
    entries = list(spec) if spec is not None else []
    entries += [None] * (len(raw.shape) - len(entries))
    names = x.axis_names if isinstance(x, NamedArray) else [f"dim{i}" for i in range(len(raw.shape))]
    dims = []
    for name, size, entry in zip(names, raw.shape, entries):
        where = "unsharded" if entry is None else entry if isinstance(entry, str) else "+".join(entry)
        dims.append(f"{name}({size})->{where}")
    shard = tuple(sharding.shard_shape(tuple(raw.shape)))
    return f"{path or '<root>'}: {', '.join(dims) or 'scalar'}; shard {shard} on {len(sharding.device_set)} device(s)"


def _print_sharding(path: str, x: Any, sharding: Any) -> None:
    print(_sharding_line(path, x, sharding))


def visualize_shardings(tree: Any) -> None:
    """Print how every array of ``tree`` is sharded: per axis, the mesh axes it is split over.

    One line per array: its path, each axis with its size and mesh axes (``unsharded`` if none), the
    shape of one shard and the number of devices. Works inside ``jit`` too (the line is printed when the
    function is compiled, with the sharding XLA chose).

    Args:
        tree: a NamedArray, an array, or any pytree of them (modules included).

    Example:
        >>> import ponente.namedtensor as hax
        >>> visualize_shardings({"w": hax.zeros({"embed": 4})})
        ['w']: embed(4)->unsharded; shard (4,) on 1 device(s)
    """
    is_named = lambda x: isinstance(x, NamedArray)  # noqa: E731
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree, is_leaf=is_named):
        if not _is_array(leaf):
            continue
        where = jax.tree_util.keystr(path)
        raw = _raw(leaf)
        if isinstance(raw, jax.core.Tracer):
            jax.debug.inspect_array_sharding(raw, callback=functools.partial(_print_sharding, where, leaf))
        elif getattr(raw, "sharding", None) is not None:
            print(_sharding_line(where, leaf, raw.sharding))
