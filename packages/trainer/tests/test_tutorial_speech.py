"""The speech tutorial (``docs/trainer/docs/speech.md``) runs as written, and what it says is true.

``test_tutorial_runs`` (``integration``) replays the page in a scratch folder down to its "shown, not run" marker:
every command of a ``bash`` block runs unchanged (``python -m ...`` with this interpreter, ``ponente-*`` through
its console script in ``pyproject.toml``), then every ``py`` block runs in one namespace. It then checks what the
page promises: the loss and the word error rate fell (WER from the run's metrics, and recomputed with ``jiwer`` on
the run's own transcripts), the Hugging Face export loads and transcribes in ``transformers``, and Ponente's greedy
decoding of the export gives the same transcripts. The fast tests check that every command of the page (the real
data ones included) resolves to a configuration, that the page's excerpt of ``whisper_tiny_digits`` is the
packaged file's, and that the token ids the page states are the generated tokenizer's.
"""

from __future__ import annotations

import importlib.resources
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_tutorials import Block, _split_args, blocks, console_scripts

ROOT = Path(__file__).resolve().parents[3]
PAGE = ROOT / "docs" / "trainer" / "docs" / "speech.md"
STOP = "<!-- test_tutorial_speech: the commands below are shown, not run -->"
EXCERPT = "# whisper_tiny_digits (excerpt)"


def _stop_line() -> int:
    lines = PAGE.read_text(encoding="utf-8").splitlines()
    assert STOP in lines, f"{PAGE.name}: the marker {STOP!r} is missing"
    return lines.index(STOP) + 1


def _commands(block: Block) -> list[list[str]]:
    """The ``ponente-*`` and ``python -m`` command lines of a ``bash`` block (continuations joined)."""
    joined = re.sub(r"\\\n", " ", block.code)
    lines = [shlex.split(line, comments=True) for line in joined.splitlines()]
    return [argv for argv in lines if argv and (argv[0].startswith("ponente-") or argv[:2] == ["python", "-m"])]


def _page_blocks(*, run: bool) -> list[Block]:
    """The blocks the test runs (above the marker) or only resolves (below it)."""
    stop = _stop_line()
    return [b for b in blocks(PAGE) if (b.line < stop) == run]


def _write_config_files(directory: Path) -> None:
    for block in blocks(PAGE):
        if block.lang == "yaml" and block.title:
            (directory / block.title).write_text(block.code + "\n", encoding="utf-8")


