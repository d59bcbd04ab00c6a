"""Errors users see: every console script checks its inputs before slow work and reports one line.

A configuration error (bad key) exits 2 naming the key, a missing file exits 1 naming the path, neither prints a
traceback unless ``--debug`` (or ``PONENTE_DEBUG=1``) is given, and the slow part of the script (training,
loading a model, building caches) is never reached.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ponente.trainer import run

MISSING = "/nonexistent-ponente/missing"

# console script -> (module, the function holding the slow work, arguments that make a valid command, when
# ``{missing}`` is a path that exists, and the text of the one-line error when it does not)
SCRIPTS: dict[str, tuple[str, str, list[str], str]] = {
    "ponente-train": (
        "ponente.trainer.main.train_lm",
        "run.start_run",
        ["--config_path", "gpt2_nano", "--data.train_urls=[{missing}.jsonl]"],
        "no such file: {missing}.jsonl (data.train_urls)",
    ),
    "ponente-sft": (
        "ponente.trainer.main.sft",
        "run.start_run",
        ["--data.train_urls=[{missing}.jsonl]"],
        "no such file: {missing}.jsonl (data.train_urls)",
    ),
    "ponente-lora-lm": (
        "ponente.trainer.main.lora_lm",
        "run.start_run",
        ["--initialize_from_hf", "{missing}/model"],
        "no such model folder: {missing}/model (initialize_from_hf)",
    ),
    "ponente-train-asr": (
        "ponente.trainer.main.train_asr",
        "run.start_run",
        ["--config_path", "whisper_tiny_digits", "--data.train_urls=[{missing}.jsonl]"],
        "no such file: {missing}.jsonl (data.train_urls)",
    ),
    "ponente-cache-dataset": (
        "ponente.trainer.main.cache_dataset",
        "cache_dataset",
        ["--data.validation_urls=[{missing}.jsonl.gz]"],
        "no such file: {missing}.jsonl.gz (data.validation_urls)",
    ),
    "ponente-sample-lm": (
        "ponente.trainer.main.sample_lm",
        "sample_lm",
        ["--checkpoint_path", "{missing}/run", "--prompts", "[hello]"],
        "no checkpoint at {missing}/run (checkpoint_path)",
    ),
    "ponente-serve": (
        "ponente.trainer.main.serve",
        "build_app",
        ["--hf_checkpoint", "{missing}/model"],
        "no such model folder: {missing}/model (hf_checkpoint)",
    ),
    "ponente-eval-harness": (
        "ponente.trainer.main.eval_harness",
        "eval_harness",
        ["--hf_checkpoint", "{missing}/model", "--tasks", "[hellaswag]"],
        "no such model folder: {missing}/model (hf_checkpoint)",
    ),
    "ponente-viz-logprobs": (
        "ponente.trainer.main.viz_logprobs",
        "viz_logprobs",
        ["--hf_checkpoint", "{missing}/model", "--documents", "{missing}.jsonl"],
        "no such file: {missing}.jsonl (documents)",
    ),
    "ponente-eval-lm": (
        "ponente.trainer.main.eval_lm",
        "eval_lm",
        ["--checkpoint_path", "{missing}/run"],
        "no checkpoint at {missing}/run",
    ),
    "ponente-export-lm-to-hf": (
        "ponente.trainer.main.export_lm_to_hf",
        "export_lm_to_hf",
        ["--checkpoint_path", "{missing}/run", "--output_dir", "{tmp}/exported"],
        "no checkpoint at {missing}/run",
    ),
}


def _fill(args: list[str], tmp_path: Path) -> list[str]:
    return [a.format(missing=MISSING, tmp=tmp_path) for a in args]


def _guard(monkeypatch: pytest.MonkeyPatch, module: Any, target: str) -> list[str]:
    """Make the script's slow work record that it started (and stop there); returns the record."""
    started: list[str] = []

    def slow_work(*args: Any, **kwargs: Any) -> Any:
        started.append(target)
        raise RuntimeError("the slow work started")

    owner, _, name = target.rpartition(".")
    holder = run if owner == "run" else module
    assert hasattr(holder, name), f"{target} moved: update SCRIPTS"
    monkeypatch.setattr(holder, name, slow_work)
    return started


