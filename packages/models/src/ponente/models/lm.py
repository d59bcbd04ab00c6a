"""The language-model interface: :class:`LmHeadModel`, :class:`LmExample` and the next-token loss."""

from __future__ import annotations

import abc
import dataclasses
import functools
from collections.abc import Mapping
from typing import Any, ClassVar, Generic, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import ponente.namedtensor as hax
from ponente.namedtensor import Axis, AxisSelector, NamedArray
from ponente.namedtensor.state_dict import (
    ModuleWithStateDictSerialization,
    from_torch_compatible_state_dict,
    to_torch_compatible_state_dict,
)

from .attention import AttentionMask
from .kv_cache import KvCache

__all__ = [
    "FUSED_LOSS_BLOCK_SIZE",
    "FUSED_LOSS_CHUNK_ELEMENTS",
    "FUSED_LOSS_MIN_VOCAB",
    "LmExample",
    "LmHeadModel",
    "blockwise_cross_entropy_loss",
    "compute_next_token_loss",
    "compute_next_token_loss_and_aux",
    "cross_entropy_block_size",
    "fused_cross_entropy_loss",
]

FUSED_LOSS_MIN_VOCAB = 65536
"""With ``block_size="auto"``, the loss is blockwise (fused) from this (padded) vocabulary size on.

At 128k entries the plain loss's float32 logits and their gradient are the memory peak of a training step
(Llama 3: 1 GiB per 2048-token sequence each); below 64k (GPT-2, Llama 2, Mistral) they are small and the plain
loss is faster. The ``loss-memory`` benchmark measures both at vocabulary 128k.
"""

FUSED_LOSS_BLOCK_SIZE = 8192
"""The vocabulary block of the blockwise loss that ``block_size="auto"`` chooses for ``reduction="none"``."""

FUSED_LOSS_CHUNK_ELEMENTS = 2**27
"""Logits per position chunk of :func:`fused_cross_entropy_loss` (its default ``chunk_size``).

``2**27`` logits are 1024 tokens of a 128k vocabulary (256 MiB in bfloat16), matrix products still large enough to
keep an accelerator busy. On an H100 (bfloat16, batch 4 x 2048, vocabulary 128256) the fused loss's forward and
backward take 22.6 ms against the plain loss's 21.3 ms in 0.13 of its scratch memory; ``2**28`` takes 21.1 ms in
0.25 of it.
"""


M = TypeVar("M", bound="LmHeadModel[Any]")
# The type of a model's config. ``LmConfig`` (in ``config.py``) builds models, so it sits above this module, which
# names it only through this type variable: ``LmHeadModel[LlamaConfig]``.
ConfigT = TypeVar("ConfigT")


