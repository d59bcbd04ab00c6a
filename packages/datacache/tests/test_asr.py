"""Audio + transcript records -> cache rows, against transformers' Whisper feature extractor and tokenizer."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest

from ponente.datacache import build_cache
from ponente.datacache.asr import AudioTranscriptProcessor, whisper_prefix_tokens
from ponente.datacache.audio import CHUNK_SAMPLES
from ponente.datacache.errors import BadRecordError

transformers = pytest.importorskip("transformers")
soundfile = pytest.importorskip("soundfile")
pytest.importorskip("scipy")

SPECIALS = [
    "<|startoftranscript|>",
    "<|en|>",  # Whisper's language order (transformers locates a language token by its index)
    "<|zh|>",
    "<|de|>",
    "<|transcribe|>",
    "<|translate|>",
    "<|nocaptions|>",
    "<|notimestamps|>",
    *[f"<|{i * 0.02:.2f}|>" for i in range(1501)],
]
WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([" ".join(WORDS)] * 20, trainer)
    tok.add_special_tokens(SPECIALS)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return str(path)


def _clip(i: int, seconds: float = 1.5) -> np.ndarray:
    t = np.arange(int(16_000 * seconds)) / 16_000
    return (0.2 * np.sin(2 * np.pi * (200 + 90 * i) * t)).astype(np.float32)


def _wav(samples: np.ndarray, rate: int = 16_000) -> bytes:
    buf = io.BytesIO()
    soundfile.write(buf, samples, rate, format="WAV", subtype="FLOAT")
    return buf.getvalue()


def _records(tmp_path) -> list[dict]:
    """Four records, one per way of giving the audio: a relative path, base64 bytes, a dict path, samples."""
    (tmp_path / "clips").mkdir(exist_ok=True)
    (tmp_path / "clips" / "a.wav").write_bytes(_wav(_clip(0)))
    (tmp_path / "clips" / "c.wav").write_bytes(_wav(_clip(2)))
    return [
        {"audio": "clips/a.wav", "text": "one two three"},
        {"audio": {"bytes": base64.b64encode(_wav(_clip(1))).decode(), "path": "b.wav"}, "text": "four five"},
        {"audio": {"path": str(tmp_path / "clips" / "c.wav")}, "text": "six"},
        {"audio": {"array": _clip(3).tolist(), "sampling_rate": 16_000}, "text": "seven eight nine zero"},
    ]


def _write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _reference_rows(tokenizer_file: str, language: str, task: str) -> tuple[list[np.ndarray], list[list[int]]]:
    fe = transformers.WhisperFeatureExtractor(feature_size=80)
    clips = [_clip(i) for i in range(4)]
    feats = [fe._np_extract_fbank_features(np.pad(c, (0, CHUNK_SAMPLES - c.size))[None], "cpu")[0] for c in clips]
    hf_tok = transformers.WhisperTokenizerFast(
        tokenizer_file=tokenizer_file, language=language, task=task, predict_timestamps=False
    )
    texts = ["one two three", "four five", "six", "seven eight nine zero"]
    return feats, [hf_tok(t).input_ids for t in texts]


@pytest.mark.parametrize(("language", "task"), [("en", "transcribe"), ("de", "translate")])
def test_cache_rows_match_whisper_feature_extractor_and_tokenizer(tmp_path, tokenizer_file, language, task) -> None:
    data = _write_jsonl(tmp_path / "train.jsonl", _records(tmp_path))
    processor = AudioTranscriptProcessor(tokenizer_file, language=language, task=task, audio_root=tmp_path)
    cache = build_cache(data, tmp_path / "cache", processor=processor, workers=0, progress=False)
    hf_language = {"en": "english", "de": "german"}[language]
    features, ids = _reference_rows(tokenizer_file, hf_language, task)
    assert len(cache) == 4
    for i in range(4):
        row = cache[i]
        np.testing.assert_allclose(row["input_features"].reshape(80, 3000), features[i], rtol=0, atol=1e-5)
        assert row["input_ids"].tolist() == ids[i]


def test_rows_do_not_depend_on_worker_count(tmp_path, tokenizer_file) -> None:
    data = _write_jsonl(tmp_path / "train.jsonl", _records(tmp_path)[:3] * 3)
    processor = AudioTranscriptProcessor(tokenizer_file, audio_root=tmp_path)
    one = build_cache(data, tmp_path / "c0", processor=processor, workers=0, progress=False, batch_rows=2)
    two = build_cache(data, tmp_path / "c2", processor=processor, workers=2, progress=False, batch_rows=2)
    assert len(one) == len(two) == 9
    for i in range(9):
        for field in ("input_features", "input_ids"):
            np.testing.assert_array_equal(one[i][field], two[i][field])


def test_bad_audio_is_skipped_and_counted_or_an_error_naming_the_file(tmp_path, tokenizer_file) -> None:
    records = _records(tmp_path)[:2]
    (tmp_path / "clips" / "broken.wav").write_bytes(b"RIFF\x10\x00\x00\x00WAVEjunk")
    records += [{"audio": "clips/broken.wav", "text": "two"}, {"audio": "clips/gone.flac", "text": "three"}]
    data = _write_jsonl(tmp_path / "train.jsonl", records)
    processor = AudioTranscriptProcessor(tokenizer_file, audio_root=tmp_path)
    with pytest.raises(BadRecordError, match=r"broken\.wav") as err:
        build_cache(data, tmp_path / "strict", processor=processor, workers=0, progress=False)
    assert "train.jsonl" in str(err.value)
    cache = build_cache(data, tmp_path / "lenient", processor=processor, workers=0, progress=False, bad_records="skip")
    assert len(cache) == 2
    assert cache.ledger.skipped == {"bad_audio": 2}
    examples = " ".join(str(e) for e in cache.ledger.skip_examples)
    assert "broken.wav" in examples
    assert "gone.flac" in examples


def test_timestamps_wrap_the_transcript_and_labels_are_capped(tmp_path, tokenizer_file) -> None:
    processor = AudioTranscriptProcessor(tokenizer_file, timestamps=True, max_label_tokens=8)
    out = processor([{"audio": {"array": _clip(0, 1.372).tolist(), "sampling_rate": 16_000}, "text": "one two"}])
    tokens = [processor.tokenizer.id_to_token(i) for i in out["input_ids"][0]]
    assert tokens[:4] == ["<|startoftranscript|>", "<|en|>", "<|transcribe|>", "<|0.00|>"]
    assert tokens[-2:] == ["<|1.38|>", "<|endoftext|>"]
    long = processor([{"audio": {"array": _clip(0).tolist(), "sampling_rate": 16_000}, "text": " ".join(WORDS * 5)}])
    assert len(long["input_ids"][0]) == 8
    assert long["input_ids"][0][-1] == processor.tokenizer.token_to_id("<|endoftext|>")


def test_settings_errors_name_the_setting(tokenizer_file) -> None:
    with pytest.raises(ValueError, match="task"):
        whisper_prefix_tokens("en", "summarize", False)
    with pytest.raises(ValueError, match=r"language.*<\|xx\|>"):
        AudioTranscriptProcessor(tokenizer_file, language="xx")
    with pytest.raises(ValueError, match="n_mels"):
        AudioTranscriptProcessor(tokenizer_file, n_mels=0)
