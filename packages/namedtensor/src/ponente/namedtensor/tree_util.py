"""Pytree helpers that treat NamedArrays as leaves, ``scan_aware_tree_map`` and ``resize_axis``."""

from __future__ import annotations

import abc
import dataclasses
import typing
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .axis import Axis, AxisSelector
from .core import NamedArray
from .hof import vmap

__all__ = [
    "LayerStack",
    "resize_axis",
    "scan_aware_tree_map",
    "tree_flatten",
    "tree_leaves",
    "tree_map",
    "tree_structure",
    "tree_unflatten",
]


class LayerStack(abc.ABC):
    """A module holding a block's layers stacked along one axis, which :func:`scan_aware_tree_map` maps per layer.

    Such a module has a ``Block`` field (the layers axis) and a ``stacked`` field (the block whose arrays carry that
    axis). :class:`~ponente.namedtensor.nn.Stacked` registers itself as one (``LayerStack.register``), so this module,
    which ``nn`` is built on, never imports ``nn``; a user-defined stack type can register the same way.
    """

    @property
    @abc.abstractmethod
    def Block(self) -> Axis:
        """The layers axis."""

    @property
    @abc.abstractmethod
    def stacked(self) -> Any:
        """The block whose arrays carry the ``Block`` axis."""


def _is_leaf(is_leaf: Callable[[Any], bool] | None) -> Callable[[Any], bool]:
    if is_leaf is None:
        return lambda x: isinstance(x, NamedArray)
    user = is_leaf
    return lambda x: isinstance(x, NamedArray) or user(x)


def tree_map(fn: Callable[..., Any], tree: Any, *rest: Any, is_leaf: Callable[[Any], bool] | None = None) -> Any:
    """Like :func:`jax.tree_util.tree_map`, but a NamedArray is one leaf (``fn`` gets the NamedArray).

    Args:
        fn: called with the corresponding leaves of ``tree`` and ``rest``.
        tree: the pytree.
        *rest: more pytrees with the structure of ``tree``.
        is_leaf: also treat nodes for which this returns True as leaves.

    Returns:
        A pytree with the structure of ``tree`` and ``fn``'s results as leaves.

    Example:
        >>> import ponente.namedtensor as hax
        >>> tree = {"w": hax.ones({"embed": 2}), "n": 3}
        >>> tree_map(lambda x: x.axes if isinstance(x, hax.NamedArray) else x, tree)["w"]
        (Axis(name='embed', size=2),)
    """
    return jax.tree_util.tree_map(fn, tree, *rest, is_leaf=_is_leaf(is_leaf))


def scan_aware_tree_map(
    fn: Callable[..., Any], tree: Any, *rest: Any, is_leaf: Callable[[Any], bool] | None = None
) -> Any:
    """Like :func:`tree_map`, but inside an ``nn.Stacked`` ``fn`` is applied to each layer separately.

    A ``Stacked`` holds its layers as one module whose arrays have a leading layers axis; here ``fn`` never sees
    that axis: it is ``vmap``-ed over it (so ``fn`` on a ``Linear`` of a stacked block sees one layer's
    ``Linear``, and a mean over its weight is per layer). Without ``Stacked`` modules this is :func:`tree_map`.

    Args:
        fn: called with the corresponding leaves of ``tree`` and ``rest``.
        tree: the pytree.
        *rest: more pytrees with the structure of ``tree`` (their ``Stacked`` modules are sliced the same way).
        is_leaf: also treat nodes for which this returns True as leaves.

    Returns:
        A pytree with the structure of ``tree`` and ``fn``'s results as leaves.

    Example:
        >>> import jax, ponente.namedtensor as hax
        >>> from ponente.namedtensor.nn import Stacked
        >>> stack = Stacked(hax.arange({"layers": 2, "embed": 3}, dtype=float), hax.Axis("layers", 2))
        >>> scan_aware_tree_map(lambda w: w - w.mean(), stack).stacked.array.tolist()
        [[-1.0, 0.0, 1.0], [-1.0, 0.0, 1.0]]
    """

    def stops(x: Any) -> bool:
        return isinstance(x, LayerStack) or (is_leaf is not None and is_leaf(x))

    def per_layer(*layers: Any) -> Any:
        return scan_aware_tree_map(fn, *layers, is_leaf=is_leaf)

    def apply(x: Any, *others: Any) -> Any:
        if isinstance(x, LayerStack):
            inner = vmap(per_layer, x.Block)(x.stacked, *(o.stacked for o in others))
            return dataclasses.replace(typing.cast(Any, x), stacked=inner)  # a registered stack is a dataclass
        return fn(x, *others)

    return tree_map(apply, tree, *rest, is_leaf=stops)


