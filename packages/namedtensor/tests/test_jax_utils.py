"""Tests for ``named_call``, ``maybe_rng_split``, ``shaped_rng_split``, ``is_in_jit`` and ``tree_checkpoint_name``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ponente.namedtensor as hax
from ponente.namedtensor.jax_utils import (
    is_in_jit,
    maybe_rng_split,
    named_call,
    shaped_rng_split,
    tree_checkpoint_name,
)


def test_named_call_forms_and_scope_in_hlo():
    def attention(x):
        return x * 2

    for wrapped in (named_call(attention), named_call(attention, "my_block"), named_call(name="other")(attention)):
        assert wrapped(3.0) == 6.0
        assert wrapped.__name__ == "attention"
    text = jax.jit(named_call(lambda x: jnp.sin(x), "my_block")).lower(1.0).as_text(debug_info=True)
    assert "my_block" in text


def test_maybe_rng_split():
    assert maybe_rng_split(None, 3) == [None, None, None]
    key = jax.random.key(0)
    keys = maybe_rng_split(key, 4)
    np.testing.assert_array_equal(jax.random.key_data(keys), jax.random.key_data(jax.random.split(key, 4)))


@pytest.mark.parametrize("key", [jax.random.key(1), jax.random.PRNGKey(1)])
def test_shaped_rng_split(key):
    keys = shaped_rng_split(key, (2, 3))
    flat = jax.random.split(key, 6)
    assert keys.shape == (2, 3, *key.shape)
    np.testing.assert_array_equal(
        jax.random.key_data(keys).reshape(6, -1) if keys.dtype != jnp.uint32 else keys.reshape(6, -1),
        jax.random.key_data(flat).reshape(6, -1) if flat.dtype != jnp.uint32 else flat.reshape(6, -1),
    )
    assert shaped_rng_split(key, 4).shape == (4, *key.shape)
    assert shaped_rng_split(key, ()) is key


def test_is_in_jit():
    assert is_in_jit() is False
    assert bool(jax.jit(lambda: jnp.asarray(is_in_jit()))())
    seen = []
    jax.lax.scan(lambda c, x: (seen.append(is_in_jit()) or c, None), 0.0, jnp.ones(2))
    jax.grad(lambda x: seen.append(is_in_jit()) or x**2)(1.0)
    assert seen == [True, False]


def test_tree_checkpoint_name_tags_every_array_and_keeps_values():
    tree = {"h": hax.arange(hax.Axis("embed", 3), dtype=float), "raw": jnp.ones(2), "n": 7}
    arrays = {k: v for k, v in tree.items() if k != "n"}
    jaxpr = jax.make_jaxpr(lambda t: tree_checkpoint_name({**t, "n": 7}, "h"))(arrays)
    names = [eqn.params["name"] for eqn in jaxpr.jaxpr.eqns if eqn.primitive.name == "name"]
    assert names == ["h", "h"]  # the NamedArray's array and the plain array; the int is not tagged
    out = tree_checkpoint_name(tree, "h")
    np.testing.assert_array_equal(out["h"].array, [0.0, 1.0, 2.0])
    assert out["h"].axes == tree["h"].axes
    assert out["n"] == 7
