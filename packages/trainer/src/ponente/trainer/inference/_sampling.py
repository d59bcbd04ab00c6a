"""Choosing the next token of each row from its logits: greedy, temperature, top-k, top-p, with log-probs."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ._config import GenerationConfig

__all__ = ["SamplingParams", "sample_next"]


class SamplingParams(eqx.Module):
    """Per-row sampling settings as arrays over the batch (rows of one batch may differ).

    Attributes:
        temperature: ``(batch,)`` float32; 0 is greedy.
        top_k: ``(batch,)`` int32; 0 keeps every token.
        top_p: ``(batch,)`` float32; 1 keeps every token.
        keys: ``(batch, 2)`` uint32 raw PRNG keys, one per row (from its seed).
        tempered: ``(batch,)`` bool: report the row's log-probs under ``logits / temperature``
            (:attr:`GenerationConfig.tempered_logprobs`).
        filtered: whether any row uses ``top_k``/``top_p`` (static: rows without filters skip the sort).
        greedy: whether every row is greedy (static: no random draw at all).
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    keys: jax.Array
    tempered: jax.Array
    filtered: bool = eqx.field(static=True)
    greedy: bool = eqx.field(static=True)

    @staticmethod
    def of(
        configs: Sequence[GenerationConfig | None],
        *,
        key: Callable[[int], np.ndarray] | None = None,
    ) -> SamplingParams:
        """The settings of a batch; None rows (padding of the batch) are greedy.

        Args:
            configs: one config per row.
            key: the raw PRNG key of a seed (e.g. a cached one); None: ``jax.random.PRNGKey(seed)``.

        Returns:
            Host (NumPy) arrays; the jitted step moves them to the devices.
        """
        rows = [c or GenerationConfig() for c in configs]
        key_of = key or (lambda seed: np.asarray(jax.random.PRNGKey(seed), np.uint32))
        return SamplingParams(
            temperature=np.asarray([c.temperature for c in rows], np.float32),  # type: ignore[arg-type]
            top_k=np.asarray([c.top_k or 0 for c in rows], np.int32),  # type: ignore[arg-type]
            top_p=np.asarray([c.top_p or 1.0 for c in rows], np.float32),  # type: ignore[arg-type]
            keys=np.stack([key_of(c.seed) for c in rows]),  # type: ignore[arg-type]
            tempered=np.asarray([c.tempered_logprobs for c in rows], np.bool_),  # type: ignore[arg-type]
            filtered=any(c.top_k is not None or c.top_p is not None for c in rows),
            greedy=all(c.temperature == 0 for c in rows),
        )


def sample_next(logits: jax.Array, params: SamplingParams, steps: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The next token of each row and its log-probability.

    Temperature divides the logits; then ``top_k`` keeps the k most likely tokens and ``top_p`` the most
    likely ones whose renormalized probabilities reach ``top_p`` (the first always stays), as ``transformers``
    orders them. The draw of row ``b`` uses ``fold_in(keys[b], steps[b])``, so it depends only on that row's
    seed and how many tokens it generated, not on the other rows.

    Args:
        logits: ``(batch, vocab)`` logits (any float dtype; computed in float32).
        params: the per-row settings.
        steps: ``(batch,)`` int32: how many tokens each row has generated before this one.

    Returns:
        ``(tokens, logprobs)``: ``(batch,)`` int32 ids and ``(batch,)`` float32 log-probabilities of those ids under
        the unmodified distribution ``log_softmax(logits)``, or, for the rows with ``tempered`` and a temperature
        above 0, under the tempered one ``log_softmax(logits / temperature)`` (before ``top_k``/``top_p``).
    """
    logits = logits.astype(jnp.float32)
    best = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if params.greedy:
        tokens = best
    else:
        temperature = jnp.where(params.temperature > 0, params.temperature, 1.0)
        scores = logits / temperature[:, None]
        keys = jax.vmap(jax.random.fold_in)(params.keys, steps)
        drawn = jax.vmap(jax.random.categorical)(keys, scores).astype(jnp.int32)
        if params.filtered:  # rows without top_k/top_p keep the plain draw: a row's token ignores the other rows
            row_filtered = (params.top_k > 0) | (params.top_p < 1)
            drawn = jnp.where(row_filtered, _sample_filtered(scores, params, keys), drawn)
        tokens = jnp.where(params.temperature > 0, drawn, best)
    # untempered rows divide by 1.0, which is exact: their log-probs are bitwise those of log_softmax(logits)
    divisor = jnp.where(params.tempered & (params.temperature > 0), params.temperature, 1.0)
    logprobs = jax.nn.log_softmax(logits / divisor[:, None], axis=-1)
    return tokens, jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]


def _sample_filtered(scores: jax.Array, params: SamplingParams, keys: jax.Array) -> jax.Array:
    """Draw among the tokens that ``top_k`` and ``top_p`` keep (on the scores sorted in decreasing order)."""
    vocab = scores.shape[-1]
    order = jnp.argsort(-scores, axis=-1)
    ranked = jnp.take_along_axis(scores, order, axis=-1)
    rank = jnp.arange(vocab)[None, :]
    k = jnp.where(params.top_k > 0, params.top_k, vocab)[:, None]
    ranked = jnp.where(rank < k, ranked, -jnp.inf)
    probs = jax.nn.softmax(ranked, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # the mass of the more likely tokens
    ranked = jnp.where((before < params.top_p[:, None]) | (rank == 0), ranked, -jnp.inf)
    picked = jax.vmap(jax.random.categorical)(keys, ranked)
    return jnp.take_along_axis(order, picked[:, None], axis=-1)[:, 0].astype(jnp.int32)
