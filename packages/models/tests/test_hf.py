"""HF import/export: parity with transformers (GPT-2, Llama), sharding, config spellings, errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import transformers

import ponente.namedtensor as hax
from ponente.models import Gpt2LMHeadModel, LlamaConfig, LlamaLMHeadModel
from ponente.models.hf import load_pretrained, save_pretrained

TOL = 1e-4


def _ids(seq: int = 16, batch: int = 2, vocab: int = 97, seed: int = 0) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, vocab, size=(batch, seq))


def _ours(model: Any, ids: np.ndarray) -> np.ndarray:
    return np.asarray(model(hax.named(ids, ("batch", "position"))).array)


GPT2_CASES = [
    {},
    {"n_layer": 1, "n_head": 2, "n_embd": 16},
    {"n_layer": 3, "n_head": 8, "n_inner": 48},
]
LLAMA_CASES = [
    {},  # GQA 4 query heads / 2 kv heads, untied
    {"num_key_value_heads": 4, "tie_word_embeddings": True},  # MHA, tied
    {"num_key_value_heads": 1, "num_hidden_layers": 3},  # MQA
    {"head_dim": 16, "num_attention_heads": 4, "num_key_value_heads": 2},  # head_dim != hidden / heads
    {
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8,
        }
    },
]


@pytest.mark.parametrize("overrides", GPT2_CASES)
@pytest.mark.parametrize("seq", [16, 7])
def test_gpt2_import_matches_transformers(
    tmp_path: Path, overrides: dict[str, Any], seq: int, tiny_gpt2: Any, hf_logits: Any
) -> None:
    hf = tiny_gpt2(**overrides)
    hf.save_pretrained(tmp_path)
    model = load_pretrained(tmp_path)
    assert isinstance(model, Gpt2LMHeadModel)
    ids = _ids(seq)
    np.testing.assert_allclose(_ours(model, ids), hf_logits(hf, ids), atol=TOL, rtol=0)


@pytest.mark.parametrize("overrides", LLAMA_CASES)
@pytest.mark.parametrize("seq", [16, 5])
def test_llama_import_matches_transformers(
    tmp_path: Path, overrides: dict[str, Any], seq: int, tiny_llama: Any, hf_logits: Any
) -> None:
    hf = tiny_llama(**overrides)
    hf.save_pretrained(tmp_path)
    model = load_pretrained(tmp_path)
    assert isinstance(model, LlamaLMHeadModel)
    ids = _ids(seq)
    np.testing.assert_allclose(_ours(model, ids), hf_logits(hf, ids), atol=TOL, rtol=0)


@pytest.mark.parametrize("arch", ["gpt2", "llama", "llama_tied"])
@pytest.mark.parametrize("max_shard_size", [5 * 1024**3, 20_000])
def test_export_loads_in_transformers_and_round_trips_bitwise(
    tmp_path: Path, arch: str, max_shard_size: int, tiny_gpt2: Any, tiny_llama: Any, hf_logits: Any
) -> None:
    hf = {"gpt2": tiny_gpt2, "llama": tiny_llama, "llama_tied": lambda: tiny_llama(tie_word_embeddings=True)}[arch]()
    hf.save_pretrained(tmp_path / "hf")
    model = load_pretrained(tmp_path / "hf")
    save_pretrained(model, tmp_path / "ours", max_shard_size=max_shard_size)
    sharded = (tmp_path / "ours" / "model.safetensors.index.json").is_file()
    assert sharded == (max_shard_size < 5 * 1024**3)
    reloaded_hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    ids = _ids()
    np.testing.assert_array_equal(hf_logits(reloaded_hf, ids), hf_logits(hf, ids))
    # every parameter survives ours -> files -> ours bit for bit
    again = load_pretrained(tmp_path / "ours")
    first, second = model.to_hf_state_dict(), again.to_hf_state_dict()
    assert first.keys() == second.keys()
    for name in first:
        np.testing.assert_array_equal(first[name], second[name], err_msg=name)
    # and matches the PyTorch parameters
    torch_state = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    for name, value in first.items():
        np.testing.assert_array_equal(value, torch_state[name], err_msg=name)


def test_reads_transformers4_config_spelling(tmp_path: Path, tiny_llama: Any, hf_logits: Any) -> None:
    hf = tiny_llama(rope_parameters={"rope_type": "default", "rope_theta": 1234.0})
    hf.save_pretrained(tmp_path)
    config_path = tmp_path / "config.json"
    cfg = json.loads(config_path.read_text())
    cfg.pop("rope_parameters")
    cfg.pop("dtype", None)
    cfg.update(rope_theta=1234.0, torch_dtype="float32")
    config_path.write_text(json.dumps(cfg))
    model = load_pretrained(tmp_path)
    assert isinstance(model.config, LlamaConfig)
    assert model.config.rope.theta == 1234.0
    ids = _ids()
    np.testing.assert_allclose(_ours(model, ids), hf_logits(hf, ids), atol=TOL, rtol=0)


def test_dtype_argument_casts_parameters(tmp_path: Path, tiny_llama: Any) -> None:
    tiny_llama().save_pretrained(tmp_path)
    model = load_pretrained(tmp_path, dtype="bfloat16")
    assert model.to_hf_state_dict()["model.norm.weight"].dtype.name == "bfloat16"


def test_hub_id_fails_with_clear_message() -> None:
    with pytest.raises(FileNotFoundError, match=r"meta-llama/Llama-3\.2-1B.*not a local directory"):
        load_pretrained("meta-llama/Llama-3.2-1B")


def test_missing_weights_and_unknown_type(tmp_path: Path, tiny_gpt2: Any) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(KeyError, match="num_attention_heads"):
        load_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(KeyError, match="bert"):
        load_pretrained(tmp_path)
    tiny_gpt2().save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors"):
        load_pretrained(tmp_path)
