"""Write ``packages/trainer/src/ponente/trainer/assets/tiny_preferences.jsonl``: 240 chat preference pairs.

Every pair is generated here from arithmetic and small word lists, and every answer computed: the chosen response
is right, the rejected one wrong in a regular way (the smaller number, an off-by-one sum, lower case instead of
capitals, the word not reversed). Half the records give an explicit ``prompt`` with one-message ``chosen`` and
``rejected`` lists; the other half give two whole conversations that share their prompt (TRL's implicit prompt).
Some carry a system turn, some an earlier exchange. Deterministic: ``python scripts/build_preference_assets.py``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "packages/trainer/src/ponente/trainer/assets/tiny_preferences.jsonl"
WORDS = [
    "apple", "river", "stone", "violin", "garden", "candle", "forest", "window", "silver", "harbor",
    "lantern", "meadow", "pepper", "rocket", "saddle", "tunnel", "valley", "winter", "yellow", "zebra",
]  # fmt: skip
SYSTEM = {"role": "system", "content": "You are a careful assistant. Answer in one sentence."}


def _task(rng: random.Random) -> tuple[str, str, str]:
    kind = rng.randrange(4)
    if kind == 0:
        a, b = rng.sample(range(100, 1000), 2)
        big, small = max(a, b), min(a, b)
        return f"Which is larger, {a} or {b}?", f"{big} is larger than {small}.", f"{small} is larger than {big}."
    if kind == 1:
        a, b = rng.randrange(10, 90), rng.randrange(10, 90)
        return f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}.", f"{a} plus {b} is {a + b + 1}."
    word = rng.choice(WORDS)
    if kind == 2:
        return f"Write this in capitals: {word}", word.upper(), word
    return f"Spell '{word}' backwards.", f"'{word}' backwards is '{word[::-1]}'.", f"'{word}' backwards is '{word}'."


def main() -> None:
    rng = random.Random(20261207)
    lines = []
    for i in range(240):
        prompt: list[dict[str, str]] = []
        if rng.random() < 0.3:
            prompt.append(SYSTEM)
        if rng.random() < 0.3:
            question, answer, _ = _task(rng)
            prompt += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        question, good, bad = _task(rng)
        prompt.append({"role": "user", "content": question})
        chosen, rejected = {"role": "assistant", "content": good}, {"role": "assistant", "content": bad}
        if i % 2 == 0:
            record = {"prompt": prompt, "chosen": [chosen], "rejected": [rejected]}
        else:
            record = {"chosen": [*prompt, chosen], "rejected": [*prompt, rejected]}
        lines.append(json.dumps(record, ensure_ascii=False))
    OUT.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {len(lines)} pairs to {OUT}")


if __name__ == "__main__":
    main()
