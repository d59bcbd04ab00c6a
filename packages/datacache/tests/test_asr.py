"""Audio + transcript records -> cache rows, against transformers' Whisper feature extractor and tokenizer."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest

from ponente.datacache import AsrExampleDataset, InMemoryTokenStore, build_cache, open_cache
from ponente.datacache.asr import AudioTranscriptProcessor, chunk_frames, whisper_prefix_tokens
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


def _reference_rows(
    tokenizer_file: str, language: str, task: str, *, n_mels: int = 80, chunk_seconds: int = 30
) -> tuple[list[np.ndarray], list[list[int]]]:
    """transformers' features (its NumPy path, on clips padded or cut to the window) and token ids."""
    fe = transformers.WhisperFeatureExtractor(feature_size=n_mels, chunk_length=chunk_seconds)
    assert fe.n_samples == chunk_seconds * 16_000
    assert fe.nb_max_frames == chunk_seconds * 100
    clips = [_clip(i)[: fe.n_samples] for i in range(4)]
    feats = [fe._np_extract_fbank_features(np.pad(c, (0, fe.n_samples - c.size))[None], "cpu")[0] for c in clips]
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


@pytest.mark.parametrize(("n_mels", "chunk_seconds"), [(80, 1), (128, 2)])
def test_chunk_seconds_window_matches_the_feature_extractor_with_that_chunk_length(
    tmp_path, tokenizer_file, n_mels, chunk_seconds
) -> None:
    data = _write_jsonl(tmp_path / "train.jsonl", _records(tmp_path))  # 1.5 s clips: cut to 1 s, padded to 2 s
    processor = AudioTranscriptProcessor(
        tokenizer_file, n_mels=n_mels, chunk_seconds=chunk_seconds, audio_root=tmp_path
    )
    assert processor.config()["frames"] == chunk_seconds * 100
    assert processor.config() != AudioTranscriptProcessor(tokenizer_file, n_mels=n_mels).config()
    cache = build_cache(data, tmp_path / "cache", processor=processor, workers=0, progress=False)
    features, ids = _reference_rows(
        tokenizer_file, "english", "transcribe", n_mels=n_mels, chunk_seconds=chunk_seconds
    )
    for i in range(4):
        row = cache[i]
        assert row["input_features"].shape == (n_mels * chunk_seconds * 100,)
        np.testing.assert_allclose(row["input_features"].reshape(n_mels, -1), features[i], rtol=0, atol=1e-5)
        assert row["input_ids"].tolist() == ids[i]


def test_timestamps_end_within_the_window(tokenizer_file) -> None:
    processor = AudioTranscriptProcessor(tokenizer_file, timestamps=True, chunk_seconds=1.0)
    out = processor([{"audio": {"array": _clip(0, 1.5).tolist(), "sampling_rate": 16_000}, "text": "one"}])
    assert processor.tokenizer.id_to_token(int(out["input_ids"][0][-2])) == "<|1.00|>"


def test_chunk_seconds_must_be_whole_frames(tokenizer_file) -> None:
    assert chunk_frames(30) == 3000
    assert chunk_frames(2.5) == 250
    for bad in (0, -1.0, 0.005):
        with pytest.raises(ValueError, match="chunk_seconds"):
            AudioTranscriptProcessor(tokenizer_file, chunk_seconds=bad)


def test_asr_example_dataset_rows_are_padded_reference_rows(tmp_path, tokenizer_file) -> None:
    data = _write_jsonl(tmp_path / "train.jsonl", _records(tmp_path))
    processor = AudioTranscriptProcessor(tokenizer_file, chunk_seconds=2, audio_root=tmp_path)
    build_cache(data, tmp_path / "cache", processor=processor, workers=0, progress=False)
    pad = processor.tokenizer.token_to_id("<|endoftext|>")
    ds = AsrExampleDataset(open_cache(tmp_path / "cache"), max_label_tokens=12, pad_id=pad)
    assert (len(ds), ds.n_mels, ds.frames, ds.is_finished) == (4, 80, 200, True)
    features, ids = _reference_rows(tokenizer_file, "english", "transcribe", chunk_seconds=2)
    batch = ds.get_batch_arrays([3, 0, 3])
    assert batch["input_features"].shape == (3, 80 * 200)
    assert batch["input_features"].dtype == np.float32
    assert batch["input_ids"].shape == batch["loss_mask"].shape == (3, 12)
    for k, i in enumerate([3, 0, 3]):
        np.testing.assert_allclose(batch["input_features"][k].reshape(80, 200), features[i], rtol=0, atol=1e-5)
        assert batch["input_ids"][k].tolist() == ids[i] + [pad] * (12 - len(ids[i]))
        assert batch["loss_mask"][k].tolist() == [1] * len(ids[i]) + [0] * (12 - len(ids[i]))
    row = ds[1]
    assert row["input_ids"].dtype == row["loss_mask"].dtype == np.int32
    assert [r["input_ids"].tolist() for r in ds.get_batch([1])] == [row["input_ids"].tolist()]
    short = AsrExampleDataset(open_cache(tmp_path / "cache"), max_label_tokens=5, pad_id=pad)
    assert short[3]["input_ids"].tolist() == ids[3][:5]
    assert short[3]["loss_mask"].tolist() == [1] * 5
    with pytest.raises(IndexError, match="index 4"):
        ds.get_batch_arrays([4])


