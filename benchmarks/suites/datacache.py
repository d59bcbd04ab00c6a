"""ponente.datacache: cache reads (and builds) measured against plain NumPy / raw tokenizers in the same process."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.harness import Recorder, time_fn


def _read_throughput(rec: Recorder) -> None:
    """Random-access `TokenSeqDataset` batch reads from a local on-disk cache, vs NumPy fancy indexing.

    Builds a pre-tokenized cache of ~4M tokens (documents of 16..4095 tokens), then reads random batches
    of 64 windows of 2048 tokens: once cold (every chunk decoded from disk on first touch) and warm (the
    reader's chunk cache holds the data). The reference is ``windows[idx]`` on the same tokens as one
    in-memory NumPy array; ``ratio_vs_numpy`` is our throughput over the reference's.
    """
    from ponente.datacache import InMemoryTokenStore, PassthroughProcessor, TokenSeqDataset, build_cache, open_cache

    seq_len, batch_size, total_tokens = 2048, 64, 4 << 20
    rng = np.random.default_rng(0)
    docs = []
    count = 0
    while count < total_tokens:
        doc = rng.integers(0, 50_000, size=int(rng.integers(16, 4096)), dtype=np.int32)
        docs.append(doc)
        count += doc.size
    flat = np.concatenate(docs)
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.jsonl"
        with corpus.open("w", encoding="utf-8") as f:
            for doc in docs:
                f.write(json.dumps({"input_ids": doc.tolist()}) + "\n")
        build_cache(str(corpus), str(Path(tmp) / "cache"), processor=PassthroughProcessor(), progress=False)

        cache = open_cache(str(Path(tmp) / "cache"))
        ds = TokenSeqDataset(cache, seq_len)
        n = len(ds)
        batches = [rng.integers(0, n, size=batch_size) for _ in range(32)]
        tokens_per_batch = batch_size * seq_len

        order = rng.permutation(n)
        cold = time_fn(
            lambda: [ds.get_batch_arrays(order[k : k + batch_size]) for k in range(0, n, batch_size)],
            warmup=0,
            repeat=1,
        )
        rec.record(
            "token_seq_read",
            "tokens_per_s_cold",
            n * seq_len / cold,
            "tokens/s",
            seq_len=seq_len,
            batch=batch_size,
            tokens=int(flat.size),
        )

        cursor = iter(range(1 << 30))

        def ours() -> None:
            ds.get_batch_arrays(batches[next(cursor) % len(batches)])

        warm = time_fn(ours, warmup=4, repeat=50)
        windows = flat[: n * seq_len].reshape(n, seq_len)

        def reference() -> None:
            windows[batches[next(cursor) % len(batches)]].copy()

        ref = time_fn(reference, warmup=4, repeat=50)
        memory = TokenSeqDataset(InMemoryTokenStore.from_documents(docs), seq_len)
        in_memory = time_fn(lambda: memory.get_batch_arrays(batches[next(cursor) % len(batches)]), warmup=4, repeat=50)

    rec.record(
        "token_seq_read",
        "tokens_per_s",
        tokens_per_batch / warm,
        "tokens/s",
        seq_len=seq_len,
        batch=batch_size,
        tokens=int(flat.size),
        store="on-disk cache",
    )
    rec.record(
        "token_seq_read",
        "tokens_per_s_numpy_reference",
        tokens_per_batch / ref,
        "tokens/s",
        seq_len=seq_len,
        batch=batch_size,
    )
    rec.record(
        "token_seq_read",
        "tokens_per_s_in_memory_store",
        tokens_per_batch / in_memory,
        "tokens/s",
        seq_len=seq_len,
        batch=batch_size,
    )
    rec.record("token_seq_read", "ratio_vs_numpy", ref / warm, "x", seq_len=seq_len, batch=batch_size)


def run(rec: Recorder) -> None:
    _read_throughput(rec)
