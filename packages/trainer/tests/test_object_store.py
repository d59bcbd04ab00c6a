"""Training on S3 end to end, against a real S3 API served locally (moto; see ``s3_support``).

Inputs, token cache, checkpoints and the Hugging Face export of a tiny ``train_lm`` run all live in the
bucket. An uninterrupted run is the reference; a second run is killed (``kill -9``) while a checkpoint's
arrays are in the bucket but before its commit, and resumed: the previous checkpoint stays loadable, the
resumed run starts from it and ends bitwise equal to the reference. Exports to the bucket and to a local
folder hold the same bytes, and the local one loads in ``transformers``.
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from conftest import TrainLmProcess, tiny_corpus, tiny_overrides, write_config
from s3_support import S3Bucket, s3_bucket_fixture  # noqa: F401  (the s3_bucket fixture)

import ponente.namedtensor as hax
from ponente.datacache.storage import StorageError, filesystem
from ponente.trainer.checkpoint import discover_checkpoints, latest_checkpoint_path, load_checkpoint, read_metadata
from ponente.trainer.checkpoint._io import SLOW_CHECKPOINT_ENV
from ponente.trainer.config import load_config
from ponente.trainer.data import data_vocab_size
from ponente.trainer.main.train_lm import TrainLmConfig
from ponente.trainer.tasks.lm import lm_loss_fn
from ponente.trainer.trainer import Trainer

STEPS = 6
EVERY = 2
TIMEOUT = 300.0


def _losses(directory: Path) -> list[tuple[int, float]]:
    path = directory / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines(keepends=True) if line.endswith("\n")]
    return [(r["step"], r["train/loss"]) for r in records if "train/loss" in r]


def _leaf_bytes(tree: Any) -> list[tuple[str, bytes]]:
    out = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        if isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
            host = np.asarray(leaf)
            out.append((f"{jax.tree_util.keystr(path)}:{host.dtype}{host.shape}", host.tobytes()))
    return out


def _state_template(overrides: list[str]) -> Any:
    cfg = load_config(TrainLmConfig, overrides=overrides)
    trainer = Trainer(cfg.trainer, cfg.optimizer.build(cfg.trainer.num_train_steps), lm_loss_fn(0.0, None))
    Vocab = hax.Axis("vocab", data_vocab_size(cfg.data))
    return trainer.initial_state(lambda key: cfg.model.build(Vocab, key=key))


def _committed(run_path: str) -> list[int]:
    return [c.step for c in discover_checkpoints(run_path) if c.committed]


@pytest.mark.integration
def test_train_checkpoint_kill_resume_and_export_on_s3(s3_bucket: S3Bucket, tmp_path: Path) -> None:
    # the corpus goes to the bucket; the runs read it from there (fsspec/s3fs) and cache it there
    train, validation = tiny_corpus(tmp_path)
    fs, _ = filesystem(s3_bucket.url())
    for path in (train, validation):
        fs.put_file(path, f"{s3_bucket.bucket}/raw/{Path(path).name}")

    def overrides(name: str, *extra: str) -> list[str]:
        directory = tmp_path / name
        directory.mkdir()
        remote = {
            "data.cache_dir": s3_bucket.url("cache"),
            "trainer.checkpointer.base_path": s3_bucket.url(f"{name}/ckpt"),
        }
        base = tiny_overrides(
            directory, s3_bucket.url("raw/train.jsonl"), s3_bucket.url("raw/validation.jsonl"), STEPS
        )
        out = [f"{k}={remote[k]}" if (k := o.partition("=")[0]) in remote else o for o in base]
        out += ["trainer.checkpointer.save_interval=1h", f"trainer.checkpointer.keep=[{{every: {EVERY}}}]"]
        out += ["trainer.progress_bar=false", *extra]
        write_config(directory, out)
        return out

    # 1. the reference: uninterrupted, exporting its final model to the bucket
    ref_overrides = overrides("reference", f"hf_save_path={s3_bucket.url('exports/reference')}")
    reference = TrainLmProcess(tmp_path / "reference", 0, timeout=TIMEOUT)
    assert reference.finish() == 0, reference.stderr()[-3000:]
    ref_run = s3_bucket.url("reference/ckpt/tiny")
    assert _committed(ref_run) == list(range(EVERY, STEPS + 1, EVERY))
    assert any(k.startswith("cache/") for k in s3_bucket.keys("cache/"))
    assert any(k.startswith("reference/ckpt/tiny/step-6/") for k in s3_bucket.keys("reference/"))
    assert not (tmp_path / "reference" / "cache").exists()
    assert not (tmp_path / "reference" / "ckpt").exists()
    template = _state_template(ref_overrides)
    ref_final = load_checkpoint(template, f"{ref_run}/step-{STEPS}")

    # 2. kill -9 while the second checkpoint's arrays are in the bucket but not committed
    overrides("interrupted")
    run_path = s3_bucket.url("interrupted/ckpt/tiny")
    first = TrainLmProcess(tmp_path / "interrupted", 1, env={SLOW_CHECKPOINT_ENV: "8"}, timeout=TIMEOUT)
    first.wait_until(
        lambda: first.stderr().count("waiting before the commit") >= 2 and _committed(run_path) == [EVERY],
        "a second checkpoint in flight",
    )
    first.proc.send_signal(signal.SIGKILL)
    assert first.finish() == -signal.SIGKILL
    found = discover_checkpoints(run_path)
    in_flight = [c.step for c in found if not c.committed]
    assert in_flight, found
    assert in_flight[-1] > EVERY, found
    assert any(k.startswith(f"interrupted/ckpt/tiny/step-{in_flight[-1]}/") for k in s3_bucket.keys("interrupted/"))
    previous = latest_checkpoint_path(run_path)
    assert previous == f"{run_path}/step-{EVERY}"
    assert (read_metadata(previous) or {}).get("step") == EVERY
    assert int(load_checkpoint(template, previous).step) == EVERY

    # 3. the next run resumes from it and ends where the reference did, bit for bit
    second = TrainLmProcess(tmp_path / "interrupted", 2, timeout=TIMEOUT)
    assert second.finish() == 0, second.stderr()[-3000:]
    assert f"resuming from {previous}" in second.stderr()
    assert _losses(tmp_path / "interrupted") == _losses(tmp_path / "reference")
    final = load_checkpoint(template, f"{run_path}/step-{STEPS}")
    assert _leaf_bytes(final) == _leaf_bytes(ref_final)

    # 4. export the resumed run's checkpoint (read from the bucket) to a local folder and to the bucket
    from ponente.trainer.main.export_lm_to_hf import ExportLmToHfConfig, export_lm_to_hf

    cfg = load_config(TrainLmConfig, overrides=ref_overrides)
    local = tmp_path / "export"
    for output in (str(local), s3_bucket.url("exports/resumed")):
        export_lm_to_hf(
            ExportLmToHfConfig(checkpoint_path=run_path, output_dir=output, model=cfg.model, data=cfg.data)
        )
    exported = {k.rpartition("/")[2] for k in s3_bucket.keys("exports/resumed/")}
    assert exported == {p.name for p in local.iterdir()}, exported
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= exported
    for name in ("model.safetensors", "config.json"):
        # the same model: the resumed run's export, the reference's end-of-training upload and the local folder
        with fs.open(f"{s3_bucket.bucket}/exports/resumed/{name}", "rb") as f:
            resumed = f.read()
        with fs.open(f"{s3_bucket.bucket}/exports/reference/{name}", "rb") as f:
            assert f.read() == resumed == (local / name).read_bytes(), name

    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(local)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, 8, data_vocab_size(cfg.data))
    assert bool(torch.isfinite(logits).all())


@pytest.mark.integration
def test_missing_bucket_is_one_line_naming_the_location(s3_bucket: S3Bucket) -> None:
    with pytest.raises(StorageError) as info:
        latest_checkpoint_path("s3://no-such-bucket/ckpt/run")
    assert str(info.value) == "listing s3://no-such-bucket/ckpt/run: the bucket does not exist"


def test_export_to_s3_without_s3fs_names_the_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import fsspec  # noqa: F401

    from ponente.trainer.run import export_hf

    implementations = sys.modules["fsspec.registry"]._registry
    monkeypatch.setitem(sys.modules, "s3fs", None)
    monkeypatch.delitem(implementations, "s3", raising=False)
    with pytest.raises(StorageError, match=r"^s3://bucket/hf: s3:// paths need s3fs: pip install .*\[s3\]"):
        export_hf(object(), "s3://bucket/hf", tokenizer=None, seq_len=8)  # fails before touching the model
