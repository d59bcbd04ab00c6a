"""The language-model interface: :class:`LmHeadModel` (token ids to logits) and :class:`LmExample` (one batch).

The losses computed from them live in :mod:`ponente.models.loss` (``compute_next_token_loss`` and its kernels).
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from typing import Any, ClassVar, Generic, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import ponente.namedtensor as hax
from ponente.namedtensor import Axis, NamedArray
from ponente.namedtensor.state_dict import (
    ModuleWithStateDictSerialization,
    from_torch_compatible_state_dict,
    to_torch_compatible_state_dict,
)

from .attention import AttentionMask, KvCache

__all__ = ["LmExample", "LmHeadModel", "is_aux_loss"]


def is_aux_loss(name: str) -> bool:
    """Whether the auxiliary entry ``name`` (see :meth:`LmHeadModel.logits_and_aux`) is a loss term, added to the
    objective, rather than a diagnostic that is only logged: diagnostics are named ``<group>/<metric>``
    (e.g. ``router/expert_load_max``), loss terms have no ``/`` (e.g. ``router_aux_loss``).

    Example:
        >>> is_aux_loss("router_aux_loss"), is_aux_loss("router/z_loss")
        (True, False)
    """
    return "/" not in name


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
            A zero :class:`~ponente.models.KvCache` over ``(layers, batch, kv_heads, cache_position,
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
        (:meth:`~ponente.models.KvCache.for_prefill`) to attend with the forward's attention backend.

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

        Auxiliary losses are named scalar terms, already weighted, that :func:`~ponente.models.compute_next_token_loss`
        adds to the objective (e.g. a mixture of experts' ``router_aux_loss``); entries named ``<group>/<metric>``
        are diagnostics, logged but not added (see :func:`is_aux_loss`). Models without any keep
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
        targets: the token each position predicts, over the tokens' axes; None: the next token along ``position``
            (set when the ``position`` axis is permuted, see :mod:`ponente.models.context_parallel`).
    """

    tokens: NamedArray
    loss_mask: NamedArray
    attn_mask: AttentionMask
    pos_ids: NamedArray | None = None
    targets: NamedArray | None = None

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
