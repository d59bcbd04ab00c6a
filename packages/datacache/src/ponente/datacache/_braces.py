"""Shell-style brace expansion: ``a{1..3}b`` and ``{x,y}``, nested, as bash does it."""

from __future__ import annotations

import itertools
import re

_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)(?:\.\.(-?\d+))?$")


def _top_level_commas(body: str) -> list[int]:
    depth = 0
    commas = []
    for i, char in enumerate(body):
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
        elif char == "," and depth == 0:
            commas.append(i)
    return commas


def _alternatives(body: str) -> list[str] | None:
    """The alternatives a brace body stands for, or ``None`` if the body is not an expansion."""
    match = _RANGE.match(body)
    if match:
        lo_text, hi_text, step_text = match.groups()
        lo, hi = int(lo_text), int(hi_text)
        step = abs(int(step_text)) if step_text else 1
        if step == 0:
            raise ValueError(f"brace range {{{body}}} has step 0")
        # bash pads to the wider endpoint when either endpoint is written with a leading zero.
        padded = any(len(t.lstrip("-")) > 1 and t.lstrip("-").startswith("0") for t in (lo_text, hi_text))
        width = max(len(lo_text), len(hi_text)) if padded else 0
        values = range(lo, hi + 1, step) if lo <= hi else range(lo, hi - 1, -step)
        return [str(v).zfill(width) for v in values]
    commas = _top_level_commas(body)
    if not commas:
        return None
    bounds = [-1, *commas, len(body)]
    return [body[a + 1 : b] for a, b in itertools.pairwise(bounds)]


def expand_braces(pattern: str) -> list[str]:
    """Expand shell-style braces in ``pattern``, left to right, like bash.

    ``{a,b}`` gives each alternative; ``{1..3}`` a numeric range (zero-padded when an endpoint is written
    with leading zeros, as in ``{01..10}``; ``{1..10..2}`` steps). Braces that expand nothing (``{x}``)
    are kept literally.

    Args:
        pattern: A path, glob or URL, e.g. ``"train.{1..128}-of-128.jsonl.gz"``.

    Returns:
        The expanded strings, in order.

    Raises:
        ValueError: If the braces are unbalanced.

    Examples:
        >>> expand_braces("data_{a,b}{1..2}.txt")
        ['data_a1.txt', 'data_a2.txt', 'data_b1.txt', 'data_b2.txt']
    """
    if pattern.count("{") != pattern.count("}"):
        raise ValueError(f"unbalanced braces in {pattern!r}")
    start = 0
    while True:
        open_at = pattern.find("{", start)
        if open_at < 0:
            return [pattern]
        depth = 0
        for close_at in range(open_at, len(pattern)):
            depth += {"{": 1, "}": -1}.get(pattern[close_at], 0)
            if depth == 0:
                break
        else:  # pragma: no cover - excluded by the count check above
            raise ValueError(f"unbalanced braces in {pattern!r}")
        alternatives = _alternatives(pattern[open_at + 1 : close_at])
        if alternatives is None:
            start = open_at + 1
            continue
        prefix, suffix = pattern[:open_at], pattern[close_at + 1 :]
        return [out for alt in alternatives for out in expand_braces(prefix + alt + suffix)]
