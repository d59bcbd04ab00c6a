"""FP8 quantized matrix products with delayed scaling, plugged into :class:`~ponente.namedtensor.nn.Linear`.

A quantized ``Linear`` casts its input and kernel to ``float8_e4m3fn`` (and, in the backward pass, the
output gradient to ``float8_e5m2``) with per-tensor scales derived from a history of absolute maxima
("delayed scaling"). The scales and histories are not trained: the gradient with respect to them *is*
their new value. :func:`partition_for_grad_overwrite` separates those overwrites from the real
gradients, and :func:`apply_updates` applies the optimizer's updates and the overwrites together.

Example:
    ```python
    config = QuantizationConfig(targets=["up_proj"], fp8=True)
    model = quantize_linear_layers(model, config)
    grads = eqx.filter_grad(loss_fn)(model, batch)
    overwrites, grads = partition_for_grad_overwrite(grads)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    model = apply_updates(model, updates, overwrites)
    ```
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Sequence
from typing import Any, Protocol, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp

from .axis import Axis
from .core import NamedArray

__all__ = [
    "AMAX_HISTORY",
    "DefaultDotGeneralOp",
    "DotGeneralOp",
    "Fp8DotGeneralOp",
    "OverwriteWithGradient",
    "QuantizationConfig",
    "apply_updates",
    "partition_for_grad_overwrite",
    "quantize_linear_layers",
]

T = TypeVar("T")

AMAX_HISTORY = "amax_history"
"""Name of the history axis of the FP8 state."""


class DotGeneralOp(Protocol):
    """Anything callable like ``jax.lax.dot_general`` (the hook :class:`~ponente.namedtensor.nn.Linear` calls)."""

    def __call__(
        self,
        lhs: jax.Array,
        rhs: jax.Array,
        dimension_numbers: Any,
        precision: Any = None,
        preferred_element_type: Any = None,
    ) -> jax.Array:
        """Contracts ``lhs`` and ``rhs`` as ``jax.lax.dot_general`` does."""
        ...


class DefaultDotGeneralOp(eqx.Module):
    """The unquantized contraction: plain ``jax.lax.dot_general``."""

    def __call__(
        self,
        lhs: jax.Array,
        rhs: jax.Array,
        dimension_numbers: Any,
        precision: Any = None,
        preferred_element_type: Any = None,
    ) -> jax.Array:
        """Calls ``jax.lax.dot_general`` with the same arguments."""
        return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type)


class OverwriteWithGradient(eqx.Module):
    """Marker base class: the gradient of every array in such a module is its new value, not a gradient."""


def _fp8_max(dtype: Any) -> float:
    return float(jnp.finfo(dtype).max)


def _quantize_dequantize(x: jax.Array, q_dtype: Any, scale: jax.Array, compute_dtype: Any) -> jax.Array:
    """Rounds ``x / scale`` to ``q_dtype`` (saturating) and scales back, in ``x``'s dtype."""
    cd = x.dtype if compute_dtype is None else compute_dtype
    limit = _fp8_max(q_dtype)
    q = jnp.clip(x.astype(cd) / scale.astype(cd), -limit, limit).astype(q_dtype)
    return q.astype(x.dtype) * scale.astype(x.dtype)


