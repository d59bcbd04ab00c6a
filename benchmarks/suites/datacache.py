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


def _build_throughput(rec: Recorder) -> None:
    """Cache build throughput vs raw ``tokenizers`` ``encode_batch`` on the same documents and cores.

    A synthetic corpus (~16 MB of text in 8 gzipped JSON-lines shards) and a byte-level BPE (vocabulary
    4096) trained on it. The reference tokenizes all documents, already in memory, with one
    ``encode_batch`` call (all cores). The build reads, decompresses and parses the shards, tokenizes,
    and writes the cache; ``ratio_vs_encode_batch`` is reference time over build time (target >= 0.9).
    """
    import gzip
    import os
    import time

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from ponente.datacache import build_cache

    rng = np.random.default_rng(0)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    vocab = ["".join(rng.choice(letters, size=int(rng.integers(2, 10)))) for _ in range(5000)]
    docs = [" ".join(rng.choice(vocab, size=int(rng.integers(20, 400)))) for _ in range(8000)]
    text_bytes = sum(len(d) for d in docs)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=4096, special_tokens=["<eos>"], show_progress=False)
    tokenizer.train_from_iterator(docs[:500], trainer)
    cores = os.cpu_count() or 1

    encode = time_fn(lambda: tokenizer.encode_batch(docs, add_special_tokens=False), warmup=1, repeat=3)
    tokens = sum(len(e.ids) for e in tokenizer.encode_batch(docs, add_special_tokens=False))
    rec.record("build", "encode_batch_tokens_per_s", tokens / encode, "tokens/s", cores=cores, text_bytes=text_bytes)
    with tempfile.TemporaryDirectory() as tmp:
        tok_path = Path(tmp) / "tokenizer.json"
        tokenizer.save(str(tok_path))
        shards = []
        for i in range(8):
            path = Path(tmp) / f"train.{i}.jsonl.gz"
            path.write_bytes(gzip.compress("".join(json.dumps({"text": d}) + "\n" for d in docs[i::8]).encode()))
            shards.append(str(path))
        for workers in (0, cores):
            times = []
            for repeat in range(2):
                out = Path(tmp) / f"cache-{workers}-{repeat}"
                start = time.perf_counter()
                build_cache(shards, out, tokenizer=tok_path, workers=workers, progress=False)
                times.append(time.perf_counter() - start)
            best = min(times)
            backend = "in-process" if workers == 0 else f"local x{workers}"
            rec.record("build", "tokens_per_s", tokens / best, "tokens/s", workers=workers, backend=backend)
            rec.record("build", "MB_per_s", text_bytes / best / 1e6, "MB/s", workers=workers, backend=backend)
            rec.record("build", "ratio_vs_encode_batch", encode / best, "x", workers=workers, backend=backend)


def run(rec: Recorder) -> None:
    _build_throughput(rec)
    _read_throughput(rec)
