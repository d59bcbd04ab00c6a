"""Runs that start from a Hugging Face Hub id: offline-first from a fake Hub cache, ``@revision``, ``allow_pickle``.

The cache lives under a temporary ``HF_HOME``; ``HF_ENDPOINT`` points at a closed port and every socket
connection is recorded, so nothing here may (or can) reach the network.
"""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from finetune_support import losses, supervised_overrides, write_tiny_llama

from ponente.trainer import run
from ponente.trainer.config import load_config
from ponente.trainer.main import sft
from ponente.trainer.main.lora_lm import LoraLmConfig
from ponente.trainer.main.sft import SftConfig
from ponente.trainer.main.train_lm import TrainLmConfig
from ponente.trainer.tasks.lm import LmTask

COMMIT_A = "a" * 40
COMMIT_B = "b" * 40


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, Any]:
    """An empty Hub cache under ``tmp_path/hf`` (HF_HOME), online mode, an unreachable endpoint, connections logged."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    connects: list[Any] = []
    original = socket.socket.connect

    def logged(self: socket.socket, address: Any) -> Any:
        connects.append(address)
        return original(self, address)

    monkeypatch.setattr(socket.socket, "connect", logged)
    return {"cache": tmp_path / "hf" / "hub", "connects": connects}


def _snapshot(cache: Path, repo_id: str, commit: str, refs: tuple[str, ...]) -> Path:
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


def _as_pickle(source: Path, target: Path) -> None:
    """Copy the checkpoint folder ``source`` to ``target`` with its safetensors replaced by ``pytorch_model.bin``."""
    import torch
    from safetensors.torch import load_file

    shutil.copytree(source, target, dirs_exist_ok=True)
    (target / "model.safetensors").unlink()
    torch.save(load_file(source / "model.safetensors"), target / "pytorch_model.bin")


def test_allow_pickle_is_a_key_of_the_runs_that_load_hf_models(tmp_path: Path) -> None:
    write_tiny_llama(tmp_path)
    data = [f"data.tokenizer={tmp_path}", "data.train_urls=[unused.jsonl]"]
    cfg = load_config(TrainLmConfig, overrides=["allow_pickle=true", f"initialize_from_hf={tmp_path}", *data])
    assert cfg.allow_pickle is True
    assert LmTask(cfg).allow_pickle is True
    assert load_config(TrainLmConfig).allow_pickle is False
    assert load_config(SftConfig, overrides=["allow_pickle=true"]).allow_pickle is True
    assert load_config(LoraLmConfig, overrides=["allow_pickle=true"]).allow_pickle is True


def test_model_config_of_a_hub_revision_needs_only_its_config(hub: dict[str, Any]) -> None:
    """``org/name@rev`` picks that snapshot's config.json; no weights are needed (or fetched) to read it."""
    for commit, ref, layers in ((COMMIT_A, "main", 2), (COMMIT_B, "v1", 3)):
        config = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
                  "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2,
                  "max_position_embeddings": 64}  # fmt: skip
        (_snapshot(hub["cache"], "org/tiny", commit, refs=(ref,)) / "config.json").write_text(json.dumps(config))
    assert run.hf_model_config("org/tiny").num_layers == 2
    assert run.hf_model_config("org/tiny@v1").num_layers == 3
    assert run.hf_model_config(f"org/tiny@{COMMIT_B}").num_layers == 3
    assert run.hf_vocab_size("org/tiny@v1") == 64
    assert hub["connects"] == []


def test_pickle_weights_need_allow_pickle(hub: dict[str, Any], tmp_path: Path) -> None:
    import jmp
    import torch
    import transformers

    from ponente.models.hf import PickleCheckpointError

    source = write_tiny_llama(tmp_path / "source")
    _as_pickle(source, _snapshot(hub["cache"], "org/old-llama", COMMIT_A, refs=("main",)))
    model_config = run.hf_model_config("org/old-llama")
    mp = jmp.get_policy("f32")
    with pytest.raises(PickleCheckpointError, match=r"^initialize_from_hf: .*allow_pickle: true"):
        run.load_hf_weights("org/old-llama", model_config, mp)
    hub["connects"].clear()  # (online, the refusal asked the Hub whether it has safetensors too)
    model = run.load_hf_weights("org/old-llama", model_config, mp, allow_pickle=True)
    assert hub["connects"] == []
    reference = transformers.LlamaForCausalLM.from_pretrained(source, dtype=torch.float32).state_dict()
    ours = model.to_hf_state_dict()
    for name, value in ours.items():
        np.testing.assert_array_equal(np.asarray(value), reference[name].numpy(), err_msg=name)


@pytest.mark.integration
def test_sft_from_a_cached_hub_id_with_pickle_weights(hub: dict[str, Any], tmp_path: Path) -> None:
    """A run from ``org/name@rev`` (pickle weights, allowed) starts exactly where one from the local folder does."""
    source = write_tiny_llama(tmp_path / "source")
    _as_pickle(source, _snapshot(hub["cache"], "org/old-llama", COMMIT_B, refs=("v1",)))

    def overrides(where: Path, model: str) -> list[str]:
        listed = [
            o for o in supervised_overrides(where, source, 2) if not o.startswith(("initialize_from_hf", "data.tok"))
        ]
        return [*listed, f"initialize_from_hf={model}", f"data.tokenizer={model}"]

    refused = load_config(SftConfig, overrides=overrides(tmp_path / "refused", "org/old-llama@v1"))
    with pytest.raises(ValueError, match=r"initialize_from_hf: .*allow_pickle: true"):
        sft.train(refused)
    hub["connects"].clear()
    from_hub = sft.train(
        load_config(SftConfig, overrides=[*overrides(tmp_path / "hub", "org/old-llama@v1"), "allow_pickle=true"])
    )
    assert hub["connects"] == []
    from_folder = sft.train(load_config(SftConfig, overrides=overrides(tmp_path / "folder", str(source))))
    assert from_hub.steps == from_folder.steps == 2
    assert losses(tmp_path / "hub") == losses(tmp_path / "folder")


def test_a_run_that_started_from_a_hub_id_loads_for_inference(hub: dict[str, Any], tmp_path: Path) -> None:
    """``inference.load_model`` of a checkpoint whose run names its model only by a hub id (no model section)."""
    import equinox as eqx
    import jax

    import ponente.namedtensor as hax
    from ponente.models.hf import load_pretrained
    from ponente.trainer.checkpoint import save_checkpoint
    from ponente.trainer.inference import load_model

    source = write_tiny_llama(tmp_path / "src")
    shutil.copytree(source, _snapshot(hub["cache"], "org/tiny-llama", COMMIT_A, refs=("v2",)), dirs_exist_ok=True)
    reference = load_pretrained(source)
    config = {"initialize_from_hf": "org/tiny-llama@v2", "data": {"tokenizer": str(source)}}
    save_checkpoint({"model": reference}, tmp_path / "run", step=1, metadata={"config": config})
    model, tokenizer = load_model(str(tmp_path / "run"))
    assert tokenizer is not None
    tokens = hax.named(jax.numpy.arange(8)[None] % 50, ("batch", "position"))
    np.testing.assert_array_equal(
        np.asarray(eqx.filter_jit(lambda m: m(tokens))(model).array),
        np.asarray(eqx.filter_jit(lambda m: m(tokens))(reference).array),
    )
    assert hub["connects"] == []
