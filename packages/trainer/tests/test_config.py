"""Config parsing: files, overrides, registries, errors, --help and the dict round trip."""

# no ``from __future__ import annotations``: the dataclasses local to tests need evaluated annotations

import dataclasses
import datetime
import enum
import pathlib
import textwrap
from typing import Any, ClassVar, Literal

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from ponente.trainer.config import (
    ConfigError,
    Registrable,
    config_to_dict,
    config_to_yaml,
    format_duration,
    load_config,
    packaged_config_names,
    parse_config,
    parse_duration,
    register_family,
)

# ---------------------------------------------------------------------------------------------- toy configs


class Color(enum.Enum):
    RED = "red"
    GREEN = "green"


class Level(enum.Enum):
    LOW = 1
    HIGH = 2


class ShapeConfig(Registrable):
    """A toy family (like OptimizerConfig)."""

    default_choice: ClassVar[str | None] = "circle"


@ShapeConfig.register_subclass("circle")
@dataclasses.dataclass(frozen=True)
class Circle(ShapeConfig):
    radius: float = 1.0
    filled: bool = False


@ShapeConfig.register_subclass("square")
@dataclasses.dataclass(frozen=True)
class Square(ShapeConfig):
    side: int = 2
    filled: bool = False


class NoDefault(Registrable):
    pass


@NoDefault.register_subclass("a")
@dataclasses.dataclass(frozen=True)
class NoDefaultA(NoDefault):
    x: int = 0


@dataclasses.dataclass(frozen=True)
class Inner:
    """Inner section.

    Attributes:
        steps: how many steps
            to run.
        rate: the learning rate.
    """

    steps: int = 10
    rate: float = 0.1
    name: str = "inner"

    def __post_init__(self) -> None:
        if self.steps < 0:
            raise ValueError(f"steps must be >= 0, got {self.steps}")


@dataclasses.dataclass(frozen=True)
class Toy:
    inner: Inner = dataclasses.field(default_factory=Inner)
    flag: bool = False
    ratio: float = 0.5
    label: str | None = None
    mode: Literal["fast", "slow"] = "fast"
    color: Color = Color.RED
    level: Level = Level.LOW
    tags: list[str] = dataclasses.field(default_factory=list)
    dims: tuple[int, ...] = (1, 2)
    pair: tuple[int, str] = (0, "a")
    weights: dict[str, float] = dataclasses.field(default_factory=dict)
    every: datetime.timedelta = datetime.timedelta(minutes=15)
    out: pathlib.Path = pathlib.Path("out")
    shape: ShapeConfig = dataclasses.field(default_factory=Circle)
    shapes: ShapeConfig | tuple[ShapeConfig, ...] = dataclasses.field(default_factory=Square)
    extra: Any = None
    checkpointing: bool | str = False
    count: int | None = None
    sections: dict[str, Inner] = dataclasses.field(default_factory=lambda: {"a": Inner(steps=1)})


@dataclasses.dataclass(frozen=True)
class NeedsValue:
    required: int
    optional: int = dataclasses.field(default=3, metadata={"help": "an optional value\nsecond line"})


@dataclasses.dataclass(frozen=True)
class Disk:
    path: str = "/tmp"
    size_gb: int = 1


@dataclasses.dataclass(frozen=True)
class Bucket:
    bucket: str = "b"
    region: str = "eu"


@dataclasses.dataclass(frozen=True)
class Storage:
    where: Disk | Bucket = dataclasses.field(default_factory=Disk)
    both: Disk | Bucket | None = None


