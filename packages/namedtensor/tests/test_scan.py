"""Tests for ``nn.scan``: ``Stacked``/``BlockSeq`` against a NumPy loop; checkpoint policies by saved residuals."""

import contextlib
import io

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.ad_checkpoint import print_saved_residuals

import ponente.namedtensor as hax
from ponente.namedtensor import Axis, NamedArray
from ponente.namedtensor.nn import BlockFoldable, BlockSeq, ScanCheckpointPolicy, Stacked, tree_checkpoint_name

Layers, E, B = Axis("layers", 4), Axis("embed", 3), Axis("batch", 2)


class Block(eqx.Module):
    """``x -> cos(tag(sin(x * w)) ) * w + b * scale`` with a tagged internal named ``"y"``."""

    w: NamedArray
    b: jax.Array
    scale: float = eqx.field(static=True)

    @staticmethod
    def init(Embed: Axis, scale: float, *, key: jax.Array) -> "Block":
        k1, k2 = jax.random.split(key)
        return Block(hax.random.normal(k1, Embed), jax.random.normal(k2, ()), scale)

    def __call__(self, x: NamedArray, bias: NamedArray | None = None) -> NamedArray:
        y = tree_checkpoint_name(hax.sin(x * self.w), "y")
        out = hax.cos(y) * self.w + self.b * self.scale
        return out if bias is None else out + bias

    def with_output(self, x: NamedArray) -> tuple[NamedArray, NamedArray]:
        out = self(x)
        return out, out.sum("embed")


def _keys(n: int = Layers.size, seed: int = 0) -> jax.Array:
    return jax.random.split(jax.random.key(seed), n)


