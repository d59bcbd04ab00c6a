"""``Linear``: an affine map between (possibly multi-axis) named input and output axes."""

from __future__ import annotations

import math
from typing import Any

import equinox as eqx
import jax

from .. import random as hrandom
from ..axis import Axis, AxisSpec, axis_name, axis_size
from ..core import NamedArray
from ..creation import zeros
from ..jax_utils import named_call
from ..partitioning import auto_sharded
from ..quantization import DefaultDotGeneralOp, DotGeneralOp
from ..util import ensure_tuple

__all__ = ["Linear"]


def _axes(spec: AxisSpec) -> tuple[Axis, ...]:
    if isinstance(spec, dict):
        return tuple(Axis(k, v) for k, v in spec.items())
    return tuple(ensure_tuple(spec))  # type: ignore[arg-type]


def _contract(inputs: NamedArray, weight: NamedArray, In: AxisSpec, dot_general: Any) -> NamedArray:
    """``inputs · weight`` over ``In`` through ``dot_general``; result axes: inputs' rest, then weight's rest."""
    in_names = axis_name(_axes(In))
    for name in in_names:
        if not inputs.has_axis(name):
            raise ValueError(
                f"Linear: input axis {name!r} is missing from the input, whose axes are {inputs.axis_names}"
            )
        if inputs.axis_size(name) != weight.axis_size(name):
            raise ValueError(
                f"Linear: input axis {name!r} has size {inputs.axis_size(name)} but the layer expects "
                f"{weight.axis_size(name)}"
            )
    free_w = tuple(ax for ax in weight.axes if ax.name not in in_names)
    clash = [ax.name for ax in free_w if inputs.has_axis(ax.name)]
    if clash:
        raise ValueError(f"Linear: the input already has the output axes {clash}; rename them before the layer")
    lhs_c = tuple(inputs._index_of(n) for n in in_names)
    rhs_c = tuple(weight._index_of(n) for n in in_names)
    out = dot_general(inputs.array, weight.array, ((lhs_c, rhs_c), ((), ())))
    free_x = tuple(ax for ax in inputs.axes if ax.name not in in_names)
    return NamedArray(out, free_x + free_w)


class Linear(eqx.Module):
    """An affine map ``y = x · W + b`` contracting the input axes ``In`` and producing the axes ``Out``.

    Both ``In`` and ``Out`` may be several axes (e.g. ``Out = (Heads, HeadSize)``); other axes of the
    input (batch, position...) pass through. The product goes through ``dot_general`` (a
    ``jax.lax.dot_general``-compatible callable), which is how quantization plugs in.

    Attributes:
        weight: the weight, axes ``Out + In`` (``out_first``, the default) or ``In + Out``.
        bias: the bias over ``Out``, or None.
        In: the input axes (static).
        Out: the output axes (static).
        dot_general: the contraction operator (default :class:`ponente.namedtensor.quantization.DefaultDotGeneralOp`).

    Example:
        >>> import jax
        >>> import ponente.namedtensor as hax
        >>> Embed, Heads, Head = hax.make_axes(embed=8, heads=2, head=4)
        >>> layer = Linear.init(Embed, (Heads, Head), key=jax.random.key(0))
        >>> layer(hax.ones({"pos": 3, "embed": 8})).shape
        {'pos': 3, 'heads': 2, 'head': 4}
    """

    weight: NamedArray
    bias: NamedArray | None
    In: AxisSpec = eqx.field(static=True)
    Out: AxisSpec = eqx.field(static=True)
    dot_general: DotGeneralOp = eqx.field(default_factory=DefaultDotGeneralOp)

    @staticmethod
    def init(
        In: AxisSpec,
        Out: AxisSpec,
        *,
        key: jax.Array,
        use_bias: bool = True,
        out_first: bool = True,
        dot_general: DotGeneralOp | None = None,
        init_scale: float = 1.0,
    ) -> Linear:
        """Creates a layer with weights drawn from a truncated normal (±3σ) scaled by ``init_scale / sqrt(fan_in)``.

        Args:
            In: the input axes (contracted).
            Out: the output axes (produced).
            key: the PRNG key for the weights.
            use_bias: whether to add a (zero-initialized) bias over ``Out``.
            out_first: store the weight as ``Out + In`` (True, PyTorch's layout) or ``In + Out``.
            dot_general: the contraction operator; None for plain ``jax.lax.dot_general``.
            init_scale: multiplies the standard deviation ``1 / sqrt(axis_size(In))``.

        Returns:
            The layer.

        Raises:
            ValueError: if ``In`` and ``Out`` share an axis name.
        """
        ins, outs = _axes(In), _axes(Out)
        shared = set(axis_name(ins)) & set(axis_name(outs))
        if shared:
            raise ValueError(f"Linear.init: In and Out share the axis names {sorted(shared)}; rename one side")
        joint = outs + ins if out_first else ins + outs
        std = init_scale / math.sqrt(axis_size(ins))
        weight = hrandom.truncated_normal(key, joint, -3.0, 3.0) * std
        bias = zeros(outs) if use_bias else None
        return Linear(weight, bias, In, Out, dot_general if dot_general is not None else DefaultDotGeneralOp())

    @named_call
    def __call__(self, inputs: NamedArray, *, key: jax.Array | None = None) -> NamedArray:
        """Applies the layer.

        Args:
            inputs: a NamedArray with the ``In`` axes (and any others, which pass through).
            key: unused; accepted for a uniform layer interface.

        Returns:
            The output: the input's other axes followed by ``Out``.

        Raises:
            ValueError: if an ``In`` axis is missing or has the wrong size.
        """
        del key
        # shard the activations by the current axis mapping (a no-op without one), as Haliax does
        out = auto_sharded(_contract(inputs, self.weight, self.In, self.dot_general))
        if self.bias is not None:
            out = auto_sharded(out + self.bias)
        return out

    @property
    def out_first(self) -> bool:
        """Whether the weight is stored ``Out + In`` (True) or ``In + Out``."""
        outs, ins = axis_name(_axes(self.Out)), axis_name(_axes(self.In))
        first = next(ax.name for ax in self.weight.axes if ax.name in outs or ax.name in ins)
        return first in outs
