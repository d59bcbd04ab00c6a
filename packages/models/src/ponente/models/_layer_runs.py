"""Decoders that mix dense-MLP blocks and mixture-of-experts blocks (Qwen3-MoE's ``mlp_only_layers`` and
``decoder_sparse_step``).

Blocks of one kind share parameter shapes, so each kind is one :class:`~ponente.namedtensor.nn.Stacked` (the MoE
blocks in ``layers``, the dense ones in ``dense_layers``, each in layer order) and the forward pass scans the runs of
consecutive blocks of one kind, in layer order, each over its slice of its stack. Hugging Face numbers every block in
one ``model.layers.L``; these helpers translate between the two numberings.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import jax

import ponente.namedtensor as hax
from ponente.namedtensor import Axis, NamedArray
from ponente.namedtensor.nn import Stacked

from .moe import RouterOutput

T = TypeVar("T")

DENSE_LAYERS = "dense_layers"
"""The attribute (and state-dict key) of the dense blocks' stack in a mixed decoder."""

_OURS = re.compile(r"^model\.(dense_layers|layers)\.(\d+)\.(.*)$")
_HF = re.compile(r"^model\.layers\.(\d+)\.(.*)$")


def layer_runs(dense: Sequence[bool]) -> list[tuple[bool, int, int, int]]:
    """The runs of consecutive blocks of one kind: ``(dense, first layer, first index in its stack, length)``.

    Example:
        >>> layer_runs([True, False, False, True, False])
        [(True, 0, 0, 1), (False, 1, 0, 2), (True, 3, 1, 1), (False, 4, 2, 1)]
    """
    runs: list[tuple[bool, int, int, int]] = []
    seen = {True: 0, False: 0}
    for layer, kind in enumerate(dense):
        if runs and runs[-1][0] == kind:
            d, first, start, n = runs[-1]
            runs[-1] = (d, first, start, n + 1)
        else:
            runs.append((bool(kind), layer, seen[kind], 1))
        seen[kind] += 1
    return runs


def slice_layers(tree: T, name: str, start: int, stop: int) -> T:
    """``tree`` restricted to layers ``start .. stop - 1`` of its axis ``name`` (NamedArrays having it; others as
    they are)."""

    def one(x: Any) -> Any:
        if isinstance(x, NamedArray) and name in x.axis_names:
            return x[{name: slice(start, stop)}]
        return x

    return jax.tree_util.tree_map(one, tree, is_leaf=lambda x: isinstance(x, NamedArray))


def slice_stack(stack: Stacked[Any], start: int, stop: int) -> Stacked[Any]:
    """Blocks ``start .. stop - 1`` of ``stack`` as a stack of their own (the stack itself when that is all)."""
    if start == 0 and stop == stack.Block.size:
        return stack
    Block = stack.Block
    stacked = slice_layers(stack.stacked, Block.name, start, stop)
    return dataclasses.replace(stack, stacked=stacked, Block=Axis(Block.name, stop - start))


def concat_routing(routings: Sequence[RouterOutput], name: str) -> RouterOutput:
    """The routings of consecutive runs of MoE blocks joined along their layers axis ``name``."""
    if len(routings) == 1:
        return routings[0]
    return jax.tree_util.tree_map(
        lambda *xs: hax.concatenate(name, xs), *routings, is_leaf=lambda x: isinstance(x, NamedArray)
    )


def to_hf_layers(state: Mapping[str, T], dense: Sequence[bool]) -> dict[str, T]:
    """Our ``model.dense_layers.i`` / ``model.layers.j`` keys renumbered to Hugging Face's ``model.layers.L``."""
    ids = {True: [i for i, d in enumerate(dense) if d], False: [i for i, d in enumerate(dense) if not d]}
    out: dict[str, T] = {}
    for key, value in state.items():
        m = _OURS.match(key)
        out[key if m is None else f"model.layers.{ids[m[1] == DENSE_LAYERS][int(m[2])]}.{m[3]}"] = value
    return out


def from_hf_layers(state: Mapping[str, T], dense: Sequence[bool]) -> dict[str, T]:
    """Hugging Face's ``model.layers.L`` keys renumbered to ours (``model.dense_layers.i`` for a dense block,
    ``model.layers.j`` for a MoE block); layers beyond ``len(dense)`` are dropped."""
    index = {}
    seen = {True: 0, False: 0}
    for layer, kind in enumerate(dense):
        index[layer] = (DENSE_LAYERS if kind else "layers", seen[kind])
        seen[kind] += 1
    out: dict[str, T] = {}
    for key, value in state.items():
        m = _HF.match(key)
        if m is None:
            out[key] = value
        elif int(m[1]) in index:
            stack, i = index[int(m[1])]
            out[f"model.{stack}.{i}.{m[2]}"] = value
    return out
