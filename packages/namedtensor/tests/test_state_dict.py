"""Tests for ``state_dict``: key layout against hand-built PyTorch-style dicts, round trips, safetensors."""

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ponente.namedtensor as hax
from ponente.namedtensor import Axis, NamedArray
from ponente.namedtensor.nn import BlockSeq, Linear, Stacked
from ponente.namedtensor.state_dict import (
    ModuleWithStateDictSerialization,
    flatten_modules_for_export,
    from_state_dict,
    from_torch_compatible_state_dict,
    load_state_dict,
    save_state_dict,
    stack_state_dict,
    to_state_dict,
    to_torch_compatible_state_dict,
    unflatten_modules_from_export,
    unstack_state_dict,
    with_prefix,
)

Embed, Heads, Head, Mlp, Layers = (
    Axis("embed", 4),
    Axis("heads", 2),
    Axis("head", 3),
    Axis("mlp", 5),
    Axis("layers", 3),
)


class Norm(ModuleWithStateDictSerialization):
    scale: NamedArray

    def _state_dict_key_map(self):
        return {"scale": "weight"}


class Attn(eqx.Module):
    q_proj: Linear
    o_proj: Linear


class TBlock(ModuleWithStateDictSerialization):
    attn: Attn
    ln: Norm
    mlp: list[Linear]
    name: str = eqx.field(static=True, default="block")

    @staticmethod
    def init(*, key):
        k = jax.random.split(key, 4)
        attn = Attn(
            Linear.init(Embed, (Heads, Head), key=k[0]),
            Linear.init((Heads, Head), Embed, key=k[1], use_bias=False),
        )
        mlp = [Linear.init(Embed, Mlp, key=k[2]), Linear.init(Mlp, Embed, key=k[3], out_first=False)]
        return TBlock(attn, Norm(hax.random.normal(k[3], Embed)), mlp)

    def _state_dict_key_map(self):
        return {"attn": "self_attn", "ln": "input_layernorm", "mlp": None}

    def __call__(self, x):
        h = hax.tanh(self.attn.o_proj(self.attn.q_proj(x)) * self.ln.scale)
        return x + self.mlp[1](hax.tanh(self.mlp[0](h)))


def _np(x):
    return np.asarray(x.array if isinstance(x, NamedArray) else x)


def _torch_reference(block: TBlock, prefix: str) -> dict[str, np.ndarray]:
    """The PyTorch layout built by hand with NumPy: Linear weights (out, in), biases (out,)."""
    q, o = block.attn.q_proj, block.attn.o_proj
    m0, m1 = block.mlp
    ref = {
        # q: weight axes (heads, head, embed) -> (heads*head, embed)
        f"{prefix}.self_attn.q_proj.weight": _np(q.weight).reshape(Heads.size * Head.size, Embed.size),
        f"{prefix}.self_attn.q_proj.bias": _np(q.bias).reshape(-1),
        # o: weight axes (embed, heads, head) -> (embed, heads*head)
        f"{prefix}.self_attn.o_proj.weight": _np(o.weight).reshape(Embed.size, -1),
        f"{prefix}.input_layernorm.weight": _np(block.ln.scale),
        f"{prefix}.0.weight": _np(m0.weight),
        f"{prefix}.0.bias": _np(m0.bias),
        # stored (in, out) (out_first=False): exported in the stored order, as Haliax does
        f"{prefix}.1.weight": _np(m1.weight),
        f"{prefix}.1.bias": _np(m1.bias),
    }
    return ref


def _assert_dicts_equal(actual, expected):
    assert sorted(actual) == sorted(expected)
    for key in expected:
        np.testing.assert_array_equal(np.asarray(actual[key]), expected[key], err_msg=key)


def test_with_prefix():
    assert with_prefix(None, None) is None
    assert with_prefix("a", "b") == "a.b"


