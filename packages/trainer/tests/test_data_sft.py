"""Supervised and chat data in the trainer: config keys, rows against hand-built references, lm_batch masks."""

from __future__ import annotations

import dataclasses
import inspect
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tokenizers import Tokenizer

from ponente.datacache import BadRecordError, FingerprintMismatchError
from ponente.models import LmExample
from ponente.trainer.config import ConfigError, load_config
from ponente.trainer.data import (
    ChatLmDatasetFormat,
    LMDatasetConfig,
    LMMixtureDatasetConfig,
    SupervisedLmDatasetFormat,
    batch_for_step,
    build_caches,
    data_processor,
    data_tokenizer,
    resolve_url,
    train_set,
    validation_sets,
)
from ponente.trainer.tasks.lm import lm_batch, lm_example

TOKENIZER = "package://ponente.trainer.assets/shakespeare_tokenizer.json"
INSTRUCTIONS = "package://ponente.trainer.assets/tiny_instructions.jsonl"
CHATS = "package://ponente.trainer.assets/tiny_chat.jsonl"
CHAT_TEMPLATE = "package://ponente.trainer.assets/tiny_chat_template.jinja"
EOS = "<|endoftext|>"

PROMPT = "{{ instruction }}\n{% if input %}Input: {{ input }}\n{% endif %}Answer: "


def _prompt(row: dict[str, str]) -> str:
    """PROMPT written out in Python: the reference of the Jinja rendering."""
    return row["instruction"] + "\n" + (f"Input: {row['input']}\n" if row["input"] else "") + "Answer: "


def _records(url: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(resolve_url(url)).read_text().splitlines()]


def _naive_pack(examples: list[tuple[list[int], list[int]]], seq_len: int) -> list[dict[str, list[int]]]:
    """Greedy packing written as plainly as possible (no example here is longer than seq_len)."""
    rows: list[list[tuple[list[int], list[int]]]] = []
    for ids, mask in examples:
        if rows and sum(len(i) for i, _ in rows[-1]) + len(ids) <= seq_len:
            rows[-1].append((ids, mask))
        else:
            rows.append([(ids, mask)])
    out = []
    for group in rows:
        row: dict[str, list[int]] = {"input_ids": [], "segment_ids": [], "loss_mask": [], "position_ids": []}
        for k, (ids, mask) in enumerate(group):
            row["input_ids"] += ids
            row["segment_ids"] += [k] * len(ids)
            row["loss_mask"] += mask
            row["position_ids"] += list(range(len(ids)))
        pad = seq_len - len(row["input_ids"])
        for key, value in (("input_ids", 0), ("segment_ids", -1), ("loss_mask", 0), ("position_ids", 0)):
            row[key] += [value] * pad
        out.append(row)
    return out


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_file(resolve_url(TOKENIZER))


def _ids(tok: Tokenizer, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False).ids)


def _id(tok: Tokenizer, token: str) -> int:
    token_id = tok.token_to_id(token)
    assert token_id is not None, token
    return int(token_id)


def test_supervised_rows_match_a_hand_built_reference(tmp_path: Path, tok: Tokenizer) -> None:
    cfg = LMDatasetConfig(
        train_urls=[INSTRUCTIONS],
        tokenizer=TOKENIZER,
        cache_dir=str(tmp_path),
        format=SupervisedLmDatasetFormat(prompt_template=PROMPT),
        workers=0,
    )
    seq_len = 64
    eos = _id(tok, EOS)
    examples = []
    for row in _records(INSTRUCTIONS):
        head, tail = _ids(tok, _prompt(row)), [*_ids(tok, row["output"]), eos]
        examples.append((head + tail, [0] * len(head) + [1] * len(tail)))
    assert max(len(ids) for ids, _ in examples) <= seq_len
    expected = _naive_pack(examples, seq_len)
    train = train_set(cfg, seq_len, seed=0)
    train.wait_for_length(None)
    assert len(train) == len(expected)
    assert len(expected) < len(examples)  # packed: several examples per row
    got = [{k: v.tolist() for k, v in row.items()} for row in train.get_batch(range(len(train)))]
    assert got == expected
    assert train.truncated == 0  # type: ignore[attr-defined]

    unpacked = train_set(dataclasses.replace(cfg, format=dataclasses.replace(cfg.format, pack=False)), seq_len, seed=0)
    unpacked.wait_for_length(None)
    assert len(unpacked) == len(examples)
    assert unpacked[3]["input_ids"][: len(examples[3][0])].tolist() == examples[3][0]

    # mask_inputs is part of the cache fingerprint: the cache built above refuses another mask policy
    with pytest.raises(FingerprintMismatchError, match="mask_inputs"):
        build_caches(
            dataclasses.replace(cfg, format=dataclasses.replace(cfg.format, mask_inputs=False)),
            "train",
            background=False,
        )


