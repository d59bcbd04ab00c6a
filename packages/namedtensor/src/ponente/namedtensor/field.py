"""``field``: an ``equinox.field`` that can record the axis names of a plain-array field."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx

__all__ = ["field"]


def field(
    *,
    converter: Callable[[Any], Any] | None = None,
    static: bool = False,
    axis_names: tuple[str, ...] | None = None,
    **kwargs: Any,
) -> Any:
    """Declare a module field, like :func:`equinox.field`, optionally naming the axes of a plain JAX array.

    ``axis_names`` is stored in the field's metadata (``metadata["axis_names"]``), so tools that walk a
    module (e.g. sharding by axis name) can treat a plain array field as if it were a NamedArray.

    Args:
        converter: applied to the value when the module is constructed.
        static: the field is part of the tree structure, not a leaf (as in :func:`equinox.field`).
        axis_names: the names of the array's axes, in order; not allowed with ``static=True``.
        **kwargs: passed on to :func:`equinox.field` (``default``, ``metadata``, ...).

    Returns:
        The dataclass field.

    Raises:
        ValueError: if ``static`` and ``axis_names`` are both given.

    Example:
        >>> import dataclasses, equinox as eqx, jax
        >>> class Table(eqx.Module):
        ...     rows: jax.Array = field(axis_names=("vocab", "embed"))
        >>> dataclasses.fields(Table)[0].metadata["axis_names"]
        ('vocab', 'embed')
    """
    if static and axis_names is not None:
        raise ValueError(
            f"field: a static field is not an array, so it cannot have axis_names (got axis_names={axis_names!r})"
        )
    metadata = {**kwargs.pop("metadata", {}), "axis_names": axis_names}
    if converter is not None:
        kwargs["converter"] = converter
    return eqx.field(static=static, metadata=metadata, **kwargs)
