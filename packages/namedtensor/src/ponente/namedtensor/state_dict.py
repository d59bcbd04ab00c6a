"""PyTorch-style flat state dicts (``{"layers.0.mlp.weight": array}``) for modules, and safetensors files.

:func:`to_state_dict` walks a module: each field contributes its name to the key (lists and tuples
their index), and a module can rename or drop key components with ``_state_dict_key_map()`` (see
:class:`ModuleWithStateDictSerialization`). Stacked layers (``nn.Stacked``) become numbered
per-layer keys. :func:`to_torch_compatible_state_dict` additionally flattens multi-axis layers to
PyTorch's layout (a ``Linear`` weight becomes 2-D, a ``LayerNorm`` scale 1-D) with each module's
``flatten_for_export`` (see :func:`flatten_modules_for_export`); :func:`from_torch_compatible_state_dict`
undoes it.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, cast

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .core import NamedArray
from .tree_util import scan_aware_tree_map

__all__ = [
    "ModuleWithStateDictSerialization",
    "StateDict",
    "flatten_linear_layers",
    "flatten_modules_for_export",
    "from_state_dict",
    "from_torch_compatible_state_dict",
    "load_state_dict",
    "save_state_dict",
    "stack_state_dict",
    "to_numpy_state_dict",
    "to_state_dict",
    "to_torch_compatible_state_dict",
    "unflatten_linear_layers",
    "unflatten_modules_from_export",
    "unstack_state_dict",
    "with_prefix",
]

T = TypeVar("T")

StateDict = dict[str, Any]
"""A flat mapping from dotted keys (``"layers.0.attn.q_proj.weight"``) to arrays."""


def with_prefix(prefix: str | None, leaf: str | None) -> str | None:
    """Join two key components with a dot; None on either side means "nothing to add".

    Args:
        prefix: the outer key, or None.
        leaf: the inner component, or None.

    Returns:
        ``"prefix.leaf"``, or whichever is not None (None if both are).

    Example:
        >>> with_prefix("model", "embed"), with_prefix(None, "embed"), with_prefix("model", None)
        ('model.embed', 'embed', 'model')
    """
    if prefix is None:
        return leaf
    if leaf is None:
        return prefix
    return f"{prefix}.{leaf}"


class ModuleWithStateDictSerialization(eqx.Module):
    """Base class for modules that customize their state-dict keys or their PyTorch layout.

    Override ``_state_dict_key_map`` to rename fields (``{"weight": "kernel"}``) or to drop a level
    (``{"inner": None}`` puts ``inner``'s keys directly under this module's prefix). For full control,
    override ``to_state_dict``/``from_state_dict`` (that is how ``nn.Stacked`` numbers its layers).
    Override ``flatten_for_export``/``unflatten_from_export`` to change the array layout of PyTorch
    exports (``nn.Linear`` merges its input axes and its output axes into one axis each).

    Example:
        >>> import ponente.namedtensor as hax
        >>> class Norm(ModuleWithStateDictSerialization):
        ...     scale: hax.NamedArray
        ...
        ...     def _state_dict_key_map(self):
        ...         return {"scale": "weight"}
        >>> list(to_state_dict(Norm(hax.ones({"embed": 2})), "ln"))
        ['ln.weight']
    """

    def _state_dict_key_map(self) -> dict[str, str | None]:
        """Field name -> key component (None: no component). Fields not listed keep their names."""
        return {}

    def to_state_dict(self, prefix: str | None = None) -> StateDict:
        """This module's arrays as a flat state dict under ``prefix``.

        Args:
            prefix: the key of this module (None at the root).

        Returns:
            The state dict.
        """
        return _fields_to_state_dict(self, prefix, self._state_dict_key_map())

    def from_state_dict(self: T, state_dict: Mapping[str, Any], prefix: str | None = None) -> T:
        """A copy of this module with its arrays read from ``state_dict`` under ``prefix``.

        Args:
            state_dict: the flat state dict.
            prefix: the key of this module (None at the root).

        Returns:
            The new module.
        """
        module = cast(ModuleWithStateDictSerialization, self)
        return cast(T, _fields_from_state_dict(module, state_dict, prefix, module._state_dict_key_map()))

    def flatten_for_export(self: T) -> T:
        """This module in PyTorch's layout (used by :func:`to_torch_compatible_state_dict`); the default is itself.

        Submodules are flattened separately by :func:`flatten_modules_for_export`; stacked layers arrive one layer
        at a time.

        Returns:
            The module with export-shaped arrays (it need not be callable).
        """
        return self

    def unflatten_from_export(self: T, template: T) -> T:
        """Undo :meth:`flatten_for_export`; the default returns this module unchanged.

        Args:
            template: the module as it should be (its axes and static fields; its values are ignored).

        Returns:
            This module's values in ``template``'s layout.
        """
        del template
        return self


def _fields(module: eqx.Module) -> list[dataclasses.Field[Any]]:
    return [f for f in dataclasses.fields(module) if not f.metadata.get("static", False)]


def _fields_to_state_dict(module: eqx.Module, prefix: str | None, key_map: Mapping[str, str | None]) -> StateDict:
    out: StateDict = {}
    for field in _fields(module):
        out.update(
            to_state_dict(getattr(module, field.name), with_prefix(prefix, key_map.get(field.name, field.name)))
        )
    return out


def _replace_fields(module: Any, updates: Mapping[str, Any]) -> Any:
    """A copy of ``module`` with some fields replaced, bypassing ``__init__`` (as pytree unflattening does)."""
    new = object.__new__(type(module))
    for field in dataclasses.fields(module):
        object.__setattr__(new, field.name, updates.get(field.name, getattr(module, field.name)))
    return new


def _fields_from_state_dict(
    module: eqx.Module, state_dict: Mapping[str, Any], prefix: str | None, key_map: Mapping[str, str | None]
) -> eqx.Module:
    updates = {
        f.name: from_state_dict(getattr(module, f.name), state_dict, with_prefix(prefix, key_map.get(f.name, f.name)))
        for f in _fields(module)
    }
    return _replace_fields(module, updates)


def to_state_dict(tree: Any, prefix: str | None = None) -> StateDict:
    """Flatten the arrays of a module (or any pytree) into a dict keyed by dotted paths.

    NamedArrays contribute their array (axes in stored order); plain arrays themselves; lists and
    tuples number their entries; dicts use their keys; other values (configuration, None) nothing.

    Args:
        tree: the module or pytree.
        prefix: a key prefix for everything (None: none).

    Returns:
        The state dict (values are JAX arrays).

    Raises:
        ValueError: if the root itself is an array and no ``prefix`` is given.

    Example:
        >>> import ponente.namedtensor as hax
        >>> sorted(to_state_dict({"w": hax.ones({"embed": 2}), "layers": [hax.zeros({"embed": 2})]}))
        ['layers.0', 'w']
    """
    if isinstance(tree, ModuleWithStateDictSerialization):
        return tree.to_state_dict(prefix)
    if isinstance(tree, NamedArray) or eqx.is_array(tree):
        if prefix is None:
            raise ValueError("to_state_dict: an array needs a key; pass prefix=...")
        return {prefix: tree.array if isinstance(tree, NamedArray) else tree}
    if isinstance(tree, eqx.Module):
        return _fields_to_state_dict(tree, prefix, {})
    if isinstance(tree, (list, tuple)):
        out: StateDict = {}
        for i, item in enumerate(tree):
            out.update(to_state_dict(item, with_prefix(prefix, str(i))))
        return out
    if isinstance(tree, Mapping):
        out = {}
        for key, item in tree.items():
            out.update(to_state_dict(item, with_prefix(prefix, str(key))))
        return out
    return {}


def _missing_key(key: str, state_dict: Mapping[str, Any]) -> KeyError:
    parent = key.rsplit(".", 1)[0] if "." in key else ""
    near = sorted(k for k in state_dict if k.startswith(parent))[:8] if parent else []
    hint = f"; keys under {parent!r}: {near}" if near else f"; the state dict has {len(state_dict)} keys"
    return KeyError(f"from_state_dict: key {key!r} is missing from the state dict{hint}")


def _load_array(template: Any, value: Any, key: str) -> Any:
    shape = tuple(template.shape) if not isinstance(template, NamedArray) else tuple(template.array.shape)
    found = tuple(np.shape(value))
    if found != shape:
        what = f"axes {template.axes}" if isinstance(template, NamedArray) else f"shape {shape}"
        raise ValueError(f"from_state_dict: {key!r} should have {what} (shape {shape}), but has shape {found}")
    raw = template.array if isinstance(template, NamedArray) else template
    array = jnp.asarray(value, dtype=raw.dtype)
    sharding = getattr(raw, "sharding", None)
    if isinstance(raw, jax.Array) and not isinstance(raw, jax.core.Tracer) and sharding is not None:
        array = jax.device_put(array, sharding)
    return NamedArray(array, template.axes) if isinstance(template, NamedArray) else array


def from_state_dict(tree: T, state_dict: Mapping[str, Any], prefix: str | None = None) -> T:
    """A copy of ``tree`` (the template) with every array read from ``state_dict``.

    Keys are computed as in :func:`to_state_dict`. Loaded arrays take the template's dtype and, for
    placed JAX arrays, its sharding.

    Args:
        tree: the template module or pytree (its shapes are checked against the state dict).
        state_dict: the flat state dict (NumPy or JAX arrays).
        prefix: the key prefix of ``tree``.

    Returns:
        The loaded module or pytree.

    Raises:
        KeyError: if a key is missing (the message names it and lists nearby keys).
        ValueError: if an array has the wrong shape (the message names the key and both shapes).

    Example:
        >>> import numpy as np, ponente.namedtensor as hax
        >>> w = from_state_dict({"w": hax.zeros({"embed": 2})}, {"w": np.ones(2)})["w"]
        >>> w.array.tolist()
        [1.0, 1.0]
    """
    if isinstance(tree, ModuleWithStateDictSerialization):
        return tree.from_state_dict(state_dict, prefix)
    if isinstance(tree, NamedArray) or eqx.is_array(tree):
        if prefix is None:
            raise ValueError("from_state_dict: an array needs a key; pass prefix=...")
        if prefix not in state_dict:
            raise _missing_key(prefix, state_dict)
        return _load_array(tree, state_dict[prefix], prefix)
    if isinstance(tree, eqx.Module):
        return _fields_from_state_dict(tree, state_dict, prefix, {})  # type: ignore[return-value]
    if isinstance(tree, (list, tuple)):
        items = [from_state_dict(item, state_dict, with_prefix(prefix, str(i))) for i, item in enumerate(tree)]
        return type(tree)(items) if isinstance(tree, list) or type(tree) is tuple else type(tree)(*items)
    if isinstance(tree, Mapping):
        return type(tree)(  # type: ignore[call-arg]
            {k: from_state_dict(v, state_dict, with_prefix(prefix, str(k))) for k, v in tree.items()}
        )
    return tree


def unstack_state_dict(
    state_dict: Mapping[str, Any], prefix: str | None = None, num_layers: int | None = None
) -> StateDict:
    """Split stacked arrays into numbered per-layer keys: ``prefix.key`` (leading dim n) -> ``prefix.i.key``.

    Keys outside ``prefix`` are copied unchanged.

    Args:
        state_dict: a state dict whose arrays under ``prefix`` have a leading layers dimension.
        prefix: the key of the stack (None: every key).
        num_layers: the size of the layers dimension (None: each array's first dimension).

    Returns:
        The per-layer state dict.

    Raises:
        ValueError: if an array under ``prefix`` is a scalar or does not have ``num_layers`` entries along dim 0.

    Example:
        >>> import numpy as np
        >>> sorted(unstack_state_dict({"layers.w": np.zeros((2, 3))}, "layers", 2))
        ['layers.0.w', 'layers.1.w']
    """
    out: StateDict = {}
    head = "" if prefix is None else prefix + "."
    for key, value in state_dict.items():
        if not key.startswith(head):
            out[key] = value
            continue
        rest = key[len(head) :]
        shape = np.shape(value)
        if not shape or (num_layers is not None and shape[0] != num_layers):
            expected = "a layers dimension" if num_layers is None else f"{num_layers} layers"
            raise ValueError(
                f"stacked state dict entry {key!r} should have {expected} along its first dimension, "
                f"but has shape {shape}"
            )
        for i in range(shape[0]):
            out[f"{head}{i}.{rest}"] = value[i]
    return out


def stack_state_dict(
    state_dict: Mapping[str, Any], prefix: str | None = None, num_layers: int | None = None
) -> StateDict:
    """Inverse of :func:`unstack_state_dict`: numbered keys ``prefix.i.key`` are stacked into ``prefix.key``.

    Args:
        state_dict: the per-layer state dict.
        prefix: the key of the stack (None: the root).
        num_layers: the number of layers expected (None: one more than the highest layer number found).

    Returns:
        A state dict with the stacked entries (and every key not under ``prefix.<digit>`` unchanged).

    Raises:
        KeyError: if a layer is missing a key that another layer has (the message names it).

    Example:
        >>> import numpy as np
        >>> stack_state_dict({"layers.0.w": np.zeros(3), "layers.1.w": np.ones(3)}, "layers", 2)["layers.w"].shape
        (2, 3)
    """
    head = "" if prefix is None else prefix + "."
    per_layer: dict[str, dict[int, Any]] = {}
    out: StateDict = {}
    for key, value in state_dict.items():
        if key.startswith(head):
            index, sep, rest = key[len(head) :].partition(".")
            if sep and index.isdigit():
                if num_layers is not None and int(index) >= num_layers:
                    raise ValueError(f"state dict key {key!r} is for layer {index}, but there are only {num_layers}")
                per_layer.setdefault(rest, {})[int(index)] = value
                continue
        out[key] = value
    if num_layers is None:
        num_layers = 1 + max((i for layers in per_layer.values() for i in layers), default=-1)
    for rest, layers in per_layer.items():
        missing = [i for i in range(num_layers) if i not in layers]
        if missing:
            raise KeyError(f"state dict key {head}{missing[0]}.{rest!s} is missing (layers {missing} lack {rest!r})")
        values = [layers[i] for i in range(num_layers)]
        stack = jnp.stack if any(isinstance(v, jax.Array) for v in values) else np.stack
        out[f"{head}{rest}"] = stack(values)
    return out


def _is_serializable(x: Any) -> bool:
    return isinstance(x, ModuleWithStateDictSerialization)


def flatten_modules_for_export(tree: T) -> T:
    """Apply every module's ``flatten_for_export`` (see :class:`ModuleWithStateDictSerialization`), outermost first.

    Inside ``nn.Stacked``, each layer is flattened separately (a ``vmap`` over the layers axis), so a module never
    sees the layers axis. :func:`to_torch_compatible_state_dict` calls this before :func:`to_state_dict`.

    Args:
        tree: a module or pytree.

    Returns:
        The same structure in export layout (not callable in general).

    Example:
        >>> import jax, ponente.namedtensor as hax
        >>> from ponente.namedtensor.nn import Linear
        >>> lin = Linear.init(hax.Axis("embed", 4), (hax.Axis("heads", 2), hax.Axis("head", 3)), key=jax.random.key(0))
        >>> flatten_modules_for_export(lin).weight.shape
        {'__OUT__': 6, '__IN__': 4}
    """

    def flatten(node: Any) -> Any:
        if not _is_serializable(node):
            return node
        flat = node.flatten_for_export()
        return scan_aware_tree_map(flatten, flat, is_leaf=lambda x: x is not flat and _is_serializable(x))

    return scan_aware_tree_map(flatten, tree, is_leaf=_is_serializable)


def unflatten_modules_from_export(tree: T, template: T) -> T:
    """Inverse of :func:`flatten_modules_for_export`: every module's ``unflatten_from_export(template)``.

    Args:
        tree: the flattened structure (e.g. loaded from a PyTorch state dict).
        template: the original structure (gives the axes; its values are ignored).

    Returns:
        ``tree``'s values in ``template``'s layout.

    Example:
        >>> import jax, ponente.namedtensor as hax
        >>> from ponente.namedtensor.nn import Linear
        >>> lin = Linear.init(hax.Axis("embed", 4), (hax.Axis("heads", 2), hax.Axis("head", 3)), key=jax.random.key(0))
        >>> unflatten_modules_from_export(flatten_modules_for_export(lin), lin).weight.shape
        {'heads': 2, 'head': 3, 'embed': 4}
    """

    def unflatten(node: Any, like: Any) -> Any:
        if not _is_serializable(node):
            return node
        restored = node.unflatten_from_export(like)
        return scan_aware_tree_map(
            unflatten, restored, like, is_leaf=lambda x: x is not restored and _is_serializable(x)
        )

    return scan_aware_tree_map(unflatten, tree, template, is_leaf=_is_serializable)


def flatten_linear_layers(tree: T) -> T:
    """Deprecated alias of :func:`flatten_modules_for_export` (kept for one release).

    Unlike the old function, which flattened only ``Linear`` layers, it flattens every module that defines
    ``flatten_for_export`` (norms over several axes too), as Haliax does.
    """
    warnings.warn(
        "flatten_linear_layers is deprecated and will be removed in the next release; use flatten_modules_for_export",
        DeprecationWarning,
        stacklevel=2,
    )
    return flatten_modules_for_export(tree)


def unflatten_linear_layers(template: T, flattened: Any) -> T:
    """Deprecated alias of :func:`unflatten_modules_from_export` (note its argument order: ``(tree, template)``)."""
    warnings.warn(
        "unflatten_linear_layers(template, flattened) is deprecated and will be removed in the next release; use "
        "unflatten_modules_from_export(flattened, template)",
        DeprecationWarning,
        stacklevel=2,
    )
    return unflatten_modules_from_export(flattened, template)


def to_numpy_state_dict(state_dict: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Copy every array of ``state_dict`` to host memory as a NumPy array.

    Args:
        state_dict: the state dict.

    Returns:
        A dict with the same keys and NumPy values.
    """
    return {k: np.asarray(jax.device_get(v)) for k, v in state_dict.items()}


def to_torch_compatible_state_dict(
    tree: Any, *, flatten: bool = True, prefix: str | None = None, filter: Callable[[Any], bool] = eqx.is_array
) -> dict[str, np.ndarray]:
    """A state dict in PyTorch's conventions: NumPy arrays, ``Linear`` weights 2-D ``(out, in)``.

    Stacked layers appear as numbered keys (``layers.0.…``), so a ``Stacked`` model exports like a
    PyTorch ``ModuleList``.

    Args:
        tree: the module.
        flatten: put modules in PyTorch's layout first (see :func:`flatten_modules_for_export`).
        prefix: a key prefix.
        filter: which leaves to export (default: arrays).

    Returns:
        The state dict.

    Example:
        >>> import jax, ponente.namedtensor as hax
        >>> from ponente.namedtensor.nn import Linear
        >>> lin = Linear.init(hax.Axis("embed", 4), (hax.Axis("heads", 2), hax.Axis("head", 3)), key=jax.random.key(0))
        >>> to_torch_compatible_state_dict(lin)["weight"].shape
        (6, 4)
    """
    tree = eqx.filter(tree, filter)
    if flatten:
        tree = flatten_modules_for_export(tree)
    return to_numpy_state_dict(to_state_dict(tree, prefix))


def from_torch_compatible_state_dict(
    tree: T, state_dict: Mapping[str, Any], *, unflatten: bool = True, prefix: str | None = None
) -> T:
    """Load a PyTorch-convention state dict (see :func:`to_torch_compatible_state_dict`) into template ``tree``.

    The template may be abstract (``ShapeDtypeStruct`` leaves, e.g. from ``equinox.filter_eval_shape``): only its
    structure, axes and dtypes are used.

    Args:
        tree: the template module.
        state_dict: the state dict.
        unflatten: the state dict is in export layout (:func:`flatten_modules_for_export`) and must be reshaped to
            ``tree``'s axes.
        prefix: the key prefix.

    Returns:
        The loaded module.

    Raises:
        KeyError: if a key is missing.
        ValueError: if an array has the wrong shape.

    Example:
        >>> import jax, ponente.namedtensor as hax
        >>> from ponente.namedtensor.nn import Linear
        >>> lin = Linear.init(hax.Axis("embed", 4), (hax.Axis("heads", 2), hax.Axis("head", 3)), key=jax.random.key(0))
        >>> back = from_torch_compatible_state_dict(lin, to_torch_compatible_state_dict(lin))
        >>> bool((back.weight == lin.weight).all())
        True
    """
    if not unflatten:
        return from_state_dict(tree, state_dict, prefix)
    flat = from_state_dict(eqx.filter_eval_shape(flatten_modules_for_export, tree), state_dict, prefix)
    loaded = eqx.filter_jit(_unflatten_into)(flat, tree)
    return jax.tree_util.tree_map(_place_like, loaded, tree)


def _unflatten_into(flat: Any, template: Any) -> Any:
    # an abstract template only lends its axes: give it placeholder values (unused, so compiled away)
    def placeholder(x: Any) -> Any:
        return jnp.zeros(x.shape, x.dtype) if isinstance(x, jax.ShapeDtypeStruct) else x

    return unflatten_modules_from_export(flat, jax.tree_util.tree_map(placeholder, template))


def _place_like(x: Any, like: Any) -> Any:
    """``x`` with the sharding of ``like`` when ``like`` is a placed (not traced) JAX array."""
    if isinstance(x, jax.Array) and isinstance(like, jax.Array) and not isinstance(like, jax.core.Tracer):
        return jax.device_put(x, like.sharding)
    return x


def save_state_dict(state_dict: Mapping[str, Any], path: str | os.PathLike[str]) -> None:
    """Write ``state_dict`` to a safetensors file (arrays are gathered to host memory; None entries are skipped).

    The file's metadata says ``format: pt``, which Hugging Face ``transformers`` expects.

    Args:
        state_dict: the state dict.
        path: the file to write.

    Example:
        >>> import numpy as np, tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
        >>> save_state_dict({"w": np.ones(2, np.float32), "b": None}, path)
        >>> sorted(load_state_dict(path))
        ['w']
    """
    from safetensors.numpy import save_file

    present = {k: v for k, v in state_dict.items() if v is not None}
    arrays = {k: np.ascontiguousarray(v) for k, v in to_numpy_state_dict(present).items()}
    save_file(arrays, os.fspath(path), metadata={"format": "pt"})


def load_state_dict(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """Read a safetensors file into a state dict of NumPy arrays.

    Args:
        path: the file.

    Returns:
        The state dict.

    Raises:
        FileNotFoundError: if ``path`` does not exist.
    """
    from safetensors.numpy import load_file

    if not os.path.exists(path):
        raise FileNotFoundError(f"load_state_dict: no such safetensors file: {os.fspath(path)!r}")
    return load_file(os.fspath(path))
