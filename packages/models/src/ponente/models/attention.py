"""Attention shared by the model zoo: masks (causal, sliding window, segments) and grouped-query attention."""

from __future__ import annotations

import equinox as eqx
import jax

import ponente.namedtensor as hax
from ponente.namedtensor import Axis, NamedArray
from ponente.namedtensor.nn import Linear
from ponente.namedtensor.nn import attention as hattn

from .flash_attention import flash_attention
from .rotary import RotaryConfig, apply_rotary

__all__ = ["ATTENTION_BACKENDS", "Attention", "AttentionMask", "attention", "dot_product_attention"]

KEY_POSITION = "key_position"

ATTENTION_BACKENDS = ("reference", "flash")
"""The names accepted by :func:`attention`'s ``backend`` (and ``LmConfig.attn_backend``)."""


class AttentionMask(eqx.Module):
    """A lazily materialized attention mask: causal, optional sliding window, optional segment ids.

    Attributes:
        is_causal: queries see only keys at or before their position.
        segment_ids: integer ids over ``position`` (and batch axes); queries see only keys of the same segment.
        sliding_window: if set, queries see only the last ``sliding_window`` keys (including themselves).

    Example:
        >>> import ponente.namedtensor as hax
        >>> Pos = hax.Axis("position", 3)
        >>> AttentionMask.causal().materialize(Pos, Pos.alias("key_position")).array.astype(int).tolist()
        [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    """

    is_causal: bool = eqx.field(static=True, default=False)
    segment_ids: NamedArray | None = None
    sliding_window: int | None = eqx.field(static=True, default=None)

    @staticmethod
    def causal(sliding_window: int | None = None) -> AttentionMask:
        """A causal mask, optionally restricted to a sliding window."""
        return AttentionMask(is_causal=True, segment_ids=None, sliding_window=sliding_window)

    def with_segment_ids(self, segment_ids: NamedArray) -> AttentionMask:
        """A copy that also separates segments (``segment_ids`` over ``position``)."""
        return AttentionMask(self.is_causal, segment_ids, self.sliding_window)

    def materialize(self, QPos: Axis, KPos: Axis) -> NamedArray | None:
        """The boolean mask over ``(QPos, KPos)`` (plus the segment ids' batch axes), or None when nothing is masked.

        Args:
            QPos: the query position axis (the segment ids' position axis).
            KPos: the key position axis.

        Returns:
            True where attention is allowed, or None.
        """
        mask: NamedArray | None = None
        if self.is_causal:
            mask = hattn.causal_mask(QPos, KPos)
        if self.sliding_window is not None:
            mask = hattn.combine_masks_and(mask, hattn.sliding_window_mask(QPos, KPos, self.sliding_window))
        if self.segment_ids is not None:
            k_seg = self.segment_ids.rename({QPos.name: KPos.name})
            mask = hattn.combine_masks_and(mask, hattn.segment_mask(self.segment_ids, k_seg))
        return mask


def dot_product_attention(
    Pos: Axis,
    HeadSize: Axis,
    query: NamedArray,
    key: NamedArray,
    value: NamedArray,
    mask: AttentionMask | NamedArray | None,
    *,
    scaling_factor: float | None = None,
) -> NamedArray:
    """Reference attention where query, key and value share the position axis ``Pos``.

    The key and value position axis is renamed to ``key_position``. Heads may be grouped: axes of
    the query that the key lacks (e.g. ``q_heads_per_group``) broadcast, which is grouped-query attention.

    Args:
        Pos: the position axis of query, key and value.
        HeadSize: the contracted per-head axis.
        query: ``(..., Pos, heads..., HeadSize)``.
        key: ``(..., Pos, kv heads..., HeadSize)``.
        value: like ``key``.
        mask: an :class:`AttentionMask`, an explicit boolean mask over ``(Pos, key_position)``, or None.
        scaling_factor: multiplies the scores (None: ``1/sqrt(HeadSize.size)``).

    Returns:
        The attended values with the query's axes.
    """
    KPos = Pos.alias(KEY_POSITION)
    key = key.rename({Pos.name: KPos.name})
    value = value.rename({Pos.name: KPos.name})
    explicit = mask.materialize(Pos, KPos) if isinstance(mask, AttentionMask) else mask
    scale = 1.0 / (HeadSize.size**0.5) if scaling_factor is None else scaling_factor
    # The scores and weights take the query's axis order. Putting the axes shared with the key (batch, kv
    # heads) first makes that order the one ``dot_general`` produces, ``(batch..., Pos, group..., KPos)``, so
    # neither the scores nor their gradients are transposed; grouped query heads join ``Pos`` in the rows of
    # one matmul per kv head instead of repeating the keys.
    shared = tuple(ax for ax in query.axes if ax.name not in (Pos.name, HeadSize.name) and key.has_axis(ax.name))
    rest = tuple(ax for ax in query.axes if ax.name != HeadSize.name and not key.has_axis(ax.name))
    q = query.rearrange((*shared, *rest, query.resolve_axis(HeadSize.name)))
    weights = hattn.dot_product_attention_weights(HeadSize, KPos, q, key, explicit, scaling_factor=scale)
    return hax.dot(weights, value, axis=KPos.name).rearrange(query.axes)


def _check_backend(backend: str) -> None:
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention: unknown backend {backend!r}; choose one of {list(ATTENTION_BACKENDS)}")


