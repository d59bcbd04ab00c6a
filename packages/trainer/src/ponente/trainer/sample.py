"""Sample text from a language model: one compiled loop, no key/value cache (for small models and demos)."""

from __future__ import annotations

from collections.abc import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp

import ponente.namedtensor as hax
from ponente.models import AttentionMask, LmHeadModel

__all__ = ["sample_tokens"]


def sample_tokens(
    model: LmHeadModel,
    prompt: Sequence[int],
    *,
    num_tokens: int,
    key: jax.Array,
    temperature: float = 1.0,
    top_k: int | None = None,
    vocab_size: int | None = None,
) -> list[int]:
    """Continue ``prompt`` by ``num_tokens`` tokens drawn from ``model``.

    Each step runs the model over a window of ``model.config.seq_len`` tokens (the most recent ones once
    the text is longer) and draws the next token from the logits at the last filled position. No
    key/value cache is kept, so this is meant for small models, demos and tests, not serving.

    Args:
        model: the language model.
        prompt: token ids to continue (at least one).
        num_tokens: how many tokens to generate.
        key: PRNG key for sampling.
        temperature: softmax temperature; ``0`` picks the most likely token (greedy).
        top_k: if set, sample only among the ``top_k`` most likely tokens.
        vocab_size: the tokenizer's vocabulary size when the model's vocab axis is padded; ids at or
            above it are never produced.

    Returns:
        The generated ids (without the prompt).

    Raises:
        ValueError: for an empty prompt, negative ``num_tokens``/``temperature`` or a bad ``top_k``.
    """
    if len(prompt) == 0:
        raise ValueError("sample_tokens: the prompt must contain at least one token")
    if num_tokens < 0 or temperature < 0:
        raise ValueError(f"sample_tokens: num_tokens ({num_tokens}) and temperature ({temperature}) must be >= 0")
    Vocab = model.Vocab
    if top_k is not None and not 0 < top_k <= Vocab.size:
        raise ValueError(f"sample_tokens: top_k must be in [1, {Vocab.size}], got {top_k}")
    if num_tokens == 0:
        return []
    Pos = model.config.Pos
    window = Pos.size
    context = list(prompt)[-window:]
    buf = jnp.zeros((window,), jnp.int32).at[: len(context)].set(jnp.asarray(context, jnp.int32))
    tokens = _sample_loop(
        model, buf, jnp.int32(len(context)), key, num_tokens, float(temperature), top_k, vocab_size or Vocab.size
    )
    return [int(t) for t in jax.device_get(tokens)]


@eqx.filter_jit
def _sample_loop(
    model: LmHeadModel,
    buf: jax.Array,
    length: jax.Array,
    key: jax.Array,
    num_tokens: int,
    temperature: float,
    top_k: int | None,
    vocab_size: int,
) -> jax.Array:
    Pos = model.config.Pos
    window = Pos.size
    allowed = jnp.arange(model.Vocab.size) < vocab_size

    def step(
        carry: tuple[jax.Array, jax.Array, jax.Array], _: None
    ) -> tuple[tuple[jax.Array, jax.Array, jax.Array], jax.Array]:
        buf, length, key = carry
        logits = model(hax.named(buf, Pos), AttentionMask.causal()).array
        last = jnp.where(allowed, logits[length - 1].astype(jnp.float32), -jnp.inf)
        key, sub = jax.random.split(key)
        if temperature == 0:
            token = jnp.argmax(last).astype(jnp.int32)
        else:
            scores = last / temperature
            if top_k is not None:
                threshold = jax.lax.top_k(scores, top_k)[0][-1]
                scores = jnp.where(scores >= threshold, scores, -jnp.inf)
            token = jax.random.categorical(sub, scores).astype(jnp.int32)
        full = length >= window
        # a full window slides left by one; otherwise the token is written after the last filled position
        buf = jnp.where(full, jnp.roll(buf, -1), buf)
        buf = buf.at[jnp.where(full, window - 1, length)].set(token)
        return (buf, jnp.minimum(length + 1, window), key), token

    _, tokens = jax.lax.scan(step, (buf, length, key), None, length=num_tokens)
    return tokens
