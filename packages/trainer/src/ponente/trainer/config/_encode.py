"""Typed configs -> plain YAML-friendly data (the inverse of decoding)."""

from __future__ import annotations

import dataclasses
import datetime
import enum
import pathlib
from collections.abc import Mapping
from typing import Any

import yaml

from ._duration import format_duration
from ._family import family_of

__all__ = ["config_to_dict", "config_to_yaml", "to_plain"]


def to_plain(value: Any) -> Any:
    """Plain data for one value: dataclasses -> dicts (with ``type`` for family members), tuples -> lists,
    timedeltas -> ``"1h30m"``, paths -> str, enums -> their value; other values unchanged."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out: dict[str, Any] = {}
        family = family_of(type(value))
        name = family.name_of(type(value)) if family is not None else None
        if name:
            out["type"] = name
        for field in dataclasses.fields(value):
            if field.init:
                out[field.name] = to_plain(getattr(value, field.name))
        return out
    if isinstance(value, enum.Enum):
        return value.value if isinstance(value.value, str | int | float | bool) else value.name
    if isinstance(value, datetime.timedelta):
        return format_duration(value)
    if isinstance(value, pathlib.PurePath):
        return str(value)
    if isinstance(value, str):
        return str(value)
    if isinstance(value, Mapping):
        return {to_plain(k): to_plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_plain(v) for v in value]
    return value


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """A config dataclass as nested plain data that :func:`load_config` reads back to an equal config.

    Args:
        cfg: a config dataclass instance.

    Returns:
        A dict of plain values (``type`` keys for registry members, durations as ``"90s"``-style text).

    Raises:
        TypeError: if ``cfg`` is not a dataclass instance.

    Example:
        >>> import dataclasses, datetime
        >>> @dataclasses.dataclass(frozen=True)
        ... class Run:
        ...     steps: int = 10
        ...     every: datetime.timedelta = datetime.timedelta(minutes=90)
        >>> config_to_dict(Run())
        {'steps': 10, 'every': '1h30m'}
    """
    if not dataclasses.is_dataclass(cfg) or isinstance(cfg, type):
        raise TypeError(f"config_to_dict expects a dataclass instance, got {type(cfg).__name__}")
    out: dict[str, Any] = to_plain(cfg)
    return out


def config_to_yaml(cfg: Any) -> str:
    """:func:`config_to_dict` as YAML text (keys in field order).

    Args:
        cfg: a config dataclass instance.

    Returns:
        The YAML document.
    """
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False, default_flow_style=False)
