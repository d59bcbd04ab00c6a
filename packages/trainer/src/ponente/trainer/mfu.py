"""Model FLOPs utilization: peak FLOP/s of common accelerators and the MFU of a training step.

MFU is the fraction of the hardware's peak throughput that the model's *useful* arithmetic uses:
``3 * forward_flops_per_token * tokens / step_seconds / (peak_flops_per_device * devices)`` (one
forward and a backward counted as two forwards; recomputation from gradient checkpointing is not
useful work, so it is not counted). The peak numbers are the vendors' dense (no sparsity) figures.
"""

from __future__ import annotations

import logging
import re

__all__ = ["DEVICE_PEAK_FLOPS", "device_peak_flops", "mfu", "training_flops"]

logger = logging.getLogger(__name__)

DEVICE_PEAK_FLOPS: dict[str, dict[str, float]] = {
    # NVIDIA datasheets, dense. "fp32" is the TF32 tensor-core rate where the GPU has one: XLA runs
    # float32 matrix products on tensor cores at JAX's default precision.
    "h100-sxm": {"bf16": 989.4e12, "fp16": 989.4e12, "fp32": 494.7e12},
    "h100-pcie": {"bf16": 756.5e12, "fp16": 756.5e12, "fp32": 378e12},
    "h100-nvl": {"bf16": 835.5e12, "fp16": 835.5e12, "fp32": 417.5e12},
    "h200": {"bf16": 989.4e12, "fp16": 989.4e12, "fp32": 494.7e12},
    "a100": {"bf16": 312e12, "fp16": 312e12, "fp32": 156e12},
    "a10g": {"bf16": 125e12, "fp16": 125e12, "fp32": 62.5e12},
    "l4": {"bf16": 121e12, "fp16": 121e12, "fp32": 60e12},
    "v100": {"fp16": 125e12, "fp32": 15.7e12},
    # Google Cloud TPU documentation, per chip; TPUs have no float32 matrix unit rate to speak of.
    "tpu-v4": {"bf16": 275e12},
    "tpu-v5e": {"bf16": 197e12},
    "tpu-v5p": {"bf16": 459e12},
    "tpu-v6e": {"bf16": 918e12},
}
"""Peak FLOP/s per device, by table key and dtype (``"bf16"``, ``"fp16"``, ``"fp32"``)."""

# (pattern on the lowercased ``device_kind``, table key); the first match wins, so specific names come first
_KIND_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"h100.*pcie", "h100-pcie"),
    (r"h100.*nvl", "h100-nvl"),
    (r"h100", "h100-sxm"),
    (r"h200", "h200"),
    (r"a100", "a100"),
    (r"a10g?\b", "a10g"),
    (r"\bl4\b", "l4"),
    (r"v100", "v100"),
    (r"tpu v4", "tpu-v4"),
    (r"tpu v5 ?(lite|e)", "tpu-v5e"),
    (r"tpu v5p?$", "tpu-v5p"),
    (r"tpu v6 ?(lite|e)", "tpu-v6e"),
)

_DTYPE_ALIASES = {
    "bfloat16": "bf16",
    "bf16": "bf16",
    "float16": "fp16",
    "fp16": "fp16",
    "half": "fp16",
    "float32": "fp32",
    "fp32": "fp32",
    "f32": "fp32",
}


def _table_key(device_kind: str) -> str | None:
    kind = device_kind.strip().lower()
    for pattern, key in _KIND_PATTERNS:
        if re.search(pattern, kind):
            return key
    return None


def device_peak_flops(device_kind: str | None = None, dtype: str = "bf16") -> float | None:
    """Peak dense FLOP/s of one device for matrix products in ``dtype``, or None when unknown.

    Args:
        device_kind: a JAX ``device_kind`` such as ``"NVIDIA H100 80GB HBM3"`` or ``"TPU v5 lite"``
            (default: that of ``jax.devices()[0]``).
        dtype: the compute dtype: ``"bf16"``/``"bfloat16"``, ``"fp16"``/``"float16"``, ``"fp32"``/``"float32"``.

    Returns:
        FLOP/s, or None (with a logged note) for a CPU, a device missing from :data:`DEVICE_PEAK_FLOPS`,
        or a dtype the device has no listed rate for.

    Raises:
        ValueError: if ``dtype`` is not one of the names above.

    Example:
        >>> device_peak_flops("NVIDIA A100-SXM4-80GB", "bfloat16")
        312000000000000.0
        >>> device_peak_flops("cpu") is None
        True
    """
    key = _DTYPE_ALIASES.get(str(dtype).lower())
    if key is None:
        raise ValueError(f"device_peak_flops: unknown dtype {dtype!r}; expected one of {sorted(_DTYPE_ALIASES)}")
    if device_kind is None:
        import jax

        device_kind = jax.devices()[0].device_kind
    table_key = _table_key(device_kind)
    if table_key is None:
        logger.info("MFU not reported: no peak FLOP/s known for device kind %r", device_kind)
        return None
    peak = DEVICE_PEAK_FLOPS[table_key].get(key)
    if peak is None:
        logger.info("MFU not reported: no %s peak FLOP/s listed for device kind %r", key, device_kind)
    return peak


def training_flops(flops_per_token: float, tokens: int) -> float:
    """Model FLOPs of one training step: forward plus backward (twice the forward) over ``tokens`` tokens.

    Args:
        flops_per_token: forward FLOPs per token (``LmConfig.flops_per_token(vocab_size)``).
        tokens: tokens processed in the step (batch size times sequence length).

    Returns:
        ``3 * flops_per_token * tokens``.
    """
    return 3.0 * flops_per_token * tokens


def mfu(flops_per_token: float, tokens: int, seconds: float, peak_flops: float, num_devices: int = 1) -> float:
    """Model FLOPs utilization of a step, a fraction in [0, 1] for a physically possible measurement.

    Args:
        flops_per_token: forward FLOPs per token.
        tokens: tokens processed in the step.
        seconds: wall-clock seconds of the step.
        peak_flops: peak FLOP/s of one device (:func:`device_peak_flops`).
        num_devices: devices the step ran on.

    Returns:
        ``training_flops(flops_per_token, tokens) / seconds / (peak_flops * num_devices)``.

    Raises:
        ValueError: if ``seconds``, ``peak_flops`` or ``num_devices`` is not positive.

    Example:
        >>> mfu(1e9, 1000, 1.0, 3e12)
        1.0
    """
    if seconds <= 0 or peak_flops <= 0 or num_devices < 1:
        raise ValueError(
            f"mfu: seconds ({seconds}), peak_flops ({peak_flops}) and num_devices ({num_devices}) must be positive"
        )
    return training_flops(flops_per_token, tokens) / seconds / (peak_flops * num_devices)
