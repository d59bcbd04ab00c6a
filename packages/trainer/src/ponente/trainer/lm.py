"""The language-model task of the trainer: packed NumPy rows to named batches, and the next-token loss."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

import ponente.namedtensor as hax
from ponente.models import LmExample, compute_next_token_loss_and_aux

__all__ = ["lm_batch", "lm_loss_fn"]

BATCH_AXES = ("batch", "position")


def lm_batch(rows: Mapping[str, np.ndarray]) -> dict[str, hax.NamedArray]:
    """Turn packed rows (``[batch, position]`` arrays) into named arrays plus a prediction-aligned loss mask.

    Position ``i`` predicts token ``i + 1``; it counts only when that token exists and belongs to the same
    document (segment), so no loss crosses a document boundary. Rows of supervised and chat data (see
    :class:`~ponente.datacache.PackedExampleDataset`) also carry a *target-aligned* ``loss_mask`` (1 where the
    token is a training target) and ``position_ids``: then position ``i`` counts only if, in addition,
    token ``i + 1`` is a target, and ``position_ids`` is passed on to the model. The mask travels with the
    batch, so the loss is the mean over trained tokens and gradient accumulation can weight each microbatch
    by its number of loss tokens.

    Args:
        rows: int arrays of shape ``[batch, position]``: ``input_ids`` and ``segment_ids``, optionally
            ``loss_mask`` (target-aligned) and ``position_ids``.

    Returns:
        ``{"input_ids", "segment_ids", "loss_mask"}`` (+ ``"position_ids"`` when given) as NamedArrays over
        ``(batch, position)``; ``loss_mask`` is prediction-aligned float32.

    Raises:
        ValueError: if the arrays are not 2-D or their shapes differ.

    Example:
        >>> import numpy as np
        >>> b = lm_batch({"input_ids": np.array([[5, 6, 7, 8]]), "segment_ids": np.array([[0, 0, 1, 1]])})
        >>> b["loss_mask"].array.tolist()
        [[1.0, 0.0, 1.0, 0.0]]
        >>> b = lm_batch(
        ...     {
        ...         "input_ids": np.array([[5, 6, 7, 0]]),
        ...         "segment_ids": np.array([[0, 0, 0, -1]]),
        ...         "loss_mask": np.array([[0, 0, 1, 0]]),
        ...         "position_ids": np.array([[0, 1, 2, 0]]),
        ...     }
        ... )
        >>> b["loss_mask"].array.tolist()  # only the prediction of token 2 (position 1) trains
        [[0.0, 1.0, 0.0, 0.0]]
    """
    ids = np.asarray(rows["input_ids"], dtype=np.int32)
    seg = np.asarray(rows["segment_ids"], dtype=np.int32)
    optional = {key: np.asarray(rows[key], dtype=np.int32) for key in ("loss_mask", "position_ids") if key in rows}
    if ids.ndim != 2 or any(a.shape != ids.shape for a in (seg, *optional.values())):
        shapes = {key: np.shape(rows[key]) for key in ("input_ids", "segment_ids", *optional)}
        raise ValueError(f"lm_batch: every array must be [batch, position] of one shape, got {shapes}")
    mask = np.zeros(ids.shape, dtype=np.float32)
    mask[:, :-1] = seg[:, 1:] == seg[:, :-1]
    if "loss_mask" in optional:
        mask[:, :-1] *= optional["loss_mask"][:, 1:] != 0
    batch = {
        "input_ids": hax.named(ids, BATCH_AXES),
        "segment_ids": hax.named(seg, BATCH_AXES),
        "loss_mask": hax.named(mask, BATCH_AXES),
    }
    if "position_ids" in optional:
        batch["position_ids"] = hax.named(optional["position_ids"], BATCH_AXES)
    return batch


def lm_example(batch: Mapping[str, hax.NamedArray]) -> LmExample:
    """The causal :class:`~ponente.models.LmExample` of a batch made by :func:`lm_batch` (segments kept apart,
    positions restarting per example when the batch has ``position_ids``)."""
    return LmExample.causal(
        batch["input_ids"],
        loss_mask=batch["loss_mask"],
        segment_ids=batch["segment_ids"],
        pos_ids=batch.get("position_ids"),
    )


def lm_loss_fn(z_loss_weight: float = 0.0, block_size: int | str | None = "auto") -> Callable[..., Any]:
    """The training loss ``loss_fn(model, batch, *, key)``: next-token cross-entropy (+ z-loss, + aux losses).

    Args:
        z_loss_weight: weight of ``logsumexp(logits)**2`` (0: none).
        block_size: compute the loss blockwise over this many vocabulary entries (None: plain; ``"auto"``:
            blockwise for large vocabularies, see :func:`ponente.models.loss.cross_entropy_block_size`).

    Returns:
        The loss function for :class:`~ponente.trainer.trainer.Trainer`.
    """

    def loss_fn(model: Any, batch: Mapping[str, hax.NamedArray], *, key: Any) -> Any:
        loss, aux = compute_next_token_loss_and_aux(
            model, lm_example(batch), key=key, logsumexp_weight=z_loss_weight or None, block_size=block_size
        )
        # auxiliary terms (e.g. a MoE router's load-balancing loss) are already in ``loss``; they are also
        # returned by name so that the trainer logs them
        return (loss, aux) if aux else loss

    return loss_fn
