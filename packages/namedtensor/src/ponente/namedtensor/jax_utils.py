"""Small JAX utilities: ``named_call``, key splitting helpers, ``is_in_jit`` and ``tree_checkpoint_name``."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, overload

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

__all__ = ["is_in_jit", "maybe_rng_split", "named_call", "shaped_rng_split", "tree_checkpoint_name"]

T = TypeVar("T")

F = TypeVar("F", bound=Callable[..., Any])


@overload
def named_call(f: F, name: str | None = None) -> F: ...


@overload
def named_call(f: None = None, name: str | None = None) -> Callable[[F], F]: ...


def named_call(f: Any = None, name: str | None = None) -> Any:
    """Wrap ``f`` so its operations appear under ``name`` in profiles and HLO dumps (``jax.named_scope``).

    Usable as ``named_call(f)``, ``named_call(f, "name")``, ``@named_call`` and
    ``@named_call(name="attention")``. The default name is ``f``'s ``__name__``.

    Args:
        f: the function.
        name: the scope name.

    Returns:
        The wrapped function (or a decorator when ``f`` is omitted).

    Example:
        >>> @named_call
        ... def attention(x):
        ...     return x * 2
        >>> attention(1.0)
        2.0
    """
    if f is None:
        return functools.partial(named_call, name=name)
    scope = name if name is not None else getattr(f, "__name__", type(f).__name__)

    @functools.wraps(f)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with jax.named_scope(scope):
            return f(*args, **kwargs)

    return wrapped


def maybe_rng_split(key: jax.Array | None, num: int = 2) -> Any:
    """Split ``key`` into ``num`` keys, or return ``num`` Nones when ``key`` is None.

    Lets layers with optional randomness (dropout) pass keys down without special cases.

    Args:
        key: a PRNG key or None.
        num: how many keys.

    Returns:
        An array of ``num`` keys, or a list of ``num`` Nones.

    Example:
        >>> maybe_rng_split(None, 3)
        [None, None, None]
    """
    if key is None:
        return [None] * num
    return jax.random.split(key, num)


def shaped_rng_split(key: jax.Array, split_shape: int | Sequence[int] = 2) -> jax.Array:
    """Split ``key`` into an array of keys of shape ``split_shape`` (for ``vmap``/``scan`` over layers).

    Equals ``jax.random.split(key, prod(split_shape))`` reshaped; with ``split_shape=()`` the key is
    returned unchanged.

    Args:
        key: a PRNG key (typed, or a legacy ``uint32[2]`` key).
        split_shape: the leading shape of the result.

    Returns:
        Keys with shape ``split_shape`` followed by the key's own shape.

    Example:
        >>> import jax
        >>> shaped_rng_split(jax.random.key(0), (2, 3)).shape
        (2, 3)
    """
    shape = (split_shape,) if isinstance(split_shape, int) else tuple(split_shape)
    if not shape:
        return key
    keys = jax.random.split(key, math.prod(shape))
    return jnp.reshape(keys, shape + tuple(keys.shape[1:]))


def is_in_jit() -> bool:
    """Whether the caller is being staged out for compilation: inside ``jit`` or a ``scan``/``cond`` body.

    Eager transformations (``grad`` or ``vmap`` outside ``jit``) do not count: new constants there are
    concrete.

    Returns:
        True while staging, False otherwise.

    Example:
        >>> is_in_jit()
        False
    """
    return isinstance(jnp.zeros(()), jax.core.Tracer)


def tree_checkpoint_name(tree: T, name: str) -> T:
    """Tag every array of ``tree`` (NamedArrays included) with ``name`` for gradient-checkpointing policies.

    :func:`jax.ad_checkpoint.checkpoint_name` for a whole pytree. Inside a checkpointed scan body (``hax.scan`` with
    ``remat=``, or a block of ``nn.Stacked``), a value tagged ``"h"`` is kept for the backward pass, instead of being
    recomputed, when the :class:`~ponente.namedtensor.ScanCheckpointPolicy` lists ``"h"`` in
    ``save_block_internals`` (or moved to host memory when it lists it in ``offload_block_internals``).

    Args:
        tree: a NamedArray, array or pytree of them; other leaves pass through.
        name: the tag.

    Returns:
        ``tree`` with the same values, tagged.

    Example:
        >>> import ponente.namedtensor as hax
        >>> tree_checkpoint_name({"h": hax.ones({"embed": 2}), "n": 3}, "h")["h"].shape
        {'embed': 2}
    """
    return jax.tree_util.tree_map(lambda x: checkpoint_name(x, name) if eqx.is_array(x) else x, tree)
