"""Time from the command's start to the first logged training step of the hello world (``gpt2_nano``).

Subprocess runs of ``python -m ponente.trainer.main.train_lm --config_path gpt2_nano`` (the packaged hello
world, with its tensorboard + json trackers, run record and checkpointer; only the number of steps, the
evaluation cadence and the final sample are overridden, and every path lies in a fresh folder):

- ``cold``: a fresh token-cache folder and a fresh JAX compilation cache (everything built in the run);
- ``warm``: the same folders again under a new run id (cache finished, compiled programs on disk);
- ``reference``: a hand-written JAX script of the same GPT-2 size (positional ``jax.numpy``, optax AdamW,
  random tokens), from process start to its first step's loss on the host.

The time to the first step is when the run's JSON log first holds a ``train/loss`` line (polled every
20 ms). ``$PONENTE_STARTUP_REPEAT`` (default 1) repeats the cold/warm/reference triple; every repetition
is recorded with the 1-minute load average at its start, so runs on a busy machine can be told apart.
Targets on 2 CPU cores: cold <= 15 s, warm <= 8 s. Recorded: seconds for each run and the ratios
cold/reference and warm/reference.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from benchmarks.harness import Recorder

_REFERENCE = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np, optax
    V, D, L, H, S, B = 4096, 128, 4, 4, 128, 16
    rng = np.random.default_rng(0)
    def w(*shape): return jnp.asarray(rng.normal(0, 0.02, shape), jnp.float32)
    p = {"wte": w(V, D), "wpe": w(S, D), "qkv": w(L, D, 3 * D), "o": w(L, D, D), "fc": w(L, D, 4 * D),
         "proj": w(L, 4 * D, D), "ln": jnp.ones((L, 2, D)), "lnf": jnp.ones(D)}
    def norm(x, g): return (x - x.mean(-1, keepdims=True)) / jnp.sqrt(x.var(-1, keepdims=True) + 1e-5) * g
    def loss_fn(p, tok):
        x = p["wte"][tok] + p["wpe"]
        mask = jnp.tril(jnp.ones((S, S), bool))
        def layer(x, l):
            qkv, o, fc, proj, ln = l
            q, k, v = jnp.split(norm(x, ln[0]) @ qkv, 3, -1)
            q, k, v = (t.reshape(B, S, H, D // H) for t in (q, k, v))
            a = jax.nn.softmax(jnp.where(mask, jnp.einsum("bqhd,bkhd->bhqk", q, k) / (D // H) ** 0.5, -1e9), -1)
            x = x + jnp.einsum("bhqk,bkhd->bqhd", a, v).reshape(B, S, D) @ o
            return x + jax.nn.gelu(norm(x, ln[1]) @ fc) @ proj, None
        x, _ = jax.lax.scan(layer, x, (p["qkv"], p["o"], p["fc"], p["proj"], p["ln"]))
        logits = norm(x, p["lnf"]) @ p["wte"].T
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]), tok[:, 1:, None], -1))
    opt = optax.adamw(3e-3)
    @jax.jit
    def step(p, s, tok):
        loss, g = jax.value_and_grad(loss_fn)(p, tok)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, loss
    tok = jnp.asarray(rng.integers(0, V, (B, S)))
    p, s, loss = step(p, opt.init(p), tok)
    print("loss", float(loss), flush=True)
    """
)


def _time_hello_world(workdir: Path, compile_cache: Path, run_id: str) -> tuple[float, float]:
    metrics = workdir / "ponente_hello" / "runs" / run_id / "metrics.jsonl"
    cmd = [
        sys.executable, "-m", "ponente.trainer.main.train_lm", "--config_path", "gpt2_nano",
        "--trainer.id", run_id, "--trainer.num_train_steps", "2", "--trainer.steps_per_eval", "1000",
        "--sample.num_tokens", "0", "--trainer.compilation_cache_dir", str(compile_cache),
    ]  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=workdir, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    first = None
    while proc.poll() is None:
        if first is None and metrics.exists() and "train/loss" in metrics.read_text():
            first = time.perf_counter() - start
        time.sleep(0.02)
    total = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"hello world failed ({proc.returncode}): {proc.stderr.read()[-2000:]}")  # type: ignore[union-attr]
    if first is None:
        first = total
    return first, total


def run(rec: Recorder) -> None:
    repeat = int(os.environ.get("PONENTE_STARTUP_REPEAT", "1"))
    for i in range(repeat):
        with tempfile.TemporaryDirectory() as tmp:
            work, compile_cache = Path(tmp) / "work", Path(tmp) / "jax-cache"
            work.mkdir()
            load = os.getloadavg()[0]
            cold_first, cold_total = _time_hello_world(work, compile_cache, f"cold{i}")
            warm_first, warm_total = _time_hello_world(work, compile_cache, f"warm{i}")
            start = time.perf_counter()
            subprocess.run([sys.executable, "-c", _REFERENCE], check=True, capture_output=True)
            reference = time.perf_counter() - start
        extra = {"repetition": i, "load_average": load}
        rec.record(
            "hello_world_cold",
            "seconds_to_first_step",
            cold_first,
            "s",
            total_seconds=cold_total,
            target=15.0,
            **extra,
        )
        rec.record(
            "hello_world_warm", "seconds_to_first_step", warm_first, "s", total_seconds=warm_total, target=8.0, **extra
        )
        rec.record("hand_written_jax", "seconds_to_first_step", reference, "s", **extra)
        rec.record("hello_world_cold", "ratio_vs_hand_written", cold_first / reference, "x", **extra)
        rec.record("hello_world_warm", "ratio_vs_hand_written", warm_first / reference, "x", **extra)
