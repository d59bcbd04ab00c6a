"""Where config values come from: YAML files, packaged configs by name, dotted overrides; and their merge."""

from __future__ import annotations

import copy
import importlib.resources
import os
from collections.abc import Iterable, Mapping
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any, TypeVar

import yaml

from ._decode import Text, decode, join
from ._errors import ConfigError

__all__ = ["apply_override", "load_config", "merge", "packaged_config_names", "read_config_file", "split_override"]

T = TypeVar("T")
_PACKAGE = "ponente.trainer.config"


def packaged_config_names() -> list[str]:
    """The names of the YAML configs shipped in ``ponente/trainer/config/`` (usable as ``--config_path NAME``)."""
    root = importlib.resources.files(_PACKAGE)
    return sorted(entry.name[: -len(".yaml")] for entry in root.iterdir() if entry.name.endswith(".yaml"))


def _resolve(path_or_name: str | os.PathLike[str]) -> tuple[Traversable, Traversable]:
    # (the file, the folder its ``!include``s are relative to)
    path = Path(path_or_name)
    if path.is_file():
        return path, path.parent
    name = str(path_or_name)
    name = name[: -len(".yaml")] if name.endswith(".yaml") else name
    if "/" not in name and os.sep not in name and name in packaged_config_names():
        root = importlib.resources.files(_PACKAGE)
        return root.joinpath(f"{name}.yaml"), root
    where = "is a directory" if path.is_dir() else "is neither a file nor a packaged config"
    known = ", ".join(packaged_config_names()) or "none"
    raise ConfigError(f"config {str(path_or_name)!r}: {where}; packaged configs: {known}")


class _Loader(yaml.SafeLoader):
    """SafeLoader plus ``!include other.yaml`` (relative to the including file), as in Levanter's configs."""

    directory: Traversable | None = None
    chain: tuple[str, ...] = ()  # the files being read, outermost first, to refuse ``!include`` cycles


def _include(loader: _Loader, node: yaml.Node) -> Any:
    target = str(loader.construct_scalar(node))  # type: ignore[arg-type]
    if Path(target).is_absolute() or loader.directory is None:
        file, directory = _resolve(target)
        return _read(file, target, directory, loader.chain)
    file = loader.directory.joinpath(target)
    directory = Path(file).parent if isinstance(file, Path) else loader.directory
    return _read(file, target, directory, loader.chain)


_Loader.add_constructor("!include", _include)


def _identity(file: Traversable) -> str:
    if isinstance(file, Path):
        try:
            return str(file.resolve())
        except (OSError, RuntimeError):  # RuntimeError: a symlink loop
            return str(file.absolute())
    return f"{_PACKAGE}:{file.name}"


def _read(file: Traversable, shown: str, directory: Traversable, chain: tuple[str, ...] = ()) -> dict[str, Any]:
    identity = _identity(file)
    if identity in chain:
        raise ConfigError(f"config {shown!r}: !include cycle: {' -> '.join([*chain, identity])}")
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"config {shown!r}: cannot read ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config {shown!r}: not UTF-8 text (byte {e.object[e.start]:#04x} at {e.start})") from None
    loader: _Loader | None = None
    try:
        loader = _Loader(text)  # refuses control characters (NUL, ...) right away
        loader.directory = directory
        loader.chain = (*chain, identity)
        data = loader.get_single_data()
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{shown}{line}: invalid YAML: {problem}") from None
    except RecursionError:  # PyYAML composes nested nodes recursively
        raise ConfigError(f"{shown}: invalid YAML: nested too deeply") from None
    finally:
        if loader is not None:
            loader.dispose()
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{shown}: expected a mapping of config keys at the top level, got {type(data).__name__}")
    return data


def read_config_file(path_or_name: str | os.PathLike[str]) -> dict[str, Any]:
    """Read one YAML config: a file path, or the name of a packaged config (``gpt2_nano``, ``.yaml`` optional).

    Raises:
        ConfigError: if the file is missing (the message lists the packaged names), unreadable, not UTF-8,
            not YAML (or nested too deeply), not a mapping, or ``!include``s itself.
    """
    file, directory = _resolve(path_or_name)
    return _read(file, str(path_or_name), directory)


