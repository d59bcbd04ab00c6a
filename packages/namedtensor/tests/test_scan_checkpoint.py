"""Tests for ``ScanCheckpointPolicy``: shortcuts, validation, nested groups, and what ``hax.scan`` keeps under it."""

import contextlib
import io

import jax
import pytest
from jax.ad_checkpoint import print_saved_residuals

import ponente.namedtensor as hax
from ponente.namedtensor import Axis, ScanCheckpointPolicy

T, E = Axis("time", 4), Axis("embed", 3)


def _scan_residuals(policy) -> list[str]:
    """The residuals that ``hax.scan`` under ``policy`` stacks for the backward pass (one line each)."""
    xs = hax.ones((T, E))

    def loss(w):
        def step(c, x):
            h = hax.tree_checkpoint_name(hax.sin(c * w + x), "h")
            return hax.cos(h) * w, None

        return hax.scan(step, T, remat=policy)(hax.ones(E), xs)[0].sum().scalar()

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        print_saved_residuals(loss, hax.ones(E))
    return [line for line in buf.getvalue().splitlines() if "output of scan" in line]


def test_shortcuts():
    assert ScanCheckpointPolicy.from_bool_or_str(False).disable
    assert ScanCheckpointPolicy.from_bool_or_str("none").disable
    save_all = ScanCheckpointPolicy.from_bool_or_str("save_all")
    assert (save_all.save_carries, save_all.save_inputs, save_all.save_block_internals) == (True, True, True)
    offload = ScanCheckpointPolicy.from_bool_or_str("offload")
    assert (offload.save_carries, offload.save_inputs) == ("offload", "offload")
    assert ScanCheckpointPolicy.from_bool_or_str(("a",)).save_block_internals == ("a",)
    with pytest.raises(TypeError):
        ScanCheckpointPolicy.from_bool_or_str(3)  # type: ignore[arg-type]


def test_invalid_policies_are_clear_errors():
    with pytest.raises(ValueError, match=r"write \['h'\]"):
        ScanCheckpointPolicy(offload_block_internals="h")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="nothing can be offloaded"):
        ScanCheckpointPolicy(save_block_internals=True, offload_block_internals=["h"])
    with pytest.raises(ValueError, match="positive int"):
        ScanCheckpointPolicy(nested=0)
    with pytest.raises(ValueError, match="3 groups do not divide 4"):
        ScanCheckpointPolicy(nested=3).nested_groups(4)


@pytest.mark.parametrize(
    ("n", "groups"), [(1, 1), (4, 2), (7, 1), (8, 2), (12, 3), (16, 4), (18, 3), (24, 4), (30, 5)]
)
def test_nested_groups_is_the_divisor_nearest_sqrt(n, groups):
    assert ScanCheckpointPolicy(nested=True).nested_groups(n) == groups
    assert ScanCheckpointPolicy(nested=2).nested_groups(8) == 2
    assert ScanCheckpointPolicy(nested=False).nested_groups(n) is None
    assert ScanCheckpointPolicy(nested=True, disable=True).nested_groups(n) is None


def test_what_scan_keeps_under_each_policy():
    everything = _scan_residuals(False)
    assert len(everything) >= 3  # carries and the step's internals
    assert len(_scan_residuals(True)) == 1  # only the carries (plus what enters the step)
    assert len(_scan_residuals(ScanCheckpointPolicy(save_block_internals=["h"]))) == 2
    assert len(_scan_residuals(ScanCheckpointPolicy(save_block_internals=["other"]))) == 1
    assert len(_scan_residuals("save_all")) == len(everything)
    offloaded = _scan_residuals(ScanCheckpointPolicy(offload_block_internals=["h"]))
    assert len(offloaded) == 2
    assert sum("<host>" in line.split(" ")[0] for line in offloaded) == 1
    nested = _scan_residuals("nested")  # 4 steps -> 2 groups: 2 carries kept, not 4
    assert [line.split(" ")[0] for line in nested] == ["f32[2,3]"]


def test_policy_jit_and_grad_agree_with_no_checkpointing():
    xs = hax.random.normal(jax.random.key(0), (T, E))

    def loss(w, policy):
        def step(c, x):
            return hax.tanh(c * w + x), None

        return hax.scan(step, T, remat=policy)(hax.ones(E), xs)[0].sum().scalar()

    reference = jax.grad(loss)(0.7, False)
    for policy in [True, "nested", "offload", ScanCheckpointPolicy(simple=True), ScanCheckpointPolicy(nested=4)]:
        assert jax.jit(jax.grad(loss), static_argnums=1)(0.7, policy) == pytest.approx(float(reference), rel=1e-5)