def _delayed_scaling(
    x: jax.Array, q_dtype: Any, scale: jax.Array, history: jax.Array, compute_dtype: Any
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Quantizes with the scale derived from the amax history; returns ``(qdq(x), new_scale, new_history)``."""
    amax = jnp.max(history)
    candidate = (amax / _fp8_max(q_dtype)).astype(scale.dtype)
    new_scale = jnp.where((amax > 0) & jnp.isfinite(amax), candidate, scale)
    qx = _quantize_dequantize(x, q_dtype, new_scale, compute_dtype)
    current = jnp.max(jnp.abs(x)).astype(history.dtype)
    new_history = jnp.concatenate([current[None], history[:-1]])
    return qx, new_scale, new_history


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _in_qdq(compute_dtype: Any, x: jax.Array, scale: jax.Array, history: jax.Array) -> jax.Array:
    return _delayed_scaling(x, jnp.float8_e4m3fn, scale, history, compute_dtype)[0]


def _in_qdq_fwd(
    compute_dtype: Any, x: jax.Array, scale: jax.Array, history: jax.Array
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    qx, new_scale, new_history = _delayed_scaling(x, jnp.float8_e4m3fn, scale, history, compute_dtype)
    return qx, (new_scale, new_history)


def _in_qdq_bwd(compute_dtype: Any, res: tuple[jax.Array, jax.Array], g: jax.Array) -> tuple[Any, ...]:
    # straight-through for x; the "gradients" of the state are its new values (overwritten, not optimized)
    new_scale, new_history = res
    return g, new_scale, new_history


_in_qdq.defvjp(_in_qdq_fwd, _in_qdq_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _out_qdq(compute_dtype: Any, y: jax.Array, scale: jax.Array, history: jax.Array) -> jax.Array:
    return y


def _out_qdq_fwd(
    compute_dtype: Any, y: jax.Array, scale: jax.Array, history: jax.Array
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    return y, (scale, history)


def _out_qdq_bwd(compute_dtype: Any, res: tuple[jax.Array, jax.Array], g: jax.Array) -> tuple[Any, ...]:
    scale, history = res
    qg, new_scale, new_history = _delayed_scaling(g, jnp.float8_e5m2, scale, history, compute_dtype)
    return qg, new_scale, new_history


_out_qdq.defvjp(_out_qdq_fwd, _out_qdq_bwd)


class Fp8DotGeneralOp(OverwriteWithGradient):
    """A ``dot_general`` that computes in FP8 with delayed per-tensor scaling.

    Inputs and kernel are quantized to ``float8_e4m3fn``; the output gradient to ``float8_e5m2`` in
    the backward pass. Each tensor's scale is ``max(amax history) / fp8_max``; the history records the
    absolute maximum of the tensor at every call (newest first).

    Because the new state travels as a gradient, call each quantized layer once per gradient
    computation and not under ``vmap`` over the batch (cotangents of shared state are summed: a
    layer used twice would get the sum of two new states). Batch axes of the input are fine: the
    layer contracts them through ``dot_general`` in one call.

    The state is held in NamedArrays: scales have no axes and histories the axis ``amax_history``,
    both preceded by ``batch_axes`` for a stacked layer (e.g. ``layers``), so that scanning a
    ``Stacked`` block over its layers axis gives every layer its own state.

    Attributes:
        input_scale: scale of the left operand.
        output_grad_scale: scale of the output gradient.
        kernel_scale: scale of the right operand (the weight).
        input_amax_history: absolute maxima of past inputs, newest first.
        output_grad_amax_history: absolute maxima of past output gradients.
        kernel_amax_history: absolute maxima of past kernels.
        compute_dtype: dtype in which the scaling division is done (None: the operand's dtype).
    """

    input_scale: NamedArray
    output_grad_scale: NamedArray
    kernel_scale: NamedArray
    input_amax_history: NamedArray
    output_grad_amax_history: NamedArray
    kernel_amax_history: NamedArray
    compute_dtype: Any = eqx.field(static=True, default=None)

    @classmethod
    def init(
        cls, amax_history_length: int = 1024, compute_dtype: Any = None, batch_axes: tuple[Axis, ...] = ()
    ) -> Fp8DotGeneralOp:
        """Fresh state: scales 1, histories of zeros.

        Args:
            amax_history_length: how many past absolute maxima each scale looks at.
            compute_dtype: dtype for the scaling arithmetic (None: the operand's dtype).
            batch_axes: leading axes of a stacked layer (one independent state per entry).

        Returns:
            The operator.

        Raises:
            ValueError: if ``amax_history_length`` is less than 1.
        """
        if amax_history_length < 1:
            raise ValueError(f"amax_history_length must be at least 1, got {amax_history_length}")
        lead = tuple(ax.size for ax in batch_axes)
        one = NamedArray(jnp.ones(lead, jnp.float32), tuple(batch_axes))
        hist_axes = (*batch_axes, Axis(AMAX_HISTORY, amax_history_length))
        hist = NamedArray(jnp.zeros((*lead, amax_history_length), jnp.float32), hist_axes)
        return cls(one, one, one, hist, hist, hist, compute_dtype)

    def __call__(
        self,
        lhs: jax.Array,
        rhs: jax.Array,
        dimension_numbers: Any,
        precision: Any = None,
        preferred_element_type: Any = None,
    ) -> jax.Array:
        """Quantize-dequantize both operands, contract, and quantize the output gradient on the way back.

        Raises:
            ValueError: if the state still has stacked axes (call the layer inside a scan over them).
        """
        if self.input_scale.ndim != 0:
            raise ValueError(
                f"Fp8DotGeneralOp: the FP8 state has the stacked axes {self.input_scale.axis_names}; apply the "
                "layer per layer (e.g. through Stacked.fold or hax.fold over that axis)"
            )
        x = _in_qdq(self.compute_dtype, lhs, self.input_scale.array, self.input_amax_history.array)
        k = _in_qdq(self.compute_dtype, rhs, self.kernel_scale.array, self.kernel_amax_history.array)
        y = jax.lax.dot_general(x, k, dimension_numbers, precision, preferred_element_type)
        return _out_qdq(self.compute_dtype, y, self.output_grad_scale.array, self.output_grad_amax_history.array)


@dataclasses.dataclass(frozen=True)
class QuantizationConfig:
    """Which ``Linear`` layers to quantize, and how.

    Attributes:
        targets: which layers: None for all; a list of names, each matched exactly against the layer's
            attribute name (the last part of its path, e.g. ``"up_proj"``) or its whole dotted path
            (``"layers.0.mlp.up_proj"``); or a regular expression matched (``re.match``) against either.
        amax_history_length: length of the absolute-maximum history behind each scale.
        compute_dtype: dtype of the scaling arithmetic (None: the operand's dtype).
        fp8: whether to quantize to FP8 (the only scheme implemented).
    """

    targets: Sequence[str] | str | None = None
    amax_history_length: int = 1024
    compute_dtype: Any = None
    fp8: bool = False


def _path_str(path: Sequence[Any]) -> list[str]:
    parts = []
    for k in path:
        if isinstance(k, jax.tree_util.GetAttrKey):
            parts.append(k.name)
        elif isinstance(k, jax.tree_util.SequenceKey):
            parts.append(str(k.idx))
        elif isinstance(k, jax.tree_util.DictKey):
            parts.append(str(k.key))
        else:
            parts.append(str(k))
    return parts


def _matches(parts: list[str], targets: Sequence[str] | str | None) -> bool:
    if targets is None:
        return True
    full = ".".join(parts)
    last = parts[-1] if parts else ""
    if isinstance(targets, str):
        return re.match(targets, last) is not None or re.match(targets, full) is not None
    return last in targets or full in targets


def quantize_linear_layers(tree: T, config: QuantizationConfig) -> T:
    """Replaces the ``dot_general`` of the selected ``Linear`` layers in ``tree`` by an :class:`Fp8DotGeneralOp`.

    Args:
        tree: a module or any pytree containing :class:`~ponente.namedtensor.nn.Linear` layers.
        config: which layers and how; ``config.fp8`` must be True.

    Returns:
        The tree with the selected layers quantized (others unchanged).

    Raises:
        ValueError: if ``config.fp8`` is False.

    A layer whose weight has axes beyond ``In`` and ``Out`` (a layer of a ``Stacked`` block, whose
    weight carries the layers axis) gets one FP8 state per entry of those axes.
    """
    from .axis import axis_name
    from .nn.linear import Linear, _axes

    if not config.fp8:
        raise ValueError("QuantizationConfig: no quantization scheme selected; set fp8=True")

    def visit(path: Sequence[Any], node: Any) -> Any:
        if not isinstance(node, Linear):
            return node
        parts = _path_str(path)
        if not _matches(parts, config.targets):
            return node
        own = set(axis_name(_axes(node.In))) | set(axis_name(_axes(node.Out)))
        extra = tuple(ax for ax in node.weight.axes if ax.name not in own)
        op = Fp8DotGeneralOp.init(config.amax_history_length, config.compute_dtype, extra)
        return eqx.tree_at(lambda lin: lin.dot_general, node, op)

    return jax.tree_util.tree_map_with_path(visit, tree, is_leaf=lambda x: isinstance(x, Linear))


def _is_overwrite(x: Any) -> bool:
    return isinstance(x, OverwriteWithGradient)


def partition_for_grad_overwrite(grad: T) -> tuple[T, T]:
    """Splits a gradient tree into (overwrites, gradients).

    Args:
        grad: the gradient of a loss with respect to a model containing :class:`OverwriteWithGradient` modules.

    Returns:
        ``(overwrites, grads)``: the first holds the new values of the overwrite modules (None elsewhere),
        the second the ordinary gradients (None at the overwrite modules), ready for an optimizer.
    """
    overwrites, grads = eqx.partition(grad, _is_overwrite, is_leaf=_is_overwrite)
    return overwrites, grads


def apply_updates(tree: T, updates: Any, overwrites: Any) -> T:
    """Adds ``updates`` to ``tree`` (as ``eqx.apply_updates``) and then replaces the overwrite modules.

    Args:
        tree: the model.
        updates: additive updates (e.g. from an optax optimizer); None leaves are skipped.
        overwrites: the first result of :func:`partition_for_grad_overwrite`, or None.

    Returns:
        The updated model.
    """
    new = eqx.apply_updates(tree, updates)
    if overwrites is None:
        return new

    def pick(o: Any, t: Any) -> Any:
        return t if o is None else o

    return jax.tree_util.tree_map(pick, overwrites, new, is_leaf=lambda x: x is None or _is_overwrite(x))
