"""Dtype-qualified NamedArray annotations: ``f32["batch embed"]``, ``Float["batch ..."]``, ``Named[NamedArray, "b"]``.

Each name is subscripted with an axes spec (as for ``NamedArray[...]``) or with ``(NamedArray, spec)``;
the result is ``Annotated[NamedArray, NamedArrayAxes(..., dtype=...)]``, which
:meth:`~ponente.namedtensor.NamedArray.matches_axes` and ``isinstance`` check at run time. A base other than
``NamedArray`` (``f32[jax.Array, "b c"]``) is handed to the jaxtyping annotation of the same dtype.

- exact dtypes: ``f16``, ``bf16``, ``f32``, ``f64``, ``i8``...``i64``, ``u8``...``u64``, ``bool_``, ``complex64``,
  ``complex128``;
- dtype families (any member matches): ``Float``, ``Int`` (signed), ``UInt``, ``Complex``;
- ``Named``: axes only, any dtype.

Example:
    ```python
    import jax.numpy as jnp
    import ponente.namedtensor as hax
    from ponente.namedtensor.haxtyping import Float, Int, f32


    def scale(x: f32["batch embed"]) -> f32["batch embed"]:  # noqa: F722
        return x * 2


    x = hax.ones({"batch": 2, "embed": 3}, dtype=jnp.float32)
    assert x.matches_axes(f32["batch embed"]) and x.matches_axes(Float["batch ..."])
    assert not x.matches_axes(Int["batch embed"])
    ```
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import jax.numpy as jnp
import jaxtyping

from .annotation import DTypeCategory, NamedArrayAxes, named_array_annotation
from .core import NamedArray

__all__ = [
    "Complex",
    "DTypeCategory",
    "Float",
    "Int",
    "Named",
    "UInt",
    "bf16",
    "bool_",
    "complex64",
    "complex128",
    "f16",
    "f32",
    "f64",
    "i8",
    "i16",
    "i32",
    "i64",
    "u8",
    "u16",
    "u32",
    "u64",
]


class _DTypeAnnotation:
    """``name[spec]`` or ``name[NamedArray, spec]``: a NamedArray annotation that also requires a dtype."""

    def __init__(self, name: str, dtype: Any, jaxtyping_name: str) -> None:
        self._name = name
        self._dtype = dtype
        self._jaxtyping = getattr(jaxtyping, jaxtyping_name)

    def __getitem__(self, item: Any) -> Any:
        base: Any = NamedArray
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], type):
            base, item = item
        if base is not NamedArray:
            return self._jaxtyping[base, item]
        spec = NamedArrayAxes.parse(item)
        if self._dtype is not None and spec.dtype is None:
            spec = dataclasses.replace(spec, dtype=self._dtype)
        return named_array_annotation(NamedArray, spec)

    def __repr__(self) -> str:
        return f"ponente.namedtensor.haxtyping.{self._name}"


if TYPE_CHECKING:
    # type checkers see ``name[NamedArray, spec]`` as ``NamedArray`` (the spec is metadata)
    from typing import Annotated as Complex
    from typing import Annotated as Float
    from typing import Annotated as Int
    from typing import Annotated as Named
    from typing import Annotated as UInt
    from typing import Annotated as bf16  # noqa: N813
    from typing import Annotated as bool_  # noqa: N813
    from typing import Annotated as complex64  # noqa: N813
    from typing import Annotated as complex128  # noqa: N813
    from typing import Annotated as f16  # noqa: N813
    from typing import Annotated as f32  # noqa: N813
    from typing import Annotated as f64  # noqa: N813
    from typing import Annotated as i8  # noqa: N813
    from typing import Annotated as i16  # noqa: N813
    from typing import Annotated as i32  # noqa: N813
    from typing import Annotated as i64  # noqa: N813
    from typing import Annotated as u8  # noqa: N813
    from typing import Annotated as u16  # noqa: N813
    from typing import Annotated as u32  # noqa: N813
    from typing import Annotated as u64  # noqa: N813
else:
    f16 = _DTypeAnnotation("f16", jnp.float16, "Float16")
    bf16 = _DTypeAnnotation("bf16", jnp.bfloat16, "BFloat16")
    f32 = _DTypeAnnotation("f32", jnp.float32, "Float32")
    f64 = _DTypeAnnotation("f64", jnp.float64, "Float64")
    i8 = _DTypeAnnotation("i8", jnp.int8, "Int8")
    i16 = _DTypeAnnotation("i16", jnp.int16, "Int16")
    i32 = _DTypeAnnotation("i32", jnp.int32, "Int32")
    i64 = _DTypeAnnotation("i64", jnp.int64, "Int64")
    u8 = _DTypeAnnotation("u8", jnp.uint8, "UInt8")
    u16 = _DTypeAnnotation("u16", jnp.uint16, "UInt16")
    u32 = _DTypeAnnotation("u32", jnp.uint32, "UInt32")
    u64 = _DTypeAnnotation("u64", jnp.uint64, "UInt64")
    bool_ = _DTypeAnnotation("bool_", jnp.bool_, "Bool")
    complex64 = _DTypeAnnotation("complex64", jnp.complex64, "Complex64")
    complex128 = _DTypeAnnotation("complex128", jnp.complex128, "Complex128")

    Float = _DTypeAnnotation("Float", DTypeCategory("float", jnp.floating), "Float")
    Int = _DTypeAnnotation("Int", DTypeCategory("int", jnp.signedinteger), "Int")
    UInt = _DTypeAnnotation("UInt", DTypeCategory("uint", jnp.unsignedinteger), "UInt")
    Complex = _DTypeAnnotation("Complex", DTypeCategory("complex", jnp.complexfloating), "Complex")

    Named = _DTypeAnnotation("Named", None, "Shaped")
    """Axes only, any dtype: ``Named[NamedArray, "batch embed"]`` is ``NamedArray["batch embed"]``."""
