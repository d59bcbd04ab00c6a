"""Element-wise activation functions for named arrays (the ``jax.nn`` activations, axes preserved)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ..axis import AxisSelector
from ..core import NamedArray
from ..wrap import wrap_elemwise_unary

__all__ = [
    "celu",
    "elu",
    "gelu",
    "glu",
    "hard_sigmoid",
    "hard_silu",
    "hard_swish",
    "hard_tanh",
    "leaky_relu",
    "log_sigmoid",
    "quick_gelu",
    "relu",
    "relu6",
    "relu_squared",
    "selu",
    "sigmoid",
    "silu",
    "soft_sign",
    "softplus",
    "swish",
]


def _unary(fn: Callable[..., Any], name: str, what: str) -> Callable[[Any], Any]:
    def activation(a: Any) -> Any:
        return wrap_elemwise_unary(fn, a)

    activation.__name__ = name
    activation.__qualname__ = name
    activation.__doc__ = f"""{what}, element-wise.

    Args:
        a: a NamedArray (or a positional array/scalar).

    Returns:
        An array with the same axes as ``a``.
    """
    return activation


relu = _unary(jax.nn.relu, "relu", "Rectified linear unit ``max(x, 0)``")
relu6 = _unary(jax.nn.relu6, "relu6", "Rectified linear unit clipped at 6: ``min(max(x, 0), 6)``")
sigmoid = _unary(jax.nn.sigmoid, "sigmoid", "Logistic sigmoid ``1 / (1 + exp(-x))``")
log_sigmoid = _unary(jax.nn.log_sigmoid, "log_sigmoid", "Log of the logistic sigmoid, ``-softplus(-x)``")
softplus = _unary(jax.nn.softplus, "softplus", "Softplus ``log(1 + exp(x))``")
soft_sign = _unary(jax.nn.soft_sign, "soft_sign", "Soft sign ``x / (|x| + 1)``")
silu = _unary(jax.nn.silu, "silu", "Sigmoid linear unit ``x * sigmoid(x)``")
swish = _unary(jax.nn.silu, "swish", "Swish, another name for :func:`silu`: ``x * sigmoid(x)``")
hard_sigmoid = _unary(jax.nn.hard_sigmoid, "hard_sigmoid", "Hard sigmoid ``relu6(x + 3) / 6``")
hard_silu = _unary(jax.nn.hard_silu, "hard_silu", "Hard SiLU ``x * hard_sigmoid(x)``")
hard_swish = _unary(jax.nn.hard_silu, "hard_swish", "Hard swish, another name for :func:`hard_silu`")
hard_tanh = _unary(jax.nn.hard_tanh, "hard_tanh", "Hard tanh: ``x`` clipped to ``[-1, 1]``")
selu = _unary(jax.nn.selu, "selu", "Scaled exponential linear unit")


def _relu_squared(x: Any) -> Any:
    r = jax.nn.relu(x)
    return r * r


relu_squared = _unary(_relu_squared, "relu_squared", "Squared rectified linear unit ``max(x, 0) ** 2``")


def _quick_gelu(x: Any) -> Any:
    return x * jax.nn.sigmoid(1.702 * x)


quick_gelu = _unary(_quick_gelu, "quick_gelu", "The sigmoid approximation of GELU, ``x * sigmoid(1.702 x)``")


def leaky_relu(a: Any, negative_slope: float = 0.01) -> Any:
    """Leaky rectified linear unit: ``x`` if ``x >= 0`` else ``negative_slope * x``, element-wise.

    Args:
        a: a NamedArray (or a positional array/scalar).
        negative_slope: the slope for negative inputs.

    Returns:
        An array with the same axes as ``a``.
    """
    return wrap_elemwise_unary(jax.nn.leaky_relu, a, negative_slope=negative_slope)


def elu(a: Any, alpha: float = 1.0) -> Any:
    """Exponential linear unit: ``x`` if ``x > 0`` else ``alpha * (exp(x) - 1)``, element-wise.

    Args:
        a: a NamedArray (or a positional array/scalar).
        alpha: the scale of the negative part.

    Returns:
        An array with the same axes as ``a``.
    """
    return wrap_elemwise_unary(jax.nn.elu, a, alpha=alpha)


def celu(a: Any, alpha: float = 1.0) -> Any:
    """Continuously differentiable ELU: ``max(x, 0) + alpha * min(exp(x / alpha) - 1, 0)``, element-wise.

    Args:
        a: a NamedArray (or a positional array/scalar).
        alpha: the scale of the negative part.

    Returns:
        An array with the same axes as ``a``.
    """
    return wrap_elemwise_unary(jax.nn.celu, a, alpha=alpha)


def gelu(a: Any, approximate: bool = True) -> Any:
    """Gaussian error linear unit ``x * Phi(x)``, element-wise.

    Args:
        a: a NamedArray (or a positional array/scalar).
        approximate: use the tanh approximation (True, the default as in ``jax.nn.gelu``) or the exact erf form.

    Returns:
        An array with the same axes as ``a``.
    """
    return wrap_elemwise_unary(jax.nn.gelu, a, approximate=approximate)


def glu(x: NamedArray, axis: AxisSelector) -> NamedArray:
    """Gated linear unit: splits ``axis`` into two halves ``a, b`` and returns ``a * sigmoid(b)``.

    Args:
        x: the named array.
        axis: the axis to split; its size must be even. The result has this axis at half the size.

    Returns:
        The gated array; ``axis`` has half its size, the other axes are unchanged.

    Raises:
        ValueError: if ``axis`` is absent or its size is odd.

    Example:
        >>> import ponente.namedtensor as hax
        >>> glu(hax.ones({"b": 2, "mlp": 8}), "mlp").shape
        {'b': 2, 'mlp': 4}
    """
    ax = x.resolve_axis(axis)
    if ax.size % 2 != 0:
        raise ValueError(f"glu: axis {ax.name!r} must have an even size to split in halves, got {ax.size}")
    pos = x._index_of(ax)
    a, b = jnp.split(x.array, 2, axis=pos)
    axes = tuple(ax.resize(ax.size // 2) if i == pos else other for i, other in enumerate(x.axes))
    return NamedArray(a * jax.nn.sigmoid(b), axes)
