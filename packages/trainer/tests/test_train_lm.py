"""The ``train_lm`` entry point: configuration glue, the LM batch, provenance checks, and end-to-end runs."""

import importlib.metadata
import importlib.resources
import json
import subprocess
import sys
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ponente.namedtensor as hax
import ponente.trainer
from ponente.trainer.config import ConfigError, config_to_yaml, load_config
from ponente.trainer.data import data_tokenizer, data_vocab_size, validation_sets
from ponente.trainer.main import train_lm
from ponente.trainer.main.train_lm import TrainLmConfig, config_differences
from ponente.trainer.tasks.lm import lm_batch
from ponente.trainer.versions import PONENTE_PACKAGES

TOKENIZER = "package://ponente.trainer.assets/shakespeare_tokenizer.json"


def test_version_and_typing_marker():
    assert ponente.trainer.__version__ == importlib.metadata.version("ponente-trainer")
    assert importlib.resources.files("ponente.trainer").joinpath("py.typed").is_file()


def test_version_flag_prints_packages_and_devices(capsys):
    assert train_lm.main(["--version"]) == 0
    out = capsys.readouterr().out
    for name in PONENTE_PACKAGES:
        assert f"ponente-{name} {importlib.metadata.version(f'ponente-{name}')}" in out
    assert "JAX backend: cpu" in out


def test_no_training_data_is_a_clear_error():
    with pytest.raises(ValueError, match=r"data.train_urls is empty.*--config_path gpt2_nano"):
        train_lm.train(TrainLmConfig())


def test_packaged_hello_world_config_parses():
    cfg = load_config(TrainLmConfig, ["gpt2_nano"])
    assert cfg.model.model_type == "gpt2"
    assert cfg.trainer.num_train_steps == 300
    assert [t.choice_name for t in cfg.trainer.tracker] == ["tensorboard", "json"]
    assert cfg.data.tokenizer == TOKENIZER


def test_unknown_key_names_the_dotted_path():
    with pytest.raises(ConfigError, match=r"trainer\.num_trian_steps: unknown key; did you mean num_train_steps"):
        load_config(TrainLmConfig, ["gpt2_nano"], overrides=["trainer.num_trian_steps=3"])


def test_scan_layers_is_a_model_key():
    # Levanter's key: the layers unrolled in the compiled step (the model tests check the numerics)
    assert load_config(TrainLmConfig, ["gpt2_nano"]).model.scan_layers is True
    cfg = load_config(TrainLmConfig, ["gpt2_nano"], overrides=["model.scan_layers=false"])
    assert cfg.model.scan_layers is False
    with pytest.raises(ConfigError, match=r"model\.scan_layers"):
        load_config(TrainLmConfig, ["gpt2_nano"], overrides=["model.scan_layers=sometimes"])


def test_selective_gradient_checkpointing_is_a_model_key(tmp_path):
    # a list of the blocks' internals to keep (the model tests check what is kept and the gradients)
    cfg = load_config(TrainLmConfig, ["gpt2_nano"], overrides=["model.gradient_checkpointing=[attn_qkv, mlp_in]"])
    assert cfg.model.gradient_checkpointing == ("attn_qkv", "mlp_in")
    with pytest.raises(ConfigError, match=r"gradient_checkpointing: unknown internal name\(s\) \['mlp'\]"):
        load_config(TrainLmConfig, ["gpt2_nano"], overrides=["model.gradient_checkpointing=[attn_qkv, mlp]"])
    # a policy as a mapping: named internals kept on the device or moved to host memory; it survives the saved config
    policy = "{save_block_internals: [attn_qkv], offload_block_internals: [mlp_in]}"
    cfg = load_config(TrainLmConfig, ["gpt2_nano"], overrides=[f"model.gradient_checkpointing={policy}"])
    assert cfg.model.gradient_checkpointing == hax.ScanCheckpointPolicy(
        save_block_internals=["attn_qkv"], offload_block_internals=["mlp_in"]
    )
    saved = tmp_path / "config.yaml"
    saved.write_text(config_to_yaml(cfg))
    assert load_config(TrainLmConfig, [str(saved)]) == cfg


def test_hf_save_steps_needs_a_path():
    with pytest.raises(ConfigError, match="hf_save_steps is set but hf_save_path is not"):
        load_config(TrainLmConfig, overrides=["hf_save_steps=10"])


def _naive_loss_mask(segments: list[int]) -> list[float]:
    out = []
    for i in range(len(segments)):
        out.append(1.0 if i + 1 < len(segments) and segments[i + 1] == segments[i] else 0.0)
    return out


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=5, max_size=5), min_size=1, max_size=3))
def test_lm_batch_masks_predictions_across_documents(rows):
    segments = [sorted(r) for r in rows]  # segment ids are non-decreasing within a packed row
    ids = np.arange(len(rows) * 5).reshape(len(rows), 5)
    batch = lm_batch({"input_ids": ids, "segment_ids": np.array(segments)})
    assert batch["input_ids"].axis_names == ("batch", "position")
    assert batch["loss_mask"].array.tolist() == [_naive_loss_mask(s) for s in segments]


