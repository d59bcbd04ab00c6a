"""The synthetic spoken-digit set: deterministic files, readable WAVs, distinct digits, a real Whisper tokenizer.

Checked with code other than the generator's: the WAVs are read with ``soundfile``, the tokenizer is loaded by
``transformers``' Whisper tokenizer (ids, prompt, decoding, language order), the features come from
``transformers``' ``WhisperFeatureExtractor``, and the cache rows from ``ponente-datacache``'s processor.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ponente.trainer.data.synthetic_speech import (
    DIGITS,
    MAX_SECONDS,
    SAMPLE_RATE,
    WHISPER_LANGUAGES,
    speak_digits,
    whisper_special_tokens,
    write_synthetic_speech,
    write_tokenizer,
)

transformers = pytest.importorskip("transformers")
soundfile = pytest.importorskip("soundfile")


def _digests(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def speech(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("speech")
    write_synthetic_speech(out, train=12, validation=4, seed=3)
    return out


def test_same_seed_same_bytes_and_clips_do_not_depend_on_the_count(speech: Path, tmp_path: Path) -> None:
    again = tmp_path / "again"
    write_synthetic_speech(again, train=12, validation=4, seed=3)
    assert _digests(again) == _digests(speech)

    fewer = tmp_path / "fewer"
    write_synthetic_speech(fewer, train=5, validation=2, seed=3)
    assert _rows(fewer / "train.jsonl") == _rows(speech / "train.jsonl")[:5]
    for name, digest in _digests(fewer).items():
        if name.startswith("clips/"):
            assert digest == _digests(speech)[name], name

    other = tmp_path / "other"
    write_synthetic_speech(other, train=12, validation=4, seed=4)
    assert _rows(other / "train.jsonl") != _rows(speech / "train.jsonl")
    assert (other / "clips" / "train-00000.wav").read_bytes() != (speech / "clips" / "train-00000.wav").read_bytes()


def test_rows_name_16khz_mono_clips_of_two_to_four_digits(speech: Path) -> None:
    seen: set[str] = set()
    for split, count in (("train", 12), ("validation", 4)):
        rows = _rows(speech / f"{split}.jsonl")
        assert len(rows) == count
        for row in rows:
            assert set(row) == {"audio", "text"}
            words = row["text"].split(" ")
            assert 2 <= len(words) <= 4, row
            assert set(words) <= set(DIGITS), row
            samples, rate = soundfile.read(speech / row["audio"], dtype="float32")
            assert rate == SAMPLE_RATE
            assert samples.ndim == 1
            assert 0.6 * SAMPLE_RATE < samples.size <= MAX_SECONDS * SAMPLE_RATE
            assert 0.2 < np.max(np.abs(samples)) < 1.0
            seen.add(row["audio"])
    assert len(seen) == 16  # every clip its own file


def test_the_cli_writes_what_the_function_writes(speech: Path, tmp_path: Path) -> None:
    out = tmp_path / "cli"
    cmd = [sys.executable, "-m", "ponente.trainer.data.synthetic_speech", str(out), "--train", "12"]
    subprocess.run([*cmd, "--validation", "4", "--seed", "3"], check=True, capture_output=True, timeout=120)
    assert _digests(out) == _digests(speech)
    bad = subprocess.run([*cmd, "--validation", "-1"], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0
    assert "--validation must be >= 0" in bad.stderr


def _log_mel(clip: np.ndarray) -> np.ndarray:
    fe = transformers.WhisperFeatureExtractor(feature_size=80, chunk_length=2)
    return fe(clip, sampling_rate=SAMPLE_RATE, return_tensors="np").input_features[0]


def test_each_digit_sounds_alike_across_speakers_and_unlike_the_others() -> None:
    """Nearest-centroid on time-pooled log-mel features tells held-out speakers' digits apart."""

    def pooled(digit: int, seed: int) -> np.ndarray:
        clip = speak_digits([digit], np.random.default_rng([seed, digit]))
        mel = _log_mel(clip)
        loud = mel[:, mel.max(axis=0) > mel.max() - 0.6]  # the frames of the word, not the silence around it
        thirds = np.array_split(loud, 3, axis=1)  # beginning, middle and end of the word
        return np.concatenate([part.mean(axis=1) for part in thirds])

    centroids = np.stack([np.mean([pooled(d, s) for s in range(4)], axis=0) for d in range(10)])
    correct = 0
    for seed in range(100, 104):
        for d in range(10):
            correct += int(np.argmin(np.linalg.norm(centroids - pooled(d, seed), axis=1)) == d)
    assert correct >= 36, correct


