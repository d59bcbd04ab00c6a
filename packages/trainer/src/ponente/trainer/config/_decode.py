"""Typed decoding: plain data (YAML values, command-line text) -> frozen config dataclasses.

The decoder walks ``dataclasses.fields`` and ``typing.get_type_hints``; every error it raises is a
:class:`ConfigError` whose message starts with the full dotted key.
"""

from __future__ import annotations

import dataclasses
import datetime
import difflib
import enum
import inspect
import pathlib
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Union

import yaml

from ._duration import parse_duration
from ._errors import ConfigError
from ._family import Family, family_of

__all__ = ["Text", "decode", "field_default", "is_config_class", "join", "resolve_class", "type_hints", "type_name"]

_NONE_WORDS = frozenset({"null", "none", "~"})
_TRUE_WORDS = frozenset({"true", "yes", "on", "1"})
_FALSE_WORDS = frozenset({"false", "no", "off", "0"})
_MISSING: Any = dataclasses.MISSING


class Text(str):
    """Command-line text, not yet interpreted: ``str`` fields take it verbatim, other types read it as YAML."""

    __slots__ = ()


def join(path: str, key: object) -> str:
    """The dotted key ``path.key`` (just ``key`` at the root)."""
    return f"{path}.{key}" if path else str(key)


def _show(value: Any) -> str:
    text = repr(str(value) if isinstance(value, Text) else value).replace("\n", "\\n")
    return text if len(text) <= 80 else text[:77] + "..."


def type_name(tp: Any) -> str:
    """A short readable name of a type annotation (``int``, ``list[str]``, ``Gpt2Config | None``)."""
    if tp is type(None):
        return "None"
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Union or origin is types.UnionType:
        return " | ".join(type_name(a) for a in args)
    if origin is Literal:
        return f"Literal[{', '.join(map(repr, args))}]"
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin is not None and args:
        inner = ", ".join("..." if a is Ellipsis else type_name(a) for a in args)
        return f"{getattr(origin, '__name__', repr(origin))}[{inner}]"
    return tp.__name__ if inspect.isclass(tp) else repr(tp).replace("typing.", "")


_HINTS: dict[type[Any], dict[str, Any]] = {}


def type_hints(cls: type[Any]) -> dict[str, Any]:
    """The resolved field annotations of a dataclass (string annotations evaluated), cached per class."""
    if cls not in _HINTS:
        try:
            _HINTS[cls] = typing.get_type_hints(cls)
        except NameError as e:
            raise TypeError(f"cannot resolve the field annotations of {cls.__qualname__}: {e}") from e
    return _HINTS[cls]


def is_config_class(tp: Any) -> bool:
    """Whether ``tp`` is a dataclass or a member of a registered family (parsed from a mapping)."""
    return inspect.isclass(tp) and (dataclasses.is_dataclass(tp) or family_of(tp) is not None)


def field_default(field: dataclasses.Field[Any]) -> Any:
    """The default value of a dataclass field (calling its factory), or ``dataclasses.MISSING``."""
    if field.default is not _MISSING:
        return field.default
    if field.default_factory is not _MISSING:
        factory: Any = field.default_factory
        return factory()
    return _MISSING


def _is_raw_type(tp: Any) -> bool:
    # fields left exactly as written: Any/object, and jmp policies (``p=f32,c=bfloat16``), parsed by the trainer
    return tp is Any or tp is object or (inspect.isclass(tp) and tp.__module__.split(".")[0] == "jmp")


def _yaml_text(text: Text, path: str) -> Any:
    try:
        return yaml.safe_load(str(text))
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or type(e).__name__
        raise ConfigError(f"{path}: cannot parse {_show(text)} as a YAML value ({problem})") from None
    except RecursionError:  # PyYAML's composer recurses once per nesting level
        raise ConfigError(f"{path}: cannot parse {_show(text)} as a YAML value (nested too deeply)") from None


def _yaml_or_none(text: Text) -> Any:
    try:
        return yaml.safe_load(str(text))
    except (yaml.YAMLError, RecursionError):
        return None


def _plain(value: Any, path: str) -> Any:
    return _yaml_text(value, path) if isinstance(value, Text) else value


