"""``ponente-train-asr``: a tiny Whisper trained end to end, offline, on the synthetic spoken digits.

References are independent of the code under test: ``jiwer`` for the word error rate, ``transformers``'
``WhisperForConditionalGeneration`` for the exported model and for the starting weights of ``initialize_from_hf``,
an uninterrupted run for a resumed one, and NumPy for the batch layout.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ponente.trainer.config import load_config
from ponente.trainer.data import build_caches, data_tokenizer
from ponente.trainer.data.synthetic_speech import write_missing_synthetic_speech, write_synthetic_speech
from ponente.trainer.main import train_asr
from ponente.trainer.main.train_asr import TrainAsrConfig
from ponente.trainer.tasks.asr import whisper_batch
from ponente.trainer.wer import edit_distance, wer

TINY_MODEL = {
    "vocab_size": 1931,
    "d_model": 32,
    "encoder_layers": 1,
    "decoder_layers": 1,
    "encoder_attention_heads": 2,
    "decoder_attention_heads": 2,
    "encoder_ffn_dim": 64,
    "decoder_ffn_dim": 64,
    "max_source_positions": 100,
    "max_target_positions": 16,
}
"""A tiny Whisper for the packaged config's data (2-second clips, 12 decoder tokens)."""


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small synthetic spoken-digit set (24 training and 8 validation clips) with its tokenizer."""
    folder = tmp_path_factory.mktemp("digits")
    write_synthetic_speech(folder, train=24, validation=8, seed=3)
    return folder


def tiny_config(digits: Path, tmp_path: Path, *, steps: int = 4, **overrides: Any) -> TrainAsrConfig:
    """The packaged ``whisper_tiny_digits`` shrunk: a tiny model, a few steps, every output under ``tmp_path``."""
    trainer = {
        "num_train_steps": steps,
        "train_batch_size": 4,
        "steps_per_eval": steps,
        "max_eval_batches": 2,
        "id": "asr",
        "run_dir": str(tmp_path / "runs" / "{run_id}"),
        "tracker": [{"type": "json", "path": str(tmp_path / "metrics.jsonl")}],
        "checkpointer": {"base_path": str(tmp_path / "checkpoints"), "keep": [{"every": 2}]},
    }
    tree: dict[str, Any] = {
        "data": {
            "train_urls": [str(digits / "train.jsonl")],
            "validation_urls": [str(digits / "validation.jsonl")],
            "tokenizer": str(digits / "tokenizer"),
            "cache_dir": str(digits / "cache"),
        },
        "model": dict(TINY_MODEL),
        "trainer": trainer,
        "optimizer": {"learning_rate": 3e-3, "warmup": 0.0},
        "wer": {"max_examples": 6, "max_new_tokens": 6},
    }
    for dotted, value in overrides.items():
        node = tree
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return load_config(TrainAsrConfig, ["whisper_tiny_digits"], [tree])


def metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def safetensors_of(folder: str | Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(Path(folder) / "model.safetensors"))


# -- word error rate ------------------------------------------------------------------------------------------


def test_wer_equals_jiwer_on_random_transcripts() -> None:
    import jiwer

    rng = np.random.default_rng(0)
    words = ["zero", "one", "two", "three", "four", "five"]
    for _ in range(30):
        refs = [" ".join(rng.choice(words, rng.integers(1, 6))) for _ in range(rng.integers(1, 5))]
        hyps = [" ".join(rng.choice(words, rng.integers(0, 7))) for _ in refs]
        assert wer(refs, hyps) == pytest.approx(jiwer.wer(refs, hyps), abs=1e-12)


def test_edit_distance_of_empty_sequences() -> None:
    assert edit_distance([], []) == 0
    assert edit_distance(["a", "b"], []) == 2
    assert edit_distance([], ["a"]) == 1
    with pytest.raises(ValueError, match="no words"):
        wer([""], ["a"])


# -- batches --------------------------------------------------------------------------------------------------


def test_whisper_batch_predicts_the_next_real_token() -> None:
    rows = {
        "input_features": np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 12),
        "input_ids": np.array([[5, 6, 7, 9, 9], [5, 6, 9, 9, 9]]),
        "loss_mask": np.array([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]]),
    }
    batch = whisper_batch(rows, n_mels=3, frames=4)
    assert [a.name for a in batch["input_features"].axes] == ["batch", "mel", "frame"]
    np.testing.assert_array_equal(batch["input_features"].array, rows["input_features"].reshape(2, 3, 4))
    np.testing.assert_array_equal(batch["loss_mask"].array, [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0]])
    with pytest.raises(ValueError, match="whisper_batch"):
        whisper_batch(rows, n_mels=4, frames=4)


# -- bad configurations ---------------------------------------------------------------------------------------


def test_missing_tokenizer_is_one_line_naming_the_key(digits: Path, tmp_path: Path, capsys) -> None:
    code = train_asr.main(
        [
            "--config_path",
            "whisper_tiny_digits",
            f"--data.train_urls=[{digits / 'train.jsonl'}]",
            f"--data.validation_urls=[{digits / 'validation.jsonl'}]",
            "--data.tokenizer",
            "null",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0
    assert "data.tokenizer" in err[-1]
    assert not any("Traceback" in line for line in err)


def test_the_packaged_example_writes_its_data_on_the_first_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``ponente-train-asr --config_path whisper_tiny_digits`` as one command, in an empty folder (shrunk)."""
    monkeypatch.chdir(tmp_path)
    args = [
        "--config_path",
        "whisper_tiny_digits",
        *(f"--model.{key}={value}" for key, value in TINY_MODEL.items()),
        "--synthetic_data.train=8",
        "--synthetic_data.validation=4",
        "--trainer.num_train_steps=1",
        "--trainer.train_batch_size=4",
        "--trainer.max_eval_batches=1",
        "--wer.max_examples=0",
        "--hf_save_path=null",
    ]
    with caplog.at_level(logging.INFO, logger="ponente.trainer.data.synthetic_speech"):
        assert train_asr.main(args) == 0
    data = (tmp_path / "ponente_speech" / "data").resolve()
    said = [r.getMessage() for r in caplog.records if r.name == "ponente.trainer.data.synthetic_speech"]
    assert any("writing the synthetic spoken-digit set (8 training and 4 validation clips" in m for m in said), said
    assert any(m.startswith("wrote ") and str(data) in m for m in said), said
    reference = tmp_path / "reference"
    write_synthetic_speech(reference, train=8, validation=4, seed=0)
    for name in ("train.jsonl", "validation.jsonl", "tokenizer/tokenizer.json", "clips/validation-00003.wav"):
        assert (data / name).read_bytes() == (reference / name).read_bytes(), name
    config = load_config(TrainAsrConfig, ["whisper_tiny_digits"], [])
    assert config.synthetic_data is not None
    assert write_missing_synthetic_speech(config.synthetic_data, config.data.train_urls) is None  # complete now
    elsewhere = dataclasses.replace(config.synthetic_data, out_dir=str(tmp_path / "unused"))
    assert write_missing_synthetic_speech(elsewhere, config.data.train_urls) is None  # the run does not read it
    assert not (tmp_path / "unused").exists()
    # other training data (here missing): the set is not written, the missing file is the error
    (tmp_path / "other").mkdir()
    monkeypatch.chdir(tmp_path / "other")
    assert train_asr.main(["--config_path", "whisper_tiny_digits", f"--data.train_urls=[{tmp_path / 'mine.jsonl'}]"])
    assert not (tmp_path / "other" / "ponente_speech").exists()