def test_key_maps_and_raw_layout():
    block = TBlock.init(key=jax.random.key(0))
    sd = to_state_dict(block, "model")
    assert set(sd) == {
        "model.self_attn.q_proj.weight",
        "model.self_attn.q_proj.bias",
        "model.self_attn.o_proj.weight",
        "model.input_layernorm.weight",
        "model.0.weight",
        "model.0.bias",
        "model.1.weight",
        "model.1.bias",
    }
    # unflattened: the multi-axis weight keeps its axes
    assert sd["model.self_attn.q_proj.weight"].shape == (Heads.size, Head.size, Embed.size)


def test_torch_compatible_layout_matches_hand_built_numpy_dict():
    block = TBlock.init(key=jax.random.key(0))
    _assert_dicts_equal(to_torch_compatible_state_dict(block, prefix="block"), _torch_reference(block, "block"))


def test_torch_compatible_round_trip_from_hand_built_dict():
    block = TBlock.init(key=jax.random.key(0))
    other = TBlock.init(key=jax.random.key(1))
    loaded = from_torch_compatible_state_dict(other, _torch_reference(block, "b"), prefix="b")
    for a, b in zip(jax.tree_util.tree_leaves(loaded), jax.tree_util.tree_leaves(block)):
        np.testing.assert_array_equal(a, b)
    x = hax.random.normal(jax.random.key(2), (Axis("pos", 2), Embed))
    np.testing.assert_allclose(loaded(x).array, block(x).array, rtol=1e-6)


def test_stacked_exports_numbered_per_layer_keys():
    stacked = Stacked.init(Layers, TBlock)(key=jax.random.split(jax.random.key(0), Layers.size))
    sd = to_torch_compatible_state_dict(stacked, prefix="layers")
    expected = {}
    for i, layer in enumerate(stacked.unstacked()):
        expected.update(_torch_reference(layer, f"layers.{i}"))
    _assert_dicts_equal(sd, expected)
    # BlockSeq exports exactly the same keys and values
    seq = BlockSeq(tuple(stacked.unstacked()), Layers)
    _assert_dicts_equal(to_torch_compatible_state_dict(seq, prefix="layers"), expected)


def test_stacked_and_blockseq_load_numbered_keys():
    source = Stacked.init(Layers, TBlock)(key=jax.random.split(jax.random.key(0), Layers.size))
    template = Stacked.init(Layers, TBlock)(key=jax.random.split(jax.random.key(5), Layers.size))
    sd = to_torch_compatible_state_dict(source, prefix="model.layers")
    loaded = from_torch_compatible_state_dict(template, sd, prefix="model.layers")
    for a, b in zip(jax.tree_util.tree_leaves(loaded), jax.tree_util.tree_leaves(source)):
        np.testing.assert_array_equal(a, b)
    seq_template = BlockSeq(tuple(template.unstacked()), Layers)
    seq = from_torch_compatible_state_dict(seq_template, sd, prefix="model.layers")
    x = hax.random.normal(jax.random.key(2), (Embed,))
    np.testing.assert_allclose(seq.fold(x).array, source.fold(x).array, rtol=1e-5)


def test_plain_round_trip_keeps_dtypes_and_structure():
    block = TBlock.init(key=jax.random.key(0))
    sd = to_state_dict(block)
    loaded = from_state_dict(TBlock.init(key=jax.random.key(9)), {k: np.asarray(v) for k, v in sd.items()})
    assert jax.tree_util.tree_structure(loaded) == jax.tree_util.tree_structure(block)
    for a, b in zip(jax.tree_util.tree_leaves(loaded), jax.tree_util.tree_leaves(block)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)


def test_missing_key_and_wrong_shape_are_clear_errors():
    block = TBlock.init(key=jax.random.key(0))
    sd = to_state_dict(block, "m")
    del sd["m.input_layernorm.weight"]
    with pytest.raises(KeyError, match=r"m\.input_layernorm\.weight"):
        from_state_dict(block, sd, "m")
    sd = to_state_dict(block, "m")
    sd["m.0.bias"] = np.zeros(7)
    with pytest.raises(ValueError, match=r"'m\.0\.bias'.*\(7,\)"):
        from_state_dict(block, sd, "m")
    with pytest.raises(KeyError, match=r"layers\.1\.w"):
        stack_state_dict({"layers.0.w": np.zeros(2), "layers.2.w": np.zeros(2)}, "layers", 3)
    with pytest.raises(ValueError, match="3 layers"):
        unstack_state_dict({"layers.w": np.zeros((2, 4))}, "layers", 3)
    with pytest.raises(FileNotFoundError, match=r"nope\.safetensors"):
        load_state_dict("/nonexistent/nope.safetensors")


