"""haxtyping: dtype-qualified NamedArray annotations, checked against NumPy's dtype rules."""

import typing

import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest

import ponente.namedtensor as hax
from ponente.namedtensor import NamedArray
from ponente.namedtensor import haxtyping as ht

EXACT = {
    "f16": np.float16,
    "bf16": jnp.bfloat16,
    "f32": np.float32,
    "i8": np.int8,
    "i16": np.int16,
    "i32": np.int32,
    "u8": np.uint8,
    "u32": np.uint32,
    "bool_": np.bool_,
    "complex64": np.complex64,
}
FAMILIES = {"Float": np.floating, "Int": np.signedinteger, "UInt": np.unsignedinteger, "Complex": np.complexfloating}


@pytest.mark.parametrize("name", sorted(EXACT))
def test_exact_dtype_annotations(name):
    ann = getattr(ht, name)["b c"]
    spec = typing.get_args(ann)[1]
    assert typing.get_args(ann)[0] is NamedArray
    assert spec.before == ("b", "c")
    assert np.dtype(spec.dtype) == np.dtype(EXACT[name])
    assert typing.get_args(getattr(ht, name)[NamedArray, "b c"])[1] == spec
    for other in EXACT.values():
        x = hax.zeros({"b": 1, "c": 2}, dtype=other)
        assert x.matches_axes(ann) == (np.dtype(other) == np.dtype(EXACT[name]))


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_dtype_families(name):
    ann = getattr(ht, name)["b ..."]
    assert str(typing.get_args(ann)[1].dtype) == name.lower()
    for other in EXACT.values():
        x = hax.zeros({"b": 1, "c": 2}, dtype=other)
        # NumPy does not know bfloat16 (a float to JAX)
        expected = name == "Float" if other is jnp.bfloat16 else bool(np.issubdtype(np.dtype(other), FAMILIES[name]))
        assert x.matches_axes(ann) == expected
        assert isinstance(x, ann) == expected


def test_named_is_axes_only_and_other_bases_go_to_jaxtyping():
    assert typing.get_args(ht.Named[NamedArray, "b c"])[1] == typing.get_args(NamedArray["b c"])[1]
    plain = ht.f32[jax.Array, "b c"]
    assert issubclass(plain, jaxtyping.AbstractArray)
    assert plain.dtypes == jaxtyping.Float32[jax.Array, "b c"].dtypes
    assert isinstance(jnp.zeros((1, 2), jnp.float32), plain)
    assert not isinstance(jnp.zeros((1, 2), jnp.int32), plain)
    assert isinstance(jnp.zeros(3, jnp.int8), ht.Int[jax.Array, "b"])
    assert hax.Named is ht.Named
