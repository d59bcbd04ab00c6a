"""The next-token loss of a language model, and which cross-entropy computes it (``block_size``)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

import ponente.namedtensor as hax
from ponente.namedtensor import NamedArray

from ..lm import LmExample, LmHeadModel, _pos_ids_kwargs, is_aux_loss
from .blockwise import blockwise_cross_entropy_loss
from .fused import fused_cross_entropy_loss

__all__ = [
    "FUSED_LOSS_BLOCK_SIZE",
    "FUSED_LOSS_MIN_VOCAB",
    "compute_next_token_loss",
    "compute_next_token_loss_and_aux",
    "cross_entropy_block_size",
]

FUSED_LOSS_MIN_VOCAB = 65536
"""With ``block_size="auto"``, the loss is blockwise (fused) from this (padded) vocabulary size on.

At 128k entries the plain loss's float32 logits and their gradient are the memory peak of a training step
(Llama 3: 1 GiB per 2048-token sequence each); below 64k (GPT-2, Llama 2, Mistral) they are small and the plain
loss is faster. The ``loss-memory`` benchmark measures both at vocabulary 128k.
"""

FUSED_LOSS_BLOCK_SIZE = 8192
"""The vocabulary block of the blockwise loss that ``block_size="auto"`` chooses for ``reduction="none"``."""


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
    temperature: float = 1.0,
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
        temperature: the loss of the tempered distribution ``softmax(logits / temperature)`` (> 0; 1: the model's
            own). Without materialized logits the final hidden states are divided instead (the logits are linear in
            them), in the model's compute dtype.

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
        temperature=temperature,
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
    temperature: float = 1.0,
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
    if not temperature > 0:
        raise ValueError(f"compute_next_token_loss: temperature must be > 0, got {temperature}")
    Pos = example.tokens.resolve_axis("position")
    targets = hax.roll(example.tokens, -1, Pos) if example.targets is None else example.targets
    resolved = cross_entropy_block_size(model, block_size)
    mask = example.loss_mask.astype(loss_dtype)
    fused = resolved is not None and block_size == "auto" and reduction != "none"
    if resolved is not None:
        hidden, aux = model.activations_and_aux(
            example.tokens, example.attn_mask, key=key, **_pos_ids_kwargs(example.pos_ids)
        )
        if temperature != 1.0:
            hidden = hidden / temperature
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
            if temperature != 1.0:
                logits = logits / temperature
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
    for name, term in aux.items():
        if is_aux_loss(name):
            total = total + term.astype(loss_dtype)
    return total, aux
