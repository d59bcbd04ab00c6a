"""LoRA: PEFT parity (transformers + peft load our adapters with the same logits), merging, PEFT round trip,
trainable leaves, target selection, dropout, errors, and every architecture of the zoo."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
import transformers
from parity_support import hf_logits, logits, random_ids

import ponente.namedtensor as hax
from ponente.models import LmExample, LoraConfig, LoraLinear, compute_next_token_loss, config_for_type
from ponente.models.hf import load_peft_pretrained, load_pretrained, save_peft_pretrained
from ponente.models.lora import (
    has_lora,
    lora_sites,
    lora_trainable_filter,
    loraize,
    merge_lora,
    unwrap,
    with_dropout_keys,
)

TOL = 1e-4
VOCAB = 61
ARCHITECTURES = ["gemma", "gemma2", "gemma3", "gpt2", "llama", "mistral", "mixtral", "olmo2", "qwen", "qwen3"]


def _randomize(model: Any, *, seed: int = 0) -> Any:
    """Every adapter with random (non-zero) A and B, so that the update changes the logits."""
    flat, treedef = jax.tree_util.tree_flatten(model, is_leaf=lambda x: isinstance(x, LoraLinear))
    out = []
    for i, leaf in enumerate(flat):
        if isinstance(leaf, LoraLinear):
            ka, kb = jax.random.split(jax.random.key(seed + i))
            leaf = dataclasses.replace(
                leaf,
                lora_a=hax.random.normal(ka, leaf.lora_a.axes) * 0.3,
                lora_b=hax.random.normal(kb, leaf.lora_b.axes) * 0.3,
            )
        out.append(leaf)
    return jax.tree_util.tree_unflatten(treedef, out)


def _hf_model(kind: str) -> Any:
    """A tiny transformers model with random weights (norm scales near 1)."""
    common: dict[str, Any] = {
        "vocab_size": VOCAB,
        "max_position_embeddings": 32,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    elif kind == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, head_dim=16))
    elif kind == "gemma2":
        config = transformers.Gemma2Config(**common, head_dim=8, sliding_window=4, attn_implementation="eager")
        model = transformers.Gemma2ForCausalLM(config)
    elif kind == "gpt2":
        model = transformers.GPT2LMHeadModel(
            transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4)
        )
    else:
        raise AssertionError(kind)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if "norm" in name or "ln_" in name else 0.0))
    return model.eval()


def _ids(seq: int = 12) -> np.ndarray:
    return random_ids(seq, 2, vocab=VOCAB)


@pytest.mark.parametrize(
    ("kind", "targets"),
    [
        ("llama", None),
        ("llama", ["q_proj", "v_proj"]),
        ("qwen3", "model\\.layers\\.\\d+\\.(self_attn\\.o_proj|mlp\\.up_proj)"),
        ("gemma2", None),
        ("gpt2", ["attn.c_proj", "c_fc"]),
    ],
)
def test_peft_loads_our_adapter_with_the_same_logits(tmp_path: Path, kind: str, targets: Any) -> None:
    import peft

    hf = _hf_model(kind)
    hf.save_pretrained(tmp_path / "base")
    config = LoraConfig(r=4, alpha=8.0, target_modules=targets)
    base = load_pretrained(tmp_path / "base")
    model = _randomize(loraize(base, config, key=jax.random.key(1)))
    save_peft_pretrained(model, config, tmp_path / "adapter", base_model_name_or_path=str(tmp_path / "base"))

    adapter_config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["peft_type"] == "LORA"
    assert adapter_config["r"] == 4
    assert adapter_config["lora_alpha"] == 8.0
    peft_model = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base"), tmp_path / "adapter"
    ).eval()
    # PEFT adapted exactly our layers (no more: a short name must not select other modules)
    ours = {p for s in lora_sites(model, adapted=True) for p in s.hf_paths}
    theirs = {name.removeprefix("base_model.model.") for name, m in peft_model.named_modules() if hasattr(m, "lora_A")}
    assert theirs == ours

    ids = _ids()
    expected = hf_logits(peft_model, ids)
    np.testing.assert_allclose(logits(model, ids), expected, atol=TOL, rtol=0)
    # the adapters matter: without them the logits are far from PEFT's
    assert np.abs(logits(base, ids) - expected).max() > 100 * TOL


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_we_load_an_adapter_that_peft_wrote(tmp_path: Path, kind: str) -> None:
    import peft

    hf = _hf_model(kind)
    hf.save_pretrained(tmp_path / "base")
    targets = ["q_proj", "o_proj", "up_proj"] if kind == "llama" else ["c_attn", "mlp.c_proj"]
    peft_config = peft.LoraConfig(r=3, lora_alpha=5, target_modules=targets, task_type="CAUSAL_LM")
    peft_model = peft.get_peft_model(hf, peft_config)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.3)
    peft_model.save_pretrained(tmp_path / "adapter")
    expected = hf_logits(peft_model.eval(), _ids())

    base = load_pretrained(tmp_path / "base")
    model = load_peft_pretrained(base, tmp_path / "adapter")
    names = {s.path.rsplit(".", 2)[-2] + "." + s.path.rsplit(".", 1)[-1] for s in lora_sites(model, adapted=True)}
    expected_names = (
        {"self_attn.q_proj", "self_attn.o_proj", "mlp.up_proj"} if kind == "llama" else {"attn.c_attn", "mlp.c_proj"}
    )
    assert names == expected_names
    np.testing.assert_allclose(logits(model, _ids()), expected, atol=TOL, rtol=0)
    assert np.abs(logits(base, _ids()) - expected).max() > 100 * TOL


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_merge_equals_the_adapted_forward(kind: str) -> None:
    base = load_pretrained_in_memory(kind)
    model = _randomize(loraize(base, LoraConfig(r=3, alpha=6.0), key=jax.random.key(0)))
    merged = merge_lora(model)
    assert not has_lora(merged)
    assert type(merged) is type(base)
    ids = _ids()
    np.testing.assert_allclose(logits(merged, ids), logits(model, ids), atol=TOL, rtol=0)
    assert np.abs(logits(merged, ids) - logits(base, ids)).max() > 100 * TOL
    # unwrap gives the base back, bitwise
    assert all(
        bool(jnp.array_equal(a, b))
        for a, b in zip(jax.tree_util.tree_leaves(unwrap(model)), jax.tree_util.tree_leaves(base), strict=True)
    )


def test_save_pretrained_refuses_unmerged_adapters(tmp_path: Path) -> None:
    from ponente.models.hf import save_pretrained

    model = loraize(load_pretrained_in_memory("llama"), LoraConfig(r=2), key=jax.random.key(0))
    with pytest.raises(ValueError, match="merge_lora"):
        save_pretrained(model, tmp_path / "adapted")
    assert not (tmp_path / "adapted" / "model.safetensors").exists()
    save_pretrained(merge_lora(model), tmp_path / "merged")
    assert (tmp_path / "merged" / "model.safetensors").exists()


def load_pretrained_in_memory(kind: str) -> Any:
    from parity_support import port

    return port(_hf_model(kind))


def test_peft_round_trip(tmp_path: Path) -> None:
    base = load_pretrained_in_memory("llama")
    config = LoraConfig(r=2, alpha=4.0, dropout=0.1, target_modules=["k_proj", "down_proj"])
    model = _randomize(loraize(base, config, key=jax.random.key(0)))
    save_peft_pretrained(model, config, tmp_path)
    back = load_peft_pretrained(base, tmp_path)
    assert [s.path for s in lora_sites(back, adapted=True)] == [s.path for s in lora_sites(model, adapted=True)]
    for a, b in zip(
        jax.tree_util.tree_leaves(eqx.filter(back, lora_trainable_filter(back))),
        jax.tree_util.tree_leaves(eqx.filter(model, lora_trainable_filter(model))),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    layer = back.transformer.layers.stacked.self_attn.k_proj
    assert layer.scale == 2.0
    assert layer.dropout == 0.1
    np.testing.assert_array_equal(logits(back, _ids()), logits(model, _ids()))


def test_fresh_adapters_change_nothing_and_are_initialized_like_peft() -> None:
    base = load_pretrained_in_memory("llama")
    model = loraize(base, LoraConfig(r=4), key=jax.random.key(0))
    np.testing.assert_array_equal(logits(model, _ids()), logits(base, _ids()))
    layer = model.transformer.layers.stacked.mlp.down_proj  # fan-in 48
    assert not np.asarray(layer.lora_b.array).any()
    a = np.asarray(layer.lora_a.array)
    bound = 1 / np.sqrt(48)
    assert np.abs(a).max() <= bound
    assert np.abs(a).max() > 0.9 * bound
    assert not np.array_equal(a[0], a[1])  # each layer of the stack has its own adapter


def test_only_adapters_train() -> None:
    base = load_pretrained_in_memory("llama")
    model = loraize(base, LoraConfig(r=2), key=jax.random.key(0))
    mask = lora_trainable_filter(model)
    trainable, frozen = eqx.partition(model, mask)
    leaves = jax.tree_util.tree_leaves(trainable)
    assert len(leaves) == 2 * len(lora_sites(model, adapted=True)) == 14
    # (in + out) * r per adapted layer, times 2 layers: q 32->32, k and v 32->16, o 32->32, gate/up 32->48, down 48->32
    assert sum(x.size for x in leaves) == 2 * 2 * (64 + 48 + 48 + 64 + 80 + 80 + 80)

    example = LmExample.causal(hax.named(jnp.asarray(_ids(8)), ("batch", "position")))
    opt = optax.adam(1e-2)
    state = opt.init(trainable)

    @eqx.filter_jit
    def step(trainable: Any, state: Any) -> tuple[Any, Any]:
        grads = eqx.filter_grad(lambda t: compute_next_token_loss(eqx.combine(t, frozen), example).scalar())(trainable)
        updates, state = opt.update(grads, state, trainable)
        return eqx.apply_updates(trainable, updates), state

    for _ in range(2):
        trainable, state = step(trainable, state)
    trained = eqx.combine(trainable, frozen)
    assert all(
        bool(jnp.array_equal(a, b))
        for a, b in zip(
            jax.tree_util.tree_leaves(unwrap(trained)), jax.tree_util.tree_leaves(unwrap(model)), strict=True
        )
    )
    assert np.asarray(trained.transformer.layers.stacked.mlp.up_proj.lora_b.array).any()


def test_target_selection() -> None:
    base = load_pretrained_in_memory("llama")

    def adapted(targets: Any) -> list[str]:
        model = loraize(base, LoraConfig(r=2, target_modules=targets), key=jax.random.key(0))
        return [s.path.rsplit(".", 1)[-1] for s in lora_sites(model, adapted=True)]

    assert adapted(None) == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert adapted(["mlp.up_proj", "q_proj"]) == ["q_proj", "up_proj"]
    assert adapted(".*_proj") == adapted(None)  # not the output projection
    assert adapted(r"model\.layers\.\d+\.self_attn\.(q|v)_proj") == ["q_proj", "v_proj"]
    assert adapted(["transformer.layers.stacked.mlp.gate_proj"]) == ["gate_proj"]  # a Ponente attribute path
    with pytest.raises(ValueError, match=r"lora\.target_modules: .* selects the output projection 'lm_head'"):
        adapted(".*")


def test_errors() -> None:
    base = load_pretrained_in_memory("llama")
    with pytest.raises(ValueError, match=r"lora\.target_modules: 'wq' matches no linear layer.*'q_proj'"):
        loraize(base, LoraConfig(target_modules=["q_proj", "wq"]), key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"lora\.target_modules: 'nothing\.\*' matches no linear layer; available"):
        loraize(base, LoraConfig(target_modules="nothing.*"), key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"lora\.r: rank 33 is larger than model\.layers\.0\.self_attn\.q_proj"):
        loraize(base, LoraConfig(r=33), key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"lora\.target_modules: .* but not the other layers of the same stack"):
        loraize(base, LoraConfig(target_modules=["layers.0.self_attn.q_proj"]), key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"lora\.r must be a positive integer"):
        LoraConfig(r=0)
    with pytest.raises(ValueError, match=r"lora\.dropout"):
        LoraConfig(dropout=1.0)
    with pytest.raises(ValueError, match=r"lora\.target_modules"):
        LoraConfig(target_modules=[])
    model = loraize(base, LoraConfig(r=2), key=jax.random.key(0))
    with pytest.raises(ValueError, match="already has LoRA adapters"):
        loraize(model, LoraConfig(r=2), key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"lora\.r: the model's adapters have rank 2"):
        save_peft_pretrained(model, LoraConfig(r=4), "/nonexistent")
    with pytest.raises(ValueError, match="no LoRA adapters"):
        lora_trainable_filter(base)


def test_dropout_needs_a_key_and_differs_per_layer() -> None:
    base = load_pretrained_in_memory("llama")
    model = _randomize(loraize(base, LoraConfig(r=2, dropout=0.5, target_modules=["o_proj"]), key=jax.random.key(0)))
    ids = _ids()
    plain = logits(model, ids)
    np.testing.assert_array_equal(logits(with_dropout_keys(model, None), ids), plain)
    keyed = with_dropout_keys(model, jax.random.key(1))
    keys = keyed.transformer.layers.stacked.self_attn.o_proj.dropout_key
    assert keys.shape == (2,)
    assert not bool(jnp.all(jax.random.key_data(keys[0]) == jax.random.key_data(keys[1])))
    dropped = logits(keyed, ids)
    assert np.abs(dropped - plain).max() > 100 * TOL
    np.testing.assert_array_equal(logits(with_dropout_keys(model, jax.random.key(1)), ids), dropped)


def test_lora_linear_matches_numpy() -> None:
    In, Out = hax.Axis("embed", 6), (hax.Axis("heads", 2), hax.Axis("head", 3))
    base = hax.nn.Linear.init(In, Out, key=jax.random.key(0))
    layer = _randomize(LoraLinear.init(base, 2, alpha=3.0, dropout=0.25, key=jax.random.key(1)))
    x = hax.random.normal(jax.random.key(2), (hax.Axis("position", 5), In))
    w = np.asarray(base.weight.rearrange(("embed", "heads", "head")).array).reshape(6, 6)
    a = np.asarray(layer.lora_a.rearrange(("embed", "lora_r")).array)
    b = np.asarray(layer.lora_b.rearrange(("lora_r", "heads", "head")).array).reshape(2, 6)
    xs = np.asarray(x.array)
    bias = np.asarray(base.bias.rearrange(("heads", "head")).array).reshape(6)
    got = np.asarray(layer(x).rearrange(("position", "heads", "head")).array).reshape(5, 6)
    np.testing.assert_allclose(got, xs @ w + bias + 1.5 * xs @ a @ b, atol=1e-5)
    # dropout: the adapter sees the input with a quarter of its entries zeroed and the rest scaled by 4/3
    key = jax.random.key(3)
    kept = np.asarray(hax.nn.dropout(hax.ones(x.axes), 0.25, inference=False, key=key).array)
    np.testing.assert_allclose(np.unique(kept), [0.0, 4 / 3], rtol=1e-6)
    dropped = np.asarray(layer(x, key=key).rearrange(("position", "heads", "head")).array).reshape(5, 6)
    np.testing.assert_allclose(dropped, xs @ w + bias + 1.5 * (xs * kept) @ a @ b, atol=1e-5)


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_every_architecture(model_type: str) -> None:
    kv_heads = 4 if model_type == "gpt2" else 2
    cfg = config_for_type(model_type)(
        seq_len=8, hidden_dim=16, intermediate_dim=32, num_layers=2, num_heads=4, num_kv_heads=kv_heads
    )
    base = cfg.build(hax.Axis("vocab", 11), key=jax.random.key(0))
    model = _randomize(loraize(base, LoraConfig(r=2), key=jax.random.key(1)))
    sites = lora_sites(model, adapted=True)
    assert sites
    assert not any(s.path.endswith(("router", "lm_head")) for s in sites)
    hf_state = model.to_hf_state_dict()
    for site in sites:
        assert len(site.hf_paths) == 2  # one per layer of the stack
        for path in site.hf_paths:
            assert hf_state[f"{path}.lora_A.weight"].shape == (2, site.in_size)
            assert hf_state[f"{path}.lora_B.weight"].shape == (site.out_size, 2)
            assert f"{path}.weight" in hf_state
    ids = random_ids(8, 2, vocab=11)
    np.testing.assert_allclose(logits(merge_lora(model), ids), logits(model, ids), atol=TOL, rtol=0)
    assert np.abs(logits(model, ids) - logits(base, ids)).max() > 100 * TOL
