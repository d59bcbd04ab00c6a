"""Preference tuning: pairs/s of a DPO step with a live reference, with precomputed reference log-probs, and with
LoRA-DPO; and the memory of full DPO vs LoRA-DPO.

The shipped preference set (``ponente.trainer.assets/tiny_preferences.jsonl``, 240 chat pairs) is rendered with the
shipped ChatML template, tokenized with the shipped Shakespeare tokenizer and cached by
``ponente.datacache.PreferenceChatProcessor``; ``PreferencePairDataset`` cuts one pair per row. Each step reads the
next ``BATCH`` pairs (wrapping around), makes the batch (``ponente.trainer.tasks.dpo.dpo_batch``) and runs the
Trainer's step on a small Llama (hidden 128, 2 layers, vocab 4096, AdamW) with the preference loss of
``DpoTask`` (sigmoid, beta 0.1). Modes, timed in interleaved rounds (``benchmarks.harness.interleaved_times``):

- ``live``: the state holds the policy and a frozen copy (``PolicyAndReference``); a step runs both forwards;
- ``precomputed``: the reference log-probs of every pair are computed once (timed apart: ``precompute_time``) and
  read with the rows; a step runs the policy alone. Expected: about 1.33× the pairs/s of ``live`` (a step of
  ``live`` is the policy's forward and backward, ~3 forwards, plus the reference's forward);
- ``lora``: LoRA rank 8 on every attention and MLP linear; the reference is the base with the adapters off.

Memory, per mode: the bytes of the training state (parameters + optimizer state) and XLA's compiled temporary
memory of the step (``memory_analysis``). Full DPO holds the policy, its AdamW moments and the reference (four
copies of the weights); LoRA-DPO holds one copy plus the adapters and their moments. The ratio is recorded for the
small model and, abstractly (``jax.eval_shape``, nothing allocated), for Llama-3.2-1B's shape.
Knobs: ``PONENTE_BENCH_DPO_SEQ`` (row length, default 128), ``PONENTE_BENCH_DPO_BATCH`` (pairs per step, default
8), ``PONENTE_BENCH_STEPS`` (timed rounds, default 30).
"""

from __future__ import annotations

import importlib.resources
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import equinox as eqx
import jax
import numpy as np
import optax

import ponente.namedtensor as hax
from benchmarks.harness import interleaved_times, round_ratio
from ponente.datacache import PreferenceChatProcessor, PreferencePairDataset, build_cache
from ponente.models import LlamaConfig
from ponente.models.lora import LoraConfig, lora_trainable_filter, loraize, unwrap
from ponente.trainer.state import init_state
from ponente.trainer.tasks.dpo import PAIR_FIELDS, PolicyAndReference, _pair_logprobs, dpo_batch, pair_loss
from ponente.trainer.trainer import Trainer, TrainerConfig

if TYPE_CHECKING:
    from benchmarks.harness import Recorder

VOCAB = 4096
BETA = 0.1
MODES = ("live", "precomputed", "lora")


def _asset(name: str) -> Path:
    return Path(str(importlib.resources.files("ponente.trainer.assets") / name))


def _loss(mode: str) -> Callable[..., Any]:
    """The preference loss of ``DpoTask`` for each way of getting the reference log-probs."""

    def loss(model: Any, batch: Any, *, key: Any) -> Any:
        policy = model.policy if mode == "live" else model
        if mode == "live":
            ref = _pair_logprobs(model.reference, batch, key=None)
        elif mode == "lora":
            ref = _pair_logprobs(unwrap(model), batch, key=None)
        else:
            ref = (batch["reference_chosen_logp"], batch["reference_rejected_logp"])
        return pair_loss(_pair_logprobs(policy, batch, key=key), ref, batch, loss_type="sigmoid", beta=BETA)

    return loss


