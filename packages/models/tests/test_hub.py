"""Hub ids resolve offline-first: from a fake Hugging Face cache under a temporary HF_HOME, with no network.

Each test points ``HF_ENDPOINT`` at a closed port on 127.0.0.1 and records every socket connection, so a code path
that asks the network (instead of the cache) is caught even though it would fall back to the cache.
"""

from __future__ import annotations

import json
import logging
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ponente.models.hf import (
    HubUnavailableError,
    PickleCheckpointError,
    UnsupportedModelError,
    load_pretrained,
    resolve_checkpoint,
    split_revision,
)

COMMIT_A = "a" * 40
COMMIT_B = "b" * 40
COMMIT_C = "c" * 40


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


def _add_snapshot(
    cache: Path, repo_id: str, commit: str, write: Callable[[Path], None], refs: tuple[str, ...]
) -> Path:
    """A snapshot of ``repo_id`` at ``commit`` in the Hub cache layout, written by ``write``, named by ``refs``."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    write(snapshot)
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


def _state(model: Any) -> dict[str, np.ndarray]:
    return {k: np.asarray(v, dtype=np.float32) for k, v in model.to_hf_state_dict().items()}


def _assert_same_weights(model: Any, hf: Any) -> None:
    ours = _state(model)
    theirs = {k: v.detach().float().numpy() for k, v in hf.state_dict().items() if k in ours}
    assert sorted(theirs) == sorted(ours)
    for name, value in theirs.items():
        np.testing.assert_array_equal(ours[name], value, err_msg=name)


def _save_pickle(hf: Any) -> Callable[[Path], None]:
    """Write ``hf`` as an old-style pickle checkpoint: config.json + pytorch_model.bin, no safetensors."""

    def write(folder: Path) -> None:
        hf.config.save_pretrained(folder)
        torch.save(hf.state_dict(), folder / "pytorch_model.bin")

    return write


def test_split_revision() -> None:
    assert split_revision("org/name@v1.0") == ("org/name", "v1.0")
    assert split_revision("org/name@refs/pr/1") == ("org/name", "refs/pr/1")
    assert split_revision("org/name") == ("org/name", None)


def test_cached_id_loads_without_network_and_revision_picks_the_snapshot(hub: dict[str, Any], tiny_llama: Any) -> None:
    main, tagged = tiny_llama(), tiny_llama(initializer_range=0.3)
    _add_snapshot(hub["cache"], "org/tiny", COMMIT_A, main.save_pretrained, refs=("main",))
    _add_snapshot(hub["cache"], "org/tiny", COMMIT_B, tagged.save_pretrained, refs=("v1",))

    start = time.perf_counter()
    folder = resolve_checkpoint("org/tiny")
    assert time.perf_counter() - start < 2.0
    assert folder.name == COMMIT_A
    _assert_same_weights(load_pretrained("org/tiny"), main)
    _assert_same_weights(load_pretrained("org/tiny@v1"), tagged)
    _assert_same_weights(load_pretrained("org/tiny", revision="v1"), tagged)
    _assert_same_weights(load_pretrained(f"org/tiny@{COMMIT_A}"), main)
    assert hub["connects"] == []  # online mode, yet the cache answered: no connection was even tried


def test_hf_hub_cache_overrides_hf_home(hub: dict[str, Any], tiny_llama: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    other = hub["cache"].parent.parent / "elsewhere"
    monkeypatch.setenv("HF_HUB_CACHE", str(other))
    _add_snapshot(other, "org/tiny", COMMIT_A, tiny_llama().save_pretrained, refs=("main",))
    assert (
        resolve_checkpoint("org/tiny", key="initialize_from_hf")
        == other / "models--org--tiny" / "snapshots" / COMMIT_A
    )
    assert hub["connects"] == []


def test_offline_uncached_id_is_one_quick_line(
    hub: dict[str, Any], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, capfd: Any
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    with caplog.at_level(logging.DEBUG), pytest.raises(HubUnavailableError) as info:
        load_pretrained("org/not-cached@v2", key="initialize_from_hf")
    assert time.perf_counter() - start < 2.0
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("initialize_from_hf: 'org/not-cached' (revision v2)")
    assert "HF_HUB_OFFLINE" in message
    assert str(hub["cache"]) in message
    assert isinstance(info.value, FileNotFoundError)
    assert hub["connects"] == []
    assert [r for r in caplog.records if r.name.startswith("huggingface_hub") and r.levelno >= logging.WARNING] == []
    assert capfd.readouterr().err == ""


def test_online_uncached_id_with_unreachable_hub_is_one_line(hub: dict[str, Any]) -> None:
    start = time.perf_counter()
    with pytest.raises(HubUnavailableError) as info:
        resolve_checkpoint("org/not-cached")
    assert time.perf_counter() - start < 5.0  # one refused connection, no retry with backoff
    message = str(info.value)
    assert "\n" not in message
    assert "could not be downloaded" in message
    assert "'org/not-cached'" in message
    assert hub["connects"]  # it did ask the (unreachable) Hub, as it should when online


def test_pickle_weights_are_refused_unless_allowed(hub: dict[str, Any], tiny_llama: Any, tmp_path: Path) -> None:
    hf = tiny_llama()
    _add_snapshot(hub["cache"], "org/old", COMMIT_C, _save_pickle(hf), refs=("main",))
    local = tmp_path / "local-old"
    local.mkdir()
    _save_pickle(hf)(local)
    for where in ("org/old", str(local)):
        # (online, the Hub is asked whether it also has safetensors; unreachable here, so the cached copy decides)
        with pytest.raises(PickleCheckpointError) as info:
            load_pretrained(where, key="initialize_from_hf")
        message = str(info.value)
        assert "\n" not in message
        assert message.startswith("initialize_from_hf: ")
        assert "allow_pickle: true" in message
        assert isinstance(info.value, ValueError)
        hub["connects"].clear()
        _assert_same_weights(load_pretrained(where, allow_pickle=True), hf)
        assert hub["connects"] == []  # the cached pickle weights suffice


def test_pickle_bfloat16_weights_keep_their_values(tmp_path: Path, tiny_llama: Any) -> None:
    hf = tiny_llama().to(torch.bfloat16)
    _save_pickle(hf)(tmp_path)
    model = load_pretrained(tmp_path, allow_pickle=True, dtype="bfloat16")
    assert model.to_hf_state_dict()["model.norm.weight"].dtype.name == "bfloat16"
    _assert_same_weights(model, hf)


def test_pickle_loading_uses_weights_only(tmp_path: Path, tiny_llama: Any) -> None:
    """A .bin whose pickle would run code when unpickled is refused by torch's weights-only unpickler."""
    hf = tiny_llama()
    hf.config.save_pretrained(tmp_path)
    marker = tmp_path / "code-ran"

    class Payload:
        def __reduce__(self) -> tuple[Any, ...]:
            return (Path.touch, (marker,))

    torch.save({"model.norm.weight": Payload()}, tmp_path / "pytorch_model.bin")
    with pytest.raises(Exception, match=r"(?i)weights.only|unsupported|global"):
        load_pretrained(tmp_path, allow_pickle=True)
    assert not marker.exists()


