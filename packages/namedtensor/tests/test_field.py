"""Tests for ``field``: axis names in the dataclass metadata, and the equinox field options it passes on."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import ponente.namedtensor as hax


class Table(eqx.Module):
    rows: jax.Array = hax.field(axis_names=("vocab", "embed"))
    scale: float = hax.field(static=True, default=2.0)
    count: jax.Array = hax.field(converter=jnp.asarray, default=3, metadata={"doc": "n"})


def test_axis_names_and_other_metadata():
    fields = {f.name: f for f in dataclasses.fields(Table)}
    assert fields["rows"].metadata["axis_names"] == ("vocab", "embed")
    assert fields["scale"].metadata["static"] is True
    assert fields["scale"].metadata["axis_names"] is None
    assert fields["count"].metadata["doc"] == "n"


def test_static_converter_and_default_behave_as_in_equinox():
    table = Table(jnp.ones((2, 3)))
    leaves = jax.tree_util.tree_leaves(table)
    assert len(leaves) == 2  # rows and count; the static scale is not a leaf
    assert isinstance(table.count, jax.Array)
    assert int(table.count) == 3
    assert table.scale == 2.0


def test_static_field_cannot_name_axes():
    with pytest.raises(ValueError, match="static"):
        hax.field(static=True, axis_names=("x",))
