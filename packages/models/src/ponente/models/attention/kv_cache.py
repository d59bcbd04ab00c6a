"""The key/value cache of autoregressive decoding: :class:`KvCache` and attention of new queries over it.

A model's :meth:`~ponente.models.LmHeadModel.init_cache` makes an empty cache; its
:meth:`~ponente.models.LmHeadModel.decode` runs some tokens (a padded prompt, then one token per step) through the
layers, writing each token's keys and values into the cache at the token's position and attending over the cache.
Slot ``c`` of the ``cache_position`` axis holds the keys and values of the token at position ``c`` of its row, so a
query at position ``p`` attends to slots ``0 .. p`` (``p - window + 1 .. p`` on a sliding-window layer). Slots
beyond ``p`` may hold stale or garbage entries (e.g. the right padding of a shorter prompt in a batch): they are never
attended to, and the token that later takes their position overwrites them first.

A prefill (the first call, writing each row's tokens at slots ``0 .. n - 1``) can mark the cache with
:meth:`KvCache.for_prefill`: the layers' attention (:func:`ponente.models.attention.decode_attention`) then runs
causally over the ``n`` new keys alone, through the same attention backend as the model's forward pass (e.g. the
blockwise ``flash`` kernel), instead of over all ``max_len`` slots with materialized scores. The model's ``decode``
returns the cache unmarked, ready for one-token steps.
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

import ponente.namedtensor as hax
from ponente.namedtensor import Axis, NamedArray

from ._sinks import softmax_with_sinks

__all__ = ["CACHE_POSITION", "KvCache", "PagedKvCache", "cached_attention", "take_positions"]

CACHE_POSITION = "cache_position"
"""The name of the cache's slot axis (one slot per token position, ``0 .. max_len - 1``)."""


