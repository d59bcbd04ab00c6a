"""Polynomials as named coefficient arrays: the ``jax.numpy`` ``poly*`` functions, ``roots`` and ``vander``.

A polynomial is a one-axis named array of coefficients, highest power first (NumPy's convention). A result's
coefficient axis takes the name of the (first named) input's axis, at the result's length; when no input is
named it is called :data:`DEFAULT_POLY_AXIS_NAME` (``"degree"``).

Example:
    >>> import jax.numpy as jnp, ponente.namedtensor as hax
    >>> p = hax.named(jnp.array([1.0, -3.0, 2.0]), "coef")  # x**2 - 3x + 2
    >>> hax.roots(p).array.real.tolist()
    [2.0, 1.0]
    >>> hax.polyder(p).axes
    (Axis(name='coef', size=2),)
"""

from __future__ import annotations

from typing import Any, cast

import jax
import jax.numpy as jnp

from .axis import Axis, AxisSelector, axis_name
from .core import NamedArray

__all__ = [
    "DEFAULT_POLY_AXIS_NAME",
    "poly",
    "polyadd",
    "polyder",
    "polydiv",
    "polyfit",
    "polyint",
    "polymul",
    "polysub",
    "polyval",
    "roots",
    "trim_zeros",
    "vander",
]

DEFAULT_POLY_AXIS_NAME = "degree"
"""The name of a result's coefficient axis when no input is a named array."""


def _raw(x: Any) -> Any:
    return x.array if isinstance(x, NamedArray) else x


def _coefficients(result: jax.Array, *inputs: Any) -> NamedArray:
    """Names a 1-D result after the first named input's (single) axis, or ``degree``."""
    for x in inputs:
        if isinstance(x, NamedArray):
            if x.ndim != 1:
                raise ValueError(f"polynomial coefficients must have exactly one axis, got axes {x.axis_names}")
            return NamedArray(result, (x.axes[0].resize(result.shape[0]),))
    return NamedArray(result, (Axis(DEFAULT_POLY_AXIS_NAME, result.shape[0]),))


def poly(seq_of_zeros: Any) -> NamedArray:
    """The coefficients of the monic polynomial with the given roots (``jnp.poly``).

    Example:
        >>> import jax.numpy as jnp, ponente.namedtensor as hax
        >>> hax.poly(hax.named(jnp.array([1.0, 2.0]), "r")).array.tolist()
        [1.0, -3.0, 2.0]
    """
    return _coefficients(jnp.poly(_raw(seq_of_zeros)), seq_of_zeros)


def polyadd(p1: Any, p2: Any) -> NamedArray:
    """The sum of two polynomials (``jnp.polyadd``).

    Example:
        >>> import jax.numpy as jnp, ponente.namedtensor as hax
        >>> hax.polyadd(hax.named(jnp.array([1, 2]), "c"), jnp.array([1, 1, 1])).array.tolist()
        [1, 2, 3]
    """
    return _coefficients(jnp.polyadd(_raw(p1), _raw(p2)), p1, p2)


def polysub(p1: Any, p2: Any) -> NamedArray:
    """The difference ``p1 - p2`` of two polynomials (``jnp.polysub``)."""
    return _coefficients(jnp.polysub(_raw(p1), _raw(p2)), p1, p2)


def polymul(p1: Any, p2: Any) -> NamedArray:
    """The product of two polynomials (``jnp.polymul``).

    Example:
        >>> import jax.numpy as jnp, ponente.namedtensor as hax
        >>> hax.polymul(hax.named(jnp.array([1.0, 1.0]), "c"), hax.named(jnp.array([1.0, -1.0]), "d")).array.tolist()
        [1.0, 0.0, -1.0]
    """
    return _coefficients(jnp.polymul(_raw(p1), _raw(p2)), p1, p2)


def polydiv(p1: Any, p2: Any) -> tuple[NamedArray, NamedArray]:
    """Quotient and remainder of the division ``p1 / p2`` (``jnp.polydiv``).

    Example:
        >>> import jax.numpy as jnp, ponente.namedtensor as hax
        >>> q, r = hax.polydiv(hax.named(jnp.array([1.0, 0.0, -1.0]), "c"), jnp.array([1.0, 1.0]))
        >>> q.array.tolist(), r.array.tolist()
        ([1.0, -1.0], [0.0, 0.0, 0.0])
    """
    q, r = jnp.polydiv(_raw(p1), _raw(p2))
    return _coefficients(q, p1, p2), _coefficients(r, p1, p2)


def polyint(p: Any, m: int = 1, k: Any = None) -> NamedArray:
    """The ``m``-th antiderivative, with integration constants ``k`` (``jnp.polyint``).

    Example:
        >>> import jax.numpy as jnp, ponente.namedtensor as hax
        >>> hax.polyint(hax.named(jnp.array([3.0, 2.0]), "c")).array.tolist()
        [1.5, 2.0, 0.0]
    """
    return _coefficients(jnp.polyint(_raw(p), m=m, k=None if k is None else _raw(k)), p)