def _run(script: str, argv: list[str], monkeypatch: pytest.MonkeyPatch) -> tuple[int, list[str]]:
    module_name, target, _, _ = SCRIPTS[script]
    module = importlib.import_module(module_name)
    started = _guard(monkeypatch, module, target)
    code = module.main(argv)
    return code, started


def _one_error_line(err: str) -> str:
    """The ``error:`` line of stderr; fails if there is not exactly one, or if there is a traceback."""
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture(autouse=True)
def _no_debug_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PONENTE_DEBUG", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_bad_key_exits_2_naming_it(
    script: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, started = _run(script, ["--no_such_key", "1"], monkeypatch)
    err = capsys.readouterr().err
    assert code == 2, err
    line = _one_error_line(err)
    assert line.startswith("error: no_such_key: unknown key"), line
    assert not started


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_missing_file_exits_1_naming_it_before_slow_work(
    script: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _, _, args, message = SCRIPTS[script]
    code, started = _run(script, _fill(args, tmp_path), monkeypatch)
    err = capsys.readouterr().err
    assert code == 1, err
    line = _one_error_line(err)
    assert line.startswith(f"error: {message.format(missing=MISSING)}"), line
    assert "bad_records" not in line
    assert not started, f"{script} started its slow work before reporting the missing file"


@pytest.mark.parametrize("script", ["ponente-train", "ponente-sample-lm", "ponente-export-lm-to-hf"])
def test_debug_flag_prints_the_traceback(
    script: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    args = _fill(SCRIPTS[script][2], tmp_path)
    code, _ = _run(script, [*args, "--debug"], monkeypatch)
    err = capsys.readouterr().err
    assert code == 1
    assert "Traceback (most recent call last)" in err
    assert err.rstrip().splitlines()[-1].startswith("error: "), err  # the one line still ends the report
    code, _ = _run(script, ["--no_such_key", "1", "--debug"], monkeypatch)
    err = capsys.readouterr().err
    assert code == 2
    assert "Traceback (most recent call last)" in err
    assert "ConfigError" in err


def test_debug_environment_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    monkeypatch.setenv("PONENTE_DEBUG", "1")
    code, _ = _run("ponente-sft", _fill(SCRIPTS["ponente-sft"][2], tmp_path), monkeypatch)
    assert code == 1
    assert "Traceback (most recent call last)" in capsys.readouterr().err


def test_train_checks_checkpoints_and_output_folders(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from ponente.trainer.main import train_lm

    started = _guard(monkeypatch, train_lm, "run.start_run")
    in_the_way = tmp_path / "a_file"
    in_the_way.write_text("not a folder")
    empty = tmp_path / "empty_run"
    empty.mkdir()
    cases = [
        (f"--trainer.initialize_from={MISSING}", f"no checkpoint at {MISSING} (trainer.initialize_from)"),
        (
            f"--trainer.load_checkpoint_path={empty}",
            f"no committed checkpoint at {empty} (trainer.load_checkpoint_path)",
        ),
        (
            f"--trainer.checkpointer.base_path={in_the_way}/checkpoints",
            f"cannot create the folder {in_the_way}/checkpoints (trainer.checkpointer.base_path): "
            f"{in_the_way} is a file",
        ),
        (f"--data.cache_dir={in_the_way}/cache", f"cannot create the folder {in_the_way}/cache (data.cache_dir)"),
        (
            f"--data.tokenizer={MISSING}/tokenizer.json",
            f"no such tokenizer: {MISSING}/tokenizer.json (data.tokenizer)",
        ),
        (f"--data.train_urls=[{tmp_path}/*.jsonl]", f"no file matches {tmp_path}/*.jsonl (data.train_urls)"),
    ]
    for override, message in cases:
        code = train_lm.main(["--config_path", "gpt2_nano", override])
        err = capsys.readouterr().err
        assert code == 1, (override, err)
        assert _one_error_line(err).startswith(f"error: {message}"), (override, err)
    assert not started


def test_config_that_cannot_run_is_a_configuration_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from ponente.trainer.main import train_lm

    started = _guard(monkeypatch, train_lm, "run.start_run")
    # a value __post_init__ refuses, and a wrong type: both name the key, exit 2
    for argv, key in (
        (["--hf_save_steps", "10"], "hf_save_steps"),
        (["--trainer.num_train_steps", "ten"], "trainer.num_train_steps"),
    ):
        assert train_lm.main(["--config_path", "gpt2_nano", *argv]) == 2
        line = _one_error_line(capsys.readouterr().err)
        assert key in line
    assert not started


def test_internal_error_is_one_line_pointing_at_debug(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from ponente.trainer.main import cache_dataset

    def bug(config: Any) -> Any:
        raise TypeError("unsupported operand type(s) for +: 'int' and 'str'")

    monkeypatch.setattr(cache_dataset, "cache_dataset", bug)
    assert cache_dataset.main(["--config_path", "gpt2_nano"]) == 1
    line = _one_error_line(capsys.readouterr().err)
    assert line == (
        "error: internal error (TypeError: unsupported operand type(s) for +: 'int' and 'str'); "
        "run with --debug for the traceback"
    )


def test_keyboard_interrupt_exits_130(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from ponente.trainer.main import cache_dataset

    def interrupted(config: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(cache_dataset, "cache_dataset", interrupted)
    assert cache_dataset.main(["--config_path", "gpt2_nano"]) == 130
    assert "Traceback" not in capsys.readouterr().err


def test_help_still_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    from ponente.trainer.main import sample_lm

    with pytest.raises(SystemExit) as info:
        sample_lm.main(["--help"])
    assert info.value.code == 0
    assert "usage: ponente-sample-lm" in capsys.readouterr().out


def _subprocess(module: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, "JAX_PLATFORMS": "cpu", "HF_HUB_OFFLINE": "1", **(env or {})}
    if env is None:
        environment.pop("PONENTE_DEBUG", None)
    return subprocess.run(
        [sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=120, env=environment
    )


def test_real_exit_codes_in_a_subprocess(tmp_path: Path) -> None:
    bad_key = _subprocess(
        "ponente.trainer.main.train_lm", "--config_path", "gpt2_nano", "--trainer.num_trian_steps", "3"
    )
    assert bad_key.returncode == 2, bad_key.stderr
    assert bad_key.stderr.strip() == "error: trainer.num_trian_steps: unknown key; did you mean num_train_steps?"

    missing = _subprocess(
        "ponente.trainer.main.train_lm", "--config_path", "gpt2_nano", f"--data.train_urls=[{MISSING}]"
    )
    assert missing.returncode == 1, missing.stderr
    assert _one_error_line(missing.stderr) == f"error: no such file: {MISSING} (data.train_urls)"

    debug = _subprocess(
        "ponente.trainer.main.serve", "--hf_checkpoint", f"{MISSING}/model", env={"PONENTE_DEBUG": "1"}
    )
    assert debug.returncode == 1
    assert "Traceback (most recent call last)" in debug.stderr
    assert debug.stderr.rstrip().endswith(f"error: no such model folder: {MISSING}/model (hf_checkpoint)")


def test_run_cli_is_the_datacache_one() -> None:
    """One implementation: the trainer's scripts and ``ponente-cache`` share ``ponente.datacache.errors.run_cli``."""
    from ponente.datacache import errors

    assert run.run_cli is errors.run_cli
    from ponente.trainer.config import ConfigError

    assert issubclass(ConfigError, errors.PonenteUserError)
    assert ConfigError.exit_code == 2


def test_a_cpu_run_keeps_jax_backend_discovery_off_the_console(tmp_path: Path) -> None:
    """JAX's INFO ``Unable to initialize backend 'tpu'`` is not printed (JAX_PLATFORMS unset); Ponente's lines are."""
    from finetune_support import write_tiny_llama

    folder = write_tiny_llama(tmp_path / "llama")
    docs = tmp_path / "docs.jsonl"
    docs.write_text('{"text": "hello world"}\n', encoding="utf-8")
    args = [f"--hf_checkpoint={folder}", f"--documents={docs}", f"--output={tmp_path / 'page.html'}"]
    done = _subprocess("ponente.trainer.main.viz_logprobs", *args, env={"JAX_PLATFORMS": ""})
    assert done.returncode == 0, done.stderr
    assert "Unable to initialize backend" not in done.stderr, done.stderr
    assert "INFO ponente.models.hf._checkpoint: load_pretrained:" in done.stderr, done.stderr
    debug = _subprocess(
        "ponente.trainer.main.viz_logprobs", *args, env={"JAX_PLATFORMS": "", "PONENTE_LOG_LEVEL": "DEBUG"}
    )
    assert debug.returncode == 0, debug.stderr
    assert "jax._src.xla_bridge" in debug.stderr  # asked for DEBUG: JAX's own lines are shown
