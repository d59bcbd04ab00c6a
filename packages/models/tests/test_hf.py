"""HF import/export: parity with transformers (GPT-2, Llama), sharding, config spellings, errors."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest
import transformers

import ponente.namedtensor as hax
from ponente.models import Gpt2LMHeadModel, LlamaConfig, LlamaLMHeadModel, LmExample, compute_next_token_loss
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


YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 8}


@pytest.mark.parametrize(
    ("arch", "max_shard_size"),
    [
        ("gpt2", 5 * 1024**3),
        ("gpt2", 20_000),
        ("gpt2_options", 20_000),
        ("llama", 5 * 1024**3),
        ("llama", 20_000),
        ("llama_tied", 20_000),
        ("llama_yarn", 5 * 1024**3),
    ],
)
def test_export_loads_in_transformers_and_round_trips_bitwise(
    tmp_path: Path, arch: str, max_shard_size: int, tiny_gpt2: Any, tiny_llama: Any, hf_logits: Any
) -> None:
    hf = {
        "gpt2": tiny_gpt2,
        "gpt2_options": lambda: tiny_gpt2(scale_attn_by_inverse_layer_idx=True, reorder_and_upcast_attn=True),
        "llama": tiny_llama,
        "llama_tied": lambda: tiny_llama(tie_word_embeddings=True),
        "llama_yarn": lambda: tiny_llama(rope_parameters=dict(YARN), initializer_range=0.2),
    }[arch]()
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


def test_hub_id_offline_fails_with_clear_message() -> None:
    # conftest sets HF_HUB_OFFLINE=1 for every test
    with pytest.raises(FileNotFoundError, match=r"'no-such-org/no-such' is not a local directory.*HF_HUB_OFFLINE"):
        load_pretrained("no-such-org/no-such")
    with pytest.raises(FileNotFoundError, match=r"nor a Hugging Face Hub id"):
        load_pretrained("a/b/c/not-a-repo")


def test_hub_id_without_huggingface_hub(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import fails
    with pytest.raises(ImportError, match=r"'fake-org/fake'.*huggingface_hub.*ponente-models\[hf\]"):
        load_pretrained("fake-org/fake")


def test_hub_id_download_failure_and_success(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_gpt2: Any, hf_logits: Any
) -> None:
    import huggingface_hub

    monkeypatch.delenv("HF_HUB_OFFLINE")
    calls: list[tuple[str, str | None]] = []

    def unreachable(repo_id: str, *, revision: str | None = None, local_files_only: bool = False, **_: Any) -> str:
        if local_files_only:  # the cache is asked first (and is empty)
            raise huggingface_hub.errors.LocalEntryNotFoundError("not cached")
        calls.append((repo_id, revision))
        raise OSError("connection refused")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    with pytest.raises(FileNotFoundError, match=r"'fake-org/fake' \(revision v1\).*could not be downloaded.*OSError"):
        load_pretrained("fake-org/fake", revision="v1")
    assert calls == [("fake-org/fake", "v1")]

    hf = tiny_gpt2()
    hf.save_pretrained(tmp_path)

    def local(repo_id: str, *, allow_patterns: Any = None, local_files_only: bool = False, **_: Any) -> str:
        assert "config.json" in allow_patterns
        if local_files_only:
            raise huggingface_hub.errors.LocalEntryNotFoundError("not cached")
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", local)
    model = load_pretrained("fake-org/fake")
    ids = _ids()
    np.testing.assert_allclose(_ours(model, ids), hf_logits(hf, ids), atol=TOL, rtol=0)


def test_vocab_padding_masks_logits_and_exports_unpadded(tmp_path: Path, tiny_llama: Any, hf_logits: Any) -> None:
    hf = tiny_llama(initializer_range=0.2)
    hf.save_pretrained(tmp_path / "hf")
    plain = load_pretrained(tmp_path / "hf")
    padded = load_pretrained(tmp_path / "hf", pad_vocab_to_multiple=64)
    assert isinstance(padded, LlamaLMHeadModel)
    assert padded.lm_head is not None
    assert (padded.Vocab.size, padded.vocab_size, padded.config.vocab_padding_multiple) == (128, 97, 64)
    state = padded.to_hf_state_dict()
    assert state["model.embed_tokens.weight"].shape == state["lm_head.weight"].shape == (128, 32)
    assert not state["lm_head.weight"][97:].any()  # padded rows load as zeros
    # even with large padded output rows, masking keeps padded entries out of the softmax and the argmax
    head = padded.lm_head.weight
    big = hax.where(hax.arange(padded.Vocab) >= 97, 5.0, head)
    padded = dataclasses.replace(padded, lm_head=dataclasses.replace(padded.lm_head, weight=big))
    ids = _ids()
    lp, lq = _ours(plain, ids), _ours(padded, ids)
    np.testing.assert_allclose(lq[..., :97], lp, atol=1e-5, rtol=0)  # a wider matmul may round differently
    np.testing.assert_allclose(lp, hf_logits(hf, ids), atol=TOL, rtol=0)
    assert (lq[..., 97:] == np.finfo(np.float32).min).all()
    assert lq.argmax(-1).max() < 97
    example = LmExample.causal(hax.named(jnp.asarray(ids), ("batch", "position")))
    loss_plain = float(compute_next_token_loss(plain, example).scalar())
    loss_padded = float(compute_next_token_loss(padded, example).scalar())
    assert np.isfinite(loss_padded)
    assert loss_padded == pytest.approx(loss_plain, rel=1e-6)
    # export drops the padding: transformers loads it and the weights are the original ones, bit for bit
    save_pretrained(padded, tmp_path / "ours")
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["vocab_size"] == 97
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    torch_state = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    for name, value in reloaded.state_dict().items():
        np.testing.assert_array_equal(value.detach().numpy(), torch_state[name], err_msg=name)
    # an explicit vocab_size exports fewer rows; an impossible one is an error
    save_pretrained(plain, tmp_path / "small", vocab_size=90)
    assert load_pretrained(tmp_path / "small").Vocab.size == 90
    with pytest.raises(ValueError, match=r"vocab_size must be in 1\.\.97"):
        save_pretrained(plain, tmp_path / "big", vocab_size=98)


def test_config_overrides(tmp_path: Path, tiny_llama: Any) -> None:
    tiny_llama().save_pretrained(tmp_path)
    model = load_pretrained(tmp_path, config_overrides={"gradient_checkpointing": True, "attn_backend": "flash"})
    assert model.config.gradient_checkpointing is True
    assert model.config.attn_backend == "flash"
    with pytest.raises(ValueError, match=r"\['no_such_field'\] are not fields of LlamaConfig"):
        load_pretrained(tmp_path, config_overrides={"no_such_field": 1})


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


@pytest.mark.parametrize(
    "shard", ["../outside.safetensors", "/tmp/outside.safetensors", "sub/../../outside.safetensors"]
)
def test_an_index_cannot_name_a_shard_outside_the_folder(tmp_path: Path, shard: str) -> None:
    import jax

    import ponente.namedtensor as hax
    from ponente.models import LlamaConfig

    config = LlamaConfig(seq_len=8, hidden_dim=16, intermediate_dim=32, num_layers=1, num_heads=2, num_kv_heads=2)
    save_pretrained(config.build(hax.Axis("vocab", 32), key=jax.random.key(0)), tmp_path / "m", max_shard_size=2000)
    index_path = tmp_path / "m" / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    (tmp_path / "outside.safetensors").write_bytes((tmp_path / "m" / first).read_bytes())
    index["weight_map"] = {k: (shard if v == first else v) for k, v in index["weight_map"].items()}
    index_path.write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json") as error:
        load_pretrained(tmp_path / "m")
    assert repr(shard) in str(error.value)
