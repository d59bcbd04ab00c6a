"""The matrix products behind :class:`~ponente.namedtensor.nn.Linear`: the default one, FP8 (delayed scaling) and int8.

This module sits below ``nn`` (``Linear`` takes one of these as its ``dot_general``); choosing which layers to
quantize (:func:`~ponente.namedtensor.quantization.quantize_linear_layers`) lives in ``quantization``, above ``nn``.
Everything here is public through ``ponente.namedtensor.quantization``.

An FP8 ``Linear`` casts its input and kernel to ``float8_e4m3fn`` (and, in the backward pass, the
output gradient to ``float8_e5m2``) with per-tensor scales derived from a history of absolute maxima
("delayed scaling"). The scales and histories are not trained: the gradient with respect to them *is*
their new value. :func:`partition_for_grad_overwrite` separates those overwrites from the real
gradients, and :func:`apply_updates` applies the optimizer's updates and the overwrites together.
An int8 ``Linear`` (:class:`Int8DotGeneralOp`) has no state: it quantizes both operands at every call.
How to quantize a model and apply its updates: :mod:`ponente.namedtensor.quantization`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, Protocol, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp

from .axis import Axis

__all__ = [
    "FP8_SCALINGS",
    "DefaultDotGeneralOp",
    "DotGeneralOp",
    "Fp8DotGeneralOp",
    "Int8DotGeneralOp",
    "OverwriteWithGradient",
    "apply_updates",
    "compute_scale",
    "partition_for_grad_overwrite",
]

T = TypeVar("T")


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


# --- FP8 with delayed scaling ------------------------------------------------------------------------


def compute_scale(amax: jax.Array, scale: jax.Array, fp8_max: Any, margin: float = 0) -> jax.Array:
    """The per-tensor FP8 scale for values whose absolute maximum is ``amax``: ``amax / fp8_max * 2**margin``.

    A tensor is quantized as ``x / scale`` (so ``amax`` lands on the largest finite FP8 value, less the
    safety ``margin`` in powers of two). Where ``amax`` is zero or not finite, the old ``scale`` is kept.

    Args:
        amax: the absolute maximum (usually the maximum of an amax history).
        scale: the current scale, returned where ``amax`` gives no information.
        fp8_max: the largest finite value of the FP8 format (448 for ``float8_e4m3fn``).
        margin: extra headroom, in powers of two.

    Returns:
        The new scale (``scale``'s shape).

    Example:
        >>> import jax.numpy as jnp
        >>> compute_scale(jnp.float32(896.0), jnp.ones(1), 448.0).tolist()
        [2.0]
        >>> compute_scale(jnp.float32(0.0), jnp.full(1, 3.0), 448.0).tolist()
        [3.0]
    """
    candidate = (amax / fp8_max) * (2.0**margin)
    return jnp.where((amax > 0) & jnp.isfinite(amax), candidate, scale).astype(scale.dtype)


def _fp8_max(dtype: Any) -> float:
    return float(jnp.finfo(dtype).max)


def _quantize_dequantize(x: jax.Array, q_dtype: Any, scale: jax.Array, compute_dtype: Any) -> jax.Array:
    """Rounds ``x / scale`` to ``q_dtype`` (saturating) and scales back, in ``x``'s dtype."""
    cd = x.dtype if compute_dtype is None else compute_dtype
    limit = _fp8_max(q_dtype)
    q = jnp.clip(x.astype(cd) / scale.astype(cd), -limit, limit).astype(q_dtype)
    return q.astype(x.dtype) * scale.astype(x.dtype)


def _delayed_scaling(
    x: jax.Array, q_dtype: Any, scale: jax.Array, history: jax.Array, compute_dtype: Any, current_scaling: bool = False
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Quantizes with the scale derived from the amax history (``current_scaling``: from ``x``'s own absolute
    maximum); returns ``(qdq(x), new_scale, new_history)``."""
    current = jnp.max(jnp.abs(x)).astype(history.dtype)
    new_scale = compute_scale(current if current_scaling else jnp.max(history), scale, _fp8_max(q_dtype))
    qx = _quantize_dequantize(x, q_dtype, new_scale, compute_dtype)
    # slot 0 takes the newest maximum and the rest rotate, so the oldest one drops out (Flax's layout)
    new_history = jnp.roll(history, -1).at[0].set(current)
    return qx, new_scale, new_history


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _in_qdq(compute_dtype: Any, current: bool, x: jax.Array, scale: jax.Array, history: jax.Array) -> jax.Array:
    return _delayed_scaling(x, jnp.float8_e4m3fn, scale, history, compute_dtype, current)[0]


def _in_qdq_fwd(
    compute_dtype: Any, current: bool, x: jax.Array, scale: jax.Array, history: jax.Array
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    qx, new_scale, new_history = _delayed_scaling(x, jnp.float8_e4m3fn, scale, history, compute_dtype, current)
    return qx, (new_scale, new_history)


def _in_qdq_bwd(compute_dtype: Any, current: bool, res: tuple[jax.Array, jax.Array], g: jax.Array) -> tuple[Any, ...]:
    # straight-through for x; the "gradients" of the state are its new values (overwritten, not optimized)
    new_scale, new_history = res
    return g, new_scale, new_history


_in_qdq.defvjp(_in_qdq_fwd, _in_qdq_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _out_qdq(compute_dtype: Any, current: bool, y: jax.Array, scale: jax.Array, history: jax.Array) -> jax.Array:
    return y


def _out_qdq_fwd(
    compute_dtype: Any, current: bool, y: jax.Array, scale: jax.Array, history: jax.Array
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    return y, (scale, history)


def _out_qdq_bwd(compute_dtype: Any, current: bool, res: tuple[jax.Array, jax.Array], g: jax.Array) -> tuple[Any, ...]:
    scale, history = res
    qg, new_scale, new_history = _delayed_scaling(g, jnp.float8_e5m2, scale, history, compute_dtype, current)
    return qg, new_scale, new_history


_out_qdq.defvjp(_out_qdq_fwd, _out_qdq_bwd)


FP8_SCALINGS = ("delayed", "current")
"""How an FP8 scale is chosen: from the amax history of earlier calls, or from the tensor itself."""


class Fp8DotGeneralOp(OverwriteWithGradient):
    """A ``dot_general`` that computes in FP8 with delayed (or current) per-tensor scaling.

    Inputs and kernel are quantized to ``float8_e4m3fn``; the output gradient to ``float8_e5m2`` in
    the backward pass. Each tensor's scale is :func:`compute_scale` of the maximum of its amax history;
    the history records the tensor's absolute maximum at every call (slot 0 the newest; the others
    rotate, so the window holds the last ``amax_history_length`` maxima). With ``scaling="current"`` the
    scale is :func:`compute_scale` of the tensor's own absolute maximum at this call instead (the history is
    still recorded).

    Because the new state travels as a gradient, call each quantized layer once per gradient
    computation and not under ``vmap`` over the batch (cotangents of shared state are summed: a
    layer used twice would get the sum of two new states). Batch axes of the input are fine: the
    layer contracts them through ``dot_general`` in one call.

    The state is held in plain arrays: scales of shape ``(1,)`` and histories of shape
    ``(amax_history_length,)``, both preceded by the sizes of ``batch_axes`` for a stacked layer (a layer
    of an ``nn.Stacked`` block), so that scanning over the layers gives every layer its own state.

    Attributes:
        input_scale: scale of the left operand.
        output_grad_scale: scale of the output gradient.
        kernel_scale: scale of the right operand (the weight).
        input_amax_history: absolute maxima of past inputs.
        output_grad_amax_history: absolute maxima of past output gradients.
        kernel_amax_history: absolute maxima of past kernels.
        compute_dtype: dtype in which the scaling division is done (None: the operand's dtype).
        scaling: ``"delayed"`` or ``"current"`` (static).

    Example:
        >>> import jax
        >>> import ponente.namedtensor as hax
        >>> In, Out = hax.make_axes(In=8, Out=4)
        >>> layer = hax.nn.Linear.init(In, Out, key=jax.random.key(0), dot_general=Fp8DotGeneralOp.init())
        >>> layer(hax.ones(In)).axes == (Out,), layer.dot_general.input_amax_history.shape
        (True, (1024,))
    """

    input_scale: jax.Array
    output_grad_scale: jax.Array
    kernel_scale: jax.Array
    input_amax_history: jax.Array
    output_grad_amax_history: jax.Array
    kernel_amax_history: jax.Array
    compute_dtype: Any = eqx.field(static=True, default=None)
    scaling: str = eqx.field(static=True, default="delayed")

    @classmethod
    def init(
        cls,
        amax_history_length: int = 1024,
        compute_dtype: Any = None,
        batch_axes: Sequence[Axis] = (),
        scaling: str = "delayed",
    ) -> Fp8DotGeneralOp:
        """Fresh state: scales 1, histories of zeros.

        Args:
            amax_history_length: how many past absolute maxima each scale looks at.
            compute_dtype: dtype for the scaling arithmetic (None: the operand's dtype).
            batch_axes: leading axes of a stacked layer (one independent state per entry).
            scaling: ``"delayed"`` (each scale from the amax history of earlier calls) or ``"current"`` (from the
                tensor's own absolute maximum at this call: no lag, one more reduction per tensor).

        Returns:
            The operator.

        Raises:
            ValueError: if ``amax_history_length`` is less than 1, or ``scaling`` is neither of the two.
        """
        if amax_history_length < 1:
            raise ValueError(f"amax_history_length must be at least 1, got {amax_history_length}")
        if scaling not in FP8_SCALINGS:
            raise ValueError(f"scaling must be one of {FP8_SCALINGS}, got {scaling!r}")
        lead = tuple(ax.size for ax in batch_axes)
        one = jnp.ones((*lead, 1), jnp.float32)
        hist = jnp.zeros((*lead, amax_history_length), jnp.float32)
        return cls(one, one, one, hist, hist, hist, compute_dtype, scaling)

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
            ValueError: if the state still has stacked dimensions (call the layer inside a scan over them).
        """
        if self.input_amax_history.ndim != 1:
            raise ValueError(
                f"Fp8DotGeneralOp: the FP8 state has the stacked dimensions {self.input_amax_history.shape[:-1]}; "
                "apply the layer per layer (e.g. through Stacked.fold or hax.fold over that axis)"
            )
        current = self.scaling == "current"
        x = _in_qdq(self.compute_dtype, current, lhs, self.input_scale, self.input_amax_history)
        k = _in_qdq(self.compute_dtype, current, rhs, self.kernel_scale, self.kernel_amax_history)
        y = jax.lax.dot_general(x, k, dimension_numbers, precision, preferred_element_type)
        return _out_qdq(self.compute_dtype, current, y, self.output_grad_scale, self.output_grad_amax_history)


# --- INT8 ----------------------------------------------------------------------------------------------

_INT8_MAX = 127.0


def _int8_quantize(x: jax.Array, contracting: Sequence[int]) -> tuple[jax.Array, jax.Array]:
    """Symmetric int8 quantization with one scale per slice along ``contracting`` (keepdims)."""
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=tuple(contracting), keepdims=True)
    scale = jnp.where(amax > 0, amax / _INT8_MAX, 1.0)
    q = jnp.clip(jnp.round(x.astype(jnp.float32) / scale), -_INT8_MAX, _INT8_MAX).astype(jnp.int8)
    return q, scale


def _scale_in_output_layout(
    scale: jax.Array, contracting: Sequence[int], batch: Sequence[int], free_before: int, free_after: int
) -> jax.Array:
    """Moves an operand's keepdims scale to ``dot_general``'s output layout (batch, lhs free, rhs free)."""
    free = [d for d in range(scale.ndim) if d not in contracting and d not in batch]
    moved = jnp.transpose(scale, (*batch, *free, *contracting))
    sizes = moved.shape[: len(batch) + len(free)]
    nb = len(batch)
    return moved.reshape((*sizes[:nb], *(1,) * free_before, *sizes[nb:], *(1,) * free_after))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _int8_dot_general(
    lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any, precision: Any, out_dtype: Any
) -> jax.Array:
    return _int8_dot_general_fwd(lhs, rhs, dimension_numbers, precision, out_dtype)[0]


def _int8_dot_general_fwd(
    lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any, precision: Any, out_dtype: Any
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    (lc, rc), (lb, rb) = dimension_numbers
    ql, sl = _int8_quantize(lhs, lc)
    qr, sr = _int8_quantize(rhs, rc)
    acc = jax.lax.dot_general(ql, qr, dimension_numbers, preferred_element_type=jnp.int32)
    n_lfree = lhs.ndim - len(lc) - len(lb)
    n_rfree = rhs.ndim - len(rc) - len(rb)
    scale = _scale_in_output_layout(sl, lc, lb, 0, n_rfree) * _scale_in_output_layout(sr, rc, rb, n_lfree, 0)
    out = (acc.astype(jnp.float32) * scale).astype(out_dtype)
    # the backward pass sees the operands as the forward pass did (straight-through estimator)
    return out, ((ql * sl).astype(lhs.dtype), (qr * sr).astype(rhs.dtype))


def _int8_dot_general_bwd(
    dimension_numbers: Any, precision: Any, out_dtype: Any, res: tuple[jax.Array, jax.Array], g: jax.Array
) -> tuple[jax.Array, jax.Array]:
    lhs_dq, rhs_dq = res
    _, vjp = jax.vjp(lambda a, b: jax.lax.dot_general(a, b, dimension_numbers, precision), lhs_dq, rhs_dq)
    return vjp(g.astype(jnp.result_type(lhs_dq, rhs_dq)))


_int8_dot_general.defvjp(_int8_dot_general_fwd, _int8_dot_general_bwd)


class Int8DotGeneralOp(eqx.Module):
    """A ``dot_general`` that multiplies in int8: symmetric quantization with one scale per output row/column.

    Each operand is scaled by its absolute maximum over the contracted dimensions (one scale per
    remaining index), rounded to int8, multiplied with int32 accumulation, and rescaled. The backward
    pass differentiates the same product of the dequantized operands in floating point (a
    straight-through estimator), so a model trains through it. The operator has no state.

    Example:
        >>> import jax
        >>> import ponente.namedtensor as hax
        >>> In, Out = hax.make_axes(In=8, Out=4)
        >>> layer = hax.nn.Linear.init(In, Out, key=jax.random.key(0), dot_general=Int8DotGeneralOp.init())
        >>> layer(hax.ones(In)).axes == (Out,)
        True
    """

    @classmethod
    def init(cls) -> Int8DotGeneralOp:
        """The operator (it has no parameters)."""
        return cls()

    def __call__(
        self,
        lhs: jax.Array,
        rhs: jax.Array,
        dimension_numbers: Any,
        precision: Any = None,
        preferred_element_type: Any = None,
    ) -> jax.Array:
        """Contracts ``lhs`` and ``rhs`` as ``jax.lax.dot_general`` does, through int8.

        Returns:
            The product in ``preferred_element_type``, or the operands' common dtype.
        """
        out_dtype = preferred_element_type if preferred_element_type is not None else jnp.result_type(lhs, rhs)
        (lc, rc), (lb, rb) = dimension_numbers
        dn = ((tuple(lc), tuple(rc)), (tuple(lb), tuple(rb)))  # hashable: it is a static argument
        return _int8_dot_general(lhs, rhs, dn, precision, out_dtype)


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
