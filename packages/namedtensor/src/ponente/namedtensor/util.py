"""Small helpers shared by the named-tensor modules."""

from __future__ import annotations

from typing import Any

from ._util import ensure_tuple, index_where, is_jax_or_hax_array_like
from .core import NamedArray

__all__ = ["ensure_tuple", "index_where", "is_jax_or_hax_array_like", "is_named_array"]


def is_named_array(leaf: Any) -> bool:
    """Whether ``leaf`` is a :class:`~ponente.namedtensor.NamedArray`.

    Useful as the ``is_leaf`` argument of ``jax.tree_util`` functions, so that named arrays are
    treated as leaves instead of being flattened into their underlying JAX arrays.

    Args:
        leaf: any object.

    Returns:
        True if ``leaf`` is a ``NamedArray``.

    Example:
        >>> import jax.numpy as jnp
        >>> import ponente.namedtensor as hax
        >>> is_named_array(hax.named(jnp.zeros(3), "x")), is_named_array(jnp.zeros(3))
        (True, False)
    """
    return isinstance(leaf, NamedArray)
