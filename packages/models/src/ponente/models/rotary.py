"""Rotary position embeddings (RoPE): default frequencies and the linear, Llama-3 and YaRN frequency scalings."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from ponente.namedtensor import Axis, NamedArray

__all__ = ["RotaryConfig", "apply_rotary"]

_TYPES = ("default", "linear", "llama3", "yarn")


@dataclasses.dataclass(frozen=True)
class RotaryConfig:
    """Rotary embedding frequencies, as Hugging Face's ``rope_parameters`` (transformers 5).

    ``rope_type`` selects how the inverse frequencies ``theta ** (-2i / head_size)`` are scaled:

    - ``"default"``: not at all.
    - ``"linear"``: divided by ``factor`` (position interpolation).
    - ``"llama3"``: low frequencies divided by ``factor``, high ones kept, a smooth ramp between
      (``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``).
    - ``"yarn"``: YaRN's ramp between interpolated and original frequencies over the dimensions whose
      number of rotations in ``original_max_position_embeddings`` lies between ``beta_slow`` and
      ``beta_fast``; cos and sin are multiplied by :meth:`attention_scaling`.

    Fields that a type does not use are ignored (and not written by :meth:`to_hf`).

    Attributes:
        theta: the base of the geometric frequency progression (``rope_theta``).
        rope_type: ``"default"``, ``"linear"``, ``"llama3"`` or ``"yarn"``.
        factor: the context-extension factor (linear, Llama-3, YaRN).
        low_freq_factor: Llama-3 low-frequency factor.
        high_freq_factor: Llama-3 high-frequency factor.
        original_max_position_embeddings: the pre-extension context length (Llama-3, YaRN).
        beta_fast: YaRN: rotations bounding the extrapolated (unscaled) high-frequency dimensions.
        beta_slow: YaRN: rotations bounding the interpolated (scaled) low-frequency dimensions.
        attention_factor: YaRN: the cos/sin multiplier (None: derived from ``factor``, ``mscale``, ``mscale_all_dim``).
        mscale: YaRN (DeepSeek spelling): numerator scale of the derived attention factor.
        mscale_all_dim: YaRN (DeepSeek spelling): denominator scale of the derived attention factor.
        truncate: YaRN: round the correction range outward to whole dimensions.

    Example:
        >>> RotaryConfig(theta=10000.0).inv_freq(4).tolist()
        [1.0, 0.01]
        >>> RotaryConfig(theta=10000.0, rope_type="linear", factor=2.0).inv_freq(4).tolist()
        [0.5, 0.005]
    """

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.rope_type not in _TYPES:
            raise ValueError(f"RotaryConfig: rope_type {self.rope_type!r} is not supported; expected one of {_TYPES}")
        if self.rope_type != "default" and not self.factor > 0:
            raise ValueError(f"RotaryConfig: rope_type {self.rope_type!r} needs factor > 0, got {self.factor}")

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
        if self.rope_type == "linear":
            return inv / self.factor
        if self.rope_type == "llama3":
            return self._llama3(inv)
        if self.rope_type == "yarn":
            return self._yarn(inv, head_size)
        return inv

    def _llama3(self, inv: np.ndarray) -> np.ndarray:
        old = self.original_max_position_embeddings
        low_wavelen = old / self.low_freq_factor
        high_wavelen = old / self.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / self.factor, inv)
        smooth = (old / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return np.where(medium, smoothed, scaled)

    def _yarn(self, inv: np.ndarray, head_size: int) -> np.ndarray:
        # the dimension d completes `rotations` turns over the original context when
        # d = head_size * log(L / (2 pi rotations)) / (2 log theta)
        def dim_for(rotations: float) -> float:
            length = self.original_max_position_embeddings
            return head_size * math.log(length / (rotations * 2 * math.pi)) / (2 * math.log(self.theta))

        low, high = dim_for(self.beta_fast), dim_for(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_size - 1)
        if low == high:
            high += 0.001  # a one-dimension ramp would divide by zero
        ramp = np.clip((np.arange(head_size // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
        keep = 1.0 - ramp  # 1: keep the original (extrapolated) frequency, 0: interpolate by `factor`
        return inv / self.factor * (1.0 - keep) + inv * keep

    def attention_scaling(self) -> float:
        """The multiplier of cos and sin: 1 except for YaRN (``attention_factor``, or ``0.1 ln(factor) + 1``).

        Returns:
            The scale.

        Example:
            >>> round(RotaryConfig(rope_type="yarn", factor=4.0).attention_scaling(), 6)
            1.138629
        """
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if self.mscale and self.mscale_all_dim:
            return mscale(self.factor, self.mscale) / mscale(self.factor, self.mscale_all_dim)
        return mscale(self.factor)

    def to_hf(self) -> dict[str, Any]:
        """The Hugging Face ``rope_parameters`` dict (only the keys that ``rope_type`` uses).

        Returns:
            The dict, e.g. ``{"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}``.
        """
        out: dict[str, Any] = {"rope_type": self.rope_type, "rope_theta": self.theta}
        if self.rope_type in ("linear", "llama3", "yarn"):
            out["factor"] = self.factor
        if self.rope_type in ("llama3", "yarn"):
            out["original_max_position_embeddings"] = self.original_max_position_embeddings
        if self.rope_type == "llama3":
            out.update(low_freq_factor=self.low_freq_factor, high_freq_factor=self.high_freq_factor)
        if self.rope_type == "yarn":
            out.update(beta_fast=self.beta_fast, beta_slow=self.beta_slow)
            for name in ("attention_factor", "mscale", "mscale_all_dim"):
                if getattr(self, name) is not None:
                    out[name] = getattr(self, name)
            if not self.truncate:
                out["truncate"] = False
        return out

    @staticmethod
    def from_hf(hf_config: Mapping[str, Any]) -> RotaryConfig:
        """Read the rotary settings of a Hugging Face config (``rope_parameters`` or ``rope_theta``/``rope_scaling``).

        Missing YaRN settings take transformers' defaults: ``original_max_position_embeddings`` is the
        config's ``max_position_embeddings`` and a missing ``factor`` is their ratio.

        Args:
            hf_config: the parsed ``config.json``.

        Returns:
            The rotary config.

        Raises:
            ValueError: for an unsupported ``rope_type``.
            KeyError: if a scaled type lacks ``factor`` (or, for Llama-3, ``original_max_position_embeddings``).
        """
        params = dict(hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {})
        theta = params.get("rope_theta", hf_config.get("rope_theta", 10000.0))
        rope_type = str(params.get("rope_type", params.get("type", "default")))
        if rope_type not in _TYPES:
            raise ValueError(
                f"RotaryConfig.from_hf: rope_type {rope_type!r} is not supported; expected one of {_TYPES}"
            )
        kwargs: dict[str, Any] = {}
        if rope_type == "yarn":
            max_pos = hf_config.get("max_position_embeddings")
            original = params.get("original_max_position_embeddings") or max_pos
            if original is None:
                raise KeyError("RotaryConfig.from_hf: yarn needs 'original_max_position_embeddings'")
            factor = params.get("factor")
            if factor is None and max_pos is not None:
                factor = max_pos / original
            kwargs.update(original_max_position_embeddings=int(original), truncate=bool(params.get("truncate", True)))
            kwargs.update({k: float(params[k]) for k in ("beta_fast", "beta_slow") if params.get(k)})
            kwargs.update(
                {k: float(params[k]) for k in ("attention_factor", "mscale", "mscale_all_dim") if params.get(k)}
            )
            params["factor"] = factor
        if rope_type == "llama3":
            kwargs.update({k: params[k] for k in ("low_freq_factor", "high_freq_factor") if k in params})
            kwargs["original_max_position_embeddings"] = int(
                _param(params, "original_max_position_embeddings", rope_type)
            )
        if rope_type != "default":
            kwargs["factor"] = float(_param(params, "factor", rope_type))
        return RotaryConfig(theta=float(theta), rope_type=rope_type, **kwargs)


def _param(params: Mapping[str, Any], key: str, rope_type: str) -> Any:
    if params.get(key) is None:
        raise KeyError(
            f"RotaryConfig.from_hf: rope_type {rope_type!r} needs {key!r} in rope_parameters (got {params})"
        )
    return params[key]


def apply_rotary(
    x: NamedArray, Pos: Axis, HeadSize: Axis, rotary: RotaryConfig, pos_ids: NamedArray | None = None
) -> NamedArray:
    """Rotate ``x`` by position (the "rotate half" convention of Hugging Face Llama).

    Args:
        x: queries or keys with the ``Pos`` and ``HeadSize`` axes.
        Pos: the position axis.
        HeadSize: the per-head axis.
        rotary: the frequencies.
        pos_ids: the integer position of each token, over ``Pos`` and optionally some of ``x``'s batch axes (e.g.
            restarting at 0 for each document packed in a row); None: ``0 .. Pos.size - 1``.

    Returns:
        The rotated array, same axes and dtype as ``x`` (for YaRN also scaled by ``rotary.attention_scaling()``).

    Raises:
        ValueError: if ``pos_ids`` lacks ``Pos`` or has an axis that ``x`` lacks.

    Example:
        >>> import jax.numpy as jnp, ponente.namedtensor as hax
        >>> Pos, Hd = hax.Axis("position", 3), hax.Axis("head_size", 2)
        >>> x = hax.ones((Pos, Hd))
        >>> same = apply_rotary(x, Pos, Hd, RotaryConfig(), pos_ids=hax.arange(Pos))
        >>> bool(hax.all(same == apply_rotary(x, Pos, Hd, RotaryConfig())).scalar())
        True
    """
    inv = jnp.asarray(rotary.inv_freq(HeadSize.size), dtype=jnp.float32)
    if pos_ids is None:
        positions = jnp.arange(Pos.size, dtype=jnp.float32)
        pos_axes: tuple[Axis, ...] = (Pos,)
    else:
        if not pos_ids.has_axis(Pos.name) or any(not x.has_axis(ax.name) for ax in pos_ids.axes):
            raise ValueError(
                f"apply_rotary: pos_ids axes {pos_ids.axis_names} must include {Pos.name!r} and be among x's axes "
                f"{x.axis_names}"
            )
        positions = pos_ids.array.astype(jnp.float32)
        pos_axes = pos_ids.axes
    freqs = positions[..., None] * inv
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    scale = rotary.attention_scaling()
    cos = NamedArray((jnp.cos(emb) * scale).astype(x.dtype), (*pos_axes, HeadSize))
    sin = NamedArray((jnp.sin(emb) * scale).astype(x.dtype), (*pos_axes, HeadSize))
    axis = x.axis_indices(HeadSize.name)
    x1, x2 = jnp.split(x.array, 2, axis=axis)
    rotated = NamedArray(jnp.concatenate([-x2, x1], axis=axis), x.axes)
    return x * cos + rotated * sin
