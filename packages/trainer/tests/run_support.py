"""A tiny finished training run for the tests of the tools that read a run's checkpoints (export, evaluation).

The run is the hello world (packaged ``gpt2_nano``) shrunk: its training file is ``gpt2_nano`` with a tiny
model, a tiny local corpus and every output under one folder, written to disk as a user would write it, then
trained for a few steps with ``ponente-train``'s ``train``.
"""

import dataclasses
from pathlib import Path

import pytest
import yaml
from conftest import TOKENIZER, tiny_corpus

from ponente.trainer.config import load_config, read_config_file
from ponente.trainer.main import train_lm
from ponente.trainer.main.train_lm import TrainLmConfig

TINY_MODEL = {
    "seq_len": 32,
    "hidden_dim": 32,
    "intermediate_dim": 64,
    "num_layers": 2,
    "num_heads": 2,
    "num_kv_heads": 2,
}
"""The model of the tiny run (``gpt2_nano`` has 4 layers of width 128)."""


@dataclasses.dataclass(frozen=True)
class TinyRun:
    """A finished tiny run.

    Attributes:
        config: its training configuration.
        training_file: the YAML file it was trained from.
        checkpoints: its run folder of checkpoints (``<base_path>/<run id>``).
        checkpoint: its last checkpoint (``.../step-N``).
    """

    config: TrainLmConfig
    training_file: Path
    checkpoints: Path
    checkpoint: Path


def train_tiny_run(directory: Path, steps: int = 3) -> TinyRun:
    """Write a shrunk ``gpt2_nano`` training file under ``directory`` and train it for ``steps`` steps."""
    train, validation = tiny_corpus(directory)
    tree = read_config_file("gpt2_nano")
    tree["data"].update(
        train_urls=[train], validation_urls=[validation], tokenizer=TOKENIZER, cache_dir=str(directory / "cache")
    )
    tree["model"].update(TINY_MODEL)
    tree["trainer"].update(
        train_batch_size=4,
        num_train_steps=steps,
        steps_per_eval=steps,
        max_eval_batches=1,
        id="tiny",
        run_dir=str(directory / "runs" / "{run_id}"),
        tracker=[{"type": "json", "path": str(directory / "metrics.jsonl")}],
    )
    tree["trainer"]["checkpointer"]["base_path"] = str(directory / "checkpoints")
    tree["sample"]["num_tokens"] = 4
    training_file = directory / "train.yaml"
    training_file.write_text(yaml.safe_dump(tree, sort_keys=False))
    config = load_config(TrainLmConfig, [str(training_file)])
    result = train_lm.train(config)
    assert result.checkpoint is not None
    assert result.checkpoint.endswith(f"step-{steps}")
    return TinyRun(config, training_file, directory / "checkpoints" / "tiny", Path(result.checkpoint))


_RUNS: dict[str, TinyRun] = {}


def shared_tiny_run(tmp_path_factory: pytest.TempPathFactory) -> TinyRun:
    """The tiny run of this test session, trained on first use (export and evaluation tests share it)."""
    key = str(tmp_path_factory.getbasetemp())
    if key not in _RUNS:
        _RUNS[key] = train_tiny_run(tmp_path_factory.mktemp("tiny_run"))
    return _RUNS[key]
