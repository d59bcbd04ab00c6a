"""Trainer step vs a hand-written positional JAX step: small GPT-2 and Llama, same math, same optimizer.

For each model the suite builds a ponente model, trains it one step at a time through
:class:`ponente.trainer.trainer.Trainer` (named axes, ``named_jit``, donated state), and compares with a
plain ``jax.numpy`` implementation of the same network (written from the Hugging Face parameter
layout, stacked layers under ``lax.scan``) updated by the same optax AdamW in a donated ``jax.jit``.
Recorded per model: the median step times, the ratio trainer/positional (target <= 1.0), the ratio
trainer/bare (the same named model and loss in a bare donated ``eqx.filter_jit`` step: the Trainer's own
cost) and the absolute difference of the first step's losses (a check that both compute the same function).
The reference steps also return the global gradient norm, as the Trainer's step does (its ``grad_norm`` metric).

The three steps are timed in interleaved rounds (each step once per round, the order rotating), so that load
on a shared machine hits all of them alike; times are medians over rounds, and each ratio is the median of the
per-round ratios, recorded with its spread (``ratio_min``, ``ratio_max``) and the ratio of the fastest steps
(``ratio_of_min``). Environment knobs: ``PONENTE_BENCH_TRAINER_MODELS`` (comma-separated subset of
``gpt2,llama``; default both) and ``PONENTE_BENCH_STEPS`` (rounds, default 30).
"""

from __future__ import annotations

import os
import statistics
from typing import TYPE_CHECKING, Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import ponente.namedtensor as hax
from benchmarks.harness import interleaved_times, round_ratio
from ponente.models import Gpt2Config, LlamaConfig, LmExample, compute_next_token_loss
from ponente.trainer.trainer import Trainer, TrainerConfig

if TYPE_CHECKING:
    from benchmarks.harness import Recorder

BATCH, SEQ, VOCAB = 8, 128, 512
GPT2 = Gpt2Config(seq_len=SEQ, hidden_dim=128, intermediate_dim=512, num_layers=2, num_heads=4, num_kv_heads=4)
LLAMA = LlamaConfig(seq_len=SEQ, hidden_dim=128, intermediate_dim=352, num_layers=2, num_heads=4, num_kv_heads=2)


def _stack(state: dict[str, np.ndarray], prefix: str, layers: int) -> dict[str, jax.Array]:
    """``{prefix}{i}.{name}`` per layer -> ``{name}: [layers, ...]``."""
    names = [k[len(f"{prefix}0.") :] for k in state if k.startswith(f"{prefix}0.")]
    return {n: jnp.stack([jnp.asarray(state[f"{prefix}{i}.{n}"]) for i in range(layers)]) for n in names}


def _causal_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """q: [b, s, h, d]; k, v: [b, s, h, d] -> [b, s, h, d]."""
    s = q.shape[1]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    causal = jnp.tril(jnp.ones((s, s), dtype=bool))
    scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)


def _layer_norm(x: jax.Array, w: jax.Array, b: jax.Array, eps: float) -> jax.Array:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * w + b


def gpt2_params(model: Any) -> dict[str, Any]:
    state = model.to_hf_state_dict()
    top = {k: jnp.asarray(v) for k, v in state.items() if ".h." not in k}
    return {"top": top, "layers": _stack(state, "transformer.h.", model.config.num_layers)}


def gpt2_logits(p: dict[str, Any], tokens: jax.Array, cfg: Gpt2Config = GPT2) -> jax.Array:
    top, eps, heads = p["top"], cfg.layer_norm_epsilon, cfg.num_heads
    h = top["transformer.wte.weight"][tokens] + top["transformer.wpe.weight"][: tokens.shape[1]]

    def block(h: jax.Array, w: dict[str, jax.Array]) -> tuple[jax.Array, None]:
        b, s, d = h.shape
        a = _layer_norm(h, w["ln_1.weight"], w["ln_1.bias"], eps)
        qkv = (a @ w["attn.c_attn.weight"] + w["attn.c_attn.bias"]).reshape(b, s, 3, heads, d // heads)
        o = _causal_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]).reshape(b, s, d)
        h = h + o @ w["attn.c_proj.weight"] + w["attn.c_proj.bias"]
        m = _layer_norm(h, w["ln_2.weight"], w["ln_2.bias"], eps)
        m = jax.nn.gelu(m @ w["mlp.c_fc.weight"] + w["mlp.c_fc.bias"], approximate=True)
        return h + m @ w["mlp.c_proj.weight"] + w["mlp.c_proj.bias"], None

    h, _ = jax.lax.scan(block, h, p["layers"])
    h = _layer_norm(h, top["transformer.ln_f.weight"], top["transformer.ln_f.bias"], eps)
    return h @ top["transformer.wte.weight"].T


