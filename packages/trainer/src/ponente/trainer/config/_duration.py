"""``datetime.timedelta`` as text: ``"10m"``, ``"1h30m"``, ``"45s"``, ``"2d"``, ``"250ms"`` or a number of seconds."""

from __future__ import annotations

import datetime
import re
from decimal import Decimal, InvalidOperation

__all__ = ["format_duration", "parse_duration"]

_MICROS = {"d": 86_400_000_000, "h": 3_600_000_000, "m": 60_000_000, "s": 1_000_000, "ms": 1_000}
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ms|d|h|m|s)")
_WHOLE = re.compile(rf"(?:{_PART.pattern})+")


def parse_duration(text: str | float) -> datetime.timedelta:
    """Parse a duration: a number of seconds, or unit parts such as ``"1h30m"`` (units ``d h m s ms``).

    Raises:
        ValueError: if ``text`` is not a non-negative duration.
    """
    if isinstance(text, bool):
        raise ValueError(f"not a duration: {text!r}")
    compact = str(text).strip().replace(" ", "")
    try:
        micros = Decimal(compact) * _MICROS["s"]
    except InvalidOperation:
        if not _WHOLE.fullmatch(compact):
            raise ValueError(f"not a duration: {text!r}") from None
        micros = sum((Decimal(num) * _MICROS[unit] for num, unit in _PART.findall(compact)), Decimal(0))
    if not micros.is_finite() or micros < 0:
        raise ValueError(f"not a non-negative duration: {text!r}")
    return datetime.timedelta(microseconds=int(micros.to_integral_value()))


def format_duration(delta: datetime.timedelta) -> str:
    """Unit text for ``delta``, largest units first (``"1h30m"``, ``"1m30s"``, ``"0.5s"``).

    :func:`parse_duration` reads it back to an equal timedelta. Negative durations become plain seconds.
    """
    micros = delta // datetime.timedelta(microseconds=1)
    if micros < 0:
        return f"{Decimal(micros) / _MICROS['s']}"
    parts = []
    for unit in ("d", "h", "m"):
        count, micros = divmod(micros, _MICROS[unit])
        if count:
            parts.append(f"{count}{unit}")
    if micros or not parts:
        seconds = Decimal(micros) / _MICROS["s"]
        parts.append(f"{seconds.normalize():f}s")
    return "".join(parts)