class KvCache(eqx.Module):
    """The keys and values of the tokens decoded so far, one slot per position (an Equinox pytree).

    For a model, both arrays are ``(layers, batch, kv_heads, cache_position, head_size)``. Inside a layer, a model
    either passes that layer's slice (no ``layers`` axis) or a view of the stacked cache with :attr:`layer` set
    (:meth:`at_layer`): then :meth:`update` scatters into the stacked arrays, which XLA does in place in the loop over
    layers, instead of copying each layer's slice in and out. Keys are stored after the rotary embedding (and
    QK-norm), as attention reads them.

    Attributes:
        keys: the keys, with a ``cache_position`` axis.
        values: the values, same axes as ``keys``.
        layer: for a view of one layer of a stacked cache (:meth:`at_layer`), that layer's index; else None.

    Example:
        >>> import jax.numpy as jnp, ponente.namedtensor as hax
        >>> Batch, Heads, Hd = hax.make_axes(batch=1, kv_heads=1, head_size=2)
        >>> cache = KvCache.init((Batch, Heads), Hd, max_len=4)
        >>> k = hax.ones((Batch, hax.Axis("position", 1), Heads, Hd))
        >>> pos = hax.named(jnp.array([[2]]), ("batch", "position"))
        >>> cache.update(k, k, pos).keys["kv_heads", 0, "head_size", 0].array.tolist()
        [[0.0, 0.0, 1.0, 0.0]]
    """

    keys: NamedArray
    values: NamedArray
    layer: jax.Array | None = None
    """None: a cache of one layer (or the whole model's); an integer: a view of this layer of a stacked cache, which
    :meth:`update` writes into in place (no per-layer copy of the cache) and attention reads layer ``layer`` of."""
    prefill: bool = eqx.field(static=True, default=False)
    """True (:meth:`for_prefill`): the call writes each row's first tokens at slots ``0 .. n - 1`` and nothing was
    cached before, so the layers attend causally over those ``n`` keys with the forward's backend (see
    :func:`ponente.models.attention.decode_attention`)."""

    @staticmethod
    def init(
        Leading: Axis | tuple[Axis, ...],
        HeadSize: Axis,
        max_len: int,
        *,
        dtype: jnp.dtype | type = jnp.float32,
    ) -> KvCache:
        """An empty (zero) cache of ``max_len`` slots.

        Args:
            Leading: the axes before ``cache_position``, e.g. ``(Layers, Batch, KVHeads)``.
            HeadSize: the per-head axis (last).
            max_len: the number of slots (the longest sequence, prompt and generated tokens, it can hold).
            dtype: the dtype of keys and values.

        Returns:
            The cache.

        Raises:
            ValueError: if ``max_len`` is below 1.
        """
        if max_len < 1:
            raise ValueError(f"KvCache.init: max_len must be >= 1, got {max_len}")
        leading = (Leading,) if isinstance(Leading, Axis) else tuple(Leading)
        axes = (*leading, Axis(CACHE_POSITION, max_len), HeadSize)
        return KvCache(hax.zeros(axes, dtype=dtype), hax.zeros(axes, dtype=dtype))

    @property
    def CachePos(self) -> Axis:
        """The slot axis (``cache_position``, of size ``max_len``)."""
        return self.keys.resolve_axis(CACHE_POSITION)

    @property
    def max_len(self) -> int:
        """The number of slots."""
        return self.CachePos.size

    def update(self, key: NamedArray, value: NamedArray, pos_ids: NamedArray) -> KvCache:
        """A copy with ``key`` and ``value`` written at the slots ``pos_ids`` (per batch row).

        Positions ``>= max_len`` are dropped (not written).

        Args:
            key: ``(batch..., position, kv heads..., head_size)``, the cache's axes with ``position`` instead of
                ``cache_position`` (any order).
            value: like ``key``.
            pos_ids: integer slot of each token, over ``(batch..., position)``: the batch axes are the cache's axes
                that ``pos_ids`` has.

        Returns:
            The updated cache.

        Raises:
            ValueError: if ``pos_ids`` has no ``position`` axis.
        """
        if not pos_ids.has_axis("position"):
            raise ValueError(f"KvCache.update: pos_ids needs a 'position' axis, got axes {pos_ids.axis_names}")
        return KvCache(
            _write(self.keys, key, pos_ids, self.layer),
            _write(self.values, value, pos_ids, self.layer),
            self.layer,
            self.prefill,
        )

    def at_layer(self, layer: jax.Array | int | None) -> KvCache:
        """A view of layer ``layer`` of this stacked cache (None: the whole cache again, as :meth:`update` sees it)."""
        return KvCache(self.keys, self.values, None if layer is None else jnp.asarray(layer, jnp.int32), self.prefill)

    def for_prefill(self, prefill: bool = True) -> KvCache:
        """This cache marked for a prefill (or unmarked, with ``prefill=False``).

        A marked cache promises that the next ``decode`` call feeds each row's first ``n`` tokens at positions
        ``0 .. n - 1`` (right-padded prompts included) and that nothing is cached yet; attention then runs causally
        over the new keys alone with the layer's forward attention backend (``attention.decode_attention``), which
        gives the same logits faster than attending over every slot. Models return the cache unmarked.

        Args:
            prefill: whether to mark it.

        Returns:
            The same arrays, marked or not.
        """
        return KvCache(self.keys, self.values, self.layer, prefill)

    @property
    def layer_keys(self) -> NamedArray:
        """The keys of this layer (``keys`` itself, or its ``layers`` slice ``layer`` for a view)."""
        return self.keys if self.layer is None else self.keys["layers", self.layer]

    @property
    def layer_values(self) -> NamedArray:
        """The values of this layer (see :attr:`layer_keys`)."""
        return self.values if self.layer is None else self.values["layers", self.layer]

    def attention_mask(self, pos_ids: NamedArray, window: int | None = None) -> NamedArray:
        """Which slots each query may attend to: ``slot <= p`` (and ``slot > p - window``) for a query at ``p``.

        Args:
            pos_ids: the queries' positions over ``(batch..., position)``.
            window: how many keys (the query's own included) a sliding-window layer sees; None: all earlier ones.

        Returns:
            A boolean NamedArray over ``pos_ids``' axes and ``cache_position``.
        """
        slots = hax.broadcast_to(hax.arange(self.CachePos), (*pos_ids.axes, self.CachePos))
        allowed = slots <= pos_ids
        if window is not None:
            allowed = allowed & (slots > pos_ids - window)
        return allowed


