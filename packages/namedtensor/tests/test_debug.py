"""Tests for ``debug``: ``describe_array``, ``diagnose_common_issues``, ``visualize_shardings``."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ponente.namedtensor.partitioning as P
from ponente.namedtensor import Axis, NamedArray
from ponente.namedtensor.debug import ModuleProblems, describe_array, diagnose_common_issues, visualize_shardings


def test_named_array_statistics_match_numpy():
    raw = np.array([[1.0, -2.0, 5.0], [np.nan, np.inf, 0.5]], dtype=np.float32)
    text = describe_array(NamedArray(jnp.asarray(raw), (Axis("batch", 2), Axis("embed", 3))))
    finite = raw[np.isfinite(raw)].astype(np.float64)
    assert text.startswith("NamedArray(batch=2, embed=3, dtype=float32")
    for stat in ("min", "max", "mean", "std"):
        assert f"{stat}={getattr(finite, stat)():.4g}" in text
    assert "nan=1" in text
    assert "inf=1" in text


def test_plain_empty_and_traced():
    assert describe_array(np.zeros((2, 0))).endswith("shape=(2, 0), dtype=float64, empty)")
    assert "shape=(), dtype=int32, min=3, max=3" in describe_array(jnp.asarray(3))
    seen = []
    jax.jit(lambda x: seen.append(describe_array(x)) or x)(NamedArray(jnp.ones(2), (Axis("b", 2),)))
    assert seen == ["NamedArray(b=2, dtype=float32, traced)"]
    assert "dtype=bool" in describe_array(np.array([True, False]))


class Pair(eqx.Module):
    a: jax.Array
    b: NamedArray
    frozen: jax.Array | None = eqx.field(static=True, default=None)


class Holder(eqx.Module):
    pairs: list
    c: jax.Array


def test_diagnose_finds_reused_and_static_arrays_with_their_paths():
    w = jnp.zeros(2)
    named = NamedArray(w, (Axis("x", 2),))  # another NamedArray object, but the same buffer
    with pytest.warns(UserWarning, match="set as static"):  # equinox warns about an array in a static field
        frozen = Pair(jnp.ones(1), NamedArray(jnp.ones(1), (Axis("y", 1),)), frozen=jnp.ones(3))
    with pytest.raises(ModuleProblems) as info:
        diagnose_common_issues(Holder([Pair(w, named), frozen], w))
    problems = info.value
    assert [paths for _, paths in problems.reused_arrays] == [[".pairs[0].a", ".pairs[0].b", ".c"]]
    assert problems.static_arrays == [".pairs[1].frozen"]
    assert "stored at 3 places" in str(problems)
    assert "static field .pairs[1].frozen" in str(problems)


def test_diagnose_accepts_a_clean_module_and_problems_are_falsy_when_empty():
    diagnose_common_issues(Holder([Pair(jnp.zeros(1), NamedArray(jnp.zeros(1), (Axis("x", 1),)))], jnp.zeros(1)))
    assert not ModuleProblems()


def test_visualize_shardings_prints_each_axis_and_the_shard_shape(capsys):
    n = len(jax.devices())
    mesh = P.make_mesh({"data": -1})
    with jax.set_mesh(mesh):
        tree = P.shard(
            {"w": NamedArray(jnp.ones((n, 2 * n)), (Axis("batch", n), Axis("embed", 2 * n))), "k": 1},
            {"batch": "data"},
        )
        visualize_shardings(tree)
        visualize_shardings(jnp.ones(2))
        jax.jit(lambda t: visualize_shardings(P.shard(t, {"embed": "data"})))(tree["w"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"['w']: batch({n})->data, embed({2 * n})->unsharded; shard (1, {2 * n}) on {n} device(s)"
    assert lines[1].startswith("<root>: dim0(2)->unsharded; shard (2,)")
    inside = "data" if n > 1 else "unsharded"  # on one device, XLA reports every sharding as unsharded
    assert lines[2].startswith(f"<root>: batch({n})->unsharded, embed({2 * n})->{inside}")
