"""How a pytree maps to checkpoint entries: one entry per leaf, keyed by the leaf's dotted tree path.

A NamedArray counts as one leaf (its axes are recorded), a typed PRNG key array is stored as its key
data with the implementation's name, Python scalars go into the metadata, and anything else (functions,
objects in non-static fields) is not stored at all: it is taken from the template when loading.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from ponente.namedtensor import NamedArray


class Kind(enum.Enum):
    """How one leaf is stored."""

    ARRAY = "array"
    """A jax/NumPy array (inside a NamedArray or not): a zarr3 array in the checkpoint."""
    KEY = "key"
    """A typed PRNG key array: its ``key_data`` as a zarr3 array, plus the implementation name."""
    SCALAR = "scalar"
    """A Python bool/int/float/str: its value in ``metadata.json``."""
    TEMPLATE = "template"
    """Anything else: not stored; loading takes it from the template."""


def _is_leaf(x: Any) -> bool:
    return isinstance(x, NamedArray)


def flatten(tree: Any) -> tuple[list[tuple[str, Any]], Any]:
    """``([(dotted_path, leaf), ...], treedef)`` with NamedArrays as leaves.

    Raises:
        ValueError: if two leaves get the same dotted path (e.g. dict keys ``"a.b"`` and ``a -> b``).
    """
    with_path, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_leaf)
    leaves: list[tuple[str, Any]] = []
    seen: set[str] = set()
    for key_path, leaf in with_path:
        name = jax.tree_util.keystr(key_path, simple=True, separator=".") or "<root>"
        if name in seen:
            raise ValueError(
                f"two leaves of the checkpointed tree have the same path {name!r}; rename the dict key that "
                "contains '.' so that every leaf has its own path"
            )
        seen.add(name)
        leaves.append((name, leaf))
    return leaves, treedef


def array_of(leaf: Any) -> Any:
    """The array inside a NamedArray leaf, or the leaf itself."""
    return leaf.array if isinstance(leaf, NamedArray) else leaf


def is_key_dtype(dtype: Any) -> bool:
    """Whether ``dtype`` is a typed PRNG key dtype (``jax.random.key``)."""
    return bool(jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key))


def kind_of(leaf: Any) -> Kind:
    """How ``leaf`` is stored (see :class:`Kind`)."""
    inner = array_of(leaf)
    if isinstance(inner, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)):
        return Kind.KEY if is_key_dtype(inner.dtype) else Kind.ARRAY
    if isinstance(inner, (bool, int, float, str)):
        return Kind.SCALAR
    return Kind.TEMPLATE


def axis_names(leaf: Any) -> list[str] | None:
    """The axis names of a NamedArray leaf, None for anything else."""
    return [ax.name for ax in leaf.axes] if isinstance(leaf, NamedArray) else None


def rewrap(template_leaf: Any, array: Any) -> Any:
    """Put a loaded array where the template leaf's array was (keeping a NamedArray's axes)."""
    if isinstance(template_leaf, NamedArray):
        return NamedArray(array, template_leaf.axes)
    return array


def key_impl_name(key_array: Any) -> str:
    """The name of a typed key array's PRNG implementation (e.g. ``threefry2x32``)."""
    return str(jax.random.key_impl(key_array))


def map_shardings(shardings: Any, treedef: Any, leaves: list[tuple[str, Any]]) -> list[Any]:
    """One sharding (or None) per template leaf, from a pytree of shardings or a function of the leaf.

    Raises:
        ValueError: if a pytree of shardings does not have the template's structure.
    """
    if shardings is None or isinstance(shardings, jax.sharding.Sharding):
        return [shardings] * len(leaves)
    # a function is a pytree leaf; a callable module holding shardings is not
    if callable(shardings) and jax.tree_util.treedef_is_leaf(jax.tree.structure(shardings)):
        fn: Callable[[Any], Any] = shardings
        return [fn(leaf) for _, leaf in leaves]
    try:
        per_leaf = treedef.flatten_up_to(shardings)
    except (ValueError, TypeError) as exc:
        raise ValueError(
            f"`shardings` must be a Sharding, a function of a leaf, or a pytree with the template's structure: {exc}"
        ) from exc
    return [array_of(s) for s in per_leaf]