def merge(old: Any, new: Any) -> Any:
    """Deep-merge ``new`` over ``old``: mappings merge key by key, anything else replaces.

    A mapping whose ``type`` differs from the old mapping's ``type`` replaces it whole (the old keys
    belong to the old class). Neither input is modified.
    """
    if not (isinstance(old, Mapping) and isinstance(new, Mapping)):
        return copy.deepcopy(new)
    if "type" in old and "type" in new and str(old["type"]) != str(new["type"]):
        return copy.deepcopy(dict(new))
    out = dict(old)
    for key, value in new.items():
        out[key] = merge(out[key], value) if key in out else copy.deepcopy(value)
    return out


def split_override(text: str) -> tuple[list[str], Text]:
    """Split ``"a.b.c=value"`` (a leading ``--`` is allowed) into ``(["a", "b", "c"], Text("value"))``.

    Raises:
        ConfigError: if there is no ``=`` or the key is empty.
    """
    body = text[2:] if text.startswith("--") else text
    key, sep, value = body.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r}: expected KEY=VALUE with a dotted KEY, e.g. trainer.num_train_steps=10")
    return key.split("."), Text(value)


def apply_override(tree: dict[str, Any], keys: list[str], value: Any) -> None:
    """Set ``tree[k1][k2]...[kn] = value`` in place, creating mappings on the way.

    Setting a ``type`` that differs from the one already there drops the sibling keys (they belonged
    to the old class).

    Raises:
        ConfigError: if a key on the way holds something that is not a mapping.
    """
    node = tree
    for depth, key in enumerate(keys[:-1]):
        child = node.get(key)
        if isinstance(child, Text):
            child = decode(Any, child, join(".".join(keys[:depth]), key))
        if child is None:
            child = {}
        if not isinstance(child, dict):
            where = ".".join(keys[: depth + 1])
            raise ConfigError(f"{'.'.join(keys)}: cannot set a key inside {where}, which is {child!r}, not a mapping")
        node[key] = child = dict(child)
        node = child
    last = keys[-1]
    if last == "type" and "type" in node and str(node["type"]) != str(value):
        node.clear()
    node[last] = value


def _override_order(item: str | Mapping[str, Any]) -> int:
    # ``--model.type llama`` applies before ``--model.num_layers 2`` whatever their order on the command line
    return 0 if isinstance(item, str) and split_override(item)[0][-1] == "type" else 1


def load_config(
    cls: type[T],
    paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]] = (),
    overrides: Mapping[str, Any] | Iterable[str | Mapping[str, Any]] = (),
) -> T:
    """Build config ``cls`` from YAML files and overrides, over the dataclass defaults.

    Args:
        cls: the root config dataclass.
        paths: YAML files or packaged config names, deep-merged in order (later wins).
        overrides: applied after the files, in order: ``"a.b.c=value"`` strings (the value is read like a
            command-line value) and nested mappings of plain data (merged like one more file). A single
            mapping is accepted too, e.g. the output of :func:`config_to_dict`.

    Returns:
        The config.

    Raises:
        ConfigError: one line naming the dotted key (or file) at fault. This is the only exception that
            files and ``"key=value"`` overrides can cause, whatever their content (the config parser is
            fuzzed with random bytes and random YAML structures).

    Example:
        >>> import dataclasses
        >>> @dataclasses.dataclass(frozen=True)
        ... class Run:
        ...     steps: int = 10
        ...     name: str = "demo"
        >>> load_config(Run, overrides=["steps=20"])
        Run(steps=20, name='demo')
    """
    if isinstance(paths, str | os.PathLike):
        paths = [paths]
    tree: dict[str, Any] = {}
    for path in paths:
        tree = merge(tree, read_config_file(path))
    items: list[str | Mapping[str, Any]] = [overrides] if isinstance(overrides, Mapping) else list(overrides)
    for item in sorted(items, key=_override_order):
        if isinstance(item, str):
            keys, value = split_override(item)
            apply_override(tree, keys, value)
        elif isinstance(item, Mapping):
            tree = merge(tree, item)
        else:
            raise TypeError(f"load_config: overrides must be 'key=value' strings or mappings, got {item!r}")
    try:
        config: T = decode(cls, tree, "")
    except RecursionError:  # a value nested deeper than Python's recursion limit
        raise ConfigError("the configuration is nested too deeply to decode") from None
    return config
