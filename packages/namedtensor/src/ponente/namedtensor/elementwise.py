"""Element-wise functions on named arrays: every unary and binary NumPy function that ``jax.numpy`` offers.

Unary functions keep the axes of their input. Binary functions broadcast by name: one operand's axes must
be a subset of the other's, and the result takes the larger operand's axis order. Scalars broadcast freely.
Non-named inputs are passed straight to ``jax.numpy``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from .core import NamedArray
from .wrap import elemwise_binary, wrap_elemwise_unary

NamedOrNumeric = Any
"""A named array, a JAX/NumPy scalar array, or a Python number."""

__all__ = [
    "abs",
    "absolute",
    "acos",
    "acosh",
    "add",
    "angle",
    "arccos",
    "arccosh",
    "arcsin",
    "arcsinh",
    "arctan",
    "arctan2",
    "arctanh",
    "around",
    "asin",
    "asinh",
    "atan",
    "atan2",
    "atanh",
    "bitwise_and",
    "bitwise_count",
    "bitwise_invert",
    "bitwise_left_shift",
    "bitwise_not",
    "bitwise_or",
    "bitwise_right_shift",
    "bitwise_xor",
    "cbrt",
    "ceil",
    "conj",
    "conjugate",
    "copy",
    "copysign",
    "cos",
    "cosh",
    "deg2rad",
    "degrees",
    "divide",
    "divmod",
    "equal",
    "exp",
    "exp2",
    "expm1",
    "fabs",
    "fix",
    "float_power",
    "floor",
    "floor_divide",
    "fmax",
    "fmin",
    "fmod",
    "frexp",
    "gcd",
    "greater",
    "greater_equal",
    "heaviside",
    "hypot",
    "i0",
    "imag",
    "invert",
    "iscomplex",
    "isfinite",
    "isinf",
    "isnan",
    "isneginf",
    "isposinf",
    "isreal",
    "lcm",
    "ldexp",
    "left_shift",
    "less",
    "less_equal",
    "log",
    "log1p",
    "log2",
    "log10",
    "logaddexp",
    "logaddexp2",
    "logical_and",
    "logical_not",
    "logical_or",
    "logical_xor",
    "maximum",
    "minimum",
    "mod",
    "modf",
    "multiply",
    "nan_to_num",
    "negative",
    "nextafter",
    "not_equal",
    "positive",
    "pow",
    "power",
    "rad2deg",
    "radians",
    "real",
    "reciprocal",
    "remainder",
    "right_shift",
    "rint",
    "round",
    "rsqrt",
    "sign",
    "signbit",
    "sin",
    "sinc",
    "sinh",
    "spacing",
    "sqrt",
    "square",
    "subtract",
    "tan",
    "tanh",
    "true_divide",
    "trunc",
]


def abs(a: NamedArray) -> NamedArray:
    """Element-wise ``jax.numpy.abs``; the result has the axes of ``a``."""
    return wrap_elemwise_unary(jnp.abs, a)


def absolute(a: NamedArray) -> NamedArray:
    """Element-wise ``jax.numpy.absolute``; the result has the axes of ``a``."""
    return wrap_elemwise_unary(jnp.absolute, a)


def acos(a: NamedArray) -> NamedArray:
    """Element-wise ``jax.numpy.acos``; the result has the axes of ``a``."""
    return wrap_elemwise_unary(jnp.acos, a)


def acosh(a: NamedArray) -> NamedArray:
    """Element-wise ``jax.numpy.acosh``; the result has the axes of ``a``."""
    return wrap_elemwise_unary(jnp.acosh, a)


def angle(a: NamedArray) -> NamedArray:
    """Element-wise ``jax.numpy.angle``; the result has the axes of ``a``."""
    return wrap_elemwise_unary(jnp.angle, a)


def arccos(a: NamedArray) -> NamedArray:
    """Element-wise ``jax.numpy.arccos``; the result has the axes of ``a``."""
    return wrap_elemwise_unary(jnp.arccos, a)


def arccosh(a: NamedArray) -> NamedArray:
    """Element-wise ``jax.numpy.arccosh``; the result has the axes of ``a``."""
    return wrap_elemwise_unary(jnp.arccosh, a)


def arcsin(a: NamedArray) -> NamedArray:
    """Element-wise ``jax.numpy.arcsin``; the result has the axes of ``a``."""
    return wrap_elemwise_unary(jnp.arcsin, a)


def arcsinh(a: NamedArray) -> NamedArray:
    """Element-wise ``jax.numpy.arcsinh``; the result has the axes of ``a``."""
    return wrap_elemwise_unary(jnp.arcsinh, a)


def arctan(a: NamedArray) -> NamedArray:
    """Element-wise ``jax.numpy.arctan``; the result has the axes of ``a``."""
    return wrap_elemwise_unary(jnp.arctan, a)


def arctanh(a: NamedArray) -> NamedArray:
    """Element-wise ``jax.numpy.arctanh``; the result has the axes of ``a``."""
    return wrap_elemwise_unary(jnp.arctanh, a)


def asin(a: NamedArray) -> NamedArray:
    """Element-wise ``jax.numpy.asin``; the result has the axes of ``a``."""
    return wrap_elemwise_unary(jnp.asin, a)


def asinh(a: NamedArray) -> NamedArray:
    """Element-wise ``jax.numpy.asinh``; the result has the axes of ``a``."""
    return wrap_elemwise_unary(jnp.asinh, a)


def atan(a: NamedArray) -> NamedArray:
    """Element-wise ``jax.numpy.atan``; the result has the axes of ``a``."""
    return wrap_elemwise_unary(jnp.atan, a)


def atanh(a: NamedArray) -> NamedArray:
    """Element-wise ``jax.numpy.atanh``; the result has the axes of ``a``."""
    return wrap_elemwise_unary(jnp.atanh, a)


def bitwise_count(a: NamedArray) -> NamedArray:
    """Element-wise ``jax.numpy.bitwise_count``; the result has the axes of ``a``."""
    return wrap_elemwise_unary(jnp.bitwise_count, a)


def bitwise_invert(a: NamedArray) -> NamedArray:
    """Element-wise ``jax.numpy.bitwise_invert``; the result has the axes of ``a``."""
    return wrap_elemwise_unary(jnp.bitwise_invert, a)


def bitwise_not(a: NamedArray) -> NamedArray:
    """Element-wise ``jax.numpy.bitwise_not``; the result has the axes of ``a``."""
    return wrap_elemwise_unary(jnp.bitwise_not, a)


def cbrt(a: NamedArray) -> NamedArray:
    """Element-wise ``jax.numpy.cbrt``; the result has the axes of ``a``."""
    return wrap_elemwise_unary(jnp.cbrt, a)


def ceil(a: NamedArray) -> NamedArray:
    """Element-wise ``jax.numpy.ceil``; the result has the axes of ``a``."""
    return wrap_elemwise_unary(jnp.ceil, a)


def conj(a: NamedArray) -> NamedArray:
    """Element-wise ``jax.numpy.conj``; the result has the axes of ``a``."""
    return wrap_elemwise_unary(jnp.conj, a)


def conjugate(a: NamedArray) -> NamedArray:
    """Element-wise ``jax.numpy.conjugate``; the result has the axes of ``a``."""
    return wrap_elemwise_unary(jnp.conjugate, a)


def copy(a: NamedArray) -> NamedArray:
    """Element-wise ``jax.numpy.copy``; the result has the axes of ``a``."""
    return wrap_elemwise_unary(jnp.copy, a)


def cos(a: NamedArray) -> NamedArray:
    """Element-wise ``jax.numpy.cos``; the result has the axes of ``a``."""
    return wrap_elemwise_unary(jnp.cos, a)


def cosh(a: NamedArray) -> NamedArray:
    """Element-wise ``jax.numpy.cosh``; the result has the axes of ``a``."""
    return wrap_elemwise_unary(jnp.cosh, a)


def deg2rad(a: NamedArray) -> NamedArray:
    """Element-wise ``jax.numpy.deg2rad``; the result has the axes of ``a``."""
    return wrap_elemwise_unary(jnp.deg2rad, a)


def degrees(a: NamedArray) -> NamedArray:
    """Element-wise ``jax.numpy.degrees``; the result has the axes of ``a``."""
    return wrap_elemwise_unary(jnp.degrees, a)


def exp(a: NamedArray) -> NamedArray:
    """Element-wise ``jax.numpy.exp``; the result has the axes of ``a``."""
    return wrap_elemwise_unary(jnp.exp, a)


def exp2(a: NamedArray) -> NamedArray:
    """Element-wise ``jax.numpy.exp2``; the result has the axes of ``a``."""
    return wrap_elemwise_unary(jnp.exp2, a)


def expm1(a: NamedArray) -> NamedArray:
    """Element-wise ``jax.numpy.expm1``; the result has the axes of ``a``."""
    return wrap_elemwise_unary(jnp.expm1, a)


def fabs(a: NamedArray) -> NamedArray:
    """Element-wise ``jax.numpy.fabs``; the result has the axes of ``a``."""
    return wrap_elemwise_unary(jnp.fabs, a)


def fix(a: NamedArray) -> NamedArray:
    """Element-wise rounding toward zero (NumPy's ``fix``); the result has the axes of ``a``."""
    return wrap_elemwise_unary(jnp.trunc, a)


def floor(a: NamedArray) -> NamedArray:
    """Element-wise ``jax.numpy.floor``; the result has the axes of ``a``."""
    return wrap_elemwise_unary(jnp.floor, a)


def i0(a: NamedArray) -> NamedArray:
    """Element-wise ``jax.numpy.i0``; the result has the axes of ``a``."""
    return wrap_elemwise_unary(jnp.i0, a)


def imag(a: NamedArray) -> NamedArray:
    """Element-wise ``jax.numpy.imag``; the result has the axes of ``a``."""
    return wrap_elemwise_unary(jnp.imag, a)


def invert(a: NamedArray) -> NamedArray:
    """Element-wise ``jax.numpy.invert``; the result has the axes of ``a``."""
    return wrap_elemwise_unary(jnp.invert, a)


def iscomplex(a: NamedArray) -> NamedArray:
    """Element-wise ``jax.numpy.iscomplex``; the result has the axes of ``a``."""
    return wrap_elemwise_unary(jnp.iscomplex, a)


def isfinite(a: NamedArray) -> NamedArray:
    """Element-wise ``jax.numpy.isfinite``; the result has the axes of ``a``."""
    return wrap_elemwise_unary(jnp.isfinite, a)


def isinf(a: NamedArray) -> NamedArray:
    """Element-wise ``jax.numpy.isinf``; the result has the axes of ``a``."""
    return wrap_elemwise_unary(jnp.isinf, a)


def isnan(a: NamedArray) -> NamedArray:
    """Element-wise ``jax.numpy.isnan``; the result has the axes of ``a``."""
    return wrap_elemwise_unary(jnp.isnan, a)


def isneginf(a: NamedArray) -> NamedArray:
    """Element-wise ``jax.numpy.isneginf``; the result has the axes of ``a``."""
    return wrap_elemwise_unary(jnp.isneginf, a)


def isposinf(a: NamedArray) -> NamedArray:
    """Element-wise ``jax.numpy.isposinf``; the result has the axes of ``a``."""
    return wrap_elemwise_unary(jnp.isposinf, a)


def isreal(a: NamedArray) -> NamedArray:
    """Element-wise ``jax.numpy.isreal``; the result has the axes of ``a``."""
    return wrap_elemwise_unary(jnp.isreal, a)


def log(a: NamedArray) -> NamedArray:
    """Element-wise ``jax.numpy.log``; the result has the axes of ``a``."""
    return wrap_elemwise_unary(jnp.log, a)


def log10(a: NamedArray) -> NamedArray:
    """Element-wise ``jax.numpy.log10``; the result has the axes of ``a``."""
    return wrap_elemwise_unary(jnp.log10, a)


def log1p(a: NamedArray) -> NamedArray:
    """Element-wise ``jax.numpy.log1p``; the result has the axes of ``a``."""
    return wrap_elemwise_unary(jnp.log1p, a)


def log2(a: NamedArray) -> NamedArray:
    """Element-wise ``jax.numpy.log2``; the result has the axes of ``a``."""
    return wrap_elemwise_unary(jnp.log2, a)


def logical_not(a: NamedArray) -> NamedArray:
    """Element-wise ``jax.numpy.logical_not``; the result has the axes of ``a``."""
    return wrap_elemwise_unary(jnp.logical_not, a)


def negative(a: NamedArray) -> NamedArray:
    """Element-wise ``jax.numpy.negative``; the result has the axes of ``a``."""
    return wrap_elemwise_unary(jnp.negative, a)


def positive(a: NamedArray) -> NamedArray:
    """Element-wise ``jax.numpy.positive``; the result has the axes of ``a``."""
    return wrap_elemwise_unary(jnp.positive, a)


def rad2deg(a: NamedArray) -> NamedArray:
    """Element-wise ``jax.numpy.rad2deg``; the result has the axes of ``a``."""
    return wrap_elemwise_unary(jnp.rad2deg, a)


def radians(a: NamedArray) -> NamedArray:
    """Element-wise ``jax.numpy.radians``; the result has the axes of ``a``."""
    return wrap_elemwise_unary(jnp.radians, a)


def real(a: NamedArray) -> NamedArray:
    """Element-wise ``jax.numpy.real``; the result has the axes of ``a``."""
    return wrap_elemwise_unary(jnp.real, a)


def reciprocal(a: NamedArray) -> NamedArray:
    """Element-wise ``jax.numpy.reciprocal``; the result has the axes of ``a``."""
    return wrap_elemwise_unary(jnp.reciprocal, a)


def rint(a: NamedArray) -> NamedArray:
    """Element-wise ``jax.numpy.rint``; the result has the axes of ``a``."""
    return wrap_elemwise_unary(jnp.rint, a)


def rsqrt(a: NamedArray) -> NamedArray:
    """Element-wise reciprocal square root ``jax.lax.rsqrt``; the result has the axes of ``a``.

    Example:
        >>> import jax.numpy as jnp, ponente.namedtensor as hax
        >>> hax.rsqrt(hax.named(jnp.array([1.0, 4.0]), "a")).array.tolist()
        [1.0, 0.5]
    """
    return wrap_elemwise_unary(jax.lax.rsqrt, a)


def sign(a: NamedArray) -> NamedArray:
    """Element-wise ``jax.numpy.sign``; the result has the axes of ``a``."""
    return wrap_elemwise_unary(jnp.sign, a)


def signbit(a: NamedArray) -> NamedArray:
    """Element-wise ``jax.numpy.signbit``; the result has the axes of ``a``."""
    return wrap_elemwise_unary(jnp.signbit, a)


def sin(a: NamedArray) -> NamedArray:
    """Element-wise ``jax.numpy.sin``; the result has the axes of ``a``."""
    return wrap_elemwise_unary(jnp.sin, a)


def sinc(a: NamedArray) -> NamedArray:
    """Element-wise ``jax.numpy.sinc``; the result has the axes of ``a``."""
    return wrap_elemwise_unary(jnp.sinc, a)


def sinh(a: NamedArray) -> NamedArray:
    """Element-wise ``jax.numpy.sinh``; the result has the axes of ``a``."""
    return wrap_elemwise_unary(jnp.sinh, a)


def spacing(a: NamedArray) -> NamedArray:
    """Element-wise ``jax.numpy.spacing``; the result has the axes of ``a``."""
    return wrap_elemwise_unary(jnp.spacing, a)


def sqrt(a: NamedArray) -> NamedArray:
    """Element-wise ``jax.numpy.sqrt``; the result has the axes of ``a``."""
    return wrap_elemwise_unary(jnp.sqrt, a)


def square(a: NamedArray) -> NamedArray:
    """Element-wise ``jax.numpy.square``; the result has the axes of ``a``."""
    return wrap_elemwise_unary(jnp.square, a)


def tan(a: NamedArray) -> NamedArray:
    """Element-wise ``jax.numpy.tan``; the result has the axes of ``a``."""
    return wrap_elemwise_unary(jnp.tan, a)


def tanh(a: NamedArray) -> NamedArray:
    """Element-wise ``jax.numpy.tanh``; the result has the axes of ``a``."""
    return wrap_elemwise_unary(jnp.tanh, a)


def trunc(a: NamedArray) -> NamedArray:
    """Element-wise ``jax.numpy.trunc``; the result has the axes of ``a``."""
    return wrap_elemwise_unary(jnp.trunc, a)


def round(a: NamedArray, decimals: int = 0) -> NamedArray:
    """Rounds element-wise to ``decimals`` decimals (``jax.numpy.round``); keeps the axes of ``a``."""
    return wrap_elemwise_unary(jnp.round, a, decimals)


def around(a: NamedArray, decimals: int = 0) -> NamedArray:
    """Same as :func:`round`."""
    return wrap_elemwise_unary(jnp.round, a, decimals)


def nan_to_num(
    a: NamedArray, copy: bool = True, nan: float = 0.0, posinf: float | None = None, neginf: float | None = None
) -> NamedArray:
    """Replaces NaN and infinities by finite numbers (``jax.numpy.nan_to_num``); keeps the axes of ``a``."""
    return wrap_elemwise_unary(jnp.nan_to_num, a, copy, nan, posinf, neginf)


def frexp(a: NamedArray) -> tuple[NamedArray, NamedArray]:
    """Mantissa and exponent, element-wise (``jax.numpy.frexp``); both keep the axes of ``a``."""
    m, e = jnp.frexp(a.array)
    return NamedArray(m, a.axes), NamedArray(e, a.axes)


def modf(a: NamedArray) -> tuple[NamedArray, NamedArray]:
    """Fractional and integral parts, element-wise (``jax.numpy.modf``); both keep the axes of ``a``."""
    f, i = jnp.modf(a.array)
    return NamedArray(f, a.axes), NamedArray(i, a.axes)


def divmod(x1: NamedOrNumeric, x2: NamedOrNumeric) -> tuple[NamedArray, NamedArray]:
    """Floor quotient and remainder, broadcast by name (``jax.numpy.divmod``)."""
    return elemwise_binary(jnp.floor_divide, x1, x2), elemwise_binary(jnp.mod, x1, x2)


def add(x1: NamedOrNumeric, x2: NamedOrNumeric) -> NamedArray:
    """Element-wise ``jax.numpy.add``, broadcast by name (subset rule; larger operand's axis order)."""
    return elemwise_binary(jnp.add, x1, x2)


def arctan2(x1: NamedOrNumeric, x2: NamedOrNumeric) -> NamedArray:
    """Element-wise ``jax.numpy.arctan2``, broadcast by name (subset rule; larger operand's axis order)."""
    return elemwise_binary(jnp.arctan2, x1, x2)


def atan2(x1: NamedOrNumeric, x2: NamedOrNumeric) -> NamedArray:
    """Element-wise ``jax.numpy.atan2``, broadcast by name (subset rule; larger operand's axis order)."""
    return elemwise_binary(jnp.atan2, x1, x2)


def bitwise_and(x1: NamedOrNumeric, x2: NamedOrNumeric) -> NamedArray:
    """Element-wise ``jax.numpy.bitwise_and``, broadcast by name (subset rule; larger operand's axis order)."""
    return elemwise_binary(jnp.bitwise_and, x1, x2)


def bitwise_left_shift(x1: NamedOrNumeric, x2: NamedOrNumeric) -> NamedArray:
    """Element-wise ``jax.numpy.bitwise_left_shift``, broadcast by name (subset rule; larger operand's axis order)."""
    return elemwise_binary(jnp.bitwise_left_shift, x1, x2)


def bitwise_or(x1: NamedOrNumeric, x2: NamedOrNumeric) -> NamedArray:
    """Element-wise ``jax.numpy.bitwise_or``, broadcast by name (subset rule; larger operand's axis order)."""
    return elemwise_binary(jnp.bitwise_or, x1, x2)


def bitwise_right_shift(x1: NamedOrNumeric, x2: NamedOrNumeric) -> NamedArray:
    """Element-wise ``jax.numpy.bitwise_right_shift``, broadcast by name (subset rule; larger operand's axis order)."""
    return elemwise_binary(jnp.bitwise_right_shift, x1, x2)


def bitwise_xor(x1: NamedOrNumeric, x2: NamedOrNumeric) -> NamedArray:
    """Element-wise ``jax.numpy.bitwise_xor``, broadcast by name (subset rule; larger operand's axis order)."""
    return elemwise_binary(jnp.bitwise_xor, x1, x2)


def copysign(x1: NamedOrNumeric, x2: NamedOrNumeric) -> NamedArray:
    """Element-wise ``jax.numpy.copysign``, broadcast by name (subset rule; larger operand's axis order)."""
    return elemwise_binary(jnp.copysign, x1, x2)


def divide(x1: NamedOrNumeric, x2: NamedOrNumeric) -> NamedArray:
    """Element-wise ``jax.numpy.divide``, broadcast by name (subset rule; larger operand's axis order)."""
    return elemwise_binary(jnp.divide, x1, x2)


def equal(x1: NamedOrNumeric, x2: NamedOrNumeric) -> NamedArray:
    """Element-wise ``jax.numpy.equal``, broadcast by name (subset rule; larger operand's axis order)."""
    return elemwise_binary(jnp.equal, x1, x2)


def float_power(x1: NamedOrNumeric, x2: NamedOrNumeric) -> NamedArray:
    """Element-wise ``jax.numpy.float_power``, broadcast by name (subset rule; larger operand's axis order)."""
    return elemwise_binary(jnp.float_power, x1, x2)


def floor_divide(x1: NamedOrNumeric, x2: NamedOrNumeric) -> NamedArray:
    """Element-wise ``jax.numpy.floor_divide``, broadcast by name (subset rule; larger operand's axis order)."""
    return elemwise_binary(jnp.floor_divide, x1, x2)


def fmax(x1: NamedOrNumeric, x2: NamedOrNumeric) -> NamedArray:
    """Element-wise ``jax.numpy.fmax``, broadcast by name (subset rule; larger operand's axis order)."""
    return elemwise_binary(jnp.fmax, x1, x2)


def fmin(x1: NamedOrNumeric, x2: NamedOrNumeric) -> NamedArray:
    """Element-wise ``jax.numpy.fmin``, broadcast by name (subset rule; larger operand's axis order)."""
    return elemwise_binary(jnp.fmin, x1, x2)


def fmod(x1: NamedOrNumeric, x2: NamedOrNumeric) -> NamedArray:
    """Element-wise ``jax.numpy.fmod``, broadcast by name (subset rule; larger operand's axis order)."""
    return elemwise_binary(jnp.fmod, x1, x2)


def gcd(x1: NamedOrNumeric, x2: NamedOrNumeric) -> NamedArray:
    """Element-wise ``jax.numpy.gcd``, broadcast by name (subset rule; larger operand's axis order)."""
    return elemwise_binary(jnp.gcd, x1, x2)


def greater(x1: NamedOrNumeric, x2: NamedOrNumeric) -> NamedArray:
    """Element-wise ``jax.numpy.greater``, broadcast by name (subset rule; larger operand's axis order)."""
    return elemwise_binary(jnp.greater, x1, x2)


def greater_equal(x1: NamedOrNumeric, x2: NamedOrNumeric) -> NamedArray:
    """Element-wise ``jax.numpy.greater_equal``, broadcast by name (subset rule; larger operand's axis order)."""
    return elemwise_binary(jnp.greater_equal, x1, x2)


def heaviside(x1: NamedOrNumeric, x2: NamedOrNumeric) -> NamedArray:
    """Element-wise ``jax.numpy.heaviside``, broadcast by name (subset rule; larger operand's axis order)."""
    return elemwise_binary(jnp.heaviside, x1, x2)


def hypot(x1: NamedOrNumeric, x2: NamedOrNumeric) -> NamedArray:
    """Element-wise ``jax.numpy.hypot``, broadcast by name (subset rule; larger operand's axis order)."""
    return elemwise_binary(jnp.hypot, x1, x2)


def lcm(x1: NamedOrNumeric, x2: NamedOrNumeric) -> NamedArray:
    """Element-wise ``jax.numpy.lcm``, broadcast by name (subset rule; larger operand's axis order)."""
    return elemwise_binary(jnp.lcm, x1, x2)


def ldexp(x1: NamedOrNumeric, x2: NamedOrNumeric) -> NamedArray:
    """Element-wise ``jax.numpy.ldexp``, broadcast by name (subset rule; larger operand's axis order)."""
    return elemwise_binary(jnp.ldexp, x1, x2)


def left_shift(x1: NamedOrNumeric, x2: NamedOrNumeric) -> NamedArray:
    """Element-wise ``jax.numpy.left_shift``, broadcast by name (subset rule; larger operand's axis order)."""
    return elemwise_binary(jnp.left_shift, x1, x2)


def less(x1: NamedOrNumeric, x2: NamedOrNumeric) -> NamedArray:
    """Element-wise ``jax.numpy.less``, broadcast by name (subset rule; larger operand's axis order)."""
    return elemwise_binary(jnp.less, x1, x2)


def less_equal(x1: NamedOrNumeric, x2: NamedOrNumeric) -> NamedArray:
    """Element-wise ``jax.numpy.less_equal``, broadcast by name (subset rule; larger operand's axis order)."""
    return elemwise_binary(jnp.less_equal, x1, x2)


def logaddexp(x1: NamedOrNumeric, x2: NamedOrNumeric) -> NamedArray:
    """Element-wise ``jax.numpy.logaddexp``, broadcast by name (subset rule; larger operand's axis order)."""
    return elemwise_binary(jnp.logaddexp, x1, x2)


def logaddexp2(x1: NamedOrNumeric, x2: NamedOrNumeric) -> NamedArray:
    """Element-wise ``jax.numpy.logaddexp2``, broadcast by name (subset rule; larger operand's axis order)."""
    return elemwise_binary(jnp.logaddexp2, x1, x2)


def logical_and(x1: NamedOrNumeric, x2: NamedOrNumeric) -> NamedArray:
    """Element-wise ``jax.numpy.logical_and``, broadcast by name (subset rule; larger operand's axis order)."""
    return elemwise_binary(jnp.logical_and, x1, x2)


def logical_or(x1: NamedOrNumeric, x2: NamedOrNumeric) -> NamedArray:
    """Element-wise ``jax.numpy.logical_or``, broadcast by name (subset rule; larger operand's axis order)."""
    return elemwise_binary(jnp.logical_or, x1, x2)


def logical_xor(x1: NamedOrNumeric, x2: NamedOrNumeric) -> NamedArray:
    """Element-wise ``jax.numpy.logical_xor``, broadcast by name (subset rule; larger operand's axis order)."""
    return elemwise_binary(jnp.logical_xor, x1, x2)


def maximum(x1: NamedOrNumeric, x2: NamedOrNumeric) -> NamedArray:
    """Element-wise ``jax.numpy.maximum``, broadcast by name (subset rule; larger operand's axis order)."""
    return elemwise_binary(jnp.maximum, x1, x2)


def minimum(x1: NamedOrNumeric, x2: NamedOrNumeric) -> NamedArray:
    """Element-wise ``jax.numpy.minimum``, broadcast by name (subset rule; larger operand's axis order)."""
    return elemwise_binary(jnp.minimum, x1, x2)


def mod(x1: NamedOrNumeric, x2: NamedOrNumeric) -> NamedArray:
    """Element-wise ``jax.numpy.mod``, broadcast by name (subset rule; larger operand's axis order)."""
    return elemwise_binary(jnp.mod, x1, x2)


def multiply(x1: NamedOrNumeric, x2: NamedOrNumeric) -> NamedArray:
    """Element-wise ``jax.numpy.multiply``, broadcast by name (subset rule; larger operand's axis order)."""
    return elemwise_binary(jnp.multiply, x1, x2)


def nextafter(x1: NamedOrNumeric, x2: NamedOrNumeric) -> NamedArray:
    """Element-wise ``jax.numpy.nextafter``, broadcast by name (subset rule; larger operand's axis order)."""
    return elemwise_binary(jnp.nextafter, x1, x2)


def not_equal(x1: NamedOrNumeric, x2: NamedOrNumeric) -> NamedArray:
    """Element-wise ``jax.numpy.not_equal``, broadcast by name (subset rule; larger operand's axis order)."""
    return elemwise_binary(jnp.not_equal, x1, x2)


def power(x1: NamedOrNumeric, x2: NamedOrNumeric) -> NamedArray:
    """Element-wise ``jax.numpy.power``, broadcast by name (subset rule; larger operand's axis order)."""
    return elemwise_binary(jnp.power, x1, x2)


def pow(x1: NamedOrNumeric, x2: NamedOrNumeric) -> NamedArray:
    """Element-wise ``jax.numpy.pow``, broadcast by name (subset rule; larger operand's axis order)."""
    return elemwise_binary(jnp.pow, x1, x2)


def remainder(x1: NamedOrNumeric, x2: NamedOrNumeric) -> NamedArray:
    """Element-wise ``jax.numpy.remainder``, broadcast by name (subset rule; larger operand's axis order)."""
    return elemwise_binary(jnp.remainder, x1, x2)


def right_shift(x1: NamedOrNumeric, x2: NamedOrNumeric) -> NamedArray:
    """Element-wise ``jax.numpy.right_shift``, broadcast by name (subset rule; larger operand's axis order)."""
    return elemwise_binary(jnp.right_shift, x1, x2)


def subtract(x1: NamedOrNumeric, x2: NamedOrNumeric) -> NamedArray:
    """Element-wise ``jax.numpy.subtract``, broadcast by name (subset rule; larger operand's axis order)."""
    return elemwise_binary(jnp.subtract, x1, x2)


def true_divide(x1: NamedOrNumeric, x2: NamedOrNumeric) -> NamedArray:
    """Element-wise ``jax.numpy.true_divide``, broadcast by name (subset rule; larger operand's axis order)."""
    return elemwise_binary(jnp.true_divide, x1, x2)
