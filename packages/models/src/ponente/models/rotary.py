"""Rotary position embeddings (RoPE): default frequencies and Llama-3 frequency scaling."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from ponente.namedtensor import Axis, NamedArray

__all__ = ["RotaryConfig", "apply_rotary"]

_TYPES = ("default", "llama3")


@dataclasses.dataclass(frozen=True)
class RotaryConfig:
    """Rotary embedding frequencies, as Hugging Face's ``rope_parameters``.

    Attributes:
        theta: the base of the geometric frequency progression (``rope_theta``).
        rope_type: ``"default"`` or ``"llama3"``.
        factor: Llama-3 scaling factor.
        low_freq_factor: Llama-3 low-frequency factor.
        high_freq_factor: Llama-3 high-frequency factor.
        original_max_position_embeddings: Llama-3 original context length.

    Example:
        >>> RotaryConfig(theta=10000.0).inv_freq(4).tolist()
        [1.0, 0.01]
    """

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in _TYPES:
            raise ValueError(f"RotaryConfig: rope_type {self.rope_type!r} is not supported; expected one of {_TYPES}")

    def inv_freq(self, head_size: int) -> np.ndarray:
        """The ``head_size // 2`` inverse frequencies (float64 NumPy).

        Args:
            head_size: the per-head size (even).

        Returns:
            The inverse frequencies.

        Raises:
            ValueError: if ``head_size`` is odd.
        """
        if head_size % 2:
            raise ValueError(f"RotaryConfig: head_size must be even for rotary embeddings, got {head_size}")
        inv = 1.0 / (self.theta ** (np.arange(0, head_size, 2, dtype=np.float64) / head_size))
        if self.rope_type == "llama3":
            old = self.original_max_position_embeddings
            low_wavelen = old / self.low_freq_factor
            high_wavelen = old / self.high_freq_factor
            wavelen = 2 * math.pi / inv
            scaled = np.where(wavelen > low_wavelen, inv / self.factor, inv)
            smooth = (old / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
            inv = np.where(medium, smoothed, scaled)
        return inv

    def to_hf(self) -> dict[str, Any]:
        """The Hugging Face ``rope_parameters`` dict."""
        out: dict[str, Any] = {"rope_type": self.rope_type, "rope_theta": self.theta}
        if self.rope_type == "llama3":
            out.update(
                factor=self.factor,
                low_freq_factor=self.low_freq_factor,
                high_freq_factor=self.high_freq_factor,
                original_max_position_embeddings=self.original_max_position_embeddings,
            )
        return out

    @staticmethod
    def from_hf(hf_config: Mapping[str, Any]) -> RotaryConfig:
        """Read the rotary settings of a Hugging Face config (``rope_parameters`` or ``rope_theta``/``rope_scaling``).

        Args:
            hf_config: the parsed ``config.json``.

        Returns:
            The rotary config.

        Raises:
            ValueError: for an unsupported ``rope_type``.
        """
        params = dict(hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {})
        theta = params.get("rope_theta", hf_config.get("rope_theta", 10000.0))
        rope_type = str(params.get("rope_type", params.get("type", "default")))
        kwargs = {
            k: params[k]
            for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
            if k in params and rope_type == "llama3"
        }
        return RotaryConfig(theta=float(theta), rope_type=rope_type, **kwargs)


def apply_rotary(x: NamedArray, Pos: Axis, HeadSize: Axis, rotary: RotaryConfig) -> NamedArray:
    """Rotate ``x`` by position (the "rotate half" convention of Hugging Face Llama).

    Args:
        x: queries or keys with the ``Pos`` and ``HeadSize`` axes.
        Pos: the position axis (positions are ``0 .. Pos.size - 1``).
        HeadSize: the per-head axis.
        rotary: the frequencies.

    Returns:
        The rotated array, same axes and dtype as ``x``.
    """
    inv = jnp.asarray(rotary.inv_freq(HeadSize.size), dtype=jnp.float32)
    freqs = jnp.arange(Pos.size, dtype=jnp.float32)[:, None] * inv[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    cos = NamedArray(jnp.cos(emb).astype(x.dtype), (Pos, HeadSize))
    sin = NamedArray(jnp.sin(emb).astype(x.dtype), (Pos, HeadSize))
    axis = x.axis_indices(HeadSize.name)
    x1, x2 = jnp.split(x.array, 2, axis=axis)
    rotated = NamedArray(jnp.concatenate([-x2, x1], axis=axis), x.axes)
    return x * cos + rotated * sin
