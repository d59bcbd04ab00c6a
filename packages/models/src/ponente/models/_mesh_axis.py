"""Which mesh axis a logical axis is split over inside a traced function, for the layers that run ``shard_map``
(expert parallelism, context-parallel attention). The models never build meshes; they read the one in effect."""

from __future__ import annotations

from typing import Any

import jax

from ponente.namedtensor.partitioning import current_mesh, physical_axis_name

__all__ = ["current_or_abstract_mesh", "split_axis"]


def current_or_abstract_mesh() -> Any:
    """The concrete mesh in effect, else the abstract one (inside ``jax.jit``), else None."""
    mesh = current_mesh()
    if mesh is not None:
        return mesh
    abstract = jax.sharding.get_abstract_mesh()
    return None if abstract.empty else abstract


def split_axis(logical: str, what: str) -> tuple[str | None, int]:
    """The mesh axis the logical axis ``logical`` maps to under the current mapping and mesh, and its size
    (``(None, 1)`` when there is no mesh or ``logical`` is not split).

    Raises:
        ValueError: if ``logical`` maps to several mesh axes (the message starts with ``what``).
    """
    mesh = current_or_abstract_mesh()
    physical = physical_axis_name(logical)
    if mesh is None or physical is None:
        return None, 1
    if not isinstance(physical, str):
        if len(physical) != 1:
            raise ValueError(f"{what}: {logical!r} must map to one mesh axis, got {physical}")
        physical = physical[0]
    if physical not in mesh.shape:
        return None, 1
    return physical, int(mesh.shape[physical])
