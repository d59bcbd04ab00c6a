"""Named query/key/value as the positional ``[batch, seq, heads, head_dim]`` arrays that fused kernels take.

The key's axes other than ``Pos`` and ``HeadSize`` are split at ``Pos``: those before it become the kernel's
batch dimension, those after it its key/value heads; the query's axes that the key lacks (e.g.
``q_heads_per_group``) are the query heads of each group, so query head ``n`` uses key/value head ``n // G``
(``jax.nn.dot_product_attention``'s grouped-query convention). Any split gives the same attention; this one
keeps the usual ``(batch, position, kv_heads, head_size)`` key layout free of transposes.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

import ponente.namedtensor as hax
from ponente.namedtensor import Axis, NamedArray

from .reference import KEY_POSITION

__all__ = ["PositionalLayout"]


@dataclasses.dataclass(frozen=True)
class PositionalLayout:
    """How one attention call's named arrays map to ``[B, T, N, H]`` (query) and ``[B, S, K, H]`` (key, value).

    Attributes:
        Pos: the position axis (``T`` and ``S``).
        HeadSize: the per-head axis (``H``).
        batch: the key's axes before ``Pos`` (flattened into ``B``).
        kv_heads: the key's axes after ``Pos`` other than ``HeadSize`` (flattened into ``K``).
        group: the query's axes the key lacks (``G``; ``N = K * G``).
        query_axes: the query's axes, to restore the output.
    """

    Pos: Axis
    HeadSize: Axis
    batch: tuple[Axis, ...]
    kv_heads: tuple[Axis, ...]
    group: tuple[Axis, ...]
    query_axes: tuple[Axis, ...]

    @staticmethod
    def of(
        where: str, Pos: Axis, HeadSize: Axis, query: NamedArray, key: NamedArray, value: NamedArray
    ) -> PositionalLayout:
        """The layout of ``query``, ``key`` and ``value``, checked.

        Args:
            where: the caller, for messages (e.g. ``"attention backend 'xla'"``).
            Pos: the shared position axis.
            HeadSize: the per-head axis.
            query: ``(..., Pos, heads..., HeadSize)``.
            key: ``(..., Pos, kv heads..., HeadSize)``.
            value: the key's axes.

        Returns:
            The layout.

        Raises:
            ValueError: if an axis is missing or differs in size, or the value's axes are not the key's
                (fused kernels have one head size for keys and values).
        """
        for role, x in (("query", query), ("key", key)):
            for ax in (Pos, HeadSize):
                if not x.has_axis(ax.name) or x.axis_size(ax.name) != ax.size:
                    raise ValueError(f"{where}: the {role} needs the axis {ax}; its axes: {x.axes}")
        if set(value.axes) != set(key.axes):
            raise ValueError(
                f"{where}: the value must have the key's axes {key.axes} (one head size for keys and values); "
                f"got {value.axes}; use backend='reference' for other value axes"
            )
        names = [ax.name for ax in key.axes]
        at = names.index(Pos.name)
        skip = (Pos.name, HeadSize.name)
        batch = tuple(ax for ax in key.axes[:at] if ax.name not in skip)
        kv_heads = tuple(ax for ax in key.axes[at:] if ax.name not in skip)
        for ax in (*batch, *kv_heads):
            if not query.has_axis(ax.name) or query.axis_size(ax.name) != ax.size:
                raise ValueError(f"{where}: the key's axis {ax} must also be on the query; query axes: {query.axes}")
        group = tuple(ax for ax in query.axes if ax.name not in skip and not key.has_axis(ax.name))
        return PositionalLayout(Pos, HeadSize, batch, kv_heads, group, query.axes)

    @property
    def B(self) -> int:
        """The kernel's batch size."""
        return math.prod(ax.size for ax in self.batch)

    @property
    def K(self) -> int:
        """The kernel's key/value heads."""
        return math.prod(ax.size for ax in self.kv_heads)

    @property
    def G(self) -> int:
        """Query heads per key/value head."""
        return math.prod(ax.size for ax in self.group)

    def query(self, query: NamedArray) -> jax.Array:
        """``[B, T, K * G, H]``."""
        order = (*self.batch, self.Pos, *self.kv_heads, *self.group, self.HeadSize)
        return query.rearrange(order).array.reshape(self.B, self.Pos.size, self.K * self.G, self.HeadSize.size)

    def key(self, key: NamedArray) -> jax.Array:
        """``[B, S, K, H]`` (also for the value)."""
        order = (*self.batch, self.Pos, *self.kv_heads, self.HeadSize)
        return key.rearrange(order).array.reshape(self.B, self.Pos.size, self.K, self.HeadSize.size)

    def output(self, out: jax.Array) -> NamedArray:
        """The kernel's ``[B, T, K * G, H]`` output as a NamedArray with the query's axes."""
        axes = (*self.batch, self.Pos, *self.kv_heads, *self.group, self.HeadSize)
        return NamedArray(out.reshape(tuple(ax.size for ax in axes)), axes).rearrange(self.query_axes)

    def segment_ids(self, where: str, ids: NamedArray) -> jax.Array:
        """Segment ids over ``Pos`` and batch axes as ``[B, T]`` int32.

        Raises:
            ValueError: if ``ids`` has an axis other than ``Pos`` and the batch axes (e.g. a heads axis).
        """
        allowed = {self.Pos.name, *(ax.name for ax in self.batch)}
        extra = [ax.name for ax in ids.axes if ax.name not in allowed]
        if extra or not ids.has_axis(self.Pos.name):
            raise ValueError(
                f"{where}: segment ids must have the position axis {self.Pos.name!r} and only batch axes "
                f"{[ax.name for ax in self.batch]} besides; got {ids.axes}"
            )
        full = hax.broadcast_to(ids, (*self.batch, self.Pos)).array
        return full.reshape(self.B, self.Pos.size).astype(jnp.int32)

    def mask(self, where: str, mask: NamedArray) -> jax.Array:
        """An explicit boolean mask over ``(Pos, key_position)`` (and batch/head axes) as ``[B, 1 or N, T, S]``.

        Raises:
            ValueError: if the mask has an axis the attention does not have.
        """
        KPos = self.Pos.alias(KEY_POSITION)
        heads = (*self.kv_heads, *self.group)
        known = {ax.name for ax in (*self.batch, *heads, self.Pos, KPos)}
        extra = [ax.name for ax in mask.axes if ax.name not in known]
        if extra:
            raise ValueError(
                f"{where}: the mask has axes {extra} that the attention does not have; mask axes: {mask.axes}"
            )
        per_head = any(mask.has_axis(ax.name) for ax in heads)
        order = (*self.batch, *(heads if per_head else ()), self.Pos, KPos)
        n = self.K * self.G if per_head else 1
        full = hax.broadcast_to(mask, order).array
        return full.reshape(self.B, n, self.Pos.size, self.Pos.size).astype(bool)

    def segment_mask(self, where: str, ids: NamedArray) -> jax.Array:
        """The ``[B, 1, T, S]`` boolean mask of same-segment pairs (for kernels that take a mask, not ids)."""
        seg = self.segment_ids(where, ids)
        return (seg[:, :, None] == seg[:, None, :])[:, None]