def test_missing_audio_file_names_the_file(digits: Path, tmp_path: Path) -> None:
    records = [json.loads(line) for line in (digits / "train.jsonl").read_text().splitlines()][:6]
    records[2]["audio"] = "clips/no-such-clip.wav"
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    shutil.copytree(digits / "clips", tmp_path / "clips")
    config = tiny_config(digits, tmp_path, **{"data.train_urls": [str(data)], "data.cache_dir": str(tmp_path / "c")})
    with pytest.raises(Exception) as info:
        build_caches(config.data, "train", background=False, progress=False)
    message = str(info.value)
    assert "no-such-clip.wav" in message
    assert "\n" not in message


def test_data_that_do_not_fit_the_model_name_the_keys(digits: Path, tmp_path: Path) -> None:
    config = tiny_config(digits, tmp_path, **{"model.num_mel_bins": 128})
    with pytest.raises(ValueError, match=r"data\.format\.n_mels \(80\) differs from model\.num_mel_bins \(128\)"):
        train_asr.train(config)
    config = tiny_config(digits, tmp_path, **{"data.chunk_seconds": 3.0})
    with pytest.raises(ValueError, match=r"data\.format\.chunk_seconds"):
        train_asr.train(config)


# -- end to end (integration: each trains a tiny Whisper for a few steps, 30-90 s on a shared CPU) --------------


