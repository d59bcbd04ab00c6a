"""FP8 delayed scaling: quantization vs an ml_dtypes reference, state overwrites, training with moving scales."""

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import ponente.namedtensor as hax
from ponente.namedtensor import Axis, nn
from ponente.namedtensor import quantization as q

In, Out, B = Axis("in", 8), Axis("out", 4), Axis("b", 16)


class _Block(eqx.Module):
    up_proj: nn.Linear
    down_proj: nn.Linear


def _block(key):
    k1, k2 = jax.random.split(key)
    return _Block(nn.Linear.init(In, Axis("mid", 6), key=k1), nn.Linear.init(Axis("mid", 6), Out, key=k2))


def test_targets_select_layers_by_name_or_regex():
    model = {"blocks": [_block(jax.random.key(0)), _block(jax.random.key(1))]}
    by_name = q.quantize_linear_layers(model, q.QuantizationConfig(targets=["up_proj"], fp8=True))
    kinds = [(type(b.up_proj.dot_general), type(b.down_proj.dot_general)) for b in by_name["blocks"]]
    assert kinds == [(q.Fp8DotGeneralOp, q.DefaultDotGeneralOp)] * 2
    by_path = q.quantize_linear_layers(model, q.QuantizationConfig(targets=["blocks.1.down_proj"], fp8=True))
    assert isinstance(by_path["blocks"][1].down_proj.dot_general, q.Fp8DotGeneralOp)
    assert isinstance(by_path["blocks"][0].down_proj.dot_general, q.DefaultDotGeneralOp)
    by_regex = q.quantize_linear_layers(model, q.QuantizationConfig(targets=r".*_proj", fp8=True))
    assert all(isinstance(b.down_proj.dot_general, q.Fp8DotGeneralOp) for b in by_regex["blocks"])
    with pytest.raises(ValueError, match="fp8=True"):
        q.quantize_linear_layers(model, q.QuantizationConfig())


def test_stacked_linear_gets_one_state_per_layer():
    Layers = Axis("layers", 3)
    keys = jax.random.split(jax.random.key(0), 3)
    layers = [nn.Linear.init(In, In.alias("in2"), key=k) for k in keys]
    layers = [
        nn.Linear(lin.weight * (i + 1), lin.bias, In, In.alias("in2"), lin.dot_general) for i, lin in enumerate(layers)
    ]
    stacked = nn.Linear(
        hax.stack(Layers, [lin.weight for lin in layers]),
        hax.stack(Layers, [lin.bias for lin in layers]),
        In,
        In.alias("in2"),
        layers[0].dot_general,
    )
    stacked = q.quantize_linear_layers(stacked, q.QuantizationConfig(amax_history_length=2, fp8=True))
    assert stacked.dot_general.kernel_amax_history.shape == (3, 2)
    assert stacked.dot_general.kernel_scale.shape == (3, 1)
    x = hax.random.normal(jax.random.key(1), (B, In))

    def loss(model):
        def body(h, layer):
            return layer(h).rename({"in2": "in"})

        return hax.sum(hax.fold(body, Layers)(x, model) ** 2).scalar()

    grads = eqx.filter_grad(loss)(stacked)
    overwrites, _ = q.partition_for_grad_overwrite(grads)
    kernel_hist = np.asarray(overwrites.dot_general.kernel_amax_history)
    expected = [float(jnp.abs(lin.weight.array).max()) for lin in layers]
    np.testing.assert_allclose(kernel_hist[:, 0], expected, rtol=1e-6)
    np.testing.assert_array_equal(kernel_hist[:, 1], 0)
    with pytest.raises(ValueError, match="stacked dimensions"):
        stacked(x)