def test_config_differences_splits_fixed_and_free_keys():
    saved = {
        "config": {"data": {"tokenizer": "a"}, "trainer": {"seed": 0, "num_train_steps": 10, "id": "x"}},
        "num_devices": 8,
    }
    current = {
        "config": {"data": {"tokenizer": "b"}, "trainer": {"seed": 0, "num_train_steps": 20, "id": "y"}},
        "num_devices": 1,
    }
    fixed, other = config_differences(saved, current)
    assert fixed == ["data.tokenizer", "num_devices"]
    assert other == ["trainer.num_train_steps"]


# --- end to end ----------------------------------------------------------------------------------


@pytest.mark.integration
def test_train_lm_end_to_end_export_and_eval(tmp_path, tiny_lm_overrides):
    """Loss falls; logs, run record and checkpoint exist; the export loads in transformers with our logits."""
    import jax
    import torch
    import transformers

    import ponente.namedtensor as hax
    from ponente.models import AttentionMask
    from ponente.trainer.main.eval_lm import EvalLmConfig, eval_lm
    from ponente.trainer.main.export_lm_to_hf import (
        ExportLmToHfConfig,
        export_lm_to_hf,
        load_model_from_checkpoint,
    )

    overrides = tiny_lm_overrides(30)
    cfg = load_config(TrainLmConfig, overrides=[*overrides, "sample.num_tokens=8", "sample.prompt=KING"])
    result = train_lm.train(cfg)

    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train/loss"] for r in records if "train/loss" in r]
    assert [r["step"] for r in records if "train/loss" in r] == list(range(1, 31))
    assert np.mean(losses[-5:]) < losses[0] - 1.0, losses
    evals = [r for r in records if "eval/tiny/loss" in r or any(k.startswith("eval/") for k in r)]
    assert [r["step"] for r in evals] == [10, 20, 30]
    assert result.steps == 30
    assert result.final_loss == losses[-1]
    assert result.sample.startswith("KING")
    assert result.checkpoint.endswith("step-30")
    run_record = tmp_path / "runs" / "tiny"
    assert {"config.yaml", "pip_freeze.txt", "git.txt", "versions.json"} <= {p.name for p in run_record.iterdir()}

    # export the checkpoint, load it with transformers, compare logits with our model from the checkpoint
    out = tmp_path / "hf"
    export_lm_to_hf(
        ExportLmToHfConfig(checkpoint_path=result.checkpoint, output_dir=str(out), model=cfg.model, data=cfg.data)
    )
    ours = load_model_from_checkpoint(cfg.model, data_vocab_size(cfg.data), result.checkpoint)
    ids = np.random.default_rng(0).integers(0, data_vocab_size(cfg.data), size=(2, 32))
    expected = np.asarray(ours(hax.named(ids, ("batch", "position")), AttentionMask.causal()).array)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        got = hf_model(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(got, expected, atol=1e-4)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok("To be")["input_ids"] == data_tokenizer(cfg.data).encode("To be").ids

    # eval_lm: loss and bits/byte against a float64 NumPy computation over the same rows
    results = eval_lm(EvalLmConfig(data=cfg.data, model=cfg.model, checkpoint_path=result.checkpoint, batch_size=4))
    ((name, r),) = results.items()
    ds = validation_sets(cfg.data, 32)[name]
    rows = [ds[i] for i in range(4 * (len(ds) // 4))]
    ids = np.stack([row["input_ids"] for row in rows])
    seg = np.stack([row["segment_ids"] for row in rows])
    logits = np.asarray(
        ours(
            hax.named(ids, ("batch", "position")),
            AttentionMask.causal().with_segment_ids(hax.named(seg, ("batch", "position"))),
        ).array,
        dtype=np.float64,
    )
    logp = (
        logits
        - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
        - logits.max(-1, keepdims=True)
    )
    nats = tokens = nbytes = 0.0
    tokenizer = data_tokenizer(cfg.data)
    for b in range(ids.shape[0]):
        for i in range(ids.shape[1] - 1):
            if seg[b, i + 1] == seg[b, i]:
                nats -= logp[b, i, ids[b, i + 1]]
                tokens += 1
                nbytes += len(tokenizer.decode([int(ids[b, i + 1])]).encode("utf-8"))
    assert r.tokens == tokens
    assert r.bytes == nbytes
    np.testing.assert_allclose(r.loss, nats / tokens, rtol=1e-5)
    np.testing.assert_allclose(r.bits_per_byte, nats / np.log(2) / nbytes, rtol=1e-5)
    del jax


@pytest.mark.integration
def test_hello_world_runs_a_few_steps(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ponente.trainer.main.train_lm",
            "--config_path",
            "gpt2_nano",
            "--trainer.num_train_steps",
            "3",
            "--trainer.steps_per_eval",
            "3",
            "--trainer.max_eval_batches",
            "1",
            "--sample.num_tokens",
            "5",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "3 steps" in proc.stdout
    assert "sample:" in proc.stdout
    (run,) = (tmp_path / "ponente_hello" / "runs").iterdir()
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert (run / "config.yaml").is_file()
    assert "==" in (run / "pip_freeze.txt").read_text()  # the run record is written in a background thread
    # the start-up phases are logged once, at the first step
    (line,) = [line for line in proc.stderr.splitlines() if "first step done" in line]
    for phase in ("imports", "model and optimizer init", "[bg] train step compile", "[bg] run record"):
        assert phase in line
    assert (tmp_path / "ponente_hello" / "checkpoints" / run.name / "step-3" / "metadata.json").is_file()
    metrics = (run / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in metrics if "train/loss" in line] == [1, 2, 3]


LEVANTER_LLAMA_SMALL_FAST = """
data:
  train_urls:
    - "{train}"
  validation_urls:
    - "{validation}"
  cache_dir: "{cache}"
  tokenizer: "{tokenizer}"
model:
  type: llama
  hidden_dim: 768
  intermediate_dim: 2048
  num_heads: 12
  num_kv_heads: 12
  num_layers: 12
  seq_len: 1024
  gradient_checkpointing: true
trainer:
  tracker:
    - type: wandb
      project: "levanter"
      tags: [ "openwebtext", "llama", "itest"]

  mp: p=f32,c=bfloat16
  model_axis_size: 1
  per_device_parallelism: -1

  train_batch_size: 256
  num_train_steps: 20000
optimizer:
  learning_rate: 1E-3
  weight_decay: 0.1
  warmup: 0.01
"""


@pytest.mark.integration
def test_levanter_llama_small_fast_yaml_runs(tmp_path, monkeypatch, tiny_lm_overrides):
    """Levanter's llama_small_fast.yaml with local data paths parses as is and trains (shrunk to CPU size)."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    overrides = tiny_lm_overrides(1)
    train = next(o for o in overrides if o.startswith("data.train_urls=")).split("=", 1)[1].strip("[]")
    validation = next(o for o in overrides if o.startswith("data.validation_urls=")).split("=", 1)[1].strip("[]")
    path = tmp_path / "llama_small_fast.yaml"
    path.write_text(
        LEVANTER_LLAMA_SMALL_FAST.format(
            train=train, validation=validation, cache=tmp_path / "cache", tokenizer=TOKENIZER
        )
    )
    cfg = load_config(TrainLmConfig, [str(path)])
    assert cfg.model.model_type == "llama"
    assert cfg.model.gradient_checkpointing is True
    assert cfg.trainer.mp == "p=f32,c=bfloat16"
    assert cfg.trainer.train_batch_size == 256
    assert cfg.trainer.tracker[0].choice_name == "wandb"
    assert cfg.trainer.tracker[0].tags == (
        "openwebtext",
        "llama",
        "itest",
    )
    assert cfg.optimizer.learning_rate == 1e-3
    assert cfg.optimizer.warmup == 0.01
    # unchanged except what a 2-core CPU cannot run at full size
    shrink = ["--trainer.num_train_steps", "2", "--trainer.train_batch_size", "2", "--model.seq_len", "32",
              "--model.hidden_dim", "48", "--model.intermediate_dim", "64", "--model.num_layers", "2",
              "--model.num_heads", "4", "--model.num_kv_heads", "2", "--sample.num_tokens", "0"]  # fmt: skip
    assert train_lm.main(["--config_path", str(path), *shrink]) == 0
    assert list((tmp_path / "wandb").glob("offline-run-*"))


@pytest.mark.parametrize(
    "model_type",
    ["gpt2", "llama", "mistral", "mixtral", "qwen", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "olmo2"],
)
def test_every_architecture_is_selectable_by_type(model_type):
    from ponente.models import config_for_type

    cfg = load_config(TrainLmConfig, overrides=[f"model.type={model_type}"])
    assert type(cfg.model) is config_for_type(model_type)


def test_process_age_counts_from_the_process_start():
    code = "import time; time.sleep(0.5); from ponente.trainer.run._startup import process_age; print(process_age())"
    begun = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    elapsed = time.perf_counter() - begun
    age = float(out.stdout)
    # the child slept 0.5 s before it measured; it cannot be older than the time the parent waited for it
    # (/proc counts in clock ticks of 10 ms)
    assert 0.5 - 0.02 <= age <= elapsed + 0.02
