"""Whisper log-mel features and audio decoding, against transformers' WhisperFeatureExtractor and synthetic signals."""

from __future__ import annotations

import io

import numpy as np
import pytest

from ponente.datacache.audio import (
    CHUNK_SAMPLES,
    AudioDecodeError,
    decode_audio,
    log_mel_spectrogram,
    mel_filters,
    resample,
)

transformers = pytest.importorskip("transformers")


def _chirp(seconds: float, seed: int) -> np.ndarray:
    """A rising tone plus noise: loud and quiet frequency bands, so log-mel rounding shows up."""
    t = np.arange(int(16_000 * seconds)) / 16_000
    rng = np.random.default_rng(seed)
    return (0.3 * np.sin(2 * np.pi * (300 + 200 * t) * t) + 0.02 * rng.standard_normal(t.size)).astype(np.float32)


@pytest.mark.parametrize("n_mels", [80, 128])
def test_mel_filters_match_transformers(n_mels: int) -> None:
    from transformers.audio_utils import mel_filter_bank

    ref = mel_filter_bank(
        num_frequency_bins=201,
        num_mel_filters=n_mels,
        min_frequency=0.0,
        max_frequency=8000.0,
        sampling_rate=16_000,
        norm="slaney",
        mel_scale="slaney",
    )
    np.testing.assert_allclose(mel_filters(n_mels), ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize("n_mels", [80, 128])
@pytest.mark.parametrize("seconds", [3.0, 30.0, 41.5])
def test_log_mel_matches_whisper_feature_extractor(n_mels: int, seconds: float) -> None:
    audio = _chirp(seconds, seed=n_mels)
    extractor = transformers.WhisperFeatureExtractor(feature_size=n_mels)
    ours = log_mel_spectrogram(audio, n_mels=n_mels)
    assert ours.shape == (n_mels, 3000)
    assert ours.dtype == np.float32
    # transformers' float64 NumPy path: equal to float32 rounding
    window = np.pad(audio[:CHUNK_SAMPLES], (0, max(0, CHUNK_SAMPLES - audio.size)))
    reference = extractor._np_extract_fbank_features(window[None], "cpu")[0]
    np.testing.assert_allclose(ours, reference, rtol=0, atol=1e-5)
    # the public call (its torch path when torch is installed computes in float32: ~5e-5 in quiet bands)
    public = extractor(audio, sampling_rate=16_000, return_tensors="np").input_features[0]
    np.testing.assert_allclose(ours, public, rtol=0, atol=1e-4)


def test_batch_equals_clips_and_keeps_each_clips_floor() -> None:
    clips = [_chirp(5.0, 1), 0.01 * _chirp(2.0, 2)]  # a quiet clip: its floor is its own max - 8, not the batch's
    batch = np.stack([np.pad(c, (0, CHUNK_SAMPLES - c.size)) for c in clips])
    out = log_mel_spectrogram(batch)
    for row, clip in zip(out, clips, strict=True):
        np.testing.assert_array_equal(row, log_mel_spectrogram(clip))
    extractor = transformers.WhisperFeatureExtractor(feature_size=80)
    ref = extractor(clips, sampling_rate=16_000, return_tensors="np").input_features
    np.testing.assert_allclose(out, ref, rtol=0, atol=1e-4)


def test_unpadded_length_and_bad_shapes() -> None:
    out = log_mel_spectrogram(_chirp(1.0, 0), n_samples=None)
    assert out.shape == (80, 100)
    with pytest.raises(ValueError, match="audio: expected"):
        log_mel_spectrogram(np.zeros((2, 2, 500)))
    with pytest.raises(ValueError, match="n_mels"):
        mel_filters(0)


def _wav_bytes(samples: np.ndarray, rate: int, fmt: str = "WAV") -> bytes:
    soundfile = pytest.importorskip("soundfile")
    buf = io.BytesIO()
    soundfile.write(buf, samples, rate, format=fmt)
    return buf.getvalue()


@pytest.mark.parametrize("fmt", ["WAV", "FLAC"])
def test_decode_resamples_to_16k_and_mixes_to_mono(tmp_path, fmt: str) -> None:
    pytest.importorskip("scipy")
    rate = 44_100
    t = np.arange(rate) / rate
    tone = 0.5 * np.sin(2 * np.pi * 440 * t)
    stereo = np.stack([tone, tone], axis=1)
    path = tmp_path / f"tone.{fmt.lower()}"
    path.write_bytes(_wav_bytes(stereo, rate, fmt))
    decoded = decode_audio(path)
    t16 = np.arange(16_000) / 16_000
    expected = 0.5 * np.sin(2 * np.pi * 440 * t16)
    assert decoded.dtype == np.float32
    assert abs(decoded.size - 16_000) <= 1
    inner = slice(200, 15_800)  # the filter's edges ramp
    np.testing.assert_allclose(decoded[inner], expected[inner], atol=2e-3)
    np.testing.assert_allclose(decode_audio(path.read_bytes()), decoded)


def test_resample_identity_and_bad_rate() -> None:
    x = _chirp(0.5, 3)
    np.testing.assert_array_equal(resample(x, 16_000), x)
    with pytest.raises(ValueError, match="sample rate"):
        resample(x, 0)


def test_corrupt_and_missing_audio_are_named(tmp_path) -> None:
    pytest.importorskip("soundfile")
    bad = tmp_path / "broken.wav"
    bad.write_bytes(b"RIFF\x00\x00\x00\x00WAVEnot really audio")
    with pytest.raises(AudioDecodeError, match=r"broken\.wav"):
        decode_audio(bad)
    with pytest.raises(AudioDecodeError, match="clip-7"):
        decode_audio(b"\x00" * 64, name="clip-7")
    with pytest.raises(FileNotFoundError, match=r"nothere\.flac"):
        decode_audio(tmp_path / "nothere.flac")


@pytest.mark.parametrize("rate", [8_000, 22_050, 44_100])
def test_resample_matches_fourier_resampling_of_a_periodic_signal(rate: int) -> None:
    """A band-limited periodic clip: scipy's FFT resampling is exact for it, so the polyphase filter must agree."""
    signal = pytest.importorskip("scipy.signal")
    seconds = 1.0  # whole cycles of every tone below, so the clip is periodic
    t = np.arange(int(rate * seconds)) / rate
    tones = [(110, 0.3), (440, 0.2), (1_000, 0.1), (3_000, 0.05)]
    x = sum(a * np.sin(2 * np.pi * f * t) for f, a in tones)
    ours = resample(x, rate)
    reference = signal.resample(x, int(16_000 * seconds))
    assert ours.dtype == np.float32
    assert ours.shape == reference.shape
    inner = slice(400, -400)  # the polyphase filter's edges see zeros, the FFT method wraps around
    np.testing.assert_allclose(ours[inner], reference[inner], rtol=0, atol=2e-3)
    # each tone peaks at its frequency (1 Hz bins over one second) with its amplitude (Hann gain: N / 4)
    spectrum = np.abs(np.fft.rfft(ours * np.hanning(ours.size)))
    for f, a in tones:
        assert int(np.argmax(spectrum[f - 20 : f + 21])) == 20
        assert spectrum[f] == pytest.approx(a * ours.size / 4, rel=0.01)


def test_resample_removes_what_16k_cannot_hold() -> None:
    """A 10 kHz tone at 44.1 kHz is above the 8 kHz Nyquist limit of 16 kHz audio: it must not alias to 6 kHz."""
    pytest.importorskip("scipy")
    t = np.arange(44_100) / 44_100
    kept, dropped = np.sin(2 * np.pi * 1_000 * t), np.sin(2 * np.pi * 10_000 * t)
    x = 0.5 * kept + 0.5 * dropped

    def level_at_6k(out: np.ndarray) -> float:  # relative to the 1 kHz tone
        spectrum = np.abs(np.fft.rfft(out[1_000:-1_000] * np.hanning(out.size - 2_000)))
        freqs = np.fft.rfftfreq(out.size - 2_000, 1 / 16_000)
        return float(spectrum[np.argmin(np.abs(freqs - 6_000))] / spectrum[np.argmin(np.abs(freqs - 1_000))])

    assert level_at_6k(resample(x, 44_100)) < 1e-2  # attenuated by more than 40 dB
    naive = np.interp(np.arange(16_000) / 16_000, t, x)  # no anti-aliasing filter: the alias is loud
    assert level_at_6k(naive) > 0.3
