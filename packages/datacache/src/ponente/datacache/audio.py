"""Audio for speech models: decoding, resampling to 16 kHz and Whisper's log-mel features, in NumPy (no JAX).

The features are those Whisper was trained on: 30-second windows of 16 kHz audio (shorter clips zero-padded,
longer ones cut), a 400-sample periodic-Hann STFT every 160 samples (so 100 frames per second, 3000 per
window), the power spectrum projected on 80 or 128 Slaney-normalised mel filters between 0 and 8 kHz, then
``log10``, floored at 8 below the clip's maximum and mapped by ``(x + 4) / 4``. The STFT runs in float64, the
mel projection and the log in float32; the features equal the NumPy path of ``transformers.WhisperFeatureExtractor``
to float32 rounding (~1e-7). That extractor's torch path computes its STFT in float32 and strays up to ~5e-5 in
quiet frequency bands. Shorter windows (``n_samples``) suit small models trained on short clips.

Decoding (WAV, FLAC, OGG through ``soundfile``) and resampling (``scipy.signal.resample_poly``) need the
``audio`` extra: ``pip install "ponente-datacache[audio]"``.
"""

from __future__ import annotations

import functools
import io
import math
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from ponente.datacache.errors import MissingExtraError

__all__ = [
    "CHUNK_SAMPLES",
    "HOP_LENGTH",
    "N_FFT",
    "SAMPLE_RATE",
    "AudioDecodeError",
    "decode_audio",
    "log_mel_spectrogram",
    "mel_filters",
    "resample",
]

SAMPLE_RATE = 16_000
"""The sample rate Whisper's features assume (Hz)."""
N_FFT = 400
"""STFT window length in samples (25 ms at 16 kHz)."""
HOP_LENGTH = 160
"""STFT hop in samples (10 ms at 16 kHz): 100 frames per second."""
CHUNK_SAMPLES = 30 * SAMPLE_RATE
"""Samples in one Whisper input window (30 seconds)."""


class AudioDecodeError(ValueError):
    """Audio bytes or a file that cannot be decoded (the message names the file when there is one)."""


def _hz_to_mel(freq: np.ndarray) -> np.ndarray:
    """Slaney's mel scale: linear (3 mels per 200 Hz) below 1 kHz, logarithmic (27 mels per factor 6.4) above."""
    freq = np.asarray(freq, dtype=np.float64)
    linear = 3.0 * freq / 200.0
    log = 15.0 + 27.0 * np.log(np.maximum(freq, 1e-10) / 1000.0) / math.log(6.4)
    return np.where(freq >= 1000.0, log, linear)


def _mel_to_hz(mel: np.ndarray) -> np.ndarray:
    mel = np.asarray(mel, dtype=np.float64)
    linear = 200.0 * mel / 3.0
    log = 1000.0 * np.exp(math.log(6.4) * (mel - 15.0) / 27.0)
    return np.where(mel >= 15.0, log, linear)