class _GrowingStore:
    """Two fields in memory, committed row by row (like a cache that is being built)."""

    def __init__(self) -> None:
        self.fields: dict[str, list[np.ndarray]] = {"input_features": [], "input_ids": []}
        self.is_finished = False

    def add(self, features: np.ndarray, ids: list[int]) -> None:
        self.fields["input_features"].append(features.astype(np.float32))
        self.fields["input_ids"].append(np.asarray(ids, dtype=np.int32))

    def __len__(self) -> int:
        return len(self.fields["input_ids"])

    def read_flat(self, start: int, stop: int, field: str = "input_ids") -> np.ndarray:
        return np.concatenate(self.fields[field])[start:stop]

    def row_offsets(self, start_row: int, stop_row: int, field: str = "input_ids") -> np.ndarray:
        lengths = [0] + [row.size for row in self.fields[field]]
        return np.cumsum(lengths)[start_row : stop_row + 1]

    def wait_until(self, *, rows: int | None = None, timeout: float | None = None) -> bool:
        return self.is_finished or (rows is not None and len(self) >= rows)


def test_asr_example_dataset_grows_with_its_store_and_checks_the_window() -> None:
    store = InMemoryTokenStore.from_documents([[1, 2]])
    with pytest.raises(ValueError, match="n_mels"):
        AsrExampleDataset(store, max_label_tokens=8, pad_id=0)
    growing = _GrowingStore()
    ds = AsrExampleDataset(growing, max_label_tokens=4, pad_id=9, n_mels=2, frames=3)
    assert len(ds) == 0
    assert not ds.wait_for_length(1, timeout=0)
    growing.add(np.arange(6), [5, 6])
    assert ds.wait_for_length(1, timeout=0)
    assert not ds.is_finished
    assert ds[0]["input_features"].tolist() == list(range(6))
    assert ds[0]["input_ids"].tolist() == [5, 6, 9, 9]
    growing.add(np.arange(5), [7])  # not n_mels * frames values
    with pytest.raises(ValueError, match="row 1 has 5 feature values"):
        ds.get_batch_arrays([1])


# -- Hugging Face datasets: Audio columns and decoded values ------------------------------------------------------

RATES = (16_000, 8_000, 44_100)


def _clip_at(i: int, rate: int, seconds: float = 1.2) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    return (0.2 * np.sin(2 * np.pi * (150 + 70 * i) * t) + 0.05 * np.sin(2 * np.pi * 2_900 * t)).astype(np.float32)


def _multi_rate_jsonl(tmp_path) -> tuple[str, list[tuple[str, int, np.ndarray, str]]]:
    """WAV files at 16, 8 and 44.1 kHz and a jsonl naming them; returns the jsonl and (file, rate, samples, text)."""
    (tmp_path / "clips").mkdir(exist_ok=True)
    clips = []
    for i, rate in enumerate(RATES):
        samples, name, text = _clip_at(i, rate), f"clips/r{rate}.wav", " ".join(WORDS[i : i + 3])
        (tmp_path / name).write_bytes(_wav(samples, rate))
        clips.append((name, rate, samples, text))
    data = _write_jsonl(tmp_path / "train.jsonl", [{"audio": name, "text": text} for name, _, _, text in clips])
    return data, clips


def _assert_same_rows(a, b, n: int) -> None:
    assert len(a) == len(b) == n
    for i in range(n):
        for field in ("input_features", "input_ids"):
            np.testing.assert_array_equal(a[i][field], b[i][field])


def test_hf_audio_column_builds_the_rows_of_the_jsonl_files(tmp_path, tokenizer_file) -> None:
    datasets = pytest.importorskip("datasets")
    from ponente.datacache import HFSource

    data, clips = _multi_rate_jsonl(tmp_path)
    columns = {
        "audio": [{"bytes": (tmp_path / name).read_bytes(), "path": name.split("/")[-1]} for name, *_ in clips],
        "text": [text for *_, text in clips],
    }
    features = datasets.Features({"audio": datasets.Audio(decode=False), "text": datasets.Value("string")})
    table = datasets.Dataset.from_dict(columns).cast(features)  # cast: encoding Audio values would need torchcodec
    table.save_to_disk(str(tmp_path / "hf"))
    processor = AudioTranscriptProcessor(tokenizer_file, audio_root=tmp_path, chunk_seconds=2)
    from_jsonl = build_cache(data, tmp_path / "c_jsonl", processor=processor, workers=0, progress=False)
    from_hf = build_cache(HFSource(tmp_path / "hf"), tmp_path / "c_hf", processor=processor, progress=False)
    _assert_same_rows(from_jsonl, from_hf, 3)
    # the 16 kHz row is transformers' features of the file's samples
    fe = transformers.WhisperFeatureExtractor(feature_size=80, chunk_length=2)
    ref = fe._np_extract_fbank_features(np.pad(clips[0][2], (0, 32_000 - clips[0][2].size))[None], "cpu")[0]
    np.testing.assert_allclose(from_hf[0]["input_features"].reshape(80, 200), ref, rtol=0, atol=1e-5)