def _is_null(value: Any) -> bool:
    return value is None or (isinstance(value, Text) and value.strip().lower() in _NONE_WORDS)


def decode(tp: Any, value: Any, path: str, base: Any = _MISSING) -> Any:
    """Convert ``value`` to type ``tp``.

    Args:
        tp: the field's annotation.
        value: plain data from YAML, a :class:`Text` from the command line, or an already typed value.
        path: the dotted key, for error messages.
        base: the current value of the field (its default); a mapping given for a dataclass merges over it.

    Returns:
        The typed value.

    Raises:
        ConfigError: if ``value`` does not fit ``tp``.
    """
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Annotated:
        return decode(args[0], value, path, base)
    if _is_raw_type(tp):
        return _plain(value, path)
    if origin is Union or origin is types.UnionType:
        return _decode_union(tp, args, value, path, base)
    if tp is type(None):
        if _is_null(value):
            return None
        raise ConfigError(f"{path}: expected null, got {_show(value)}")
    if origin is Literal:
        return _decode_literal(args, value, path)
    if tp is bool:
        return _decode_bool(value, path)
    if tp is int:
        return _decode_int(value, path)
    if tp is float:
        return _decode_float(value, path)
    if tp is str:
        if isinstance(value, str):
            return str(value)
        raise ConfigError(f"{path}: expected str, got {_show(value)} ({type(value).__name__}); quote it in YAML")
    if tp is datetime.timedelta:
        return _decode_timedelta(value, path)
    if inspect.isclass(tp) and issubclass(tp, pathlib.PurePath):
        if isinstance(value, str | pathlib.PurePath):
            return tp(str(value))
        raise ConfigError(f"{path}: expected a path, got {_show(value)}")
    if inspect.isclass(tp) and issubclass(tp, enum.Enum):
        return _decode_enum(tp, value, path)
    if tp in (list, tuple, dict) or origin in (list, tuple, dict, Sequence, Mapping):
        return _decode_collection(tp, origin or tp, args, value, path, base)
    if is_config_class(tp):
        return _decode_config(tp, value, path, base)
    raise ConfigError(f"{path}: fields of type {type_name(tp)} are not supported by the config parser")


