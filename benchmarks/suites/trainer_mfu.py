"""Model FLOPs utilization of the Trainer's step: a Llama-3.2-1B shape at sequence 2048 in bfloat16 on a GPU.

The model (hidden 2048, MLP 8192, 16 layers, 32 heads / 8 KV heads, vocab 128256, untied; seq 2048) trains with
AdamW through :class:`ponente.trainer.trainer.Trainer` (``mp: p=f32,c=bfloat16``), with every default left on:
``attn_backend: auto`` and the ``auto`` cross-entropy (fused at this vocabulary). Recorded: step time, tokens/s,
and MFU = ``3 * LmConfig.flops_per_token * tokens / step time / peak`` where a peak is known for the device
(``ponente.trainer.mfu``); target on one H100: >= 50 %. The batch size and remat policy are recorded with the
figures. On a CPU (no known peak) a scaled-down shape (hidden 256, 2 layers, seq 256, vocab 8192, float32) runs
and only tokens/s are recorded.

Knobs: ``PONENTE_BENCH_MFU_SIZE`` (``1b`` or ``small``; default ``1b`` on GPU/TPU, ``small`` on CPU),
``PONENTE_BENCH_MFU_BATCH`` (default 4 for ``1b``, 2 for ``small``), ``PONENTE_BENCH_MFU_REMAT`` (the model's
``gradient_checkpointing``: ``false``, ``true``, ``offload``, ...; or the block internals to keep, separated by commas,
e.g. ``attn_qkv,attn_context,attn_out,mlp_in,mlp_out``: selective checkpointing; default ``false``),
``PONENTE_BENCH_STEPS`` (timed steps, default 10), ``PONENTE_BENCH_MFU_SEGMENTS`` (``one``: one document per row,
segment ids all 0, what the data loader gives for unpacked text, the default; ``packed``: documents of random lengths
packed into each row; ``none``: no segment ids at all, like a hand-written causal step), ``PONENTE_BENCH_MFU_LOSS``
(``auto``, the default; ``plain``: the loss over materialized logits; or a vocabulary block size for the blockwise
loss), ``PONENTE_BENCH_MFU_PER_DEVICE`` (``trainer.per_device_parallelism``: examples per microbatch, the batch then
accumulated over ``batch / per-device`` microbatches; default -1, one microbatch), ``PONENTE_BENCH_MFU_SCAN_LAYERS``
(the model's ``scan_layers``: ``true``, the default, a loop over the layers; ``false``, the layers unrolled),
``PONENTE_BENCH_MFU_QUANT`` (``trainer.quantization`` of each measured step, comma-separated: ``off``, the default,
``fp8``, ``fp8-current`` (FP8 with current scaling), ``int8``; e.g. ``off,fp8,int8`` times all three in one process
and records each one's step time relative to the first, with the compiled step's FLOPs from XLA's cost analysis).
The compiled step's scratch memory (XLA's ``memory_analysis``: the temporaries, activations kept for the backward
pass included) is recorded on every device; on a GPU the peak device memory is recorded too.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
import optax

import ponente.namedtensor as hax
from benchmarks.harness import packed_segment_ids, time_fn
from ponente.models import CHECKPOINT_NAMES, LlamaConfig, LmExample, compute_next_token_loss
from ponente.trainer.mfu import device_peak_flops, mfu
from ponente.trainer.tasks.lm import lm_batch, lm_loss_fn
from ponente.trainer.trainer import QuantizationConfig, Trainer, TrainerConfig

if TYPE_CHECKING:
    from benchmarks.harness import Recorder

SHAPES: dict[str, tuple[dict[str, Any], int]] = {
    "1b": (
        {"hidden_dim": 2048, "intermediate_dim": 8192, "num_layers": 16, "num_heads": 32, "num_kv_heads": 8,
         "seq_len": 2048},
        128256,
    ),
    "small": (
        {"hidden_dim": 256, "intermediate_dim": 1024, "num_layers": 2, "num_heads": 8, "num_kv_heads": 2,
         "seq_len": 256},
        8192,
    ),
}  # fmt: skip


def _remat(text: str) -> bool | str | tuple[str, ...]:
    """``PONENTE_BENCH_MFU_REMAT``: a bool, a policy name, or internals to keep separated by commas."""
    if "," in text or text in CHECKPOINT_NAMES:
        return tuple(name.strip() for name in text.split(",") if name.strip())
    return {"false": False, "true": True}.get(text.lower(), text)


def _scan_layers(text: str) -> bool:
    value = {"true": True, "false": False}.get(text.lower())
    if value is None:
        raise ValueError(f"PONENTE_BENCH_MFU_SCAN_LAYERS: expected true or false, got {text!r}")
    return value


def _per_device(text: str, batch: int) -> int:
    """``PONENTE_BENCH_MFU_PER_DEVICE``: -1, or examples per microbatch dividing the batch."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value != -1 and (value < 1 or batch % value):
        raise ValueError(
            f"PONENTE_BENCH_MFU_PER_DEVICE: expected -1 or a divisor of the batch ({batch}), got {text!r}"
        )
    return value


def _segment_ids(kind: str, batch: int, seq_len: int) -> np.ndarray:
    if kind in ("one", "none"):
        return np.zeros((batch, seq_len), np.int32)
    if kind != "packed":
        raise ValueError(f"PONENTE_BENCH_MFU_SEGMENTS: expected one, packed or none, got {kind!r}")
    return packed_segment_ids(batch, seq_len, seed=1)