def test_every_command_resolves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each ``ponente-train-asr`` command of the page resolves to a configuration; each module exists."""
    from ponente.trainer.config import load_config
    from ponente.trainer.main.train_asr import TrainAsrConfig

    monkeypatch.chdir(tmp_path)
    _write_config_files(tmp_path)
    scripts = console_scripts()
    resolved = {True: 0, False: 0}
    for run in (True, False):
        for block in _page_blocks(run=run):
            if block.lang != "bash":
                continue
            for argv in _commands(block):
                where = f"{PAGE.name}:{block.line}"
                if argv[0] == "python":
                    assert importlib.util.find_spec(argv[2]) is not None, f"{where}: no module {argv[2]}"
                    continue
                assert argv[0] == "ponente-train-asr", f"{where}: unexpected command {argv[0]}"
                assert argv[0] in scripts, f"{where}: {argv[0]} is not a console script of ponente-trainer"
                paths, overrides = _split_args(argv[1:])
                config = load_config(TrainAsrConfig, paths, overrides=overrides)
                assert config.data.tokenizer, where
                resolved[run] += 1
    assert resolved == {True: 1, False: 3}


def test_the_excerpt_is_the_packaged_config() -> None:
    [excerpt] = [b for b in blocks(PAGE) if b.lang == "yaml" and b.code.startswith(EXCERPT)]
    packaged = yaml.safe_load(
        importlib.resources.files("ponente.trainer.config").joinpath("whisper_tiny_digits.yaml").read_text()
    )

    def check(part: dict, whole: dict, where: str) -> None:
        for key, value in part.items():
            assert key in whole, f"{where}{key}: not in the packaged whisper_tiny_digits.yaml"
            if isinstance(value, dict):
                check(value, whole[key], f"{where}{key}.")
            else:
                assert whole[key] == value, f"{where}{key}: the page says {value!r}, the file {whole[key]!r}"

    check(yaml.safe_load(excerpt.code), packaged, "")


def test_the_stated_token_ids_are_the_tokenizers(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    from ponente.trainer.data.synthetic_speech import write_tokenizer

    tokenizer = Tokenizer.from_file(str(write_tokenizer(tmp_path)))
    text = PAGE.read_text(encoding="utf-8")
    stated = dict(re.findall(r"`(<\|[\w.]+\|>)` = (\d+)", text))
    assert len(stated) >= 4, stated
    for token, token_id in stated.items():
        assert tokenizer.token_to_id(token) == int(token_id), token
    assert f"{tokenizer.get_vocab_size():,} tokens" in text


def _run(argv: list[str], where: str, workdir: Path) -> None:
    if argv[0] == "python":
        command = [sys.executable, *argv[1:]]
    else:
        module, function = console_scripts()[argv[0]].split(":")
        command = [sys.executable, "-c", f"import sys; from {module} import {function}; sys.exit({function}())"]
        command += argv[1:]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"{where}: {' '.join(argv)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"


@pytest.mark.integration
def test_tutorial_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Replay the page as written: generate the set, train, read the metrics, transcribe in transformers."""
    jiwer = pytest.importorskip("jiwer")
    pytest.importorskip("transformers")
    pytest.importorskip("soundfile")
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": "__tutorial__"}
    commands = 0
    for block in _page_blocks(run=True):
        where = f"{PAGE.name}:{block.line}"
        if block.lang == "bash":
            for argv in _commands(block):
                _run(argv, where, tmp_path)
                commands += 1
        elif block.lang == "py":
            exec(compile(block.code, where, "exec"), namespace)
    assert commands == 2

    # the loss and the WER fell (section 3)
    records = namespace["records"]
    assert isinstance(records, list)
    losses = [r["train/loss"] for r in records if "train/loss" in r]
    evals = [r for r in records if "eval/digits/wer" in r]
    assert len(losses) == 400
    assert sum(losses[-20:]) / 20 < 0.2 * sum(losses[:20]) / 20, (losses[:20], losses[-20:])
    assert len(evals) >= 2, evals
    assert evals[-1]["eval/digits/loss"] < 0.3 * evals[0]["eval/digits/loss"], evals
    assert evals[-1]["eval/digits/wer"] < 0.25, evals
    assert evals[-1]["eval/digits/wer"] < evals[0]["eval/digits/wer"], evals
    [transcripts] = (tmp_path / "ponente_speech" / "runs").glob(f"*/transcripts/digits-step-{evals[-1]['step']}.jsonl")
    pairs = [json.loads(line) for line in transcripts.read_text().splitlines()]
    assert len(pairs) == 64
    wer = jiwer.wer([p["reference"] for p in pairs], [p["hypothesis"] for p in pairs])
    assert wer == pytest.approx(evals[-1]["eval/digits/wer"], abs=1e-9)

    # transformers transcribes with the export, and Ponente's decoding of it agrees (section 4)
    rows, transformers_out, ponente_out = (namespace[k] for k in ("rows", "hypotheses", "ponente_hypotheses"))
    assert isinstance(rows, list)
    assert isinstance(transformers_out, list)
    assert isinstance(ponente_out, list)
    hypotheses = [h.strip() for h in transformers_out]
    ours = [h.strip() for h in ponente_out]
    assert len(ours) == len(hypotheses)
    # the same greedy decoding of the same weights: float32 rounding of torch's and XLA's CPU kernels may flip an
    # argmax where two tokens nearly tie, so one transcript of the page's eight may differ
    differ = [(a, b) for a, b in zip(hypotheses, ours, strict=True) if a != b]
    assert len(differ) <= 1, differ
    assert jiwer.wer([r["text"] for r in rows], hypotheses) < 0.3, hypotheses
    for name in ("config.json", "model.safetensors", "preprocessor_config.json", "tokenizer.json"):
        assert (tmp_path / "ponente_speech" / "whisper-digits" / name).exists(), name