class PagedKvCache(KvCache):
    """A key/value cache kept as a pool of fixed-size pages, shared by the rows through a page table.

    The pool holds ``pages`` pages of ``page_size`` token slots each, for every layer: ``keys`` and ``values`` are
    ``(layers, page, page_position, kv heads..., head_size)``. Row ``b`` owns the pages ``page_table[b, 0]``,
    ``page_table[b, 1]``, ...: the token at position ``p`` of the row lives at slot ``p % page_size`` of page
    ``page_table[b, p // page_size]``, so a row takes memory only for the pages its tokens reach, and rows may share
    pages (a common prompt prefix). Attention reads a row's pages gathered into a contiguous ``cache_position`` axis
    of ``seq_pages * page_size`` slots (a plain gather), masked up to the query's position exactly as a
    :class:`KvCache`, so a model decodes over it unchanged.

    ``write_mask`` (over the ``(batch, position)`` of the next tokens) marks the tokens whose keys and values are
    written: padding tokens of a step (a row with fewer tokens than the step's width, or an idle row) are computed
    but never stored. Which pages a row owns is the caller's business (e.g. an inference engine's allocator): the
    table must name a page for every position written or attended to.

    Attributes:
        keys: the key pool, ``(layers, page, page_position, kv heads..., head_size)`` (or without ``layers``).
        values: the value pool, like ``keys``.
        page_table: ``(batch, seq_page)`` int32: the pool page of each page of each row.
        write_mask: ``(batch, position)`` bool: which of the next tokens to store (None: all).

    Example:
        >>> import jax.numpy as jnp, ponente.namedtensor as hax
        >>> Heads, Hd = hax.make_axes(kv_heads=1, head_size=1)
        >>> cache = PagedKvCache.init((Heads,), Hd, pages=4, page_size=2)
        >>> table = hax.named(jnp.array([[3, 1]]), ("batch", "seq_page"))  # row 0: positions 0-1 on page 3, 2-3 on 1
        >>> cache = cache.with_pages(table)
        >>> k = hax.ones((hax.Axis("batch", 1), hax.Axis("position", 1), Heads, Hd))
        >>> pos = hax.named(jnp.array([[2]]), ("batch", "position"))
        >>> cache.update(k, k, pos).layer_keys["kv_heads", 0, "head_size", 0].array.tolist()
        [[0.0, 0.0, 1.0, 0.0]]
    """

    page_table: NamedArray | None = None
    write_mask: NamedArray | None = None

    @staticmethod
    def init(  # type: ignore[override]
        Leading: Axis | tuple[Axis, ...],
        HeadSize: Axis,
        *,
        pages: int,
        page_size: int,
        dtype: jnp.dtype | type = jnp.float32,
        ValueSize: Axis | None = None,
    ) -> PagedKvCache:
        """An empty (zero) pool of ``pages`` pages of ``page_size`` slots, without a page table yet.

        Args:
            Leading: the axes before the page axes, then the heads: e.g. ``(Layers, KVHeads)`` (``layers`` first).
            HeadSize: the per-head axis of the keys (last).
            pages: the number of pages in the pool.
            page_size: the token slots of a page.
            dtype: the dtype of keys and values.
            ValueSize: the last axis of the values when it differs from the keys' (e.g. DeepSeek-V3's latent cache:
                latents as keys, rotary keys as values); None: ``HeadSize``.

        Raises:
            ValueError: if ``pages`` or ``page_size`` is below 1.
        """
        if pages < 1:
            raise ValueError(f"PagedKvCache.init: pages must be >= 1, got {pages}")
        if page_size < 1:
            raise ValueError(f"PagedKvCache.init: page_size must be >= 1, got {page_size}")
        leading = (Leading,) if isinstance(Leading, Axis) else tuple(Leading)
        layers = tuple(ax for ax in leading if ax.name == "layers")
        heads = tuple(ax for ax in leading if ax.name != "layers")
        axes = (*layers, Axis("page", pages), Axis("page_position", page_size), *heads)
        values = HeadSize if ValueSize is None else ValueSize
        return PagedKvCache(hax.zeros((*axes, HeadSize), dtype=dtype), hax.zeros((*axes, values), dtype=dtype))

    @staticmethod
    def like(template: KvCache, *, pages: int, page_size: int) -> PagedKvCache:
        """A pool for the layers, heads and dtype of a model's contiguous cache ``template`` (its ``batch`` and
        ``cache_position`` axes are dropped; e.g. ``model.init_cache(Batch, 1)``, or its ``jax.eval_shape``); keys
        and values may differ in their last axis."""
        keys, values = (
            tuple(ax for ax in x.axes if ax.name not in ("batch", CACHE_POSITION))
            for x in (template.keys, template.values)
        )
        return PagedKvCache.init(
            keys[:-1], keys[-1], pages=pages, page_size=page_size, dtype=template.keys.dtype, ValueSize=values[-1]
        )

    @property
    def pages(self) -> int:
        """The number of pages in the pool."""
        return self.keys.resolve_axis("page").size

    @property
    def page_size(self) -> int:
        """The token slots of a page."""
        return self.keys.resolve_axis("page_position").size

    def with_pages(self, page_table: NamedArray, write_mask: NamedArray | None = None) -> PagedKvCache:
        """This pool with a page table (``(batch, seq_page)``) and the write mask of the next tokens."""
        return PagedKvCache(self.keys, self.values, self.layer, False, page_table, write_mask)

    @property
    def CachePos(self) -> Axis:
        """The gathered slot axis of a row: ``seq_page * page_size`` slots (0 without a page table)."""
        seq_pages = 0 if self.page_table is None else self.page_table.resolve_axis("seq_page").size
        return Axis(CACHE_POSITION, seq_pages * self.page_size)

    def at_layer(self, layer: jax.Array | int | None) -> PagedKvCache:
        """A view of layer ``layer`` of the stacked pool (None: the whole pool again)."""
        index = None if layer is None else jnp.asarray(layer, jnp.int32)
        return PagedKvCache(self.keys, self.values, index, False, self.page_table, self.write_mask)

    def for_prefill(self, prefill: bool = True) -> PagedKvCache:
        """The same cache: a paged cache always attends over its slots (a prompt runs as chunks over the pages)."""
        del prefill
        return self

    def update(self, key: NamedArray, value: NamedArray, pos_ids: NamedArray) -> PagedKvCache:
        """A copy with ``key`` and ``value`` written at the pages and slots of positions ``pos_ids`` (per row).

        Tokens that :attr:`write_mask` excludes are dropped, as are positions beyond the page table.

        Raises:
            ValueError: without a page table, or if ``pos_ids`` lacks the ``position`` axis or the table's batch axis.
        """
        if self.page_table is None:
            raise ValueError("PagedKvCache.update: the cache has no page table (see with_pages)")
        Batch = self.page_table.axes[0]
        if not pos_ids.has_axis("position") or not pos_ids.has_axis(Batch.name):
            raise ValueError(
                f"PagedKvCache.update: pos_ids needs axes ({Batch.name!r}, 'position'), got {pos_ids.axis_names}"
            )
        Pos = pos_ids.resolve_axis("position")
        table = self.page_table.array.astype(jnp.int32)
        pos = pos_ids.rearrange((Batch, Pos)).array.astype(jnp.int32)
        page_size, seq_pages = self.page_size, table.shape[1]
        index = pos // page_size
        page = jnp.take_along_axis(table, jnp.clip(index, 0, seq_pages - 1), axis=1)
        keep = (pos >= 0) & (index < seq_pages)
        if self.write_mask is not None:
            keep = keep & self.write_mask.rearrange((Batch, Pos)).array
        page = jnp.where(keep, page, self.pages)  # out of the pool: dropped
        offset = pos % page_size
        return PagedKvCache(
            self._write(self.keys, key, page, offset, Batch, Pos),
            self._write(self.values, value, page, offset, Batch, Pos),
            self.layer,
            False,
            self.page_table,
            self.write_mask,
        )

    def _write(
        self, pool: NamedArray, new: NamedArray, page: jax.Array, offset: jax.Array, Batch: Axis, Pos: Axis
    ) -> NamedArray:
        rest = tuple(ax for ax in pool.axes if ax.name not in ("layers", "page", "page_position"))
        arr = new.rearrange((Batch, Pos, *rest)).array.astype(pool.dtype)
        if pool.has_axis("layers"):
            if self.layer is None:
                raise ValueError("PagedKvCache.update: a stacked pool is written through a layer view (at_layer)")
            out = pool.array.at[self.layer, page, offset].set(arr, mode="drop")
        else:
            out = pool.array.at[page, offset].set(arr, mode="drop")
        return NamedArray(out, pool.axes)

    def _gather(self, pool: NamedArray) -> NamedArray:
        if self.page_table is None:
            raise ValueError("PagedKvCache: the cache has no page table (see with_pages)")
        if pool.has_axis("layers"):
            pool = pool["layers", self.layer] if self.layer is not None else pool
        rest = tuple(ax for ax in pool.axes if ax.name not in ("page", "page_position"))
        arr = pool.rearrange(("page", "page_position", *rest)).array
        Batch = self.page_table.axes[0]
        rows = arr[self.page_table.array.astype(jnp.int32)]  # (batch, seq_page, page_position, rest...)
        rows = rows.reshape(Batch.size, self.CachePos.size, *(ax.size for ax in rest))
        return NamedArray(rows, (Batch, self.CachePos, *rest))

    @property
    def layer_keys(self) -> NamedArray:
        """Each row's keys in this layer, gathered from its pages: ``(batch, cache_position, heads..., head_size)``."""
        return self._gather(self.keys)

    @property
    def layer_values(self) -> NamedArray:
        """This layer's values of every row, gathered from its pages (see :attr:`layer_keys`)."""
        return self._gather(self.values)