def polyder(p: Any, m: int = 1) -> NamedArray:
    """The ``m``-th derivative (``jnp.polyder``).

    Example:
        >>> import jax.numpy as jnp, ponente.namedtensor as hax
        >>> hax.polyder(hax.named(jnp.array([1.0, 2.0, 3.0]), "c")).array.tolist()
        [2.0, 2.0]
    """
    return _coefficients(jnp.polyder(_raw(p), m=m), p)


def polyval(p: Any, x: Any) -> Any:
    """The polynomial ``p`` evaluated at ``x`` (``jnp.polyval``).

    Returns:
        A named array with ``x``'s axes if ``x`` is named, else a plain array.

    Example:
        >>> import jax.numpy as jnp, ponente.namedtensor as hax
        >>> p = hax.named(jnp.array([1.0, 0.0, -1.0]), "c")
        >>> hax.polyval(p, hax.named(jnp.array([0.0, 2.0]), "x")).array.tolist()
        [-1.0, 3.0]
    """
    result = jnp.polyval(_raw(p), _raw(x))
    return NamedArray(result, x.axes) if isinstance(x, NamedArray) else result


def polyfit(
    x: Any,
    y: Any,
    deg: int,
    rcond: Any = None,
    full: bool = False,
    w: Any = None,
    cov: bool = False,
) -> Any:
    """Least-squares fit of a polynomial of degree ``deg`` to the points ``(x, y)`` (``jnp.polyfit``).

    The coefficients are named after ``x``'s axis (else ``y``'s, else ``degree``).

    Args:
        x: the sample points (one axis).
        y: the values at ``x``.
        deg: the degree of the fitted polynomial.
        rcond: relative condition number cutoff (see ``jnp.polyfit``).
        full: also return ``(residuals, rank, singular_values, rcond)`` as plain arrays.
        w: weights of the points.
        cov: also return the coefficients' covariance matrix, a named array whose axes are the coefficient
            axis and a copy of it named ``<name>_cov`` (ignored when ``full``).

    Returns:
        The coefficients; or ``(coefficients, residuals, rank, singular_values, rcond)`` if ``full``; or
        ``(coefficients, covariance)`` if ``cov``.

    Example:
        >>> import jax.numpy as jnp, ponente.namedtensor as hax
        >>> x = hax.named(jnp.arange(4.0), "x")
        >>> hax.polyfit(x, 2 * x + 1, 1).array.round(4).tolist()
        [2.0, 1.0]
    """
    result = jnp.polyfit(_raw(x), _raw(y), deg, rcond=_raw(rcond), full=full, w=_raw(w), cov=cov)
    if full:
        return (_coefficients(result[0], x, y), *result[1:])
    if cov:
        coeffs = _coefficients(result[0], x, y)
        row = coeffs.axes[0]
        return coeffs, NamedArray(result[1], (row, Axis(f"{row.name}_cov", row.size)))
    return _coefficients(cast(jax.Array, result), x, y)


def roots(p: Any) -> NamedArray:
    """The roots of a polynomial (``jnp.roots``), named after its coefficient axis.

    Example:
        >>> import jax.numpy as jnp, ponente.namedtensor as hax
        >>> hax.roots(hax.named(jnp.array([1.0, -1.0]), "c")).array.real.tolist()
        [1.0]
    """
    return _coefficients(jnp.roots(_raw(p)), p)


def trim_zeros(f: Any, trim: str = "fb") -> NamedArray:
    """Removes leading (``"f"``) and/or trailing (``"b"``) zeros (``jnp.trim_zeros``; not traceable).

    Example:
        >>> import jax.numpy as jnp, ponente.namedtensor as hax
        >>> hax.trim_zeros(hax.named(jnp.array([0, 1, 2, 0]), "c")).array.tolist()
        [1, 2]
    """
    return _coefficients(jnp.trim_zeros(_raw(f), trim=trim), f)


def vander(x: NamedArray, degree: AxisSelector) -> NamedArray:
    """The Vandermonde matrix of ``x``: column ``j`` holds ``x ** (N - 1 - j)`` (``jnp.vander``).

    Args:
        x: a one-axis named array.
        degree: the column axis; an :class:`~ponente.namedtensor.Axis` gives the number of columns ``N``, a name
            makes ``N`` the length of ``x``.

    Returns:
        A named array with axes ``(x's axis, degree)``.

    Raises:
        ValueError: if ``x`` does not have exactly one axis.

    Example:
        >>> import jax.numpy as jnp, ponente.namedtensor as hax
        >>> hax.vander(hax.named(jnp.array([2, 3]), "x"), hax.Axis("power", 3)).array.tolist()
        [[4, 2, 1], [9, 3, 1]]
    """
    if x.ndim != 1:
        raise ValueError(f"vander needs a one-axis array, got axes {x.axis_names}")
    column = degree if isinstance(degree, Axis) else Axis(axis_name(degree), x.axes[0].size)
    return NamedArray(jnp.vander(x.array, N=column.size), (x.axes[0], column))
