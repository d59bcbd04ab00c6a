"""Errors users see: ``run_cli`` (the one wrapper of every console script) and ``ponente-cache``'s input checks."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ponente.datacache import BadRecordError, PonenteConfigError, PonenteUserError, build_cache
from ponente.datacache import cli as cache_cli
from ponente.datacache.errors import CacheNotFoundError, error_message, exit_code, run_cli


@pytest.fixture(autouse=True)
def _no_debug_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PONENTE_DEBUG", raising=False)


def _raising(exc: BaseException) -> Callable[[list[str]], int]:
    def main(args: list[str]) -> int:
        raise exc

    return main


def _error_line(err: str) -> str:
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    return lines[0]


# ------------------------------------------------------------------------------------------------ run_cli


@pytest.mark.parametrize(
    ("exc", "code", "line"),
    [
        (FileNotFoundError("no such file: a.jsonl (INPUT)"), 1, "error: no such file: a.jsonl (INPUT)"),
        (
            FileNotFoundError(errno.ENOENT, "No such file or directory", "/x/a.jsonl"),
            1,
            "error: no such file or directory: /x/a.jsonl",
        ),
        (PonenteUserError("cache: damaged"), 1, "error: cache: damaged"),
        (
            PonenteConfigError("trainer.steps: expected int, got 'ten'"),
            2,
            "error: trainer.steps: expected int, got 'ten'",
        ),
        (ValueError("first line\n  second line"), 1, "error: first line second line"),
        (CacheNotFoundError("no cache at '/c'"), 1, "error: no cache at '/c'"),
        (
            TypeError("'NoneType' object is not subscriptable"),
            1,
            "error: internal error (TypeError: 'NoneType' object is not subscriptable); run with --debug for the "
            "traceback",
        ),
        (
            KeyError("input_ids"),
            1,
            "error: internal error (KeyError: 'input_ids'); run with --debug for the traceback",
        ),
    ],
)
def test_one_line_and_exit_status(exc: Exception, code: int, line: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(_raising(exc), []) == code
    captured = capsys.readouterr()
    assert captured.err == line + "\n"
    assert captured.out == ""
    assert exit_code(exc) == code
    assert "error: " + error_message(exc) == line


def test_an_error_raised_from_a_user_error_is_one(capsys: pytest.CaptureFixture[str]) -> None:
    # e.g. the trainer's CacheBuildError (a RuntimeError) raised from the background build's BadRecordError
    def main(args: list[str]) -> int:
        try:
            raise PonenteConfigError("data.text_key: no such field")
        except PonenteConfigError as exc:
            raise RuntimeError(f"building the cache at 'c' failed: {exc}") from exc

    assert run_cli(main, []) == 2
    assert capsys.readouterr().err == "error: building the cache at 'c' failed: data.text_key: no such field\n"


def test_debug_flag_is_removed_and_prints_the_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    seen: list[list[str]] = []

    def main(args: list[str]) -> int:
        seen.append(args)
        raise PonenteConfigError("model.num_layers: expected int")

    assert run_cli(main, ["--a", "1", "--debug", "--b", "2"]) == 2
    assert seen == [["--a", "1", "--b", "2"]]
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err
    assert err.rstrip().splitlines()[-1] == "error: model.num_layers: expected int"


@pytest.mark.parametrize(("value", "debug"), [("1", True), ("true", True), ("0", False), ("", False)])
def test_debug_environment_variable(
    value: str, debug: bool, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PONENTE_DEBUG", value)
    assert run_cli(_raising(OSError("disk full while writing checkpoint /c/step-3")), []) == 1
    assert ("Traceback" in capsys.readouterr().err) is debug


def test_success_interrupt_and_system_exit(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(lambda args: 0, []) == 0
    assert run_cli(lambda args: None, []) == 0
    assert run_cli(lambda args: 3, []) == 3
    assert run_cli(_raising(KeyboardInterrupt()), [], interrupted="interrupted: resumable") == 130
    assert capsys.readouterr().err == "interrupted: resumable\n"
    with pytest.raises(SystemExit) as info:  # --help and argparse's usage errors keep their own status
        run_cli(_raising(SystemExit(0)), [])
    assert info.value.code == 0


def test_user_error_classes() -> None:
    from ponente.datacache import DataCacheError, MissingExtraError

    for cls in (DataCacheError, BadRecordError, CacheNotFoundError, MissingExtraError):
        assert issubclass(cls, PonenteUserError)
    assert issubclass(PonenteConfigError, ValueError)
    assert PonenteUserError("x").exit_code == 1
    assert PonenteConfigError("x").exit_code == 2


# ------------------------------------------------------------------------------------------- ponente-cache


def test_build_reports_a_missing_input_before_loading_the_tokenizer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    started: list[Any] = []
    monkeypatch.setattr(cache_cli, "build_cache", lambda *a, **k: started.append(a))
    missing = tmp_path / "missing.jsonl"
    argv = ["build", "-o", str(tmp_path / "c"), "--tokenizer", "no-such-org/no-such-tokenizer", str(missing)]
    assert cache_cli.main(argv) == 1
    assert _error_line(capsys.readouterr().err) == f"error: no such file: {missing} (INPUT)"
    assert not started
    assert cache_cli.main([*argv[:-1], str(tmp_path / "*.jsonl")]) == 1
    assert str(tmp_path / "*.jsonl") in _error_line(capsys.readouterr().err)
    assert cache_cli.main([*argv[:-1], str(tmp_path)]) == 1
    assert "is a folder, not a data file" in _error_line(capsys.readouterr().err)
    assert not started


def test_missing_file_is_not_called_a_bad_record(
    tmp_path: Path, write_jsonl: Callable[..., Path], tokenizer_path: Path
) -> None:
    good = write_jsonl("good.jsonl", ["one", "two"])
    missing = tmp_path / "missing.jsonl"
    with pytest.raises(BadRecordError) as info:
        build_cache([str(good), str(missing)], tmp_path / "c", tokenizer=tokenizer_path, workers=0, progress=False)
    message = str(info.value)
    assert message.startswith(f"no such file: {missing}.")
    assert "bad_records" not in message
    assert "\n" not in message


def test_info_and_debug(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cache_cli.main(["info", str(tmp_path / "nothing")]) == 1
    assert _error_line(capsys.readouterr().err).startswith("error: no cache at ")
    assert cache_cli.main(["info", str(tmp_path / "nothing"), "--debug"]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err
    assert "CacheNotFoundError" in err


def test_real_exit_codes_in_a_subprocess(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PONENTE_DEBUG"}
    missing = tmp_path / "missing.jsonl"
    command = [sys.executable, "-m", "ponente.datacache.cli", "build", "-o", str(tmp_path / "c")]
    result = subprocess.run(
        [*command, "--tokenizer", "gpt2", str(missing)], capture_output=True, text=True, timeout=120, env=env
    )
    assert result.returncode == 1
    assert result.stderr == f"error: no such file: {missing} (INPUT)\n"
    usage = subprocess.run([*command, "--bogus"], capture_output=True, text=True, timeout=120, env=env)
    assert usage.returncode == 2
    assert "Traceback" not in usage.stderr
