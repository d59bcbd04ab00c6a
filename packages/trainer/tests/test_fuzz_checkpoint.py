"""Fuzzing the checkpoint reader: random ``metadata.json`` contents and random damage to a step folder.

The contract (:mod:`ponente.trainer.checkpoint`): reading a damaged checkpoint raises :class:`CheckpointError`
(:class:`CheckpointCorruptError` for damage) naming the checkpoint, or ``FileNotFoundError`` when there is no
committed checkpoint; finding checkpoints (:func:`discover_checkpoints`, :func:`latest_checkpoint_path`) never
raises for a damaged one; and a load that succeeds returns exactly the saved values (no silent corruption).
Each example runs under a SIGALRM time limit so a hang fails instead of stalling the suite.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from ponente.datacache.testing import time_limit
from ponente.trainer.checkpoint import (
    METADATA_FILE,
    CheckpointError,
    discover_checkpoints,
    latest_checkpoint_path,
    load_checkpoint,
    read_metadata,
    save_checkpoint,
)

EXAMPLE_SECONDS = 20
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
TREE: dict[str, Any] = {
    "a": np.arange(12, dtype=np.float32).reshape(3, 4),
    "b": {"c": np.arange(5, dtype=np.int32) * 7},
}
_DIR = Path(tempfile.mkdtemp(prefix="ponente-fuzz-checkpoint-"))
atexit.register(shutil.rmtree, _DIR, ignore_errors=True)
PRISTINE = _DIR / "pristine"


def _pristine() -> Path:
    """A committed checkpoint ``<run>/step-3`` of :data:`TREE`, written once."""
    step = PRISTINE / "step-3"
    if not (step / METADATA_FILE).exists():
        save_checkpoint(TREE, step, step=3)
    return PRISTINE


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=16,
)


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path to a node of a JSON tree."""
    out = [prefix]
    if isinstance(node, dict):
        for key, child in node.items():
            out.extend(_paths(child, (*prefix, key)))
    elif isinstance(node, list):
        for i, child in enumerate(node):
            out.extend(_paths(child, (*prefix, i)))
    return out


@st.composite
def damages(draw: st.DrawFn) -> list[tuple[str, Any]]:
    """1-3 damages: ``(what, detail)``; applied to a copy of the pristine step folder by :func:`_apply`."""
    kinds = st.sampled_from(["meta_bytes", "meta_json", "meta_edit", "flip", "truncate", "delete", "add"])
    out: list[tuple[str, Any]] = []
    for kind in draw(st.lists(kinds, min_size=1, max_size=3)):
        if kind == "meta_bytes":
            out.append((kind, draw(st.binary(max_size=300))))
        elif kind == "meta_json":
            out.append((kind, draw(json_values)))
        elif kind == "meta_edit":
            out.append((kind, (draw(st.integers(0, 10_000)), draw(json_values))))
        elif kind == "flip":
            out.append((kind, (draw(st.integers(0, 100)), draw(st.integers(0, 1 << 20)), draw(st.integers(1, 255)))))
        elif kind == "truncate":
            out.append((kind, (draw(st.integers(0, 100)), draw(st.integers(0, 1 << 20)))))
        elif kind == "delete":
            out.append((kind, draw(st.integers(0, 100))))
        else:
            name = draw(st.sampled_from(["process-1.json", "process-0/d/extra", "process-1/manifest.ocdbt", "x"]))
            out.append((kind, (name, draw(st.binary(max_size=200)))))
    return out


def _apply(step: Path, damage: list[tuple[str, Any]]) -> None:
    meta = step / METADATA_FILE
    for kind, detail in damage:
        files = sorted(p for p in step.rglob("*") if p.is_file() and p != meta)
        if kind == "meta_bytes":
            meta.write_bytes(detail)
        elif kind == "meta_json":
            meta.write_text(json.dumps(detail))
        elif kind == "meta_edit":  # replace one node of the real metadata (a leaf's shape, dtype, the step, ...)
            index, value = detail
            try:
                tree = json.loads(meta.read_bytes())
            except ValueError:
                continue
            paths = _paths(tree)[1:]
            if not paths:
                continue
            *parents, last = paths[index % len(paths)]
            node = tree
            for key in parents:
                node = node[key]
            node[last] = value
            meta.write_text(json.dumps(tree))
        elif kind in ("flip", "truncate", "delete") and files:
            target = files[detail[0] % len(files)] if kind != "delete" else files[detail % len(files)]
            data = bytearray(target.read_bytes())
            if kind == "delete":
                target.unlink()
            elif kind == "flip" and data:
                data[detail[1] % len(data)] ^= detail[2]
                target.write_bytes(bytes(data))
            elif kind == "truncate":
                target.write_bytes(bytes(data[: detail[1] % (len(data) + 1)]))
        elif kind == "add":
            name, data = detail
            (step / name).parent.mkdir(parents=True, exist_ok=True)
            (step / name).write_bytes(data)


