"""The ``data.format`` registry: every shipped and documented data section still loads, flat and nested spellings
agree, and a new format is one registered class."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any, ClassVar

import pytest
import yaml

from ponente.datacache import TokenizerProcessor
from ponente.trainer.config import ConfigError, load_config, packaged_config_names, read_config_file
from ponente.trainer.data import (
    AsrDatasetFormat,
    ChatLmDatasetFormat,
    LMDatasetConfig,
    LmDatasetFormat,
    LMMixtureDatasetConfig,
    PreferenceChatLmDatasetFormat,
    SupervisedLmDatasetFormat,
    TextLmDatasetFormat,
    build_datasets,
)
from ponente.trainer.data.tokens import TokenizerSpec
from ponente.trainer.main.train_asr import speech_data
from ponente.trainer.main.train_rl import RlDataConfig

DOCS = Path(__file__).parents[3] / "docs" / "trainer" / "docs"
TOKENIZER = "package://ponente.trainer.assets/shakespeare_tokenizer.json"


@dataclasses.dataclass(frozen=True)
class _Run:
    data: LMDatasetConfig | LMMixtureDatasetConfig = dataclasses.field(default_factory=LMDatasetConfig)


@dataclasses.dataclass(frozen=True)
class _SpeechRun:
    data: LMDatasetConfig = dataclasses.field(default_factory=speech_data)


@dataclasses.dataclass(frozen=True)
class _RlRun:
    data: RlDataConfig = dataclasses.field(default_factory=RlDataConfig)


def _load(data: dict[str, Any], run: type[Any] = _Run) -> Any:
    return load_config(run, overrides=[f"data={yaml.safe_dump(data, default_flow_style=True, width=10**6)}"]).data


# what each packaged config's data section must read as, written out by hand (the flat keys of each file)
PACKAGED_FORMATS = {
    "gpt2_nano": TextLmDatasetFormat(),
    "lora_llama2": TextLmDatasetFormat(),
    "sft_chat": ChatLmDatasetFormat(messages_field="messages", chat_template=None, mask_inputs=True, pack=True),
    "tiny_chat": ChatLmDatasetFormat(chat_template="package://ponente.trainer.assets/tiny_chat_template.jinja"),
    "dpo_tiny": PreferenceChatLmDatasetFormat(
        chat_template="package://ponente.trainer.assets/tiny_chat_template.jinja", truncation="truncate"
    ),
}


SPEECH_FORMATS = {"whisper_tiny_digits": AsrDatasetFormat(n_mels=80, chunk_seconds=2.0, max_label_tokens=12)}


@pytest.mark.parametrize("name", packaged_config_names())
def test_every_packaged_data_section_loads_unchanged(name: str) -> None:
    data = read_config_file(name)["data"]
    if name.startswith("whisper"):  # the flat speech keys of the file, read into data.format
        assert _load(data, _SpeechRun).format == SPEECH_FORMATS[name]
        return
    if name.startswith("rl_"):  # prompts for ponente-rl: jsonl rows, not an LM data format
        assert _load(data, _RlRun) == RlDataConfig(**data)
        return
    cfg = _load(data)
    if name in PACKAGED_FORMATS:
        assert cfg.format == PACKAGED_FORMATS[name]
    else:  # the supervised ones: their template, written in the file under data.prompt_template
        assert cfg.format == SupervisedLmDatasetFormat(output_field="output", prompt_template=data["prompt_template"])


def _doc_data_sections() -> list[tuple[str, dict[str, Any]]]:
    sections = []
    for page in sorted(DOCS.glob("*.md")):
        for k, block in enumerate(re.findall(r"```yaml[^\n]*\n(.*?)```", page.read_text(), re.S)):
            tree = yaml.safe_load(block)
            if isinstance(tree, dict) and isinstance(tree.get("data"), dict):
                sections.append((f"{page.name}[{k}]", tree["data"]))
    return sections


@pytest.mark.parametrize(("where", "data"), _doc_data_sections(), ids=[w for w, _ in _doc_data_sections()])
def test_every_documented_data_section_loads(where: str, data: dict[str, Any]) -> None:
    run = {"speech.md": _SpeechRun, "rl.md": _RlRun}.get(where.split("[")[0], _Run)  # the page's entry point
    cfg = _load(data, run)
    if "format" in data:
        fmt = data["format"]
        assert cfg.format.choice_name == (fmt if isinstance(fmt, str) else fmt["type"])


def test_levanter_nested_format_sections_equal_the_flat_keys() -> None:
    flat = {"train_urls": ["c.jsonl"], "format": "chat", "messages_field": "conversation", "pack": False}
    nested = {"train_urls": ["c.jsonl"], "format": {"type": "chat", "messages_field": "conversation", "pack": False}}
    assert (
        _load(flat)
        == _load(nested)
        == LMDatasetConfig(
            train_urls=["c.jsonl"], format=ChatLmDatasetFormat(messages_field="conversation", pack=False)
        )
    )
    # a mixture component reads its format the same way
    mix = _load({"configs": {"a": flat, "b": {"train_urls": ["t.jsonl"]}}, "train_weights": {"a": 1, "b": 1}})
    assert mix.configs["a"].format == ChatLmDatasetFormat(messages_field="conversation", pack=False)
    assert mix.configs["b"].format == TextLmDatasetFormat()
    # a text config of an older file keeps a text_key; the format defaults of the other formats are dropped
    assert _load({"text_key": "content", "messages_field": "messages", "chat_template": None}).format == (
        TextLmDatasetFormat(text_key="content")
    )


def test_the_flat_keys_of_speech_configs_are_the_asr_format() -> None:
    speech = {"n_mels": 128, "chunk_seconds": 2.0, "max_label_tokens": 12, "audio_field": "clip", "language": None}
    flat = {"train_urls": ["s.jsonl"], "tokenizer": "tok", **speech}
    nested = {"train_urls": ["s.jsonl"], "tokenizer": "tok", "format": {"type": "asr", **speech}}
    untyped = {"train_urls": ["s.jsonl"], "tokenizer": "tok", "format": speech}  # the speech run's default type
    want = LMDatasetConfig(
        train_urls=["s.jsonl"],
        tokenizer="tok",
        shuffle=True,  # the speech run's default
        format=AsrDatasetFormat(n_mels=128, chunk_seconds=2.0, max_label_tokens=12, audio_field="clip", language=None),
    )
    assert _load(flat, _SpeechRun) == _load(nested, _SpeechRun) == _load(untyped, _SpeechRun) == want
    # a speech key in a text corpus: dropped at its former default, else an error naming it
    assert _load({"n_mels": 80}).format == TextLmDatasetFormat()
    with pytest.raises(ConfigError, match=r"^data\.format\.n_mels: not a field of type 'text'"):
        _load({"n_mels": 128})


def test_the_tokenizer_members_are_deprecated_for_the_pipeline_function() -> None:
    from ponente.trainer.data import data_tokenizer, data_vocab_size

    cfg = LMDatasetConfig(tokenizer=TOKENIZER, vocab_size=4100)
    with pytest.warns(DeprecationWarning, match=r"data_tokenizer\(config\)"):
        assert cfg.the_tokenizer is data_tokenizer(cfg)
    with pytest.warns(DeprecationWarning, match=r"data_vocab_size\(config\)"):
        assert cfg.the_vocab_size == data_vocab_size(cfg) == 4100


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"format": {"type": "text", "messages_field": "m"}}, r"^data\.format\.messages_field: not a field of type "),
        ({"format": "text", "chat_template": "{{ x }}"}, r"^data\.format\.chat_template: not a field of type 'text'"),
        (
            {"format": "dpo"},
            r"^data\.format\.type: unknown type 'dpo'; known: asr, chat, preference_chat, supervised, text$",
        ),
        ({"format": {"type": "chat", "pack": False}, "pack": True}, r"^data\.pack: given both flat"),
    ],
)
def test_bad_format_sections_name_the_key(data: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _load(data)


def test_a_new_format_is_one_registered_class(tmp_path: Path) -> None:
    """A toy format (every record's ``body`` upper-cased), registered like ``preference_chat`` would be."""

    @LmDatasetFormat.register_subclass("shouted")
    @dataclasses.dataclass(frozen=True)
    class ShoutedFormat(TextLmDatasetFormat):
        has_loss_mask: ClassVar[bool] = False
        text_key: str = "body"

        def processor(self, tokens: TokenizerSpec, folder: str | None) -> TokenizerProcessor:
            return TokenizerProcessor(tokens.tokenizer, text_key=self.text_key, eos=tokens.eos)

    try:
        (tmp_path / "t.jsonl").write_text('{"body": "to be or not to be, that is the question"}\n' * 4)
        cfg = _load({"train_urls": [str(tmp_path / "t.jsonl")], "tokenizer": TOKENIZER, "format": "shouted"})
        assert cfg.format == ShoutedFormat()
        cfg = dataclasses.replace(cfg, cache_dir=str(tmp_path / "cache"), workers=0)
        built = build_datasets(cfg, 8, seed=0)
        assert built.train is not None
        built.train.wait_for_length(None)
        ids = built.tokenizer.encode("to be or not to be, that is the question").ids
        assert built.train[0]["input_ids"].tolist() == ids[:8]
        assert built.validation == {}
        assert built.vocab_size == built.tokenizer.get_vocab_size(with_added_tokens=True)
    finally:
        LmDatasetFormat._registry().pop("shouted")