def _llama_params(model: Any) -> dict[str, Any]:
    state = model.to_hf_state_dict()
    top = {k: jnp.asarray(v) for k, v in state.items() if ".layers." not in k}
    return {"top": top, "layers": _stack(state, "model.layers.", LLAMA.num_layers)}


def _rms(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def _llama_logits(p: dict[str, Any], tokens: jax.Array) -> jax.Array:
    top, eps = p["top"], LLAMA.layer_norm_epsilon
    heads, kv, hd = LLAMA.num_heads, LLAMA.num_kv_heads, LLAMA.HeadSize.size
    inv = jnp.asarray(LLAMA.rope.inv_freq(hd), jnp.float32)
    angles = jnp.arange(tokens.shape[1], dtype=jnp.float32)[:, None] * inv[None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)[None, :, None, :]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    h = top["model.embed_tokens.weight"][tokens]

    def block(h: jax.Array, w: dict[str, jax.Array]) -> tuple[jax.Array, None]:
        b, s, _d = h.shape
        a = _rms(h, w["input_layernorm.weight"], eps)
        q = _rope((a @ w["self_attn.q_proj.weight"].T).reshape(b, s, heads, hd), cos, sin)
        k = _rope((a @ w["self_attn.k_proj.weight"].T).reshape(b, s, kv, hd), cos, sin)
        v = (a @ w["self_attn.v_proj.weight"].T).reshape(b, s, kv, hd)
        k, v = jnp.repeat(k, heads // kv, axis=2), jnp.repeat(v, heads // kv, axis=2)
        h = h + _causal_attention(q, k, v).reshape(b, s, heads * hd) @ w["self_attn.o_proj.weight"].T
        m = _rms(h, w["post_attention_layernorm.weight"], eps)
        gate = jax.nn.silu(m @ w["mlp.gate_proj.weight"].T) * (m @ w["mlp.up_proj.weight"].T)
        return h + gate @ w["mlp.down_proj.weight"].T, None

    h, _ = jax.lax.scan(block, h, p["layers"])
    return _rms(h, top["model.norm.weight"], eps) @ top["lm_head.weight"].T


def _positional_loss(logits_fn: Any, params: Any, tokens: jax.Array) -> jax.Array:
    logits = logits_fn(params, tokens)[:, :-1].astype(jnp.float32)
    targets = tokens[:, 1:]
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return (lse - picked).mean()


def _named_loss(model: Any, example: LmExample, *, key: jax.Array | None) -> Any:
    return compute_next_token_loss(model, example, key=key)


def bench_train_step(
    rec: Recorder,
    name: str,
    cfg: Any,
    to_params: Any,
    logits_fn: Any,
    *,
    batch: int = BATCH,
    vocab: int = VOCAB,
    target: str = "<= 1.0",
) -> None:
    """Record the Trainer's step vs the positional step ``logits_fn`` (same math) and vs a bare named step."""
    Vocab = hax.Axis("vocab", vocab)
    tokens_np = np.random.default_rng(0).integers(0, vocab, (batch, cfg.seq_len)).astype(np.int32)
    optimizer = optax.adamw(1e-3, weight_decay=0.1)

    trainer = Trainer(
        TrainerConfig(train_batch_size=batch, num_train_steps=10**6, compilation_cache_dir=None, progress_bar=False),
        optimizer,
        _named_loss,
    )
    model_init = lambda key: cfg.build(Vocab, key=key)  # noqa: E731
    example = trainer.shard_batch(LmExample.causal(hax.named(jnp.asarray(tokens_np), ("batch", "position"))))
    holder = [trainer.initial_state(model_init, key=jax.random.PRNGKey(0))]
    params = to_params(holder[0].model)

    def trainer_step() -> float:
        holder[0], metrics = trainer.train_step(holder[0], example)
        return float(metrics["loss"])

    tokens = jnp.asarray(tokens_np)

    def positional_update(
        params: Any, opt_state: Any, tokens: jax.Array
    ) -> tuple[Any, Any, tuple[jax.Array, jax.Array]]:
        loss, grads = jax.value_and_grad(lambda p: _positional_loss(logits_fn, p, tokens))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, (loss, optax.tree.norm(grads))

    update = jax.jit(positional_update, donate_argnums=(0, 1))
    pos = [params, optimizer.init(params)]

    def positional_step() -> float:
        pos[0], pos[1], (loss, _norm) = update(pos[0], pos[1], tokens)
        return float(loss)

    # the same named model and loss in a bare donated ``eqx.filter_jit`` step: separates the Trainer's own
    # cost (trainer / bare) from the cost of the named model itself (bare / positional)
    @eqx.filter_jit(donate="all-except-first")
    def bare_update(example: LmExample, model: Any, opt_state: Any) -> tuple[Any, Any, tuple[jax.Array, jax.Array]]:
        loss, grads = eqx.filter_value_and_grad(lambda m: _named_loss(m, example, key=None).array)(model)
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
        return eqx.apply_updates(model, updates), opt_state, (loss, optax.tree.norm(grads))

    bare_model = model_init(jax.random.PRNGKey(0))
    bare = [bare_model, optimizer.init(eqx.filter(bare_model, eqx.is_inexact_array))]

    def bare_step() -> float:
        bare[0], bare[1], (loss, _norm) = bare_update(example, bare[0], bare[1])
        return float(loss)

    first_named, first_positional = trainer_step(), positional_step()
    times = interleaved_times({"trainer": trainer_step, "positional": positional_step, "bare_named": bare_step})
    t_named, t_pos, t_bare = (statistics.median(times[k]) for k in ("trainer", "positional", "bare_named"))
    shape = {"batch": batch, "seq_len": cfg.seq_len, "hidden": cfg.hidden_dim, "layers": cfg.num_layers}
    rec.record(f"{name}_train_step/trainer", "time", t_named, "s", **shape)
    rec.record(f"{name}_train_step/positional", "time", t_pos, "s", **shape)
    rec.record(f"{name}_train_step/bare_named", "time", t_bare, "s", **shape)
    ratio, spread = round_ratio(times["trainer"], times["positional"])
    rec.record(f"{name}_train_step", "ratio", ratio, "x", target=target, **spread, **shape)
    ratio, spread = round_ratio(times["trainer"], times["bare_named"])
    rec.record(f"{name}_train_step", "trainer_over_bare_ratio", ratio, "x", **spread, **shape)
    rec.record(f"{name}_train_step", "first_loss_abs_diff", abs(first_named - first_positional), "nats")


_MODELS = {"gpt2": (GPT2, gpt2_params, gpt2_logits), "llama": (LLAMA, _llama_params, _llama_logits)}


def run(rec: Recorder) -> None:
    """Time one training step of small GPT-2 and Llama models, named (Trainer) vs positional.

    Raises:
        ValueError: if ``PONENTE_BENCH_TRAINER_MODELS`` names a model other than ``gpt2`` and ``llama``.
    """
    chosen = [m.strip() for m in os.environ.get("PONENTE_BENCH_TRAINER_MODELS", ",".join(_MODELS)).split(",")]
    unknown = [m for m in chosen if m not in _MODELS]
    if unknown:
        raise ValueError(f"PONENTE_BENCH_TRAINER_MODELS: unknown models {unknown}; choose among {list(_MODELS)}")
    for name in chosen:
        bench_train_step(rec, name, *_MODELS[name])
