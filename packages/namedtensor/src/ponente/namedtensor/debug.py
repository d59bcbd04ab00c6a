"""Debugging helpers."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from .core import NamedArray

__all__ = ["describe_array"]


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
