"""NamedArray: construction, pytree behaviour, transforms, broadcasting by name, reshaping ops."""

import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from named_strategies import axes_st, random_named, to_numpy

import ponente.namedtensor as hax
from ponente.namedtensor import Axis, NamedArray

A, B, C = Axis("a", 2), Axis("b", 3), Axis("c", 4)


def test_construction_properties_and_errors():
    x = NamedArray(jnp.zeros((2, 3), jnp.float32), (A, B))
    assert x.shape == {"a": 2, "b": 3}
    assert x.dtype == jnp.float32
    assert x.ndim == 2
    assert x.size == 6
    assert x.axes == (A, B)
    assert x.axis_size("b") == 3
    assert x.axis_size(("a", "b")) == 6
    assert x.resolve_axis("a") == A
    assert x.has_axis("a")
    assert not x.has_axis("z")
    with pytest.raises(ValueError, match=r"shape \(2, 3\)"):
        NamedArray(jnp.zeros((2, 3)), (A, C))
    with pytest.raises(ValueError, match="unique"):
        NamedArray(jnp.zeros((2, 2)), (A, A))
    with pytest.raises(TypeError, match="Axis"):
        NamedArray(jnp.zeros(2), ("a",))  # type: ignore[arg-type]
    with hax.enable_shape_checks(False):
        assert not hax.are_shape_checks_enabled()
        NamedArray(jnp.zeros(3), (C,))
    assert hax.are_shape_checks_enabled()


def test_named_accepts_names_axes_and_dicts():
    x = hax.named(np.ones((2, 3)), ("a", B))
    assert x.axes == (A, B)
    assert hax.named(np.ones((2, 3)), {"a": 2, "b": None}).axes == (A, B)
    with pytest.raises(ValueError, match="2 dimensions"):
        hax.named(np.ones((2, 3)), "a")
    with pytest.raises(ValueError, match="'b' has size 3"):
        hax.named(np.ones((2, 2)), (A, B))


def test_scalar_item_and_conversion():
    s = hax.named(jnp.array(3.0), ())
    assert s.scalar() == 3.0
    assert s.item() == 3.0
    assert float(s) == 3.0
    with pytest.raises(ValueError, match="axes"):
        hax.zeros((A,)).scalar()
    # no implicit conversion (no __jax_array__, as in Haliax): positional code must ask for `.array`
    with pytest.raises((TypeError, ValueError)):
        jnp.asarray(hax.zeros((A,)))


def test_axisless_named_array_with_a_positional_array_is_positional():
    carry = jnp.arange(4.0)
    s = hax.named(jnp.array(2.0), ())
    for out in (carry + s, s + carry, carry * s):
        assert isinstance(out, jax.Array)
    np.testing.assert_array_equal(carry + s, np.arange(4.0) + 2.0)
    np.testing.assert_array_equal(s - carry, 2.0 - np.arange(4.0))
    with pytest.raises(TypeError, match="positional array of shape"):
        hax.zeros((A,)) + jnp.ones(5)


def test_pytree_has_array_as_only_child():
    x = hax.zeros((A, B))
    leaves, treedef = jax.tree_util.tree_flatten(x)
    assert len(leaves) == 1
    assert leaves[0] is x.array
    y = jax.tree_util.tree_unflatten(treedef, [jnp.ones((2, 3))])
    assert isinstance(y, NamedArray)
    assert y.axes == (A, B)


