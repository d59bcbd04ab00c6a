"""The static facts about one attention call that decide which backends can compute it (and which ``auto`` picks)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ponente.namedtensor import Axis, NamedArray

from ._mask import AttentionMask

__all__ = ["AttentionCall"]


@dataclasses.dataclass(frozen=True)
class AttentionCall:
    """What a backend must handle in one call: the device, dtype, shapes and mask features, all known when tracing.

    Attributes:
        platform: the JAX platform, ``"cpu"``, ``"gpu"`` or ``"tpu"``.
        dtype: the compute dtype's name (``"float32"``, ``"bfloat16"``, ...).
        seq_len: the length of the position axis.
        head_size: the size of the per-head axis.
        sliding_window: whether keys are limited to a sliding window.
        segment_ids: whether segment ids (packed sequences) separate the keys.
        explicit_mask: whether the mask is an explicit boolean NamedArray rather than an ``AttentionMask``.
        soft_cap: whether the logits are soft-capped (``cap * tanh(logits / cap)``).
        sinks: whether the softmax has per-head sink logits (gpt-oss; see ``_sinks.softmax_with_sinks``).
        token_index: whether the mask orders the tokens by explicit indices (context parallelism's zig-zag split)
            rather than by the position axis.

    Example:
        >>> AttentionCall("gpu", "bfloat16", seq_len=2048, head_size=64).soft_cap
        False
    """

    platform: str
    dtype: str
    seq_len: int
    head_size: int
    sliding_window: bool = False
    segment_ids: bool = False
    explicit_mask: bool = False
    soft_cap: bool = False
    sinks: bool = False
    token_index: bool = False

    @staticmethod
    def of(
        Pos: Axis,
        HeadSize: Axis,
        query: NamedArray,
        key: NamedArray,
        value: NamedArray,
        mask: AttentionMask | NamedArray | None,
        logit_soft_cap: float | None,
        platform: str | None = None,
        *,
        sinks: bool = False,
    ) -> AttentionCall:
        """The facts of an :func:`~ponente.models.attention.attention` call with these arguments.

        Args:
            Pos: the position axis.
            HeadSize: the per-head axis.
            query: the query.
            key: the key.
            value: the value.
            mask: the mask.
            logit_soft_cap: the soft cap, or None.
            platform: the JAX platform (None: ``jax.default_backend()``, where the traced computation runs).
            sinks: whether the call has attention sinks.

        Returns:
            The call's description.
        """
        structured = mask if isinstance(mask, AttentionMask) else None
        return AttentionCall(
            platform=jax.default_backend() if platform is None else platform,
            dtype=jnp.result_type(query.dtype, key.dtype, value.dtype).name,
            seq_len=Pos.size,
            head_size=HeadSize.size,
            sliding_window=structured is not None and structured.sliding_window is not None,
            segment_ids=structured is not None and structured.segment_ids is not None,
            explicit_mask=isinstance(mask, NamedArray),
            soft_cap=logit_soft_cap is not None,
            sinks=sinks,
            token_index=structured is not None and structured.token_index is not None,
        )
