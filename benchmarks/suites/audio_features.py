"""Whisper log-mel feature extraction: ``ponente.datacache.audio`` vs ``transformers.WhisperFeatureExtractor``.

Both turn the same batch of 30-second, 16 kHz clips into ``[batch, n_mels, 3000]`` features; the suite records
the throughput of each in audio seconds per wall-clock second, and the median of their per-round ratios (target
>= 1), timed in interleaved rounds so that load on a shared machine hits both alike. The reference is the
extractor's public ``__call__`` with ``return_tensors="np"``: its torch STFT when torch is installed (float32),
its NumPy path otherwise. Ponente computes the STFT in float64 (see the module's docstring); the suite checks
that both give the same features (within 1e-4, the torch path's float32 rounding) before timing.

Knobs: ``PONENTE_BENCH_AUDIO_BATCH`` (clips per call, default 8), ``PONENTE_BENCH_AUDIO_MELS`` (comma-separated,
default ``80,128``), ``PONENTE_BENCH_STEPS`` (rounds, default 30).
"""

from __future__ import annotations

import functools
import os
import statistics
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from benchmarks.harness import interleaved_times, round_ratio
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
        steps: dict[str, Callable[[], Any]] = {
            "ponente": functools.partial(log_mel_spectrogram, clips, n_mels=n_mels),
            "transformers": functools.partial(extractor, list(clips), sampling_rate=SAMPLE_RATE, return_tensors="np"),
        }
        gap = float(np.abs(steps["ponente"]() - steps["transformers"]().input_features).max())
        if gap > 1e-4:
            raise RuntimeError(f"{n_mels} mels: Ponente's features differ from transformers' by {gap}")
        times = interleaved_times(steps)
        extra = {"n_mels": n_mels, "batch": batch, "reference_path": reference_path}
        for name in steps:
            rec.record(
                f"{n_mels}-mels/{name}", "throughput", seconds / statistics.median(times[name]), "audio s/s", **extra
            )
        ratio, spread = round_ratio(times["transformers"], times["ponente"])
        rec.record(f"{n_mels}-mels", "speedup", ratio, "x", target=">= 1", max_abs_difference=gap, **extra, **spread)
