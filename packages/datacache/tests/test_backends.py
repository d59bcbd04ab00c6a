"""Backends: ordered results with a bounded window, and work before an error is kept."""

from __future__ import annotations

import numpy as np
import pytest

from ponente.datacache import MissingExtraError, PassthroughProcessor
from ponente.datacache.backends import InProcessBackend, LocalBackend, make_backend, map_ordered, process_batch


def _records(i: int) -> list[dict]:
    return [{"input_ids": [i] * (i % 3 + 1)}] if i % 4 else []


def _empty() -> dict:
    return {"input_ids": (np.empty(0, np.int32), np.empty(0, np.int64))}


def test_map_ordered_keeps_order_and_drains_before_raising() -> None:
    processor = PassthroughProcessor()

    def items():  # type: ignore[no-untyped-def]
        yield from range(10)
        raise RuntimeError("bad record at 10")

    backend = LocalBackend(processor, 2)
    seen = []

    def consume() -> None:
        for item, result in map_ordered(backend, items(), _records, _empty):
            flat, lengths = result["input_ids"]
            seen.append(item)
            assert flat.tolist() == [t for r in _records(item) for t in r["input_ids"]]
            assert lengths.tolist() == [len(r["input_ids"]) for r in _records(item)]

    try:
        with pytest.raises(RuntimeError, match="bad record at 10"):
            consume()
        assert seen == list(range(10))
    finally:
        backend.close(abort=False)


def test_process_batch_checks_processor_output() -> None:
    class Broken(PassthroughProcessor):
        def __call__(self, records):  # type: ignore[no-untyped-def]
            return {"input_ids": []}

    with pytest.raises(ValueError, match="returned 0 rows for field 'input_ids'; expected 1 rows"):
        process_batch(Broken(), [{"input_ids": [1]}])


def test_make_backend_validates() -> None:
    assert isinstance(make_backend("local", PassthroughProcessor(), 0), InProcessBackend)
    with pytest.raises(ValueError, match="workers must be >= 0"):
        make_backend("local", PassthroughProcessor(), -1)


def test_missing_ray_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "ray", None)  # makes `import ray` raise ImportError
    with pytest.raises(MissingExtraError, match=r"ponente-datacache\[ray\]"):
        make_backend("ray", PassthroughProcessor(), 1)