@pytest.fixture(scope="module")
def chat_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shipped tokenizer plus ChatML special tokens, saved with a tokenizer_config.json holding the template."""
    folder = tmp_path_factory.mktemp("chat_tokenizer")
    tok = Tokenizer.from_file(resolve_url(TOKENIZER))
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(str(folder / "tokenizer.json"))
    template = Path(resolve_url(CHAT_TEMPLATE)).read_text()
    config = {"chat_template": template, "eos_token": "<|im_end|>", "bos_token": None}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_chat_rows_mask_assistant_turns(tmp_path: Path, chat_tokenizer_dir: Path) -> None:
    tok = Tokenizer.from_file(str(chat_tokenizer_dir / "tokenizer.json"))
    start, end = _id(tok, "<|im_start|>"), _id(tok, "<|im_end|>")
    cfg = LMDatasetConfig(
        train_urls=[CHATS],
        validation_urls=[CHATS],
        tokenizer=str(chat_tokenizer_dir),  # chat_template: None -> the tokenizer_config.json's
        cache_dir=str(tmp_path),
        format=ChatLmDatasetFormat(pack=False),
        workers=0,
    )
    seq_len = 256
    train = train_set(cfg, seq_len, seed=0)
    train.wait_for_length(None)
    records = _records(CHATS)
    assert len(train) == len(records)
    for k in (0, 1, 7, len(records) - 1):
        ids: list[int] = []
        mask: list[int] = []
        for message in records[k]["messages"]:  # special tokens cut the text: each piece is tokenized alone
            head = [start, *_ids(tok, message["role"] + "\n")]
            tail = [*_ids(tok, message["content"]), end, *_ids(tok, "\n")]
            ids += head + tail
            mask += [0] * len(head) + [int(message["role"] == "assistant")] * len(tail)
        row = train[k]
        n = len(ids)
        assert row["input_ids"][:n].tolist() == ids
        assert row["loss_mask"][:n].tolist() == mask
        assert row["segment_ids"].tolist() == [0] * n + [-1] * (seq_len - n)
        assert row["position_ids"][:n].tolist() == list(range(n))
    assert sorted(validation_sets(cfg, seq_len)) == ["default"]

    # the same template given explicitly (a package:// .jinja file) gives the same processor config
    explicit = dataclasses.replace(cfg, format=ChatLmDatasetFormat(chat_template=CHAT_TEMPLATE, pack=False))
    assert data_processor(explicit).config() == data_processor(cfg).config()


def test_chat_template_errors_name_the_key(tmp_path: Path, chat_tokenizer_dir: Path) -> None:
    no_template = LMDatasetConfig(
        train_urls=[CHATS], tokenizer=TOKENIZER, format=ChatLmDatasetFormat(), cache_dir=str(tmp_path)
    )
    with pytest.raises(ValueError, match=r"^data\.format\.chat_template: not set, and the tokenizer"):
        data_processor(no_template)
    missing_file = dataclasses.replace(
        no_template, format=ChatLmDatasetFormat(chat_template=str(tmp_path / "nope.jinja"))
    )
    with pytest.raises(ValueError, match=r"^data\.format\.chat_template: .*nope\.jinja.* read as a template file"):
        data_processor(missing_file)
    broken = dataclasses.replace(no_template, format=ChatLmDatasetFormat(chat_template="{% for m in messages %}"))
    with pytest.raises(ValueError, match=r"^data\.format\.chat_template: Jinja syntax error"):
        data_processor(broken)
    # a role the template does not know: the build stops with a one-line error naming the key
    path = tmp_path / "tool.jsonl"
    messages = [{"role": "tool", "content": "42"}, {"role": "assistant", "content": "the answer is 42"}]
    path.write_text(json.dumps({"messages": messages}) + "\n")
    cfg = LMDatasetConfig(
        train_urls=[str(path)],
        tokenizer=str(chat_tokenizer_dir),
        cache_dir=str(tmp_path / "cache"),
        format=ChatLmDatasetFormat(),
        workers=0,
    )
    with pytest.raises(ValueError, match=r"^data\.format\.chat_template: the template failed .* unknown role 'tool'"):
        build_caches(cfg, "train", background=False, progress=False)


@dataclasses.dataclass(frozen=True)
class _Run:
    data: LMDatasetConfig = dataclasses.field(default_factory=LMDatasetConfig)


def _data(*overrides: str) -> LMDatasetConfig:
    return load_config(_Run, overrides=[f"data.{o}" for o in overrides]).data


def test_config_keys_parse_and_errors_name_the_key() -> None:
    # the flat keys of earlier configs and the nested format section give the same config
    flat = ["format=supervised", "input_field=question", "output_field=answer", "mask_inputs=false", "pack=false"]
    nested = "format={type: supervised, input_field: question, output_field: answer, mask_inputs: false, pack: false}"
    want = SupervisedLmDatasetFormat(input_field="question", output_field="answer", mask_inputs=False, pack=False)
    assert _data(*flat).format == want
    assert _data(nested).format == want
    assert _data("format.type=chat", "format.pack=false").format == ChatLmDatasetFormat(pack=False)
    # the same key flat and nested: fine when equal, an error naming both when not
    assert _data("format={type: chat, pack: false}", "pack=false").format == ChatLmDatasetFormat(pack=False)
    with pytest.raises(
        ConfigError, match=r"^data\.pack: given both flat \(True\) and as data\.format\.pack \(False\)"
    ):
        _data("format={type: chat, pack: false}", "pack=true")
    with pytest.raises(
        ConfigError,
        match=r"^data\.format\.type: unknown type 'alpaca'; known: asr, chat, preference_chat, supervised, text$",
    ):
        _data("format=alpaca")
    with pytest.raises(
        ConfigError, match=r"^data\.format\.chat_template: not a field of type 'supervised'; it belongs"
    ):
        _data("format=supervised", "chat_template={{ messages }}")
    with pytest.raises(
        ConfigError, match=r"^data\.format\.prompt_template: not a field of type 'text'; .*'supervised'"
    ):
        _data("prompt_template={{ instruction }}")
    with pytest.raises(ConfigError, match=r"^data\.format\.input_field: expected a non-empty field name, got ''$"):
        _data("format=supervised", "input_field=")
    with pytest.raises(ValueError, match=r"^data\.format: expected a format config \(type one of \['asr', 'chat'"):
        LMDatasetConfig(format="alpaca")  # type: ignore[arg-type]


def test_bad_rows_are_skipped_and_counted_or_an_error(tmp_path: Path) -> None:
    rows = [
        {"input": "to be", "output": "or not"},
        {"input": "to be"},
        {"input": "that is", "output": ""},
        {"input": "the question", "output": "indeed"},
    ]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    base: dict[str, Any] = {"train_urls": [str(path)], "tokenizer": TOKENIZER, "workers": 0}
    base["format"] = SupervisedLmDatasetFormat()
    with pytest.raises(BadRecordError, match=r"rows\.jsonl, line 2: missing field"):
        build_caches(LMDatasetConfig(**base, cache_dir=str(tmp_path / "error")), "train", background=False)
    cfg = LMDatasetConfig(**base, cache_dir=str(tmp_path / "skip"), bad_records="skip")
    cache = build_caches(cfg, "train", background=False, progress=False)
    assert len(cache) == 2
    assert cache.ledger.skipped == {"missing_field": 2}
    assert "rows.jsonl, line 3: missing_field: empty response" in cache.ledger.skip_examples[1]


def _reference_loss_mask(rows: dict[str, np.ndarray]) -> np.ndarray:
    """Position i trains iff token i + 1 exists, is in the same segment, and is a target: an explicit loop."""
    ids, seg, target = rows["input_ids"], rows["segment_ids"], rows.get("loss_mask")
    out = np.zeros(ids.shape, dtype=np.float32)
    for b in range(ids.shape[0]):
        for i in range(ids.shape[1] - 1):
            same = seg[b, i] == seg[b, i + 1]
            out[b, i] = float(same and (target is None or target[b, i + 1] == 1))
    return out


def test_lm_batch_aligns_the_target_mask_with_predictions() -> None:
    rng = np.random.default_rng(0)
    shape = (3, 16)
    seg = np.sort(rng.integers(-1, 3, size=shape), axis=1)
    rows = {
        "input_ids": rng.integers(0, 50, size=shape),
        "segment_ids": seg,
        "loss_mask": rng.integers(0, 2, size=shape),
        "position_ids": rng.integers(0, 16, size=shape),
    }
    batch = lm_batch(rows)
    np.testing.assert_array_equal(np.asarray(batch["loss_mask"].array), _reference_loss_mask(rows))
    np.testing.assert_array_equal(np.asarray(batch["position_ids"].array), rows["position_ids"])
    assert batch["position_ids"].axis_names == ("batch", "position")
    text = {"input_ids": rows["input_ids"], "segment_ids": seg}
    text_batch = lm_batch(text)
    assert "position_ids" not in text_batch
    np.testing.assert_array_equal(np.asarray(text_batch["loss_mask"].array), _reference_loss_mask(text))
    with pytest.raises(ValueError, match="one shape"):
        lm_batch({**rows, "loss_mask": rows["loss_mask"][:, :-1]})


def test_lm_example_passes_the_positions_on() -> None:
    rows = {
        "input_ids": np.array([[5, 6, 7, 8, 9, 0]]),
        "segment_ids": np.array([[0, 0, 0, 1, 1, -1]]),
        "loss_mask": np.array([[0, 1, 1, 0, 1, 0]]),
        "position_ids": np.array([[0, 1, 2, 0, 1, 0]]),
    }
    batch = lm_batch(rows)
    example = lm_example(batch)
    assert np.asarray(example.loss_mask.array).tolist() == [[1.0, 1.0, 0.0, 1.0, 0.0, 0.0]]
    # LmExample.causal's pos_ids comes from the restartable-positions change; check it is carried when present
    if "pos_ids" in inspect.signature(LmExample.causal).parameters:
        assert example.pos_ids is not None
        assert np.asarray(example.pos_ids.array).tolist() == rows["position_ids"].tolist()
        assert lm_example(lm_batch({k: rows[k] for k in ("input_ids", "segment_ids")})).pos_ids is None


def test_mixture_of_text_and_supervised_rows(tmp_path: Path) -> None:
    text = tmp_path / "text.jsonl"
    text.write_text("".join(json.dumps({"text": "to be or not to be " * (k % 4 + 1)}) + "\n" for k in range(30)))
    mix = LMMixtureDatasetConfig(
        configs={
            "text": LMDatasetConfig(train_urls=[str(text)], workers=0),
            "sft": LMDatasetConfig(
                train_urls=[INSTRUCTIONS], format=SupervisedLmDatasetFormat(prompt_template=PROMPT), workers=0
            ),
        },
        train_weights={"text": 0.5, "sft": 0.5},
        tokenizer=TOKENIZER,
        cache_dir=str(tmp_path / "cache"),
        mixture_block_size=4,
    )
    train = train_set(mix, 32, seed=0)
    batch = batch_for_step(train, 0, 8)
    assert set(batch) == {"input_ids", "segment_ids", "loss_mask", "position_ids"}
    # the text rows train exactly as text rows do without the supervised keys
    text_cache = build_caches(mix, "train", background=False, progress=False)["text"]
    text_rows = mix.configs["text"].format.rows(text_cache, 32, data_tokenizer(mix))
    row = text_rows[0]
    in_mix = [k for k in range(8) if batch["input_ids"][k].tolist() == row["input_ids"].tolist()]
    assert in_mix
    k = in_mix[0]
    alone = lm_batch({key: row[key][None] for key in ("input_ids", "segment_ids")})
    mixed = lm_batch({key: value[k : k + 1] for key, value in batch.items()})
    np.testing.assert_array_equal(np.asarray(mixed["loss_mask"].array), np.asarray(alone["loss_mask"].array))
    assert batch["position_ids"][k].tolist() == list(range(32))