def test_forward_is_quantize_dequantize_with_history_scale():
    op = q.Fp8DotGeneralOp.init(amax_history_length=4)
    # put a known history in: the scale used is max(history) / fp8_max
    op = eqx.tree_at(
        lambda o: (o.input_amax_history, o.kernel_amax_history),
        op,
        (jnp.array([2.0, 5.0, 0.0, 0.0]), jnp.array([1.0, 0.0, 0.0, 0.0])),
    )
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 8)).astype(np.float32) * 3
    w = rng.standard_normal((8, 4)).astype(np.float32)
    e4m3_max = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)

    def qdq(a, amax):
        s = np.float32(amax / e4m3_max)
        return np.clip(a / s, -e4m3_max, e4m3_max).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * s

    ref = qdq(x, 5.0) @ qdq(w, 1.0)
    out = op(jnp.asarray(x), jnp.asarray(w), (((1,), (0,)), ((), ())))
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    assert not np.allclose(out, x @ w, rtol=1e-6, atol=1e-6)  # quantization really happened


def test_gradient_of_state_is_its_new_value():
    lin = q.quantize_linear_layers(
        nn.Linear.init(In, Out, key=jax.random.key(0)), q.QuantizationConfig(amax_history_length=3, fp8=True)
    )
    x = hax.random.normal(jax.random.key(1), (B, In)) * 4.0
    grads = eqx.filter_grad(lambda m: hax.sum(m(x) ** 2).scalar())(lin)
    overwrites, plain = q.partition_for_grad_overwrite(grads)
    new_op = overwrites.dot_general
    np.testing.assert_allclose(new_op.input_amax_history, [float(jnp.abs(x.array).max()), 0, 0], rtol=1e-6)
    np.testing.assert_allclose(new_op.kernel_amax_history[0], float(jnp.abs(lin.weight.array).max()), rtol=1e-6)
    assert float(new_op.output_grad_amax_history[0]) > 0
    # empty history: the scale keeps its old value this step
    assert new_op.input_scale.tolist() == [1.0]
    assert plain.dot_general is None
    assert overwrites.weight.array is None
    updated = q.apply_updates(lin, jax.tree_util.tree_map(lambda g: -0.0 * g, plain), overwrites)
    np.testing.assert_array_equal(updated.weight.array, lin.weight.array)
    np.testing.assert_array_equal(updated.dot_general.input_amax_history, new_op.input_amax_history)


def test_quantized_linear_trains_and_scales_move():
    key = jax.random.key(0)
    kx, kw, kl = jax.random.split(key, 3)
    x = hax.random.normal(kx, (B, In))
    true_w = hax.random.normal(kw, (In, Out))
    y = hax.dot(x, true_w, axis="in")
    model = q.quantize_linear_layers(
        nn.Linear.init(In, Out, key=kl), q.QuantizationConfig(amax_history_length=4, fp8=True)
    )

    def loss_fn(m):
        return hax.mean((m(x) - y) ** 2).scalar()

    @eqx.filter_jit
    def step(m):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(m)
        overwrites, grads = q.partition_for_grad_overwrite(grads)
        updates = jax.tree_util.tree_map(lambda g: -0.1 * g, grads)
        return q.apply_updates(m, updates, overwrites), loss

    losses = []
    for _ in range(30):
        model, loss = step(model)
        losses.append(float(loss))
    op = model.dot_general
    assert losses[-1] < 0.2 * losses[0]
    for scale in (op.input_scale, op.kernel_scale, op.output_grad_scale):
        assert float(scale[0]) != 1.0
        assert np.isfinite(float(scale[0]))
    e4m3_max = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)
    np.testing.assert_allclose(float(op.input_scale[0]), float(jnp.abs(x.array).max()) / e4m3_max, rtol=1e-5)


def test_compute_scale_matches_formula():
    amax = jnp.array([0.0, 3.0, jnp.inf, 896.0])
    old = jnp.full((4,), 5.0)
    got = np.asarray(q.compute_scale(amax, old, 448.0, margin=1))
    np.testing.assert_allclose(got, [5.0, 3.0 / 448.0 * 2, 5.0, 4.0], rtol=1e-6)