def attention(
    Pos: Axis,
    HeadSize: Axis,
    query: NamedArray,
    key: NamedArray,
    value: NamedArray,
    mask: AttentionMask | NamedArray | None,
    *,
    scaling_factor: float | None = None,
    backend: str = "reference",
    block_size: int = 128,
) -> NamedArray:
    """Attention over the shared position axis ``Pos``, computed by the chosen backend.

    Both backends have the contract of :func:`dot_product_attention` (named axes, grouped-query
    attention by broadcasting extra query axes, batch axes anywhere).

    Args:
        Pos: the position axis of query, key and value.
        HeadSize: the contracted per-head axis.
        query: ``(..., Pos, heads..., HeadSize)``.
        key: ``(..., Pos, kv heads..., HeadSize)``.
        value: like ``key``.
        mask: an :class:`AttentionMask`, an explicit boolean mask (``"reference"`` only), or None.
        scaling_factor: multiplies the scores (None: ``1/sqrt(HeadSize.size)``).
        backend: ``"reference"`` (:func:`dot_product_attention`, materializes the scores) or ``"flash"``
            (:func:`~ponente.models.flash_attention.flash_attention`, blockwise, O(seq * block) memory).
        block_size: the flash tile size over positions (ignored by ``"reference"``).

    Returns:
        The attended values with the query's axes.

    Raises:
        ValueError: for an unknown ``backend`` (the message lists the choices), or as the backend raises.

    Example:
        >>> import jax, ponente.namedtensor as hax
        >>> Pos, Hd = hax.Axis("position", 6), hax.Axis("head_size", 4)
        >>> x = hax.random.normal(jax.random.key(0), (Pos, Hd))
        >>> ref = attention(Pos, Hd, x, x, x, AttentionMask.causal())
        >>> fla = attention(Pos, Hd, x, x, x, AttentionMask.causal(), backend="flash", block_size=4)
        >>> bool(hax.all(hax.abs(ref - fla) < 1e-5).scalar())
        True
    """
    _check_backend(backend)
    if backend == "flash":
        return flash_attention(
            Pos, HeadSize, query, key, value, mask, scaling_factor=scaling_factor, block_size=block_size
        )
    return dot_product_attention(Pos, HeadSize, query, key, value, mask, scaling_factor=scaling_factor)


class Attention(eqx.Module):
    """Multi-head attention with grouped key/value heads (MHA, GQA, MQA) and optional rotary embeddings.

    Query heads are laid out as ``(kv_heads, q_heads_per_group)``, so flattened weights match Hugging
    Face's ``(num_heads * head_dim, hidden)`` layout where query head ``h`` uses key head ``h // group``.

    Attributes:
        q_proj: ``Embed -> (KVHeads, QHeadsPerGroup, HeadSize)``.
        k_proj: ``Embed -> (KVHeads, HeadSize)``.
        v_proj: ``Embed -> (KVHeads, HeadSize)``.
        o_proj: ``(KVHeads, QHeadsPerGroup, HeadSize) -> Embed``.
        rotary: rotary settings (None: no rotary embedding).
        backend: the attention backend, ``"reference"`` or ``"flash"`` (see :func:`attention`).
        block_size: the flash-attention tile size over positions.
    """

    q_proj: Linear
    k_proj: Linear
    v_proj: Linear
    o_proj: Linear
    rotary: RotaryConfig | None = eqx.field(static=True)
    backend: str = eqx.field(static=True, default="reference")
    block_size: int = eqx.field(static=True, default=128)

    @staticmethod
    def init(
        Embed: Axis,
        KVHeads: Axis,
        QHeadsPerGroup: Axis,
        HeadSize: Axis,
        *,
        use_bias: bool,
        rotary: RotaryConfig | None,
        key: jax.Array,
        backend: str = "reference",
        block_size: int = 128,
    ) -> Attention:
        """Create the projections.

        Args:
            Embed: the model-width axis.
            KVHeads: the key/value heads axis.
            QHeadsPerGroup: query heads per key/value head.
            HeadSize: the per-head axis.
            use_bias: whether the Q/K/V/O projections have biases.
            rotary: rotary settings, or None.
            key: the PRNG key.
            backend: the attention backend (``"reference"`` or ``"flash"``; see :func:`attention`).
            block_size: the flash-attention tile size over positions.

        Returns:
            The layer.

        Raises:
            ValueError: for an unknown ``backend`` or a ``block_size`` below 1.
        """
        _check_backend(backend)
        if block_size < 1:
            raise ValueError(f"Attention.init: block_size must be >= 1, got {block_size}")
        kq, kk, kv, ko = jax.random.split(key, 4)
        QHeads = (KVHeads, QHeadsPerGroup, HeadSize)
        return Attention(
            q_proj=Linear.init(Embed, QHeads, key=kq, use_bias=use_bias),
            k_proj=Linear.init(Embed, (KVHeads, HeadSize), key=kk, use_bias=use_bias),
            v_proj=Linear.init(Embed, (KVHeads, HeadSize), key=kv, use_bias=use_bias),
            o_proj=Linear.init(QHeads, Embed, key=ko, use_bias=use_bias),
            rotary=rotary,
            backend=backend,
            block_size=block_size,
        )

    def __call__(
        self, x: NamedArray, mask: AttentionMask | NamedArray | None, *, key: jax.Array | None = None
    ) -> NamedArray:
        """Attend over the ``position`` axis of ``x``.

        Args:
            x: ``(..., position, embed)``.
            mask: the attention mask (or None).
            key: unused (no dropout).

        Returns:
            ``(..., position, embed)``.
        """
        del key
        Pos = x.resolve_axis("position")
        HeadSize = self.o_proj.weight.resolve_axis("head_size")
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.rotary is not None:
            q = apply_rotary(q, Pos, HeadSize, self.rotary)
            k = apply_rotary(k, Pos, HeadSize, self.rotary)
        out = attention(Pos, HeadSize, q, k, v, mask, backend=self.backend, block_size=self.block_size)
        return self.o_proj(out)
