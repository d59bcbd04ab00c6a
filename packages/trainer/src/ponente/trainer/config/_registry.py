"""Registries of config classes keyed by ``type``: how a YAML ``type: adamw`` picks a dataclass."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

__all__ = ["Registrable"]

R = TypeVar("R", bound=type["Registrable"])


class Registrable:
    """Base of a family of config dataclasses selected by a ``type`` key (optimizers, trackers, ...).

    Each direct subclass that calls :meth:`register_subclass` on itself gets its own registry; the
    config parser reads ``type:`` from YAML/CLI, looks the class up with :meth:`get_choice_class`, and
    parses the remaining keys into it. Without a ``type`` key the parser uses :attr:`default_choice`.

    Example:
        >>> import dataclasses
        >>> class ShapeConfig(Registrable):
        ...     pass
        >>> @ShapeConfig.register_subclass("circle")
        ... @dataclasses.dataclass(frozen=True)
        ... class Circle(ShapeConfig):
        ...     radius: float = 1.0
        >>> ShapeConfig.get_choice_class("circle") is Circle, Circle.choice_name
        (True, 'circle')
    """

    _choices: ClassVar[dict[str, type[Any]]]
    choice_name: ClassVar[str | None] = None
    """The ``type`` name this class was registered under (None for an unregistered base)."""
    default_choice: ClassVar[str | None] = None
    """The ``type`` used when a config omits it (None: ``type`` is required)."""

    @classmethod
    def _registry(cls) -> dict[str, type[Any]]:
        # the registry belongs to the first class in the MRO that defines ``_choices`` in its own __dict__
        for klass in cls.__mro__:
            if "_choices" in klass.__dict__:
                return klass.__dict__["_choices"]
        cls._choices = {}
        return cls._choices

    @classmethod
    def register_subclass(cls, name: str) -> Callable[[R], R]:
        """Class decorator registering a subclass under ``name``.

        Raises:
            ValueError: if ``name`` is taken by another class, or the class does not derive from ``cls``.
        """

        def register(sub: R) -> R:
            if not issubclass(sub, cls):
                raise ValueError(f"{sub.__qualname__} must subclass {cls.__qualname__} to register as {name!r}")
            registry = cls._registry()
            existing = registry.get(name)
            if existing is not None and existing is not sub:
                raise ValueError(f"{cls.__qualname__}: type {name!r} is already registered to {existing.__qualname__}")
            registry[name] = sub
            sub.choice_name = name
            return sub

        return register

    @classmethod
    def get_choice_class(cls, name: str) -> type[Any]:
        """The class registered under ``name``.

        Raises:
            KeyError: if nothing is registered under ``name``; the message lists the known choices.
        """
        registry = cls._registry()
        if name not in registry:
            raise KeyError(f"unknown {cls.__qualname__} type {name!r}; known types: {sorted(registry)}")
        return registry[name]

    @classmethod
    def choice_names(cls) -> list[str]:
        """The sorted registered ``type`` names."""
        return sorted(cls._registry())