def test_amax_history_is_a_window_of_the_last_maxima():
    # after every step the history holds exactly the last n maxima (slot 0 the newest), whatever the order
    op = q.Fp8DotGeneralOp.init(amax_history_length=3)
    lin = nn.Linear.init(In, Out, key=jax.random.key(0), dot_general=op)
    seen = []
    for step in range(5):
        x = hax.ones((B, In)) * float(step + 1)
        grads = eqx.filter_grad(lambda m, x=x: hax.sum(m(x)).scalar())(lin)
        overwrites, _ = q.partition_for_grad_overwrite(grads)
        lin = q.apply_updates(lin, None, overwrites)
        seen.append(float(step + 1))
        hist = np.asarray(lin.dot_general.input_amax_history)
        assert hist[0] == seen[-1]
        window = (seen[-3:] + [0.0] * 3)[:3]
        assert sorted(hist.tolist()) == sorted(window)


def _int8_reference(x, w):
    """Per-row (x) and per-column (w) symmetric int8 quantization, then a float product (NumPy)."""

    def qdq(a, axis):
        s = np.abs(a).max(axis=axis, keepdims=True) / 127.0
        s = np.where(s > 0, s, 1.0)
        return np.clip(np.round(a / s), -127, 127) * s

    return qdq(x, 1) @ qdq(w, 0)


def test_int8_product_matches_numpy_reference_and_differs_from_float():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 16)).astype(np.float32)
    w = rng.standard_normal((16, 3)).astype(np.float32)
    op = q.Int8DotGeneralOp.init()
    out = op(jnp.asarray(x), jnp.asarray(w), (((1,), (0,)), ((), ())))
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, _int8_reference(x, w), rtol=1e-5, atol=1e-5)
    assert not np.allclose(out, x @ w, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(out, x @ w, rtol=0.05, atol=0.1)


def test_int8_batched_and_transposed_layouts():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 4, 6)).astype(np.float32)  # (batch, contract, free)
    w = rng.standard_normal((3, 2, 4)).astype(np.float32)  # (free, batch, contract)
    op = q.Int8DotGeneralOp.init()
    out = op(jnp.asarray(x), jnp.asarray(w), (((1,), (2,)), ((0,), (1,))))
    expected = np.stack([_int8_reference(x[b].T, w[:, b].T) for b in range(2)])  # (batch, free_x, free_w)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_int8_gradient_is_straight_through():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((4, 8)).astype(np.float32)
    w = rng.standard_normal((8, 2)).astype(np.float32)
    op = q.Int8DotGeneralOp.init()
    gx, gw = jax.grad(lambda a, b: op(a, b, (((1,), (0,)), ((), ()))).sum(), argnums=(0, 1))(x, w)

    def qdq(a, axis):
        s = np.abs(a).max(axis=axis, keepdims=True) / 127.0
        return np.clip(np.round(a / s), -127, 127) * s

    ones = np.ones((4, 2), np.float32)
    np.testing.assert_allclose(gx, ones @ qdq(w, 0).T, rtol=1e-5)
    np.testing.assert_allclose(gw, qdq(x, 1).T @ ones, rtol=1e-5)


def test_int8_config_quantizes_and_trains():
    key = jax.random.key(0)
    kx, kw, kl = jax.random.split(key, 3)
    x = hax.random.normal(kx, (B, In))
    y = hax.dot(x, hax.random.normal(kw, (In, Out)), axis="in")
    model = q.quantize_linear_layers(nn.Linear.init(In, Out, key=kl), q.QuantizationConfig(int8=True))
    assert isinstance(model.dot_general, q.Int8DotGeneralOp)

    @eqx.filter_jit
    def step(m):
        loss, grads = eqx.filter_value_and_grad(lambda m: hax.mean((m(x) - y) ** 2).scalar())(m)
        return eqx.apply_updates(m, jax.tree_util.tree_map(lambda g: -0.1 * g, grads)), loss

    losses = []
    for _ in range(30):
        model, loss = step(model)
        losses.append(float(loss))
    assert losses[-1] < 0.2 * losses[0]
    with pytest.raises(ValueError, match="not both"):
        q.QuantizationConfig(fp8=True, int8=True)


