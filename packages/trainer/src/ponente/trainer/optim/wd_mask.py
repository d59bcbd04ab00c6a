"""Which parameters get weight decay: a boolean mask over a model's parameter tree.

Paths are dotted attribute names from the root (``transformer.h.stacked.mlp.c_fc.weight``); each
parameter is also known by its owner-relative path (``Linear.weight``, ``LayerNorm.bias``), so a rule
can target a layer type anywhere in the model.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax

from ponente.namedtensor import NamedArray
from ponente.namedtensor.nn import Embedding
from ponente.namedtensor.nn.normalization import LayerNormBase

__all__ = ["param_paths", "weight_decay_mask"]


def _key_name(key: Any) -> str:
    for attr in ("name", "key", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _is_param(x: Any) -> bool:
    return isinstance(x, NamedArray) or eqx.is_array(x)


def _map_params_with_path(fn: Callable[[str, str, tuple[type, ...], Any], Any], tree: Any) -> Any:
    """Maps ``fn(root_path, class_path, owner_types, param)`` over the parameters of ``tree``.

    A parameter is a ``NamedArray`` (kept whole, not split into its array) or a JAX/NumPy array; other
    leaves are passed through unchanged and ``None`` stays ``None``, so the result has the structure of
    ``tree`` up to the parameters (a valid optax mask / label tree).

    Args:
        fn: called with the dotted path from the root, the path relative to the innermost enclosing
            ``eqx.Module`` prefixed by its class name (``Linear.weight``), the classes of all enclosing
            modules (outermost first) and the parameter.
        tree: a pytree (typically an Equinox model or ``eqx.filter(model, eqx.is_inexact_array)``).

    Returns:
        The tree with each parameter replaced by ``fn``'s result.
    """

    def walk(x: Any, path: tuple[str, ...], owner: int, owners: tuple[type, ...]) -> Any:
        if _is_param(x):
            root_path = ".".join(path)
            cls_path = ".".join((owners[-1].__name__, *path[owner:])) if owners else root_path
            return fn(root_path, cls_path, owners, x)
        children, treedef = jax.tree_util.tree_flatten_with_path(x, is_leaf=lambda y: y is not x)
        if jax.tree_util.treedef_is_leaf(treedef):
            return x
        if isinstance(x, eqx.Module):
            owner, owners = len(path), (*owners, type(x))
        mapped = [walk(child, (*path, *(_key_name(k) for k in keys)), owner, owners) for keys, child in children]
        return jax.tree_util.tree_unflatten(treedef, mapped)

    return walk(tree, (), 0, ())


def param_paths(tree: Any) -> list[str]:
    """The dotted paths of the parameters (NamedArrays and arrays) of ``tree``, in tree order.

    Example:
        >>> import jax, ponente.namedtensor as hax
        >>> layer = hax.nn.Linear.init(hax.Axis("a", 2), hax.Axis("b", 3), key=jax.random.key(0))
        >>> param_paths(layer)
        ['weight', 'bias']
    """
    paths: list[str] = []

    def record(root: str, cls_path: str, owners: tuple[type, ...], x: Any) -> Any:
        paths.append(root)
        return x

    _map_params_with_path(record, tree)
    return paths


def _default_decays(cls_path: str, owners: tuple[type, ...]) -> bool:
    """The reasonable default: decay everything except norms, embeddings and biases."""
    # by type for ours, by class name for norms/embeddings that other libraries define
    for owner in owners:
        if issubclass(owner, LayerNormBase | Embedding) or "Norm" in owner.__name__ or "Embedding" in owner.__name__:
            return False
    return not cls_path.endswith("bias")


def weight_decay_mask(
    tree: Any, *, modules: str | Sequence[str] | None = None, use_default: bool | None = None
) -> Any:
    """The weight-decay mask of a parameter tree (True: decay), with Levanter's rules.

    Args:
        tree: the parameters (an Equinox model or ``eqx.filter(model, eqx.is_inexact_array)``).
        modules: Levanter's ``weight_decay_modules``: a regular expression matched (``re.match``) against each
            parameter's root path and owner-relative path, or a list of regular expressions searched
            (``re.search``, so a plain name such as ``"c_fc"`` matches as a substring) in those paths. Matching
            parameters are decayed.
        use_default: Levanter's ``default_weight_decay_mask``: whether parameters no pattern matched follow the
            default rule (decay everything except norms, embeddings and biases). None: the default applies
            when ``modules`` is None. False with ``modules=None`` decays every parameter.

    Returns:
        A tree like ``tree`` with a bool in place of each parameter.

    Raises:
        ValueError: if a pattern is not a valid regular expression (the message names it).

    Example:
        >>> import jax, ponente.namedtensor as hax
        >>> layer = hax.nn.Linear.init(hax.Axis("a", 2), hax.Axis("b", 3), key=jax.random.key(0))
        >>> mask = weight_decay_mask(layer)
        >>> mask.weight, mask.bias
        (True, False)
    """
    apply_default = use_default is True or (use_default is None and modules is None)
    patterns: list[re.Pattern[str]] = []
    raw = [modules] if isinstance(modules, str) else list(modules or [])
    for pattern in raw:
        try:
            patterns.append(re.compile(pattern))
        except re.error as err:
            raise ValueError(f"optimizer.weight_decay_modules: invalid regular expression {pattern!r}: {err}") from err
    search = not isinstance(modules, str)

    def decide(root: str, cls_path: str, owners: tuple[type, ...], x: Any) -> bool:
        for pattern in patterns:
            for path in (root, cls_path):
                if (pattern.search(path) if search else pattern.match(path)) is not None:
                    return True
        if apply_default:
            return _default_decays(cls_path, owners)
        return modules is None  # default switched off and no patterns: decay everything, as Levanter does

    return _map_params_with_path(decide, tree)
