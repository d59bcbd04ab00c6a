"""Shared helpers of the trainer tests: a tiny local corpus and a tiny ``train_lm`` configuration."""

import gzip
import importlib.resources
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

TOKENIZER = "package://ponente.trainer.assets/shakespeare_tokenizer.json"
"""The shipped Shakespeare byte-level BPE tokenizer (4096 entries)."""


def tiny_corpus(directory: Path) -> tuple[str, str]:
    """A few thousand words of the shipped validation works, split into train/validation jsonl files."""
    source = importlib.resources.files("ponente.trainer.assets").joinpath("shakespeare_validation.jsonl.gz")
    with gzip.open(source.open("rb"), "rt", encoding="utf-8") as f:
        text = json.loads(f.readline())["text"]
    text = "".join(ch for ch in text if ch.isascii())
    chunks = [text[i : i + 2000] for i in range(0, 60_000, 2000)]
    paths = []
    for name, docs in (("train", chunks[:-3]), ("validation", chunks[-3:])):
        path = directory / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
        paths.append(str(path))
    return paths[0], paths[1]


def write_config(directory: Path, overrides: list[str]) -> Path:
    """The dotted ``key=value`` overrides as one nested YAML file ``directory/config.yaml`` (values parsed as YAML)."""
    nested: dict[str, Any] = {}
    for item in overrides:
        key, _, value = item.partition("=")
        *parents, leaf = key.split(".")
        node = nested
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(value)
    path = directory / "config.yaml"
    path.write_text(yaml.safe_dump(nested))
    return path


def tiny_overrides(tmp_path: Path, train: str, validation: str, steps: int) -> list[str]:
    return [
        f"data.train_urls=[{train}]",
        f"data.validation_urls=[{validation}]",
        f"data.tokenizer={TOKENIZER}",
        f"data.cache_dir={tmp_path / 'cache'}",
        "model.type=gpt2",
        "model.seq_len=32",
        "model.hidden_dim=32",
        "model.intermediate_dim=64",
        "model.num_layers=2",
        "model.num_heads=2",
        "model.num_kv_heads=2",
        "trainer.train_batch_size=8",
        f"trainer.num_train_steps={steps}",
        "trainer.steps_per_eval=10",
        "trainer.max_eval_batches=2",
        "trainer.id=tiny",
        f"trainer.run_dir={tmp_path / 'runs' / '{run_id}'}",
        f"trainer.tracker={{type: json, path: {tmp_path / 'metrics.jsonl'}}}",
        f"trainer.checkpointer.base_path={tmp_path / 'ckpt'}",
        "optimizer.learning_rate=1e-2",
        "optimizer.warmup=0.1",
    ]


@pytest.fixture
def tiny_lm_overrides(tmp_path: Path):
    """A factory ``(steps) -> list of overrides`` for a tiny GPT-2 run on a small corpus under ``tmp_path``."""
    train, validation = tiny_corpus(tmp_path)

    def make(steps: int) -> list[str]:
        return tiny_overrides(tmp_path, train, validation, steps)

    return make


@pytest.fixture(scope="module")
def tiny_lm_shared(tmp_path_factory: pytest.TempPathFactory):
    """A factory ``(directory, steps) -> overrides`` whose runs share one corpus and token cache per test module.

    Each run's tracker, checkpoints and run record go under ``directory``; the corpus and the cache are
    built once, so several runs (e.g. a reference and interrupted copies of it) do not rebuild them.
    """
    root = tmp_path_factory.mktemp("tiny_lm_shared")
    train, validation = tiny_corpus(root)

    def make(directory: Path, steps: int) -> list[str]:
        overrides = tiny_overrides(directory, train, validation, steps)
        return [f"data.cache_dir={root / 'cache'}" if o.startswith("data.cache_dir=") else o for o in overrides]

    return make


@pytest.fixture
def tiny_lm_run_overrides(tmp_path: Path):
    """A factory ``(name, steps) -> overrides`` of tiny runs that share one corpus, each under ``tmp_path/name``."""
    train, validation = tiny_corpus(tmp_path)

    def make(name: str, steps: int) -> list[str]:
        where = tmp_path / name
        where.mkdir(exist_ok=True)
        return tiny_overrides(where, train, validation, steps)

    return make


class TrainLmProcess:
    """One ``python -m ponente.trainer.main.train_lm --config_path config.yaml`` subprocess in ``directory``.

    Its output goes to files; a wait fails the test (with the end of its stderr) after ``timeout`` seconds.
    """

    def __init__(
        self, directory: Path, attempt: int, env: dict[str, str] | None = None, *, timeout: float = 300.0
    ) -> None:
        self.timeout = timeout
        self.directory = directory
        self.stderr_path = directory / f"stderr-{attempt}.txt"
        self.stdout_path = directory / f"stdout-{attempt}.txt"
        with self.stdout_path.open("w") as out, self.stderr_path.open("w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "ponente.trainer.main.train_lm", "--config_path", "config.yaml"],
                stdout=out,
                stderr=err,
                env={**os.environ, **(env or {})},
                cwd=directory,
            )

    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def wait_until(self, condition: Any, what: str) -> None:
        """Poll ``condition()`` until it holds; fail if the process exits first or it takes too long."""
        deadline = time.monotonic() + self.timeout
        while not condition():
            if self.proc.poll() is not None:
                pytest.fail(f"the run exited ({self.proc.returncode}) before {what}:\n{self.stderr()[-3000:]}")
            if time.monotonic() > deadline:
                self.proc.kill()
                pytest.fail(f"timed out waiting for {what}:\n{self.stderr()[-3000:]}")
            time.sleep(0.05)

    def finish(self) -> int:
        try:
            return self.proc.wait(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            pytest.fail(f"the run did not finish:\n{self.stderr()[-3000:]}")