def test_stack_unstack_are_inverse_and_leave_other_keys():
    sd = {"layers.w": np.arange(6.0).reshape(3, 2), "embed": np.ones(2)}
    per_layer = unstack_state_dict(sd, "layers", 3)
    assert sorted(per_layer) == ["embed", "layers.0.w", "layers.1.w", "layers.2.w"]
    np.testing.assert_array_equal(per_layer["layers.1.w"], [2.0, 3.0])
    back = stack_state_dict(per_layer, "layers", 3)
    assert sorted(back) == ["embed", "layers.w"]
    np.testing.assert_array_equal(back["layers.w"], sd["layers.w"])


def test_safetensors_round_trip(tmp_path):
    block = TBlock.init(key=jax.random.key(0))
    sd = to_torch_compatible_state_dict(block)
    sd["extra_bf16"] = np.arange(4).astype(ml_dtypes.bfloat16)
    path = tmp_path / "model.safetensors"
    save_state_dict(sd, path)
    loaded = load_state_dict(path)
    assert sorted(loaded) == sorted(sd)
    for key in sd:
        assert loaded[key].dtype == sd[key].dtype
        np.testing.assert_array_equal(loaded[key], sd[key])
    # jax arrays are accepted too
    save_state_dict({"w": jnp.ones((2, 3))}, tmp_path / "jax.safetensors")
    np.testing.assert_array_equal(load_state_dict(tmp_path / "jax.safetensors")["w"], np.ones((2, 3)))


@settings(max_examples=15)
@given(
    out_sizes=st.lists(st.integers(1, 3), min_size=1, max_size=3),
    in_sizes=st.lists(st.integers(1, 3), min_size=1, max_size=2),
    out_first=st.booleans(),
    use_bias=st.booleans(),
)
def test_linear_flatten_matches_numpy_and_round_trips(out_sizes, in_sizes, out_first, use_bias):
    outs = tuple(Axis(f"o{i}", s) for i, s in enumerate(out_sizes))
    ins = tuple(Axis(f"i{i}", s) for i, s in enumerate(in_sizes))
    lin = Linear.init(ins, outs, key=jax.random.key(0), out_first=out_first, use_bias=use_bias)
    flat = lin.flatten_for_export()
    w = _np(lin.weight)
    n_out, n_in = int(np.prod(out_sizes)), int(np.prod(in_sizes))
    # the stored order is kept: (out, in) when out_first, else (in, out)
    expected = w.reshape(n_out, n_in) if out_first else w.reshape(n_in, n_out)
    np.testing.assert_array_equal(_np(flat.weight), expected)
    assert flat.weight.axis_names == (("__OUT__", "__IN__") if out_first else ("__IN__", "__OUT__"))
    if use_bias:
        np.testing.assert_array_equal(_np(flat.bias), _np(lin.bias).reshape(-1))
    back = flat.unflatten_from_export(lin)
    assert back.weight.axes == lin.weight.axes
    np.testing.assert_array_equal(_np(back.weight), w)
    if use_bias:
        assert back.bias.axes == lin.bias.axes
        np.testing.assert_array_equal(_np(back.bias), _np(lin.bias))


