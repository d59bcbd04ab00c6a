"""Supervised and chat processors: ids and loss masks against hand-built references, checks, bad rows, errors."""

from __future__ import annotations

import json
import pickle
import sys
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from ponente.datacache import (
    BadRecordError,
    BatchProcessor,
    ChatProcessor,
    MissingExtraError,
    SupervisedProcessor,
    build_cache,
)
from ponente.datacache.errors import MISSING_FIELD, WRONG_TYPE

ALPACA = (
    "Below is an instruction. Write a response.\n\n### Instruction:\n{{ instruction }}\n\n"
    "{% if input %}### Input:\n{{ input }}\n\n{% endif %}### Response:\n"
)

CHATML = (
    "{%- for message in messages %}\n"
    "    {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)


def _alpaca_prompt(row: dict[str, str]) -> str:
    """The ALPACA template written out in Python: the reference of the Jinja rendering."""
    text = f"Below is an instruction. Write a response.\n\n### Instruction:\n{row['instruction']}\n\n"
    if row["input"]:
        text += f"### Input:\n{row['input']}\n\n"
    return text + "### Response:\n"


@pytest.fixture(scope="module")
def chat_tokenizer(tokenizer_path: Path) -> Tokenizer:
    """The fixture tokenizer plus the ChatML special tokens."""
    tok = Tokenizer.from_file(str(tokenizer_path))
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    return tok


def _ids(tokenizer: Tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False).ids)


def _id(tokenizer: Tokenizer, token: str) -> int:
    token_id = tokenizer.token_to_id(token)
    assert token_id is not None, token
    return int(token_id)


def test_supervised_without_template_matches_separate_tokenization(tokenizer_path: Path, tokenizer: Tokenizer) -> None:
    rows = [{"input": "the quick fox", "output": "jumps over"}, {"input": "", "output": "a lazy dog"}]
    processor = SupervisedProcessor(tokenizer_path, bos="<bos>", eos="<eos>")
    assert isinstance(processor, BatchProcessor)
    out = processor(rows)
    bos, eos = _id(tokenizer, "<bos>"), _id(tokenizer, "<eos>")
    for row, ids, mask in zip(rows, out["input_ids"], out["loss_mask"], strict=True):
        head = [bos, *_ids(tokenizer, row["input"])]
        tail = [*_ids(tokenizer, row["output"]), eos]
        assert ids.dtype == np.int32
        assert mask.dtype == np.uint8
        assert ids.tolist() == head + tail
        assert mask.tolist() == [0] * len(head) + [1] * len(tail)

    unmasked = SupervisedProcessor(tokenizer_path, bos="<bos>", eos="<eos>", mask_inputs=False)(rows)
    assert [m.tolist() for m in unmasked["loss_mask"]] == [[1] * len(i) for i in out["input_ids"]]
    assert [i.tolist() for i in unmasked["input_ids"]] == [i.tolist() for i in out["input_ids"]]


def test_supervised_alpaca_template(tokenizer_path: Path, tokenizer: Tokenizer) -> None:
    rows = [
        {"instruction": "reverse the words", "input": "brown fox", "output": "fox brown"},
        {"instruction": "say hello", "input": "", "output": "hello"},
    ]
    processor = SupervisedProcessor(tokenizer_path, prompt_template=ALPACA, eos="<eos>")
    out = processor(rows)
    eos = _id(tokenizer, "<eos>")
    for row, ids, mask in zip(rows, out["input_ids"], out["loss_mask"], strict=True):
        assert processor.prompt(row) == _alpaca_prompt(row)
        head = _ids(tokenizer, _alpaca_prompt(row))
        tail = [*_ids(tokenizer, row["output"]), eos]
        assert ids.tolist() == head + tail
        assert mask.tolist() == [0] * len(head) + [1] * len(tail)
    # the template (and mask_inputs) are part of the fingerprint
    assert processor.config() != SupervisedProcessor(tokenizer_path, eos="<eos>").config()
    assert (
        processor.config() != SupervisedProcessor(tokenizer_path, prompt_template=ALPACA + " ", eos="<eos>").config()
    )
    unmasked = SupervisedProcessor(tokenizer_path, prompt_template=ALPACA, eos="<eos>", mask_inputs=False)
    assert processor.config() != unmasked.config()
    # it pickles (workers get a copy) and the copy compiles its own template
    copy = pickle.loads(pickle.dumps(processor))
    assert [i.tolist() for i in copy(rows)["input_ids"]] == [i.tolist() for i in out["input_ids"]]


