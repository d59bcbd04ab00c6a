"""Peak FLOP/s lookup by device kind and the MFU arithmetic."""

import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ponente.models import Gpt2Config, LlamaConfig
from ponente.trainer.mfu import DEVICE_PEAK_FLOPS, device_peak_flops, mfu, training_flops


@pytest.mark.parametrize(
    ("kind", "dtype", "expected"),
    [
        ("NVIDIA H100 80GB HBM3", "bfloat16", 989.4e12),
        ("NVIDIA H100 PCIe", "bf16", 756.5e12),
        ("NVIDIA H100 NVL", "bf16", 835.5e12),
        ("NVIDIA H200", "bfloat16", 989.4e12),
        ("NVIDIA A100-SXM4-40GB", "bfloat16", 312e12),
        ("NVIDIA A100 80GB PCIe", "float32", 156e12),
        ("NVIDIA A10G", "bf16", 125e12),
        ("NVIDIA L4", "bfloat16", 121e12),
        ("Tesla V100-SXM2-16GB", "float16", 125e12),
        ("Tesla V100-SXM2-16GB", "fp32", 15.7e12),
        ("TPU v4", "bfloat16", 275e12),
        ("TPU v5 lite", "bfloat16", 197e12),
        ("TPU v5e", "bfloat16", 197e12),
        ("TPU v5", "bfloat16", 459e12),
        ("TPU v5p", "bfloat16", 459e12),
        ("TPU v6 lite", "bfloat16", 918e12),
    ],
)
def test_known_devices(kind, dtype, expected):
    assert device_peak_flops(kind, dtype) == expected


def test_every_table_entry_is_reachable_from_some_device_kind():
    kinds = ["h100 hbm3", "h100 pcie", "h100 nvl", "h200", "a100", "a10g", "l4", "v100"]
    kinds += ["tpu v4", "tpu v5 lite", "tpu v5p", "tpu v6 lite"]
    from ponente.trainer.mfu import _table_key

    assert {_table_key(k) for k in kinds} == set(DEVICE_PEAK_FLOPS)


def test_unknown_device_or_dtype_gives_none_with_a_note(caplog):
    with caplog.at_level(logging.INFO, logger="ponente.trainer.mfu"):
        assert device_peak_flops("cpu", "float32") is None
        assert device_peak_flops("TPU v4", "float32") is None
        assert device_peak_flops("Some Future Chip", "bfloat16") is None
    assert "'cpu'" in caplog.text
    assert "fp32" in caplog.text
    assert "Some Future Chip" in caplog.text


def test_default_device_on_cpu_is_unknown():
    assert device_peak_flops() is None


def test_bad_dtype_is_an_error():
    with pytest.raises(ValueError, match="unknown dtype 'int4'"):
        device_peak_flops("TPU v4", "int4")


@settings(max_examples=30, deadline=None)
@given(
    fpt=st.floats(1.0, 1e12),
    tokens=st.integers(1, 10**7),
    seconds=st.floats(1e-3, 1e3),
    peak=st.floats(1e9, 1e16),
    devices=st.integers(1, 512),
)
def test_mfu_is_useful_flops_over_available_flops(fpt, tokens, seconds, peak, devices):
    hand = (fpt * tokens + 2 * fpt * tokens) / (seconds * peak * devices)  # forward + backward (2 forwards)
    assert mfu(fpt, tokens, seconds, peak, devices) == pytest.approx(hand, rel=1e-12)
    assert training_flops(fpt, tokens) == pytest.approx(3 * fpt * tokens, rel=1e-12)


def test_mfu_rejects_nonpositive_inputs():
    with pytest.raises(ValueError, match="must be positive"):
        mfu(1.0, 1, 0.0, 1e12)


def test_flops_per_token_matches_a_hand_count():
    # Llama: 2 layers, d=16, mlp=32, 4 heads of 4 (2 kv heads), seq 8, vocab 13
    cfg = LlamaConfig(seq_len=8, hidden_dim=16, intermediate_dim=32, num_layers=2, num_heads=4, num_kv_heads=2)
    q, kv, d = 16, 8, 16
    per_layer = 2 * d * q + 2 * 2 * d * kv + 2 * q * d + 2 * 2 * 8 * q + 3 * 2 * d * 32
    assert cfg.flops_per_token(13) == 2 * per_layer + 2 * d * 13
    gpt = Gpt2Config(seq_len=8, hidden_dim=16, intermediate_dim=64, num_layers=1, num_heads=2, num_kv_heads=2)
    per_layer = 4 * 2 * 16 * 16 + 2 * 2 * 8 * 16 + 2 * 2 * 16 * 64
    assert gpt.flops_per_token(10) == per_layer + 2 * 16 * 10