@pytest.mark.integration
def test_train_asr_loss_falls_wer_is_jiwers_and_the_export_loads_in_transformers(digits: Path, tmp_path: Path) -> None:
    import jiwer
    import torch
    from transformers import WhisperForConditionalGeneration

    from ponente.datacache import open_cache
    from ponente.models.hf import load_whisper_pretrained

    steps = 12
    config = tiny_config(digits, tmp_path, steps=steps, hf_save_path=str(tmp_path / "hf"))
    config = dataclasses.replace(config, trainer=dataclasses.replace(config.trainer, steps_per_eval=6))
    result = train_asr.train(config)
    assert result.steps == steps
    assert result.stopped is None

    logged = metrics(tmp_path / "metrics.jsonl")
    losses = [m["train/loss"] for m in logged if "train/loss" in m]
    assert len(losses) == steps
    assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.5

    # the WER logged at the last evaluation is jiwer's on the transcripts the run wrote
    evals = [m for m in logged if "eval/digits/wer" in m]
    assert [m["step"] for m in evals] == [6, 12]
    pairs = [json.loads(x) for x in (tmp_path / "runs" / "asr" / "transcripts" / "digits-step-12.jsonl").open()]
    assert len(pairs) == 6
    assert all(p["reference"] for p in pairs)
    expected = jiwer.wer([p["reference"] for p in pairs], [p["hypothesis"] for p in pairs])
    assert evals[-1]["eval/digits/wer"] == pytest.approx(expected, abs=1e-9)
    assert result.eval_loss["digits/wer"] == pytest.approx(expected, abs=1e-9)

    # the export loads in transformers; its loss on the validation rows is the run's evaluation loss, and its
    # logits equal those of the model read back by Ponente
    hf = WhisperForConditionalGeneration.from_pretrained(str(tmp_path / "hf")).eval()
    speech = config.data.format
    rows = speech.rows(open_cache(config.data.cache_path("validation")), 0, data_tokenizer(config.data))
    batch = rows.get_batch_arrays(list(range(len(rows))))
    feats = batch["input_features"].reshape(len(rows), speech.n_mels, speech.frames)
    ids, mask = batch["input_ids"], batch["loss_mask"]
    with torch.no_grad():
        logits = hf(input_features=torch.tensor(feats), decoder_input_ids=torch.tensor(ids, dtype=torch.long)).logits
    logits = logits.numpy().astype(np.float64)
    log_probs = (
        logits
        - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
        - logits.max(-1, keepdims=True)
    )
    nll = -np.take_along_axis(log_probs[:, :-1], ids[:, 1:, None].astype(np.int64), axis=-1)[..., 0]
    weights = mask[:, 1:].astype(np.float64)
    assert (nll * weights).sum() / weights.sum() == pytest.approx(result.eval_loss["digits/loss"], abs=1e-4)

    import ponente.namedtensor as hax

    ours = load_whisper_pretrained(tmp_path / "hf")
    our_logits = ours(hax.named(feats, ("batch", "mel", "frame")), hax.named(ids, ("batch", "position")))
    np.testing.assert_allclose(
        np.asarray(our_logits.rearrange(("batch", "position", "vocab")).array), logits, atol=1e-4, rtol=1e-4
    )
    assert (tmp_path / "hf" / "tokenizer.json").is_file()
    assert json.loads((tmp_path / "hf" / "preprocessor_config.json").read_text())["nb_max_frames"] == 200