class LmHeadModel(ModuleWithStateDictSerialization, Generic[ConfigT]):
    """A causal language model: token ids ``NamedArray[..., "position"]`` to logits ``[..., "position", "vocab"]``.

    Subclasses are Equinox modules built by their config's ``build``; their state-dict keys are the
    Hugging Face parameter names (see :meth:`to_hf_state_dict`).

    Attributes:
        config: the :class:`~ponente.models.LmConfig` this model was built from (a static field of every
            subclass; ``LmHeadModel[C]`` is a model whose config is a ``C``).
    """

    config: eqx.AbstractVar[ConfigT]

    @property
    @abc.abstractmethod
    def Vocab(self) -> Axis:
        """The vocabulary axis."""

    @abc.abstractmethod
    def __call__(
        self,
        input_ids: NamedArray,
        attn_mask: AttentionMask | NamedArray | None = None,
        *,
        key: jax.Array | None = None,
        pos_ids: NamedArray | None = None,
    ) -> NamedArray:
        """Compute logits.

        Args:
            input_ids: integer token ids with a ``position`` axis (and any batch axes).
            attn_mask: the attention mask (None: causal).
            key: PRNG key for dropout (unused by deterministic models).
            pos_ids: integer position of each token over ``position`` (and some batch axes), e.g. restarting at 0
                for each document packed in a row; None: ``0 .. n - 1``. Rotary embeddings and learned position
                embeddings read them; keeping packed documents apart is the attention mask's job (segment ids).

        Returns:
            Logits with the input's axes followed by ``vocab``.
        """

    def init_cache(self, Batch: Axis, max_len: int, *, dtype: Any = None) -> KvCache:
        """An empty key/value cache for decoding ``Batch`` sequences of up to ``max_len`` tokens (see :meth:`decode`).

        Args:
            Batch: the batch axis of the tokens that :meth:`decode` will be given.
            max_len: the number of cache slots: the longest sequence (prompt and generated tokens) it can hold.
            dtype: the dtype of the cached keys and values (None: the model's parameter dtype).

        Returns:
            A zero :class:`~ponente.models.kv_cache.KvCache` over ``(layers, batch, kv_heads, cache_position,
            head_size)``.

        Raises:
            NotImplementedError: if the model has no cached decoding.
            ValueError: if ``max_len`` is below 1 (or beyond what the model's positions allow).
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement init_cache()/decode()")

    def decode(
        self,
        tokens: NamedArray,
        cache: KvCache,
        pos_ids: NamedArray,
        *,
        key: jax.Array | None = None,
        logits_at: NamedArray | None = None,
    ) -> tuple[NamedArray, KvCache]:
        """Logits of ``tokens`` given the cached earlier tokens; also write the tokens' keys and values to the cache.

        Used for prefill (``n`` = the padded prompt length, ``pos_ids`` ``0 .. n - 1``) and then for each new token
        (``n = 1``, ``pos_ids`` = the row's current length). A token at position ``p`` is written to cache slot ``p``
        of its row and attends to slots ``<= p`` (and ``> p - window`` on sliding-window layers), so its logits equal
        those of the full forward pass (:meth:`__call__`) at position ``p`` of the whole sequence. Right-padded
        prompts work: padding writes slots past a row's length, which are overwritten before they are attended to.
        A pure function (no compilation inside; callers ``jit`` it). A prefill may mark the cache
        (:meth:`~ponente.models.kv_cache.KvCache.for_prefill`) to attend with the forward's attention backend.

        Args:
            tokens: integer ids over ``(batch, position)``, ``position`` of any size ``n >= 1``.
            cache: the cache (from :meth:`init_cache`, or returned by the previous call).
            pos_ids: the position of each token, over ``(batch, position)`` (or ``position`` alone, shared by all
                rows); positions ``>= max_len`` are not cached.
            key: PRNG key (unused: decoding is deterministic).
            logits_at: per batch row, the index along ``position`` of the one token whose logits are wanted (e.g.
                each prompt's last token in a prefill), over the batch axes; None: every token's.

        Returns:
            ``(logits over (batch, position, vocab), the updated cache)``; with ``logits_at``, logits over
            ``(batch, vocab)``.

        Raises:
            NotImplementedError: if the model has no cached decoding.
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement init_cache()/decode()")

    def activations(
        self,
        input_ids: NamedArray,
        attn_mask: AttentionMask | NamedArray | None = None,
        *,
        key: jax.Array | None = None,
        pos_ids: NamedArray | None = None,
    ) -> NamedArray:
        """The final hidden states, i.e. what the output projection (:meth:`get_lm_head`) turns into logits.

        Models that implement this and :meth:`get_lm_head` support the blockwise loss
        (``compute_next_token_loss(..., block_size=...)``), which never materializes the full logits.

        Args:
            input_ids: integer token ids with a ``position`` axis (and any batch axes).
            attn_mask: the attention mask (None: causal).
            key: PRNG key for dropout (unused by deterministic models).
            pos_ids: integer positions over ``position`` (and some batch axes); None: ``0 .. n - 1`` (see
                :meth:`__call__`).

        Returns:
            ``(..., position, embed)`` hidden states (after the final norm).

        Raises:
            NotImplementedError: if the model does not expose its hidden states.
        """
        raise NotImplementedError(
            f"{type(self).__name__} does not implement activations(); it is needed for the blockwise loss "
            "(compute_next_token_loss(..., block_size=...)); use block_size=None"
        )

    def get_lm_head(self) -> NamedArray:
        """The output projection: a NamedArray over ``(embed, vocab)`` (either order), without bias.

        ``logits = hax.dot(self.activations(...), self.get_lm_head(), axis="embed")``.

        Returns:
            The unembedding matrix (the token embedding itself for tied models).

        Raises:
            NotImplementedError: if the model does not expose its output projection.
        """
        raise NotImplementedError(
            f"{type(self).__name__} does not implement get_lm_head(); it is needed for the blockwise loss "
            "(compute_next_token_loss(..., block_size=...)); use block_size=None"
        )

    def blockwise_loss_support(self) -> str | None:
        """None if the blockwise loss can compute this model's loss, else why not (a phrase for messages).

        The default says yes when the subclass implements :meth:`activations` and :meth:`get_lm_head`; models
        whose logits are not ``activations · lm_head`` (e.g. a final logit soft cap) override it.
        """
        own = type(self)
        if own.activations is LmHeadModel.activations or own.get_lm_head is LmHeadModel.get_lm_head:
            return f"{own.__name__} does not implement activations() and get_lm_head()"
        return None

    def logits_and_aux(
        self,
        input_ids: NamedArray,
        attn_mask: AttentionMask | NamedArray | None = None,
        *,
        key: jax.Array | None = None,
        pos_ids: NamedArray | None = None,
    ) -> tuple[NamedArray, dict[str, NamedArray]]:
        """Logits and the model's auxiliary losses, computed in the same forward pass.

        Auxiliary losses are named scalar terms, already weighted, that :func:`compute_next_token_loss`
        adds to the objective (e.g. a mixture of experts' ``router_aux_loss``). Models without any keep
        this default, which returns ``(self(...), {})``.

        Args:
            input_ids: integer token ids with a ``position`` axis (and any batch axes).
            attn_mask: the attention mask (None: causal).
            key: PRNG key for dropout (unused by deterministic models).
            pos_ids: integer positions over ``position`` (and some batch axes); None: ``0 .. n - 1`` (see
                :meth:`__call__`).

        Returns:
            ``(logits, {name: scalar})``.
        """
        return self(input_ids, attn_mask, key=key, **_pos_ids_kwargs(pos_ids)), {}

    def activations_and_aux(
        self,
        input_ids: NamedArray,
        attn_mask: AttentionMask | NamedArray | None = None,
        *,
        key: jax.Array | None = None,
        pos_ids: NamedArray | None = None,
    ) -> tuple[NamedArray, dict[str, NamedArray]]:
        """:meth:`activations` and the auxiliary losses (see :meth:`logits_and_aux`); default: no auxiliary loss.

        Args:
            input_ids: integer token ids with a ``position`` axis (and any batch axes).
            attn_mask: the attention mask (None: causal).
            key: PRNG key for dropout (unused by deterministic models).
            pos_ids: integer positions over ``position`` (and some batch axes); None: ``0 .. n - 1`` (see
                :meth:`__call__`).

        Returns:
            ``(hidden states, {name: scalar})``.
        """
        return self.activations(input_ids, attn_mask, key=key, **_pos_ids_kwargs(pos_ids)), {}

    # Hugging Face PyTorch parameters stored (in, out) (GPT-2's Conv1D); keys ending with these are transposed
    _hf_transposed_suffixes: ClassVar[tuple[str, ...]] = ()

    def to_hf_state_dict(self) -> dict[str, np.ndarray]:
        """The parameters under their Hugging Face names and layouts, as NumPy arrays.

        Returns:
            The state dict (stacked layers appear as numbered per-layer keys).
        """
        state = to_torch_compatible_state_dict(self)
        return {k: (v.T if k.endswith(self._hf_transposed_suffixes) else v) for k, v in state.items()}

    def from_hf_state_dict(self: M, state_dict: Mapping[str, Any]) -> M:
        """A copy of this (template) model with parameters read from a Hugging Face state dict.

        Args:
            state_dict: parameter name -> array (NumPy or anything array-like); extra keys are ignored.

        Returns:
            The loaded model (dtypes follow this template).

        Raises:
            KeyError: if a parameter is missing (the message names it).
            ValueError: if a parameter has the wrong shape.
        """
        suffixes = type(self)._hf_transposed_suffixes
        fixed = {k: (np.asarray(v).T if k.endswith(suffixes) and suffixes else v) for k, v in state_dict.items()}
        # a shape-only template (from ``eqx.filter_eval_shape``) works too
        return from_torch_compatible_state_dict(self, fixed)


class LmExample(eqx.Module):
    """One (batch of) training example(s): tokens, a loss mask, an attention mask and optionally positions.

    Attributes:
        tokens: integer ids over ``position`` (and batch axes).
        loss_mask: 1.0 where the prediction of the *next* token counts (over the same axes), else 0.
        attn_mask: the attention mask.
        pos_ids: the integer position of each token over ``position`` (and some of the tokens' batch axes), passed
            to the model (see :meth:`LmHeadModel.__call__`); None: ``0 .. n - 1`` in every row.
    """

    tokens: NamedArray
    loss_mask: NamedArray
    attn_mask: AttentionMask
    pos_ids: NamedArray | None = None

    @staticmethod
    def causal(
        tokens: NamedArray,
        *,
        loss_mask: NamedArray | None = None,
        eos_id: int | None = None,
        segment_ids: NamedArray | None = None,
        pos_ids: NamedArray | None = None,
    ) -> LmExample:
        """A causal example; documents packed in ``tokens`` get separate segments (from ``segment_ids`` or EOS).

        The last position never has a target, so its loss mask is 0. No token attends across a segment
        boundary, and the prediction of a token of another segment (the next document's first token) is
        masked. With ``eos_id``, a token belongs to the segment ended by the next EOS (the EOS itself
        included). With ``segment_ids`` (e.g. from a packed dataset), segments are its contiguous runs;
        with both, a boundary of either one separates segments. ``pos_ids`` (e.g. restarting at 0 in each
        segment, so that a packed document is embedded as if it were alone) only set the positions the model
        sees; they do not separate segments.

        Args:
            tokens: integer ids with a ``position`` axis.
            loss_mask: an extra mask multiplied in (None: all ones).
            eos_id: the end-of-sequence id used to derive segments (None: no EOS-based segments).
            segment_ids: integer segment ids over ``position`` (and some of the tokens' batch axes).
            pos_ids: integer positions over ``position`` (and some of the tokens' batch axes); None:
                ``0 .. n - 1``.

        Returns:
            The example.

        Raises:
            ValueError: if ``tokens`` has no ``position`` axis, or ``segment_ids`` or ``pos_ids`` has axes
                ``tokens`` lacks (or lacks ``position``).

        Example:
            >>> import jax.numpy as jnp, ponente.namedtensor as hax
            >>> ex = LmExample.causal(hax.named(jnp.array([5, 6, 0, 7, 8]), "position"), eos_id=0)
            >>> ex.attn_mask.segment_ids.array.tolist(), ex.loss_mask.array.tolist()
            ([0, 0, 0, 1, 1], [1.0, 1.0, 0.0, 1.0, 0.0])
            >>> seg = hax.named(jnp.array([3, 3, 4, 4, 4]), "position")
            >>> LmExample.causal(
            ...     hax.named(jnp.array([5, 6, 7, 8, 9]), "position"), segment_ids=seg
            ... ).loss_mask.array.tolist()
            [1.0, 0.0, 1.0, 1.0, 0.0]
        """
        if not tokens.has_axis("position"):
            raise ValueError(f"LmExample.causal: tokens need a 'position' axis, got axes {tokens.axis_names}")
        Pos = tokens.resolve_axis("position")
        not_last = hax.arange(Pos) < Pos.size - 1
        mask = hax.broadcast_to(not_last.astype(jnp.float32), tokens.axes)
        if loss_mask is not None:
            mask = mask * loss_mask.astype(jnp.float32)
        for name, ids in (("segment_ids", segment_ids), ("pos_ids", pos_ids)):
            if ids is not None and (
                any(not tokens.has_axis(ax.name) for ax in ids.axes) or not ids.has_axis(Pos.name)
            ):
                raise ValueError(
                    f"LmExample.causal: {name} axes {ids.axis_names} must include 'position' and be among the "
                    f"tokens' axes {tokens.axis_names}"
                )
        segments = segment_ids
        if eos_id is not None:
            is_eos = (tokens == eos_id).astype(jnp.int32)
            eos_segments = hax.cumsum(is_eos, Pos) - is_eos
            segments = eos_segments if segments is None else _merge_segments(segments, eos_segments, Pos)
        attn = AttentionMask.causal()
        if segments is not None:
            attn = attn.with_segment_ids(segments)
            # the target of position i is token i + 1: it only counts inside the same segment
            same_segment = hax.roll(segments, -1, Pos) == segments
            mask = mask * same_segment.astype(jnp.float32)
        return LmExample(tokens, mask, attn, pos_ids)


def _pos_ids_kwargs(pos_ids: NamedArray | None) -> dict[str, NamedArray]:
    """``{"pos_ids": pos_ids}``, or no argument for None (so a model whose methods predate ``pos_ids`` still works)."""
    return {} if pos_ids is None else {"pos_ids": pos_ids}


def _merge_segments(a: NamedArray, b: NamedArray, Pos: Axis) -> NamedArray:
    """Segment ids that change wherever ``a`` or ``b`` changes along ``Pos`` (contiguous runs, counted from 0)."""
    changed = (hax.roll(a, 1, Pos) != a) | (hax.roll(b, 1, Pos) != b)
    changed = changed & (hax.arange(Pos) > 0)
    return hax.cumsum(changed.astype(jnp.int32), Pos)


@dataclasses.dataclass(frozen=True)
class _LossSpec:
    """Static settings of the blockwise cross-entropy (a ``nondiff`` argument of its custom VJP)."""

    block: int
    vocab: int  # the vocabulary size (columns of ``w``)
    z_loss_weight: float
    dtype: Any  # of logits, softmax statistics, loss and accumulated gradients

    @property
    def num_blocks(self) -> int:
        return -(-self.vocab // self.block)


def _vocab_tile(
    spec: _LossSpec, h: jax.Array, w: jax.Array, t: jax.Array, j: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Block ``j`` of the vocabulary: its logits ``[..., block]``, target indicator, first column and ``w`` slice.

    The last block is shifted left to end at the last column (no padded copy of ``w``, which is vocabulary-sized);
    its columns that the previous block already covered get ``-inf`` logits and are never the target.
    """
    start = jnp.minimum(j * spec.block, spec.vocab - spec.block)
    cols = start + jnp.arange(spec.block)
    fresh = cols >= j * spec.block
    # no cast of ``w``: XLA would hoist it out of the loop as a vocabulary-sized copy; the products accumulate in
    # ``spec.dtype`` instead
    w_j = lax.dynamic_slice_in_dim(w, start, spec.block, axis=1)
    logits = jnp.where(fresh, jnp.matmul(h, w_j, preferred_element_type=spec.dtype), -jnp.inf)
    return logits, fresh & (cols == t[..., None]), start, w_j


def _blockwise_forward(spec: _LossSpec, h: jax.Array, w: jax.Array, t: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-token loss and log-sum-exp (``t``'s shape) with an online softmax over vocabulary blocks."""

    def visit(j: jax.Array, carry: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array, jax.Array]:
        m, total, target = carry
        logits, is_target, _, _ = _vocab_tile(spec, h, w, t, j)
        m_new = jnp.maximum(m, logits.max(-1))
        total = total * jnp.exp(m - m_new) + jnp.exp(logits - m_new[..., None]).sum(-1)
        target = target + jnp.sum(jnp.where(is_target, logits, 0.0), axis=-1)
        return m_new, total, target

    init = (jnp.full(t.shape, -jnp.inf, spec.dtype), jnp.zeros(t.shape, spec.dtype), jnp.zeros(t.shape, spec.dtype))
    m, total, target = lax.fori_loop(0, spec.num_blocks, visit, init)
    lse = m + jnp.log(total)
    return lse - target + spec.z_loss_weight * lse * lse, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _blockwise_ce(spec: _LossSpec, h: jax.Array, w: jax.Array, t: jax.Array) -> jax.Array:
    return _blockwise_forward(spec, h, w, t)[0]


def _blockwise_ce_fwd(
    spec: _LossSpec, h: jax.Array, w: jax.Array, t: jax.Array
) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    loss, lse = _blockwise_forward(spec, h, w, t)
    return loss, (h, w, t, lse)


def _blockwise_ce_bwd(spec: _LossSpec, res: tuple[jax.Array, ...], g: jax.Array) -> tuple[Any, ...]:
    h, w, t, lse = res
    # d loss / d logits = softmax * (1 + 2 z lse) - onehot(target)
    coef = g * (1.0 + 2.0 * spec.z_loss_weight * lse)

    def block_grads(carry: tuple[jax.Array, jax.Array], j: jax.Array) -> tuple[tuple[jax.Array, jax.Array], None]:
        dh, dw = carry
        logits, is_target, start, w_j = _vocab_tile(spec, h, w, t, j)
        dlogits = coef[..., None] * jnp.exp(logits - lse[..., None]) - jnp.where(is_target, g[..., None], 0.0)
        dlogits_in = dlogits.astype(h.dtype)
        # 0 on the columns a shifted last block repeats
        dw_j = jnp.einsum("...e,...v->ev", h, dlogits_in, preferred_element_type=spec.dtype)
        # accumulated in place into the gradient buffer (no stack of per-block gradients, no f32 copy of ``w``)
        dw_j = (lax.dynamic_slice_in_dim(dw, start, spec.block, axis=1).astype(spec.dtype) + dw_j).astype(w.dtype)
        dh = dh + jnp.matmul(dlogits_in, w_j.T, preferred_element_type=spec.dtype)
        return (dh, lax.dynamic_update_slice_in_dim(dw, dw_j, start, axis=1)), None

    blocks = jnp.arange(spec.num_blocks)
    init = (jnp.zeros(h.shape, spec.dtype), jnp.zeros_like(w))
    (dh, dw), _ = lax.scan(block_grads, init, blocks)
    return dh.astype(h.dtype), dw, None


_blockwise_ce.defvjp(_blockwise_ce_fwd, _blockwise_ce_bwd)


def _loss_axes(
    where: str, hidden: NamedArray, lm_head: NamedArray, targets: NamedArray
) -> tuple[Axis, Axis, tuple[Axis, ...]]:
    """``(Embed, Vocab, token axes)`` of a loss of ``logits = hidden · lm_head``, after checking the three inputs."""
    shared = [ax for ax in lm_head.axes if hidden.has_axis(ax.name)]
    if len(lm_head.axes) != 2 or len(shared) != 1:
        raise ValueError(
            f"{where}: lm_head must have two axes (embed, vocab), exactly one of them shared with hidden; got "
            f"lm_head axes {lm_head.axes} and hidden axes {hidden.axes}"
        )
    Embed = shared[0]
    Vocab = next(ax for ax in lm_head.axes if ax.name != Embed.name)
    token_axes = tuple(ax for ax in hidden.axes if ax.name != Embed.name)
    if {ax.name for ax in targets.axes} != {ax.name for ax in token_axes}:
        raise ValueError(
            f"{where}: targets must have hidden's axes minus {Embed.name!r}, i.e. {token_axes}; got {targets.axes}"
        )
    return Embed, Vocab, token_axes


def blockwise_cross_entropy_loss(
    hidden: NamedArray,
    lm_head: NamedArray,
    targets: NamedArray,
    *,
    block_size: int,
    z_loss_weight: float = 0.0,
    dtype: Any = jnp.float32,
) -> NamedArray:
    """Per-position cross-entropy of ``logits = hidden · lm_head`` without materializing the logits.

    The vocabulary is processed ``block_size`` columns at a time with an online log-sum-exp; the
    backward pass (a custom VJP) recomputes each block, so memory is O(tokens * block_size) instead of
    O(tokens * vocab). The loss at a position is ``lse - logits[target] + z_loss_weight * lse**2``.

    Args:
        hidden: ``(..., Embed)`` hidden states (e.g. :meth:`LmHeadModel.activations`).
        lm_head: the output projection over ``(Embed, Vocab)`` in either order; ``Embed`` is the axis it
            shares with ``hidden``.
        targets: integer target ids with exactly ``hidden``'s axes minus ``Embed`` (ids outside the
            vocabulary contribute a target logit of 0).
        block_size: vocabulary columns per block (clipped to the vocabulary size; the last block overlaps the one
            before it when the size is not a multiple).
        z_loss_weight: the z-loss weight (0: none).
        dtype: the computation dtype of logits and loss.

    Returns:
        The unreduced, unmasked loss with ``targets``' axes.

    Raises:
        ValueError: if ``lm_head`` is not two axes, one shared with ``hidden``, if ``targets``' axes are
            not ``hidden``'s minus ``Embed``, or if ``block_size`` is below 1.

    Example:
        >>> import jax, ponente.namedtensor as hax
        >>> Pos, Embed, Vocab = hax.make_axes(position=4, embed=8, vocab=50)
        >>> h = hax.random.normal(jax.random.key(0), (Pos, Embed))
        >>> w = hax.random.normal(jax.random.key(1), (Embed, Vocab))
        >>> blockwise_cross_entropy_loss(h, w, hax.arange(Pos), block_size=16).shape
        {'position': 4}
    """
    if block_size < 1:
        raise ValueError(f"blockwise_cross_entropy_loss: block_size must be >= 1, got {block_size}")
    Embed, Vocab, token_axes = _loss_axes("blockwise_cross_entropy_loss", hidden, lm_head, targets)
    # token (batch, position) dimensions stay separate: no reshape of possibly sharded axes
    # inputs keep their (common) dtype, e.g. bfloat16: a float32 copy of ``lm_head`` would be vocabulary-sized;
    # products accumulate in ``dtype``
    common = jnp.promote_types(hidden.dtype, lm_head.dtype)
    h = hidden.rearrange((*token_axes, Embed)).array.astype(common)
    w = lm_head.rearrange((Embed, Vocab)).array.astype(common)
    t = targets.rearrange(token_axes).array.astype(jnp.int32)
    blk = min(block_size, Vocab.size)
    spec = _LossSpec(block=blk, vocab=Vocab.size, z_loss_weight=float(z_loss_weight), dtype=jnp.dtype(dtype))
    loss = _blockwise_ce(spec, h, w, t)
    return NamedArray(loss, token_axes)


@dataclasses.dataclass(frozen=True)
class _FusedSpec:
    """Static settings of the position-chunked fused cross-entropy (a ``nondiff`` argument of its custom VJP)."""

    chunk: int  # positions per chunk
    positions: int  # the length of the position axis (the second-to-last of ``h``)
    z_loss_weight: float
    dtype: Any  # of the softmax, its statistics and the loss
    groups: int = 1  # > 1: ``h`` and the token arrays have a leading group axis of this size

    @property
    def num_chunks(self) -> int:
        return -(-self.positions // self.chunk)


def _fused_chunks(
    spec: _FusedSpec, h: jax.Array, w: jax.Array, t: jax.Array, wt: jax.Array, *, grads: bool
) -> tuple[jax.Array, ...]:
    """``sum(wt * loss)`` over ``h [..., position, embed]``, one chunk of positions (all vocabulary columns) at a time.

    With ``grads`` the same pass also returns the gradients of that sum wrt ``h`` and ``w`` (in their dtype) and the
    per-token loss (the gradient wrt ``wt``): each chunk's logits serve its loss and its gradient, so the loss and
    its gradient cost three matrix products over the vocabulary instead of four.

    Each matrix product accumulates in float32 (on accelerators; XLA:CPU upcasts bfloat16) and returns the inputs'
    dtype, as the plain loss's logits and gradients are in the compute dtype. With bfloat16 inputs this is what keeps
    the fused loss about as fast as the plain one on an H100 (:data:`FUSED_LOSS_CHUNK_ELEMENTS`): float32 logits and a
    float32 accumulator of the projection's gradient cost a pass over 4-byte chunk logits and a read and write of a
    float32 ``[embed, vocab]`` array per chunk (27.6 ms instead of 22.6 at batch 4 x 2048, vocabulary 128256), and
    the accumulator alone would be 1 GiB at that size.

    With ``spec.groups > 1``, ``h`` is ``[group, ..., position, embed]``: the loss and the projection's gradient are
    summed per group inside the loop and over the groups once after it. With one group per shard of a sharded batch,
    each device adds up its own share and the shares are reduced once, not once per chunk (see
    :func:`fused_cross_entropy_loss`). With one group the arrays have no group axis (the program measured on one GPU).
    """
    axis = h.ndim - 2
    vocab_ids = jnp.arange(w.shape[1])
    grouped = spec.groups > 1
    per_group = tuple(range(1, h.ndim - 1)) if grouped else None  # the token axes summed inside a group
    dw_product = "g...ce,g...cv->gev" if grouped else "...ce,...cv->ev"

    def visit(c: jax.Array, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        # the last chunk is shifted left to end at the last position (no padded copy of ``h``); the positions it
        # repeats weigh 0 there, so nothing is counted twice
        start = jnp.minimum(c * spec.chunk, spec.positions - spec.chunk)
        fresh = start + jnp.arange(spec.chunk) >= c * spec.chunk
        h_c = lax.dynamic_slice_in_dim(h, start, spec.chunk, axis=axis)
        t_c = lax.dynamic_slice_in_dim(t, start, spec.chunk, axis=axis)
        wt_c = jnp.where(fresh, lax.dynamic_slice_in_dim(wt, start, spec.chunk, axis=axis), 0.0)
        # no cast of ``w`` (a float32 copy would be vocabulary-sized); the softmax is computed in ``spec.dtype``
        logits = jnp.matmul(h_c, w, preferred_element_type=h.dtype).astype(spec.dtype)
        lse = jax.nn.logsumexp(logits, axis=-1)
        is_target = vocab_ids == t_c[..., None]  # never true for ids outside the vocabulary: target logit 0
        loss_c = lse - jnp.sum(jnp.where(is_target, logits, 0.0), axis=-1) + spec.z_loss_weight * lse * lse
        total = carry[0] + jnp.sum(wt_c * loss_c, axis=per_group)
        if not grads:
            return (total,)
        _, dh, dw, loss = carry
        # d loss / d logits = softmax * (1 + 2 z lse) - onehot(target), times the token's weight
        coef = wt_c * (1.0 + 2.0 * spec.z_loss_weight * lse)
        dlogits = coef[..., None] * jnp.exp(logits - lse[..., None]) - jnp.where(is_target, wt_c[..., None], 0.0)
        dlogits = dlogits.astype(h.dtype)
        dh_c = jnp.einsum("...cv,ev->...ce", dlogits, w, preferred_element_type=spec.dtype).astype(dh.dtype)
        # the repeated positions of a shifted chunk have dh_c = 0: adding keeps what the previous chunk wrote
        dh_c = lax.dynamic_slice_in_dim(dh, start, spec.chunk, axis=axis) + dh_c
        dh = lax.dynamic_update_slice_in_dim(dh, dh_c, start, axis=axis)
        # fused into the matrix product as its accumulator (C += A B) by XLA:GPU
        dw = dw + jnp.einsum(dw_product, h_c, dlogits, preferred_element_type=dw.dtype)
        loss_c = jnp.where(fresh, loss_c, lax.dynamic_slice_in_dim(loss, start, spec.chunk, axis=axis))
        return total, dh, dw, lax.dynamic_update_slice_in_dim(loss, loss_c, start, axis=axis)

    lead = (spec.groups,) if grouped else ()
    init: tuple[jax.Array, ...] = (jnp.zeros(lead, spec.dtype),)
    if grads:
        init = (*init, jnp.zeros_like(h), jnp.zeros((*lead, *w.shape), w.dtype), jnp.zeros(t.shape, spec.dtype))
    out = lax.fori_loop(0, spec.num_chunks, visit, init)
    if not grouped:
        return tuple(out)
    total = jnp.sum(out[0])
    if not grads:
        return (total,)
    # the groups' gradients are added in their dtype: across devices, one all-reduce of the size of ``w`` (bfloat16 for
    # a bfloat16 model, like the other weights' gradients)
    return total, out[1], jnp.sum(out[2], axis=0, dtype=w.dtype), out[3]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused_ce(spec: _FusedSpec, h: jax.Array, w: jax.Array, t: jax.Array, wt: jax.Array) -> jax.Array:
    return _fused_chunks(spec, h, w, t, wt, grads=False)[0]


def _fused_ce_fwd(
    spec: _FusedSpec, h: jax.Array, w: jax.Array, t: jax.Array, wt: jax.Array
) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    total, dh, dw, loss = _fused_chunks(spec, h, w, t, wt, grads=True)
    # the gradients are the residuals: the backward pass only scales them by the (scalar) cotangent
    return total, (dh, dw, loss)


def _fused_ce_bwd(spec: _FusedSpec, res: tuple[jax.Array, ...], g: jax.Array) -> tuple[Any, ...]:
    dh, dw, loss = res

    def scaled(x: jax.Array) -> jax.Array:
        return (x.astype(spec.dtype) * g).astype(x.dtype)

    return scaled(dh), scaled(dw), None, scaled(loss)


_fused_ce.defvjp(_fused_ce_fwd, _fused_ce_bwd)


def _axis_shards(axis: Axis) -> int:
    """How many shards ``axis`` is split into under the current axis mapping and mesh (1 without either)."""
    try:
        return hax.partitioning.physical_axis_size(axis) or 1
    except ValueError:  # no mesh (nothing is split), or a mapping the mesh lacks (sharding the inputs reports it)
        return 1


def _fused_groups(where: str, others: tuple[Axis, ...], groups: int | None) -> tuple[Axis | None, int]:
    """The token axis to split into groups and the number of groups of :func:`fused_cross_entropy_loss`."""
    if groups is None:
        for ax in others:
            shards = _axis_shards(ax)
            if shards > 1 and ax.size % shards == 0:
                return ax, shards
        return None, 1
    if groups < 1:
        raise ValueError(f"{where}: groups must be >= 1, got {groups}")
    if groups == 1:
        return None, 1
    if not others or others[0].size % groups:
        raise ValueError(
            f"{where}: groups={groups} must divide the first token axis other than the positions; got {others}"
        )
    return others[0], groups


def _fused_chunk_size(vocab: int, tokens_per_position: int, positions: int) -> int:
    """The default positions per chunk: ``FUSED_LOSS_CHUNK_ELEMENTS`` logits, rounded down to a power of two."""
    budget = max(1, FUSED_LOSS_CHUNK_ELEMENTS // vocab // tokens_per_position)
    return min(1 << (budget.bit_length() - 1), positions)


def fused_cross_entropy_loss(
    hidden: NamedArray,
    lm_head: NamedArray,
    targets: NamedArray,
    *,
    weights: NamedArray | None = None,
    reduction: str = "mean",
    z_loss_weight: float = 0.0,
    chunk_size: int | None = None,
    Pos: AxisSelector = "position",
    dtype: Any = jnp.float32,
    groups: int | None = None,
) -> NamedArray:
    """The reduced cross-entropy of ``logits = hidden · lm_head``, its gradient computed with the loss.

    The positions are processed ``chunk_size`` at a time over the whole vocabulary. For each chunk the forward pass
    of the gradient computes the logits, the loss and at once the gradient wrt the logits, and from it the chunk's
    gradient wrt ``hidden`` and its share of the gradient wrt ``lm_head``: three matrix products over the vocabulary
    in all (the plain loss's count), where :func:`blockwise_cross_entropy_loss` recomputes the logits in its backward
    pass (four). At most one chunk's logits exist at a time; the gradients wrt ``hidden`` and ``lm_head`` are kept
    from the forward to the backward pass (the backward pass scales them by the cotangent). Without a gradient only
    the loss is computed. The loss of a token is ``lse - logits[target] + z_loss_weight * lse**2``.

    Args:
        hidden: ``(..., Pos, ..., Embed)`` hidden states (e.g. :meth:`LmHeadModel.activations`), of any float dtype
            (kept: with bfloat16 inputs the matrix products accumulate in float32 and return bfloat16, like the
            plain loss's logits; the softmax is computed in ``dtype``).
        lm_head: the output projection over ``(Embed, Vocab)`` in either order; ``Embed`` is the axis it shares with
            ``hidden``. Its gradient has its dtype and is summed over the chunks in it.
        targets: integer target ids with exactly ``hidden``'s axes minus ``Embed`` (ids outside the vocabulary
            contribute a target logit of 0).
        weights: per-token weights with ``targets``' axes or some of them (broadcast), e.g. the loss mask
            (None: all 1).
        reduction: ``"sum"`` (of ``weights * loss``) or ``"mean"`` (that sum divided by ``sum(weights)``, at least
            1: with a 0/1 mask, the mean over the unmasked tokens).
        z_loss_weight: the z-loss weight (0: none).
        chunk_size: positions per chunk (clipped to the length of ``Pos``; the last chunk overlaps the one before it
            when the length is not a multiple, its repeated positions weighing 0). None:
            :data:`FUSED_LOSS_CHUNK_ELEMENTS` logits per chunk, i.e. that divided by the vocabulary size and by the
            tokens per position (the other token axes, e.g. the batch), rounded down to a power of two.
        Pos: the position axis, the one sliced into chunks (the others, e.g. a sharded batch, are never sliced).
        dtype: the computation dtype of the softmax and the loss.
        groups: how many groups to split the first sharded token axis into (e.g. the batch over data-parallel
            devices), each summing its own loss and projection gradient over all chunks, the groups' sums added once
            at the end. With one group per shard no device waits on another inside the loop: with a single group, a
            batch sharded over devices has its projection gradient (``[embed, vocab]``) reduced across them once per
            chunk. None: the number of shards of the token axes under the current
            :func:`ponente.namedtensor.partitioning.axis_mapping` and mesh (the first token axis other than ``Pos``
            that is split, if its size is a multiple of its shards), else 1. The default chunk then counts the tokens
            per position of one group.

    Returns:
        The loss, a scalar NamedArray of ``dtype``.

    Raises:
        ValueError: if ``lm_head`` is not two axes, one shared with ``hidden``, if ``targets``' axes are not
            ``hidden``'s minus ``Embed``, if ``weights`` has other axes, if ``Pos`` is not one of them, for a
            ``reduction`` other than ``"mean"``/``"sum"``, for a ``chunk_size`` below 1, or for ``groups`` below 1 or
            not dividing the first token axis other than ``Pos``.

    Example:
        >>> import jax, ponente.namedtensor as hax
        >>> Batch, Pos, Embed, Vocab = hax.make_axes(batch=2, position=5, embed=8, vocab=50)
        >>> h = hax.random.normal(jax.random.key(0), (Batch, Pos, Embed))
        >>> w = hax.random.normal(jax.random.key(1), (Embed, Vocab))
        >>> t = hax.random.randint(jax.random.key(2), (Batch, Pos), 0, Vocab.size)
        >>> fused_cross_entropy_loss(h, w, t, chunk_size=2).shape
        {}
    """
    where = "fused_cross_entropy_loss"
    if reduction not in ("mean", "sum"):
        raise ValueError(f"{where}: reduction must be 'mean' or 'sum', got {reduction!r}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"{where}: chunk_size must be >= 1, got {chunk_size}")
    Embed, Vocab, token_axes = _loss_axes(where, hidden, lm_head, targets)
    pos_name = Pos if isinstance(Pos, str) else Pos.name
    Position = next((ax for ax in token_axes if ax.name == pos_name), None)
    if Position is None:
        raise ValueError(f"{where}: Pos {pos_name!r} must be one of hidden's token axes {token_axes}")
    if weights is None:
        weights = hax.ones(token_axes, dtype=dtype)
    elif not {ax.name for ax in weights.axes} <= {ax.name for ax in token_axes}:
        raise ValueError(f"{where}: weights must have (some of) targets' axes {token_axes}; got {weights.axes}")
    else:
        weights = hax.broadcast_to(weights, token_axes)
    # the position axis last among the token axes (a no-op for the usual (batch, position, embed) layout); the other
    # token axes stay separate dimensions
    others = tuple(ax for ax in token_axes if ax.name != Position.name)
    Split, n_groups = _fused_groups(where, others, groups)
    if Split is not None:
        others = (Split, *(ax for ax in others if ax.name != Split.name))
    order = (*others, Position)
    common = jnp.promote_types(hidden.dtype, lm_head.dtype)
    h = hidden.rearrange((*order, Embed)).array.astype(common)
    w = lm_head.rearrange((Embed, Vocab)).array.astype(common)
    t = targets.rearrange(order).array.astype(jnp.int32)
    wt = weights.rearrange(order).array.astype(dtype)
    if reduction == "mean":
        wt = wt / jnp.maximum(jnp.sum(wt), 1.0)
    per_position = int(np.prod([ax.size for ax in others], dtype=np.int64))
    # one leading group axis, split off the first token axis (the one that is sharded; ``order`` puts it first)
    if n_groups > 1:
        h, t, wt = (x.reshape(n_groups, x.shape[0] // n_groups, *x.shape[1:]) for x in (h, t, wt))
    chunk = (
        _fused_chunk_size(Vocab.size, per_position // n_groups, Position.size)
        if chunk_size is None
        else min(chunk_size, Position.size)
    )
    spec = _FusedSpec(
        chunk=chunk,
        positions=Position.size,
        z_loss_weight=float(z_loss_weight),
        dtype=jnp.dtype(dtype),
        groups=n_groups,
    )
    return NamedArray(_fused_ce(spec, h, w, t, wt), ())


def cross_entropy_block_size(model: LmHeadModel, block_size: int | str | None = "auto") -> int | None:
    """The vocabulary block of the loss of ``model``: ``block_size`` itself, or what ``"auto"`` means for it.

    ``"auto"`` is :data:`FUSED_LOSS_BLOCK_SIZE` (a loss without the full logits) when the model's vocabulary has at
    least :data:`FUSED_LOSS_MIN_VOCAB` entries and the model supports the blockwise loss
    (:meth:`LmHeadModel.blockwise_loss_support`; e.g. not with Gemma 2's final logit soft cap), else None (the
    plain loss over materialized logits). For that ``"auto"``, :func:`compute_next_token_loss` reduces ``"mean"`` and
    ``"sum"`` with :func:`fused_cross_entropy_loss` (position chunks, no block size) and uses the vocabulary block
    only for ``"none"``.

    Args:
        model: the model.
        block_size: ``"auto"``, a block size (the blockwise loss), or None (the plain loss).

    Returns:
        The block size, or None for the plain loss.

    Raises:
        ValueError: for a string other than ``"auto"``.
    """
    if not isinstance(block_size, str):
        return block_size
    if block_size != "auto":
        raise ValueError(f"cross-entropy block_size must be an int, None or 'auto', got {block_size!r}")
    if model.Vocab.size < FUSED_LOSS_MIN_VOCAB or model.blockwise_loss_support() is not None:
        return None
    return FUSED_LOSS_BLOCK_SIZE


def compute_next_token_loss(
    model: LmHeadModel,
    example: LmExample,
    *,
    key: jax.Array | None = None,
    logsumexp_weight: float | None = None,
    loss_dtype: Any = jnp.float32,
    reduction: str = "mean",
    block_size: int | str | None = "auto",
) -> NamedArray:
    """Next-token cross-entropy of ``model`` on ``example`` (masked), with an optional z-loss.

    The loss at position ``i`` is ``logsumexp(logits_i) - logits_i[tokens_{i+1}]``, plus
    ``logsumexp_weight * logsumexp(logits_i)**2`` if a z-loss weight is given. With ``block_size``, the
    loss is computed from the model's hidden states and output projection without the ``(..., position, vocab)``
    logits: with ``"auto"`` (above the vocabulary threshold) and ``"mean"``/``"sum"``, by
    :func:`fused_cross_entropy_loss` (chunks of positions, the gradient computed with the loss); with a number, or
    for ``"none"``, one vocabulary block at a time (:func:`blockwise_cross_entropy_loss`).
    The model's auxiliary losses (:meth:`LmHeadModel.logits_and_aux`, e.g. an MoE load-balancing
    term) are added to the ``"mean"`` and ``"sum"`` results; ``"none"`` returns the cross-entropy only.
    :func:`compute_next_token_loss_and_aux` also returns them, for logging.

    Args:
        model: the model.
        example: tokens, loss mask, attention mask and positions (``example.pos_ids``, passed to the model when
            not None).
        key: PRNG key passed to the model.
        logsumexp_weight: z-loss weight (None or 0: no z-loss).
        loss_dtype: dtype of the loss computation.
        reduction: ``"mean"`` (over unmasked positions), ``"sum"``, or ``"none"`` (per-position, masked).
        block_size: vocabulary block size of the blockwise loss (None: materialize the logits; ``"auto"``:
            from :data:`FUSED_LOSS_MIN_VOCAB` entries on, where the model supports it, the fused loss, or the
            blockwise one for ``"none"``, see :func:`cross_entropy_block_size`). A number needs a model implementing
            :meth:`LmHeadModel.activations` and :meth:`LmHeadModel.get_lm_head`.

    Returns:
        A scalar NamedArray (or per-position losses for ``"none"``).

    Raises:
        ValueError: for an unknown ``reduction`` or ``block_size`` string.
        NotImplementedError: with a numeric ``block_size``, for a model without ``activations``/``get_lm_head``.
    """
    return compute_next_token_loss_and_aux(
        model,
        example,
        key=key,
        logsumexp_weight=logsumexp_weight,
        loss_dtype=loss_dtype,
        reduction=reduction,
        block_size=block_size,
    )[0]


def compute_next_token_loss_and_aux(
    model: LmHeadModel,
    example: LmExample,
    *,
    key: jax.Array | None = None,
    logsumexp_weight: float | None = None,
    loss_dtype: Any = jnp.float32,
    reduction: str = "mean",
    block_size: int | str | None = "auto",
) -> tuple[NamedArray, dict[str, NamedArray]]:
    """:func:`compute_next_token_loss` (same arguments), also returning the model's auxiliary losses.

    Returns:
        ``(loss, {name: weighted scalar term})``; for ``"mean"`` and ``"sum"`` the loss already includes
        the terms, for ``"none"`` it does not.

    Raises:
        ValueError: for an unknown ``reduction``.
        NotImplementedError: with ``block_size``, for a model without ``activations``/``get_lm_head``.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"compute_next_token_loss: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    Pos = example.tokens.resolve_axis("position")
    targets = hax.roll(example.tokens, -1, Pos)
    resolved = cross_entropy_block_size(model, block_size)
    mask = example.loss_mask.astype(loss_dtype)
    fused = resolved is not None and block_size == "auto" and reduction != "none"
    if resolved is not None:
        hidden, aux = model.activations_and_aux(
            example.tokens, example.attn_mask, key=key, **_pos_ids_kwargs(example.pos_ids)
        )
    if fused:
        # the fused loss reduces in its own pass: its gradient costs no recomputation of the logits
        total = fused_cross_entropy_loss(
            hidden,
            model.get_lm_head(),
            targets,
            weights=mask,
            reduction=reduction,
            z_loss_weight=logsumexp_weight or 0.0,
            Pos=Pos,
            dtype=loss_dtype,
        )
    else:
        if resolved is not None:
            loss = blockwise_cross_entropy_loss(
                hidden,
                model.get_lm_head(),
                targets,
                block_size=resolved,
                z_loss_weight=logsumexp_weight or 0.0,
                dtype=loss_dtype,
            )
        else:
            logits, aux = model.logits_and_aux(
                example.tokens, example.attn_mask, key=key, **_pos_ids_kwargs(example.pos_ids)
            )
            logits = logits.astype(loss_dtype)
            Vocab = model.Vocab
            lse = hax.nn.logsumexp(logits, Vocab)
            target_logits = hax.sum(logits * hax.nn.one_hot(targets, Vocab, dtype=loss_dtype), Vocab)
            loss = lse - target_logits
            if logsumexp_weight:
                loss = loss + logsumexp_weight * lse * lse
        loss = loss * mask
        if reduction == "none":
            return loss, aux
        total = hax.sum(loss)
        if reduction == "mean":
            total = total / hax.maximum(hax.sum(mask), 1.0)
    for term in aux.values():
        total = total + term.astype(loss_dtype)
    return total, aux
