"""Convolutions over named spatial axes: ``Conv`` and ``ConvTranspose``."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from .. import random as hrandom
from ..axis import Axis, AxisSelector
from ..core import NamedArray
from ..jax_utils import named_call
from ..partitioning import auto_sharded
from ..util import ensure_tuple

__all__ = ["Conv", "ConvTranspose"]

PaddingSpec = str | int | Sequence[int] | Sequence[tuple[int, int]]


def _names(Spatial: AxisSelector | Sequence[AxisSelector]) -> tuple[str, ...]:
    return tuple(a.name if isinstance(a, Axis) else a for a in ensure_tuple(Spatial))  # type: ignore[arg-type]


def _tuple(value: int | Sequence[int], n: int, what: str) -> tuple[int, ...]:
    if isinstance(value, int):
        return (value,) * n
    out = tuple(int(v) for v in value)
    if len(out) != n:
        raise ValueError(f"{what} has {len(out)} entries but there are {n} spatial axes")
    return out


def _padding(padding: PaddingSpec, n: int, allow_str: bool) -> str | tuple[tuple[int, int], ...]:
    if isinstance(padding, str):
        if not allow_str:
            raise ValueError(f"padding {padding!r}: only integer padding is supported here")
        if padding.upper() not in ("SAME", "VALID", "SAME_LOWER"):
            raise ValueError(f"padding must be 'SAME', 'VALID' or integers, got {padding!r}")
        return padding.upper()
    if isinstance(padding, int):
        return ((padding, padding),) * n
    items: list[Any] = list(padding)
    if len(items) != n:
        raise ValueError(f"padding has {len(items)} entries but there are {n} spatial axes")
    return tuple((p, p) if isinstance(p, int) else (int(p[0]), int(p[1])) for p in items)


def _init_weights(
    Spatial: tuple[str, ...], In: Axis, Out: Axis, kernel: tuple[int, ...], groups: int, use_bias: bool, key: jax.Array
) -> tuple[NamedArray, NamedArray | None]:
    if In.size % groups or Out.size % groups:
        raise ValueError(f"In ({In.size}) and Out ({Out.size}) must be divisible by groups ({groups})")
    if In.name in Spatial or Out.name in Spatial or In.name == Out.name:
        raise ValueError(f"In {In.name!r}, Out {Out.name!r} and the spatial axes {Spatial} must have distinct names")
    per_group = In.size // groups
    lim = 1.0 / math.sqrt(per_group * math.prod(kernel))
    wkey, bkey = jax.random.split(key)
    axes = (Out, In.resize(per_group), *(Axis(n, k) for n, k in zip(Spatial, kernel, strict=True)))
    weight = hrandom.uniform(wkey, axes, minval=-lim, maxval=lim)
    bias = hrandom.uniform(bkey, (Out,), minval=-lim, maxval=lim) if use_bias else None
    return weight, bias


class _ConvBase(eqx.Module):
    weight: NamedArray
    bias: NamedArray | None
    Spatial: tuple[str, ...] = eqx.field(static=True)
    In: Axis = eqx.field(static=True)
    Out: Axis = eqx.field(static=True)
    kernel_size: tuple[int, ...] = eqx.field(static=True)
    stride: tuple[int, ...] = eqx.field(static=True)
    padding: Any = eqx.field(static=True)
    dilation: tuple[int, ...] = eqx.field(static=True)
    groups: int = eqx.field(static=True)

    def _to_positional(self, inputs: NamedArray) -> tuple[jax.Array, tuple[Axis, ...]]:
        """``(batch, In, *Spatial)`` layout (batch axes flattened into one) and the batch axes."""
        for n in (self.In.name, *self.Spatial):
            if not inputs.has_axis(n):
                raise ValueError(
                    f"{type(self).__name__}: axis {n!r} is not in the input, whose axes are {inputs.axis_names}"
                )
        if inputs.axis_size(self.In.name) != self.In.size:
            raise ValueError(
                f"{type(self).__name__}: input axis {self.In.name!r} has size {inputs.axis_size(self.In.name)}, "
                f"expected {self.In.size}"
            )
        own = (self.In.name, *self.Spatial)
        batch = tuple(ax for ax in inputs.axes if ax.name not in own)
        order = [inputs._index_of(ax.name) for ax in batch] + [inputs._index_of(n) for n in own]
        x = jnp.transpose(inputs.array, order)
        x = x.reshape((math.prod(ax.size for ax in batch), *x.shape[len(batch) :]))
        return x, batch

    def _positional_weight(self) -> jax.Array:
        """The kernel with its spatial axes moved after its two channel axes, as ``lax`` convolutions take it."""
        n = len(self.Spatial)
        return jnp.moveaxis(self.weight.array, [self.weight._index_of(s) for s in self.Spatial], range(2, 2 + n))

    def _from_positional(self, y: jax.Array, batch: tuple[Axis, ...]) -> NamedArray:
        y = y.reshape((*(ax.size for ax in batch), *y.shape[1:]))
        spatial = tuple(Axis(n, s) for n, s in zip(self.Spatial, y.shape[len(batch) + 1 :], strict=True))
        out = NamedArray(y, (*batch, self.Out, *spatial))
        if self.bias is not None:
            out = out + self.bias
        return auto_sharded(out)


class Conv(_ConvBase):
    """An N-dimensional convolution (cross-correlation) over the named ``Spatial`` axes.

    The input has the ``In`` axis, the spatial axes and any batch axes; the output has the batch
    axes, then ``Out``, then the spatial axes (resized). The weight has axes
    ``(Out, In/groups, *kernel)``, the kernel axes named like the spatial axes.

    Example:
        >>> import jax
        >>> import ponente.namedtensor as hax
        >>> C, D = hax.Axis("c", 3), hax.Axis("d", 4)
        >>> conv = Conv.init(("h", "w"), C, D, kernel_size=3, padding=1, key=jax.random.key(0))
        >>> conv(hax.ones({"b": 2, "c": 3, "h": 5, "w": 5})).shape
        {'b': 2, 'd': 4, 'h': 5, 'w': 5}
    """

    @staticmethod
    def init(
        Spatial: AxisSelector | Sequence[AxisSelector],
        In: Axis,
        Out: Axis,
        kernel_size: int | Sequence[int],
        *,
        stride: int | Sequence[int] = 1,
        padding: PaddingSpec = 0,
        dilation: int | Sequence[int] = 1,
        groups: int = 1,
        use_bias: bool = True,
        key: jax.Array,
    ) -> Conv:
        """Creates the layer; weight and bias uniform in ``±1/sqrt(fan_in)`` (PyTorch's default).

        Args:
            Spatial: the spatial axes (names or axes) the kernel slides over.
            In: the input channel axis.
            Out: the output channel axis.
            kernel_size: per spatial axis (an int for all).
            stride: per spatial axis.
            padding: ``"SAME"``, ``"VALID"``, an int, one int per axis, or ``(low, high)`` per axis.
            dilation: kernel dilation per spatial axis.
            groups: number of channel groups (``In`` and ``Out`` must be divisible by it).
            use_bias: whether to add a bias over ``Out``.
            key: the PRNG key.

        Returns:
            The layer.

        Raises:
            ValueError: on inconsistent sizes or names.
        """
        names = _names(Spatial)
        n = len(names)
        kernel = _tuple(kernel_size, n, "kernel_size")
        weight, bias = _init_weights(names, In, Out, kernel, groups, use_bias, key)
        return Conv(
            weight,
            bias,
            names,
            In,
            Out,
            kernel,
            _tuple(stride, n, "stride"),
            _padding(padding, n, allow_str=True),
            _tuple(dilation, n, "dilation"),
            groups,
        )

    @named_call
    def __call__(self, inputs: NamedArray, *, key: jax.Array | None = None) -> NamedArray:
        """Applies the convolution.

        Args:
            inputs: with the ``In`` axis, the spatial axes and any batch axes.
            key: unused.

        Returns:
            Batch axes, ``Out``, then the (resized) spatial axes.

        Raises:
            ValueError: if an axis is missing or ``In`` has the wrong size.
        """
        del key
        x, batch = self._to_positional(inputs)
        w = self._positional_weight()
        y = jax.lax.conv_general_dilated(
            x,
            w.astype(x.dtype),
            window_strides=self.stride,
            padding=self.padding,
            rhs_dilation=self.dilation,
            feature_group_count=self.groups,
        )
        return self._from_positional(y, batch)


class ConvTranspose(_ConvBase):
    """The transposed convolution (the adjoint of :class:`Conv`'s input map, "deconvolution").

    Input position ``i`` scatters ``x[c, i] * weight[o, c, k]`` to output position
    ``i * stride + (kernel - 1 - k) * dilation - padding_low``: the kernel is used as stored, not flipped
    (the convention of Equinox and Haliax, so weights carry over; :class:`Conv`'s adjoint is this layer
    with the kernel flipped). Output size per axis:
    ``(n - 1) * stride - padding_low - padding_high + dilation * (kernel - 1) + 1 + output_padding``.

    Attributes:
        output_padding: extra size added on the high side of each spatial axis (static).

    Example:
        >>> import jax
        >>> import ponente.namedtensor as hax
        >>> C, D = hax.Axis("c", 2), hax.Axis("d", 3)
        >>> up = ConvTranspose.init("t", C, D, kernel_size=2, stride=2, key=jax.random.key(0))
        >>> up(hax.ones({"c": 2, "t": 4})).shape
        {'d': 3, 't': 8}
    """

    output_padding: tuple[int, ...] = eqx.field(static=True, default=())

    @staticmethod
    def init(
        Spatial: AxisSelector | Sequence[AxisSelector],
        In: Axis,
        Out: Axis,
        kernel_size: int | Sequence[int],
        *,
        stride: int | Sequence[int] = 1,
        padding: int | Sequence[int] | Sequence[tuple[int, int]] = 0,
        output_padding: int | Sequence[int] = 0,
        dilation: int | Sequence[int] = 1,
        groups: int = 1,
        use_bias: bool = True,
        key: jax.Array,
    ) -> ConvTranspose:
        """Creates the layer; weight and bias uniform in ``±1/sqrt(fan_in)``.

        Args:
            Spatial: the spatial axes.
            In: the input channel axis.
            Out: the output channel axis.
            kernel_size: per spatial axis.
            stride: per spatial axis (the upsampling factor).
            padding: integer padding removed from the output, per side.
            output_padding: extra output size on the high side (must be smaller than stride or dilation).
            dilation: kernel dilation.
            groups: channel groups.
            use_bias: whether to add a bias over ``Out``.
            key: the PRNG key.

        Returns:
            The layer.

        Raises:
            ValueError: on inconsistent sizes or names, or string padding.
        """
        names = _names(Spatial)
        n = len(names)
        kernel = _tuple(kernel_size, n, "kernel_size")
        st, dil, op = (
            _tuple(stride, n, "stride"),
            _tuple(dilation, n, "dilation"),
            _tuple(output_padding, n, "output_padding"),
        )
        for s, d, o in zip(st, dil, op, strict=True):
            if o >= max(s, d):
                raise ValueError(f"output_padding {o} must be smaller than stride {s} or dilation {d}")
        weight, bias = _init_weights(names, In, Out, kernel, groups, use_bias, key)
        pad = _padding(padding, n, allow_str=False)
        return ConvTranspose(weight, bias, names, In, Out, kernel, st, pad, dil, groups, op)

    @named_call
    def __call__(self, inputs: NamedArray, *, key: jax.Array | None = None) -> NamedArray:
        """Applies the transposed convolution.

        Args:
            inputs: with the ``In`` axis, the spatial axes and any batch axes.
            key: unused.

        Returns:
            Batch axes, ``Out``, then the (upsampled) spatial axes.

        Raises:
            ValueError: if an axis is missing or ``In`` has the wrong size.
        """
        del key
        x, batch = self._to_positional(inputs)
        n = len(self.Spatial)
        w = self._positional_weight()
        pads = tuple(
            (d * (k - 1) - lo, d * (k - 1) - hi + o)
            for k, (lo, hi), o, d in zip(
                self.kernel_size, self.padding, self.output_padding, self.dilation, strict=True
            )
        )
        y = jax.lax.conv_general_dilated(
            x,
            w.astype(x.dtype),
            window_strides=(1,) * n,
            padding=pads,
            lhs_dilation=self.stride,
            rhs_dilation=self.dilation,
            feature_group_count=self.groups,
        )
        return self._from_positional(y, batch)