@functools.lru_cache(maxsize=8)
def mel_filters(
    n_mels: int, *, sample_rate: int = SAMPLE_RATE, n_fft: int = N_FFT, fmin: float = 0.0, fmax: float = 8000.0
) -> np.ndarray:
    """The triangular, area-normalised (Slaney) mel filter bank.

    Args:
        n_mels: number of filters (80 for Whisper up to large-v2, 128 for large-v3).
        sample_rate: the audio's sample rate.
        n_fft: the STFT length (``n_fft // 2 + 1`` frequency bins).
        fmin: lowest filter edge in Hz.
        fmax: highest filter edge in Hz.

    Returns:
        A read-only float64 array ``[n_fft // 2 + 1, n_mels]``.
    """
    if n_mels < 1:
        raise ValueError(f"n_mels: expected a positive number of mel filters, found {n_mels}")
    bins = np.linspace(0.0, sample_rate / 2.0, n_fft // 2 + 1)
    edges = _mel_to_hz(np.linspace(_hz_to_mel(np.array(fmin)), _hz_to_mel(np.array(fmax)), n_mels + 2))
    width = np.diff(edges)  # [n_mels + 1]
    rising = (bins[:, None] - edges[None, :-2]) / width[None, :-1]
    falling = (edges[None, 2:] - bins[:, None]) / width[None, 1:]
    bank = np.maximum(0.0, np.minimum(rising, falling))
    bank *= 2.0 / (edges[2:] - edges[:-2])[None, :]
    bank.setflags(write=False)
    return bank


def _rfft() -> Callable[..., np.ndarray]:
    try:
        import scipy.fft

        return functools.partial(scipy.fft.rfft, workers=-1)
    except ImportError:  # NumPy's FFT: the same numbers (it cannot overwrite its input)
        return lambda x, axis, overwrite_x: np.fft.rfft(x, axis=axis)


@functools.lru_cache(maxsize=4)
def _window(n_fft: int) -> np.ndarray:
    n = np.arange(n_fft, dtype=np.float64)
    return 0.5 - 0.5 * np.cos(2.0 * np.pi * n / n_fft)  # periodic Hann


def log_mel_spectrogram(audio: np.ndarray, *, n_mels: int = 80, n_samples: int | None = CHUNK_SAMPLES) -> np.ndarray:
    """Whisper's input features of one clip or a batch of clips.

    Args:
        audio: float samples at 16 kHz in [-1, 1], ``[samples]`` or ``[batch, samples]``.
        n_mels: number of mel bins (80, or 128 for large-v3).
        n_samples: pad with zeros / cut every clip to this many samples first (default 30 s, as Whisper
            expects); None keeps the length (``samples // 160`` frames).

    Returns:
        float32 ``[n_mels, frames]`` (or ``[batch, n_mels, frames]``), ``frames = n_samples // 160``.

    Example:
        ```python
        import numpy as np
        from ponente.datacache.audio import log_mel_spectrogram

        tone = np.sin(2 * np.pi * 440 * np.arange(16_000) / 16_000).astype(np.float32)
        log_mel_spectrogram(tone).shape  # (80, 3000): one second of sound, zero-padded to 30 s
        ```
    """
    x = np.asarray(audio, dtype=np.float32)
    if x.ndim not in (1, 2):
        raise ValueError(f"audio: expected [samples] or [batch, samples], found shape {x.shape}")
    single = x.ndim == 1
    x = x[None] if single else x
    if n_samples is not None:
        if x.shape[1] >= n_samples:
            x = x[:, :n_samples]
        else:
            x = np.pad(x, ((0, 0), (0, n_samples - x.shape[1])))
    if x.shape[1] <= N_FFT // 2:
        raise ValueError(f"audio: a clip needs more than {N_FFT // 2} samples, found {x.shape[1]}")
    n_frames = x.shape[1] // HOP_LENGTH
    filters = _mel_filters_f32(n_mels)
    out = np.empty((x.shape[0], n_mels, n_frames), dtype=np.float32)
    for i, clip in enumerate(x):  # one clip at a time: its buffers stay small, and a row never depends on the batch
        log = _log_mel(clip, filters, n_frames)  # [frames, mels]
        np.maximum(log, log.max() - 8.0, out=log)
        log += 4.0
        log /= 4.0
        out[i] = log.T
    return out[0] if single else out


def _log_mel(clip: np.ndarray, filters: np.ndarray, n_frames: int) -> np.ndarray:
    """``log10`` of one clip's mel power, float32 ``[frames, mels]`` (frames-major, as the product gives it).

    The STFT runs in float64: a float32 FFT's rounding (relative to the loudest bin) swamps the quiet bins that
    the log keeps (~5e-5 off after the log). The power is then rounded to float32, which costs only its own
    relative 6e-8, and projected on the mel filters in float32 (a sum of non-negative terms: nothing cancels).
    """
    padded = np.pad(clip.astype(np.float64), N_FFT // 2, mode="reflect")  # centred frames
    # every HOP_LENGTH samples a window of N_FFT; Whisper drops the last frame (100 frames per second exactly)
    frames = np.lib.stride_tricks.sliding_window_view(padded, N_FFT)[::HOP_LENGTH][:n_frames]
    spectrum = _rfft()(frames * _window(N_FFT), axis=-1, overwrite_x=True).astype(np.complex64)
    parts = spectrum.view(np.float32)  # re, im, re, im, ...
    mel = (np.square(parts[:, 0::2]) + np.square(parts[:, 1::2])) @ filters
    np.maximum(mel, 1e-10, out=mel)
    return np.log10(mel, out=mel)


@functools.lru_cache(maxsize=4)
def _mel_filters_f32(n_mels: int) -> np.ndarray:
    return np.ascontiguousarray(mel_filters(n_mels), dtype=np.float32)


def resample(audio: np.ndarray, orig_rate: int, target_rate: int = SAMPLE_RATE) -> np.ndarray:
    """Resample with a polyphase anti-aliasing filter (``scipy.signal.resample_poly``; the ``audio`` extra).

    Args:
        audio: float samples ``[samples]``.
        orig_rate: their sample rate in Hz.
        target_rate: the wanted rate (default 16 kHz).

    Returns:
        float32 samples at ``target_rate``.
    """
    if orig_rate <= 0 or target_rate <= 0:
        raise ValueError(f"sample rate: expected positive rates, found {orig_rate} -> {target_rate}")
    if orig_rate == target_rate:
        return np.asarray(audio, dtype=np.float32)
    try:
        from scipy.signal import resample_poly
    except ImportError as exc:
        raise MissingExtraError(
            f"resampling {orig_rate} Hz audio to {target_rate} Hz needs scipy: pip install 'ponente-datacache[audio]'"
        ) from exc
    g = math.gcd(int(orig_rate), int(target_rate))
    return resample_poly(np.asarray(audio, dtype=np.float64), target_rate // g, orig_rate // g).astype(np.float32)


def decode_audio(
    source: str | os.PathLike[str] | bytes, *, sample_rate: int = SAMPLE_RATE, name: str | None = None
) -> np.ndarray:
    """Decode a WAV/FLAC/OGG file or bytes to mono float32 samples at ``sample_rate``.

    Args:
        source: a path (local or any fsspec URL) or the encoded bytes.
        sample_rate: the rate to resample to.
        name: what to call the audio in errors (default: the path, or "audio bytes").

    Returns:
        float32 ``[samples]`` in [-1, 1] (channels averaged).

    Raises:
        MissingExtraError: without ``soundfile`` (the ``audio`` extra).
        AudioDecodeError: if the data is not audio ``soundfile`` can read, naming the file.
    """
    try:
        import soundfile
    except ImportError as exc:
        raise MissingExtraError("decoding audio needs soundfile: pip install 'ponente-datacache[audio]'") from exc
    if isinstance(source, bytes | bytearray):
        label = name or "audio bytes"
        data = bytes(source)
    else:
        label = name or os.fspath(source)
        import fsspec

        try:
            with fsspec.open(os.fspath(source), "rb") as f:
                data = f.read()
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"audio file not found: {label}") from exc
    try:
        samples, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except Exception as exc:  # soundfile raises LibsndfileError/RuntimeError/TypeError on bad input
        raise AudioDecodeError(f"cannot decode audio {label}: {str(exc).strip() or type(exc).__name__}") from exc
    if samples.shape[0] == 0:
        raise AudioDecodeError(f"cannot decode audio {label}: it has no samples")
    mono: Any = samples.mean(axis=1)
    return resample(mono, int(rate), sample_rate)
