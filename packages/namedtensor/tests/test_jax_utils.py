"""Tests for ``named_call``, ``maybe_rng_split``, ``shaped_rng_split`` and ``is_in_jit``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ponente.namedtensor.jax_utils import is_in_jit, maybe_rng_split, named_call, shaped_rng_split


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