def _inits(cfg: LlamaConfig, vocab: int) -> dict[str, tuple[Callable[[jax.Array], Any], Callable[[Any], Any]]]:
    """mode -> (model init, trainable filter of the model)."""
    Vocab = hax.Axis("vocab", vocab)
    lora = LoraConfig()

    def base(key: jax.Array) -> Any:
        return cfg.build(Vocab, key=key)

    def paired(key: jax.Array) -> Any:
        policy = base(key)
        return PolicyAndReference(policy, policy)

    def adapted(key: jax.Array) -> Any:
        k1, k2 = jax.random.split(key)
        return loraize(base(k1), lora, key=k2)

    def paired_filter(model: Any) -> Any:
        return PolicyAndReference(
            jax.tree_util.tree_map(lambda _: True, model.policy),
            jax.tree_util.tree_map(lambda _: False, model.reference),
        )

    return {
        "live": (paired, paired_filter),
        "precomputed": (base, lambda model: True),
        "lora": (adapted, lora_trainable_filter),
    }


def _bytes(tree: Any) -> int:
    leaves = jax.tree_util.tree_leaves(tree)
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in leaves if hasattr(x, "dtype"))


def _state_bytes(state: Any) -> int:
    """Parameters (the reference counted once: in ``live`` it is a second array) + optimizer state."""
    return _bytes(state.model) + _bytes(state.opt_state)


def _rows(ds: PreferencePairDataset, indices: list[int], reference: np.ndarray | None) -> dict[str, np.ndarray]:
    rows = ds.get_batch(indices)
    arrays = {key: np.stack([row[key] for row in rows]) for key in PAIR_FIELDS}
    if reference is not None:
        arrays["reference_chosen_logp"] = reference[0, indices]
        arrays["reference_rejected_logp"] = reference[1, indices]
    return arrays


def run(rec: Recorder) -> None:
    """Time DPO steps in the three modes on the shipped pairs; record pairs/s, state and compiled memory."""
    seq_len = int(os.environ.get("PONENTE_BENCH_DPO_SEQ", "128"))
    batch = int(os.environ.get("PONENTE_BENCH_DPO_BATCH", "8"))
    cfg = LlamaConfig(seq_len=seq_len, hidden_dim=128, intermediate_dim=352, num_layers=2, num_heads=4, num_kv_heads=2)
    optimizer = optax.adamw(1e-4, weight_decay=0.0)
    tcfg = TrainerConfig(train_batch_size=batch, num_train_steps=10**6, compilation_cache_dir=None, progress_bar=False)
    processor = PreferenceChatProcessor(
        _asset("shakespeare_tokenizer.json"),
        chat_template=_asset("tiny_chat_template.jinja").read_text(),
        eos="<|endoftext|>",
    )
    extra = {"seq_len": seq_len, "batch": batch, "hidden": cfg.hidden_dim, "layers": cfg.num_layers, "vocab": VOCAB}
    with tempfile.TemporaryDirectory() as tmp:
        cache = build_cache(
            str(_asset("tiny_preferences.jsonl")), str(Path(tmp) / "cache"), processor=processor, progress=False
        )
        ds = PreferencePairDataset(cache, seq_len)
        n = len(ds)
        steps: dict[str, Callable[[], object]] = {}
        memory: dict[str, tuple[int, int]] = {}
        for mode, (init, trainable_of) in _inits(cfg, VOCAB).items():
            trainer = Trainer(tcfg, optimizer, _loss(mode))
            trainable = trainable_of(jax.eval_shape(init, jax.random.PRNGKey(0)))
            state = [trainer.initial_state(init, key=jax.random.PRNGKey(0), is_trainable=trainable)]
            reference = None
            if mode == "precomputed":
                reference, seconds = _precompute(trainer, state[0].model, ds, batch)
                rec.record(mode, "precompute_time", seconds, "s", pairs=n, **extra)
            placeholder = trainer.shard_batch(dpo_batch(_rows(ds, list(range(batch)), reference)))
            compiled = trainer.compile_step(state[0], placeholder)
            temp = _temp_bytes(compiled)
            memory[mode] = (_state_bytes(state[0]), temp)
            cursor = [0]

            def step(
                trainer: Trainer = trainer,
                state: list[Any] = state,
                reference: Any = reference,
                cursor: list[int] = cursor,
            ) -> None:
                indices = [(cursor[0] + k) % n for k in range(batch)]
                cursor[0] = (cursor[0] + batch) % n
                named = dpo_batch(_rows(ds, indices, reference))
                state[0], metrics = trainer.train_step(state[0], trainer.shard_batch(named))
                jax.block_until_ready(metrics["loss"])

            steps[mode] = step
        times = interleaved_times(steps)

    rate = {mode: batch / statistics.median(times[mode]) for mode in steps}
    for mode in steps:
        rec.record(mode, "step_time", statistics.median(times[mode]), "s", **extra)
        rec.record(mode, "pairs_per_second", rate[mode], "pairs/s", **extra)
        rec.record(mode, "state_memory", memory[mode][0], "bytes", **extra)
        if memory[mode][1] >= 0:
            rec.record(mode, "step_temp_memory", memory[mode][1], "bytes", **extra)
    ratio, spread = round_ratio(times["live"], times["precomputed"])
    rec.record(
        "precomputed_vs_live", "speedup", ratio, "live/precomputed step time", expected="~1.33", **spread, **extra
    )
    rec.record("lora_vs_full", "state_memory_ratio", memory["lora"][0] / memory["live"][0], "lora/full", **extra)
    _abstract_memory(rec, optimizer)


