"""The ``"pallas"`` attention backend: the flash-attention kernels JAX ships, written in Pallas, per device.

- GPU: ``jax.experimental.pallas.ops.gpu.attention.mha`` (Triton): causal masks and segment ids; no sliding
  window, no soft cap; keys and values are repeated over the query heads of their group (the kernel has no
  grouped-query support); the sequence length must be a multiple of 16 and the head size a power of two from 16
  to 128 (Triton's tiles).
- TPU: splash attention (``jax.experimental.pallas.ops.tpu.splash_attention``): causal masks, sliding windows,
  segment ids and logit soft-capping; grouped-query attention runs its multi-query kernel once per key/value
  head; the sequence length must be a multiple of 128.

Neither takes an explicit boolean mask. There is no Pallas kernel for CPUs: selecting this backend there is an
error naming the device. ``interpret=True`` runs either kernel in Pallas's interpreter on any device (slowly;
the tests use it to check the wiring on CPU).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ponente.namedtensor import Axis, NamedArray

from ._call import AttentionCall
from ._layout import PositionalLayout
from ._mask import AttentionMask

__all__ = ["pallas_attention", "pallas_supports"]

_GPU_MIN_BLOCK = 16  # Triton's smallest matrix-multiply tile
_GPU_HEAD_SIZES = (16, 32, 64, 128)  # powers of two (Triton's block shapes), up to what fits its tiles
_TPU_BLOCK = 128


def pallas_supports(call: AttentionCall) -> str | None:
    """None if the ``"pallas"`` backend computes ``call``, else why not."""
    if call.platform not in ("gpu", "tpu"):
        return f"device {call.platform!r} (JAX ships Pallas attention kernels for GPUs and TPUs only)"
    if call.explicit_mask:
        return "an explicit NamedArray mask (pass an AttentionMask)"
    if call.platform == "gpu":
        if call.sliding_window:
            return "a sliding window on GPU (the Triton kernel has none)"
        if call.soft_cap:
            return "logit soft-capping on GPU (the Triton kernel has none)"
        if call.head_size not in _GPU_HEAD_SIZES:
            return (
                f"head size {call.head_size} on GPU (the Triton kernel takes {', '.join(map(str, _GPU_HEAD_SIZES))})"
            )
        if call.seq_len % _GPU_MIN_BLOCK:
            return f"sequence length {call.seq_len} on GPU (the Triton kernel needs a multiple of {_GPU_MIN_BLOCK})"
    elif call.seq_len % _TPU_BLOCK:
        return f"sequence length {call.seq_len} on TPU (splash attention needs a multiple of {_TPU_BLOCK})"
    return None


def pallas_attention(
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
    platform: str | None = None,
    interpret: bool = False,
) -> NamedArray:
    """Attention by JAX's Pallas kernel for ``platform`` (the contract of :func:`~ponente.models.attention.attention`).

    Args:
        Pos: the position axis of query, key and value.
        HeadSize: the per-head axis.
        query: ``(..., Pos, heads..., HeadSize)``.
        key: ``(..., Pos, kv heads..., HeadSize)``.
        value: the key's axes.
        mask: an :class:`~ponente.models.AttentionMask` or None.
        scaling_factor: multiplies the scores (None: ``1/sqrt(HeadSize.size)``).
        block_size: the query/key tile of the GPU kernel (clipped to what divides the sequence; TPU: 128).
        logit_soft_cap: caps the scaled logits with ``cap * tanh(logits / cap)`` (TPU only).
        sinks: must be None (the kernels have no attention sinks).
        platform: ``"gpu"`` or ``"tpu"`` (None: ``jax.default_backend()``).
        interpret: run the kernel in Pallas's interpreter (any device, slow).

    Returns:
        The attended values with the query's axes.

    Raises:
        ValueError: naming the device or the feature the kernel lacks (see :func:`pallas_supports`).
    """
    platform = jax.default_backend() if platform is None else platform
    call = AttentionCall.of(
        Pos, HeadSize, query, key, value, mask, logit_soft_cap, platform=platform, sinks=sinks is not None
    )
    reason = "attention sinks" if call.sinks else pallas_supports(call)
    if reason is not None:
        raise ValueError(f"attention backend 'pallas' does not support {reason}")
    where = "attention backend 'pallas'"
    layout = PositionalLayout.of(where, Pos, HeadSize, query, key, value)
    structured = mask if isinstance(mask, AttentionMask) else None  # explicit masks were refused above
    scale = 1.0 / HeadSize.size**0.5 if scaling_factor is None else float(scaling_factor)
    dtype = jnp.result_type(query.dtype, key.dtype, value.dtype)
    q, k, v = (x.astype(dtype) for x in (layout.query(query), layout.key(key), layout.key(value)))
    ids = None if structured is None else structured.segment_ids
    seg = None if ids is None else layout.segment_ids(where, ids)
    if platform == "gpu":
        out = _triton(layout, q, k, v, structured, seg, scale, block_size, interpret)
    else:
        out = _splash(layout, q, k, v, structured, seg, scale, logit_soft_cap, interpret)
    return layout.output(out)


def _triton(
    layout: PositionalLayout,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: AttentionMask | None,
    seg: jax.Array | None,
    scale: float,
    block_size: int,
    interpret: bool,
) -> jax.Array:
    from jax.experimental.pallas.ops.gpu import attention as triton_attention

    length = layout.Pos.size
    block = max(b for b in (128, 64, 32, 16) if length % b == 0 and (b <= block_size or b == _GPU_MIN_BLOCK))
    small = min(block, 32)
    blocks = triton_attention.BlockSizes(
        block_q=block, block_k=block, block_q_dkv=small, block_kv_dkv=small, block_q_dq=small, block_kv_dq=small
    )
    # query head n uses key/value head n // G: repeat each key/value head G times
    k, v = jnp.repeat(k, layout.G, axis=2), jnp.repeat(v, layout.G, axis=2)
    causal = mask is not None and mask.is_causal
    return triton_attention.mha(q, k, v, seg, sm_scale=scale, causal=causal, block_sizes=blocks, interpret=interpret)


def _splash(
    layout: PositionalLayout,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: AttentionMask | None,
    seg: jax.Array | None,
    scale: float,
    soft_cap: float | None,
    interpret: bool,
) -> jax.Array:
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    B, T, K, G, H = layout.B, layout.Pos.size, layout.K, layout.G, layout.HeadSize.size
    shape = (T, T)
    window = None if mask is None else mask.sliding_window
    base: splash.Mask
    if window is not None:
        base = splash.LocalMask(shape, (window - 1, 0), offset=0)
    elif mask is not None and mask.is_causal:
        base = splash.CausalMask(shape)
    else:
        base = splash.FullMask(shape)
    kernel = splash.make_splash_mqa_single_device(
        splash.MultiHeadMask([base] * G),
        attn_logits_soft_cap=soft_cap,
        block_sizes=splash.BlockSizes(
            block_q=_TPU_BLOCK,
            block_kv=_TPU_BLOCK,
            block_kv_compute=_TPU_BLOCK,
            block_q_dkv=_TPU_BLOCK,
            block_kv_dkv=_TPU_BLOCK,
            block_kv_dkv_compute=_TPU_BLOCK,
            block_q_dq=_TPU_BLOCK,
            block_kv_dq=_TPU_BLOCK,
        ),
        interpret=interpret,
    )
    # one multi-query kernel call per (batch, kv head): q [G, T, H], k and v [T, H]; splash does not scale
    qs = (q * jnp.asarray(scale, q.dtype)).reshape(B, T, K, G, H).transpose(0, 2, 3, 1, 4).reshape(B * K, G, T, H)
    ks, vs = (x.transpose(0, 2, 1, 3).reshape(B * K, T, H) for x in (k, v))
    if seg is None:
        out = jax.vmap(kernel)(qs, ks, vs)
    else:
        ids = jnp.repeat(seg, K, axis=0)  # [B * K, T], batch-major like qs
        out = jax.vmap(lambda q1, k1, v1, s1: kernel(q1, k1, v1, segment_ids=splash.SegmentIds(s1, s1)))(
            qs, ks, vs, ids
        )
    return out.reshape(B, K, G, T, H).transpose(0, 3, 1, 2, 4).reshape(B, T, K * G, H)
