"""The ``"xla"`` and ``"cudnn"`` attention backends: ``jax.nn.dot_product_attention`` on named arrays.

Both map the named query, key and value to ``[batch, seq, heads, head_dim]`` (:class:`PositionalLayout`;
grouped-query attention through the kernel's own ``num_kv_heads < num_heads`` support), a causal mask to
``is_causal``, a sliding window of ``w`` keys to ``local_window_size=(w - 1, 0)``, and segment ids or an
explicit boolean mask to the kernel's ``mask`` argument. Neither has logit soft-capping.

``"xla"`` runs anywhere (XLA's own fusion of the materialized attention). ``"cudnn"`` is cuDNN's fused flash
attention on NVIDIA GPUs: bfloat16/float16 only, head size a multiple of 8 up to 128 (256 on Hopper and later),
and a ``mask`` is turned into an additive bias over ``(batch, 1, position, key_position)`` (so segment ids
cost O(seq²) memory per sequence with it, unlike causal masks and windows, which are free).
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.numpy as jnp

from ponente.namedtensor import Axis, NamedArray

from ._call import AttentionCall
from ._layout import PositionalLayout
from ._mask import AttentionMask

__all__ = ["cudnn_attention", "cudnn_supports", "xla_attention", "xla_supports"]

_CUDNN_DTYPES = ("bfloat16", "float16")
_CUDNN_MAX_HEAD_SIZE = 128  # 256 on Hopper and later; the static choice cannot see the GPU generation


def _jax_attention(
    implementation: Literal["xla", "cudnn"],
    Pos: Axis,
    HeadSize: Axis,
    query: NamedArray,
    key: NamedArray,
    value: NamedArray,
    mask: AttentionMask | NamedArray | None,
    *,
    scaling_factor: float | None = None,
    block_size: int = 128,
    logit_soft_cap: float | None = None,
    sinks: NamedArray | None = None,
) -> NamedArray:
    del block_size  # the kernels pick their own tiles
    where = f"attention backend {implementation!r}"
    if logit_soft_cap is not None:
        raise ValueError(f"{where}: jax.nn.dot_product_attention has no logit soft-capping; use 'reference'")
    if sinks is not None:
        raise ValueError(f"{where}: jax.nn.dot_product_attention has no attention sinks; use 'reference'")
    layout = PositionalLayout.of(where, Pos, HeadSize, query, key, value)
    is_causal, window, explicit = False, None, None
    if isinstance(mask, AttentionMask):
        # a sliding window is causal too (``q - window < k <= q``), as in the reference mask
        is_causal = mask.is_causal or mask.sliding_window is not None
        if mask.sliding_window is not None:
            if mask.sliding_window < 1:
                raise ValueError(f"{where}: sliding_window must be >= 1, got {mask.sliding_window}")
            window = (mask.sliding_window - 1, 0)
        if mask.segment_ids is not None:
            explicit = layout.segment_mask(where, mask.segment_ids)
    elif mask is not None:
        explicit = layout.mask(where, mask)
    dtype = jnp.result_type(query.dtype, key.dtype, value.dtype)
    out = jax.nn.dot_product_attention(
        layout.query(query).astype(dtype),
        layout.key(key).astype(dtype),
        layout.key(value).astype(dtype),
        mask=explicit,
        scale=1.0 / HeadSize.size**0.5 if scaling_factor is None else float(scaling_factor),
        is_causal=is_causal,
        local_window_size=window,
        implementation=implementation,
    )
    return layout.output(out)


xla_attention = functools.partial(_jax_attention, "xla")
"""The ``"xla"`` backend (same arguments as :func:`~ponente.models.attention.attention`, no soft cap, no sinks)."""

cudnn_attention = functools.partial(_jax_attention, "cudnn")
"""The ``"cudnn"`` backend (same arguments as :func:`~ponente.models.attention.attention`, no soft cap, no sinks)."""


def xla_supports(call: AttentionCall) -> str | None:
    """None if the ``"xla"`` backend computes ``call``, else why not."""
    if call.soft_cap:
        return "logit soft-capping (jax.nn.dot_product_attention has none)"
    return None


def cudnn_supports(call: AttentionCall) -> str | None:
    """None if the ``"cudnn"`` backend computes ``call``, else why not."""
    if call.platform != "gpu":
        return f"device {call.platform!r} (cuDNN attention runs only on NVIDIA GPUs)"
    if call.soft_cap:
        return "logit soft-capping (cuDNN attention has none)"
    if call.dtype not in _CUDNN_DTYPES:
        return f"dtype {call.dtype} (cuDNN flash attention takes {' or '.join(_CUDNN_DTYPES)})"
    if call.head_size % 8 or call.head_size > _CUDNN_MAX_HEAD_SIZE:
        return f"head size {call.head_size} (cuDNN needs a multiple of 8 up to {_CUDNN_MAX_HEAD_SIZE})"
    if (call.segment_ids or call.explicit_mask) and call.seq_len % 2:
        return f"a mask with an odd sequence length {call.seq_len} (cuDNN's masked backward needs an even one)"
    return None
