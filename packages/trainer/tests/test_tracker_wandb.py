"""Tests for ponente.trainer.tracker.wandb: an offline run (no network) read back from its ``.wandb`` file."""

from __future__ import annotations

import builtins
import json
import struct
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from wandb.proto import wandb_internal_pb2

import ponente.trainer.tracker as trk

_BLOCK = 32768
_HEADER = 7  # ":W&B", magic u16, version u8; each record then has crc u32, length u16, type u8


def _read_records(path: Path) -> list[Any]:
    """Parse the LevelDB-log framed ``Record`` protobufs of a ``run-*.wandb`` file."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:8]
    records, pending, offset = [], b"", _HEADER
    while offset + 7 <= len(data):
        if _BLOCK - offset % _BLOCK < 7:  # block trailer padding
            offset += _BLOCK - offset % _BLOCK
            continue
        _, length, kind = struct.unpack_from("<IHB", data, offset)
        if offset + 7 + length > len(data):  # a record still being written
            break
        chunk = data[offset + 7 : offset + 7 + length]
        offset += 7 + length
        if kind == 0 and length == 0:
            continue
        pending += chunk
        if kind in (1, 4):  # FULL or LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


@pytest.fixture
def offline_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for var, value in {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_CONSOLE": "off",
        "WANDB_DISABLE_GIT": "true",
        "WANDB_CONFIG_DIR": str(tmp_path / "config"),
        "WANDB_CACHE_DIR": str(tmp_path / "cache"),
        "WANDB_DATA_DIR": str(tmp_path / "data"),
        "WANDB_API_KEY": "",
    }.items():
        monkeypatch.setenv(var, value)
    return tmp_path


def test_offline_run_writes_history_config_and_summary(offline_env: Path) -> None:
    run_dir = offline_env / "runs"
    config = trk.WandbConfig(project="ponente-test", mode="offline", dir=str(run_dir), tags=("a",), save_code=False)
    tracker = config.init("run123")
    tracker.log_hyperparameters({"optimizer.learning_rate": 0.001, "seed": np.int64(3)})
    tracker.log({"train": {"loss": 0.1 + 0.2}, "lr": np.float32(0.5)}, step=0)
    tracker.log({"train": {"loss": 0.25}}, step=1)
    tracker.log_summary({"final_loss": 0.25})
    (offline_env / "config.yaml").write_text("seed: 3\n")
    tracker.log_artifact(offline_env / "config.yaml", type="config")
    tracker.finish()

    (offline_run,) = (run_dir / "wandb").glob("offline-run-*-run123")
    (wandb_file,) = offline_run.glob("run-run123.wandb")
    # wandb's core process may still be writing the file when finish() returns: wait for the exit record
    deadline = time.monotonic() + 60
    records = _read_records(wandb_file)
    while not any(r.WhichOneof("record_type") == "exit" for r in records) and time.monotonic() < deadline:
        time.sleep(0.2)
        records = _read_records(wandb_file)
    history = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
            history[items["_step"]] = items
    assert history[0]["train/loss"] == 0.30000000000000004
    assert history[0]["lr"] == 0.5
    assert history[1]["train/loss"] == 0.25

    config_values: dict[str, Any] = {}
    summary_values: dict[str, Any] = {}
    for r in records:
        kind = r.WhichOneof("record_type")
        if kind == "config":
            config_values.update({item.key: json.loads(item.value_json) for item in r.config.update})
        elif kind == "summary":
            summary_values.update({item.key: json.loads(item.value_json) for item in r.summary.update})
    assert config_values["optimizer.learning_rate"] == 0.001
    assert config_values["seed"] == 3
    assert summary_values["final_loss"] == 0.25
    assert summary_values["num_devices"] >= 1
    (artifact,) = [r.artifact for r in records if r.WhichOneof("record_type") == "artifact"]
    assert (artifact.name, artifact.type) == ("config.yaml", "config")
    assert [entry.path for entry in artifact.manifest.contents] == ["config.yaml"]
    run_records = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run_records[0].project == "ponente-test"
    assert list(run_records[0].tags) == ["a"]


def test_bad_mode_and_missing_xla_dump_folder_are_config_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"trainer.tracker.mode: expected one of .*'offline'.*got 'ofline'"):
        trk.WandbConfig(mode="ofline").init(None)
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
    with pytest.raises(ValueError, match="save_xla_dumps is true but XLA_FLAGS has no --xla_dump_to"):
        trk.WandbConfig(mode="offline", save_xla_dumps=True).init(None)


def test_missing_wandb_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = builtins.__import__

    def fake_import(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "wandb":
            raise ImportError("No module named 'wandb'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(ImportError, match=r"pip install 'ponente-trainer\[wandb\]'"):
        trk.WandbConfig(mode="offline").init(None)