def tree_leaves(tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> list[Any]:
    """The leaves of ``tree``, with each NamedArray as one leaf.

    Args:
        tree: the pytree.
        is_leaf: also treat nodes for which this returns True as leaves.

    Returns:
        The leaves in pytree order.
    """
    return jax.tree_util.tree_leaves(tree, is_leaf=_is_leaf(is_leaf))


def tree_flatten(tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> tuple[list[Any], Any]:
    """Flatten ``tree`` into leaves (NamedArrays kept whole) and a tree definition.

    Args:
        tree: the pytree.
        is_leaf: also treat nodes for which this returns True as leaves.

    Returns:
        ``(leaves, treedef)``; :func:`tree_unflatten` inverts it.
    """
    return jax.tree_util.tree_flatten(tree, is_leaf=_is_leaf(is_leaf))


def tree_unflatten(treedef: Any, leaves: Sequence[Any]) -> Any:
    """Rebuild a pytree from a tree definition made by :func:`tree_flatten` and its leaves.

    Args:
        treedef: the tree definition.
        leaves: the leaves.

    Returns:
        The pytree.
    """
    return jax.tree_util.tree_unflatten(treedef, leaves)


def tree_structure(tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> Any:
    """The tree definition of ``tree`` with NamedArrays as leaves.

    Args:
        tree: the pytree.
        is_leaf: also treat nodes for which this returns True as leaves.

    Returns:
        The tree definition.
    """
    return jax.tree_util.tree_structure(tree, is_leaf=_is_leaf(is_leaf))


def resize_axis(tree: Any, old_axis: AxisSelector, new_size: int, key: jax.Array | None = None) -> Any:
    """Resize every NamedArray of ``tree`` that has ``old_axis`` to ``new_size`` along it.

    Shrinking keeps the first ``new_size`` entries. Growing appends entries: without ``key``, each
    equals the mean of the array's existing values; with ``key``, they are drawn from a normal
    distribution (truncated at two standard deviations) with the array's mean and standard deviation.
    Other leaves are returned unchanged. Modules that store the old :class:`Axis` in a field must
    update it themselves.

    Args:
        tree: a pytree containing NamedArrays.
        old_axis: the axis (or its name) to resize.
        new_size: its new size (positive).
        key: a PRNG key for random growth (split per array), or None.

    Returns:
        The pytree with resized arrays.

    Raises:
        ValueError: if ``new_size`` is not positive, or ``old_axis`` is an Axis whose size differs
            from an array's axis of that name.

    Example:
        >>> import ponente.namedtensor as hax
        >>> resize_axis({"w": hax.ones({"vocab": 3, "embed": 2})}, "vocab", 5)["w"].shape
        {'vocab': 5, 'embed': 2}
    """
    if new_size <= 0:
        raise ValueError(f"resize_axis: new_size must be positive, got {new_size}")
    name = old_axis if isinstance(old_axis, str) else old_axis.name
    leaves, treedef = tree_flatten(tree)
    targets = [i for i, leaf in enumerate(leaves) if isinstance(leaf, NamedArray) and name in leaf.shape]
    keys = list(jax.random.split(key, len(targets))) if key is not None and targets else [None] * len(targets)
    for i, leaf_key in zip(targets, keys):
        leaves[i] = _resize_one(leaves[i], old_axis, name, new_size, leaf_key)
    return tree_unflatten(treedef, leaves)


def _resize_one(x: NamedArray, old_axis: AxisSelector, name: str, new_size: int, key: jax.Array | None) -> NamedArray:
    index = [ax.name for ax in x.axes].index(name)
    old = x.axes[index]
    if isinstance(old_axis, Axis) and old_axis.size != old.size:
        raise ValueError(f"resize_axis: asked to resize {old_axis}, but an array has {old}")
    new_axes = (*x.axes[:index], Axis(name, new_size), *x.axes[index + 1 :])
    if new_size <= old.size:
        return NamedArray(jax.lax.slice_in_dim(x.array, 0, new_size, axis=index), new_axes)
    extra_shape = tuple(new_size - old.size if i == index else ax.size for i, ax in enumerate(x.axes))
    mean = jnp.mean(x.array)
    if key is None:
        extra = jnp.full(extra_shape, mean, dtype=x.dtype)
    else:
        noise = jax.random.truncated_normal(key, -2.0, 2.0, extra_shape, dtype=jnp.result_type(x.dtype, jnp.float32))
        extra = (mean + jnp.std(x.array) * noise).astype(x.dtype)
    return NamedArray(jnp.concatenate([x.array, extra], axis=index), new_axes)
