"""``ponente-serve`` under 16 concurrent clients with mixed prompt and answer lengths: continuous vs static batching.

A small Llama (hidden 128, 2 layers, 4 heads, vocab 4096: the shipped Shakespeare tokenizer; random weights) is served
by ``ponente.trainer.serve`` (uvicorn on a thread, the app of ``create_app`` over an ``Engine``). Each of ``CLIENTS``
threads sends ``REQUESTS`` ``/v1/completions`` requests one after the other (greedy, no stop token, so every request
generates all its tokens); request ``i`` has a prompt of 6 to 65 words and ``max_tokens`` cycling through 8, 32, 8, 128
(short and long answers mixed). The same load runs three times, on the same weights: with a continuous-batching engine
(16 slots, pages of 16 tokens, prefill chunks of 32; ``steps_per_call`` 8, the default, then 1: ``continuous-1-step``)
and with static batches of up to 16 prompts (``continuous=False``: a batch runs until its longest request ends). Before
timing, warm-up rounds (and the timed load itself, once) compile the programs the load uses; the timed load then runs
twice and the faster run counts.

Recorded per mode: generated tokens/s over the whole run (wall clock), requests/s, the median and 99th-percentile
request latency; then the continuous/static ratio of tokens/s. KV memory: the same 16 mixed requests through
``Engine.generate`` in each mode: the cache slots held per token in flight, averaged over the steps (continuous: pages
in use x page size over the tokens cached; static: each batch's whole ``rows x cache length`` cache over the tokens its
rows hold, step by step). Decode only (``decode-*``): 16 requests of 16 prompt tokens and 128 greedy new tokens at once
through ``Engine.generate`` (no server), so that after the first steps every slot decodes: the continuous batch with
``steps_per_call`` 8 (several decode steps per compiled call) and 1 (one step per call), and static batches;
interleaved rounds, the median per round: milliseconds per decode step (a round's wall time over 128, the few prefill
steps included), the ratios, and whether the three gave the same tokens.

Knobs: ``PONENTE_BENCH_SERVE_CLIENTS`` (default 16), ``PONENTE_BENCH_SERVE_REQUESTS`` (per client, default 4),
``PONENTE_BENCH_SERVE_ROUNDS`` (decode only, default 5), ``PONENTE_BENCH_SERVE_ONLY`` (``load`` or ``decode``: one of
the two parts; default both).
"""

from __future__ import annotations

import concurrent.futures
import logging
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


ANSWERS = (8, 32, 8, 128)
"""``max_tokens`` of request ``i``: ``ANSWERS[i % 4]``."""


def _prompt(i: int) -> str:
    return " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(6 + (i * 37) % 60))


def _load(base_url: str, clients: int, requests: int, offset: int) -> tuple[float, list[float], int]:
    """Every client sends its requests in turn; returns the wall time, the latencies and the generated tokens."""

    def client(c: int) -> tuple[list[float], int]:
        latencies, generated = [], 0
        with httpx.Client(base_url=base_url, timeout=600) as http:
            for r in range(requests):
                i = offset + c * requests + r
                body = {"prompt": _prompt(i), "max_tokens": ANSWERS[i % len(ANSWERS)], "temperature": 0}
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


def _static_slots_per_token(engine: Engine, prompts: list[list[int]], answers: list[int]) -> float:
    """Static batches as ``Engine.generate`` forms them (sorted by length, ``max_batch_size`` each): the cache slots
    of each batch (``rows x cache length``) over the tokens its rows hold, summed over the batch's decode steps."""
    slots = tokens = 0
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    for start in range(0, len(order), engine.max_batch_size):
        batch = order[start : start + engine.max_batch_size]
        rows = 1 << (len(batch) - 1).bit_length()
        longest = max(len(prompts[i]) + answers[i] for i in batch)
        cache_len = min(max(8, 1 << (longest - 1).bit_length()), engine.max_seq_len)
        for step in range(max(answers[i] for i in batch)):
            slots += rows * cache_len
            tokens += sum(len(prompts[i]) + min(step + 1, answers[i]) for i in batch)
    return slots / tokens


def _decode_only(rec: Recorder, model: Any, tokenizer: Any, seq_len: int, rounds: int) -> None:
    """Per decode step, 16 equal requests: continuous with 8 and 1 steps per call, and static batches."""
    from ponente.trainer.inference import GenerationConfig

    common: dict[str, Any] = {"max_batch_size": 16, "max_seq_len": seq_len, "page_size": 16, "prefill_chunk": 32}
    engines = {
        "continuous-8-steps": Engine(model, tokenizer, **common),
        "continuous-1-step": Engine(model, tokenizer, **common, steps_per_call=1),
        "static": Engine(model, tokenizer, **common, continuous=False),
    }
    new_tokens = 128
    prompts = [(engines["static"].encode(_prompt(i)) * 4)[:16] for i in range(16)]
    config = GenerationConfig(max_new_tokens=new_tokens)
    outputs = {name: [c.tokens for c in engine.generate(prompts, config)] for name, engine in engines.items()}
    same = all(out == outputs["static"] for out in outputs.values())
    times: dict[str, list[float]] = {name: [] for name in engines}
    names = list(engines)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            start = time.perf_counter()
            engines[name].generate(prompts, config)
            times[name].append(time.perf_counter() - start)
    extra = {"requests": 16, "prompt_tokens": 16, "new_tokens": new_tokens, "rounds": rounds, "same_tokens": same}
    ms = {name: 1000 * statistics.median(t) / new_tokens for name, t in times.items()}
    for name, value in ms.items():
        rec.record(f"decode-{name}", "ms_per_step", value, "ms", **extra)
    ratios = {  # per round, then the median: the rounds share the load of the moment
        "continuous-8-vs-1": [a / b for a, b in zip(times["continuous-1-step"], times["continuous-8-steps"])],
        "continuous-8-vs-static": [a / b for a, b in zip(times["static"], times["continuous-8-steps"])],
        "continuous-1-vs-static": [a / b for a, b in zip(times["static"], times["continuous-1-step"])],
    }
    for name, values in ratios.items():
        rec.record(f"decode-{name}", "speedup", statistics.median(values), "x", **extra)


