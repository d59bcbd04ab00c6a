"""Helpers below every other module of the package (``axis`` and ``core`` use them); public through ``util``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = ["ensure_tuple", "index_where", "is_jax_or_hax_array_like"]


def ensure_tuple(x: Sequence[T] | T | None) -> tuple[T, ...]:
    """Turns ``x`` into a tuple.

    Strings and mappings count as single items (a string is a name, not a sequence of letters);
    other sequences and iterables are converted; ``None`` becomes the empty tuple.

    Args:
        x: a single item, a sequence/iterable of items, or None.

    Returns:
        A tuple of the items.

    Example:
        >>> ensure_tuple("batch"), ensure_tuple(["a", "b"]), ensure_tuple(None)
        (('batch',), ('a', 'b'), ())
    """
    if x is None:
        return ()
    if isinstance(x, str | bytes | dict):
        return (x,)
    if isinstance(x, tuple):
        return x
    if isinstance(x, Sequence) or (hasattr(x, "__iter__") and not hasattr(x, "shape")):
        return tuple(x)
    return (x,)


def index_where(pred: Any, xs: Sequence[T]) -> int:
    """Index of the first element of ``xs`` for which ``pred`` is true.

    Args:
        pred: a one-argument predicate.
        xs: the sequence to search.

    Returns:
        The index of the first match.

    Raises:
        ValueError: if no element matches.
    """
    for i, x in enumerate(xs):
        if pred(x):
            return i
    raise ValueError("no element satisfies the predicate")


def is_jax_or_hax_array_like(x: Any) -> bool:
    """Whether ``x`` is a JAX/NumPy array, a ``NamedArray`` or a Python scalar.

    Args:
        x: any object.

    Returns:
        True for array-likes (anything with a ``shape``, or a Python number/bool).
    """
    return hasattr(x, "shape") or isinstance(x, int | float | complex | bool)
