"""The ``lora_lm`` entry point: Levanter's config keys, frozen base weights, PEFT export, resume and sharding.

The end-to-end runs adapt a tiny random Hugging Face Llama (written to a temporary folder, with a tokenizer
trained locally) on the shipped tiny instruction set; nothing touches the network.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from finetune_support import losses, supervised_overrides, write_tiny_llama

import ponente.namedtensor as hax
from ponente.trainer.config import load_config
from ponente.trainer.main import lora_lm
from ponente.trainer.main.lora_lm import LoraLmConfig

LORA = ["lora.r=4", "lora.alpha=16", "peft_save_path={out}/peft", "merged_hf_save_path={out}/merged"]


def _overrides(tmp_path: Path, model_dir: Path, steps: int, *extra: str) -> list[str]:
    lora = [item.format(out=tmp_path) for item in LORA]
    return [*supervised_overrides(tmp_path, model_dir, steps), *lora, "optimizer.learning_rate=2e-2", *extra]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


def test_levanters_lora_llama2_config_loads_with_only_paths_changed(tmp_path: Path) -> None:
    cfg = load_config(
        LoraLmConfig, ["lora_llama2"], overrides=[f"initialize_from_hf={tmp_path}", f"data.tokenizer={tmp_path}"]
    )
    assert cfg.peft_save_path == "lora_llama2"
    assert cfg.max_train_length == 2048
    assert cfg.trainer.mp == "p=f32,c=bfloat16"
    assert cfg.trainer.num_train_steps == 5000
    assert cfg.trainer.per_device_parallelism == 4
    assert cfg.trainer.tensor_parallel_axes == ["mlp", "heads"]
    assert cfg.optimizer.learning_rate == 3e-4
    assert cfg.optimizer.weight_decay == 0.1
    assert (cfg.lora.r, cfg.lora.alpha, cfg.lora.dropout, cfg.lora.target_modules) == (8, 8.0, 0.0, None)


def test_lora_keys_and_their_errors() -> None:
    cfg = load_config(LoraLmConfig, overrides=["lora={r: 16, alpha: 32, dropout: 0.1, target_modules: [q_proj]}"])
    assert (cfg.lora.r, cfg.lora.alpha, cfg.lora.dropout, cfg.lora.target_modules) == (16, 32.0, 0.1, ["q_proj"])
    with pytest.raises(ValueError, match="initialize_from_hf"):
        lora_lm.train(LoraLmConfig())


def test_base_weights_hold_no_optimizer_state() -> None:
    """With the LoRA filter, Adam's moments exist for the adapters only (two per adapter parameter)."""
    import equinox as eqx
    import optax

    from ponente.models import LlamaConfig
    from ponente.models.lora import LoraConfig, lora_trainable_filter, loraize
    from ponente.trainer.tasks.lm import lm_loss_fn
    from ponente.trainer.trainer import Trainer, TrainerConfig

    model_config = LlamaConfig(
        seq_len=8, hidden_dim=16, intermediate_dim=32, num_layers=2, num_heads=4, num_kv_heads=2
    )
    Vocab = hax.Axis("vocab", 32)

    def model_init(key: Any) -> Any:
        return loraize(model_config.build(Vocab, key=key), LoraConfig(r=2), key=jax.random.PRNGKey(1))

    trainer = Trainer(TrainerConfig(train_batch_size=2, compilation_cache_dir=None), optax.adam(1e-3), lm_loss_fn())
    filt = lora_trainable_filter(eqx.filter_eval_shape(model_init, jax.random.PRNGKey(0)))
    state = trainer.initial_state(model_init, is_trainable=filt)

    def size(tree: Any) -> int:
        return sum(x.size for x in jax.tree_util.tree_leaves(eqx.filter(tree, eqx.is_inexact_array)))

    adapters = sum(
        x.size for path, x in jax.tree_util.tree_leaves_with_path(state.model) if "lora_" in jax.tree_util.keystr(path)
    )
    assert adapters > 0
    assert size(state.trainable_model) == adapters
    assert size(state.opt_state) == 2 * adapters < size(state.model)


# --- end to end ----------------------------------------------------------------------------------


def _checkpoint_model(model_dir: Path, cfg: LoraLmConfig, checkpoint: str) -> tuple[Any, Any]:
    """(the base model, the adapted model of ``checkpoint``)."""
    from ponente.models.hf import load_pretrained
    from ponente.models.lora import loraize
    from ponente.trainer.checkpoint import load_checkpoint

    base = load_pretrained(model_dir)
    template = loraize(base, cfg.lora, key=jax.random.PRNGKey(0))
    return base, load_checkpoint(template, checkpoint, subpath="model")