def _temp_bytes(compiled: Any) -> int:
    """XLA's temporary memory of a compiled step (-1 where the backend does not say)."""
    try:
        analysis = compiled.memory_analysis()
    except Exception:  # not every backend has it
        return -1
    return int(getattr(analysis, "temp_size_in_bytes", -1)) if analysis is not None else -1


def _precompute(trainer: Trainer, model: Any, ds: PreferencePairDataset, batch: int) -> tuple[np.ndarray, float]:
    """Reference log-probs of every pair (what ``precompute_reference`` does before step 1), and the seconds."""
    forward = eqx.filter_jit(lambda m, b: tuple(x.array for x in _pair_logprobs(m, b, key=None)))
    n = len(ds)
    out = np.zeros((2, n), dtype=np.float32)
    start = time.perf_counter()
    for lo in range(0, n, batch):
        indices = [min(i, n - 1) for i in range(lo, lo + batch)]
        chosen, rejected = forward(model, dpo_batch(_rows(ds, indices, None)))
        keep = min(batch, n - lo)
        out[0, lo : lo + keep] = np.asarray(chosen)[:keep]
        out[1, lo : lo + keep] = np.asarray(rejected)[:keep]
    return out, time.perf_counter() - start


def _abstract_memory(rec: Recorder, optimizer: optax.GradientTransformation) -> None:
    """State bytes of full DPO vs LoRA-DPO on Llama-3.2-1B's shape, built abstractly (nothing allocated)."""
    cfg = LlamaConfig(
        seq_len=2048, hidden_dim=2048, intermediate_dim=8192, num_layers=16, num_heads=32, num_kv_heads=8
    )
    key = jax.random.PRNGKey(0)
    sizes = {}
    for mode, (init, trainable_of) in _inits(cfg, 128256).items():
        if mode == "precomputed":
            continue
        trainable = trainable_of(jax.eval_shape(init, key))
        state = eqx.filter_eval_shape(
            lambda init=init, t=trainable: init_state(init(key), optimizer, key, is_trainable=t)
        )
        sizes[mode] = _state_bytes(state)
        rec.record(f"llama-1b/{mode}", "state_memory", sizes[mode], "bytes", abstract=True)
    rec.record(
        "llama-1b/lora_vs_full", "state_memory_ratio", sizes["lora"] / sizes["live"], "lora/full", abstract=True
    )
