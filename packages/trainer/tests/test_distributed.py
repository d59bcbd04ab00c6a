"""DistributedConfig / RayConfig: detection, validation, no-op on one host; config keys parse; vocab rounding."""

import dataclasses

import optax
import pytest

from ponente.models import LlamaConfig
from ponente.trainer.config import load_config
from ponente.trainer.distributed import DistributedConfig, RayConfig, barrier
from ponente.trainer.main.train_lm import TrainLmConfig
from ponente.trainer.run import pad_vocab_for_partitioning
from ponente.trainer.trainer import Trainer, TrainerConfig

SLURM = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_PROCID": "1"}


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, False),
        (SLURM, True),
        (SLURM | {"SLURM_NTASKS": "1"}, False),
        ({"OMPI_COMM_WORLD_SIZE": "2"}, True),
        ({"OMPI_COMM_WORLD_SIZE": "1"}, False),
    ],
)
def test_multi_process_is_detected_from_the_environment(env, expected):
    assert DistributedConfig().is_multi_process(env=env) is expected
    assert DistributedConfig(auto=False).is_multi_process(env=env) is False
    assert DistributedConfig(num_processes=1).is_multi_process(env=env) is False


def test_explicit_fields_mean_multi_process_and_are_validated():
    assert DistributedConfig(coordinator_address="h:1", num_processes=2, process_id=1).is_multi_process(env={})
    with pytest.raises(ValueError, match=r"process_id=2 is not below trainer\.distributed\.num_processes=2"):
        DistributedConfig(num_processes=2, process_id=2)
    with pytest.raises(ValueError, match="heartbeat_timeout_seconds must be >= 1"):
        DistributedConfig(heartbeat_timeout_seconds=0)


def test_initialize_is_a_no_op_on_one_host_and_partial_settings_are_an_error(monkeypatch):
    for key in SLURM:
        monkeypatch.delenv(key, raising=False)
    assert DistributedConfig().initialize() is False
    barrier("single process: returns at once")
    with pytest.raises(ValueError, match="num_processes=2 are set but coordinator_address, process_id are not"):
        DistributedConfig(num_processes=2).initialize()


def test_ray_address_comes_from_the_config_then_the_environment():
    assert RayConfig(address="10.0.0.1:6379").resolved_address(env={"RAY_ADDRESS": "x"}) == "10.0.0.1:6379"
    assert RayConfig().resolved_address(env={"RAY_ADDRESS": "10.0.0.2:6379"}) == "10.0.0.2:6379"
    assert RayConfig().resolved_address(env={}) is None


def test_scaling_keys_parse_from_the_command_line():
    cfg = load_config(
        TrainLmConfig,
        overrides=[
            "trainer.replica_axis_size=2",
            "trainer.distributed.coordinator_address=10.0.0.1:8476",
            "trainer.distributed.num_processes=4",
            "trainer.distributed.process_id=3",
            "trainer.ray.head_port=7000",
            "trainer.tensor_parallel_axes=[mlp, heads]",
        ],
    )
    assert cfg.trainer.replica_axis_size == 2
    assert cfg.trainer.distributed == DistributedConfig(
        coordinator_address="10.0.0.1:8476", num_processes=4, process_id=3
    )
    assert cfg.trainer.ray.head_port == 7000
    assert cfg.trainer.compute_axis_mapping == {"batch": ("replica", "data"), "mlp": "model", "heads": "model"}


@pytest.mark.parametrize(
    ("trainer", "devices", "multiple", "expected"),
    [
        ({}, 8, 1, 1),  # vocab not split
        ({"tensor_parallel_axes": ["vocab"], "model_axis_size": 4}, 8, 1, 4),
        ({"tensor_parallel_axes": ["vocab"], "model_axis_size": 4}, 8, 6, 12),
        ({"fsdp_axis": ["embed", "vocab"], "model_axis_size": 2}, 8, 1, 4),  # data axis = 8 / 2
        ({"fsdp_axis": "vocab", "replica_axis_size": 2}, 8, 3, 12),  # data axis = 8 / 2, lcm(3, 4)
    ],
)
def test_vocab_is_padded_to_divide_over_its_shards(trainer, devices, multiple, expected):
    model = LlamaConfig(vocab_padding_multiple=multiple)
    padded = pad_vocab_for_partitioning(model, TrainerConfig(**trainer), devices)
    assert padded.vocab_padding_multiple == expected
    assert dataclasses.replace(padded, vocab_padding_multiple=multiple) == model


def test_one_process_loads_every_row():
    trainer = Trainer(TrainerConfig(train_batch_size=4, compilation_cache_dir=None), optax.sgd(0.1), lambda *a, **k: 0)
    assert trainer.process_batch_rows() == slice(0, 4)
    assert trainer.process_batch_rows(12) == slice(0, 12)
