"""Per-layer attention kinds (Hugging Face ``layer_types``): which layers of a stack attend over a sliding window.

Models whose layers mix sliding-window and full causal attention (Gemma 2/3, Qwen2/3) keep all layers in one
scanned :class:`~ponente.namedtensor.nn.Stacked`: the scan is fed a boolean flag per layer (see
:meth:`~ponente.models.decoder.DecoderLM._windows`) and each block picks its variant with :func:`select_by_kind`,
restricting the mask with :func:`with_sliding_window` in the sliding variant.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import jax

from ponente.namedtensor import Axis, NamedArray
from ponente.namedtensor.nn import attention as hattn

from .attention import AttentionMask

__all__ = [
    "FULL",
    "LAYER_TYPES",
    "SLIDING",
    "check_layer_types",
    "select_by_kind",
    "with_sliding_window",
]

SLIDING = "sliding_attention"
FULL = "full_attention"
LAYER_TYPES = (SLIDING, FULL)
"""The per-layer attention kinds (Hugging Face ``layer_types``): a sliding window or full (global) causal attention."""

T = TypeVar("T")


def check_layer_types(layer_types: Sequence[str], num_layers: int, where: str) -> None:
    """Check that ``layer_types`` names one known kind per layer.

    Args:
        layer_types: the per-layer kinds.
        num_layers: the number of layers of the model.
        where: what is checked, for the message (e.g. ``"QwenConfig"``).

    Raises:
        ValueError: if the length differs from ``num_layers`` or an entry is not in :data:`LAYER_TYPES`.
    """
    if len(layer_types) != num_layers:
        raise ValueError(f"{where}: layer_types has {len(layer_types)} entries but num_layers is {num_layers}")
    unknown = sorted({t for t in layer_types if t not in LAYER_TYPES})
    if unknown:
        raise ValueError(f"{where}: layer_types {unknown} are not supported; expected entries of {LAYER_TYPES}")


def select_by_kind(sliding: bool | NamedArray, local: Callable[[], T], full: Callable[[], T]) -> T:
    """``local()`` for a sliding layer, ``full()`` for a full-attention one.

    Args:
        sliding: a Python bool, or (inside a scan over layers of both kinds) a scalar boolean NamedArray, in which
            case ``jax.lax.cond`` traces both variants and runs only the chosen one.
        local: computes the sliding-window variant.
        full: computes the full-attention variant.

    Returns:
        The chosen variant's result.
    """
    if isinstance(sliding, NamedArray):
        return jax.lax.cond(sliding.array, local, full)
    return local() if sliding else full()


def with_sliding_window(
    mask: AttentionMask | NamedArray | None, window: int | None, Pos: Axis
) -> AttentionMask | NamedArray:
    """``mask`` (None: causal) further restricted to a causal window of ``window`` keys per query, itself included.

    A structured :class:`~ponente.models.AttentionMask` keeps its segment ids and gets the narrower of its own
    window and ``window`` (so the flash backend can skip blocks); an explicit boolean ``(position,
    key_position)`` mask is intersected with the window.

    Args:
        mask: the caller's mask, or None for causal.
        window: how many keys (the query's own included) each query sees; None leaves ``mask`` unchanged.
        Pos: the query position axis.

    Returns:
        The restricted mask.

    Example:
        >>> import ponente.namedtensor as hax
        >>> with_sliding_window(None, 3, hax.Axis("position", 8)).sliding_window
        3
    """
    if mask is None:
        return AttentionMask.causal(window)
    if window is None:
        return mask
    if isinstance(mask, AttentionMask):
        current = mask.sliding_window
        return AttentionMask(
            mask.is_causal, mask.segment_ids, window if current is None else min(current, window), mask.token_index
        )
    return mask & hattn.sliding_window_mask(Pos, Pos.alias("key_position"), window)
