"""Whisper log-mel feature extraction: ``ponente.datacache.audio`` vs ``transformers.WhisperFeatureExtractor``.

Both turn the same batch of 30-second, 16 kHz clips into ``[batch, n_mels, 3000]`` features; the suite records
the throughput of each in audio seconds per wall-clock second, and their ratio (target >= 1). The reference is
the extractor's public ``__call__`` with ``return_tensors="np"``: its torch STFT when torch is installed
(float32), its NumPy path otherwise. Ponente computes the transform in float64 (see the module's docstring).

Knobs: ``PONENTE_BENCH_AUDIO_BATCH`` (clips per call, default 8), ``PONENTE_BENCH_AUDIO_MELS`` (comma-separated,
default ``80,128``).
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING

import numpy as np

from benchmarks.harness import time_fn
from ponente.datacache.audio import CHUNK_SAMPLES, SAMPLE_RATE, log_mel_spectrogram

if TYPE_CHECKING:
    from benchmarks.harness import Recorder


def run(rec: Recorder) -> None:
    """Record audio seconds per second of both extractors and their ratio, for each mel size."""
    from transformers import WhisperFeatureExtractor
    from transformers.utils import is_torch_available

    batch = int(os.environ.get("PONENTE_BENCH_AUDIO_BATCH", "8"))
    sizes = [int(n) for n in os.environ.get("PONENTE_BENCH_AUDIO_MELS", "80,128").split(",")]
    rng = np.random.default_rng(0)
    clips = (0.1 * rng.standard_normal((batch, CHUNK_SAMPLES))).astype(np.float32)
    seconds = batch * CHUNK_SAMPLES / SAMPLE_RATE
    reference_path = "torch" if is_torch_available() else "numpy"
    for n_mels in sizes:
        extractor = WhisperFeatureExtractor(feature_size=n_mels)
        t_ref = time_fn(functools.partial(extractor, list(clips), sampling_rate=SAMPLE_RATE, return_tensors="np"))
        t_ours = time_fn(functools.partial(log_mel_spectrogram, clips, n_mels=n_mels))
        extra = {"n_mels": n_mels, "batch": batch, "reference_path": reference_path}
        rec.record(f"{n_mels}-mels/ponente", "throughput", seconds / t_ours, "audio s/s", **extra)
        rec.record(f"{n_mels}-mels/transformers", "throughput", seconds / t_ref, "audio s/s", **extra)
        rec.record(f"{n_mels}-mels", "speedup", t_ref / t_ours, "x", target=">= 1", **extra)
