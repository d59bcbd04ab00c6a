"""The axes of a loss of ``logits = hidden · lm_head``, checked once for both cross-entropy kernels."""

from __future__ import annotations

from ponente.namedtensor import Axis, NamedArray

__all__ = ["loss_axes"]


def loss_axes(
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