def _loss(segments: str, text: str) -> Any:
    if text in ("auto", "plain"):
        block: int | str | None = text if text == "auto" else None
    elif text.isdigit() and int(text) > 0:
        block = int(text)
    else:
        raise ValueError(f"PONENTE_BENCH_MFU_LOSS: expected auto, plain or a vocabulary block size, got {text!r}")
    if segments != "none":
        return lm_loss_fn(block_size=block)

    def loss_fn(model: Any, batch: Any, *, key: Any) -> Any:  # causal only, no segment ids in the mask
        example = LmExample.causal(batch["input_ids"], loss_mask=batch["loss_mask"])
        return compute_next_token_loss(model, example, key=key, block_size=block)

    return loss_fn


_QUANT = {
    "off": None,
    "fp8": QuantizationConfig(fp8=True),
    "fp8-current": QuantizationConfig(fp8=True, scaling="current"),
    "int8": QuantizationConfig(int8=True),
}


def _quantizations(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in _QUANT]
    if unknown or not names:
        raise ValueError(f"PONENTE_BENCH_MFU_QUANT: expected a comma-separated list of {sorted(_QUANT)}, got {text!r}")
    return names


def run(rec: Recorder) -> None:
    """Time the Trainer's step on the Llama-1B shape (or the small one on CPU) and report tokens/s and MFU."""
    first: float | None = None
    for quant in _quantizations(os.environ.get("PONENTE_BENCH_MFU_QUANT", "off")):
        seconds = _run_one(rec, quant, first)
        first = seconds if first is None else first


def _run_one(rec: Recorder, quant: str, reference_seconds: float | None) -> float:
    platform = jax.default_backend()
    size = os.environ.get("PONENTE_BENCH_MFU_SIZE", "small" if platform == "cpu" else "1b")
    sizes, vocab = SHAPES[size]
    batch = int(os.environ.get("PONENTE_BENCH_MFU_BATCH", "4" if size == "1b" else "2"))
    remat = _remat(os.environ.get("PONENTE_BENCH_MFU_REMAT", "false"))
    steps = int(os.environ.get("PONENTE_BENCH_STEPS", "10"))
    segments = os.environ.get("PONENTE_BENCH_MFU_SEGMENTS", "one")
    loss = os.environ.get("PONENTE_BENCH_MFU_LOSS", "auto")
    per_device = _per_device(os.environ.get("PONENTE_BENCH_MFU_PER_DEVICE", "-1"), batch)
    mp, dtype = ("f32", "fp32") if platform == "cpu" else ("p=f32,c=bfloat16", "bf16")
    scan_layers = _scan_layers(os.environ.get("PONENTE_BENCH_MFU_SCAN_LAYERS", "true"))
    cfg = LlamaConfig(**sizes, gradient_checkpointing=remat, scan_layers=scan_layers)
    trainer = Trainer(
        TrainerConfig(
            train_batch_size=batch,
            per_device_parallelism=per_device,
            num_train_steps=10**6,
            mp=mp,
            compilation_cache_dir=None,
            progress_bar=False,
            quantization=_QUANT[quant],
        ),
        optax.adamw(1e-4, weight_decay=0.1),
        _loss(segments, loss),
    )
    state = [trainer.initial_state(lambda k: cfg.build(hax.Axis("vocab", vocab), key=k), key=jax.random.PRNGKey(0))]
    ids = np.random.default_rng(0).integers(0, vocab, (batch, cfg.seq_len)).astype(np.int32)
    rows = {"input_ids": ids, "segment_ids": _segment_ids(segments, batch, cfg.seq_len)}
    example = trainer.shard_batch(lm_batch(rows))

    def step() -> None:
        state[0], metrics = trainer.train_step(state[0], example)
        jax.block_until_ready(metrics["loss"])

    start = time.perf_counter()
    compiled = trainer.compile_step(state[0], example)  # the first step below reuses it
    step()
    compile_seconds = time.perf_counter() - start
    analysis = compiled.memory_analysis()
    seconds = time_fn(step, warmup=1, repeat=steps)
    tokens = batch * cfg.seq_len
    extra = {
        "shape": size,
        "batch": batch,
        "microbatches": trainer.num_microbatches,
        "seq_len": cfg.seq_len,
        "vocab": vocab,
        "mp": mp,
        "remat": str(remat),
        "scan_layers": scan_layers,
        "attn_backend": cfg.attn_backend,
        "segments": segments,
        "loss": loss,
        "quantization": quant,
        "device": jax.devices()[0].device_kind,
    }
    name = f"llama_{size}" if quant == "off" else f"llama_{size}_{quant}"
    rec.record(name, "first_step_time", compile_seconds, "s", **extra)
    if analysis is not None:  # what XLA planned: the step's temporaries (activations kept for the backward pass...)
        rec.record(name, "compiled_scratch", float(analysis.temp_size_in_bytes), "bytes", **extra)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    if cost and "flops" in cost:
        rec.record(name, "compiled_flops", float(cost["flops"]), "flops", **extra)
    if cost and "bytes accessed" in cost:  # XLA's count of the bytes the step reads and writes (copies included)
        rec.record(name, "compiled_bytes_accessed", float(cost["bytes accessed"]), "bytes", **extra)
    memory = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in memory:
        rec.record(name, "peak_memory", float(memory["peak_bytes_in_use"]), "bytes", **extra)
    rec.record(name, "step_time", seconds, "s", **extra)
    if reference_seconds is not None:
        ratio = seconds / reference_seconds
        rec.record(name, "step_time_ratio", ratio, "x", reference="the first quantization listed", **extra)
    rec.record(name, "tokens_per_second", tokens / seconds, "tokens/s", **extra)
    peak = device_peak_flops(jax.devices()[0].device_kind, dtype)
    if peak is not None:
        value = mfu(cfg.flops_per_token(vocab), tokens, seconds, peak)
        rec.record(name, "mfu", value, "fraction", target=">= 0.50 (one H100)", **extra)
    return seconds