def test_decoded_audio_values_at_any_rate_build_the_rows_of_the_encoded_files(tmp_path, tokenizer_file) -> None:
    datasets = pytest.importorskip("datasets")
    from ponente.datacache import HFSource

    data, clips = _multi_rate_jsonl(tmp_path)
    columns = {
        "audio": [{"array": samples, "sampling_rate": rate} for _, rate, samples, _ in clips],
        "text": [text for *_, text in clips],
    }
    datasets.Dataset.from_dict(columns).save_to_disk(str(tmp_path / "hf"))
    processor = AudioTranscriptProcessor(tokenizer_file, audio_root=tmp_path, chunk_seconds=2)
    from_jsonl = build_cache(data, tmp_path / "c_jsonl", processor=processor, workers=0, progress=False)
    from_hf = build_cache(HFSource(tmp_path / "hf"), tmp_path / "c_hf", processor=processor, progress=False)
    _assert_same_rows(from_jsonl, from_hf, 3)


class _FakeSamples:
    def __init__(self, data: np.ndarray, sample_rate: int) -> None:
        self.data, self.sample_rate = data, sample_rate


class _FakeAudioDecoder:
    """What datasets >= 4 decodes an Audio value to: a torchcodec AudioDecoder ([channels, samples] data)."""

    def __init__(self, samples: np.ndarray, rate: int) -> None:
        self._samples = _FakeSamples(np.stack([samples, samples]), rate)

    def get_all_samples(self) -> _FakeSamples:
        return self._samples


def test_audio_decoder_values_are_read_like_decoded_arrays(tokenizer_file) -> None:
    processor = AudioTranscriptProcessor(tokenizer_file, chunk_seconds=2)
    for i, rate in enumerate(RATES):
        samples = _clip_at(i, rate)
        record = {"audio": _FakeAudioDecoder(samples, rate), "text": "one"}
        assert processor.check(record) is None
        ours = processor([record])
        ref = processor([{"audio": {"array": samples, "sampling_rate": rate}, "text": "one"}])
        np.testing.assert_array_equal(ours["input_features"][0], ref["input_features"][0])


def test_unusable_decoded_samples_are_bad_audio(tmp_path, tokenizer_file) -> None:
    records = [
        {"audio": {"array": _clip(0).tolist(), "sampling_rate": 16_000}, "text": "one"},
        {"audio": {"array": _clip(1).tolist(), "sampling_rate": None}, "text": "two"},
        {"audio": {"array": [], "sampling_rate": 16_000}, "text": "three"},
    ]
    data = _write_jsonl(tmp_path / "train.jsonl", records)
    processor = AudioTranscriptProcessor(tokenizer_file, chunk_seconds=2)
    with pytest.raises(BadRecordError, match="sampling_rate"):
        build_cache(data, tmp_path / "strict", processor=processor, workers=0, progress=False)
    cache = build_cache(data, tmp_path / "lenient", processor=processor, workers=0, progress=False, bad_records="skip")
    assert len(cache) == 1
    assert cache.ledger.skipped == {"bad_audio": 2}


def test_hf_audio_column_saved_decoded_is_read_undecoded(tmp_path, tokenizer_file) -> None:
    """An Audio(decode=True) column (the default) builds without torchcodec: HFSource reads it undecoded."""
    datasets = pytest.importorskip("datasets")
    from ponente.datacache import HFSource

    data, clips = _multi_rate_jsonl(tmp_path)
    columns = {
        "audio": [{"bytes": (tmp_path / name).read_bytes(), "path": name.split("/")[-1]} for name, *_ in clips],
        "text": [text for *_, text in clips],
    }
    features = datasets.Features({"audio": datasets.Audio(), "text": datasets.Value("string")})
    datasets.Dataset.from_dict(columns).cast(features).save_to_disk(str(tmp_path / "hf"))
    processor = AudioTranscriptProcessor(tokenizer_file, audio_root=tmp_path, chunk_seconds=2)
    from_jsonl = build_cache(data, tmp_path / "c_jsonl", processor=processor, workers=0, progress=False)
    from_hf = build_cache(HFSource(tmp_path / "hf"), tmp_path / "c_hf", processor=processor, progress=False)
    _assert_same_rows(from_jsonl, from_hf, 3)
