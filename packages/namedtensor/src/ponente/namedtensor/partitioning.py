"""Sharding by axis name: logical axes of NamedArrays are mapped onto the named axes of a device mesh.

Model code only names axes (``"batch"``, ``"embed"``, ``"mlp"``). A *resource mapping* such as
``{"batch": "data", "mlp": "model"}`` says which mesh axis each logical axis is split over; the
functions here turn that mapping into :class:`jax.sharding.NamedSharding`s. Training with FSDP or
with tensor parallelism is then a matter of choosing two mappings: one for stored parameters and one
for computation (see :func:`fsdp`).

The mesh comes from the ``mesh=`` argument, else from the surrounding :func:`named_jit` call, else
from ``jax.set_mesh`` (or the older ``with mesh:``). :func:`make_mesh` builds a mesh from a
``{name: size}`` dictionary.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import logging
import math
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import equinox as eqx
import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

from .axis import Axis, AxisSelector
from .core import NamedArray

__all__ = [
    "CompiledCall",
    "PhysicalAxisSpec",
    "ResourceAxis",
    "ResourceMapping",
    "auto_sharded",
    "axis_mapping",
    "current_mesh",
    "current_thread_local_mapping",
    "fsdp",
    "infer_resource_partitions",
    "make_mesh",
    "named_jit",
    "physical_axis_name",
    "physical_axis_size",
    "pspec_for",
    "pspec_for_axis",
    "round_axis_for_partitioning",
    "set_mesh",
    "shard",
    "shard_with_axis_mapping",
    "sharding_for_axis",
]

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])

PhysicalAxisSpec = str | Sequence[str] | None
"""A mesh axis name, several mesh axis names (the logical axis is split over their product), or None."""

ResourceMapping = Mapping[str, PhysicalAxisSpec]
"""Maps logical axis names (of NamedArrays) to mesh axis names, e.g. ``{"batch": "data", "mlp": "model"}``."""


class ResourceAxis(enum.StrEnum):
    """Conventional mesh axis names: ``"model"`` (tensor parallel), ``"data"`` (data/FSDP), ``"replica"``.

    Members are strings, so ``ResourceAxis.DATA == "data"`` and they can be used anywhere a mesh axis
    name is expected.
    """

    MODEL = "model"
    DATA = "data"
    REPLICA = "replica"


class _Context(threading.local):
    def __init__(self) -> None:
        self.mappings: list[ResourceMapping] = []
        self.meshes: list[Mesh] = []


_context = _Context()


def _physical_name(value: Any) -> Any:
    """Normalizes ResourceAxis members (and sequences of them) to plain strings."""
    if value is None:
        return None
    if isinstance(value, ResourceAxis):
        return value.value
    if isinstance(value, str):
        return value
    return tuple(v.value if isinstance(v, ResourceAxis) else v for v in value)


def _normalize(mapping: ResourceMapping) -> dict[str, PhysicalAxisSpec]:
    return {str(getattr(k, "value", k)): _physical_name(v) for k, v in mapping.items()}


@contextlib.contextmanager
def axis_mapping(mapping: ResourceMapping, *, merge: bool = False, **kwargs: PhysicalAxisSpec) -> Iterator[None]:
    """Make ``mapping`` the thread-local resource mapping for the duration of the ``with`` block.

    :func:`shard`, :func:`auto_sharded`, :func:`named_jit` and the query functions use it when no
    mapping is passed explicitly. Contexts nest; leaving one restores the previous mapping.

    Args:
        mapping: logical axis name -> mesh axis name(s).
        merge: if True, ``mapping`` is laid over the current mapping instead of replacing it.
        **kwargs: more entries, added to ``mapping``.

    Yields:
        Nothing.

    Example:
        >>> import ponente.namedtensor.partitioning as P
        >>> with P.axis_mapping({"batch": "data"}):
        ...     P.physical_axis_name("batch")
        'data'
    """
    new = _normalize({**mapping, **kwargs})
    if merge and _context.mappings:
        new = {**_context.mappings[-1], **new}
    _context.mappings.append(new)
    try:
        yield
    finally:
        _context.mappings.pop()


def current_thread_local_mapping() -> ResourceMapping | None:
    """The innermost mapping set by :func:`axis_mapping` in this thread, or None.

    Returns:
        The mapping, or None outside any :func:`axis_mapping` block.
    """
    return _context.mappings[-1] if _context.mappings else None


@contextlib.contextmanager
def _using_mesh(mesh: Mesh | None) -> Iterator[None]:
    if mesh is None:
        yield
        return
    _context.meshes.append(mesh)
    try:
        yield
    finally:
        _context.meshes.pop()


def _legacy_mesh() -> Mesh | None:
    """The mesh of a (deprecated) ``with mesh:`` block, if JAX still tracks one."""
    from jax._src import mesh as mesh_lib  # private, but the only place the legacy context lives

    env = getattr(getattr(mesh_lib, "thread_resources", None), "env", None)
    mesh = getattr(env, "physical_mesh", None)
    return mesh if isinstance(mesh, Mesh) and not mesh.empty else None


def current_mesh() -> Mesh | None:
    """The concrete mesh in effect: set by :func:`named_jit`, ``jax.set_mesh`` or ``with mesh:``; else None.

    Inside ``jax.jit`` (but outside :func:`named_jit`) only the abstract mesh is known, so this returns
    None there; :func:`shard` then uses the abstract mesh.

    Returns:
        The mesh, or None.
    """
    if _context.meshes:
        return _context.meshes[-1]
    try:
        mesh = jax.sharding.get_mesh()
    except ValueError:  # inside jit: only the abstract mesh is available
        mesh = None
    if isinstance(mesh, Mesh) and not mesh.empty:
        return mesh
    return _legacy_mesh()


def set_mesh(mesh: Mesh) -> contextlib.AbstractContextManager[Any]:
    """Make ``mesh`` the current mesh inside a ``with`` block (``jax.set_mesh``, under Haliax's name).

    :func:`shard`, :func:`named_jit` and the query functions find the mesh there when none is passed.

    Args:
        mesh: the device mesh.

    Returns:
        A context manager; leaving it restores the previous mesh.

    Example:
        >>> with set_mesh(make_mesh({"data": -1})):
        ...     current_mesh().axis_names
        ('data',)
    """
    return jax.set_mesh(mesh)


def _mesh_shape(mesh: Mesh | AbstractMesh | None) -> Mapping[str, int]:
    if mesh is None:
        mesh = current_mesh()
    if mesh is None:
        abstract = jax.sharding.get_abstract_mesh()
        if abstract.empty:
            raise ValueError(
                "no device mesh: pass mesh=..., call inside named_jit, or set one with jax.set_mesh(mesh) "
                "(ponente.namedtensor.partitioning.make_mesh builds one)"
            )
        mesh = abstract
    return dict(mesh.shape)


def make_mesh(
    axes: Mapping[str, int],
    *,
    devices: Sequence[Any] | None = None,
    axis_types: AxisType | Sequence[AxisType] = AxisType.Auto,
) -> Mesh:
    """Build a :class:`jax.sharding.Mesh` from ``{axis name: size}``; one size may be -1 (all remaining devices).

    Axes are laid out in dictionary order (the last varies fastest, so put the axis that communicates
    most, usually ``"model"``, last). Axes default to ``AxisType.Auto`` so that sharding follows the
    constraints set by :func:`shard` and :func:`named_jit`.

    Args:
        axes: mesh axis names and sizes; at most one size may be -1.
        devices: the devices to use (default: ``jax.devices()``).
        axis_types: one ``jax.sharding.AxisType`` for all axes, or one per axis.

    Returns:
        The mesh.

    Raises:
        ValueError: if there are no axes, a size is not positive (or -1), more than one size is -1,
            or the sizes do not multiply to the number of devices; the message names the axes.

    Example:
        >>> mesh = make_mesh({"data": -1, "model": 1})
        >>> mesh.axis_names
        ('data', 'model')
    """
    devs = list(jax.devices() if devices is None else devices)
    if not axes:
        raise ValueError("make_mesh: need at least one axis, e.g. {'data': -1}")
    names = [str(getattr(n, "value", n)) for n in axes]
    sizes = [int(s) for s in axes.values()]
    for name, size in zip(names, sizes):
        if size != -1 and size < 1:
            raise ValueError(f"make_mesh: axis {name!r} has size {size}; sizes must be positive or -1")
    wild = [name for name, size in zip(names, sizes) if size == -1]
    if len(wild) > 1:
        raise ValueError(f"make_mesh: only one axis may have size -1, but {wild} do")
    known = math.prod(s for s in sizes if s != -1)
    if wild:
        if len(devs) % known != 0:
            raise ValueError(
                f"make_mesh: the fixed axes {dict(zip(names, sizes))} need a multiple of {known} devices, "
                f"but there are {len(devs)}, so axis {wild[0]!r} cannot be inferred"
            )
        sizes = [len(devs) // known if s == -1 else s for s in sizes]
    if math.prod(sizes) != len(devs):
        raise ValueError(
            f"make_mesh: axes {dict(zip(names, sizes))} need {math.prod(sizes)} devices, but there are {len(devs)}"
        )
    types = (axis_types,) * len(names) if isinstance(axis_types, AxisType) else tuple(axis_types)
    if len(types) != len(names):
        raise ValueError(f"make_mesh: got {len(types)} axis_types for the {len(names)} axes {names}")
    return Mesh(np.array(devs, dtype=object).reshape(sizes), tuple(names), axis_types=types)


def _resolve_mapping(mapping: ResourceMapping | None) -> ResourceMapping | None:
    if mapping is not None:
        return _normalize(mapping)
    return current_thread_local_mapping()


def _axis_name(axis: AxisSelector) -> str:
    return axis if isinstance(axis, str) else axis.name


def physical_axis_name(axis: AxisSelector, mapping: ResourceMapping | None = None) -> PhysicalAxisSpec:
    """The mesh axis (or axes) that logical ``axis`` is mapped to, or None if it is not mapped.

    Args:
        axis: the logical axis or its name.
        mapping: the resource mapping (default: the one from :func:`axis_mapping`).

    Returns:
        A mesh axis name, a tuple of names, or None.

    Example:
        >>> physical_axis_name("mlp", {"mlp": "model"})
        'model'
    """
    resolved = _resolve_mapping(mapping)
    if resolved is None:
        return None
    return _physical_name(resolved.get(_axis_name(axis)))


def physical_axis_size(
    axis: AxisSelector, mapping: ResourceMapping | None = None, *, mesh: Mesh | None = None
) -> int | None:
    """How many shards logical ``axis`` is split into: the product of its mesh axes' sizes (None if unmapped).

    Args:
        axis: the logical axis or its name.
        mapping: the resource mapping (default: the one from :func:`axis_mapping`).
        mesh: the mesh (default: the current mesh).

    Returns:
        The number of shards, or None if ``axis`` is not mapped.

    Raises:
        ValueError: if ``axis`` is mapped to a mesh axis the mesh does not have, or there is no mesh.
    """
    physical = physical_axis_name(axis, mapping)
    if physical is None:
        return None
    shape = _mesh_shape(mesh)
    names = (physical,) if isinstance(physical, str) else tuple(physical)
    for name in names:
        if name not in shape:
            raise ValueError(
                f"axis {_axis_name(axis)!r} is mapped to mesh axis {name!r}, but the mesh only has {list(shape)}"
            )
    return math.prod(shape[n] for n in names)


def round_axis_for_partitioning(
    axis: Axis, mapping: ResourceMapping | None = None, *, mesh: Mesh | None = None
) -> Axis:
    """``axis`` with its size rounded up to a multiple of its number of shards (unchanged if unmapped).

    Useful for vocabularies: pad ``Vocab`` so it splits evenly over the ``model`` axis.

    Args:
        axis: the logical axis.
        mapping: the resource mapping (default: the one from :func:`axis_mapping`).
        mesh: the mesh (default: the current mesh).

    Returns:
        An axis with the same name and a size divisible by its number of shards.

    Example:
        >>> round_axis_for_partitioning(Axis("vocab", 10), {"vocab": "data"}, mesh=make_mesh({"data": 1}))
        Axis(name='vocab', size=10)
    """
    shards = physical_axis_size(axis, mapping, mesh=mesh)
    if shards is None:
        return axis
    return Axis(axis.name, -(-axis.size // shards) * shards)


def pspec_for_axis(axes: Sequence[AxisSelector], mapping: ResourceMapping | None = None) -> PartitionSpec:
    """The :class:`jax.sharding.PartitionSpec` for an array with logical ``axes`` under ``mapping``.

    Args:
        axes: the array's axes (or names), in order.
        mapping: the resource mapping (default: the one from :func:`axis_mapping`; none means replicated).

    Returns:
        One entry per axis: its mesh axis (or axes), or None.

    Raises:
        ValueError: if two axes of the array map to the same mesh axis (JAX cannot split two
            dimensions over one mesh axis); the message names both axes.

    Example:
        >>> pspec_for_axis(["batch", "embed"], {"batch": "data"})
        P('data', None)
    """
    entries: list[Any] = []
    owner: dict[str, str] = {}
    for axis in axes:
        physical = physical_axis_name(axis, mapping)
        entries.append(physical)
        if physical is None:
            continue
        for name in (physical,) if isinstance(physical, str) else physical:
            if name in owner:
                raise ValueError(
                    f"axes {owner[name]!r} and {_axis_name(axis)!r} of one array are both mapped to mesh axis "
                    f"{name!r}; map at most one of them"
                )
            owner[name] = _axis_name(axis)
    return PartitionSpec(*entries)


def sharding_for_axis(
    axes: Sequence[AxisSelector], mapping: ResourceMapping | None = None, mesh: Mesh | None = None
) -> NamedSharding:
    """The :class:`jax.sharding.NamedSharding` for an array with logical ``axes``.

    Args:
        axes: the array's axes (or names), in order.
        mapping: the resource mapping (default: the one from :func:`axis_mapping`).
        mesh: the mesh (default: the current mesh).

    Returns:
        The sharding.

    Raises:
        ValueError: if there is no mesh, or as :func:`pspec_for_axis`.
    """
    resolved = mesh if mesh is not None else current_mesh()
    if resolved is None:
        raise ValueError("sharding_for_axis: no device mesh; pass mesh=... or set one with jax.set_mesh(mesh)")
    return NamedSharding(resolved, pspec_for_axis(axes, mapping))


def _is_named(x: Any) -> bool:
    return isinstance(x, NamedArray)


def _is_array_like(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct))


def _declared_axis_names(module: eqx.Module) -> dict[str, tuple[str, ...]]:
    """Fields of ``module`` declared with ``field(axis_names=...)``: field name -> axis names."""
    declared = {}
    for f in dataclasses.fields(module):
        names = f.metadata.get("axis_names")
        if names is not None:
            declared[f.name] = (names,) if isinstance(names, str) else tuple(names)
    return declared


def _map_arrays(fn: Callable[[Any, tuple[str, ...] | None], Any], tree: Any) -> Any:
    """Apply ``fn(leaf, names)`` to every leaf of ``tree`` (NamedArrays are leaves).

    ``names`` are the leaf's axis names: a NamedArray's own, the ``axis_names`` declared for the module field
    (see :func:`ponente.namedtensor.field`) that holds a plain array, or None for every other leaf.
    """

    def visit(node: Any) -> Any:
        if isinstance(node, NamedArray):
            return fn(node, node.axis_names)
        if isinstance(node, eqx.Module):
            return visit_module(node)
        return fn(node, None)

    def visit_module(module: eqx.Module) -> Any:
        declared = _declared_axis_names(module)
        if not declared:
            return jax.tree_util.tree_map(visit, module, is_leaf=lambda x: x is not module and _is_named_or_module(x))
        children, treedef = jax.tree_util.tree_flatten_with_path(module, is_leaf=lambda x: x is not module)
        out = []
        for path, child in children:
            field_name = getattr(path[0], "name", None) if path else None
            names = declared.get(field_name) if isinstance(field_name, str) else None
            if names is not None and _is_array_like(child):
                if len(names) != np.ndim(child):
                    raise ValueError(
                        f"{type(module).__name__}.{field_name}: field(axis_names={names}) names {len(names)} axes, "
                        f"but the array has shape {np.shape(child)}"
                    )
                out.append(fn(child, names))
            else:
                out.append(jax.tree_util.tree_map(visit, child, is_leaf=_is_named_or_module))
        return jax.tree_util.tree_unflatten(treedef, out)

    return jax.tree_util.tree_map(visit, tree, is_leaf=_is_named_or_module)


def _is_named_or_module(x: Any) -> bool:
    return isinstance(x, (NamedArray, eqx.Module))


def _replicated(x: Any) -> PartitionSpec:
    return PartitionSpec(*(None,) * np.ndim(x))


def pspec_for(
    tree: Any,
    resource_mapping: ResourceMapping | None = None,
    preserve_existing_shardings: bool = True,
    use_auto_sharding: bool = True,
) -> Any:
    """The PartitionSpec of every NamedArray and array of ``tree``.

    NamedArrays, and plain arrays in module fields declared with ``field(axis_names=...)``, are
    partitioned by the mapping; other arrays are replicated, or keep the spec of their NamedSharding when
    ``preserve_existing_shardings``.

    Args:
        tree: a pytree (modules included) of NamedArrays, arrays and other values.
        resource_mapping: the mapping (default: the one from :func:`axis_mapping`).
        preserve_existing_shardings: keep the spec of plain JAX arrays that already have a NamedSharding.
        use_auto_sharding: accepted for Haliax compatibility; plain arrays without a sharding are replicated.

    Returns:
        A pytree with the structure of ``tree`` (NamedArrays as leaves) holding a PartitionSpec for
        each NamedArray and array, and None for other leaves.

    Raises:
        ValueError: if a field's declared ``axis_names`` do not match its array's rank, or as
            :func:`pspec_for_axis`.

    Example:
        >>> import ponente.namedtensor as hax
        >>> pspec_for({"w": hax.zeros({"embed": 4, "mlp": 8})}, {"mlp": "model"})
        {'w': P(None, 'model')}
    """
    del use_auto_sharding
    mapping = _resolve_mapping(resource_mapping)

    def spec(leaf: Any, names: tuple[str, ...] | None) -> Any:
        if names is not None:
            return pspec_for_axis(names, mapping)
        if isinstance(leaf, jax.Array) and preserve_existing_shardings:
            sharding = getattr(leaf, "sharding", None)
            if isinstance(sharding, NamedSharding):
                return sharding.spec
        if _is_array_like(leaf):
            return _replicated(leaf)
        return None

    return _map_arrays(spec, tree)


def infer_resource_partitions(
    tree: Any,
    resource_mapping: ResourceMapping | None = None,
    preserve_existing_shardings: bool = True,
    use_auto_sharding: bool = True,
    mesh: Mesh | None = None,
) -> Any:
    """The :class:`NamedSharding` of every NamedArray and array of ``tree``, for ``jax.jit``/``device_put``.

    NamedArrays, and plain arrays in module fields declared with ``field(axis_names=...)``, are sharded
    by ``resource_mapping``; other plain arrays keep their existing sharding when
    ``preserve_existing_shardings`` (and it lives on ``mesh``), otherwise they are replicated. Other
    leaves give None.

    Args:
        tree: a pytree (modules included).
        resource_mapping: the mapping (default: the one from :func:`axis_mapping`).
        preserve_existing_shardings: keep the sharding plain JAX arrays already have.
        use_auto_sharding: accepted for Haliax compatibility; plain arrays without a sharding are replicated.
        mesh: the mesh (default: the current mesh).

    Returns:
        A pytree with the structure of ``tree`` (NamedArrays as leaves) of shardings and Nones.

    Raises:
        ValueError: if there is no mesh, or as :func:`pspec_for`.
    """
    del use_auto_sharding
    resolved = mesh if mesh is not None else current_mesh()
    if resolved is None:
        raise ValueError("infer_resource_partitions: no device mesh; pass mesh=... or use jax.set_mesh(mesh)")
    mapping = _resolve_mapping(resource_mapping)

    def sharding(leaf: Any, names: tuple[str, ...] | None) -> Any:
        if names is not None:
            return NamedSharding(resolved, pspec_for_axis(names, mapping))
        if isinstance(leaf, jax.Array) and preserve_existing_shardings:
            existing = getattr(leaf, "sharding", None)
            if isinstance(existing, NamedSharding) and existing.mesh == resolved:
                return existing
        if _is_array_like(leaf):
            return NamedSharding(resolved, _replicated(leaf))
        return None

    return _map_arrays(sharding, tree)


def _is_tracer(x: Any) -> bool:
    return isinstance(x, jax.core.Tracer)


def _check_divisible(names: Sequence[str], shape: Sequence[int], spec: PartitionSpec, mesh: Mesh) -> None:
    for name, size, entry in zip(names, shape, spec):
        if entry is None:
            continue
        physical = (entry,) if isinstance(entry, str) else tuple(entry)
        for p in physical:
            if p not in mesh.shape:
                raise ValueError(f"axis {name!r} is mapped to mesh axis {p!r}, but the mesh has {list(mesh.shape)}")
        shards = math.prod(mesh.shape[p] for p in physical)
        if size % shards != 0:
            raise ValueError(
                f"cannot shard axis {name!r} of size {size} over mesh axes {physical} ({shards} shards): "
                f"{size} is not divisible by {shards}; pad it with round_axis_for_partitioning"
            )


def _only(spec: PartitionSpec, keep: frozenset[str]) -> PartitionSpec:
    """``spec`` with every mesh axis not in ``keep`` removed."""
    entries: list[Any] = []
    for entry in spec:
        names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        kept = tuple(n for n in names if n in keep)
        entries.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    return PartitionSpec(*entries)


def _constrain(array: Any, spec: PartitionSpec, mesh: Mesh | AbstractMesh, concrete: bool) -> Any:
    """Lay out a traced ``array`` by ``spec``: a sharding constraint over Auto mesh axes, a reshard over Explicit ones.

    ``with_sharding_constraint`` only accepts Auto axes, and ``reshard`` only Explicit ones; on a mesh with
    both, each moves its own part of ``spec``.
    """
    explicit = frozenset(n for n, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Explicit)

    def target(s: PartitionSpec) -> Any:
        return NamedSharding(mesh, s) if concrete else s

    if not explicit:
        return jax.lax.with_sharding_constraint(array, target(spec))
    array = jax.sharding.reshard(array, target(_only(spec, explicit)))
    auto = frozenset(mesh.axis_names) - explicit
    if auto:
        array = jax.lax.with_sharding_constraint(array, target(_only(spec, auto)))
    return array


def shard(x: Any, mapping: ResourceMapping | None = None, mesh: Mesh | None = None) -> Any:
    """Shard every NamedArray of ``x`` by its axis names; works inside and outside ``jit``.

    Inside ``jit`` this adds a sharding constraint (``jax.lax.with_sharding_constraint``; over mesh axes
    of type ``Explicit`` it reshards with ``jax.sharding.reshard``); outside it moves the data
    (``jax.device_put``). Plain arrays are sharded only when a module field declared with
    ``field(axis_names=...)`` holds them; they and other leaves are otherwise returned unchanged. With no
    mesh anywhere (a single-device program) there is nothing to shard onto and ``x`` is returned as is.

    Args:
        x: a NamedArray or a pytree (e.g. a module) containing NamedArrays.
        mapping: logical -> mesh axis names (default: the one from :func:`axis_mapping`).
        mesh: the mesh (default: the current mesh).

    Returns:
        ``x`` with sharded arrays.

    Raises:
        ValueError: outside ``jit``, if a mapped axis does not divide evenly over its mesh axes, or maps to
            a mesh axis the mesh lacks; if two axes of one array map to the same mesh axis.

    Example:
        >>> import ponente.namedtensor as hax
        >>> mesh = make_mesh({"data": -1})
        >>> x = shard(hax.zeros({"batch": len(jax.devices()), "embed": 3}), {"batch": "data"}, mesh)
        >>> x.array.sharding.spec
        P('data', None)
    """
    resolved_mapping = _resolve_mapping(mapping)
    if resolved_mapping is None:
        logger.warning("shard: no axis mapping passed and none set with axis_mapping(...); nothing is sharded")
        return x
    return _shard(x, resolved_mapping, mesh)


def _shard(x: Any, mapping: ResourceMapping, mesh: Mesh | None) -> Any:
    concrete = mesh if mesh is not None else current_mesh()
    abstract = None if concrete is not None else jax.sharding.get_abstract_mesh()
    if concrete is None and (abstract is None or abstract.empty):
        return x

    target_mesh: Any = concrete if concrete is not None else abstract

    def place(array: Any, names: Sequence[str]) -> Any:
        spec = pspec_for_axis(names, mapping)
        if _is_tracer(array):
            return _constrain(array, spec, target_mesh, concrete is not None)
        if concrete is None or not isinstance(array, (jax.Array, np.ndarray)):
            return array  # eager code with only an abstract mesh cannot place data; nor can a non-array be placed
        _check_divisible(names, np.shape(array), spec, concrete)
        return jax.device_put(array, NamedSharding(concrete, spec))

    def one(leaf: Any, names: tuple[str, ...] | None) -> Any:
        if names is None:
            return leaf
        if isinstance(leaf, NamedArray):
            return NamedArray.tree_unflatten(leaf.axes, [place(leaf.array, names)])
        return place(leaf, names)

    return _map_arrays(one, x)


def shard_with_axis_mapping(x: Any, mapping: ResourceMapping, mesh: Mesh | None = None) -> Any:
    """:func:`shard` with an explicit mapping (kept for Haliax compatibility).

    Args:
        x: a NamedArray or a pytree containing NamedArrays.
        mapping: logical -> mesh axis names.
        mesh: the mesh (default: the current mesh).

    Returns:
        ``x`` with sharded arrays.
    """
    return _shard(x, _normalize(mapping), mesh)


def auto_sharded(x: Any, mesh: Mesh | None = None) -> Any:
    """Shard ``x`` with the mapping from :func:`axis_mapping`; without one, return ``x`` unchanged.

    Meant for library code (layers, models) that may run with or without a mapping.

    Args:
        x: a NamedArray or a pytree containing NamedArrays.
        mesh: the mesh (default: the current mesh).

    Returns:
        ``x``, sharded if a mapping is in effect.
    """
    mapping = current_thread_local_mapping()
    if mapping is None:
        return x
    return _shard(x, mapping, mesh)


class _Static:
    """Hashable wrapper for the non-array part of a call, used as a compilation cache key."""

    def __init__(self, treedef: Any, leaves: Sequence[Any]):
        self.treedef = treedef
        self.leaves = tuple(leaves)
        try:
            self._hash = hash((treedef, self.leaves))
        except TypeError as e:
            raise TypeError(
                f"named_jit: every non-array argument must be hashable (it is part of the compilation key): {e}"
            ) from e

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Static) or self.treedef != other.treedef:
            return False
        return all(_static_equal(a, b) for a, b in zip(self.leaves, other.leaves))


def _static_equal(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    result = a == b
    return bool(result) if isinstance(result, (bool, np.bool_)) else False


def _freeze(mapping: ResourceMapping | None) -> Any:
    if mapping is None:
        return None
    return tuple(sorted((k, v if v is None or isinstance(v, str) else tuple(v)) for k, v in mapping.items()))


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


class _ArraySlot:
    """Stands for an array leaf in the static part of a call (equal only to itself)."""

    def __repr__(self) -> str:
        return "<array>"


_ARRAY_SLOT = _ArraySlot()


@dataclasses.dataclass(frozen=True)
class _Compiled:
    """One compiled entry of :class:`_NamedJit`: the call, the ``jax.jit`` function and where its inputs come from.

    ``donated_at`` and ``kept_at`` are the positions, among the flattened arguments, of the donated and the
    kept arrays; the jitted function takes them as two lists (flattening once per call keeps dispatch cheap).
    """

    run: Callable[..., Any]
    jitted: Any
    donated_at: tuple[int, ...]
    kept_at: tuple[int, ...]
    rebuild: Callable[[Any, Any], Any]


class CompiledCall:
    """A :func:`named_jit` function compiled ahead of time for one structure of arguments (``fn.compile(...)``).

    Calling it with arguments of that structure, static values, shapes and dtypes runs that executable, without
    tracing or compiling again; other arguments go to the :func:`named_jit` function (which traces and compiles
    for them, with the same result as if nothing had been compiled ahead).

    Attributes:
        compiled: the ``jax.stages.Compiled`` executable (``memory_analysis()``, ``cost_analysis()``, ...).
    """

    def __init__(self, named: _NamedJit, entry: _Compiled, compiled: Any, signature: Any) -> None:
        self._named = named
        self._entry = entry
        self.compiled = compiled
        self._signature = signature

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        entry, donated, kept = self._named._prepare(args, kwargs)
        signature = _signature(donated, kept)  # before the call: donation invalidates the buffers
        if entry is not self._entry or signature != self._signature:
            return entry.run(donated, kept)
        return entry.rebuild(signature, self.compiled(donated, kept))


class _NamedJit:
    """The callable returned by :func:`named_jit`."""

    def __init__(
        self,
        fn: Callable[..., Any],
        axis_resources: ResourceMapping | None,
        in_axis_resources: ResourceMapping | None,
        out_axis_resources: ResourceMapping | None,
        donate_args: Any,
        donate_kwargs: Any,
        jit_args: dict[str, Any],
    ):
        self.fn = fn
        self.axis_resources = None if axis_resources is None else _normalize(axis_resources)
        self.in_axis_resources = None if in_axis_resources is None else _normalize(in_axis_resources)
        self.out_axis_resources = None if out_axis_resources is None else _normalize(out_axis_resources)
        self.donate_args = donate_args
        self.donate_kwargs = donate_kwargs
        self.jit_args = jit_args
        self._cache: dict[Any, _Compiled] = {}
        functools.update_wrapper(self, fn)

    def _donation_mask(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.donate_args is None and self.donate_kwargs is None:
            return False
        donate_args: Any = self.donate_args if self.donate_args is not None else False
        if isinstance(donate_args, (tuple, list)):
            if len(donate_args) != len(args):
                raise ValueError(
                    f"named_jit: donate_args has {len(donate_args)} entries but the function got {len(args)} "
                    "positional arguments"
                )
            donate_args = tuple(donate_args)
        else:
            donate_args = (donate_args,) * len(args)
        donate_kwargs: Any = self.donate_kwargs if self.donate_kwargs is not None else False
        if isinstance(donate_kwargs, Mapping):
            unknown = sorted(set(donate_kwargs) - set(kwargs))
            if unknown:
                raise ValueError(f"named_jit: donate_kwargs names {unknown}, which are not keyword arguments")
            donate_kwargs = {k: donate_kwargs.get(k, False) for k in kwargs}
        else:
            donate_kwargs = dict.fromkeys(kwargs, donate_kwargs)
        return (donate_args, donate_kwargs)

    def _compiled(
        self, static: _Static, mapping_key: Any, mesh: Mesh | None, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> _Compiled:
        key = (static, mapping_key, mesh)
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        compute, in_mapping, out_mapping = _unfreeze(mapping_key)
        # which leaves are donated: the donation mask is a prefix of the arguments made of Python bools, so it
        # is the same for every call with this structure; find it once by partitioning a tree of leaf indices
        n = len(static.leaves)
        index_tree = jax.tree_util.tree_unflatten(static.treedef, list(range(n)))
        donated_tree = eqx.partition(index_tree, self._donation_mask(args, kwargs))[0]
        marked = set(jax.tree_util.tree_leaves(donated_tree))
        arrays = [i for i, leaf in enumerate(static.leaves) if leaf is _ARRAY_SLOT]
        donated_at = tuple(i for i in arrays if i in marked)
        kept_at = tuple(i for i in arrays if i not in marked)
        outputs: dict[Any, tuple[Any, list[Any], tuple[int, ...]]] = {}
        fn = self.fn

        def body(donated: list[Any], kept: list[Any]) -> list[Any]:
            leaves = list(static.leaves)
            for i, x in zip(donated_at, donated, strict=True):
                leaves[i] = x
            for i, x in zip(kept_at, kept, strict=True):
                leaves[i] = x
            args, kwargs = jax.tree_util.tree_unflatten(static.treedef, leaves)
            with contextlib.ExitStack() as stack:
                if compute is not None:
                    stack.enter_context(axis_mapping(compute))
                stack.enter_context(_using_mesh(mesh))
                if in_mapping is not None:
                    args, kwargs = _shard((args, kwargs), in_mapping, mesh)
                out = fn(*args, **kwargs)
                if out_mapping is not None:
                    out = _shard(out, out_mapping, mesh)
            out_leaves, out_treedef = jax.tree_util.tree_flatten(out)
            out_arrays = tuple(i for i, x in enumerate(out_leaves) if _is_array(x))
            template = [None if _is_array(x) else x for x in out_leaves]
            outputs[_signature(donated, kept)] = (out_treedef, template, out_arrays)
            return [out_leaves[i] for i in out_arrays]

        # the compiled program is named after the function (``jit_train``, not ``jit_body``): profiler traces, XLA
        # dumps and compilation logs then say which function a kernel or module belongs to
        name = getattr(fn, "__name__", None)
        if isinstance(name, str) and name.isidentifier():
            body.__name__ = body.__qualname__ = name
        jitted = jax.jit(body, donate_argnums=(0,), **self.jit_args)

        def rebuild(signature: Any, values: Any) -> Any:
            out_treedef, template, out_arrays = outputs[signature]
            leaves = list(template)
            for i, x in zip(out_arrays, values, strict=True):
                leaves[i] = x
            return jax.tree_util.tree_unflatten(out_treedef, leaves)

        def run(donated: list[Any], kept: list[Any]) -> Any:
            signature = _signature(donated, kept)  # before the call: donation invalidates the buffers
            return rebuild(signature, jitted(donated, kept))

        compiled = _Compiled(run, jitted, donated_at, kept_at, rebuild)
        self._cache[key] = compiled
        return compiled

    def _prepare(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[_Compiled, list[Any], list[Any]]:
        compute = self.axis_resources if self.axis_resources is not None else current_thread_local_mapping()
        in_mapping = self.in_axis_resources
        out_mapping = self.out_axis_resources if self.out_axis_resources is not None else compute
        mesh = current_mesh()
        # one flatten per call: array leaves are traced, the rest (and the structure) is the static key
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        static = _Static(treedef, [_ARRAY_SLOT if _is_array(x) else x for x in leaves])
        mapping_key = (_freeze(compute), _freeze(in_mapping), _freeze(out_mapping))
        compiled = self._compiled(static, mapping_key, mesh, args, kwargs)
        return compiled, [leaves[i] for i in compiled.donated_at], [leaves[i] for i in compiled.kept_at]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        compiled, donated, kept = self._prepare(args, kwargs)
        return compiled.run(donated, kept)

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        """Lower for these arguments without running (``jax.stages.Lowered``: ``.as_text()``, ``.compile()``).

        Args:
            *args: the positional arguments, as for a call.
            **kwargs: the keyword arguments.

        Returns:
            The lowered computation (of the array part of the arguments).
        """
        compiled, donated, kept = self._prepare(args, kwargs)
        return compiled.jitted.lower(donated, kept)

    def compile(self, *args: Any, **kwargs: Any) -> CompiledCall:
        """Compile for these arguments without running; calling the result runs that executable, and only it.

        Only the structure, static values, shapes, dtypes and shardings of the arguments are read, and nothing is
        donated, so placeholders of zeros will do.

        Args:
            *args: the positional arguments, as for a call.
            **kwargs: the keyword arguments.

        Returns:
            The :class:`CompiledCall`.

        Example:
            >>> import jax.numpy as jnp
            >>> f = named_jit(lambda x: x * 2)
            >>> twice = f.compile(jnp.zeros(3))
            >>> twice(jnp.ones(3)).tolist()
            [2.0, 2.0, 2.0]
        """
        entry, donated, kept = self._prepare(args, kwargs)
        return CompiledCall(self, entry, entry.jitted.lower(donated, kept).compile(), _signature(donated, kept))


def _unfreeze(key: Any) -> tuple[ResourceMapping | None, ...]:
    return tuple(None if frozen is None else dict(frozen) for frozen in key)


def _signature(*trees: Any) -> Any:
    """Structure, shapes and dtypes of ``trees``: what makes ``jax.jit`` trace again."""
    leaves, treedef = jax.tree_util.tree_flatten(trees)
    return treedef, tuple((np.shape(x), x.dtype) for x in leaves)


def named_jit(
    fn: Callable[..., Any] | None = None,
    axis_resources: ResourceMapping | None = None,
    *,
    in_axis_resources: ResourceMapping | None = None,
    out_axis_resources: ResourceMapping | None = None,
    donate_args: Any = None,
    donate_kwargs: Any = None,
    **jit_args: Any,
) -> Any:
    """``jax.jit`` for code written with named axes: shardings come from resource mappings.

    Arrays (also inside NamedArrays and Equinox modules) are traced; every other argument (axes,
    Python numbers, strings, functions, module configuration) is static and part of the compilation
    cache key, as in ``equinox.filter_jit``. Inside the function, ``axis_resources`` is the current
    :func:`axis_mapping`, so :func:`shard`/:func:`auto_sharded` in model code use it. Inputs are
    constrained to ``in_axis_resources`` (default: they keep the shardings they have) and outputs to
    ``out_axis_resources`` (default: ``axis_resources``; with no mapping at all the call is a plain
    ``jit``). The mesh is the current one at call time (``jax.set_mesh``), passed on to the traced code.
    One compiled function is kept per distinct static part, mappings and mesh; ``jax.jit`` caches per
    input shape and dtype.

    Args:
        fn: the function (omit to use ``named_jit(...)`` as a decorator).
        axis_resources: the compute mapping (default: the one from :func:`axis_mapping` at call time).
        in_axis_resources: the mapping for the arguments (default: none; arguments keep their shardings).
        out_axis_resources: the mapping for the results (default: ``axis_resources``).
        donate_args: which positional arguments to donate: one bool for all, or a tuple with one bool
            (or a pytree prefix of bools) per argument. Donated buffers may be reused for outputs.
        donate_kwargs: which keyword arguments to donate: one bool for all, or ``{name: bool}``.
        **jit_args: passed on to ``jax.jit`` (e.g. ``keep_unused``).

    Returns:
        The compiled function, or a decorator when ``fn`` is omitted.

    Raises:
        TypeError: at call time, if a non-array argument is not hashable.
        ValueError: at call time, if ``donate_args`` does not match the arguments.

    Example:
        >>> import ponente.namedtensor as hax
        >>> @named_jit(axis_resources={"batch": "data"})
        ... def double(x, scale):
        ...     return x * scale
        >>> double(hax.ones({"batch": 2}), 2.0).array.tolist()
        [2.0, 2.0]
    """
    if fn is None:
        return functools.partial(
            named_jit,
            axis_resources=axis_resources,
            in_axis_resources=in_axis_resources,
            out_axis_resources=out_axis_resources,
            donate_args=donate_args,
            donate_kwargs=donate_kwargs,
            **jit_args,
        )
    return _NamedJit(fn, axis_resources, in_axis_resources, out_axis_resources, donate_args, donate_kwargs, jit_args)


def fsdp(
    fn: F | None = None,
    parameter_mapping: ResourceMapping | None = None,
    compute_mapping: ResourceMapping | None = None,
) -> Any:
    """Compile ``fn`` for fully sharded data parallelism: store by one mapping, compute by another.

    Arguments and results are sharded by ``parameter_mapping`` (typically parameters split over the
    ``data`` axis along ``embed``); inside, ``compute_mapping`` (typically ``batch`` over ``data``)
    is in effect, so XLA gathers each parameter when it is needed. Equivalent to
    ``named_jit(fn, compute_mapping, in_axis_resources=parameter_mapping,
    out_axis_resources=parameter_mapping)``. Switching to tensor parallelism means changing the two
    mappings, not the model. Also usable as ``@fsdp(parameter_mapping=..., compute_mapping=...)``.

    Args:
        fn: the function, e.g. a training step ``(model, opt_state, batch) -> (model, opt_state, loss)``.
        parameter_mapping: logical -> mesh axes for stored arrays.
        compute_mapping: logical -> mesh axes during computation.

    Returns:
        The compiled function (or a decorator when ``fn`` is omitted).

    Raises:
        TypeError: if a mapping is missing.
    """
    if parameter_mapping is None or compute_mapping is None:
        raise TypeError("fsdp needs both parameter_mapping and compute_mapping")
    if fn is None:
        return functools.partial(fsdp, parameter_mapping=parameter_mapping, compute_mapping=compute_mapping)
    return named_jit(fn, compute_mapping, in_axis_resources=parameter_mapping, out_axis_resources=parameter_mapping)
