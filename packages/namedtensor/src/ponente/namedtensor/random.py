"""Random sampling with named shapes.

Every function here calls the ``jax.random`` function of the same name with the positional shape
of ``shape`` (axis sizes in the order given) and the same key, so its bits are identical to
``jax.random``'s: ``hax.random.normal(key, (Batch, Embed)).array`` equals
``jax.random.normal(key, (Batch.size, Embed.size))``. Distribution parameters may be scalars or
NamedArrays; a NamedArray parameter broadcasts by name (its axes must be a subset of ``shape``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .axis import Axis, AxisSelector
from .core import NamedArray

__all__ = [
    "ball",
    "bernoulli",
    "beta",
    "binomial",
    "bits",
    "categorical",
    "cauchy",
    "chisquare",
    "choice",
    "dirichlet",
    "double_sided_maxwell",
    "exponential",
    "f",
    "gamma",
    "generalized_normal",
    "geometric",
    "gumbel",
    "laplace",
    "loggamma",
    "logistic",
    "lognormal",
    "maxwell",
    "multinomial",
    "multivariate_normal",
    "normal",
    "orthogonal",
    "pareto",
    "permutation",
    "poisson",
    "rademacher",
    "randint",
    "rayleigh",
    "t",
    "triangular",
    "truncated_normal",
    "uniform",
    "wald",
    "weibull_min",
]

Shape = Axis | Sequence[Axis] | Mapping[str, int]
Param = NamedArray | float | int | jax.Array


def _axes(shape: Shape) -> tuple[Axis, ...]:
    if isinstance(shape, Axis):
        return (shape,)
    if isinstance(shape, Mapping):
        return tuple(Axis(name, size) for name, size in shape.items())
    out = tuple(shape)
    for ax in out:
        if not isinstance(ax, Axis):
            raise TypeError(f"random: a shape needs sizes; got {ax!r} in {shape!r} (use Axis(name, size) or a dict)")
    return out


def _broadcast(param: Any, axes: Sequence[Axis], what: str) -> Any:
    """A NamedArray parameter as a positional array broadcastable to ``axes``; other values unchanged."""
    if not isinstance(param, NamedArray):
        return param
    names = [ax.name for ax in axes]
    for ax in param.axes:
        if ax.name not in names:
            raise ValueError(f"random.{what}: parameter axis {ax.name!r} is not in the requested shape {tuple(names)}")
        if ax.size != axes[names.index(ax.name)].size:
            raise ValueError(
                f"random.{what}: parameter axis {ax} does not match {axes[names.index(ax.name)]} of the shape"
            )
    param_names = [ax.name for ax in param.axes]
    order = sorted(range(len(param_names)), key=lambda i: names.index(param_names[i]))
    raw = jnp.transpose(param.array, order) if order != sorted(order) else param.array
    present = set(param_names)
    return jnp.reshape(raw, tuple(ax.size if ax.name in present else 1 for ax in axes))


def _positional(axes: Sequence[Axis]) -> tuple[int, ...]:
    return tuple(ax.size for ax in axes)


def _index(array: NamedArray, axis: AxisSelector, what: str) -> int:
    name = axis if isinstance(axis, str) else axis.name
    names = [ax.name for ax in array.axes]
    if name not in names:
        raise ValueError(f"random.{what}: axis {name!r} is not in the array's axes {tuple(names)}")
    return names.index(name)


def uniform(key: jax.Array, shape: Shape, dtype: Any = None, minval: Param = 0.0, maxval: Param = 1.0) -> NamedArray:
    """Uniform samples in ``[minval, maxval)``; as :func:`jax.random.uniform`.

    Args:
        key: a PRNG key.
        shape: the axes of the result.
        dtype: a float dtype (default: JAX's default float).
        minval: lower bound (scalar or NamedArray broadcast by name).
        maxval: upper bound (scalar or NamedArray broadcast by name).

    Returns:
        A NamedArray with axes ``shape``.

    Example:
        >>> import jax
        >>> import ponente.namedtensor as hax
        >>> hax.random.uniform(jax.random.key(0), {"batch": 2}).shape
        {'batch': 2}
    """
    axes = _axes(shape)
    lo, hi = _broadcast(minval, axes, "uniform"), _broadcast(maxval, axes, "uniform")
    return NamedArray(jax.random.uniform(key, _positional(axes), dtype, lo, hi), axes)


def normal(key: jax.Array, shape: Shape, dtype: Any = None) -> NamedArray:
    """Standard normal samples; as :func:`jax.random.normal`.

    Args:
        key: a PRNG key.
        shape: the axes of the result.
        dtype: a float dtype.

    Returns:
        A NamedArray with axes ``shape``.
    """
    axes = _axes(shape)
    return NamedArray(jax.random.normal(key, _positional(axes), dtype), axes)


def randint(key: jax.Array, shape: Shape, minval: Param, maxval: Param, dtype: Any = None) -> NamedArray:
    """Integers in ``[minval, maxval)``; as :func:`jax.random.randint`.

    Args:
        key: a PRNG key.
        shape: the axes of the result.
        minval: lower bound (inclusive), scalar or NamedArray.
        maxval: upper bound (exclusive), scalar or NamedArray.
        dtype: an integer dtype.

    Returns:
        A NamedArray with axes ``shape``.
    """
    axes = _axes(shape)
    lo, hi = _broadcast(minval, axes, "randint"), _broadcast(maxval, axes, "randint")
    return NamedArray(jax.random.randint(key, _positional(axes), lo, hi, dtype), axes)


def bernoulli(key: jax.Array, shape: Shape, p: Param = 0.5) -> NamedArray:
    """Booleans that are True with probability ``p``; as :func:`jax.random.bernoulli`.

    Args:
        key: a PRNG key.
        shape: the axes of the result.
        p: probability of True, scalar or NamedArray.

    Returns:
        A boolean NamedArray with axes ``shape``.
    """
    axes = _axes(shape)
    return NamedArray(jax.random.bernoulli(key, _broadcast(p, axes, "bernoulli"), _positional(axes)), axes)


def bits(key: jax.Array, shape: Shape, dtype: Any = None) -> NamedArray:
    """Uniform random bits as unsigned integers; as :func:`jax.random.bits`.

    Args:
        key: a PRNG key.
        shape: the axes of the result.
        dtype: an unsigned integer dtype (default uint32).

    Returns:
        A NamedArray with axes ``shape``.
    """
    axes = _axes(shape)
    return NamedArray(jax.random.bits(key, _positional(axes), dtype), axes)


def _no_param(name: str, doc: str) -> Any:
    fn = getattr(jax.random, name)

    def sample(key: jax.Array, shape: Shape, dtype: Any = None) -> NamedArray:
        axes = _axes(shape)
        return NamedArray(fn(key, _positional(axes), dtype), axes)

    sample.__name__ = sample.__qualname__ = name
    sample.__doc__ = f"""{doc}; as :func:`jax.random.{name}`.

    Args:
        key: a PRNG key.
        shape: the axes of the result.
        dtype: a float dtype.

    Returns:
        A NamedArray with axes ``shape``.
    """
    return sample


def _with_params(name: str, params: Sequence[str], doc: str, defaults: Mapping[str, Any] | None = None) -> Any:
    fn = getattr(jax.random, name)

    def sample(key: jax.Array, shape: Shape, *args: Param, dtype: Any = None, **kwargs: Param) -> NamedArray:
        values = dict(zip(params, args))
        if len(args) > len(params):
            raise TypeError(f"random.{name} takes parameters {tuple(params)}, got {len(args)} positional values")
        for k, v in kwargs.items():
            if k not in params:
                raise TypeError(f"random.{name} has no parameter {k!r}; its parameters are {tuple(params)}")
            if k in values:
                raise TypeError(f"random.{name} got parameter {k!r} twice")
            values[k] = v
        for p in params:
            if p not in values:
                if defaults is None or p not in defaults:
                    raise TypeError(f"random.{name} is missing parameter {p!r}")
                values[p] = defaults[p]
        axes = _axes(shape)
        broadcast = [_broadcast(values[p], axes, name) for p in params]
        return NamedArray(fn(key, *broadcast, shape=_positional(axes), dtype=dtype), axes)

    sample.__name__ = sample.__qualname__ = name
    listed = "\n".join(
        f"        {p}: distribution parameter (scalar or NamedArray broadcast by name)." for p in params
    )
    sample.__doc__ = f"""{doc}; as :func:`jax.random.{name}` (parameters in the same order, after ``shape``).

    Args:
        key: a PRNG key.
        shape: the axes of the result.
{listed}
        dtype: the result dtype.

    Returns:
        A NamedArray with axes ``shape``.
    """
    return sample


cauchy = _no_param("cauchy", "Standard Cauchy samples")
exponential = _no_param("exponential", "Standard exponential samples")
gumbel = _no_param("gumbel", "Standard Gumbel samples")
laplace = _no_param("laplace", "Standard Laplace samples")
logistic = _no_param("logistic", "Standard logistic samples")
maxwell = _no_param("maxwell", "Standard Maxwell samples")
beta = _with_params("beta", ("a", "b"), "Beta(a, b) samples")
binomial = _with_params("binomial", ("n", "p"), "Binomial(n, p) samples")
chisquare = _with_params("chisquare", ("df",), "Chi-square samples with ``df`` degrees of freedom")
double_sided_maxwell = _with_params("double_sided_maxwell", ("loc", "scale"), "Double-sided Maxwell samples")
f = _with_params("f", ("dfnum", "dfden"), "F-distribution samples")
gamma = _with_params("gamma", ("a",), "Gamma(a) samples")
geometric = _with_params("geometric", ("p",), "Geometric(p) samples (number of trials)")
loggamma = _with_params("loggamma", ("a",), "Log-gamma samples (log of Gamma(a), accurate for small ``a``)")
lognormal = _with_params("lognormal", ("sigma",), "Log-normal samples", defaults={"sigma": 1.0})
pareto = _with_params("pareto", ("b",), "Pareto(b) samples")
poisson = _with_params("poisson", ("lam",), "Poisson(lam) samples")
rayleigh = _with_params("rayleigh", ("scale",), "Rayleigh samples")
t = _with_params("t", ("df",), "Student's t samples")
triangular = _with_params("triangular", ("left", "mode", "right"), "Triangular samples")
truncated_normal = _with_params(
    "truncated_normal", ("lower", "upper"), "Standard normal samples truncated to [lower, upper]"
)
wald = _with_params("wald", ("mean",), "Wald (inverse Gaussian) samples")
weibull_min = _with_params("weibull_min", ("scale", "concentration"), "Weibull samples")


def generalized_normal(key: jax.Array, shape: Shape, p: float, dtype: Any = None) -> NamedArray:
    """Generalized normal samples with shape parameter ``p``; as :func:`jax.random.generalized_normal`.

    Args:
        key: a PRNG key.
        shape: the axes of the result.
        p: the (static, scalar) shape parameter.
        dtype: a float dtype.

    Returns:
        A NamedArray with axes ``shape``.
    """
    axes = _axes(shape)
    return NamedArray(jax.random.generalized_normal(key, p, _positional(axes), dtype), axes)


def rademacher(key: jax.Array, shape: Shape, dtype: Any = None) -> NamedArray:
    """Random signs (-1 or +1); as :func:`jax.random.rademacher`.

    Args:
        key: a PRNG key.
        shape: the axes of the result.
        dtype: the result dtype (default int).

    Returns:
        A NamedArray with axes ``shape``.
    """
    axes = _axes(shape)
    return NamedArray(jax.random.rademacher(key, _positional(axes), dtype), axes)


def ball(key: jax.Array, shape: Shape, D: Axis, p: float = 2.0, dtype: Any = None) -> NamedArray:
    """Points uniform in the unit ``p``-norm ball of dimension ``D``; as :func:`jax.random.ball`.

    Args:
        key: a PRNG key.
        shape: the batch axes.
        D: the axis of the ball's coordinates (last in the result).
        p: the norm.
        dtype: a float dtype.

    Returns:
        A NamedArray with axes ``shape + (D,)``.
    """
    axes = _axes(shape)
    raw = jax.random.ball(key, D.size, p, _positional(axes), dtype)
    return NamedArray(raw, (*axes, D))


def categorical(key: jax.Array, logits: NamedArray, axis: AxisSelector, shape: Shape | None = None) -> NamedArray:
    """Indices along ``axis`` drawn with probabilities ``softmax(logits)``; as :func:`jax.random.categorical`.

    JAX's draws depend on where the category axis sits, so (as Haliax does) ``logits`` keeps its layout when
    its other axes are in the order of ``shape``: axes of ``shape`` that it lacks are added in front. Otherwise it is
    arranged as ``shape + (axis,)``.

    Args:
        key: a PRNG key.
        logits: unnormalized log-probabilities, with ``axis`` among their axes.
        axis: the axis of categories.
        shape: the result axes (default: the other axes of ``logits``); must include them.

    Returns:
        An integer NamedArray with axes ``shape``.
    """
    index = _index(logits, axis, "categorical")
    event = logits.axes[index]
    batch = tuple(ax for ax in logits.axes if ax.name != event.name)
    axes = batch if shape is None else _axes(shape)
    if any(ax.name == event.name for ax in axes):
        raise ValueError(f"random.categorical: the shape {axes} must not contain the category axis {event.name!r}")
    names = set(logits.axis_names)
    full = (*(ax for ax in axes if ax.name not in names), *logits.axes)
    if tuple(ax for ax in full if ax.name != event.name) == tuple(axes):
        raw, pos = jnp.broadcast_to(logits.array, _positional(full)), full.index(event)
    else:
        raw, pos = _broadcast(logits, (*axes, event), "categorical"), -1
    return NamedArray(jax.random.categorical(key, raw, axis=pos, shape=_positional(axes)), axes)


def choice(
    key: jax.Array,
    shape: Shape,
    a: NamedArray,
    axis: AxisSelector,
    replace: bool = True,
    p: NamedArray | None = None,
) -> NamedArray:
    """Random elements of ``a`` along ``axis``; as :func:`jax.random.choice`.

    Args:
        key: a PRNG key.
        shape: the axes that replace ``axis`` in the result.
        a: the array to draw from.
        axis: the axis to draw along.
        replace: sample with replacement.
        p: probabilities, a NamedArray with the single axis ``axis`` (default uniform).

    Returns:
        A NamedArray with ``axis`` of ``a`` replaced (in place) by ``shape``.
    """
    index = _index(a, axis, "choice")
    axes = _axes(shape)
    probs = None
    if p is not None:
        if tuple(ax.name for ax in p.axes) != (a.axes[index].name,):
            raise ValueError(f"random.choice: p must have exactly the axis {a.axes[index].name!r}, got {p.axes}")
        probs = p.array
    raw = jax.random.choice(key, a.array, _positional(axes), replace=replace, p=probs, axis=index)
    return NamedArray(raw, (*a.axes[:index], *axes, *a.axes[index + 1 :]))


def permutation(key: jax.Array, x: NamedArray, axis: AxisSelector, independent: bool = False) -> NamedArray:
    """Shuffle ``x`` along ``axis``; as :func:`jax.random.permutation`.

    Args:
        key: a PRNG key.
        x: the array.
        axis: the axis to permute.
        independent: permute each slice independently.

    Returns:
        A NamedArray with the axes of ``x``.
    """
    index = _index(x, axis, "permutation")
    return NamedArray(jax.random.permutation(key, x.array, axis=index, independent=independent), x.axes)


def dirichlet(key: jax.Array, shape: Shape, alpha: NamedArray, axis: AxisSelector, dtype: Any = None) -> NamedArray:
    """Dirichlet samples over the categories of ``axis``; as :func:`jax.random.dirichlet`.

    Args:
        key: a PRNG key.
        shape: the batch axes.
        alpha: concentrations with ``axis`` (and possibly some of ``shape``'s axes).
        axis: the category axis (last in the result).
        dtype: a float dtype.

    Returns:
        A NamedArray with axes ``shape + (axis,)``.
    """
    event = alpha.axes[_index(alpha, axis, "dirichlet")]
    axes = _axes(shape)
    raw = _broadcast(alpha, (*axes, event), "dirichlet")
    return NamedArray(jax.random.dirichlet(key, raw, _positional(axes), dtype), (*axes, event))


def multivariate_normal(
    key: jax.Array,
    shape: Shape,
    mean: NamedArray,
    cov: NamedArray,
    axis: AxisSelector,
    cov_axis: AxisSelector,
    method: str = "cholesky",
    dtype: Any = None,
) -> NamedArray:
    """Multivariate normal samples; as :func:`jax.random.multivariate_normal`.

    A covariance matrix needs two axes of the same size: ``axis`` (the event axis, shared with
    ``mean``) for its rows and ``cov_axis`` for its columns.

    Args:
        key: a PRNG key.
        shape: the batch axes of the result (``mean``'s and ``cov``'s other axes must be among them).
        mean: the means, with ``axis``.
        cov: the covariances, with ``axis`` and ``cov_axis``.
        axis: the event axis (last in the result).
        cov_axis: the second axis of ``cov``.
        method: ``"cholesky"``, ``"eigh"`` or ``"svd"``.
        dtype: a float dtype.

    Returns:
        A NamedArray with axes ``shape + (axis,)``.

    Raises:
        ValueError: if ``cov_axis`` does not have the size of ``axis``.
    """
    event = mean.axes[_index(mean, axis, "multivariate_normal")]
    column = cov.axes[_index(cov, cov_axis, "multivariate_normal")]
    _index(cov, event.name, "multivariate_normal")
    if column.size != event.size:
        raise ValueError(f"random.multivariate_normal: cov axis {column} must have the size of the event axis {event}")
    axes = _axes(shape)
    raw_mean = _broadcast(mean, (*axes, event), "multivariate_normal")
    raw_cov = _broadcast(
        cov.rename({column.name: "__cov_column__"}),
        (*axes, event, column.alias("__cov_column__")),
        "multivariate_normal",
    )
    raw = jax.random.multivariate_normal(key, raw_mean, raw_cov, _positional(axes), dtype, method)
    return NamedArray(raw, (*axes, event))


def orthogonal(key: jax.Array, shape: Shape, Rows: Axis, Cols: Axis, dtype: Any = None) -> NamedArray:
    """Random orthogonal matrices (Haar measure); as :func:`jax.random.orthogonal`.

    Args:
        key: a PRNG key.
        shape: the batch axes.
        Rows: the row axis of each matrix.
        Cols: the column axis; must have the size of ``Rows``.
        dtype: a float dtype.

    Returns:
        A NamedArray with axes ``shape + (Rows, Cols)``.

    Raises:
        ValueError: if ``Rows`` and ``Cols`` differ in size.
    """
    if Rows.size != Cols.size:
        raise ValueError(f"random.orthogonal: matrices are square; got {Rows} and {Cols}")
    axes = _axes(shape)
    raw = jax.random.orthogonal(key, Rows.size, _positional(axes), dtype)
    return NamedArray(raw, (*axes, Rows, Cols))


def multinomial(
    key: jax.Array,
    n: Param,
    p: NamedArray,
    axis: AxisSelector,
    shape: Shape | None = None,
    dtype: Any = None,
) -> NamedArray:
    """Counts per category of ``n`` draws with probabilities ``p``; as :func:`jax.random.multinomial`.

    Args:
        key: a PRNG key.
        n: the number of draws (a scalar or a NamedArray over batch axes).
        p: the probabilities, with the category ``axis``.
        axis: the category axis (last in the result).
        shape: the batch axes (default: the other axes of ``p``).
        dtype: the dtype of the counts.

    Returns:
        A NamedArray with axes ``shape + (axis,)``.
    """
    event = p.axes[_index(p, axis, "multinomial")]
    batch = tuple(ax for ax in p.axes if ax.name != event.name)
    axes = batch if shape is None else _axes(shape)
    raw_p = _broadcast(p, (*axes, event), "multinomial")
    raw_n = _broadcast(n, axes, "multinomial")
    extra = {} if dtype is None else {"dtype": dtype}
    raw = jax.random.multinomial(key, raw_n, raw_p, shape=(*_positional(axes), event.size), **extra)
    return NamedArray(raw, (*axes, event))