@pytest.mark.integration
def test_lora_lm_trains_only_the_adapters_and_exports_peft_and_merged(tmp_path: Path, tiny_llama: Path) -> None:
    import torch
    import transformers
    from peft import PeftModel

    from ponente.models import AttentionMask
    from ponente.models.lora import loraize, unwrap

    cfg = load_config(LoraLmConfig, overrides=_overrides(tmp_path, tiny_llama, 30, "hf_save_steps=10"))
    result = lora_lm.train(cfg)
    assert result.steps == 30
    steps_losses = losses(tmp_path)
    assert [s for s, _ in steps_losses] == list(range(1, 31))
    values = [loss for _, loss in steps_losses]
    assert np.mean(values[-5:]) < values[0] - 0.3, values
    assert result.outputs["peft adapter"] == str(tmp_path / "peft")
    assert result.hf_path == str(tmp_path / "merged")
    for step in (10, 20):
        assert (tmp_path / "peft" / f"step-{step}" / "adapter_model.safetensors").is_file()
        assert (tmp_path / "merged" / f"step-{step}" / "config.json").is_file()

    # the base weights are bitwise those of the Hugging Face checkpoint; the adapters moved
    base, trained = _checkpoint_model(tiny_llama, cfg, result.checkpoint)
    for got, want in zip(jax.tree_util.tree_leaves(unwrap(trained)), jax.tree_util.tree_leaves(base), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    initial = loraize(base, cfg.lora, key=jax.random.fold_in(jax.random.PRNGKey(0), 1))
    q_now = trained.transformer.layers.stacked.self_attn.q_proj
    q_then = initial.transformer.layers.stacked.self_attn.q_proj
    assert not np.allclose(np.asarray(q_now.lora_b.array), np.asarray(q_then.lora_b.array))
    assert not np.allclose(np.asarray(q_now.lora_a.array), np.asarray(q_then.lora_a.array))

    # PEFT loads the adapter on the base checkpoint; its logits, the merged export's and ours agree
    ids = np.random.default_rng(0).integers(0, base.Vocab.size, size=(2, 24))
    ours = np.asarray(trained(hax.named(ids, ("batch", "position")), AttentionMask.causal()).array)
    with torch.no_grad():
        hf_base = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
        peft_logits = PeftModel.from_pretrained(hf_base, tmp_path / "peft").eval()(torch.tensor(ids)).logits.numpy()
        merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
        merged_logits = merged(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(peft_logits, ours, atol=1e-4)
    np.testing.assert_allclose(merged_logits, ours, atol=1e-4)
    adapter_config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert adapter_config["r"] == 4
    assert adapter_config["lora_alpha"] == 16


@pytest.mark.integration
def test_lora_lm_stopped_and_resumed_matches_an_uninterrupted_run_bitwise(tmp_path: Path, tiny_llama: Path) -> None:
    """A run stopped after 3 of 6 steps (its final checkpoint) and resumed equals an uninterrupted run, bit for bit."""
    from ponente.trainer.checkpoint import discover_checkpoints

    constant = ("optimizer.lr_schedule=constant", "lora.dropout=0.1")  # a constant rate: the stop changes nothing
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    lora_lm.train(load_config(LoraLmConfig, overrides=_overrides(whole, tiny_llama, 6, *constant)))
    first = lora_lm.train(load_config(LoraLmConfig, overrides=_overrides(parts, tiny_llama, 3, *constant)))
    assert first.steps == 3
    second = lora_lm.train(load_config(LoraLmConfig, overrides=_overrides(parts, tiny_llama, 6, *constant)))
    assert second.resumed_from is not None
    assert second.resumed_from.endswith("step-3")
    assert losses(parts) == losses(whole)
    assert [s for s, _ in losses(parts)] == list(range(1, 7))
    cfg = load_config(LoraLmConfig, overrides=_overrides(whole, tiny_llama, 6))
    ckpt = [c.path for c in discover_checkpoints(whole / "ckpt" / "tiny") if c.step == 6]
    resumed = [c.path for c in discover_checkpoints(parts / "ckpt" / "tiny") if c.step == 6]
    _, a = _checkpoint_model(tiny_llama, cfg, str(ckpt[0]))
    _, b = _checkpoint_model(tiny_llama, cfg, str(resumed[0]))
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()


def _subprocess_run(directory: Path, overrides: list[str], devices: int) -> subprocess.CompletedProcess[str]:
    directory.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "JAX_PLATFORMS": "cpu"}
    args = [sys.executable, "-m", "ponente.trainer.main.lora_lm", *(f"--{o}" for o in overrides)]
    return subprocess.run(args, cwd=directory, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.multidevice
def test_lora_lm_on_8_devices_fsdp_and_tensor_parallel_matches_1_device(tmp_path: Path, tiny_llama: Path) -> None:
    from safetensors.numpy import load_file

    layouts = {
        "one": (1, []),
        "eight": (8, ["trainer.model_axis_size=2", "trainer.tensor_parallel_axes=[mlp, heads, kv_heads]"]),
    }
    for name, (devices, layout) in layouts.items():
        where = tmp_path / name
        # a small learning rate: Adam turns float rounding in near-zero gradients into steps of the learning rate
        proc = _subprocess_run(
            where, _overrides(where, tiny_llama, 3, "optimizer.learning_rate=1e-3", *layout), devices
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
    np.testing.assert_allclose(
        [loss for _, loss in losses(tmp_path / "eight")], [loss for _, loss in losses(tmp_path / "one")], atol=1e-5
    )
    one = load_file(tmp_path / "one" / "peft" / "adapter_model.safetensors")
    eight = load_file(tmp_path / "eight" / "peft" / "adapter_model.safetensors")
    assert sorted(one) == sorted(eight)
    for key, value in one.items():
        np.testing.assert_allclose(eight[key], value, atol=1e-5, err_msg=key)
