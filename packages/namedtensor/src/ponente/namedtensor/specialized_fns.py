"""Haliax's ``specialized_fns`` module: :func:`top_k` (implemented in :mod:`ponente.namedtensor.sorting`).

Kept so that ``import haliax.specialized_fns`` ports by renaming the package.

Example:
    >>> import jax.numpy as jnp
    >>> import ponente.namedtensor as hax
    >>> from ponente.namedtensor.specialized_fns import top_k
    >>> values, indices = top_k(hax.named(jnp.array([1, 5, 3]), "a"), "a", 2)
    >>> indices.array.tolist()
    [1, 2]
"""

from .sorting import top_k

__all__ = ["top_k"]
