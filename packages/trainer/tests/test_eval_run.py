"""``ponente-eval-lm`` evaluates a run as it is: model, tokenizer and validation data from the run's record."""

import re
import time

import pytest
from run_support import TinyRun, shared_tiny_run

from ponente.trainer.main import eval_lm
from ponente.trainer.main.eval_lm import EvalLmConfig

BATCHES = ["--batch_size", "2", "--max_batches", "2"]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> TinyRun:
    return shared_tiny_run(tmp_path_factory)


@pytest.fixture(scope="module")
def expected(run: TinyRun) -> str:
    """The result line of the evaluation configured by hand with the run's own model and data sections (the
    numbers of this path are checked against NumPy in test_train_lm.py)."""
    config = EvalLmConfig(
        data=run.config.data, model=run.config.model, checkpoint_path=str(run.checkpoint), batch_size=2, max_batches=2
    )
    ((name, r),) = eval_lm.eval_lm(config).items()
    return (
        f"{name}: loss {r.loss:.4f}  perplexity {r.perplexity:.2f}  bits/byte {r.bits_per_byte:.4f}  "
        f"({r.tokens} tokens, {r.bytes} bytes)"
    )


def test_run_folder_alone_evaluates_the_run(run, expected, capsys):
    assert eval_lm.main(["--checkpoint_path", str(run.checkpoints), *BATCHES]) == 0
    assert capsys.readouterr().out.strip() == expected


def test_the_training_file_is_accepted(run, expected, capsys):
    argv = ["--config_path", str(run.training_file), "--checkpoint_path", str(run.checkpoint), *BATCHES]
    assert eval_lm.main(argv) == 0
    assert capsys.readouterr().out.strip() == expected


def test_training_files_are_not_needed_to_evaluate_validation(run, tmp_path, expected, capsys):
    # the recorded training files are gone (another machine): the validation split is all evaluation reads
    argv = ["--checkpoint_path", str(run.checkpoint), "--data.train_urls", f"[{tmp_path / 'gone.jsonl'}]", *BATCHES]
    assert eval_lm.main(argv) == 0
    assert capsys.readouterr().out.strip() == expected
    assert eval_lm.main([*argv, "--split", "train"]) == 1
    assert capsys.readouterr().err == f"error: no such file: {tmp_path / 'gone.jsonl'} (data.train_urls)\n"


def test_a_model_that_is_not_the_checkpoints_names_parameter_and_shapes(run, capsys):
    assert eval_lm.main(["--config_path", "gpt2_nano", "--checkpoint_path", str(run.checkpoint), *BATCHES]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert re.fullmatch(
        r"error: model: checkpoint parameter \S+ has shape \(4096, 32\), the configured model expects \(4096, 128\)"
        r" \(\d+ more parameters differ\)",
        line,
    ), line


def test_missing_checkpoint_is_one_line_before_the_hub(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    missing = tmp_path / "nonexistent"
    begun = time.perf_counter()
    code = eval_lm.main(["--checkpoint_path", str(missing)])
    assert time.perf_counter() - begun < 2
    assert (code, capsys.readouterr().err) == (1, f"error: no checkpoint at {missing} (checkpoint_path)\n")