def test_stacked_multi_axis_layers_flatten_per_layer_and_come_back():
    class Block(eqx.Module):
        norm: hax.nn.RmsNorm
        proj: Linear

    def make(key):
        return Block(
            hax.nn.RmsNorm(
                (Heads, Head), hax.random.normal(key, (Heads, Head)), hax.random.normal(key, (Heads, Head)) + 1
            ),
            Linear.init(Embed, (Heads, Head), key=key),
        )

    stacked = Stacked.init(Layers, make)(jax.random.split(jax.random.key(0), Layers.size))
    flat = flatten_modules_for_export(stacked)
    sd = to_state_dict(flat, "h")
    for i in range(Layers.size):
        w = _np(stacked.stacked.norm.weight)[i]  # (heads, head) -> (heads*head,)
        np.testing.assert_array_equal(np.asarray(sd[f"h.{i}.norm.weight"]), w.reshape(-1))
        np.testing.assert_array_equal(
            np.asarray(sd[f"h.{i}.norm.bias"]), _np(stacked.stacked.norm.bias)[i].reshape(-1)
        )
        q = _np(stacked.stacked.proj.weight)[i]  # (heads, head, embed) -> (heads*head, embed)
        np.testing.assert_array_equal(np.asarray(sd[f"h.{i}.proj.weight"]), q.reshape(-1, Embed.size))
    back = unflatten_modules_from_export(flat, stacked)
    assert back.stacked.norm.weight.axes == (Layers, Heads, Head)
    assert back.stacked.proj.weight.axes == stacked.stacked.proj.weight.axes
    for a, b in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(stacked)):
        np.testing.assert_array_equal(a, b)


def test_from_torch_compatible_accepts_an_abstract_template():
    source = Stacked.init(Layers, TBlock)(key=jax.random.split(jax.random.key(0), Layers.size))
    template = eqx.filter_eval_shape(
        lambda k: Stacked.init(Layers, TBlock)(key=jax.random.split(k, Layers.size)), jax.random.key(3)
    )
    loaded = from_torch_compatible_state_dict(template, to_torch_compatible_state_dict(source))
    for a, b in zip(jax.tree_util.tree_leaves(loaded), jax.tree_util.tree_leaves(source)):
        np.testing.assert_array_equal(a, b)


def test_stack_and_unstack_infer_the_number_of_layers():
    per_layer = {"b.0.w": np.zeros(2), "b.1.w": np.ones(2), "b.2.w": np.full(2, 2.0), "other.0.w": np.ones(1)}
    stacked = stack_state_dict(per_layer, "b")
    np.testing.assert_array_equal(stacked["b.w"], np.repeat(np.arange(3.0)[:, None], 2, axis=1))
    assert sorted(stacked) == ["b.w", "other.0.w"]
    back = unstack_state_dict(stacked, "b")
    assert sorted(back) == sorted(per_layer)
    with pytest.raises(KeyError, match=r"b\.1\.w"):
        stack_state_dict({"b.0.w": np.zeros(2), "b.2.w": np.zeros(2)}, "b")
    with pytest.raises(ValueError, match="layers dimension"):
        unstack_state_dict({"b.w": np.float32(1.0)}, "b")


def test_save_skips_none_and_marks_the_format(tmp_path):
    from safetensors import safe_open

    path = tmp_path / "m.safetensors"
    save_state_dict({"w": np.arange(3, dtype=np.float32), "missing": None}, path)
    with safe_open(str(path), framework="numpy") as f:
        assert list(f.keys()) == ["w"]
        assert f.metadata() == {"format": "pt"}


def test_deprecated_linear_flatteners_are_aliases():
    lin = hax.nn.Linear.init(hax.Axis("embed", 4), (hax.Axis("heads", 2), hax.Axis("head", 3)), key=jax.random.key(0))
    with pytest.warns(DeprecationWarning, match="flatten_modules_for_export"):
        flat = hax.state_dict.flatten_linear_layers(lin)
    # the exported weight is PyTorch's 2-D (out, in) layout: rows = heads*head, columns = embed
    names = [ax.name for ax in lin.weight.axes]
    w = np.transpose(np.asarray(lin.weight.array), [names.index(n) for n in ("heads", "head", "embed")])
    np.testing.assert_array_equal(np.asarray(flat.weight.array), w.reshape(6, 4))
    with pytest.warns(DeprecationWarning, match="unflatten_modules_from_export"):
        back = hax.state_dict.unflatten_linear_layers(lin, flat)
    np.testing.assert_array_equal(np.asarray(back.weight.array), np.asarray(lin.weight.array))
