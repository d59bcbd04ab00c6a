"""Word error rate: the word-level edit distance between reference and hypothesis transcripts.

``wer(references, hypotheses)`` is the corpus WER, ``(substitutions + deletions + insertions) / reference words``
summed over all pairs (what ``jiwer.wer`` computes for lists), with words split on whitespace. No text
normalisation is applied: normalise both sides first if case or punctuation should not count.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["edit_distance", "wer", "word_errors"]


def edit_distance(reference: Sequence[str], hypothesis: Sequence[str]) -> int:
    """The Levenshtein distance between two word sequences (substitutions, deletions, insertions each cost 1).

    Example:
        >>> edit_distance("the cat sat".split(), "the cat sat down".split())
        1
    """
    previous = list(range(len(hypothesis) + 1))
    for i, ref_word in enumerate(reference, start=1):
        current = [i] + [0] * len(hypothesis)
        for j, hyp_word in enumerate(hypothesis, start=1):
            current[j] = min(
                previous[j] + 1,  # deletion
                current[j - 1] + 1,  # insertion
                previous[j - 1] + (ref_word != hyp_word),  # substitution or match
            )
        previous = current
    return previous[-1]


def word_errors(reference: str, hypothesis: str) -> tuple[int, int]:
    """``(errors, reference words)`` of one pair: the word edit distance and the reference's word count."""
    ref, hyp = reference.split(), hypothesis.split()
    return edit_distance(ref, hyp), len(ref)


def wer(references: Sequence[str], hypotheses: Sequence[str]) -> float:
    """The corpus word error rate of paired transcripts: total word errors over total reference words.

    Args:
        references: the true transcripts.
        hypotheses: the predicted transcripts, one per reference.

    Returns:
        The WER (0 is perfect; it can exceed 1 when the hypotheses insert many words).

    Raises:
        ValueError: if the lists differ in length, or the references hold no words.

    Example:
        >>> wer(["three one four", "one five"], ["three one", "one five nine"])
        0.4
    """
    if len(references) != len(hypotheses):
        raise ValueError(f"wer: {len(references)} references but {len(hypotheses)} hypotheses")
    errors = words = 0
    for reference, hypothesis in zip(references, hypotheses, strict=True):
        e, n = word_errors(reference, hypothesis)
        errors += e
        words += n
    if words == 0:
        raise ValueError("wer: the references hold no words")
    return errors / words