def test_jit_grad_vmap_and_equinox():
    x = random_named((A, B), 0)
    w = random_named((B,), 1)

    def loss(x, w):
        return ((x * w).sum("b") ** 2).sum().scalar()

    expected = np.sum((np.asarray(x.array) * np.asarray(w.array)).sum(1) ** 2)
    np.testing.assert_allclose(jax.jit(loss)(x, w), expected, rtol=1e-5)
    g = jax.grad(loss, argnums=1)(x, w)
    assert isinstance(g, NamedArray)
    assert g.axes == (B,)
    xa, wa = np.asarray(x.array), np.asarray(w.array)
    np.testing.assert_allclose(g.array, 2 * ((xa * wa).sum(1)[:, None] * xa).sum(0), rtol=1e-4)

    # jax.vmap over positional data, with names inside
    def per_row(row):
        return (hax.named(row, "b") * w).sum().scalar()

    np.testing.assert_allclose(jax.vmap(per_row)(x.array), xa @ wa, rtol=1e-5)

    class Model(eqx.Module):
        w: NamedArray

        def __call__(self, x):
            return (x * self.w).sum("b")

    m = Model(w)
    out = eqx.filter_jit(lambda m, x: m(x))(m, x)
    assert out.axes == (A,)
    gm = eqx.filter_grad(lambda m, x: m(x).sum().scalar())(m, x)
    np.testing.assert_allclose(gm.w.array, xa.sum(0), rtol=1e-5)


@given(axes_st(min_axes=1, max_axes=4), st.data())
def test_binary_broadcasting_subset_rule(axes, data):
    sub = tuple(data.draw(st.permutations(data.draw(st.lists(st.sampled_from(axes), unique=True)))))
    x = random_named(axes, data.draw(st.integers(0, 1000)))
    y = random_named(sub, data.draw(st.integers(0, 1000)))
    names = [a.name for a in axes]
    y_full = to_numpy(y, [a.name for a in sub])
    # reference: align y into x's order by expanding dims
    ref_y = np.transpose(y_full, [[a.name for a in sub].index(n) for n in names if n in {a.name for a in sub}])
    ref_y = ref_y.reshape([a.size if a in sub else 1 for a in axes])
    # the larger operand's order, whichever side it is on; the left operand's order on a tie
    right_expected = axes if len(sub) < len(axes) else sub
    for out, ref, exp_axes in [
        (x + y, np.asarray(x.array) + ref_y, axes),
        (y * x, ref_y * np.asarray(x.array), right_expected),
    ]:
        assert out.axes == exp_axes
        np.testing.assert_allclose(to_numpy(out, names), ref, rtol=1e-6)
    assert (x - 1.5).axes == axes
    assert (2 ** hax.abs(x)).axes == axes


def test_broadcasting_errors_name_the_axes():
    x, y = hax.zeros((A, B)), hax.zeros((B, C))
    with pytest.raises(ValueError, match=r"\['a'\].*\['c'\]|\['c'\].*\['a'\]"):
        _ = x + y
    with pytest.raises(ValueError, match="'b' has size 3"):
        _ = x + hax.zeros((Axis("b", 5),))
    with pytest.raises(TypeError, match="positional"):
        _ = x + jnp.ones(3)
    with pytest.raises(TypeError, match=r"hax\.dot"):
        _ = x @ y


def test_equal_axis_sets_take_left_order_and_comparisons_are_elementwise():
    x = random_named((A, B), 0)
    y = x.rearrange((B, A))
    out = x == y
    assert out.axes == (A, B)
    assert bool(out.all())
    assert (y + x).axes == (B, A)


def test_broadcast_to_axis_arrays():
    x = hax.named(jnp.arange(3), B)
    y = hax.broadcast_to(x, (A, B))
    assert y.axes == (A, B)
    np.testing.assert_array_equal(y.array, np.broadcast_to(np.arange(3), (2, 3)))
    z = hax.broadcast_to(x, (C, A), enforce_no_extra_axes=False)
    assert z.axes == (C, A, B)
    with pytest.raises(ValueError, match=r"\['b'\]"):
        hax.broadcast_to(x, (A,))
    assert hax.broadcast_axis(hax.zeros((B, C)), (A, C)).axes == (A, B, C)
    p, q, s = hax.broadcast_arrays(hax.zeros((B, A)), hax.zeros((A,)), 3.0)
    assert p.axes == q.axes == (B, A)
    assert s == 3.0
    with pytest.raises(ValueError, match="subset"):
        hax.broadcast_arrays(hax.zeros((A,)), hax.zeros((B,)))
    u, v = hax.broadcast_arrays(hax.zeros((A,)), hax.zeros((B,)), require_subset=False)
    assert u.axes == v.axes == (A, B)