def take_positions(x: NamedArray, index: NamedArray | None) -> NamedArray:
    """``x``'s entry at position ``index[b]`` of each batch row ``b`` (the ``position`` axis dropped), or ``x``.

    Models' ``decode`` use it for ``logits_at``: the output projection then runs on one token per row only.

    Args:
        x: ``(batch..., position, ...)``.
        index: integer positions over the batch axes of ``x`` (None: return ``x`` unchanged).

    Returns:
        ``x`` without its ``position`` axis (or ``x`` itself).

    Example:
        >>> import jax.numpy as jnp, ponente.namedtensor as hax
        >>> x = hax.named(jnp.arange(6).reshape(2, 3), ("batch", "position"))
        >>> take_positions(x, hax.named(jnp.array([2, 0]), "batch")).array.tolist()
        [2, 3]
    """
    if index is None:
        return x
    batch = tuple(ax for ax in x.axes if index.has_axis(ax.name))
    rest = tuple(ax for ax in x.axes if ax.name != "position" and not index.has_axis(ax.name))
    arr = x.rearrange((*batch, "position", *rest)).array
    idx = index.rearrange(batch).array.astype(jnp.int32).reshape(*(ax.size for ax in batch), 1, *([1] * len(rest)))
    return NamedArray(jnp.take_along_axis(arr, idx, axis=len(batch)).squeeze(len(batch)), (*batch, *rest))


