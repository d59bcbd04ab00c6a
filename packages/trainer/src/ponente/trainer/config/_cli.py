"""Command-line front end: ``--config_path A B --a.b.c value ... [--help]``."""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
import sys
import typing
from collections.abc import Sequence
from typing import Any, TypeVar

import yaml

from ._decode import field_default, is_config_class, join, resolve_class, type_hints, type_name
from ._encode import to_plain
from ._errors import ConfigError
from ._family import family_of
from ._sources import load_config, packaged_config_names

__all__ = ["config_help", "parse_config"]

T = TypeVar("T")
_MISSING: Any = dataclasses.MISSING
_CONFIG_FLAGS = ("--config_path", "--config")
_ATTR_LINE = re.compile(r"^(\w+)(?:\s*\([^)]*\))?\s*:\s*(.*)$")


def _split_argv(argv: Sequence[str]) -> tuple[list[str], list[str], bool]:
    paths: list[str] = []
    overrides: list[str] = []
    want_help = False
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if arg in ("-h", "--help"):
            want_help = True
            continue
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(f"unexpected argument {arg!r}; options look like --trainer.num_train_steps 10")
        flag, sep, inline = arg.partition("=")
        if flag in _CONFIG_FLAGS:
            found = [inline] if sep else []
            while not sep and i < len(argv) and not argv[i].startswith("--"):
                found.append(argv[i])
                i += 1
            if not found or not all(found):
                raise ConfigError(f"{flag}: expected a YAML file or packaged config name")
            paths.extend(found)
            continue
        if not sep:
            if i >= len(argv) or argv[i].startswith("--"):
                raise ConfigError(f"{flag[2:]}: missing value (write --{flag[2:]} VALUE or --{flag[2:]}=VALUE)")
            inline = argv[i]
            i += 1
        overrides.append(f"{flag[2:]}={inline}")
    return paths, overrides, want_help


