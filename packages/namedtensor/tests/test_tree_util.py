"""Tests for the NamedArray-aware pytree helpers and ``resize_axis``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ponente.namedtensor as hax
from ponente.namedtensor import Axis, NamedArray
from ponente.namedtensor import tree_util as htu

V, E = Axis("vocab", 3), Axis("embed", 2)


def _tree():
    w = NamedArray(jnp.arange(6.0).reshape(3, 2), (V, E))
    b = NamedArray(jnp.array([1.0, 2.0]), (E,))
    return {"w": w, "layers": [b, jnp.ones(3)], "name": "lin"}


def test_named_arrays_are_leaves():
    tree = _tree()
    leaves = htu.tree_leaves(tree)
    assert len(leaves) == 4  # w, b, plain array, the string
    assert isinstance(leaves[1], NamedArray) or isinstance(leaves[0], NamedArray)
    assert sum(isinstance(leaf, NamedArray) for leaf in leaves) == 2
    # plain jax.tree_util flattens NamedArrays into their arrays
    assert all(not isinstance(leaf, NamedArray) for leaf in jax.tree_util.tree_leaves(tree))


def test_tree_map_sees_named_arrays_and_handles_several_trees():
    tree = _tree()
    axes = htu.tree_map(lambda x: x.axes if isinstance(x, NamedArray) else None, tree)
    assert axes["w"] == (V, E)
    assert axes["layers"][0] == (E,)
    summed = htu.tree_map(lambda a, b: a + b if not isinstance(a, str) else a, tree, tree)
    np.testing.assert_array_equal(summed["w"].array, 2 * np.arange(6.0).reshape(3, 2))
    assert summed["w"].axes == (V, E)
    only_plain = htu.tree_leaves(tree, is_leaf=lambda x: isinstance(x, list))
    assert any(isinstance(leaf, list) for leaf in only_plain)


def test_flatten_unflatten_roundtrip():
    tree = _tree()
    leaves, treedef = htu.tree_flatten(tree)
    assert htu.tree_structure(tree) == treedef
    rebuilt = htu.tree_unflatten(treedef, leaves)
    assert rebuilt["w"].axes == (V, E)
    np.testing.assert_array_equal(rebuilt["layers"][1], np.ones(3))


def test_resize_axis_shrinks_and_grows():
    tree = _tree()
    small = htu.resize_axis(tree, "vocab", 2)
    assert small["w"].axes == (Axis("vocab", 2), E)
    np.testing.assert_array_equal(small["w"].array, np.arange(4.0).reshape(2, 2))
    assert small["layers"][0].axes == (E,)  # arrays without the axis are untouched

    big = htu.resize_axis(tree, V, 5)
    np.testing.assert_array_equal(big["w"].array[:3], np.arange(6.0).reshape(3, 2))
    np.testing.assert_allclose(big["w"].array[3:], np.full((2, 2), np.arange(6.0).mean()))

    rand = htu.resize_axis(tree, "vocab", 50, key=jax.random.key(0))
    extra = np.asarray(rand["w"].array[3:])
    data = np.arange(6.0)
    assert np.abs(extra - data.mean()).max() <= 2 * data.std() + 1e-5
    assert extra.std() > 0.3 * data.std()


def test_resize_axis_errors():
    tree = _tree()
    with pytest.raises(ValueError, match="positive"):
        htu.resize_axis(tree, "vocab", 0)
    with pytest.raises(ValueError, match=r"vocab\(7\)"):
        htu.resize_axis(tree, Axis("vocab", 7), 4)


def test_tree_map_under_jit():
    f = jax.jit(lambda t: htu.tree_map(lambda x: x * 2 if isinstance(x, NamedArray) else x, t))
    tree = {"w": _tree()["w"]}
    np.testing.assert_array_equal(f(tree)["w"].array, 2 * np.arange(6.0).reshape(3, 2))
    assert hax.tree_util is htu


def test_scan_aware_tree_map_applies_fn_to_each_stacked_layer():
    Layers = Axis("layers", 3)
    w = NamedArray(jnp.arange(12.0).reshape(3, 4), (Layers, Axis("embed", 4)))
    model = {"stack": hax.nn.Stacked({"w": w, "b": jnp.arange(3.0)}, Layers), "head": w}

    def center(x):
        return x - x.mean() if isinstance(x, NamedArray) else x * 10

    out = htu.scan_aware_tree_map(center, model)
    raw = np.arange(12.0).reshape(3, 4)
    # inside the stack: per layer (row) means; outside: the mean of the whole array
    np.testing.assert_allclose(out["stack"].stacked["w"].array, raw - raw.mean(axis=1, keepdims=True))
    np.testing.assert_allclose(out["stack"].stacked["b"], np.arange(3.0) * 10)
    np.testing.assert_allclose(out["head"].array, raw - raw.mean())
    assert out["stack"].Block == Layers
    # with a second tree: both are sliced per layer
    summed = htu.scan_aware_tree_map(lambda a, b: a + b.sum() if isinstance(a, NamedArray) else a, model, model)
    np.testing.assert_allclose(summed["stack"].stacked["w"].array, raw + raw.sum(axis=1, keepdims=True))
