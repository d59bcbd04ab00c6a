"""``ponente-train-asr`` sharded over 8 simulated devices trains its first step like one device.

Run in the multidevice session (``XLA_FLAGS=--xla_force_host_platform_device_count=8``). The run goes through the
entry point (sharded batches, the step compiled before the data, evaluation and WER on the mesh, the export); the
reference is the same first batch trained by a one-device :class:`Trainer` with the same seed and optimizer.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import numpy as np
import pytest
from test_train_asr import safetensors_of, tiny_config

from ponente.trainer.data import batch_for_step, train_set
from ponente.trainer.data.synthetic_speech import write_synthetic_speech
from ponente.trainer.main import train_asr
from ponente.trainer.tasks.asr import whisper_batch, whisper_loss
from ponente.trainer.trainer import Trainer

pytestmark = pytest.mark.multidevice

LAYOUTS = {
    "fsdp": {},
    "fsdp_tp": {"model_axis_size": 2, "tensor_parallel_axes": ["mlp", "heads"]},
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_sharded_first_step_equals_one_device(name: str, tmp_path: Path) -> None:
    assert len(jax.devices()) == 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"
    digits = tmp_path / "digits"
    write_synthetic_speech(digits, train=16, validation=8, seed=5)
    config = tiny_config(digits, tmp_path, steps=1, hf_save_path=str(tmp_path / "hf"))
    trainer_config = dataclasses.replace(config.trainer, train_batch_size=8, **LAYOUTS[name])
    config = dataclasses.replace(config, trainer=trainer_config)
    result = train_asr.train(config)
    assert result.steps == 1
    assert "digits/wer" in result.eval_loss
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    sharded_loss = next(m["train/loss"] for m in logged if "train/loss" in m)

    # the reference: one device, the same initial state and the same first batch
    one = dataclasses.replace(trainer_config, model_axis_size=1, tensor_parallel_axes=[])
    trainer = Trainer(one, config.optimizer.build(1), whisper_loss, devices=jax.devices()[:1])
    model_config = config.model
    state = trainer.initial_state(lambda key: model_config.build(key=key))
    data = config.data
    rows = batch_for_step(train_set(data, 0, seed=trainer_config.seed), 0, 8)
    speech = data.format
    state, metrics = trainer.train_step(state, trainer.shard_batch(whisper_batch(rows, speech.n_mels, speech.frames)))
    np.testing.assert_allclose(sharded_loss, float(metrics["loss"]), rtol=0, atol=1e-5)

    exported = safetensors_of(tmp_path / "hf")
    reference = state.model.to_hf_state_dict()
    for key, value in exported.items():
        np.testing.assert_allclose(value, reference[key], atol=1e-5, err_msg=key)
