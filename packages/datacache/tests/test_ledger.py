"""The ledger: canonical bytes, round trip, fingerprints, and the description of what differs."""

from __future__ import annotations

import json

import pytest

from ponente.datacache.ledger import FORMAT_VERSION, Ledger, describe_differences, fingerprint

PARTS = {
    "format_version": FORMAT_VERSION,
    "source": {"type": "files", "shards": [["a.jsonl", 10, "jsonl", None], ["b.jsonl", 20, "jsonl", None]]},
    "processor": {"type": "tokenizer", "eos": None},
    "keep_empty": False,
}


def test_round_trip_and_canonical_bytes() -> None:
    ledger = Ledger.new(PARTS, {"input_ids": "int32"}, ["a.jsonl", "b.jsonl"])
    ledger.rows = 3
    ledger.shards[0].skipped["empty"] = 2
    again = Ledger.from_bytes(ledger.to_bytes())
    assert again == ledger
    assert again.to_bytes() == ledger.to_bytes()
    assert json.loads(ledger.to_bytes())["fingerprint"] == fingerprint(PARTS)


def test_fingerprint_ignores_key_order_but_not_values() -> None:
    reordered = dict(reversed(list(PARTS.items())))
    assert fingerprint(reordered) == fingerprint(PARTS)
    assert fingerprint({**PARTS, "keep_empty": True}) != fingerprint(PARTS)


def test_describe_differences() -> None:
    other = json.loads(json.dumps(PARTS))
    other["processor"]["eos"] = "</s>"
    other["source"]["shards"] = [["a.jsonl", 11, "jsonl", None], ["c.jsonl", 5, "jsonl", None]]
    diffs = describe_differences(PARTS, other)
    assert any(d.startswith("processor.eos: cache has null") and '"</s>"' in d for d in diffs)
    assert any("'b.jsonl' is in the cache but not in the request" in d for d in diffs)
    assert any("'c.jsonl' is in the request but not in the cache" in d for d in diffs)
    assert any("'a.jsonl' differs" in d for d in diffs)
    assert describe_differences(PARTS, PARTS) == []


def test_damaged_or_newer_ledger_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="not a valid"):
        Ledger.from_bytes(b"{", "x/ledger.json")
    newer = json.loads(Ledger.new(PARTS, {"input_ids": "int32"}, []).to_bytes())
    newer["format_version"] = FORMAT_VERSION + 1
    with pytest.raises(ValueError, match="upgrade"):
        Ledger.from_bytes(json.dumps(newer).encode())
