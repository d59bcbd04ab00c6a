"""The attention mask as a description (causal, sliding window, segment ids), materialized only on demand.

Both attention backends read it: the reference backend materializes it over ``(position, key_position)``,
the flash backend computes it tile by tile. It sits below both so that neither imports the other for it.
"""

from __future__ import annotations

import equinox as eqx

import ponente.namedtensor as hax
from ponente.namedtensor import Axis, NamedArray
from ponente.namedtensor.nn import attention as hattn

__all__ = ["AttentionMask"]


class AttentionMask(eqx.Module):
    """A lazily materialized attention mask: causal, optional sliding window, optional segment ids.

    Attributes:
        is_causal: queries see only keys at or before their position.
        segment_ids: integer ids over ``position`` (and batch axes); queries see only keys of the same segment.
        sliding_window: if set, queries see only the last ``sliding_window`` keys (including themselves).
        token_index: integer index of each token in its original sequence, over ``position`` (and batch axes), when
            the ``position`` axis holds the tokens in another order (context parallelism's zig-zag split); causality
            and windows then compare these indices instead of the axis order. None: the axis order.

    Example:
        >>> import ponente.namedtensor as hax
        >>> Pos = hax.Axis("position", 3)
        >>> AttentionMask.causal().materialize(Pos, Pos.alias("key_position")).array.astype(int).tolist()
        [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    """

    is_causal: bool = eqx.field(static=True, default=False)
    segment_ids: NamedArray | None = None
    sliding_window: int | None = eqx.field(static=True, default=None)
    token_index: NamedArray | None = None

    @staticmethod
    def causal(sliding_window: int | None = None) -> AttentionMask:
        """A causal mask, optionally restricted to a sliding window."""
        return AttentionMask(is_causal=True, segment_ids=None, sliding_window=sliding_window)

    def with_segment_ids(self, segment_ids: NamedArray) -> AttentionMask:
        """A copy that also separates segments (``segment_ids`` over ``position``)."""
        return AttentionMask(self.is_causal, segment_ids, self.sliding_window, self.token_index)

    def with_token_index(self, token_index: NamedArray) -> AttentionMask:
        """A copy whose causality and window follow ``token_index`` (over ``position``), the original index of each
        token, instead of the order of the ``position`` axis."""
        return AttentionMask(self.is_causal, self.segment_ids, self.sliding_window, token_index)

    def materialize(self, QPos: Axis, KPos: Axis) -> NamedArray | None:
        """The boolean mask over ``(QPos, KPos)`` (plus the segment ids' batch axes), or None when nothing is masked.

        Args:
            QPos: the query position axis (the segment ids' position axis).
            KPos: the key position axis.

        Returns:
            True where attention is allowed, or None.
        """
        mask: NamedArray | None = None
        if self.token_index is not None:
            q_idx = self.token_index
            k_idx = hax.broadcast_axis(q_idx.rename({QPos.name: KPos.name}), QPos)
            if self.is_causal or self.sliding_window is not None:
                mask = k_idx <= q_idx
            if self.sliding_window is not None:
                mask = hattn.combine_masks_and(mask, q_idx - k_idx < self.sliding_window)
        else:
            if self.is_causal:
                mask = hattn.causal_mask(QPos, KPos)
            if self.sliding_window is not None:
                mask = hattn.combine_masks_and(mask, hattn.sliding_window_mask(QPos, KPos, self.sliding_window))
        if self.segment_ids is not None:
            k_seg = self.segment_ids.rename({QPos.name: KPos.name})
            mask = hattn.combine_masks_and(mask, hattn.segment_mask(self.segment_ids, k_seg))
        return mask
