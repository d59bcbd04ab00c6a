"""Reading a compiled program's optimized HLO in tests: which of its inputs XLA copies."""

from __future__ import annotations

import re


def copied_parameters(hlo: str) -> list[str]:
    """The entry computation's parameters that the optimized HLO copies (``copy(%param)``).

    A donated input that is updated in place is never copied; a copy means XLA could not write the new value over
    the old buffer (for example because a later fusion still reads the old value).
    """
    entry = hlo[hlo.index("\nENTRY ") :]
    params = set(re.findall(r"^\s+(%\S+) = \S+ parameter\(\d+\)", entry, flags=re.M))
    assert params, "no entry parameters found in the compiled program's HLO"
    return [c for c in re.findall(r"\bcopy\((%[^ ,)]+)\)", entry) if c in params]