def _np_qdq(a, amax, dtype):
    """NumPy emulation of one FP8 quantize-dequantize: scale ``amax / fp8_max``, saturate, round to ``dtype``."""
    top = float(ml_dtypes.finfo(dtype).max)
    s = np.float32(amax / top)
    return np.clip(a / s, -top, top).astype(dtype).astype(np.float32) * s


@pytest.mark.parametrize("scaling", ["delayed", "current"])
def test_fp8_forward_and_backward_equal_numpy_emulation(scaling):
    """Forward: e4m3(x) @ e4m3(w); backward: dx = e5m2(g) @ e4m3(w)^T, dw = e4m3(x)^T @ e5m2(g), each with the
    scale the rule gives (delayed: the history's maximum; current: the tensor's own)."""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((5, 8)) * 3).astype(np.float32)
    w = rng.standard_normal((8, 4)).astype(np.float32)
    g = (rng.standard_normal((5, 4)) * 1e-3).astype(np.float32)
    hist = {"in": 6.0, "kernel": 2.0, "grad": 4e-3}
    op = q.Fp8DotGeneralOp.init(amax_history_length=2, scaling=scaling)
    op = eqx.tree_at(
        lambda o: (o.input_amax_history, o.kernel_amax_history, o.output_grad_amax_history),
        op,
        tuple(jnp.array([hist[k], 0.0]) for k in ("in", "kernel", "grad")),
    )
    dn = (((1,), (0,)), ((), ()))
    out, vjp = jax.vjp(lambda a, b, o: o(a, b, dn), jnp.asarray(x), jnp.asarray(w), op)
    dx, dw, new_op = vjp(jnp.asarray(g))

    def amax(name, a):
        return float(np.abs(a).max()) if scaling == "current" else hist[name]

    e4m3, e5m2 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2
    qx, qw = _np_qdq(x, amax("in", x), e4m3), _np_qdq(w, amax("kernel", w), e4m3)
    qg = _np_qdq(g, amax("grad", g), e5m2)
    np.testing.assert_allclose(out, qx @ qw, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dx, qg @ qw.T, rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(dw, qx.T @ qg, rtol=1e-5, atol=1e-9)
    assert not np.allclose(dx, g @ w.T, rtol=1e-4, atol=0)  # the gradient really went through e5m2
    e4m3_max, e5m2_max = float(ml_dtypes.finfo(e4m3).max), float(ml_dtypes.finfo(e5m2).max)
    np.testing.assert_allclose(new_op.input_scale, [amax("in", x) / e4m3_max], rtol=1e-6)
    np.testing.assert_allclose(new_op.output_grad_scale, [amax("grad", g) / e5m2_max], rtol=1e-6)
    np.testing.assert_allclose(new_op.output_grad_amax_history, [np.abs(g).max(), hist["grad"]], rtol=1e-6)


def test_unknown_scaling_is_refused():
    with pytest.raises(ValueError, match="scaling"):
        q.QuantizationConfig(fp8=True, scaling="just_in_time")


def test_dequantize_restores_the_plain_product():
    model = {"a": nn.Linear.init(In, Out, key=jax.random.key(0)), "b": nn.Linear.init(In, Out, key=jax.random.key(1))}
    quantized = q.quantize_linear_layers(model, q.QuantizationConfig(targets=["a"], fp8=True))
    x = hax.random.normal(jax.random.key(2), (B, In))
    plain = q.dequantize_linear_layers(quantized)
    assert isinstance(quantized["a"].dot_general, q.Fp8DotGeneralOp)
    assert all(isinstance(m.dot_general, q.DefaultDotGeneralOp) for m in plain.values())
    expected = np.asarray(x.array) @ np.asarray(model["a"].weight.rearrange((In, Out)).array)
    np.testing.assert_allclose(plain["a"](x).array, expected, rtol=1e-5, atol=1e-5)