def _write(cache: NamedArray, new: NamedArray, pos_ids: NamedArray, layer: jax.Array | None = None) -> NamedArray:
    """``cache`` with ``new[b, i]`` written at slot ``pos_ids[b, i]`` (a scatter per batch row; overflow dropped).

    With ``layer``, ``cache`` is stacked over ``layers`` and the write goes to that layer.

    The scatter indexes the cache in its own axis order (integer indices on the batch axes and ``cache_position``,
    full slices elsewhere), so the cache is never transposed and XLA can write a donated buffer in place.
    """
    Pos = new.resolve_axis("position")
    batch = tuple(ax for ax in cache.axes if pos_ids.has_axis(ax.name))
    indexed = {CACHE_POSITION, *(ax.name for ax in batch), *(["layers"] if layer is not None else [])}
    index_dims = [i for i, ax in enumerate(cache.axes) if ax.name in indexed]
    sliced = tuple(ax for i, ax in enumerate(cache.axes) if i not in index_dims)
    p = pos_ids.rearrange((*batch, Pos)).array.astype(jnp.int32)
    index_shape = p.shape
    index: list[Any] = []
    b = 0
    for ax in cache.axes:
        if ax.name == CACHE_POSITION:
            index.append(p)
        elif layer is not None and ax.name == "layers":
            index.append(layer)
        elif pos_ids.has_axis(ax.name):
            shape = [1] * len(index_shape)
            shape[b] = ax.size
            index.append(jnp.arange(ax.size, dtype=jnp.int32).reshape(shape))
            b += 1
        else:
            index.append(slice(None))
    # NumPy's rule: adjacent integer indices put their broadcast shape in place, separated ones put it first
    if index_dims == list(range(index_dims[0], index_dims[0] + len(index_dims))):
        order = (*cache.axes[: index_dims[0]], *batch, Pos, *cache.axes[index_dims[-1] + 1 :])
    else:
        order = (*batch, Pos, *sliced)
    n = new.rearrange(order).array.astype(cache.dtype)
    return NamedArray(cache.array.at[tuple(index)].set(n, mode="drop"), cache.axes)


