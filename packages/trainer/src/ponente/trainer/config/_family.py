"""Families of config classes selected by a ``type`` key: one hook for every registry the parser understands."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from typing import Any

from ._registry import Registrable

__all__ = ["Family", "family_of", "register_family"]


@dataclasses.dataclass(frozen=True)
class Family:
    """How the parser reads one registry: name -> class, the known names, class -> name, the default name.

    Attributes:
        base: the family's base class; fields typed by it (or a subclass) select a class with ``type:``.
        lookup: the class registered under a name; raises ``KeyError`` for an unknown name.
        names: the registered names.
        name_of: the name a class is registered under (None or ``""`` for an unregistered class).
        default: the name used when a config gives no ``type`` and the field has no default value.
    """

    base: type[Any]
    lookup: Callable[[str], type[Any]]
    names: Callable[[], Sequence[str]]
    name_of: Callable[[type[Any]], str | None]
    default: str | None = None

    def choices_for(self, field_type: type[Any]) -> list[str]:
        """The registered names whose class is ``field_type`` or a subclass of it, sorted."""
        return sorted(name for name in self.names() if issubclass(self.lookup(name), field_type))


_FAMILIES: dict[type[Any], Family] = {}


def register_family(
    base: type[Any],
    lookup: Callable[[str], type[Any]],
    names: Callable[[], Sequence[str]],
    name_of: Callable[[type[Any]], str | None],
    default: str | None = None,
) -> None:
    """Teach the config parser a registry of classes that lives outside :class:`Registrable`.

    Fields typed by ``base`` (or a subclass of it) then read a ``type:`` key with ``lookup``, and
    :func:`config_to_dict` writes ``type: name_of(cls)``. :class:`Registrable` families need no call.

    Args:
        base: the family's base class.
        lookup: maps a ``type`` name to its class; raises ``KeyError`` when the name is unknown.
        names: returns the registered names.
        name_of: returns the name of a class (None or ``""`` when it is not registered).
        default: the name used when a config omits ``type`` and the field has no default value.

    Example:
        >>> import ponente.models as models
        >>> register_family(
        ...     models.LmConfig, models.config_for_type, models.registered_types, lambda c: c.model_type or None
        ... )
    """
    _FAMILIES[base] = Family(base, lookup, names, name_of, default)


def _registrable_family(owner: type[Registrable], field_type: type[Any]) -> Family:
    return Family(
        base=owner,
        lookup=owner.get_choice_class,
        names=owner.choice_names,
        name_of=lambda cls: cls.__dict__.get("choice_name"),
        default=getattr(field_type, "default_choice", None),
    )


def family_of(tp: Any) -> Family | None:
    """The family of the class ``tp`` (the nearest registered base in its MRO), or None."""
    if not inspect.isclass(tp):
        return None
    for klass in tp.__mro__:
        if klass in _FAMILIES:
            return _FAMILIES[klass]
        if issubclass(klass, Registrable) and "_choices" in klass.__dict__:
            return _registrable_family(klass, tp)
    return None


def _register_model_configs() -> None:
    # ponente.models keeps its own registry of model configs (``model.type: llama``)
    import ponente.models as models

    register_family(
        models.LmConfig, models.config_for_type, models.registered_types, lambda cls: cls.model_type or None
    )


_register_model_configs()
