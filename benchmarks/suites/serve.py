"""``ponente-serve`` throughput: 16 concurrent clients against a live server on localhost, batched vs one at a time.

A small Llama (hidden 128, 2 layers, 4 heads, vocab 4096: the shipped Shakespeare tokenizer; random weights) is
served by ``ponente.trainer.serve`` (uvicorn on a thread, the app of ``create_app`` over an ``Engine``). Each of
``CLIENTS`` threads sends ``REQUESTS`` ``/v1/completions`` requests one after the other (greedy, a different
prompt of about 10 tokens each, ``max_tokens`` new tokens, no stop token, so every request generates all of
them). The same load runs twice: with the scheduler batching up to 16 prompts (``max_batch_size=16``), and with
``max_batch_size=1`` (requests served one at a time, what a server without batching does). Before timing, one
warm-up round compiles the programs of every batch size the round will use.

Recorded per mode: generated tokens/s over the whole run (wall clock), requests/s, the median and 95th-percentile
request latency, and the mean batch size the scheduler ran; then the batched/one-at-a-time ratio of tokens/s.
Knobs: ``PONENTE_BENCH_SERVE_CLIENTS`` (default 16), ``PONENTE_BENCH_SERVE_REQUESTS`` (per client, default 4),
``PONENTE_BENCH_SERVE_TOKENS`` (``max_tokens``, default 64).
"""

from __future__ import annotations

import concurrent.futures
import os
import statistics
import time
from typing import TYPE_CHECKING, Any

import httpx
import jax

import ponente.namedtensor as hax
from ponente.datacache import load_tokenizer
from ponente.models import LlamaConfig
from ponente.trainer.data import resolve_url
from ponente.trainer.inference import Engine
from ponente.trainer.serve import ServerLimits, ServerThread, create_app

if TYPE_CHECKING:
    from benchmarks.harness import Recorder

WORDS = [
    "the",
    "king",
    "queen",
    "lord",
    "lady",
    "night",
    "day",
    "love",
    "death",
    "sword",
    "crown",
    "heaven",
    "earth",
    "blood",
    "honour",
    "grief",
]


def _prompt(i: int) -> str:
    return " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(8))


def _load(base_url: str, clients: int, requests: int, tokens: int, offset: int) -> tuple[float, list[float], int]:
    """Every client sends its requests in turn; returns the wall time, the latencies and the generated tokens."""

    def client(c: int) -> tuple[list[float], int]:
        latencies, generated = [], 0
        with httpx.Client(base_url=base_url, timeout=600) as http:
            for r in range(requests):
                body = {"prompt": _prompt(offset + c * requests + r), "max_tokens": tokens, "temperature": 0}
                start = time.perf_counter()
                response = http.post("/completions", json=body)
                latencies.append(time.perf_counter() - start)
                response.raise_for_status()
                generated += response.json()["usage"]["completion_tokens"]
        return latencies, generated

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(client, range(clients)))
    wall = time.perf_counter() - start
    return wall, [x for lat, _ in results for x in lat], sum(n for _, n in results)


def run(rec: Recorder) -> None:
    """Throughput of the server under concurrent clients, with and without batching."""
    clients = int(os.environ.get("PONENTE_BENCH_SERVE_CLIENTS", "16"))
    requests = int(os.environ.get("PONENTE_BENCH_SERVE_REQUESTS", "4"))
    tokens = int(os.environ.get("PONENTE_BENCH_SERVE_TOKENS", "64"))
    tokenizer = load_tokenizer(resolve_url("package://ponente.trainer.assets/shakespeare_tokenizer.json"))
    config = LlamaConfig(seq_len=256, hidden_dim=128, intermediate_dim=512, num_layers=2, num_heads=4, num_kv_heads=4)
    model = config.build(hax.Axis("vocab", tokenizer.get_vocab_size()), key=jax.random.key(0))
    extra: dict[str, Any] = {"clients": clients, "requests_per_client": requests, "max_tokens": tokens}
    rates = {}
    for mode, batch in (("batched", 16), ("one_at_a_time", 1)):
        engine = Engine(model, tokenizer, max_batch_size=batch, max_seq_len=config.seq_len)
        limits = ServerLimits(model_name="bench", max_seq_len=config.seq_len, max_tokens=tokens, max_prompts=batch)
        app = create_app(engine, tokenizer, limits=limits, max_pending=4 * clients)
        with ServerThread(app) as server:
            # warm-up: compile every batch bucket (1, 2, 4, ... up to max_batch_size) the timed round may use
            size = 1
            while size <= batch:
                _load(server.base_url, size, 1, tokens, offset=10_000)
                size *= 2
            _load(server.base_url, clients, 1, tokens, offset=20_000)
            scheduler = app.state.scheduler
            before = len(scheduler.batch_sizes)
            wall, latencies, generated = _load(server.base_url, clients, requests, tokens, offset=0)
            sizes = list(scheduler.batch_sizes)[before:]
        rates[mode] = generated / wall
        row = {**extra, "max_batch_size": batch}
        rec.record(mode, "tokens_per_second", rates[mode], "tokens/s", **row)
        rec.record(mode, "requests_per_second", len(latencies) / wall, "requests/s", **row)
        rec.record(mode, "latency_median", statistics.median(latencies), "s", **row)
        rec.record(mode, "latency_p95", statistics.quantiles(latencies, n=20)[-1], "s", **row)
        rec.record(mode, "mean_batch_size", statistics.fmean(sizes), "prompts", batches=len(sizes), **row)
    rec.record("batched_vs_one_at_a_time", "tokens_per_second_ratio", rates["batched"] / rates["one_at_a_time"], "x")