def test_supervised_checks(tokenizer_path: Path) -> None:
    plain = SupervisedProcessor(tokenizer_path, input_field="q", output_field="a")
    assert plain.check({"q": "x", "a": "y"}) is None
    assert plain.check({"q": "", "a": "y"}) is None  # an empty prompt is fine
    assert plain.check({"a": "y"})[0] == MISSING_FIELD  # type: ignore[index]
    assert plain.check({"q": "x"})[0] == MISSING_FIELD  # type: ignore[index]
    assert plain.check({"q": 3, "a": "y"})[0] == WRONG_TYPE  # type: ignore[index]
    assert plain.check({"q": "x", "a": None})[0] == WRONG_TYPE  # type: ignore[index]
    kind, detail = plain.check({"q": "x", "a": "  "})  # type: ignore[misc]
    assert kind == MISSING_FIELD
    assert "empty response" in detail
    templated = SupervisedProcessor(tokenizer_path, prompt_template=ALPACA)
    assert templated.check({"instruction": "i", "input": "", "output": "o"}) is None
    kind, detail = templated.check({"instruction": "i", "output": "o"})  # type: ignore[misc]
    assert kind == MISSING_FIELD
    assert "'input'" in detail


def test_template_errors_name_the_key(tokenizer_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^data\.prompt_template: Jinja syntax error"):
        SupervisedProcessor(tokenizer_path, prompt_template="{% if x %}", template_key="data.prompt_template")
    raising = "{{ raise_exception('no ' + instruction) }}"
    processor = SupervisedProcessor(tokenizer_path, prompt_template=raising, template_key="data.prompt_template")
    with pytest.raises(ValueError, match=r"^data\.prompt_template: the template failed .*: no way$"):
        processor([{"instruction": "way", "output": "o"}])
    with pytest.raises(ValueError, match=r"^data\.chat_template: a chat template is needed"):
        ChatProcessor(tokenizer_path, chat_template=None, template_key="data.chat_template")
    with pytest.raises(ValueError, match="'<nope>' is not in the tokenizer's vocabulary"):
        SupervisedProcessor(tokenizer_path, eos="<nope>")


def test_missing_jinja2_names_the_extra(tokenizer_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "jinja2", None)  # makes `import jinja2` fail
    with pytest.raises(MissingExtraError, match=r"ponente-datacache\[chat\]"):
        ChatProcessor(tokenizer_path, chat_template=CHATML)
    SupervisedProcessor(tokenizer_path)  # no template: no jinja2 needed


def _conversation() -> list[dict[str, str]]:
    return [
        {"role": "system", "content": "you are a fox"},
        {"role": "user", "content": "the quick brown"},
        {"role": "assistant", "content": "fox jumps"},
        {"role": "user", "content": "over a lazy"},
        {"role": "assistant", "content": "dog"},
    ]


def test_chat_render_matches_transformers(chat_tokenizer: Tokenizer) -> None:
    import transformers  # the `test` extra installs it: the reference renderer

    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=chat_tokenizer)
    processor = ChatProcessor(chat_tokenizer, chat_template=CHATML)
    messages = _conversation()
    for k in range(1, len(messages) + 1):
        for gen in (False, True):
            expected = hf.apply_chat_template(
                messages[:k], chat_template=CHATML, tokenize=False, add_generation_prompt=gen
            )
            assert processor.render(messages[:k], add_generation_prompt=gen) == expected


def test_chat_mask_marks_assistant_turns(chat_tokenizer: Tokenizer) -> None:
    start, end = _id(chat_tokenizer, "<|im_start|>"), _id(chat_tokenizer, "<|im_end|>")
    # The reference, by hand: the special tokens cut the text, and each piece is tokenized on its own; a
    # piece is a target when the assistant wrote it (its content, the <|im_end|> closing its turn, the newline).
    expected_ids: list[int] = []
    expected_mask: list[int] = []
    for message in _conversation():
        target = int(message["role"] == "assistant")
        head = [start, *_ids(chat_tokenizer, message["role"] + "\n")]
        tail = [*_ids(chat_tokenizer, message["content"]), end, *_ids(chat_tokenizer, "\n")]
        expected_ids += head + tail
        expected_mask += [0] * len(head) + [target] * len(tail)
    processor = ChatProcessor(chat_tokenizer, chat_template=CHATML)
    out = processor([{"messages": _conversation()}])
    assert out["input_ids"][0].tolist() == expected_ids
    assert out["loss_mask"][0].tolist() == expected_mask
    assert out["input_ids"][0].dtype == np.int32
    assert out["loss_mask"][0].dtype == np.uint8
    everything = ChatProcessor(chat_tokenizer, chat_template=CHATML, mask_inputs=False)
    assert everything([{"messages": _conversation()}])["loss_mask"][0].tolist() == [1] * len(expected_ids)
    assert everything.config() != processor.config()
    copy = pickle.loads(pickle.dumps(processor))
    assert copy([{"messages": _conversation()}])["loss_mask"][0].tolist() == expected_mask


