"""Fuzzing the config parser: random bytes, random YAML structures, random overrides and argv.

The contract (:func:`ponente.trainer.config.load_config`, :func:`parse_config`): whatever a config file or a
command line contains, the parser either returns a config or raises :class:`ConfigError` with a one-line
message, and it never hangs. Each example runs under a SIGALRM time limit so a hang fails instead of stalling.
"""

from __future__ import annotations

import atexit
import dataclasses
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from ponente.datacache.testing import time_limit
from ponente.trainer.config import ConfigError, load_config, parse_config
from ponente.trainer.config._family import family_of
from ponente.trainer.main.lora_lm import LoraLmConfig
from ponente.trainer.main.sft import SftConfig
from ponente.trainer.main.train_lm import TrainLmConfig

EXAMPLE_SECONDS = 10
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
FUZZ_EACH = settings(FUZZ, max_examples=50)  # per config class (3 classes)
CONFIGS: list[type[Any]] = [TrainLmConfig, SftConfig, LoraLmConfig]
_DIR = Path(tempfile.mkdtemp(prefix="ponente-fuzz-config-"))
atexit.register(shutil.rmtree, _DIR, ignore_errors=True)
FILE = _DIR / "fuzz.yaml"


def _keys(value: Any, path: str = "", depth: int = 0) -> list[str]:
    """Every dotted key of a config instance (and ``<section>.type`` for registry sections)."""
    out: list[str] = []
    for field in dataclasses.fields(value):
        if not field.init:
            continue
        key = f"{path}.{field.name}" if path else field.name
        current = getattr(value, field.name)
        if dataclasses.is_dataclass(current) and not isinstance(current, type) and depth < 6:
            if family_of(type(current)) is not None:
                out.append(f"{key}.type")
            out.extend(_keys(current, key, depth + 1))
        else:
            out.append(key)
    return out


KEYS = sorted({key for cls in CONFIGS for key in _keys(cls())})
TYPE_NAMES = ["llama", "gpt2", "gemma", "mistral", "qwen", "adam", "lion", "json", "wandb", "noop", "cosine", "linear"]

scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=10**300, max_value=10**320)  # beyond float, and timedelta, range
    | st.floats()  # nan and inf included
    | st.text(max_size=12)
    | st.sampled_from([*TYPE_NAMES, "10m", "1h30m", "-1", "1e400", "p=f32,c=bfloat16", "null", "~", "[", "{"])
)
structures = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.text(max_size=8) | st.sampled_from(["type", "name", "id"]), children, max_size=4)
    ),
    max_leaves=12,
)
# a key: a real dotted key, a real key with a random part added or cut, or random text
keys = (
    st.sampled_from(KEYS)
    | st.tuples(st.sampled_from(KEYS), st.text(max_size=6)).map(lambda t: f"{t[0]}.{t[1]}")
    | st.sampled_from(KEYS).map(lambda k: k.rsplit(".", 1)[0])
    | st.text(max_size=20)
)
value_texts = st.text(max_size=20) | structures.map(
    lambda v: yaml.safe_dump(v, default_flow_style=True, width=1_000_000).strip().removesuffix("...").strip()
)
YAML_ALPHABET = "abcdefgty_01.-:,[]{}!&*|>'\"%@#?\n \t\\" + "é\x00\x85\ufeff"


def check_one_line(error: ConfigError) -> None:
    """A ConfigError's message: one non-empty line."""
    message = str(error)
    assert message, repr(error)
    assert "\n" not in message, repr(message)


def check(cls: type[Any], paths: list[Path], overrides: list[str]) -> None:
    """Load ``cls``; only :class:`ConfigError` (one line) may come out, within the time limit."""
    error: ConfigError | None = None
    try:
        with time_limit(EXAMPLE_SECONDS):
            config = load_config(cls, [str(p) for p in paths], overrides)
    except ConfigError as e:
        error = e
    if error is not None:
        check_one_line(error)
    else:
        assert isinstance(config, cls)


