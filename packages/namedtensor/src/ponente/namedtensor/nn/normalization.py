"""Normalization layers over named axes: ``LayerNorm`` and ``RmsNorm``."""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp

from ..axis import Axis, AxisSpec, axis_name, axis_size, axis_spec_to_tuple
from ..core import NamedArray
from ..creation import ones, zeros
from ..jax_utils import named_call
from ..state_dict import ModuleWithStateDictSerialization
from .functional import log_softmax, logsumexp, softmax, standardize  # also importable from here, as in Haliax

__all__ = ["LayerNorm", "LayerNormBase", "RmsNorm", "log_softmax", "logsumexp", "softmax", "standardize"]

L = TypeVar("L", bound="LayerNormBase")

_FLAT = "__OUT__"  # name of the merged axis in PyTorch exports


def _positions(x: NamedArray, axis: AxisSpec, what: str) -> tuple[int, ...]:
    names = axis_name(axis)
    names = (names,) if isinstance(names, str) else names
    for n in names:
        if not x.has_axis(n):
            raise ValueError(f"{what}: axis {n!r} is not in the input, whose axes are {x.axis_names}")
    return tuple(x._index_of(n) for n in names)


class LayerNormBase(ModuleWithStateDictSerialization):
    """Shared fields of :class:`LayerNorm` and :class:`RmsNorm`.

    For PyTorch exports, a scale and shift over several axes become 1-D (merged into an axis ``__OUT__``).

    Attributes:
        axis: the axis or axes normalized over (static).
        weight: the learned scale over ``axis``, or None.
        bias: the learned shift over ``axis``, or None.
        eps: added to the variance.
        dtype: dtype of the statistics computation (None: the input's); the output has the input's dtype.
    """

    axis: AxisSpec = eqx.field(static=True)
    weight: NamedArray | None
    bias: NamedArray | None
    eps: float = eqx.field(default=1e-5, static=True)
    dtype: Any = eqx.field(default=None, static=True)

    @classmethod
    def init(
        cls: type[L],
        axis: AxisSpec,
        eps: float = 1e-5,
        *,
        use_weight: bool = True,
        use_bias: bool = True,
        dtype: Any = None,
    ) -> L:
        """Creates the layer with weight 1 and bias 0.

        Args:
            axis: the axis or axes to normalize over (with sizes).
            eps: added to the variance for stability.
            use_weight: whether to learn a scale.
            use_bias: whether to learn a shift.
            dtype: dtype of the statistics computation.

        Returns:
            The layer.
        """
        weight = ones(axis) if use_weight else None
        bias = zeros(axis) if use_bias else None
        return cls(axis, weight, bias, eps, dtype)

    def flatten_for_export(self: L) -> L:
        """This layer with its axes merged into one (``__OUT__``); a layer over a single axis is returned as is.

        Returns:
            The flattened layer (only for export).

        Example:
            >>> import ponente.namedtensor as hax
            >>> norm = RmsNorm.init({"heads": 2, "head": 3}, use_bias=False)
            >>> norm.flatten_for_export().weight.shape
            {'__OUT__': 6}
        """
        if isinstance(self.axis, Axis):
            return self
        axes = axis_spec_to_tuple(self.axis)
        flat = Axis(_FLAT, axis_size(self.axis))
        weight = None if self.weight is None else self.weight.flatten_axes(axes, flat)
        bias = None if self.bias is None else self.bias.flatten_axes(axes, flat)
        return dataclasses.replace(self, axis=flat, weight=weight, bias=bias)

    def unflatten_from_export(self: L, template: L) -> L:
        """Inverse of :meth:`flatten_for_export`: this layer's values over ``template``'s axes.

        Args:
            template: a layer over the original axes (its values are ignored).

        Returns:
            The layer in ``template``'s layout.
        """
        if self.axis == template.axis:
            return self

        def restore(x: NamedArray | None, like: NamedArray | None) -> NamedArray | None:
            if x is None:
                return None
            x = x.unflatten_axis(_FLAT, template.axis)
            return x if like is None else x.rearrange(like.axes)

        weight, bias = restore(self.weight, template.weight), restore(self.bias, template.bias)
        return dataclasses.replace(self, axis=template.axis, weight=weight, bias=bias)

    def _affine(self, out: NamedArray) -> NamedArray:
        if self.weight is not None:
            out = self.weight * out
        if self.bias is not None:
            out = out + self.bias
        return out


class LayerNorm(LayerNormBase):
    """Layer normalization: ``(x - mean) / sqrt(var + eps) * weight + bias`` over ``axis``.

    Example:
        >>> import ponente.namedtensor as hax
        >>> ln = LayerNorm.init(hax.Axis("embed", 4))
        >>> ln(hax.arange(hax.Axis("embed", 4), dtype=float)).shape
        {'embed': 4}
    """

    @named_call
    def __call__(self, x: NamedArray, *, key: jax.Array | None = None) -> NamedArray:
        """Normalizes ``x`` over ``axis`` (other axes are batch axes).

        Args:
            x: the input, with the ``axis`` axes.
            key: unused.

        Returns:
            The normalized array, same axes and dtype as ``x``.

        Raises:
            ValueError: if ``x`` lacks a normalized axis.
        """
        del key
        pos = _positions(x, self.axis, "LayerNorm")
        a = x.array if self.dtype is None else x.array.astype(self.dtype)
        mean = jnp.mean(a, axis=pos, keepdims=True)
        var = jnp.mean(jnp.square(a - mean), axis=pos, keepdims=True)
        out = NamedArray(((a - mean) * jax.lax.rsqrt(var + self.eps)).astype(x.dtype), x.axes)
        return self._affine(out)


class RmsNorm(LayerNormBase):
    """Root-mean-square normalization: ``x / sqrt(mean(x²) + eps) * weight (+ bias)`` over ``axis``.

    Example:
        >>> import ponente.namedtensor as hax
        >>> norm = RmsNorm.init(hax.Axis("embed", 4), use_bias=False)
        >>> norm(hax.ones({"embed": 4})).array.tolist()  # doctest: +ELLIPSIS
        [0.99999..., 0.99999..., 0.99999..., 0.99999...]
    """

    @named_call
    def __call__(self, x: NamedArray, *, key: jax.Array | None = None) -> NamedArray:
        """Normalizes ``x`` by its root mean square over ``axis``.

        Args:
            x: the input, with the ``axis`` axes.
            key: unused.

        Returns:
            The normalized array, same axes and dtype as ``x``.

        Raises:
            ValueError: if ``x`` lacks a normalized axis.
        """
        del key
        pos = _positions(x, self.axis, "RmsNorm")
        a = x.array if self.dtype is None else x.array.astype(self.dtype)
        ms = jnp.mean(jnp.square(a), axis=pos, keepdims=True)
        out = NamedArray((a * jax.lax.rsqrt(ms + self.eps)).astype(x.dtype), x.axes)
        return self._affine(out)