def cached_attention(
    HeadSize: Axis,
    query: NamedArray,
    cache: KvCache,
    pos_ids: NamedArray,
    *,
    window: int | None = None,
    scaling_factor: float | None = None,
    logit_soft_cap: float | None = None,
    sinks: NamedArray | None = None,
) -> NamedArray:
    """Attention of queries at positions ``pos_ids`` over the cached keys and values (already updated with theirs).

    Scores are computed and soft-maxed in float32 (masked slots get float32's most negative value), then cast to the
    values' dtype. Grouped-query attention works by broadcasting: query axes the keys lack (``q_heads_per_group``)
    are kept.

    This always attends over the slots (a prefill too, whatever :attr:`KvCache.prefill` says);
    :func:`ponente.models.attention.decode_attention`, the layers' entry point, takes a marked prefill through the
    forward's attention backend instead.

    Args:
        HeadSize: the contracted per-head axis.
        query: ``(batch..., position, heads..., head_size)``.
        cache: the cache of this layer (no ``layers`` axis), holding the keys of every position ``<= pos_ids``.
        pos_ids: the queries' positions over ``(batch..., position)``.
        window: how many keys (the query's own included) each query sees; None: all earlier ones.
        scaling_factor: multiplies the scores (None: ``1/sqrt(HeadSize.size)``).
        logit_soft_cap: caps the scaled scores with ``cap * tanh(scores / cap)`` before masking (Gemma 2).
        sinks: per-head sink logits over the query's head axes, added to the softmax's denominator (gpt-oss), or
            None.

    Returns:
        The attended values with the query's axes.

    Example:
        >>> import jax, jax.numpy as jnp, ponente.namedtensor as hax
        >>> Batch, Pos, Hd = hax.make_axes(batch=1, position=3, head_size=4)
        >>> x = hax.random.normal(jax.random.key(0), (Batch, Pos, Hd))
        >>> pos = hax.broadcast_to(hax.arange(Pos), (Batch, Pos))
        >>> cache = KvCache.init(Batch, Hd, max_len=8).update(x, x, pos)
        >>> out = cached_attention(Hd, x, cache, pos)
        >>> bool(jnp.allclose(out["position", 0].array, x["position", 0].array))  # the first token sees only itself
        True
    """
    CachePos = cache.CachePos
    scale = 1.0 / (HeadSize.size**0.5) if scaling_factor is None else scaling_factor
    keys = cache.layer_keys
    scores = hax.dot(query, keys, axis=HeadSize.name, preferred_element_type=jnp.float32)
    scores = scores.astype(jnp.float32) * scale
    if logit_soft_cap is not None:
        scores = logit_soft_cap * hax.tanh(scores / logit_soft_cap)
    scores = hax.where(cache.attention_mask(pos_ids, window), scores, jnp.finfo(jnp.float32).min)
    values = cache.layer_values
    weights = softmax_with_sinks(scores, CachePos.name, sinks).astype(values.dtype)
    return hax.dot(weights, values, axis=CachePos.name).rearrange(query.axes)
