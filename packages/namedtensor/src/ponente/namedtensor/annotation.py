"""``NamedArray["batch embed"]``: type annotations that name an array's axes."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

__all__ = ["NamedArrayAxes", "named_array_annotation"]


@dataclass(frozen=True)
class NamedArrayAxes:
    """The axis names an annotation requires, with ``...`` allowing any other axes at that position.

    Args:
        before: names required (in order) at the front.
        after: names required (in order) at the back, after ``...``; empty when there is no ``...``.
        has_ellipsis: whether other axes may appear between ``before`` and ``after``.
    """

    before: tuple[str, ...]
    after: tuple[str, ...]
    has_ellipsis: bool

    @staticmethod
    def parse(item: Any) -> NamedArrayAxes:
        """Parses ``"batch embed"``, ``"batch ..."``, ``("batch", "embed")`` or ``("batch", ...)``.

        Raises:
            TypeError: for anything else, or for more than one ``...``.
        """
        parts: list[Any] = []
        for piece in item if isinstance(item, tuple) else (item,):
            if isinstance(piece, str):
                parts.extend(Ellipsis if p == "..." else p for p in piece.split())
            elif piece is Ellipsis:
                parts.append(Ellipsis)
            else:
                raise TypeError(f"NamedArray[...] takes axis names (str) and ..., got {piece!r}")
        if parts.count(Ellipsis) > 1:
            raise TypeError(f"NamedArray[...] allows at most one '...', got {item!r}")
        if Ellipsis in parts:
            i = parts.index(Ellipsis)
            return NamedArrayAxes(tuple(parts[:i]), tuple(parts[i + 1 :]), True)
        return NamedArrayAxes(tuple(parts), (), False)

    def matches(self, names: tuple[str, ...]) -> bool:
        """Whether an array with these axis names (in order) satisfies the annotation."""
        if not self.has_ellipsis:
            return names == self.before
        n, b, a = len(names), len(self.before), len(self.after)
        return n >= b + a and names[:b] == self.before and names[n - a :] == self.after

    def __str__(self) -> str:
        if self.has_ellipsis:
            return " ".join((*self.before, "...", *self.after))
        return " ".join(self.before)


class _AnnotationMeta(type):
    spec: NamedArrayAxes

    def __instancecheck__(cls, obj: Any) -> bool:
        from .core import NamedArray

        return isinstance(obj, NamedArray) and cls.spec.matches(obj.axis_names)


@functools.cache
def _make(spec: NamedArrayAxes) -> type:
    return _AnnotationMeta(f"NamedArray[{str(spec)!r}]", (), {"spec": spec, "__module__": "ponente.namedtensor"})


def named_array_annotation(cls: type, item: Any) -> type:
    """The annotation type for ``NamedArray[item]`` (supports ``isinstance``)."""
    del cls
    return _make(NamedArrayAxes.parse(item))