def run(rec: Recorder) -> None:
    """Throughput and latency of the server under concurrent clients, continuous vs static batching."""
    from ponente.trainer.inference import GenerationConfig

    only = os.environ.get("PONENTE_BENCH_SERVE_ONLY", "")
    if only not in ("", "load", "decode"):
        raise ValueError(f"PONENTE_BENCH_SERVE_ONLY: 'load' or 'decode', got {only!r}")
    clients = int(os.environ.get("PONENTE_BENCH_SERVE_CLIENTS", "16"))
    requests = int(os.environ.get("PONENTE_BENCH_SERVE_REQUESTS", "4"))
    tokenizer = load_tokenizer(resolve_url("package://ponente.trainer.assets/shakespeare_tokenizer.json"))
    config = LlamaConfig(seq_len=256, hidden_dim=128, intermediate_dim=512, num_layers=2, num_heads=4, num_kv_heads=4)
    model = config.build(hax.Axis("vocab", tokenizer.get_vocab_size()), key=jax.random.key(0))
    extra: dict[str, Any] = {"clients": clients, "requests_per_client": requests, "max_tokens": list(ANSWERS)}
    if only != "load":
        _decode_only(rec, model, tokenizer, config.seq_len, int(os.environ.get("PONENTE_BENCH_SERVE_ROUNDS", "5")))
    if only == "decode":
        return
    rates = {}
    for mode in ("continuous", "continuous-1-step", "static"):
        engine = Engine(
            model,
            tokenizer,
            max_batch_size=16,
            max_seq_len=config.seq_len,
            continuous=mode != "static",
            steps_per_call=1 if mode == "continuous-1-step" else 8,
            page_size=16,
            prefill_chunk=32,
        )
        limits = ServerLimits(model_name="bench", max_seq_len=config.seq_len, max_tokens=max(ANSWERS), max_prompts=16)
        app = create_app(engine, tokenizer, limits=limits, max_pending=4 * clients)
        with ServerThread(app) as server:
            if mode == "static":  # compile every batch bucket (1, 2, 4, ... 16) the timed round may use
                size = 1
                while size <= 16:
                    _load(server.base_url, size, 1, offset=10_000 + size)
                    size *= 2
            for warm in range(2):
                _load(server.base_url, clients, 2, offset=20_000 + 1000 * warm)
            _load(server.base_url, clients, requests, offset=0)  # the timed load once: the buckets it meets compile
            logging.getLogger(__name__).info("timed loads of %s", mode)
            # the faster of two timed runs: a bucket the warm-up missed compiles in the first (about a second here)
            wall, latencies, generated = min(
                (_load(server.base_url, clients, requests, offset=0) for _ in range(2)), key=lambda run: run[0]
            )
        rates[mode] = generated / wall
        row = {**extra, "mode": mode}
        rec.record(mode, "tokens_per_second", rates[mode], "tokens/s", **row)
        rec.record(mode, "requests_per_second", len(latencies) / wall, "requests/s", **row)
        rec.record(mode, "latency_p50", statistics.median(latencies), "s", **row)
        rec.record(mode, "latency_p99", statistics.quantiles(latencies, n=100)[-1], "s", **row)
        # KV memory per token in flight, on 16 mixed requests at once
        prompts = [engine.encode(_prompt(i)) for i in range(16)]
        answers = [ANSWERS[i % len(ANSWERS)] for i in range(16)]
        if mode != "static":
            batch = engine._batch
            assert batch is not None
            pages, held = batch.page_token_steps, batch.cached_token_steps
            engine.generate(prompts, [GenerationConfig(max_new_tokens=a) for a in answers])
            per_token = (batch.page_token_steps - pages) / (batch.cached_token_steps - held)
        else:
            per_token = _static_slots_per_token(engine, prompts, answers)
        rec.record(mode, "kv_slots_per_token_in_flight", per_token, "slots/token", **row)
    rec.record("continuous_vs_static", "tokens_per_second_ratio", rates["continuous"] / rates["static"], "x")
    rec.record(
        "continuous_vs_continuous-1-step",
        "tokens_per_second_ratio",
        rates["continuous"] / rates["continuous-1-step"],
        "x",
    )
