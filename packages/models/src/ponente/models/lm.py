"""The language-model interface: :class:`LmHeadModel`, :class:`LmExample` and the next-token loss."""

from __future__ import annotations

import abc
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import ponente.namedtensor as hax
from ponente.namedtensor import Axis, NamedArray
from ponente.namedtensor.state_dict import (
    ModuleWithStateDictSerialization,
    flatten_linear_layers,
    from_state_dict,
    to_torch_compatible_state_dict,
    unflatten_linear_layers,
)

from .attention import AttentionMask

if TYPE_CHECKING:
    from .config import LmConfig

__all__ = ["LmExample", "LmHeadModel", "compute_next_token_loss"]

M = TypeVar("M", bound="LmHeadModel")


class LmHeadModel(ModuleWithStateDictSerialization):
    """A causal language model: token ids ``NamedArray[..., "position"]`` to logits ``[..., "position", "vocab"]``.

    Subclasses are Equinox modules built by their config's ``build``; their state-dict keys are the
    Hugging Face parameter names (see :meth:`to_hf_state_dict`).

    Attributes:
        config: the config this model was built from (a static field of every subclass).
    """

    config: eqx.AbstractVar[LmConfig]

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
    ) -> NamedArray:
        """Compute logits.

        Args:
            input_ids: integer token ids with a ``position`` axis (and any batch axes).
            attn_mask: the attention mask (None: causal).
            key: PRNG key for dropout (unused by deterministic models).

        Returns:
            Logits with the input's axes followed by ``vocab``.
        """

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
        # flatten the template abstractly, so a shape-only template (from ``eqx.filter_eval_shape``) works too
        flat_template = jax.eval_shape(flatten_linear_layers, self)
        return unflatten_linear_layers(self, from_state_dict(flat_template, fixed))


class LmExample(eqx.Module):
    """One (batch of) training example(s): tokens, a loss mask and an attention mask.

    Attributes:
        tokens: integer ids over ``position`` (and batch axes).
        loss_mask: 1.0 where the prediction of the *next* token counts (over the same axes), else 0.
        attn_mask: the attention mask.
    """

    tokens: NamedArray
    loss_mask: NamedArray
    attn_mask: AttentionMask

    @staticmethod
    def causal(tokens: NamedArray, *, loss_mask: NamedArray | None = None, eos_id: int | None = None) -> LmExample:
        """A causal example; with ``eos_id``, documents packed in ``tokens`` get separate segments.

        The last position never has a target, so its loss mask is 0. With ``eos_id``, a token belongs to
        the segment ended by the next EOS (the EOS itself included), so no token attends across a
        document boundary, and the prediction made at an EOS (the next document's first token) is masked.

        Args:
            tokens: integer ids with a ``position`` axis.
            loss_mask: an extra mask multiplied in (None: all ones).
            eos_id: the end-of-sequence id used to derive segments (None: one segment).

        Returns:
            The example.

        Raises:
            ValueError: if ``tokens`` has no ``position`` axis.

        Example:
            >>> import jax.numpy as jnp, ponente.namedtensor as hax
            >>> ex = LmExample.causal(hax.named(jnp.array([5, 6, 0, 7, 8]), "position"), eos_id=0)
            >>> ex.attn_mask.segment_ids.array.tolist(), ex.loss_mask.array.tolist()
            ([0, 0, 0, 1, 1], [1.0, 1.0, 0.0, 1.0, 0.0])
        """
        if not tokens.has_axis("position"):
            raise ValueError(f"LmExample.causal: tokens need a 'position' axis, got axes {tokens.axis_names}")
        Pos = tokens.resolve_axis("position")
        not_last = hax.arange(Pos) < Pos.size - 1
        mask = hax.broadcast_to(not_last.astype(jnp.float32), tokens.axes)
        if loss_mask is not None:
            mask = mask * loss_mask.astype(jnp.float32)
        attn = AttentionMask.causal()
        if eos_id is not None:
            is_eos = (tokens == eos_id).astype(jnp.int32)
            segments = hax.cumsum(is_eos, Pos) - is_eos
            attn = attn.with_segment_ids(segments)
            mask = mask * (1 - is_eos).astype(jnp.float32)
        return LmExample(tokens, mask, attn)


def compute_next_token_loss(
    model: LmHeadModel,
    example: LmExample,
    *,
    key: jax.Array | None = None,
    logsumexp_weight: float | None = None,
    loss_dtype: Any = jnp.float32,
    reduction: str = "mean",
) -> NamedArray:
    """Next-token cross-entropy of ``model`` on ``example`` (masked), with an optional z-loss.

    The loss at position ``i`` is ``logsumexp(logits_i) - logits_i[tokens_{i+1}]``, plus
    ``logsumexp_weight * logsumexp(logits_i)**2`` if a z-loss weight is given.

    Args:
        model: the model.
        example: tokens, loss mask and attention mask.
        key: PRNG key passed to the model.
        logsumexp_weight: z-loss weight (None or 0: no z-loss).
        loss_dtype: dtype of the loss computation.
        reduction: ``"mean"`` (over unmasked positions), ``"sum"``, or ``"none"`` (per-position, masked).

    Returns:
        A scalar NamedArray (or per-position losses for ``"none"``).

    Raises:
        ValueError: for an unknown ``reduction``.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"compute_next_token_loss: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    logits = model(example.tokens, example.attn_mask, key=key).astype(loss_dtype)
    Pos = example.tokens.resolve_axis("position")
    Vocab = model.Vocab
    targets = hax.roll(example.tokens, -1, Pos)
    lse = hax.nn.logsumexp(logits, Vocab)
    target_logits = hax.sum(logits * hax.nn.one_hot(targets, Vocab, dtype=loss_dtype), Vocab)
    loss = lse - target_logits
    if logsumexp_weight:
        loss = loss + logsumexp_weight * lse * lse
    loss = loss * example.loss_mask.astype(loss_dtype)
    if reduction == "none":
        return loss
    total = hax.sum(loss)
    if reduction == "sum":
        return total
    return total / hax.maximum(hax.sum(example.loss_mask.astype(loss_dtype)), 1.0)