@pytest.mark.integration
def test_resume_is_bitwise_equal_to_an_uninterrupted_run(digits: Path, tmp_path: Path) -> None:
    whole = tiny_config(digits, tmp_path / "whole", steps=4, hf_save_path=str(tmp_path / "whole-hf"))
    train_asr.train(whole)
    # an interrupted run: the same run's checkpoints up to step 2 only, then resumed to step 4
    shutil.copytree(tmp_path / "whole" / "checkpoints", tmp_path / "cut" / "checkpoints")
    for later in (tmp_path / "cut" / "checkpoints" / "asr").glob("step-*"):
        if int(later.name.split("-")[1]) > 2:
            shutil.rmtree(later)
    resumed_config = tiny_config(digits, tmp_path / "cut", steps=4, hf_save_path=str(tmp_path / "cut-hf"))
    resumed = train_asr.train(resumed_config)
    assert resumed.resumed_from is not None
    assert resumed.resumed_from.endswith("step-2")
    a, b = safetensors_of(tmp_path / "whole-hf"), safetensors_of(tmp_path / "cut-hf")
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


@pytest.mark.integration
def test_initialize_from_hf_starts_from_a_transformers_whisper(digits: Path, tmp_path: Path) -> None:
    import torch
    from transformers import WhisperConfig as HfWhisperConfig
    from transformers import WhisperForConditionalGeneration

    torch.manual_seed(0)
    hf_config = HfWhisperConfig(
        **TINY_MODEL,
        num_mel_bins=80,
        decoder_start_token_id=324,
        eos_token_id=323,
        pad_token_id=323,
        bos_token_id=323,
    )
    WhisperForConditionalGeneration(hf_config).save_pretrained(tmp_path / "start")
    start = safetensors_of(tmp_path / "start")
    # the model section says something else: use_hf_model_config (default with initialize_from_hf) ignores it
    config = tiny_config(
        digits,
        tmp_path,
        steps=1,
        initialize_from_hf=str(tmp_path / "start"),
        hf_save_path=str(tmp_path / "out"),
        **{"model.d_model": 64, "optimizer.learning_rate": 0.0, "optimizer.weight_decay": 0.0},
    )
    result = train_asr.train(config)
    assert result.steps == 1
    out = safetensors_of(tmp_path / "out")
    assert set(out) == set(start) - {"proj_out.weight"}
    for name, value in out.items():  # the encoder's position table too: kept as loaded, not recomputed
        np.testing.assert_array_equal(value, start[name], err_msg=name)


def test_hugging_face_audio_dataset_gives_the_rows_of_the_jsonl_files(digits: Path, tmp_path: Path) -> None:
    import datasets

    from ponente.trainer.data import AsrDatasetFormat, LMDatasetConfig, build_all_caches, validation_sets

    splits = {}
    for split in ("train", "validation"):
        records = [json.loads(line) for line in (digits / f"{split}.jsonl").read_text().splitlines()][:5]
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        column = [{"bytes": (digits / r["audio"]).read_bytes(), "path": r["audio"]} for r in records]
        table = datasets.Dataset.from_dict({"audio": column, "text": [r["text"] for r in records]})
        splits[split] = table.cast_column("audio", datasets.Audio(decode=False))
    datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "hf"))

    common: dict[str, Any] = {"tokenizer": str(digits / "tokenizer"), "workers": 0}
    speech = AsrDatasetFormat(chunk_seconds=2.0, max_label_tokens=12)
    files = LMDatasetConfig(
        train_urls=[str(tmp_path / "train.jsonl")],
        validation_urls=[str(tmp_path / "validation.jsonl")],
        cache_dir=str(tmp_path / "c_files"),
        shuffle=False,
        format=dataclasses.replace(speech, audio_root=str(digits)),
        **common,
    )
    hub = LMDatasetConfig(
        id=str(tmp_path / "hf"), cache_dir=str(tmp_path / "c_hf"), shuffle=False, format=speech, **common
    )
    tokenizer = data_tokenizer(hub)
    want_caches = build_all_caches(files, progress=False)
    got_caches = build_all_caches(hub, progress=False)
    for split in ("train", "validation"):
        want = files.format.rows(want_caches[split], 0, tokenizer)
        got = hub.format.rows(got_caches[split], 0, tokenizer)
        assert len(got) == len(want) == 5
        for key, value in want.get_batch_arrays(list(range(5))).items():
            np.testing.assert_array_equal(got.get_batch_arrays(list(range(5)))[key], value, err_msg=f"{split}/{key}")
    assert set(validation_sets(hub, 12)) == {str(tmp_path / "hf")}
    assert speech.prompt_ids(tokenizer) == [324, 325, 425, 429]
