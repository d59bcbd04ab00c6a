"""``Linear``: an affine map between (possibly multi-axis) named input and output axes."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import equinox as eqx
import jax

from .. import random as hrandom
from ..axis import Axis, AxisSpec, axis_name, axis_size
from ..core import NamedArray
from ..creation import zeros
from ..dot_general import DefaultDotGeneralOp, DotGeneralOp
from ..jax_utils import named_call
from ..partitioning import auto_sharded
from ..state_dict import ModuleWithStateDictSerialization, StateDict
from ..util import ensure_tuple
from .mup import (
    AbstractLinearReparam,
    HiddenLinearMup,
    InputLinearMup,
    LinearStandardParam,
    OutputLinearMup,
    ReparamEnabled,
)

__all__ = ["Linear"]

# names of the merged output and input axes in PyTorch exports
_FLAT_OUT = "__OUT__"
_FLAT_IN = "__IN__"


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


class Linear(ModuleWithStateDictSerialization, ReparamEnabled):
    """An affine map ``y = x · W + b`` contracting the input axes ``In`` and producing the axes ``Out``.

    Both ``In`` and ``Out`` may be several axes (e.g. ``Out = (Heads, HeadSize)``); other axes of the
    input (batch, position...) pass through. The product goes through ``dot_general`` (a
    ``jax.lax.dot_general``-compatible callable), which is how quantization plugs in. The
    parameterization (:mod:`ponente.namedtensor.nn.mup`) sets the initial scale and a constant the
    weight is multiplied by in the forward pass (μP's output layer); state dicts hold that effective weight.

    Attributes:
        weight: the weight, axes ``Out + In`` (``out_first``, the default) or ``In + Out``.
        bias: the bias over ``Out``, or None.
        In: the input axes (static).
        Out: the output axes (static).
        dot_general: the contraction operator (default :class:`ponente.namedtensor.quantization.DefaultDotGeneralOp`).
        _reparam_cls: the parameterization class (static; default
            :class:`~ponente.namedtensor.nn.mup.LinearStandardParam`).

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
    _reparam_cls: type[AbstractLinearReparam] = eqx.field(static=True, default=LinearStandardParam)

    @property
    def reparam(self) -> AbstractLinearReparam:
        """The parameterization for this layer's axes (its ``active_scale``, ``lr_scale``...)."""
        return self._reparam_cls(self.In, self.Out)

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
        reparam_cls: type[AbstractLinearReparam] = LinearStandardParam,
    ) -> Linear:
        """Creates a layer with weights from a truncated normal (±3σ) with σ = ``init_scale * reparam_cls.init_scale``.

        With the standard parameterization σ is ``init_scale / sqrt(fan_in)``.

        Args:
            In: the input axes (contracted).
            Out: the output axes (produced).
            key: the PRNG key for the weights.
            use_bias: whether to add a (zero-initialized) bias over ``Out``.
            out_first: store the weight as ``Out + In`` (True, PyTorch's layout) or ``In + Out``.
            dot_general: the contraction operator; None for plain ``jax.lax.dot_general``.
            init_scale: multiplies the parameterization's standard deviation.
            reparam_cls: the parameterization, e.g. :class:`~ponente.namedtensor.nn.mup.HiddenLinearMup`.

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
        std = init_scale * reparam_cls.init_scale(In, Out)
        weight = hrandom.truncated_normal(key, joint, -3.0, 3.0) * std
        bias = zeros(outs) if use_bias else None
        op = dot_general if dot_general is not None else DefaultDotGeneralOp()
        return Linear(weight, bias, In, Out, op, _reparam_cls=reparam_cls)

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
        out = auto_sharded(_contract(inputs, self._effective_weight(), self.In, self.dot_general))
        if self.bias is not None:
            out = auto_sharded(out + self.bias)
        return out

    def flatten_for_export(self) -> Linear:
        """This layer with ``Out`` merged into one axis ``__OUT__`` and ``In`` into ``__IN__`` (PyTorch's layout).

        The weight keeps its order (``(__OUT__, __IN__)`` when ``out_first``); single-axis ``In`` and ``Out`` are
        left as they are.

        Returns:
            The flattened layer (only for export: it does not accept the original inputs).

        Example:
            >>> import jax, ponente.namedtensor as hax
            >>> layer = Linear.init(hax.Axis("embed", 4), {"heads": 2, "head": 3}, key=jax.random.key(0))
            >>> layer.flatten_for_export().weight.shape
            {'__OUT__': 6, '__IN__': 4}
        """
        if isinstance(self.In, Axis) and isinstance(self.Out, Axis):
            return self
        outs, ins = _axes(self.Out), _axes(self.In)
        Out, In = Axis(_FLAT_OUT, axis_size(outs)), Axis(_FLAT_IN, axis_size(ins))
        weight = self.weight
        if weight is not None:
            order = (Out.name, In.name) if self.out_first else (In.name, Out.name)
            weight = weight.flatten_axes(outs, Out).flatten_axes(ins, In).rearrange((..., *order))
        bias = None if self.bias is None else self.bias.flatten_axes(outs, Out)
        return dataclasses.replace(self, weight=weight, bias=bias, In=In, Out=Out)

    def unflatten_from_export(self, template: Linear) -> Linear:
        """Inverse of :meth:`flatten_for_export`: this layer's values with ``template``'s axes.

        Args:
            template: a layer with the original ``In``/``Out`` and weight layout (its values are ignored).

        Returns:
            The layer in ``template``'s layout.
        """
        if (self.In, self.Out) == (template.In, template.Out):
            return self
        outs, ins = _axes(template.Out), _axes(template.In)
        weight = self.weight
        if weight is not None:
            weight = weight.unflatten_axis(_FLAT_OUT, outs).unflatten_axis(_FLAT_IN, ins)
            if template.weight is not None:
                weight = weight.rearrange(template.weight.axes)
        bias = self.bias
        if bias is not None:
            bias = bias.unflatten_axis(_FLAT_OUT, outs)
            if template.bias is not None:
                bias = bias.rearrange(template.bias.axes)
        return dataclasses.replace(self, weight=weight, bias=bias, In=template.In, Out=template.Out)

    @property
    def out_first(self) -> bool:
        """Whether the weight is stored ``Out + In`` (True) or ``In + Out``."""
        outs, ins = axis_name(_axes(self.Out)), axis_name(_axes(self.In))
        first = next(ax.name for ax in self.weight.axes if ax.name in outs or ax.name in ins)
        return first in outs

    def _effective_weight(self) -> NamedArray:
        scale = self.reparam.active_scale
        return self.weight if scale == 1 else self.weight * scale

    def to_state_dict(self, prefix: str | None = None) -> StateDict:
        """The layer's arrays under ``prefix``, with the effective weight (``weight * reparam.active_scale``).

        Example:
            >>> import jax
            >>> import ponente.namedtensor as hax
            >>> layer = Linear.init(hax.Axis("in", 2), hax.Axis("out", 3), key=jax.random.key(0))
            >>> sorted(layer.to_state_dict("proj"))
            ['proj.bias', 'proj.weight']
        """
        if self.weight is None or self.reparam.active_scale == 1:
            return super().to_state_dict(prefix)
        return super(Linear, dataclasses.replace(self, weight=self._effective_weight())).to_state_dict(prefix)

    def from_state_dict(self, state_dict: Mapping[str, Any], prefix: str | None = None) -> Linear:
        """A copy with the arrays of ``state_dict`` under ``prefix``; the weight is divided by ``active_scale``."""
        loaded = super().from_state_dict(state_dict, prefix)
        scale = self.reparam.active_scale
        if loaded.weight is None or scale == 1:
            return loaded
        return dataclasses.replace(loaded, weight=loaded.weight / scale)

    @staticmethod
    def input_reparam(use_mup: bool = True) -> type[AbstractLinearReparam]:
        """The parameterization for an input layer: :class:`InputLinearMup`, or the standard one."""
        return InputLinearMup if use_mup else LinearStandardParam

    @staticmethod
    def hidden_reparam(use_mup: bool = True) -> type[AbstractLinearReparam]:
        """The parameterization for a hidden layer: :class:`HiddenLinearMup`, or the standard one."""
        return HiddenLinearMup if use_mup else LinearStandardParam

    @staticmethod
    def output_reparam(use_mup: bool = True) -> type[AbstractLinearReparam]:
        """The parameterization for an output (readout) layer: :class:`OutputLinearMup`, or the standard one."""
        return OutputLinearMup if use_mup else LinearStandardParam
