"""Tests for named ``vmap``, ``scan``, ``fold``, ``map`` and ``jit``."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ponente.namedtensor as hax
from ponente.namedtensor import Axis, NamedArray

B, E, T = Axis("batch", 3), Axis("embed", 4), Axis("time", 5)


def _rand(axes, seed=0):
    raw = np.random.default_rng(seed).standard_normal(tuple(a.size for a in axes)).astype(np.float32)
    return NamedArray(jnp.asarray(raw), tuple(axes))


def test_vmap_maps_named_axis_and_broadcasts_the_rest():
    x = _rand((E, B))  # the mapped axis is not first
    w = _rand((E,), 1)
    plain = jnp.arange(3.0)  # plain arrays map along dimension 0

    def f(row, w, scalar, offset):
        assert row.axes == (E,)
        assert w.axes == (E,)
        return {"y": hax.dot(row, w, axis="embed") * scalar + offset, "tag": "kept"}

    out = hax.vmap(f, "batch")(x, w, 2.0, offset=plain)
    assert out["tag"] == "kept"
    assert out["y"].axes == (B,)
    expected = np.asarray(x.array).T @ np.asarray(w.array) * 2.0 + np.arange(3.0)
    np.testing.assert_allclose(out["y"].array, expected, rtol=1e-5)


def test_vmap_puts_axis_first_and_supports_several_axes():
    x = _rand((E, B, T))
    out = hax.vmap(lambda v: v * 2, B)(x)
    assert out.axes == (B, E, T)
    np.testing.assert_allclose(out.array, np.transpose(np.asarray(x.array), (1, 0, 2)) * 2)
    out = hax.vmap(lambda v: v.array.sum(), ("time", "batch"))(x)
    np.testing.assert_allclose(out, np.asarray(x.array).sum(0).T, rtol=1e-5)
    with pytest.raises(ValueError, match="no argument has axis 'missing'"):
        hax.vmap(lambda v: v, "missing")(x)


def test_vmap_grad_jit_roundtrip():
    x = _rand((B, E))
    w = _rand((E,), 1)

    def loss(w):
        per_row = hax.vmap(lambda row: hax.dot(row, w, axis="embed") ** 2, "batch")(x)
        return per_row.array.sum()

    grad = jax.jit(jax.grad(loss))(w)
    xr, wr = np.asarray(x.array, np.float64), np.asarray(w.array, np.float64)
    np.testing.assert_allclose(grad.array, 2 * xr.T @ (xr @ wr), rtol=1e-4)


def test_scan_matches_python_loop():
    xs = _rand((E, T))
    init = NamedArray(jnp.zeros(4), (E,))

    def step(carry, x_t, decay):
        new = carry * decay + x_t
        return new, {"state": new, "norm": (new.array**2).sum()}

    final, ys = hax.scan(step, "time")(init, xs, 0.5)
    carry = np.zeros(4)
    states = []
    for t in range(5):
        carry = carry * 0.5 + np.asarray(xs.array)[:, t]
        states.append(carry)
    np.testing.assert_allclose(final.array, carry, rtol=1e-5)
    assert ys["state"].axes == (T, E)
    np.testing.assert_allclose(ys["state"].array, np.stack(states), rtol=1e-5)
    np.testing.assert_allclose(ys["norm"], (np.stack(states) ** 2).sum(1), rtol=1e-5)


def test_scan_reverse_unroll_and_remat_give_same_gradients():
    xs = _rand((T, E))

    def loss(w, **options):
        def step(c, x_t):
            return jnp.tanh(c * w + x_t.array), None

        return hax.scan(step, T, **options)(jnp.zeros(4), xs)[0].sum()

    reference = jax.grad(loss)(0.3)
    for options in ({"remat": True}, {"remat": "nothing_saveable"}, {"unroll": 2}):
        np.testing.assert_allclose(jax.grad(loss)(0.3, **options), reference, rtol=1e-5)
    forward = hax.scan(lambda c, x: (c + 1, c), T)(0, xs)[1]
    backward = hax.scan(lambda c, x: (c + 1, c), T, reverse=True)(0, xs)[1]
    np.testing.assert_array_equal(backward, forward[::-1])
    with pytest.raises(ValueError, match="remat="):
        hax.scan(lambda c, x: (c, None), T, remat="no_such_policy")(0, xs)


def test_fold_and_map():
    xs = _rand((T, E))
    total = hax.fold(lambda acc, x: acc + x, "time")(NamedArray(jnp.zeros(4), (E,)), xs)
    np.testing.assert_allclose(total.array, np.asarray(xs.array).sum(0), rtol=1e-5)
    doubled = hax.map(lambda x: x * 2, "time")(xs)
    assert doubled.axes == (T, E)
    np.testing.assert_allclose(doubled.array, np.asarray(xs.array) * 2)


class _Linear(eqx.Module):
    weight: NamedArray
    In: Axis = eqx.field(static=True)

    def __call__(self, x):
        return hax.dot(x, self.weight, axis=self.In)


def test_jit_accepts_modules_and_static_values():
    layer = _Linear(_rand((E, Axis("out", 2))), E)
    x = _rand((B, E), 1)
    calls = []

    @hax.jit
    def apply(layer, x, scale, name):
        calls.append(name)
        return layer(x) * scale

    out = apply(layer, x, jnp.asarray(3.0), "first")
    np.testing.assert_allclose(out.array, np.asarray(x.array) @ np.asarray(layer.weight.array) * 3.0, rtol=1e-5)
    apply(layer, x, jnp.asarray(4.0), "first")  # a new array value is traced: no retrace
    assert calls == ["first"]
    apply(layer, x, jnp.asarray(4.0), "second")  # a new string is static: retrace
    assert calls == ["first", "second"]
    donated = hax.jit(donate="none")(lambda x: x + 1)
    np.testing.assert_allclose(donated(x).array, np.asarray(x.array) + 1)


def test_is_scanned_chooses_which_arrays_are_sliced():
    xs = _rand((T, E))
    table = jnp.arange(5.0 * 2).reshape(5, 2)  # a plain array with the scanned length, but kept whole

    def step(c, x_t, table):
        return c + x_t.array.sum() + table.sum(), table.shape

    total, shapes = hax.scan(step, T, is_scanned=hax.is_named_array)(0.0, xs, table)
    np.testing.assert_allclose(total, np.asarray(xs.array).sum() + 5 * np.asarray(table).sum(), rtol=1e-5)
    assert shapes == (5, 2)
    sliced = hax.map(lambda row: row.sum(), T, is_mapped=True)(table)
    np.testing.assert_allclose(sliced, np.asarray(table).sum(1))
    total = hax.fold(lambda c, x_t, table: c + table.sum(), T, is_scanned=False)(0.0, xs, table)
    np.testing.assert_allclose(total, 5 * np.asarray(table).sum(), rtol=1e-5)


def test_scan_length_errors_name_the_argument_and_field():
    class Weights(eqx.Module):
        w: jax.Array

    def step(c, x_t, layer, *extra):
        return c, None

    good = jnp.zeros((T.size, 2))
    with pytest.raises(ValueError) as e:
        hax.scan(step, T)(0.0, good, Weights(jnp.zeros((T.size - 1, 2))), good, jnp.zeros((2, 2)))
    assert "layer.w has leading dimension 4" in str(e.value)
    assert "extra[1] has leading dimension 2" in str(e.value)
    assert "x_t" not in str(e.value)
    with pytest.raises(ValueError, match=r"\['k'\] has leading dimension 1"):
        hax.fold(lambda c, d: c, T)(0.0, d={"k": jnp.zeros(1)})


def test_scan_step_must_return_a_pair():
    with pytest.raises(ValueError, match="pair"):
        hax.scan(lambda c, x_t: c + x_t, T)(hax.zeros(E), _rand((T, E)))


@pytest.mark.parametrize("remat", [True, "nested", hax.ScanCheckpointPolicy(nested=5), ["h"], "dots_saveable"])
def test_remat_policies_keep_values_and_gradients(remat):
    xs = _rand((T, E))

    def loss(w, **options):
        def step(c, x_t):
            h = hax.tree_checkpoint_name(jnp.tanh(c * w + x_t.array), "h")
            return h, h.sum()

        carry, ys = hax.scan(step, T, **options)(jnp.zeros(4), xs)
        return carry.sum() + ys.sum()

    # the reference: a plain Python loop
    def loop(w):
        c, total = jnp.zeros(4), 0.0
        for t in range(T.size):
            c = jnp.tanh(c * w + xs.array[t])
            total = total + c.sum()
        return c.sum() + total

    np.testing.assert_allclose(loss(0.3, remat=remat), loop(0.3), rtol=1e-5)
    np.testing.assert_allclose(jax.grad(loss)(0.3, remat=remat), jax.grad(loop)(0.3), rtol=1e-5)