def _equal(loaded: Any, expected: Any) -> bool:
    if isinstance(expected, dict):
        return (
            isinstance(loaded, dict)
            and loaded.keys() == expected.keys()
            and all(_equal(loaded[k], expected[k]) for k in expected)
        )
    return bool(np.asarray(loaded).dtype == expected.dtype and np.array_equal(np.asarray(loaded), expected))


def check_damaged(damage: list[tuple[str, Any]]) -> None:
    run = _DIR / "run"
    shutil.rmtree(run, ignore_errors=True)
    shutil.copytree(_pristine(), run)
    step = run / "step-3"
    _apply(step, damage)
    with time_limit(EXAMPLE_SECONDS):
        meta = _attempt(lambda: read_metadata(step), CheckpointError)
        found = discover_checkpoints(run)  # never raises for a damaged checkpoint
        latest_checkpoint_path(run)
        loaded = _attempt(lambda: load_checkpoint(TREE, step), CheckpointError, FileNotFoundError)
    assert [c.step for c in found] == [3]
    for outcome in (meta, loaded):
        if isinstance(outcome, Exception):  # names the checkpoint, in one line
            assert str(step) in str(outcome), str(outcome)
            assert "\n" not in str(outcome), str(outcome)
    assert meta is None or isinstance(meta, dict | Exception)
    if not isinstance(loaded, Exception):
        assert _equal(loaded, TREE), f"a damaged checkpoint loaded with wrong values: {loaded}"


def _attempt(read: Callable[[], Any], *allowed: type[Exception]) -> Any:
    """``read()``, or the exception it raised if it is one of ``allowed`` (any other propagates)."""
    try:
        return read()
    except allowed as e:
        return e


@FUZZ
@given(damage=damages())
@example(damage=[("meta_bytes", b"\xff\xfe")])
@example(damage=[("meta_json", [])])
@example(damage=[("meta_json", {"leaves": {"a": 1}})])
@example(damage=[("meta_edit", (0, None))])
@example(damage=[("truncate", (1, 10))])
def test_damaged_checkpoint_raises_only_documented_errors(damage: list[tuple[str, Any]]) -> None:
    check_damaged(damage)


@settings(FUZZ, max_examples=40)
@given(leaves=st.dictionaries(st.sampled_from(["a", "b.c", "b", "z"]), json_values, max_size=3), extra=json_values)
def test_random_leaf_tables(leaves: dict[str, Any], extra: Any) -> None:
    """``metadata.json`` that parses and has a ``leaves`` table of random entries (the shape a reader trusts)."""
    meta = json.loads((_pristine() / "step-3" / METADATA_FILE).read_text())
    meta["leaves"] = {**meta["leaves"], **leaves}
    meta["metadata"] = extra
    check_damaged([("meta_json", meta)])


def test_undamaged_copy_loads() -> None:
    """The harness itself: with no damage the copy loads the saved values (so a pass above is not vacuous)."""
    check_damaged([])
    loaded = load_checkpoint(TREE, _DIR / "run" / "step-3")
    assert _equal(loaded, TREE)
    assert not _equal({"a": TREE["a"] + 1, "b": TREE["b"]}, TREE)


@pytest.mark.parametrize("name", ["metadata", "data"])
def test_flipped_data_byte_is_an_error_not_wrong_values(name: str) -> None:
    """A flipped byte in every position of the data file: each load raises or returns the saved values."""
    run = _DIR / "run"
    shutil.rmtree(run, ignore_errors=True)
    shutil.copytree(_pristine(), run)
    step = run / "step-3"
    target = step / METADATA_FILE if name == "metadata" else next((step / "process-0" / "d").iterdir())
    data = target.read_bytes()
    outcomes = {"error": 0, "same": 0}
    for position in range(0, len(data), max(1, len(data) // 40)):
        target.write_bytes(data[:position] + bytes([data[position] ^ 0x55]) + data[position + 1 :])
        try:
            loaded = load_checkpoint(TREE, step)
        except (CheckpointError, FileNotFoundError):
            outcomes["error"] += 1
        else:
            assert _equal(loaded, TREE), f"flipping byte {position} of {target.name} changed the loaded values"
            outcomes["same"] += 1
    assert outcomes["error"] > 0
    target.write_bytes(data)
    assert _equal(load_checkpoint(TREE, step), TREE)
    os.sync()
