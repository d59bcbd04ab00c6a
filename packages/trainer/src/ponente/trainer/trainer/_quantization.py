"""Quantized training: ``trainer.quantization`` (Levanter's keys), applied to a model's ``Linear`` layers.

FP8 (``fp8: true``) multiplies in ``float8_e4m3fn`` with ``float8_e5m2`` gradients and per-tensor scales; the scales
and their amax histories live in the model (so they are checkpointed and resumed with it) and are *overwritten*, not
optimized: the step takes their gradient as their new value (see :mod:`ponente.namedtensor.quantization`). int8
(``int8: true``) quantizes both operands of every product at each call and has no state.

The output head (a ``Linear`` named ``lm_head``) is never quantized: the loss kernels read its weight directly, and
keeping the last projection in full precision is the usual FP8 recipe.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, TypeVar

import equinox as eqx
import jax

from ponente.namedtensor import quantization as q
from ponente.namedtensor.nn import Linear

__all__ = ["QuantizationConfig", "plain_model", "quantize_model"]

T = TypeVar("T")

_HEAD = "lm_head"


@dataclasses.dataclass(frozen=True)
class QuantizationConfig:
    """``trainer.quantization``: which matrix products of the model run quantized, and how.

    Attributes:
        fp8: FP8 products (e4m3 forward, e5m2 gradients) with per-tensor scales.
        int8: int8 products (one scale per row/column, computed at every call).
        targets: the ``Linear`` layers to quantize: None for all but the output head; a list of names, each
            matched against a layer's attribute name (``up_proj``) or dotted path
            (``transformer.layers.0.mlp.up_proj``); or one regular expression matched against either.
        amax_history_length: FP8: how many past absolute maxima each delayed scale looks at.
        compute_dtype: FP8: the dtype of the scaling arithmetic (None: the operand's).
        scaling: FP8: ``delayed`` (scales from the amax history of earlier steps) or ``current`` (from each tensor at
            each call).

    Raises:
        ValueError: if neither or both of ``fp8`` and ``int8`` are set, or for an unknown ``scaling`` or a
            non-positive ``amax_history_length`` (naming the key).
    """

    fp8: bool = False
    int8: bool = False
    targets: list[str] | str | None = None
    amax_history_length: int = 1024
    compute_dtype: str | None = None
    scaling: Literal["delayed", "current"] = "delayed"

    def __post_init__(self) -> None:
        if self.fp8 == self.int8:
            raise ValueError(
                "trainer.quantization: set exactly one of fp8: true and int8: true"
                + (" (both are set)" if self.fp8 else "")
            )
        if self.scaling not in q.FP8_SCALINGS:
            raise ValueError(f"trainer.quantization.scaling must be one of {q.FP8_SCALINGS}, got {self.scaling!r}")
        if self.amax_history_length < 1:
            raise ValueError(f"trainer.quantization.amax_history_length must be >= 1, got {self.amax_history_length}")

    def to_namedtensor(self) -> q.QuantizationConfig:
        """The equivalent :class:`ponente.namedtensor.quantization.QuantizationConfig`."""
        return q.QuantizationConfig(
            targets=self.targets,
            amax_history_length=self.amax_history_length,
            compute_dtype=self.compute_dtype,
            fp8=self.fp8,
            int8=self.int8,
            scaling=self.scaling,
        )


def _is_linear(x: Any) -> bool:
    return isinstance(x, Linear)


def _quantized_paths(model: Any) -> list[str]:
    paths = []
    for path, node in jax.tree_util.tree_flatten_with_path(model, is_leaf=_is_linear)[0]:
        if _is_linear(node) and not isinstance(node.dot_general, q.DefaultDotGeneralOp):
            paths.append(jax.tree_util.keystr(path, simple=True, separator="."))
    return paths


def quantize_model(model: T, config: QuantizationConfig) -> T:
    """``model`` with the products of its target ``Linear`` layers quantized (the output head excepted).

    Args:
        model: a model (any pytree of modules).
        config: the ``trainer.quantization`` section.

    Returns:
        The quantized model (weights unchanged).

    Raises:
        ValueError: if ``config.targets`` selects no ``Linear`` layer (naming the key and a few layer names).
    """
    quantized = q.quantize_linear_layers(model, config.to_namedtensor())

    def keep_head_plain(path: Any, node: Any) -> Any:
        names = [getattr(k, "name", None) for k in path]
        if _is_linear(node) and names and names[-1] == _HEAD:
            return eqx.tree_at(lambda lin: lin.dot_general, node, q.DefaultDotGeneralOp())
        return node

    quantized = jax.tree_util.tree_map_with_path(keep_head_plain, quantized, is_leaf=_is_linear)
    if not _quantized_paths(quantized):
        names = [
            jax.tree_util.keystr(path, simple=True, separator=".")
            for path, node in jax.tree_util.tree_flatten_with_path(model, is_leaf=_is_linear)[0]
            if _is_linear(node)
        ]
        raise ValueError(
            f"trainer.quantization.targets: {config.targets!r} selects none of the model's Linear layers "
            f"(the output head is never quantized; layers: {', '.join(names[:8]) or 'none'}"
            f"{', ...' if len(names) > 8 else ''})"
        )
    return quantized


def plain_model(model: T) -> T:
    """``model`` with plain products everywhere (FP8 state dropped): what is exported, served or sampled from."""
    return q.dequantize_linear_layers(model)