def test_tokenizer_is_a_whisper_tokenizer_for_transformers(tmp_path: Path) -> None:
    path = write_tokenizer(tmp_path / "tok")
    hf = transformers.WhisperTokenizerFast(
        tokenizer_file=str(path), language="english", task="transcribe", predict_timestamps=False
    )
    ids = {t: hf.convert_tokens_to_ids(t) for t in whisper_special_tokens()}
    assert sorted(ids.values()) == list(range(min(ids.values()), min(ids.values()) + len(ids)))
    assert list(ids) == sorted(ids, key=lambda token: ids[token])  # Whisper's order
    assert len(hf) == max(ids.values()) + 1 == 1931

    words = " ".join(DIGITS)
    encoded = hf(words).input_ids
    prompt = [ids[t] for t in ("<|startoftranscript|>", "<|en|>", "<|transcribe|>", "<|notimestamps|>")]
    assert encoded[:4] == prompt
    assert encoded[-1] == ids["<|endoftext|>"]
    assert len(encoded) == 4 + len(DIGITS) + 1  # one token per digit word
    assert hf.decode(encoded, skip_special_tokens=True) == words
    for word in DIGITS:  # with and without the leading space
        assert len(hf(word, add_special_tokens=False).input_ids) == 1
        assert len(hf(" " + word, add_special_tokens=False).input_ids) == 1
    text = "Zéro, 42 — ok?"  # byte-level: any text round-trips
    assert hf.decode(hf(text, add_special_tokens=False).input_ids) == text

    german = transformers.WhisperTokenizerFast(tokenizer_file=str(path), language="german", task="translate")
    assert german("one").input_ids[:3] == [ids["<|startoftranscript|>"], ids["<|de|>"], ids["<|translate|>"]]


def test_languages_are_whispers_in_its_order() -> None:
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    assert list(WHISPER_LANGUAGES) == list(LANGUAGES)[: len(WHISPER_LANGUAGES)]
    assert len(WHISPER_LANGUAGES) == 99


def test_auto_tokenizer_loads_the_folder(speech: Path) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(speech / "tokenizer")
    assert "Whisper" in type(tok).__name__
    assert tok.decode(tok("three one", add_special_tokens=False).input_ids) == "three one"


def test_the_set_builds_a_cache_of_whisper_features_and_ids(speech: Path, tmp_path: Path) -> None:
    pytest.importorskip("scipy")
    from ponente.datacache import build_cache
    from ponente.datacache.asr import AudioTranscriptProcessor

    processor = AudioTranscriptProcessor(str(speech / "tokenizer" / "tokenizer.json"), audio_root=speech)
    cache = build_cache(
        str(speech / "validation.jsonl"), tmp_path / "cache", processor=processor, workers=0, progress=False
    )
    hf = transformers.WhisperTokenizerFast(
        tokenizer_file=str(speech / "tokenizer" / "tokenizer.json"), language="english", task="transcribe"
    )
    fe = transformers.WhisperFeatureExtractor(feature_size=80)
    rows = _rows(speech / "validation.jsonl")
    assert len(cache) == len(rows)
    for i, row in enumerate(rows):
        samples, _ = soundfile.read(speech / row["audio"], dtype="float32")
        want = fe(samples, sampling_rate=SAMPLE_RATE, return_tensors="np").input_features[0]
        np.testing.assert_allclose(cache[i]["input_features"].reshape(80, -1), want, rtol=0, atol=1e-4)
        assert cache[i]["input_ids"].tolist() == hf(row["text"]).input_ids


@pytest.mark.parametrize("digits", [[], [3, 10], [1, 2, 3, 4, 5, 6, 7, 8]])
def test_bad_digit_lists_are_one_line_errors(digits: list[int]) -> None:
    with pytest.raises(ValueError, match=r"digits|longer than"):
        speak_digits(digits, np.random.default_rng(0))