def write(tmp_path: pathlib.Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def error_of(cls: type[Any], *overrides: str, paths: tuple[str, ...] = ()) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(cls, paths, overrides)
    message = str(info.value)
    assert "\n" not in message
    return message


# ---------------------------------------------------------------------------------------------- defaults, files


def test_defaults_without_sources() -> None:
    assert load_config(Toy) == Toy()


def test_yaml_file_sets_typed_values(tmp_path: pathlib.Path) -> None:
    path = write(
        tmp_path,
        "a.yaml",
        """
        inner: {steps: 5}
        flag: true
        ratio: 1E-3          # YAML 1.1 reads this as a string; float fields accept it
        label: hello
        mode: slow
        color: green
        level: 2
        tags: [x, y]
        dims: [3, 4, 5]
        pair: [7, b]
        weights: {a: 0.25, b: 1}
        every: 1h30m
        out: runs/x
        extra: {anything: [1, 2]}
        count: 4
        """,
    )
    cfg = load_config(Toy, [path])
    expected = Toy(
        inner=Inner(steps=5),
        flag=True,
        ratio=0.001,
        label="hello",
        mode="slow",
        color=Color.GREEN,
        level=Level.HIGH,
        tags=["x", "y"],
        dims=(3, 4, 5),
        pair=(7, "b"),
        weights={"a": 0.25, "b": 1.0},
        every=datetime.timedelta(hours=1, minutes=30),
        out=pathlib.Path("runs/x"),
        extra={"anything": [1, 2]},
        count=4,
    )
    assert cfg == expected
    assert isinstance(cfg.weights["b"], float)


def test_nested_section_merges_over_default() -> None:
    cfg = load_config(Toy, overrides={"inner": {"rate": 0.5}, "sections": {"a": {"rate": 2.0}, "b": {}}})
    assert cfg.inner == Inner(steps=10, rate=0.5, name="inner")
    # a dict entry merges over the default entry of the same key; new keys start from the class defaults
    assert cfg.sections == {"a": Inner(steps=1, rate=2.0), "b": Inner()}


def test_later_files_win_and_merge_deeply(tmp_path: pathlib.Path) -> None:
    a = write(tmp_path, "a.yaml", "inner: {steps: 5, name: first}\nflag: true\n")
    b = write(tmp_path, "b.yaml", "inner: {steps: 6}\n")
    cfg = load_config(Toy, [a, b])
    assert (cfg.inner.steps, cfg.inner.name, cfg.flag) == (6, "first", True)


def test_include_relative_to_file(tmp_path: pathlib.Path) -> None:
    (tmp_path / "parts").mkdir()
    write(tmp_path, "parts/inner.yaml", "steps: 9\nname: included\n")
    main = write(tmp_path, "main.yaml", "inner: !include parts/inner.yaml\n")
    assert load_config(Toy, main).inner == Inner(steps=9, name="included")


def test_empty_file_is_defaults(tmp_path: pathlib.Path) -> None:
    assert load_config(Toy, write(tmp_path, "e.yaml", "# nothing\n")) == Toy()


# ---------------------------------------------------------------------------------------------- overrides


def test_dotted_overrides_parse_by_field_type() -> None:
    cfg = load_config(
        Toy,
        overrides=[
            "inner.steps=7",
            "inner.name=007",  # str fields keep the text verbatim
            "flag=yes",
            "ratio=1e-3",
            "tags=[a, b]",
            "weights={x: 1.5}",
            "every=45s",
            "label=null",
            "count=none",
            "extra=[1, {a: 2}]",
        ],
    )
    assert cfg.inner == Inner(steps=7, name="007")
    assert (cfg.flag, cfg.ratio, cfg.tags, cfg.weights) == (True, 0.001, ["a", "b"], {"x": 1.5})
    assert (cfg.every, cfg.label, cfg.count, cfg.extra) == (datetime.timedelta(seconds=45), None, None, [1, {"a": 2}])


@pytest.mark.parametrize(
    ("text", "expected"),
    [("true", True), ("False", False), ("1", True), ("0", False), ("yes", True), ("no", False)],
)
def test_cli_bools(text: str, expected: bool) -> None:
    assert load_config(Toy, overrides=[f"flag={text}"]).flag is expected


def test_bool_or_int_union_reads_cli_text_as_typed_yaml() -> None:
    @dataclasses.dataclass(frozen=True)
    class Shuffle:
        shuffle: bool | int = False
        size: int | str = 0

    assert load_config(Shuffle, overrides=["shuffle=1"]).shuffle == 1
    assert load_config(Shuffle, overrides=["shuffle=1"]).shuffle is not True
    assert load_config(Shuffle, overrides=["shuffle=true"]).shuffle is True
    assert load_config(Shuffle, overrides=["size=2.5"]).size == "2.5"
    assert load_config(Shuffle, overrides=["size=12"]).size == 12
    assert error_of(Shuffle, "shuffle=maybe") == "shuffle: expected bool | int, got 'maybe'"


def test_bool_or_str_union() -> None:
    assert load_config(Toy, overrides=["checkpointing=true"]).checkpointing is True
    assert load_config(Toy, overrides=["checkpointing=offload"]).checkpointing == "offload"
    assert load_config(Toy, overrides={"checkpointing": "full"}).checkpointing == "full"


def test_overrides_after_files(tmp_path: pathlib.Path) -> None:
    path = write(tmp_path, "a.yaml", "inner: {steps: 5, rate: 0.2}\n")
    assert load_config(Toy, [path], ["inner.steps=8"]).inner == Inner(steps=8, rate=0.2)


def test_parse_config_cli_forms(tmp_path: pathlib.Path) -> None:
    a = write(tmp_path, "a.yaml", "inner: {steps: 5}\n")
    b = write(tmp_path, "b.yaml", "flag: true\n")
    for argv in (
        ["--config_path", a, b, "--inner.rate", "0.3", "--label=x"],
        ["--config_path", a, "--config_path", b, "--inner.rate=0.3", "--label", "x"],
        [f"--config_path={a}", "--config_path", b, "--inner.rate", "0.3", "--label", "x"],
    ):
        cfg = parse_config(Toy, argv)
        assert cfg == Toy(inner=Inner(steps=5, rate=0.3), flag=True, label="x"), argv


def test_negative_number_is_a_value() -> None:
    assert parse_config(Toy, ["--ratio", "-2.5"]).ratio == -2.5


# ---------------------------------------------------------------------------------------------- registries


def test_registry_default_choice_and_type_switch() -> None:
    assert load_config(Toy).shape == Circle()
    assert load_config(Toy, overrides=["shape.radius=3"]).shape == Circle(radius=3.0)
    assert load_config(Toy, overrides=["shape.type=square"]).shape == Square()
    assert load_config(Toy, overrides={"shape": {"type": "square", "side": 5}}).shape == Square(side=5)


def test_type_override_applies_first_and_resets_old_keys(tmp_path: pathlib.Path) -> None:
    path = write(tmp_path, "a.yaml", "shape: {type: circle, radius: 4}\n")
    cfg = load_config(Toy, [path], ["shape.filled=true", "shape.type=square"])
    assert cfg.shape == Square(filled=True)


def test_type_change_between_files_replaces_section(tmp_path: pathlib.Path) -> None:
    a = write(tmp_path, "a.yaml", "shape: {type: circle, radius: 4}\n")
    b = write(tmp_path, "b.yaml", "shape: {type: square, side: 3}\n")
    assert load_config(Toy, [a, b]).shape == Square(side=3)


def test_same_type_merges_over_default_instance() -> None:
    @dataclasses.dataclass(frozen=True)
    class Holder:
        shape: ShapeConfig = dataclasses.field(default_factory=lambda: Circle(radius=9.0))

    assert load_config(Holder, overrides={"shape": {"type": "circle", "filled": True}}).shape == Circle(9.0, True)
    assert load_config(Holder, overrides={"shape": {"filled": True}}).shape == Circle(9.0, True)


def test_family_shorthand_string() -> None:
    assert load_config(Toy, overrides=["shape=square"]).shape == Square()


def test_family_or_tuple_union(tmp_path: pathlib.Path) -> None:
    path = write(tmp_path, "a.yaml", "shapes:\n  - {type: circle, radius: 2}\n  - type: square\n")
    assert load_config(Toy, [path]).shapes == (Circle(radius=2.0), Square())
    assert load_config(Toy, overrides={"shapes": {"type": "circle"}}).shapes == Circle()
    assert load_config(Toy, overrides=["shapes.side=4"]).shapes == Square(side=4)
    assert load_config(Toy, overrides=["shapes.type=circle"]).shapes == Circle()


def test_union_of_dataclasses_picks_by_keys() -> None:
    assert load_config(Storage, overrides={"where": {"bucket": "x"}}).where == Bucket(bucket="x")
    assert load_config(Storage, overrides={"where": {"size_gb": 3}}).where == Disk(size_gb=3)
    assert load_config(Storage, overrides={"both": {"region": "us"}}).both == Bucket(region="us")


def test_external_family_hook() -> None:
    class Base:
        pass

    @dataclasses.dataclass(frozen=True)
    class One(Base):
        a: int = 1

    @dataclasses.dataclass(frozen=True)
    class Two(Base):
        b: int = 2

    table: dict[str, type[Any]] = {"one": One, "two": Two}
    register_family(Base, table.__getitem__, lambda: sorted(table), lambda c: {v: k for k, v in table.items()}.get(c))

    @dataclasses.dataclass(frozen=True)
    class Holder:
        part: Base = dataclasses.field(default_factory=One)

    assert load_config(Holder, overrides=["part.type=two", "part.b=5"]).part == Two(b=5)
    assert config_to_dict(Holder(part=Two(b=5))) == {"part": {"type": "two", "b": 5}}
    assert "part.type: unknown type 'three'; known: one, two" in error_of(Holder, "part.type=three")


# ---------------------------------------------------------------------------------------------- errors


def test_error_wrong_type_names_dotted_key() -> None:
    assert error_of(Toy, "inner.steps=ten") == "inner.steps: expected int, got 'ten'"
    assert error_of(Toy, "ratio=fast") == "ratio: expected float, got 'fast'"
    assert error_of(Toy, "flag=maybe") == "flag: expected bool (true/false), got 'maybe'"
    assert error_of(Toy, "inner.steps=2.5") == "inner.steps: expected int, got '2.5'"


def test_error_unknown_key_suggests() -> None:
    assert error_of(Toy, "inner.stepz=3") == "inner.stepz: unknown key; did you mean steps?"
    message = error_of(Toy, "inner.zzz=3")
    assert message.startswith("inner.zzz: unknown key; Inner has: steps, rate, name")


def test_error_unknown_key_in_file(tmp_path: pathlib.Path) -> None:
    path = write(tmp_path, "a.yaml", "inner:\n  rat: 0.1\n")
    assert error_of(Toy, paths=(path,)) == "inner.rat: unknown key; did you mean rate?"


def test_error_unknown_type_lists_known() -> None:
    assert error_of(Toy, "shape.type=triangle") == "shape.type: unknown type 'triangle'; known: circle, square"


def test_error_missing_type_without_default() -> None:
    @dataclasses.dataclass(frozen=True)
    class Holder:
        part: NoDefault | None = None

    assert load_config(Holder, overrides={"part": {"type": "a"}}).part == NoDefaultA()
    assert error_of(Holder, "part.x=1") == "part.type: missing; NoDefault needs a type, one of: a"


def test_error_missing_required_field() -> None:
    assert error_of(NeedsValue) == "required: missing required field (int)"
    assert load_config(NeedsValue, overrides=["required=1"]) == NeedsValue(required=1)


def test_error_post_init_prefixed_with_path() -> None:
    assert error_of(Toy, "inner.steps=-1") == "inner: steps must be >= 0, got -1"


def test_error_literal_enum_duration_path_tuple() -> None:
    assert error_of(Toy, "mode=medium") == "mode: expected one of 'fast', 'slow'; got 'medium'"
    assert error_of(Toy, "color=blue").startswith("color: expected one of 'red', 'green' (Color); got 'blue'")
    assert error_of(Toy, "every=soon").startswith("every: expected a duration like '10m'")
    assert error_of(Toy, "pair=[1, 2, 3]").startswith("pair: expected 2 items")
    assert error_of(Toy, "tags=x") == "tags: expected a list (list[str]), got 'x'"
    with pytest.raises(ConfigError, match=r"^out: expected a path, got \[1\]$"):
        load_config(Toy, overrides={"out": [1], "inner": {"steps": 2.5}})
    with pytest.raises(ConfigError, match=r"^inner.steps: expected int, got 2.5$"):
        load_config(Toy, overrides={"inner": {"steps": 2.5}})


def test_error_str_field_given_number_in_yaml(tmp_path: pathlib.Path) -> None:
    path = write(tmp_path, "a.yaml", "inner: {name: 12}\n")
    assert error_of(Toy, paths=(path,)) == "inner.name: expected str, got 12 (int); quote it in YAML"


def test_error_union_of_dataclasses() -> None:
    assert error_of(Storage, "both={nothing: 1}") == "both: no member of Disk | Bucket | None accepts keys [nothing]"

    @dataclasses.dataclass(frozen=True)
    class Twin:
        path: str = "x"

    @dataclasses.dataclass(frozen=True)
    class Amb:
        where: Disk | Twin | None = None

    assert (
        error_of(Amb, "where={path: y}")
        == "where: ambiguous: keys [path] fit Disk and Twin; add a distinguishing key or a type"
    )


def test_error_setting_inside_scalar() -> None:
    assert (
        error_of(Toy, "flag=true", "flag.x=1") == "flag.x: cannot set a key inside flag, which is True, not a mapping"
    )
    assert error_of(Toy, "flag.x=1") == "flag: expected bool (true/false), got {'x': '1'}"


def test_error_files(tmp_path: pathlib.Path) -> None:
    message = error_of(Toy, paths=("no_such_config",))
    assert message.startswith("config 'no_such_config': is neither a file nor a packaged config; packaged configs:")
    bad = write(tmp_path, "bad.yaml", "inner: {steps: 1\nflag: true\n")
    assert error_of(Toy, paths=(bad,)).startswith(f"{bad}:")
    listing = write(tmp_path, "list.yaml", "- 1\n- 2\n")
    assert (
        error_of(Toy, paths=(listing,)) == f"{listing}: expected a mapping of config keys at the top level, got list"
    )


def test_error_bad_override_syntax() -> None:
    assert "expected KEY=VALUE" in error_of(Toy, "inner.steps")


def test_parse_config_exits_2_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse_config(Toy, ["--inner.stesp", "3"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err == "error: inner.stesp: unknown key; did you mean steps?\n"
    with pytest.raises(ConfigError, match=r"^inner.steps: missing value"):
        parse_config(Toy, ["--inner.steps"], exit_on_error=False)
    with pytest.raises(ConfigError, match="unexpected argument 'stray'"):
        parse_config(Toy, ["stray"], exit_on_error=False)


# ---------------------------------------------------------------------------------------------- help


def test_help_lists_fields_with_defaults_and_docs(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse_config(Toy, ["--shape.type", "square", "--help"], prog="toy")
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: toy ")
    assert "  --inner.steps: int = 10\n      how many steps to run." in out
    assert "  --every: timedelta = 15m" in out
    assert "  --shape.type: {circle,square} = square" in out
    assert "  --shape.side: int = 2" in out  # the selected class's fields
    assert "--shape.radius" not in out
    assert "  --mode: Literal['fast', 'slow'] = fast" in out


def test_help_for_required_fields(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_config(NeedsValue, ["-h"])
    out = capsys.readouterr().out
    assert "  --required: int = (required)" in out
    assert "  --optional: int = 3\n      an optional value\n" in out


def test_packaged_configs_by_name(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ponente.trainer.config import _sources

    package = tmp_path / "fake_configs"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "tiny.yaml").write_text("inner: !include part.yaml\nflag: true\n")
    (package / "part.yaml").write_text("steps: 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(_sources, "_PACKAGE", "fake_configs")
    assert packaged_config_names() == ["part", "tiny"]
    expected = Toy(inner=Inner(steps=3), flag=True)
    assert parse_config(Toy, ["--config_path", "tiny"]) == expected
    assert parse_config(Toy, ["--config_path", "tiny.yaml"]) == expected
    message = error_of(Toy, paths=("tinny",))
    assert message == "config 'tinny': is neither a file nor a packaged config; packaged configs: part, tiny"


# ---------------------------------------------------------------------------------------------- durations


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("10m", 600), ("1h30m", 5400), ("45s", 45), ("2d", 172800), ("90", 90), ("1.5h", 5400), ("250ms", 0.25)],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == datetime.timedelta(seconds=seconds)


def test_parse_duration_rejects() -> None:
    for bad in ("", "10x", "m", "-5", "1h-2m"):
        with pytest.raises(ValueError, match="duration"):
            parse_duration(bad)


@settings(max_examples=50, deadline=None)
@given(st.timedeltas(min_value=datetime.timedelta(0), max_value=datetime.timedelta(days=5000)))
def test_duration_round_trip(delta: datetime.timedelta) -> None:
    text = format_duration(delta)
    assert parse_duration(text) == delta
    # independent reference for the whole-unit part: days/hours/minutes by integer arithmetic
    total = delta.days * 86400 + delta.seconds
    if delta.microseconds == 0 and total % 3600 == 0 and total:
        assert text.endswith(("h", "d"))


# ---------------------------------------------------------------------------------------------- round trip


def test_config_to_dict_plain_data() -> None:
    plain = config_to_dict(Toy(shapes=(Circle(), Square(side=3))))
    assert plain["every"] == "15m"
    assert plain["shape"] == {"type": "circle", "radius": 1.0, "filled": False}
    assert plain["shapes"] == [
        {"type": "circle", "radius": 1.0, "filled": False},
        {"type": "square", "side": 3, "filled": False},
    ]
    assert plain["dims"] == [1, 2]
    assert (plain["color"], plain["level"], plain["out"]) == ("red", 1, "out")
    assert yaml.safe_load(config_to_yaml(Toy())) == config_to_dict(Toy())


_texts = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), max_size=8)
_floats = st.floats(allow_nan=False, width=64)


@st.composite
def toys(draw: st.DrawFn) -> Toy:
    shape = st.one_of(
        st.builds(Circle, radius=_floats, filled=st.booleans()),
        st.builds(Square, side=st.integers(-5, 5), filled=st.booleans()),
    )
    inner = st.builds(Inner, steps=st.integers(0, 10**6), rate=_floats, name=_texts)
    return Toy(
        inner=draw(inner),
        flag=draw(st.booleans()),
        ratio=draw(_floats),
        label=draw(st.none() | _texts),
        mode=draw(st.sampled_from(["fast", "slow"])),
        color=draw(st.sampled_from(Color)),
        level=draw(st.sampled_from(Level)),
        tags=draw(st.lists(_texts, max_size=3)),
        dims=tuple(draw(st.lists(st.integers(-3, 3), max_size=3))),
        pair=(draw(st.integers(-3, 3)), draw(_texts)),
        weights=draw(st.dictionaries(_texts, _floats, max_size=3)),
        every=draw(st.timedeltas(min_value=datetime.timedelta(0), max_value=datetime.timedelta(days=30))),
        out=pathlib.Path(draw(st.sampled_from(["a", "a/b", "/abs/c"]))),
        shape=draw(shape),
        shapes=draw(shape | st.lists(shape, max_size=2).map(tuple)),
        checkpointing=draw(st.booleans() | st.sampled_from(["offload", "full", "true"])),
        count=draw(st.none() | st.integers(-10, 10)),
        sections=draw(st.dictionaries(_texts, inner, max_size=2)),
    )


@settings(max_examples=40, deadline=None)
@given(toys())
def test_round_trip_through_dict_and_yaml(cfg: Toy) -> None:
    assert load_config(Toy, overrides=config_to_dict(cfg)) == cfg
    assert load_config(Toy, overrides=yaml.safe_load(config_to_yaml(cfg))) == cfg


@settings(max_examples=30, deadline=None)
@given(st.builds(Storage, where=st.builds(Disk, size_gb=st.integers(0, 9)) | st.builds(Bucket, region=_texts)))
def test_round_trip_union_of_dataclasses(cfg: Storage) -> None:
    assert load_config(Storage, overrides=config_to_dict(cfg)) == cfg


# ---------------------------------------------------------------------------------------------- Levanter-style YAML


@dataclasses.dataclass(frozen=True)
class DataToy:
    train_urls: list[str] = dataclasses.field(default_factory=list)
    validation_urls: list[str] = dataclasses.field(default_factory=list)
    cache_dir: str = "cache/"
    tokenizer: str = "gpt2"
    id: str | None = None


class TrackerToy(Registrable):
    default_choice: ClassVar[str | None] = "wandb"


@TrackerToy.register_subclass("wandb")
@dataclasses.dataclass(frozen=True)
class WandbToy(TrackerToy):
    project: str | None = None
    tags: list[str] = dataclasses.field(default_factory=list)


@TrackerToy.register_subclass("noop")
@dataclasses.dataclass(frozen=True)
class NoopToy(TrackerToy):
    pass


@dataclasses.dataclass(frozen=True)
class KeepToy:
    every: int = 1000
    until: int | None = None


@dataclasses.dataclass(frozen=True)
class CheckpointerToy:
    base_path: str = "checkpoints/"
    save_interval: datetime.timedelta = datetime.timedelta(minutes=15)
    keep: list[KeepToy] = dataclasses.field(default_factory=lambda: [KeepToy()])


@dataclasses.dataclass(frozen=True)
class TrainerToy:
    tracker: TrackerToy | tuple[TrackerToy, ...] = dataclasses.field(default_factory=WandbToy)
    mp: Any = "f32"
    model_axis_size: int = 1
    per_device_parallelism: int = -1
    train_batch_size: int = 512
    num_train_steps: int = 10_000
    checkpointer: CheckpointerToy = dataclasses.field(default_factory=CheckpointerToy)


@dataclasses.dataclass(frozen=True)
class OptimizerToy:
    learning_rate: float = 6e-4
    weight_decay: float = 0.0
    min_lr_ratio: float = 0.1
    warmup: float = 0.01


@dataclasses.dataclass(frozen=True)
class ModelToy:
    type: str = "gpt2"
    hidden_dim: int = 768
    num_heads: int = 12
    num_kv_heads: int = 12
    num_layers: int = 12
    seq_len: int = 1024
    intermediate_dim: int = 3072
    gradient_checkpointing: bool | str = True


@dataclasses.dataclass(frozen=True)
class TrainToy:
    data: DataToy = dataclasses.field(default_factory=DataToy)
    model: ModelToy = dataclasses.field(default_factory=ModelToy)
    trainer: TrainerToy = dataclasses.field(default_factory=TrainerToy)
    optimizer: OptimizerToy = dataclasses.field(default_factory=OptimizerToy)


LEVANTER_STYLE = """
data:
  train_urls:
    - "corpus/openwebtext_train.{1..128}-of-128.jsonl.gz"
  validation_urls:
    - "corpus/openwebtext_val.{1..8}-of-8.jsonl.gz"
  cache_dir: "cache/tokenized/openwebtext_llama/"
  tokenizer: "tokenizers/llama"
model:
  type: llama
  hidden_dim: 768
  intermediate_dim: 2048
  num_heads: 12
  num_kv_heads: 12
  num_layers: 12
  seq_len: 1024
  gradient_checkpointing: true
trainer:
  tracker:
    project: "levanter"
    tags: ["openwebtext", "llama", "itest"]
  mp: p=f32,c=bfloat16
  model_axis_size: 1
  per_device_parallelism: -1
  train_batch_size: 256
  num_train_steps: 20000
  checkpointer:
    keep:
      - every: 100
    save_interval: 30m
optimizer:
  learning_rate: 1E-3
  weight_decay: 0.1
  min_lr_ratio: 0.1
  warmup: 1000
"""


def test_levanter_style_yaml(tmp_path: pathlib.Path) -> None:
    path = write(tmp_path, "llama_small_fast.yaml", LEVANTER_STYLE)
    cfg = load_config(TrainToy, [path], ["trainer.tracker.tags=[a]", "data.id=owt"])
    assert cfg.data == DataToy(
        train_urls=["corpus/openwebtext_train.{1..128}-of-128.jsonl.gz"],
        validation_urls=["corpus/openwebtext_val.{1..8}-of-8.jsonl.gz"],
        cache_dir="cache/tokenized/openwebtext_llama/",
        tokenizer="tokenizers/llama",
        id="owt",
    )
    assert cfg.model == ModelToy(type="llama", intermediate_dim=2048)
    assert cfg.trainer == TrainerToy(
        tracker=WandbToy("levanter", ["a"]),
        mp="p=f32,c=bfloat16",
        train_batch_size=256,
        num_train_steps=20000,
        checkpointer=CheckpointerToy(keep=[KeepToy(every=100)], save_interval=datetime.timedelta(minutes=30)),
    )
    assert cfg.optimizer == OptimizerToy(learning_rate=1e-3, weight_decay=0.1, min_lr_ratio=0.1, warmup=1000.0)
    # the file's tracker keys belong to the default type (wandb); switching type keeps them, so they must fit
    message = error_of(TrainToy, "trainer.tracker.type=noop", paths=(path,))
    assert (
        message
        == "trainer.tracker.project: not a field of type 'noop'; it belongs to type 'wandb'; NoopToy has no fields"
    )
    # an explicit different type in the file is replaced whole by the override
    typed = write(tmp_path, "typed.yaml", LEVANTER_STYLE.replace("  tracker:\n", "  tracker:\n    type: wandb\n"))
    assert load_config(TrainToy, [typed], ["trainer.tracker.type=noop"]).trainer.tracker == NoopToy()


def test_levanter_model_section_into_lm_config(tmp_path: pathlib.Path) -> None:
    from ponente.models import LmConfig, config_for_type

    @dataclasses.dataclass(frozen=True)
    class WithModel:
        model: LmConfig = dataclasses.field(default_factory=lambda: config_for_type("gpt2")())

    section = {"model": yaml.safe_load(LEVANTER_STYLE)["model"]}
    path = write(tmp_path, "m.yaml", yaml.safe_dump(section))
    cfg = load_config(WithModel, [path])
    llama = config_for_type("llama")
    assert type(cfg.model) is llama
    expected = llama(
        hidden_dim=768, intermediate_dim=2048, num_heads=12, num_kv_heads=12, num_layers=12, seq_len=1024,
        gradient_checkpointing=True,
    )  # fmt: skip
    assert cfg.model == expected
    # the default model type keeps its other fields; an unknown type names the known ones
    assert load_config(WithModel, overrides=["model.num_layers=2"]).model == config_for_type("gpt2")(num_layers=2)
    message = error_of(WithModel, "model.type=lama")
    assert message.startswith("model.type: unknown type 'lama'; known: ")
    assert {"gpt2", "llama"} <= set(message.split("known: ")[1].split(", "))
    assert config_to_dict(cfg)["model"]["type"] == "llama"
    assert load_config(WithModel, overrides=config_to_dict(cfg)) == cfg
    assert error_of(WithModel, "model.num_heads=5").startswith("model: ")


def test_packaged_config_names_match_files() -> None:
    import ponente.trainer.config as package

    folder = pathlib.Path(package.__file__).parent
    assert packaged_config_names() == sorted(p.stem for p in folder.glob("*.yaml"))
    for name in packaged_config_names():
        assert isinstance(yaml.safe_load((folder / f"{name}.yaml").read_text()), dict)
