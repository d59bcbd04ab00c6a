"""The ponente-cache command: build, info, verify (and damage detection)."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from ponente.datacache import open_cache
from ponente.datacache.cli import main


def test_build_info_verify(
    tmp_path: Path,
    write_jsonl: Callable[..., Path],
    tokenizer_path: Path,
    tokenizer: Tokenizer,
    helpers: type,
    capsys: pytest.CaptureFixture[str],
) -> None:
    docs = helpers.make_documents(30, seed=11)
    write_jsonl("in/a.jsonl", docs[:20], key="content")
    write_jsonl("in/b.jsonl", [*docs[20:], ""], key="content")
    out = tmp_path / "cache"
    argv = ["build", "--output", str(out), "--tokenizer", str(tokenizer_path), "--text-key", "content"]
    argv += ["--workers", "0", "--eos", "<eos>", "--no-progress", str(tmp_path / "in/{a,b}.jsonl")]
    assert main(argv) == 0
    assert "built" in capsys.readouterr().out
    eos = tokenizer.token_to_id("<eos>")
    cache = open_cache(out)
    assert [r["input_ids"].tolist() for r in cache.get_batch(range(len(cache)))] == helpers.reference_ids(
        tokenizer, docs, eos=eos
    )

    assert main(["info", str(out)]) == 0
    info = capsys.readouterr().out
    assert "finished" in info
    assert "rows:        30" in info
    assert "empty=1" in info
    assert f"tokens:      {cache.num_tokens()}" in info
    assert cache.ledger.fingerprint in info
    assert "shards:      2 (2 finished)" in info
    assert main(["info", "--json", str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["rows"] == 30

    assert main(["verify", str(out)]) == 0
    assert "ok" in capsys.readouterr().out

    damaged = tmp_path / "damaged"
    shutil.copytree(out, damaged)
    shard = damaged / "input_ids/data/c/0"
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert main(["verify", str(damaged)]) == 1
    assert "DAMAGED" in capsys.readouterr().out

    ledger = json.loads((out / "ledger.json").read_text())
    ledger["rows"] += 1
    (damaged / "input_ids/data/c/0").write_bytes((out / "input_ids/data/c/0").read_bytes())
    (damaged / "ledger.json").write_text(json.dumps(ledger))
    assert main(["verify", str(damaged)]) == 1
    assert "31 rows are committed" in capsys.readouterr().out


def test_errors_exit_1_with_a_message(
    tmp_path: Path, tokenizer_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": 3}\n')
    argv = ["build", "-o", str(tmp_path / "c"), "--tokenizer", str(tokenizer_path), "--workers", "0", "--no-progress"]
    assert main([*argv, str(bad)]) == 1
    assert f"{bad}, line 2: wrong type" in capsys.readouterr().err
    assert main([*argv, "--bad-records", "skip", str(bad)]) == 0
    assert main(["info", str(tmp_path / "nothing")]) == 1
    assert "no cache" in capsys.readouterr().err


def test_console_script_is_installed(tmp_path: Path) -> None:
    result = subprocess.run(["ponente-cache", "--help"], capture_output=True, text=True, check=True)
    assert "build" in result.stdout
    assert "verify" in result.stdout


def test_ctrl_c_stops_cleanly_and_resumes(
    tmp_path: Path, write_jsonl: Callable[..., Path], tokenizer_path: Path, helpers: type
) -> None:
    import signal
    import sys
    import time

    # many shards, so the build is still running when the signal arrives even on a loaded machine
    docs = helpers.make_documents(12000, seed=21)
    shards = [write_jsonl(f"in/part-{i:02d}.jsonl", docs[i * 500 : (i + 1) * 500]) for i in range(24)]
    out = tmp_path / "cache"
    argv = [
        "build",
        "-o",
        str(out),
        "--tokenizer",
        str(tokenizer_path),
        "--workers",
        "1",
        "--no-progress",
        *map(str, shards),
    ]
    code = f"import sys; from ponente.datacache.cli import main\nif __name__ == '__main__': sys.exit(main({argv!r}))"
    script = tmp_path / "run.py"
    script.write_text(code)
    # Interrupt as soon as the cache exists (the build is under way, its worker starting or working).
    # the child must not inherit an ignored SIGINT (as in a background job), or Python installs no handler
    process = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 60
    while not (out / "ledger.json").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 130, err
    assert "interrupted" in err
    assert not open_cache(out).is_finished
    assert main(argv) == 0
    reference = tmp_path / "reference"
    assert main([*argv[:2], str(reference), *argv[3:]]) == 0
    assert helpers.tree_digest(out) == helpers.tree_digest(reference)