def test_chat_bos_eos_variables(tokenizer_path: Path, tokenizer: Tokenizer) -> None:
    template = (
        "{{ bos_token }}{% for m in messages %}{{ m.role }}: {{ m.content }}"
        "{% if m.role == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    messages = [{"role": "user", "content": "the fox"}, {"role": "assistant", "content": "jumps"}]
    processor = ChatProcessor(tokenizer_path, chat_template=template, bos="<bos>", eos="<eos>")
    assert processor.render(messages) == "<bos>user: the fox\nassistant: jumps<eos>\n"
    out = processor([{"messages": messages}])
    bos, eos = _id(tokenizer, "<bos>"), _id(tokenizer, "<eos>")
    # " jumps" is one token that starts with the template's space: a target, as in transformers' assistant masks
    head = [bos, *_ids(tokenizer, "user: the fox\nassistant:")]
    tail = [*_ids(tokenizer, " jumps"), eos, *_ids(tokenizer, "\n")]
    assert out["input_ids"][0].tolist() == head + tail
    assert out["loss_mask"][0].tolist() == [0] * len(head) + [1] * len(tail)


def test_chat_checks(chat_tokenizer: Tokenizer) -> None:
    processor = ChatProcessor(chat_tokenizer, chat_template=CHATML, messages_field="conv")
    good = {"conv": _conversation()}
    assert processor.check(good) is None
    user = {"role": "user", "content": "hi"}
    cases: dict[str, list[dict[str, object]]] = {
        MISSING_FIELD: [
            {"messages": _conversation()},
            {"conv": [user]},
            {"conv": []},
            {"conv": [user, {"role": "assistant", "content": " "}]},
            {"conv": [user, {"role": "assistant"}]},
            {"conv": [{"content": "hi"}, {"role": "assistant", "content": "yo"}]},
        ],
        WRONG_TYPE: [
            {"conv": "hi"},
            {"conv": ["hi"]},
            {"conv": [{"role": "robot", "content": "beep"}, {"role": "assistant", "content": "yo"}]},
            {"conv": [user, {"role": "assistant", "content": 5}]},
            {"conv": [{"role": None, "content": "x"}]},
        ],
    }
    records: list[dict[str, object]]
    for kind, records in cases.items():
        for record in records:
            result = processor.check(record)
            assert result is not None, record
            assert result[0] == kind, (record, result)
    assert "role 'robot' is not one of system, user, assistant, tool" in processor.check(cases[WRONG_TYPE][2])[1]  # type: ignore[index]


def test_chat_template_errors_name_the_key(chat_tokenizer: Tokenizer) -> None:
    strict = (
        "{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}"
        "{{ raise_exception('unknown role ' + m.role) }}{% endif %}{{ m.content }}{% endfor %}"
    )
    processor = ChatProcessor(chat_tokenizer, chat_template=strict, template_key="data.chat_template")
    conversation = [{"role": "tool", "content": "x"}, {"role": "assistant", "content": "y"}]
    assert processor.check({"messages": conversation}) is None  # a known role: the template decides
    with pytest.raises(ValueError, match=r"^data\.chat_template: the template failed .*'tool'.*unknown role tool$"):
        processor([{"messages": conversation}])
    # a template whose rendering of the first turns is not a prefix of the whole cannot be masked
    closing = "{% for m in messages %}{{ m.content }};{% endfor %}{% if not add_generation_prompt %}END{% endif %}"
    processor = ChatProcessor(chat_tokenizer, chat_template=closing, template_key="data.chat_template")
    with pytest.raises(ValueError, match=r"^data\.chat_template: rendering the conversation up to assistant message"):
        processor([{"messages": _conversation()}])
    unmasked = ChatProcessor(chat_tokenizer, chat_template=closing, mask_inputs=False)
    assert unmasked([{"messages": _conversation()}])["loss_mask"][0].all()
    with pytest.raises(ValueError, match=r"^data\.chat_template: Jinja syntax error"):
        ChatProcessor(chat_tokenizer, chat_template="{% for %}", template_key="data.chat_template")


def test_bad_rows_skipped_and_counted_or_an_error(tmp_path: Path, tokenizer_path: Path, tokenizer: Tokenizer) -> None:
    rows: list[object] = [
        {"input": "the fox", "output": "jumps"},
        {"input": "the dog"},  # line 2: no response
        {"input": "a lazy", "output": ""},  # line 3: empty response
        {"input": "data", "output": 7},  # line 4: wrong type
        {"input": "rows", "output": "commit"},
    ]
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    processor = SupervisedProcessor(tokenizer_path, eos="<eos>")
    with pytest.raises(BadRecordError, match=r"sft\.jsonl, line 2: missing field: expected a response field 'output'"):
        build_cache(str(path), tmp_path / "error", processor=processor, workers=0, progress=False)
    cache = build_cache(
        str(path), tmp_path / "skip", processor=processor, workers=0, progress=False, bad_records="skip"
    )
    assert cache.ledger.skipped == {MISSING_FIELD: 2, WRONG_TYPE: 1}
    examples = cache.ledger.skip_examples
    assert [e.split(": ")[0].rsplit("/", 1)[-1] for e in examples] == [f"sft.jsonl, line {n}" for n in (2, 3, 4)]
    assert "empty response" in examples[1]
    assert len(cache) == 2
    eos = _id(tokenizer, "<eos>")
    expected = [_ids(tokenizer, "the fox") + _ids(tokenizer, "jumps") + [eos]]
    assert cache[0]["input_ids"].tolist() == expected[0]
    assert cache[0]["loss_mask"].tolist() == [0] * len(_ids(tokenizer, "the fox")) + [1] * (
        len(_ids(tokenizer, "jumps")) + 1
    )