def _nest(items: list[tuple[str, Any]]) -> dict[Any, Any]:
    """A YAML tree from dotted keys (later keys inside an earlier scalar replace it)."""
    tree: dict[Any, Any] = {}
    for key, value in items:
        node = tree
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.get(part)
            node[part] = child if isinstance(child, dict) else {}
            node = node[part]
        node[parts[-1]] = value
    return tree


@FUZZ
@given(data=st.binary(max_size=400) | st.text(YAML_ALPHABET, max_size=400).map(lambda t: t.encode("utf-8")))
@example(data=b"\xff\xfe not utf-8")
@example(data=b"[" * 2_000)  # deeper than Python's recursion limit
@example(data=b"a: " + b"{b: " * 3_000)
@example(data=b"trainer: !include fuzz.yaml\n")  # includes itself
@example(data=b"trainer: !include /\n")
@example(data=b"a: &a [*a]\n")
def test_random_file_bytes(data: bytes) -> None:
    FILE.write_bytes(data)  # what a file holds fails the same way whatever the config class
    check(TrainLmConfig, [FILE], [])


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
@FUZZ_EACH
@given(items=st.lists(st.tuples(keys.filter(bool), structures), max_size=6), top=structures)
@example(items=[], top={"\n": None})  # found in CI: a key that is a line break once split the message
@example(items=[("trainer.\r\nx", 1)], top={})
def test_random_yaml_structures(cls: type[Any], items: list[tuple[str, Any]], top: Any) -> None:
    tree: Any = _nest(items)
    FILE.write_text(yaml.safe_dump(tree if items else top, allow_unicode=True), encoding="utf-8")
    check(cls, [FILE], [])


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
@FUZZ_EACH
@given(overrides=st.lists(st.tuples(keys, value_texts).map(lambda kv: f"{kv[0]}={kv[1]}") | st.text(max_size=20)))
@example(overrides=["trainer.checkpointer.save_interval=1e400", "optimizer.learning_rate=1" + "0" * 400])
@example(overrides=["trainer.num_train_steps=" + "[" * 5_000])
@example(overrides=["model.type=llama", "model.num_layers=1e999"])
def test_random_overrides(cls: type[Any], overrides: list[str]) -> None:
    check(cls, [], overrides)


@FUZZ
@given(
    argv=st.lists(
        st.sampled_from(["--config_path", "--config", "gpt2_nano", "--", "=", "-x"])
        | keys.map(lambda k: f"--{k}")
        | value_texts
        | st.text(max_size=12),
        max_size=8,
    ).filter(lambda argv: not {"-h", "--help"} & set(argv))
)
def test_random_argv(argv: list[str]) -> None:
    error: ConfigError | None = None
    try:
        with time_limit(EXAMPLE_SECONDS):
            config = parse_config(TrainLmConfig, argv, prog="ponente-train", exit_on_error=False)
    except ConfigError as e:
        error = e
    if error is not None:
        check_one_line(error)
    else:
        assert isinstance(config, TrainLmConfig)


def test_random_argv_exits_2_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """The command-line front end turns any ConfigError into ``error: <one line>`` and exit status 2."""
    with pytest.raises(SystemExit) as info:
        parse_config(TrainLmConfig, ["--trainer.checkpointer.save_interval", "1e400"], prog="ponente-train")
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: trainer.checkpointer.save_interval: expected a duration")
    assert err.count("\n") == 1


def test_include_cycle_is_named(tmp_path: Path) -> None:
    """Files that include each other: one line naming the cycle, not a RecursionError after 1000 reads."""
    (tmp_path / "a.yaml").write_text("trainer: !include b.yaml\n")
    (tmp_path / "b.yaml").write_text("x: !include a.yaml\n")
    with pytest.raises(ConfigError, match=r"!include cycle: .*a\.yaml -> .*b\.yaml -> .*a\.yaml"):
        load_config(TrainLmConfig, [tmp_path / "a.yaml"])