def test_rename():
    x = random_named((A, B), 0)
    y = hax.rename(x, {"a": "x", B: Axis("y", 3)})
    assert y.axes == (Axis("x", 2), Axis("y", 3))
    np.testing.assert_array_equal(y.array, x.array)
    with pytest.raises(ValueError, match="'z'"):
        x.rename({"z": "w"})
    with pytest.raises(ValueError, match="size"):
        x.rename({"a": Axis("x", 5)})


@given(axes_st(min_axes=2, max_axes=4), st.data())
def test_flatten_unflatten_roundtrip_matches_numpy(axes, data):
    x = random_named(axes, data.draw(st.integers(0, 1000)))
    merged = data.draw(st.permutations(axes).map(lambda p: p[:2]))
    f = hax.flatten_axes(x, merged, "m")
    rest = [a for a in axes if a not in merged]
    first = min(axes.index(a) for a in merged)
    before = [a for a in axes[:first] if a not in merged]
    expected_axes = (*before, Axis("m", merged[0].size * merged[1].size), *rest[len(before) :])
    assert f.axes == expected_axes
    ref = to_numpy(x, [a.name for a in before] + [a.name for a in merged] + [a.name for a in rest[len(before) :]])
    np.testing.assert_array_equal(f.array, ref.reshape([a.size for a in expected_axes]))
    back = hax.unflatten_axis(f, "m", merged)
    assert bool(hax.array_equal(back, x))


def test_ravel_split_unbind_roll():
    x = random_named((A, B), 0)
    r = hax.ravel(x, "flat")
    assert r.axes == (Axis("flat", 6),)
    np.testing.assert_array_equal(r.array, np.asarray(x.array).reshape(-1))
    assert hax.flatten(x, "f").axes == (Axis("f", 6),)
    p, q = hax.split(x, "b", [Axis("b1", 1), Axis("b2", 2)])
    assert p.axes == (A, Axis("b1", 1))
    assert q.axes == (A, Axis("b2", 2))
    np.testing.assert_array_equal(q.array, np.asarray(x.array)[:, 1:])
    with pytest.raises(ValueError, match="add up"):
        hax.split(x, "b", [Axis("b1", 1)])
    parts = hax.unbind(x, "b")
    assert len(parts) == 3
    assert parts[2].axes == (A,)
    np.testing.assert_array_equal(parts[2].array, np.asarray(x.array)[:, 2])
    np.testing.assert_array_equal(hax.roll(x, 1, "b").array, np.roll(np.asarray(x.array), 1, 1))
    np.testing.assert_array_equal(x.roll((1, 2), ("a", "b")).array, np.roll(np.asarray(x.array), (1, 2), (0, 1)))


def test_annotations():
    x = hax.zeros((A, B))
    assert isinstance(x, NamedArray["a b"])
    assert isinstance(x, NamedArray["a", "b"])
    assert isinstance(x, NamedArray["a ..."])
    assert isinstance(x, NamedArray[..., "b"])
    assert not isinstance(x, NamedArray["b a"])
    assert not isinstance(x, NamedArray["a"])
    assert NamedArray["a b"] is NamedArray[("a", "b")]
    with pytest.raises(TypeError):
        NamedArray["... a ..."]


def test_astype_and_method_forms():
    x = random_named((A, B), 3)
    assert x.astype(jnp.int32).dtype == jnp.int32
    np.testing.assert_allclose(x.sum("a").array, np.asarray(x.array).sum(0), rtol=1e-6)
    np.testing.assert_allclose(x.mean().array, np.asarray(x.array).mean(), rtol=1e-5)
    assert x.argmax("b").axes == (A,)
    np.testing.assert_allclose(x.cumsum("b").array, np.cumsum(np.asarray(x.array), 1), rtol=1e-5)
    np.testing.assert_array_equal(x.sort("b").array, np.sort(np.asarray(x.array), 1))
    np.testing.assert_array_equal((-x).array, -np.asarray(x.array))
    np.testing.assert_array_equal(abs(x).array, np.abs(np.asarray(x.array)))
