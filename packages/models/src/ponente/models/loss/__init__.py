"""The losses of a language model: the next-token cross-entropy and the two kernels that avoid the full logits.

- :func:`compute_next_token_loss` (and :func:`compute_next_token_loss_and_aux`, which also returns the model's
  auxiliary losses): the masked next-token cross-entropy of an :class:`~ponente.models.LmHeadModel` on an
  :class:`~ponente.models.LmExample`, with an optional z-loss; its ``block_size`` picks how (see
  :func:`cross_entropy_block_size`): materialized logits, or from :data:`FUSED_LOSS_MIN_VOCAB` vocabulary entries on
  one of the two kernels below;
- :func:`fused_cross_entropy_loss` (:mod:`~ponente.models.loss.fused`): chunks of positions over the whole
  vocabulary, reduced, the gradient computed with the loss (three matrix products over the vocabulary);
- :func:`blockwise_cross_entropy_loss` (:mod:`~ponente.models.loss.blockwise`): blocks of the vocabulary, per-token
  losses, the logits recomputed in the backward pass (four);
- :func:`sequence_logprobs` and :func:`preference_loss` (:mod:`~ponente.models.loss.preference`): the log-probs of
  responses, and the DPO/IPO/hinge/SimPO losses on those of chosen and rejected responses.
"""

from .blockwise import blockwise_cross_entropy_loss
from .fused import FUSED_LOSS_CHUNK_ELEMENTS, fused_cross_entropy_loss
from .next_token import (
    FUSED_LOSS_BLOCK_SIZE,
    FUSED_LOSS_MIN_VOCAB,
    compute_next_token_loss,
    compute_next_token_loss_and_aux,
    cross_entropy_block_size,
)
from .preference import (
    PREFERENCE_LOSS_TYPES,
    REFERENCE_FREE_LOSS_TYPES,
    SMOOTHED_LOSS_TYPES,
    preference_loss,
    sequence_logprobs,
)

__all__ = [
    "FUSED_LOSS_BLOCK_SIZE",
    "FUSED_LOSS_CHUNK_ELEMENTS",
    "FUSED_LOSS_MIN_VOCAB",
    "PREFERENCE_LOSS_TYPES",
    "REFERENCE_FREE_LOSS_TYPES",
    "SMOOTHED_LOSS_TYPES",
    "blockwise_cross_entropy_loss",
    "compute_next_token_loss",
    "compute_next_token_loss_and_aux",
    "cross_entropy_block_size",
    "fused_cross_entropy_loss",
    "preference_loss",
    "sequence_logprobs",
]
