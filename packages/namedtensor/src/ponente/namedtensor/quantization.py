"""Quantized ``Linear`` layers: FP8 with delayed scaling and int8, chosen per layer by name.

The products themselves (how FP8 delayed scaling and int8 work) live in :mod:`ponente.namedtensor.dot_general`,
below ``nn``, which uses them; this module, above ``nn``, selects the layers and re-exports the products. The
gradient of an FP8 state is its new value: :func:`partition_for_grad_overwrite` separates those overwrites from
the real gradients, and :func:`apply_updates` applies both.

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
import re
from collections.abc import Sequence
from typing import Any, TypeVar

import equinox as eqx
import jax

from .axis import axis_name, axis_spec_to_tuple
from .dot_general import (
    FP8_SCALINGS,
    DefaultDotGeneralOp,
    DotGeneralOp,
    Fp8DotGeneralOp,
    Int8DotGeneralOp,
    OverwriteWithGradient,
    apply_updates,
    compute_scale,
    partition_for_grad_overwrite,
)
from .nn.linear import Linear

__all__ = [
    "FP8_SCALINGS",
    "DefaultDotGeneralOp",
    "DotGeneralOp",
    "Fp8DotGeneralOp",
    "Int8DotGeneralOp",
    "OverwriteWithGradient",
    "QuantizationConfig",
    "apply_updates",
    "compute_scale",
    "dequantize_linear_layers",
    "partition_for_grad_overwrite",
    "quantize_linear_layers",
]

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class QuantizationConfig:
    """Which ``Linear`` layers to quantize, and how.

    Attributes:
        targets: which layers: None for all; a list of names, each matched exactly against the layer's
            attribute name (the last part of its path, e.g. ``"up_proj"``) or its whole dotted path
            (``"layers.0.mlp.up_proj"``); or a regular expression matched (``re.match``) against either.
        amax_history_length: length of the absolute-maximum history behind each scale.
        compute_dtype: dtype of the FP8 scaling arithmetic (None: the operand's dtype).
        fp8: quantize to FP8 with delayed scaling (:class:`Fp8DotGeneralOp`).
        int8: quantize to int8 (:class:`Int8DotGeneralOp`).
        scaling: FP8 only: ``"delayed"`` (scales from the amax history) or ``"current"`` (from each tensor's own
            absolute maximum at every call); see :class:`Fp8DotGeneralOp`.

    Raises:
        ValueError: if both ``fp8`` and ``int8`` are set, or for an unknown ``scaling``.
    """

    targets: Sequence[str] | str | None = None
    amax_history_length: int = 1024
    compute_dtype: Any = None
    fp8: bool = False
    int8: bool = False
    scaling: str = "delayed"

    def __post_init__(self) -> None:
        if self.fp8 and self.int8:
            raise ValueError("QuantizationConfig: choose one of fp8=True and int8=True, not both")
        if self.scaling not in FP8_SCALINGS:
            raise ValueError(f"QuantizationConfig: scaling must be one of {FP8_SCALINGS}, got {self.scaling!r}")


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
    """Replaces the ``dot_general`` of the selected ``Linear`` layers in ``tree`` by a quantized one.

    Args:
        tree: a module or any pytree containing :class:`~ponente.namedtensor.nn.Linear` layers.
        config: which layers and how; ``config.fp8`` (:class:`Fp8DotGeneralOp`) or ``config.int8``
            (:class:`Int8DotGeneralOp`) must be set.

    Returns:
        The tree with the selected layers quantized (others unchanged).

    Raises:
        ValueError: if neither ``config.fp8`` nor ``config.int8`` is set.

    A layer whose weight has axes beyond ``In`` and ``Out`` (a layer of a ``Stacked`` block, whose
    weight carries the layers axis) gets one FP8 state per entry of those axes.
    """
    if not (config.fp8 or config.int8):
        raise ValueError("QuantizationConfig: no quantization scheme selected; set fp8=True or int8=True")

    def visit(path: Sequence[Any], node: Any) -> Any:
        if not isinstance(node, Linear):
            return node
        parts = _path_str(path)
        if not _matches(parts, config.targets):
            return node
        op: DotGeneralOp
        if config.int8:
            op = Int8DotGeneralOp.init()
        else:
            own = set(axis_name(axis_spec_to_tuple(node.In))) | set(axis_name(axis_spec_to_tuple(node.Out)))
            extra = tuple(ax for ax in node.weight.axes if ax.name not in own)
            op = Fp8DotGeneralOp.init(config.amax_history_length, config.compute_dtype, extra, config.scaling)
        return eqx.tree_at(lambda lin: lin.dot_general, node, op)

    return jax.tree_util.tree_map_with_path(visit, tree, is_leaf=lambda x: isinstance(x, Linear))


def dequantize_linear_layers(tree: T) -> T:
    """The inverse of :func:`quantize_linear_layers`: every ``Linear`` gets the plain product back.

    The weights are unchanged (quantization keeps them in full precision; only the products are quantized), so
    the result is the model to export or to serve without quantization. FP8 scales and histories are dropped.

    Args:
        tree: a module or any pytree containing :class:`~ponente.namedtensor.nn.Linear` layers.

    Returns:
        The tree with every ``Linear``'s ``dot_general`` a :class:`DefaultDotGeneralOp`.

    Example:
        >>> import jax, ponente.namedtensor as hax
        >>> In, Out = hax.make_axes(In=4, Out=2)
        >>> layer = quantize_linear_layers(
        ...     hax.nn.Linear.init(In, Out, key=jax.random.key(0)), QuantizationConfig(int8=True)
        ... )
        >>> type(dequantize_linear_layers(layer).dot_general).__name__
        'DefaultDotGeneralOp'
    """

    def visit(node: Any) -> Any:
        if not isinstance(node, Linear) or isinstance(node.dot_general, DefaultDotGeneralOp):
            return node
        return eqx.tree_at(lambda lin: lin.dot_general, node, DefaultDotGeneralOp())

    return jax.tree_util.tree_map(visit, tree, is_leaf=lambda x: isinstance(x, Linear))