def _decode_bool(value: Any, path: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        word = value.strip().lower()
        if word in _TRUE_WORDS:
            return True
        if word in _FALSE_WORDS:
            return False
    raise ConfigError(f"{path}: expected bool (true/false), got {_show(value)}")


def _decode_int(value: Any, path: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    raise ConfigError(f"{path}: expected int, got {_show(value)}")


def _decode_float(value: Any, path: str) -> float:
    if isinstance(value, int | float) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:  # an int beyond the float range
            raise ConfigError(f"{path}: expected float, got {_show(value)}, which is too large") from None
    if isinstance(value, str):  # YAML 1.1 reads ``1E-3`` as a string; so does the command line
        try:
            return float(value.strip())
        except ValueError:
            pass
    raise ConfigError(f"{path}: expected float, got {_show(value)}")


def _decode_timedelta(value: Any, path: str) -> datetime.timedelta:
    if isinstance(value, datetime.timedelta):
        return value
    if isinstance(value, int | float | str) and not isinstance(value, bool):
        try:
            return parse_duration(value)
        except (ValueError, ArithmeticError):  # ArithmeticError: beyond timedelta's range (OverflowError, ...)
            pass
    raise ConfigError(
        f"{path}: expected a duration like '10m', '1h30m', '45s', '2d' or a number of seconds, got {_show(value)}"
    )


def _decode_literal(choices: tuple[Any, ...], value: Any, path: str) -> Any:
    def match(candidate: Any) -> tuple[bool, Any]:
        for choice in choices:
            if candidate == choice and type(candidate) is type(choice):
                return True, choice
        return False, None

    if isinstance(value, Text):
        found, choice = match(str(value))
        if not found:
            found, choice = match(_yaml_text(value, path))
    else:
        found, choice = match(value)
    if found:
        return choice
    raise ConfigError(f"{path}: expected one of {', '.join(map(repr, choices))}; got {_show(value)}")


def _decode_enum(tp: type[enum.Enum], value: Any, path: str) -> enum.Enum:
    if isinstance(value, tp):
        return value
    plain = _plain(value, path)
    for member in tp:
        if member.value == plain and type(member.value) is type(plain):
            return member
    for text in {str(value), str(plain)}:
        if text in tp.__members__:
            return tp.__members__[text]
        for member in tp:
            if str(member.value) == text:
                return member
    known = ", ".join(repr(m.value) for m in tp)
    raise ConfigError(f"{path}: expected one of {known} ({tp.__name__}); got {_show(value)}")


def _decode_collection(tp: Any, origin: Any, args: tuple[Any, ...], value: Any, path: str, base: Any) -> Any:
    value = _plain(value, path)
    if origin in (dict, Mapping):
        key_tp, val_tp = args if args else (Any, Any)
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}: expected a mapping ({type_name(tp)}), got {_show(value)}")
        bases = base if isinstance(base, Mapping) else {}
        return {
            decode(key_tp, k, join(path, k)): decode(val_tp, v, join(path, k), bases.get(k, _MISSING))
            for k, v in value.items()
        }
    if not isinstance(value, list | tuple):
        raise ConfigError(f"{path}: expected a list ({type_name(tp)}), got {_show(value)}")
    if origin is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
        if len(args) != len(value):
            raise ConfigError(f"{path}: expected {len(args)} items ({type_name(tp)}), got {_show(value)}")
        return tuple(decode(t, v, f"{path}[{i}]") for i, (t, v) in enumerate(zip(args, value)))
    item_tp = args[0] if args else Any
    items = [decode(item_tp, v, f"{path}[{i}]") for i, v in enumerate(value)]
    return tuple(items) if origin in (tuple, Sequence) else items


# ---------------------------------------------------------------------------------------------- unions


def _kind(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        return _kind(typing.get_args(tp)[0])
    if tp in (list, tuple) or origin in (list, tuple, Sequence):
        return "list"
    if tp is dict or origin in (dict, Mapping):
        return "dict"
    if is_config_class(tp):
        return "config"
    if _is_raw_type(tp):
        return "raw"
    if tp is str or (inspect.isclass(tp) and issubclass(tp, pathlib.PurePath)):
        return "text"
    return "scalar"


def _decode_union(tp: Any, args: tuple[Any, ...], value: Any, path: str, base: Any) -> Any:
    if type(None) in args and _is_null(value):
        return None
    members = [a for a in args if a is not type(None)]
    if len(members) == 1:
        return decode(members[0], value, path, base)
    plain = value
    # command-line text is YAML unless a member takes text as is (``bool | str``: "true" is a bool, "auto" a str)
    if isinstance(value, Text) and (all(_kind(m) != "text" for m in members) or value.lstrip()[:1] in ("[", "{")):
        plain = _yaml_text(value, path)
    if isinstance(plain, Mapping):
        return _decode_union_mapping(tp, members, plain, path, base)
    if isinstance(plain, list | tuple):
        candidates = [m for m in members if _kind(m) in ("list", "raw")]
    else:
        ordered = sorted(members, key=lambda m: {"scalar": 0, "config": 1, "text": 2}.get(_kind(m), 3))
        candidates = [m for m in ordered if _kind(m) in ("scalar", "text", "raw", "config")]
        if isinstance(value, str) and not isinstance(value, Text):  # a YAML string never means a number
            candidates = sorted(candidates, key=lambda m: _kind(m) != "text")
    if len(candidates) == 1:
        return decode(candidates[0], value, path, base)
    attempts = [value]
    if isinstance(value, Text):  # typed YAML first, so ``1`` is an int for ``bool | int`` and ``true`` a bool
        typed = _yaml_or_none(value)
        if typed is not None and not isinstance(typed, str):
            attempts.insert(0, typed)
    for attempt in attempts:
        for member in candidates:
            try:
                return decode(member, attempt, path, base)
            except ConfigError:
                continue
    raise ConfigError(f"{path}: expected {type_name(tp)}, got {_show(value)}")


def _decode_union_mapping(tp: Any, members: list[Any], value: Mapping[Any, Any], path: str, base: Any) -> Any:
    configs = [m for m in members if _kind(m) == "config"]
    fitting: list[tuple[Any, type[Any]]] = []
    upgrade_error: ConfigError | None = None
    for member in configs:
        try:
            cls, _ = resolve_class(member, value, path, base)
        except ConfigError:
            continue
        keys = {f.name for f in dataclasses.fields(cls) if f.init}
        if family_of(cls) is not None:
            keys.add("type")
        try:
            upgraded = upgrade_keys(cls, value, path, base)
        except ConfigError as e:  # the keys are this class's, but conflict: reported unless another class fits
            upgrade_error = upgrade_error or e
            continue
        if set(upgraded) <= keys:
            fitting.append((member, cls))
    if len(fitting) > 1 and base is not _MISSING and base is not None:
        fitting = [(m, cls) for m, cls in fitting if type(base) is cls] or fitting
    if len(fitting) == 1:
        return decode(fitting[0][0], value, path, base)
    given = ", ".join(map(str, value))
    if len(fitting) > 1:
        names = " and ".join(cls.__name__ for _, cls in fitting)
        raise ConfigError(f"{path}: ambiguous: keys [{given}] fit {names}; add a distinguishing key or a type")
    if upgrade_error is not None:
        raise upgrade_error
    others = [m for m in members if _kind(m) in ("dict", "raw")] or configs
    if len(others) == 1:
        return decode(others[0], value, path, base)
    raise ConfigError(f"{path}: no member of {type_name(tp)} accepts keys [{given}]")


# ---------------------------------------------------------------------------------------------- dataclasses


def _type_error(path: str, message: str) -> ConfigError:
    return ConfigError(f"{join(path, 'type')}: {message}")


def resolve_class(tp: type[Any], value: Mapping[Any, Any], path: str, base: Any) -> tuple[type[Any], Any]:
    """Which class a mapping for a field of type ``tp`` builds, and the instance its keys merge over.

    A ``type`` key picks the class of ``tp``'s family; a different class than ``base``'s starts from
    that class's defaults. Without ``type``: ``base``'s class, ``tp`` itself when it is concrete, else
    the family's default.

    Returns:
        ``(cls, base)`` where ``base`` is an instance of ``cls`` or ``dataclasses.MISSING``.

    Raises:
        ConfigError: for an unknown ``type``, a class outside ``tp``, or no way to choose.
    """
    family = family_of(tp)
    has_base = base is not _MISSING and isinstance(base, tp)
    if family is None or "type" not in value:
        if has_base:
            return type(base), base
        if family is None or _is_concrete(tp, family):
            return tp, _MISSING
        return _lookup(family, tp, family.default, path), _MISSING
    return _pick(family, tp, value["type"], path, base if has_base else _MISSING)


def _is_concrete(tp: type[Any], family: Family) -> bool:
    return dataclasses.is_dataclass(tp) and not inspect.isabstract(tp) and bool(family.name_of(tp))


def _lookup(family: Family, tp: type[Any], name: str | None, path: str) -> type[Any]:
    known = ", ".join(family.choices_for(tp))
    if name is None:
        raise _type_error(path, f"missing; {tp.__name__} needs a type, one of: {known}")
    try:
        cls = family.lookup(name)
    except KeyError:
        raise _type_error(path, f"unknown type {name!r}; known: {known}") from None
    if not issubclass(cls, tp):
        raise _type_error(path, f"type {name!r} ({cls.__name__}) is not a {tp.__name__}; known: {known}")
    return cls


def _pick(family: Family, tp: type[Any], name: Any, path: str, base: Any) -> tuple[type[Any], Any]:
    if not isinstance(name, str):
        raise _type_error(path, f"expected a type name, got {_show(name)}")
    cls = _lookup(family, tp, str(name), path)
    return cls, (base if base is not _MISSING and type(base) is cls else _MISSING)


def _decode_config(tp: type[Any], value: Any, path: str, base: Any) -> Any:
    if isinstance(value, tp):
        return value
    family = family_of(tp)
    value = _plain(value, path)
    if family is not None and isinstance(value, str):  # ``tracker: json`` is short for ``tracker: {type: json}``
        value = {"type": value}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{path}: expected a mapping of {tp.__name__} fields, got {_show(value)}")
    cls, base = resolve_class(tp, value, path, base)
    items = {k: v for k, v in value.items() if not (family is not None and k == "type")}
    return build(cls, items, path, base)


def upgrade_keys(cls: type[Any], items: Mapping[Any, Any], path: str, base: Any = _MISSING) -> Mapping[Any, Any]:
    """``items`` with older spellings rewritten by ``cls.upgrade_config_keys``, if ``cls`` has one.

    A config class whose keys moved (e.g. ``data.messages_field`` into ``data.format``) defines that static
    method ``upgrade_config_keys(items, path, read, base)``; it returns the keys in their current places, or raises
    `ConfigError` naming a conflict. ``read(value, key)`` gives the plain data of a value (command-line text read
    as YAML); ``base`` is the instance the keys merge over, or None.
    """
    upgrade = getattr(cls, "upgrade_config_keys", None)
    if upgrade is None:
        return items
    merged_over = base if base is not _MISSING and isinstance(base, cls) else None
    return upgrade(items, path, lambda value, key: _plain(value, join(path, key)), merged_over)


def build(cls: type[Any], items: Mapping[Any, Any], path: str, base: Any = _MISSING) -> Any:
    """Construct dataclass ``cls`` from ``items``, taking the other fields from ``base`` (or their defaults).

    Raises:
        ConfigError: for an unknown key, a wrong value, a missing required field, or a ``ValueError``,
            ``TypeError`` or ``ArithmeticError`` raised by the class's ``__post_init__`` (prefixed with ``path``).
    """
    items = upgrade_keys(cls, items, path, base)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = type_hints(cls)
    kwargs: dict[str, Any] = {}
    for key, value in items.items():
        field = fields.get(key) if isinstance(key, str) else None
        if field is None:
            raise _unknown_key(cls, join(path, key), str(key), fields)
        sub_base = getattr(base, key) if base is not _MISSING else field_default(field)
        kwargs[key] = decode(hints[key], value, join(path, key), sub_base)
    if base is not _MISSING:
        if not kwargs:
            return base
        for name in fields:
            kwargs.setdefault(name, getattr(base, name))
    else:
        for name, field in fields.items():
            if name not in kwargs and field.default is _MISSING and field.default_factory is _MISSING:
                raise ConfigError(f"{join(path, name)}: missing required field ({type_name(hints[name])})")
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError, ArithmeticError) as e:  # raised by __post_init__ checks of the values
        message = str(e).replace("\n", " ")
        if path and message.startswith((f"{path}.", f"{path}:")):  # the check already named the full key
            raise ConfigError(message) from e
        raise ConfigError(f"{path or cls.__name__}: {message}") from e


def _types_with_field(cls: type[Any], key: str) -> list[str]:
    """The other ``type`` names of ``cls``'s family whose class has a field ``key``."""
    family = family_of(cls)
    if family is None:
        return []
    found = []
    for name in family.names():
        other = family.lookup(name)
        if other is not cls and dataclasses.is_dataclass(other) and key in {f.name for f in dataclasses.fields(other)}:
            found.append(name)
    return sorted(found)


def _unknown_key(cls: type[Any], dotted: str, key: str, fields: Mapping[str, Any]) -> ConfigError:
    if not dotted.isprintable() or any(c.isspace() for c in dotted):
        dotted = repr(dotted)  # a key with a line break or control character is shown escaped, on one line
    elsewhere = _types_with_field(cls, key)
    family = family_of(cls)
    if elsewhere and family is not None:
        own = family.name_of(cls)
        has = f"; {cls.__name__} has: {', '.join(fields)}" if fields else f"; {cls.__name__} has no fields"
        return ConfigError(
            f"{dotted}: not a field of type {own!r}; it belongs to type {' or '.join(map(repr, elsewhere))}{has}"
        )
    close = difflib.get_close_matches(key, list(fields), n=3, cutoff=0.6)
    if close:
        return ConfigError(f"{dotted}: unknown key; did you mean {' or '.join(close)}?")
    if not fields:
        return ConfigError(f"{dotted}: unknown key; {cls.__name__} has no fields")
    return ConfigError(f"{dotted}: unknown key; {cls.__name__} has: {', '.join(fields)}")