def _reference_fold(stacked: Stacked, x: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """A plain NumPy loop over the stacked parameters."""
    w = np.asarray(stacked.stacked.w.array)
    b = np.asarray(stacked.stacked.b)
    for i in range(w.shape[0]):
        x = np.cos(np.sin(x * w[i])) * w[i] + b[i] * stacked.stacked.scale
        if bias is not None:
            x = x + bias[i]
    return x


def _saved(fn, *args) -> list[str]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        print_saved_residuals(fn, *args)
    return [line for line in buf.getvalue().splitlines() if line.strip()]


def test_init_stacks_parameters_along_layers_axis():
    stacked = Stacked.init(Layers, Block)(E, 0.5, key=_keys())
    assert stacked.stacked.w.axes == (Layers, E)
    assert stacked.stacked.b.shape == (Layers.size,)
    assert stacked.stacked.scale == 0.5
    # each layer equals a block built separately with its own key
    for i, key in enumerate(_keys()):
        single = Block.init(E, 0.5, key=key)
        np.testing.assert_allclose(stacked.stacked.w.array[i], single.w.array, rtol=1e-6)
        np.testing.assert_allclose(stacked.stacked.b[i], single.b, rtol=1e-6)


def test_fold_matches_numpy_loop_and_blockseq():
    stacked = Stacked.init(Layers, Block)(E, 0.5, key=_keys())
    seq = BlockSeq.init(Layers, Block)(E, 0.5, key=_keys())
    x = hax.random.normal(jax.random.key(1), (B, E))
    ref = _reference_fold(stacked, np.asarray(x.array))
    np.testing.assert_allclose(stacked.fold(x).array, ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(seq.fold(x).array, ref, rtol=1e-5, atol=1e-6)
    assert isinstance(stacked, BlockFoldable)
    assert isinstance(seq, BlockFoldable)


def test_fold_splits_per_layer_arguments_and_broadcasts_others():
    stacked = Stacked.init(Layers, Block)(E, 1.0, key=_keys())
    x = hax.random.normal(jax.random.key(1), (E,))
    bias = hax.random.normal(jax.random.key(2), (Layers, E))  # has the layers axis: one slice per layer
    ref = _reference_fold(stacked, np.asarray(x.array), np.asarray(bias.array))
    np.testing.assert_allclose(stacked.fold(x, bias).array, ref, rtol=1e-5, atol=1e-6)
    seq = BlockSeq(tuple(stacked.unstacked()), Layers)
    np.testing.assert_allclose(seq.fold(x, bias=bias).array, ref, rtol=1e-5, atol=1e-6)
    # without the layers axis the same bias goes to every layer
    shared = hax.random.normal(jax.random.key(3), (E,))
    ref_shared = _reference_fold(stacked, np.asarray(x.array), np.stack([np.asarray(shared.array)] * Layers.size))
    np.testing.assert_allclose(stacked.fold(x, shared).array, ref_shared, rtol=1e-5, atol=1e-6)


def test_scan_and_scan_via_stack_outputs():
    stacked = Stacked.init(Layers, Block)(E, 0.5, key=_keys())
    seq = BlockSeq(tuple(stacked.unstacked()), Layers)
    x = hax.random.normal(jax.random.key(1), (E,))
    carry, ys = stacked.scan_via(Block.with_output)(x)
    carry_seq, ys_seq = seq.scan_via(Block.with_output)(x)
    assert ys.axes == (Layers,)
    # reference: per-layer outputs from a Python loop over unstacked blocks
    expected, h = [], x
    for block in stacked.unstacked():
        h, y = block.with_output(h)
        expected.append(float(y.scalar()))
    np.testing.assert_allclose(ys.array, expected, rtol=1e-5)
    np.testing.assert_allclose(ys_seq.array, expected, rtol=1e-5)
    np.testing.assert_allclose(carry.array, carry_seq.array, rtol=1e-6)


def test_scan_with_blocks_returning_pairs():
    class Pair(eqx.Module):
        w: NamedArray

        def __call__(self, x):
            return x * self.w, (x * self.w).sum()

    w = hax.random.normal(jax.random.key(0), (Layers, E))
    stacked = Stacked(Pair(w), Layers)
    x = hax.ones(E)
    carry, ys = stacked.scan(x)
    np.testing.assert_allclose(carry.array, np.prod(np.asarray(w.array), axis=0), rtol=1e-5)
    np.testing.assert_allclose(ys.array, np.cumprod(np.asarray(w.array), axis=0).sum(-1), rtol=1e-5)


def test_vmap_applies_each_layer_to_the_same_input():
    stacked = Stacked.init(Layers, Block)(E, 0.5, key=_keys())
    seq = BlockSeq(tuple(stacked.unstacked()), Layers)
    x = hax.random.normal(jax.random.key(1), (E,))
    out = stacked.vmap(x)
    assert out.axes == (Layers, E)
    for i, block in enumerate(stacked.unstacked()):
        np.testing.assert_allclose(out.array[i], block(x).array, rtol=1e-5)
    np.testing.assert_allclose(seq.vmap(x).array, out.array, rtol=1e-6)
    np.testing.assert_allclose(stacked.vmap_via(Block.__call__)(x).array, out.array, rtol=1e-6)


def test_unstacked_and_get_layer_and_from_layers_roundtrip():
    stacked = Stacked.init(Layers, Block)(E, 0.5, key=_keys())
    layers = stacked.unstacked()
    assert len(layers) == Layers.size
    assert layers[2].w.axes == (E,)
    np.testing.assert_array_equal(stacked.get_layer(-1).w.array, stacked.stacked.w.array[-1])
    rebuilt = Stacked.from_layers(Layers, layers)
    np.testing.assert_array_equal(rebuilt.stacked.w.array, stacked.stacked.w.array)
    with pytest.raises(IndexError, match="layer 4"):
        stacked.get_layer(4)


def test_wrong_number_of_keys_is_a_clear_error():
    with pytest.raises(ValueError, match="layers"):
        BlockSeq.init(Layers, Block)(E, 0.5, key=_keys(3))


POLICIES = [False, True, "full", "save_carries", "save_inputs", ["y"], "nested", "offload", "save_all"]


@pytest.mark.parametrize("policy", POLICIES, ids=str)
def test_stacked_and_blockseq_identical_values_and_grads_under_every_policy(policy):
    stacked = Stacked.init(Layers, Block, gradient_checkpointing=policy)(E, 0.5, key=_keys())
    seq = BlockSeq(tuple(stacked.unstacked()), Layers, gradient_checkpointing=policy)
    plain = Stacked(stacked.stacked, Layers)  # no checkpointing: the reference gradient
    x = hax.random.normal(jax.random.key(1), (B, E))

    def loss(model, x):
        return (model.fold(x) ** 2).sum().scalar()

    ref_value = float(np.sum(_reference_fold(stacked, np.asarray(x.array)) ** 2))
    np.testing.assert_allclose(float(jax.jit(loss)(stacked, x)), ref_value, rtol=1e-5)
    np.testing.assert_allclose(float(loss(seq, x)), ref_value, rtol=1e-5)
    g_ref = jax.grad(loss)(plain, x)
    g_stacked = jax.jit(jax.grad(loss))(stacked, x)
    g_seq = jax.grad(loss)(seq, x)
    np.testing.assert_allclose(g_stacked.stacked.w.array, g_ref.stacked.w.array, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(g_stacked.stacked.b, g_ref.stacked.b, rtol=1e-5, atol=1e-6)
    for i, block in enumerate(g_seq.blocks):
        np.testing.assert_allclose(block.w.array, g_ref.stacked.w.array[i], rtol=1e-5, atol=1e-6)


def test_gradients_match_finite_differences():
    stacked = Stacked.init(Layers, Block, gradient_checkpointing="nested")(E, 0.5, key=_keys())
    x = hax.random.normal(jax.random.key(1), (E,))

    def loss(b):
        return Stacked(eqx.tree_at(lambda s: s.b, stacked.stacked, b), Layers, "nested").fold(x).sum().scalar()

    grad_b = jax.grad(loss)(stacked.stacked.b)
    eps = 1e-3
    for i in range(Layers.size):
        delta = jnp.zeros(Layers.size).at[i].set(eps)
        fd = (loss(stacked.stacked.b + delta) - loss(stacked.stacked.b - delta)) / (2 * eps)
        np.testing.assert_allclose(grad_b[i], fd, rtol=2e-2, atol=1e-3)


def _residuals(policy) -> list[str]:
    stacked = Stacked.init(Layers, Block, gradient_checkpointing=policy)(E, 0.5, key=_keys())
    return _saved(lambda m, x: m.fold(x).sum().scalar(), stacked, hax.ones(E))


def _from_scan(lines: list[str]) -> list[str]:
    return [line for line in lines if "output of scan" in line]


def test_no_checkpointing_keeps_block_internals():
    # carry + sin output + cos output + ... : several per-layer stacks of shape [layers, embed]
    assert len(_from_scan(_residuals(False))) >= 3
    assert len(_from_scan(_residuals("save_all"))) == len(_from_scan(_residuals(False)))


def test_full_recompute_keeps_only_the_carries():
    lines = _from_scan(_residuals(True))
    assert len(lines) == 1
    assert lines[0].startswith("f32[4,3]")
    assert _from_scan(_residuals("full")) == lines
    assert _from_scan(_residuals("save_carries")) == lines


def test_named_internals_are_kept_when_listed():
    assert len(_from_scan(_residuals(["y"]))) == 2  # carries + the internal named "y"
    assert len(_from_scan(_residuals(["not_a_tag"]))) == 1
    assert len(_from_scan(_residuals(ScanCheckpointPolicy(save_block_internals=["y"])))) == 2


def test_nested_keeps_sqrt_n_carries():
    lines = _residuals("nested")
    carries = _from_scan(lines)
    # 4 layers -> 2 groups of 2: only the 2 group-boundary carries are saved, not 4
    assert [line.split(" ")[0] for line in carries] == ["f32[2,3]"]
    assert not any(line.startswith("f32[4,3] output of scan") for line in lines)
    explicit = _residuals(ScanCheckpointPolicy(nested=4))
    assert [line.split(" ")[0] for line in _from_scan(explicit)] == ["f32[4,3]"]


def test_offload_moves_carries_to_host():
    lines = _from_scan(_residuals("offload"))
    assert lines
    assert all("<host>" in line.split(" ")[0] for line in lines)


def test_policy_shortcuts_and_errors():
    assert ScanCheckpointPolicy.from_bool_or_str(False).disable
    assert ScanCheckpointPolicy.from_bool_or_str(None).disable
    assert ScanCheckpointPolicy.from_bool_or_str(True) == ScanCheckpointPolicy()
    assert ScanCheckpointPolicy.from_bool_or_str("nested").nested is True
    assert ScanCheckpointPolicy.from_bool_or_str(["a", "b"]).save_block_internals == ("a", "b")
    with pytest.raises(ValueError, match="unknown gradient checkpointing policy 'fast'"):
        ScanCheckpointPolicy.from_bool_or_str("fast")
    with pytest.raises(ValueError, match="save_carries"):
        ScanCheckpointPolicy(save_carries="disk")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="write \\['y'\\]"):
        ScanCheckpointPolicy(save_block_internals="y")
    stacked = Stacked.init(Layers, Block, gradient_checkpointing=ScanCheckpointPolicy(nested=3))(E, 0.5, key=_keys())
    with pytest.raises(ValueError, match="3 groups do not divide 4 layers"):
        stacked.fold(hax.ones(E))


def test_stacked_compiles_one_block_not_n():
    traces = []

    class Counting(eqx.Module):
        w: NamedArray

        def __call__(self, x):
            traces.append(1)
            return x * self.w

    many = Axis("layers", 16)
    stacked = Stacked(Counting(hax.ones((many, E))), many)
    jax.jit(lambda m, x: m.fold(x))(stacked, hax.ones(E))
    assert len(traces) == 1
    traces.clear()
    BlockSeq(tuple(stacked.unstacked()), many).fold(hax.ones(E))
    assert len(traces) == many.size


@given(n_layers=st.integers(1, 9), nested=st.booleans())
def test_nested_fold_equals_loop_for_any_layer_count(n_layers, nested):
    L = Axis("layers", n_layers)
    w = hax.random.normal(jax.random.key(n_layers), (L, E))

    class Mul(eqx.Module):
        w: NamedArray

        def __call__(self, x):
            return hax.tanh(x * self.w + 0.1)

    stacked = Stacked(Mul(w), L, gradient_checkpointing="nested" if nested else True)
    x = np.full(E.size, 0.7, np.float32)
    ref = x
    for i in range(n_layers):
        ref = np.tanh(ref * np.asarray(w.array[i]) + 0.1)
    np.testing.assert_allclose(stacked.fold(hax.named(jnp.asarray(x), "embed")).array, ref, rtol=1e-5, atol=1e-6)


def test_nested_scan_outputs_come_back_in_layer_order():
    plain = Stacked.init(Layers, Block)(E, 0.5, key=_keys())
    nested = Stacked(plain.stacked, Layers, gradient_checkpointing="nested")
    x = hax.random.normal(jax.random.key(1), (E,))
    carry, ys = nested.scan_via(Block.with_output)(x)
    ref_carry, ref_ys = plain.scan_via(Block.with_output)(x)
    assert ys.axes == (Layers,)
    np.testing.assert_allclose(ys.array, ref_ys.array, rtol=1e-6)
    np.testing.assert_allclose(carry.array, ref_carry.array, rtol=1e-6)


def test_init_splits_named_arguments_with_the_layers_axis():
    class Indexed(eqx.Module):
        index: NamedArray
        w: NamedArray

        @staticmethod
        def init(Embed, index, *, key):
            return Indexed(index, hax.random.normal(key, Embed))

        def __call__(self, x):
            return x * self.w + self.index

    for cls in (Stacked, BlockSeq):
        stack = cls.init(Layers, Indexed)(E, hax.arange(Layers, dtype=jnp.float32), key=_keys())
        layers = stack.unstacked()
        assert [float(layer.index.scalar()) for layer in layers] == [0.0, 1.0, 2.0, 3.0]
        x = np.ones(E.size, np.float32)
        for i, layer in enumerate(layers):
            x = x * np.asarray(layer.w.array) + i
        np.testing.assert_allclose(stack.fold(hax.ones(E)).array, x, rtol=1e-5)


def test_blockseq_checkpointing_recomputes_block_internals():
    stacked = Stacked.init(Layers, Block)(E, 0.5, key=_keys())

    def residuals(policy):
        seq = BlockSeq(tuple(stacked.unstacked()), Layers, gradient_checkpointing=policy)
        return _saved(lambda m, x: m.fold(x).sum().scalar(), seq, hax.ones(E))

    internals = [line for line in residuals(False) if "output of sin" in line or "output of cos" in line]
    assert len(internals) >= Layers.size
    assert not [line for line in residuals(True) if "output of sin" in line or "output of cos" in line]
    named = [line for line in residuals(["y"]) if "named 'y'" in line]
    assert len(named) == Layers.size


@pytest.mark.parametrize("unroll", [None, 1, 2, True, False])
def test_unroll_gives_the_loop_result(unroll):
    stacked = Stacked.init(Layers, Block)(E, 0.5, key=_keys())
    x = hax.random.normal(jax.random.key(1), (E,))
    ref = _reference_fold(stacked, np.asarray(x.array))
    np.testing.assert_allclose(stacked.fold(x, unroll=unroll).array, ref, rtol=1e-5)
    np.testing.assert_allclose(stacked.fold_via(Block.__call__, unroll=unroll)(x).array, ref, rtol=1e-5)
    carry, ys = stacked.scan_via(Block.with_output, unroll=unroll)(x)
    np.testing.assert_allclose(carry.array, ref, rtol=1e-5)
    assert ys.axes == (Layers,)
    seq = BlockSeq(tuple(stacked.unstacked()), Layers)
    np.testing.assert_allclose(seq.fold(x, unroll=unroll).array, ref, rtol=1e-5)
    with pytest.raises(ValueError, match="unroll"):
        stacked.fold(x, unroll=0)


def _remat_prevent_cse(fn, *args) -> list[bool]:
    """The ``prevent_cse`` of every checkpoint in the jaxpr of ``grad(fn)``, nested ones included."""
    found = []

    def visit(jaxpr):
        for eqn in jaxpr.eqns:
            if "prevent_cse" in eqn.params:
                found.append(eqn.params["prevent_cse"])
            for param in eqn.params.values():
                for value in param if isinstance(param, (list, tuple)) else (param,):
                    inner = getattr(value, "jaxpr", value)
                    if hasattr(inner, "eqns"):
                        visit(inner)

    visit(jax.make_jaxpr(jax.grad(fn))(*args).jaxpr)
    return found


@pytest.mark.parametrize("policy", [True, "save_inputs", ["y"]])
def test_fully_unrolled_checkpointing_prevents_cse(policy):
    # unrolled over every layer the loop is straight-line code, where XLA could merge the recomputation with the
    # forward pass it repeats (as BlockSeq's blocks): the checkpoint then prevents that; in a loop it need not
    stacked = Stacked.init(Layers, Block, gradient_checkpointing=policy)(E, 0.5, key=_keys())
    x = hax.random.normal(jax.random.key(2), (E,))

    def loss(unroll):
        return lambda x: stacked.fold(x, unroll=unroll).sum().scalar()

    for unroll in (None, 1, 2):
        assert set(_remat_prevent_cse(loss(unroll), x)) == {False}, unroll
    for unroll in (True, Layers.size, Layers.size + 1):
        assert set(_remat_prevent_cse(loss(unroll), x)) == {True}, unroll
    scanned = stacked.scan_via(Block.with_output, unroll=True)
    assert set(_remat_prevent_cse(lambda x: scanned(x)[0].sum().scalar(), x)) == {True}
    # and the gradient is the loop's
    np.testing.assert_allclose(jax.grad(loss(True))(x).array, jax.grad(loss(None))(x).array, rtol=1e-5)
    unchecked = Stacked.init(Layers, Block)(E, 0.5, key=_keys())
    assert _remat_prevent_cse(lambda x: unchecked.fold(x, unroll=True).sum().scalar(), x) == []


def test_scan_with_blocks_that_return_one_value_is_an_error():
    stacked = Stacked.init(Layers, Block)(E, 0.5, key=_keys())
    x = hax.ones(E)
    for stack in (stacked, BlockSeq(tuple(stacked.unstacked()), Layers)):
        with pytest.raises(ValueError, match="pair"):
            stack.scan(x)


def test_stacked_runs_through_the_package_scan_and_fold(monkeypatch):
    # Stacked looks hax.scan / hax.fold up at call time, so wrapping them (e.g. to trace or count calls) works
    stacked = Stacked.init(Layers, Block)(E, 0.5, key=_keys())
    calls = []
    for name in ("scan", "fold"):
        original = getattr(hax, name)
        monkeypatch.setattr(hax, name, lambda *a, _o=original, _n=name, **k: calls.append(_n) or _o(*a, **k))
    x = hax.ones(E)
    stacked.fold(x)
    stacked.scan_via(Block.with_output)(x)
    assert calls == ["fold", "scan"]