def test_safetensors_win_over_pickle(tmp_path: Path, tiny_llama: Any) -> None:
    good, stale = tiny_llama(), tiny_llama(initializer_range=0.3)
    good.save_pretrained(tmp_path)
    torch.save(stale.state_dict(), tmp_path / "pytorch_model.bin")
    _assert_same_weights(load_pretrained(tmp_path, allow_pickle=True), good)


def test_custom_code_is_never_run(tmp_path: Path, tiny_llama: Any) -> None:
    tiny_llama().save_pretrained(tmp_path)
    marker = tmp_path / "code-ran"
    (tmp_path / "modeling_custom.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    config = json.loads((tmp_path / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    load_pretrained(tmp_path)  # a supported model_type: loaded by Ponente's own code, auto_map ignored
    config["model_type"] = "custom_thing"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError) as info:
        load_pretrained(tmp_path, key="initialize_from_hf")
    message = str(info.value)
    assert "\n" not in message
    assert "'custom_thing'" in message
    assert "never runs" in message
    assert message.startswith("initialize_from_hf: ")
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, KeyError)
    assert not marker.exists()


def test_pickle_weights_without_torch_name_the_extra(
    tmp_path: Path, tiny_llama: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    _save_pickle(tiny_llama())(tmp_path)
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch fails
    with pytest.raises(ImportError, match=r"^initialize_from_hf: .*pytorch_model.*ponente-models\[torch\]") as info:
        load_pretrained(tmp_path, allow_pickle=True, key="initialize_from_hf")
    assert "\n" not in str(info.value)
