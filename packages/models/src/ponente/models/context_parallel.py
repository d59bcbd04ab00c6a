"""Context parallelism: the ``position`` axis of activations split over devices, balanced for causal attention.

With a causal mask, the last positions of a sequence attend to many more keys than the first ones; splitting the
sequence into ``n`` contiguous blocks would leave the last device with most of the attention work. The *zig-zag*
split cuts the sequence into ``2n`` chunks and gives device ``i`` chunks ``i`` and ``2n - 1 - i``, so every device
gets the same share of the causal work.

:func:`zigzag_example` applies that order once, to a whole :class:`~ponente.models.LmExample`: tokens, targets (taken
before the permutation, so every position still predicts its own next token), loss mask, positions (explicit, so
rotary and learned position embeddings see the original positions) and segment ids; the attention mask gets the
original token index of every position (:attr:`~ponente.models.AttentionMask.token_index`), so causality, sliding
windows and packed documents are exact. The loss, a masked mean over positions, is unchanged by the permutation.
A contiguous split of the permuted ``position`` axis over the devices (the compute mapping ``position -> context``)
then is the zig-zag split; each device holds its ``1/n`` of the query rows, and the keys and values are gathered over
the context axis by the compiler (``"allgather"``, the small operands with grouped-query attention) or passed
around the ring of devices (``"ring"``, :func:`~ponente.models.attention.ring.ring_attention`), as
``model.attention_context_parallel`` says.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

import ponente.namedtensor as hax
from ponente.namedtensor import NamedArray

from .attention import AttentionMask
from .attention.ring import ATTENTION_CONTEXT_PARALLEL
from .lm import LmExample

__all__ = ["ATTENTION_CONTEXT_PARALLEL", "check_context_split", "zigzag_example", "zigzag_permutation"]


def check_context_split(seq_len: int, context: int, where: str = "trainer.context_axis_size") -> None:
    """Raise a ValueError naming ``where`` unless ``seq_len`` divides into ``2 * context`` equal chunks.

    Example:
        >>> check_context_split(512, 4)
        >>> check_context_split(100, 4)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: trainer.context_axis_size=4: the sequence length 100 (model.seq_len) must divide by 2 x 4 = 8 ...
    """
    if context < 1:
        raise ValueError(f"{where} must be >= 1, got {context}")
    if context > 1 and seq_len % (2 * context):
        raise ValueError(
            f"{where}={context}: the sequence length {seq_len} (model.seq_len) must divide by 2 x {context} = "
            f"{2 * context} (the zig-zag split)"
        )


def zigzag_permutation(seq_len: int, context: int) -> np.ndarray:
    """The zig-zag order of ``seq_len`` positions over ``context`` devices: entry ``j`` is the original index of the
    token at permuted position ``j``.

    Example:
        >>> zigzag_permutation(8, 2).tolist()
        [0, 1, 6, 7, 2, 3, 4, 5]
    """
    check_context_split(seq_len, context)
    chunk = seq_len // (2 * context)
    chunks = np.arange(seq_len).reshape(2 * context, chunk)
    order = [c for i in range(context) for c in (i, 2 * context - 1 - i)]
    return chunks[order].reshape(-1)


def _permute(x: NamedArray, perm: jnp.ndarray, name: str) -> NamedArray:
    return hax.named(jnp.take(x.array, perm, axis=x.axis_indices(name)), x.axes)


def zigzag_example(example: LmExample, context: int) -> LmExample:
    """``example`` with its ``position`` axis in zig-zag order for ``context`` devices (see the module).

    Args:
        example: the causal example (an :class:`~ponente.models.AttentionMask`, not an explicit boolean mask).
        context: the number of devices of the context axis (1: ``example`` unchanged).

    Returns:
        The permuted example, with explicit ``targets``, ``pos_ids`` and the mask's ``token_index``.

    Raises:
        ValueError: if the length does not divide by ``2 * context`` (naming ``trainer.context_axis_size``), or the
            mask is an explicit array.
    """
    if context == 1:
        return example
    Pos = example.tokens.resolve_axis("position")
    perm = jnp.asarray(zigzag_permutation(Pos.size, context))
    mask = example.attn_mask
    if not isinstance(mask, AttentionMask):
        raise ValueError(
            "trainer.context_axis_size > 1 needs a structured AttentionMask (causal, sliding window, segment ids), "
            f"got {type(mask).__name__}"
        )
    targets = hax.roll(example.tokens, -1, Pos) if example.targets is None else example.targets
    pos_ids = example.pos_ids if example.pos_ids is not None else hax.arange(Pos)
    index = mask.token_index if mask.token_index is not None else hax.arange(Pos)
    segments = None if mask.segment_ids is None else _permute(mask.segment_ids, perm, Pos.name)
    new_mask = AttentionMask(mask.is_causal, segments, mask.sliding_window, _permute(index, perm, Pos.name))
    return LmExample(
        tokens=_permute(example.tokens, perm, Pos.name),
        loss_mask=_permute(example.loss_mask, perm, Pos.name),
        attn_mask=new_mask,
        pos_ids=_permute(pos_ids, perm, Pos.name),
        targets=_permute(targets, perm, Pos.name),
    )
