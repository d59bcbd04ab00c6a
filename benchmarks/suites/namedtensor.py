"""Named vs positional: a transformer block (attention + MLP + layer norm), forward and backward.

Both versions compute the same function with the same shapes and dtype and are jitted; the suite
records each median step time and the median of the per-round ratios named/positional, timed in interleaved
rounds (target <= 1.03: names cost nothing once traced).
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

import ponente.namedtensor as hax
from benchmarks.harness import interleaved_times, round_ratio
from ponente.namedtensor import Axis, NamedArray

if TYPE_CHECKING:
    from benchmarks.harness import Recorder

Batch, Pos, KPos = Axis("batch", 8), Axis("pos", 64), Axis("key_pos", 64)
Embed, Heads, Head, Mlp = Axis("embed", 128), Axis("heads", 4), Axis("head", 32), Axis("mlp", 512)


def _named_params(key: jax.Array) -> dict[str, NamedArray]:
    k = jax.random.split(key, 6)
    scale = Embed.size**-0.5
    return {
        "wq": hax.random.normal(k[0], (Embed, Heads, Head)) * scale,
        "wk": hax.random.normal(k[1], (Embed, Heads, Head)) * scale,
        "wv": hax.random.normal(k[2], (Embed, Heads, Head)) * scale,
        "wo": hax.random.normal(k[3], (Heads, Head, Embed)) * scale,
        "w1": hax.random.normal(k[4], (Embed, Mlp)) * scale,
        "w2": hax.random.normal(k[5], (Mlp, Embed)) * Mlp.size**-0.5,
        "g1": hax.ones(Embed),
        "g2": hax.ones(Embed),
    }


def _named_norm(x: NamedArray, gain: NamedArray) -> NamedArray:
    mean = hax.mean(x, axis=Embed)
    centered = x - mean
    var = hax.mean(centered * centered, axis=Embed)
    return centered / hax.sqrt(var + 1e-5) * gain


def named_block(p: dict[str, NamedArray], x: NamedArray) -> NamedArray:
    """The block written with named axes."""
    h = _named_norm(x, p["g1"])
    q = hax.dot(h, p["wq"], axis=Embed) * Head.size**-0.5
    k = hax.dot(h, p["wk"], axis=Embed).rename({"pos": "key_pos"})
    v = hax.dot(h, p["wv"], axis=Embed).rename({"pos": "key_pos"})
    scores = hax.dot(q, k, axis=Head)
    scores = scores - hax.max(scores, axis=KPos)
    weights = hax.exp(scores)
    weights = weights / hax.sum(weights, axis=KPos)
    attn = hax.dot(weights, v, axis=KPos)
    x = x + hax.dot(attn, p["wo"], axis=(Heads, Head))
    h = _named_norm(x, p["g2"])
    return x + hax.dot(hax.maximum(hax.dot(h, p["w1"], axis=Embed), 0.0), p["w2"], axis=Mlp)


def _norm(x: jax.Array, gain: jax.Array) -> jax.Array:
    mean = x.mean(-1, keepdims=True)
    centered = x - mean
    var = (centered * centered).mean(-1, keepdims=True)
    return centered / jnp.sqrt(var + 1e-5) * gain


def positional_block(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    """The same block written with positional ``jax.numpy`` (x: [batch, pos, embed])."""
    h = _norm(x, p["g1"])
    q = jnp.einsum("bpe,ehd->bphd", h, p["wq"]) * Head.size**-0.5
    k = jnp.einsum("bpe,ehd->bphd", h, p["wk"])
    v = jnp.einsum("bpe,ehd->bphd", h, p["wv"])
    scores = jnp.einsum("bphd,bkhd->bphk", q, k)
    scores = scores - scores.max(-1, keepdims=True)
    weights = jnp.exp(scores)
    weights = weights / weights.sum(-1, keepdims=True)
    attn = jnp.einsum("bphk,bkhd->bphd", weights, v)
    x = x + jnp.einsum("bphd,hde->bpe", attn, p["wo"])
    h = _norm(x, p["g2"])
    return x + jnp.einsum("bpm,me->bpe", jnp.maximum(jnp.einsum("bpe,em->bpm", h, p["w1"]), 0.0), p["w2"])


def _loss_named(p: dict[str, NamedArray], x: NamedArray) -> jax.Array:
    out = named_block(p, x)
    return (out.array * out.array).mean()


def _loss_positional(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    out = positional_block(p, x)
    return (out * out).mean()


def run(rec: Recorder) -> None:
    """Time forward+backward of both blocks and record the times and their ratio."""
    key = jax.random.key(0)
    named_params = _named_params(key)
    x = hax.random.normal(jax.random.key(1), (Batch, Pos, Embed))
    plain_params = {name: value.array for name, value in named_params.items()}
    named_step = jax.jit(jax.value_and_grad(_loss_named))
    plain_step = jax.jit(jax.value_and_grad(_loss_positional))

    # same math: check before timing
    named_loss, _ = named_step(named_params, x)
    plain_loss, _ = plain_step(plain_params, x.array)
    if abs(float(named_loss) - float(plain_loss)) > 1e-3 * abs(float(plain_loss)):
        raise RuntimeError(f"named and positional blocks disagree: {float(named_loss)} vs {float(plain_loss)}")

    def named_call() -> Any:
        return jax.block_until_ready(named_step(named_params, x))

    def plain_call() -> Any:
        return jax.block_until_ready(plain_step(plain_params, x.array))

    shapes = {ax.name: ax.size for ax in (Batch, Pos, Embed, Heads, Head, Mlp)}
    # interleaved rounds, so that load on a shared machine hits both versions alike
    times = interleaved_times({"named": named_call, "positional": plain_call})
    ratio, spread = round_ratio(times["named"], times["positional"])
    for name in ("named", "positional"):
        median = statistics.median(times[name])
        rec.record(f"transformer_block_fwd_bwd/{name}", "time", median, "s", dtype="float32", **shapes)
    rec.record("transformer_block_fwd_bwd", "ratio_named_over_positional", ratio, "x", target="<= 1.03", **spread)