def parse_config(
    cls: type[T], argv: Sequence[str] | None = None, *, prog: str | None = None, exit_on_error: bool = True
) -> T:
    """Build config ``cls`` from command-line arguments: config files, dotted overrides, ``--help``.

    Arguments: ``--config_path A [B ...]`` (repeatable; YAML files or packaged config names, merged in
    order), then ``--a.b.c VALUE`` or ``--a.b.c=VALUE`` overrides (values read as YAML: ``10``, ``1e-3``,
    ``[1,2]``, ``{a: 1}``; ``str`` fields take the text verbatim), ``-h``/``--help`` to print every field.

    Args:
        cls: the root config dataclass.
        argv: the arguments (default ``sys.argv[1:]``).
        prog: the program name shown by ``--help`` (default ``sys.argv[0]``'s file name).
        exit_on_error: print ``error: <message>`` to stderr and exit with status 2 on a bad config (like
            ``argparse``); if False, raise instead.

    Returns:
        The config.

    Raises:
        ConfigError: on a bad config, when ``exit_on_error`` is False.
        SystemExit: after ``--help`` (status 0), or on a bad config (status 2).

    Example:
        >>> import dataclasses
        >>> @dataclasses.dataclass(frozen=True)
        ... class Run:
        ...     steps: int = 10
        >>> parse_config(Run, ["--steps", "3"])
        Run(steps=3)
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    prog = prog or os.path.basename(sys.argv[0] or "prog")
    try:
        paths, overrides, want_help = _split_argv(argv)
        if want_help:
            print(config_help(cls, paths, overrides, prog=prog))
            raise SystemExit(0)
        return load_config(cls, paths, overrides)
    except ConfigError as e:
        if not exit_on_error:
            raise
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def config_help(
    cls: type[Any], paths: Sequence[str] = (), overrides: Sequence[str] = (), *, prog: str = "prog"
) -> str:
    """The ``--help`` text: every field as a dotted option with its type, current default and description.

    Defaults reflect ``paths`` and ``overrides`` (so the fields of the *selected* registry classes are
    listed); if they do not parse, the class defaults are shown under a note.

    Args:
        cls: the root config dataclass.
        paths: config files or packaged names given so far.
        overrides: ``key=value`` overrides given so far.
        prog: the program name for the usage line.

    Returns:
        The help text.
    """
    packaged = ", ".join(packaged_config_names()) or "none"
    lines = [
        f"usage: {prog} [--config_path FILE_OR_NAME ...] [--KEY VALUE ...] [-h]",
        "",
        f"Options of {cls.__name__} (dotted keys; values are read as YAML).",
        f"  --config_path FILE_OR_NAME ...: YAML files or packaged configs ({packaged})",
    ]
    value: Any = _MISSING
    try:
        value = load_config(cls, paths, overrides)
    except ConfigError as e:
        if paths or overrides:
            lines.append(f"  (showing class defaults: {e})")
    _field_lines(cls, value, "", lines, depth=0)
    return "\n".join(lines)


def _show_default(value: Any) -> str:
    if value is _MISSING:
        return "(required)"
    text: str = yaml.safe_dump(to_plain(value), default_flow_style=True, width=1_000_000).strip()
    text = text.removesuffix("...").strip()
    return text if len(text) <= 100 else text[:97] + "..."


def _section_class(tp: Any, value: Any, path: str) -> type[Any] | None:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return type(value)
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    candidates = [tp] if is_config_class(tp) else [a for a in args if is_config_class(a)]
    if len(candidates) != 1 or (value is not _MISSING and value is not None):
        return None
    try:
        return resolve_class(candidates[0], {}, path, _MISSING)[0]
    except ConfigError:
        return None


def _field_lines(cls: type[Any], value: Any, path: str, lines: list[str], depth: int) -> None:
    family = family_of(cls)
    if path and family is not None:
        choices = ",".join(family.choices_for(family.base))
        lines.append(f"  --{join(path, 'type')}: {{{choices}}} = {family.name_of(cls)}")
    if depth > 12:
        return
    hints = type_hints(cls)
    docs = _field_docs(cls)
    for field in dataclasses.fields(cls):
        if not field.init:
            continue
        key = join(path, field.name)
        current = getattr(value, field.name) if value is not _MISSING else field_default(field)
        section = _section_class(hints[field.name], current, key)
        if section is not None:
            lines.append(f"  [{key}] {section.__name__}" + (f": {docs[field.name]}" if field.name in docs else ""))
            _field_lines(section, current if isinstance(current, section) else _MISSING, key, lines, depth + 1)
            continue
        lines.append(f"  --{key}: {type_name(hints[field.name])} = {_show_default(current)}")
        if field.name in docs:
            lines.append(f"      {docs[field.name]}")


def _field_docs(cls: type[Any]) -> dict[str, str]:
    """First lines of field descriptions: ``metadata={"help": ...}``, else Google ``Attributes:`` sections."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        docs.update(_attributes_section(klass.__dict__.get("__doc__") or ""))
    for field in dataclasses.fields(cls):
        text = field.metadata.get("help")
        if text:
            docs[field.name] = str(text).strip().splitlines()[0]
    return docs


def _attributes_section(doc: str) -> dict[str, str]:
    # ``name: text`` entries of a Google-style ``Attributes:`` section; continuation lines join the text
    found: dict[str, str] = {}
    inside, indent, current = False, -1, ""
    for line in inspect.cleandoc(doc).splitlines():
        stripped = line.strip()
        if not inside:
            inside = stripped == "Attributes:"
            continue
        if not stripped:
            continue
        width = len(line) - len(line.lstrip())
        if width == 0:
            break
        indent = width if indent < 0 else indent
        match = _ATTR_LINE.match(stripped)
        if width == indent and match:
            current = match.group(1)
            found[current] = match.group(2)
        elif width > indent and current:
            found[current] = f"{found[current]} {stripped}".strip()
    return {name: text if len(text) <= 160 else text[:157] + "..." for name, text in found.items()}
