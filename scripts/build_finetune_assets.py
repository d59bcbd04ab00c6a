"""Build the tiny fine-tuning sets shipped inside the ``ponente-trainer`` wheel.

Run from the repository root (no network, no third-party packages)::

    python scripts/build_finetune_assets.py            # (re)writes the two files
    python scripts/build_finetune_assets.py --check    # exits 1 if the shipped files differ from a rebuild
    python scripts/build_finetune_assets.py --out DIR  # writes them into DIR instead

Writes into ``packages/trainer/src/ponente/trainer/assets/``:

- ``tiny_instructions.jsonl``: ``INSTRUCTION_ROWS`` Alpaca-shaped records ``{"instruction", "input", "output"}``
  (``input`` is ``""`` for about a fifth of them, so a prompt template's ``{% if input %}`` branch is used both
  ways);
- ``tiny_chat.jsonl``: ``CHAT_ROWS`` records ``{"messages": [{"role", "content"}, ...]}`` with an optional
  ``system`` turn first, then alternating ``user``/``assistant`` turns (a third are multi-turn).

Every example is written by this script from small word lists and arithmetic, so the sets are the project's own
(nothing is copied from Alpaca or any other corpus) and every answer is computed, not typed: sums and products,
reversed and sorted words, capitalisation, letter counts, antonyms, plurals, parity, the larger of two numbers.
The tasks are deliberately easy and regular, so that a small model learns them in a short run.

Determinism: one ``random.Random(SEED)`` drives everything, and the files are written as UTF-8 JSON lines with a
fixed key order and ``\\n`` line endings, so a rebuild is byte-identical (``--check`` verifies it;
``packages/trainer/tests/test_tutorials.py`` rebuilds them and compares).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Callable
from pathlib import Path

ASSETS = Path(__file__).resolve().parents[1] / "packages/trainer/src/ponente/trainer/assets"
INSTRUCTIONS_FILE = "tiny_instructions.jsonl"
CHAT_FILE = "tiny_chat.jsonl"
SEED = 20261126
INSTRUCTION_ROWS = 300
CHAT_ROWS = 200

WORDS = (
    "apple", "river", "stone", "garden", "window", "candle", "forest", "pencil", "rabbit", "silver",
    "market", "planet", "bridge", "cloud", "orange", "mirror", "ladder", "castle", "winter", "basket",
    "tiger", "island", "bottle", "summer", "violin", "meadow", "rocket", "harbor", "lemon", "button",
    "dragon", "pepper", "shadow", "kettle", "falcon", "marble", "saddle", "tunnel", "walnut", "zebra",
)  # fmt: skip
"""Common nouns (lower case, letters only) for the word tasks."""

ANTONYMS = (
    ("hot", "cold"), ("big", "small"), ("fast", "slow"), ("happy", "sad"), ("light", "dark"),
    ("early", "late"), ("open", "closed"), ("full", "empty"), ("strong", "weak"), ("high", "low"),
    ("young", "old"), ("wet", "dry"), ("hard", "soft"), ("loud", "quiet"), ("rich", "poor"),
    ("thick", "thin"), ("clean", "dirty"), ("near", "far"), ("true", "false"), ("first", "last"),
)  # fmt: skip
"""Pairs of opposites; each is asked both ways."""

PLURALS = (
    ("cat", "cats"), ("box", "boxes"), ("child", "children"), ("mouse", "mice"), ("city", "cities"),
    ("knife", "knives"), ("tooth", "teeth"), ("bus", "buses"), ("leaf", "leaves"), ("foot", "feet"),
    ("baby", "babies"), ("wolf", "wolves"), ("goose", "geese"), ("dish", "dishes"), ("man", "men"),
    ("woman", "women"), ("story", "stories"), ("church", "churches"), ("sheep", "sheep"), ("fish", "fish"),
)  # fmt: skip
"""Nouns and their plurals, regular and irregular."""

SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a concise assistant. Answer in one short sentence.",
    "You are a patient tutor who answers questions about words and numbers.",
)

GREETINGS = (
    ("Hello!", "Hello! How can I help you today?"),
    ("Hi there.", "Hi! What would you like to do?"),
    ("Good morning.", "Good morning! What can I do for you?"),
)
THANKS = (
    ("Thank you.", "You're welcome."),
    ("Thanks, that helps.", "Glad I could help."),
    ("Great, thanks!", "You're welcome. Ask me anything else."),
)

Task = tuple[str, str, str, str, str]
"""(instruction, input, output, chat question, chat answer): one problem phrased for both sets."""


def _join(words: list[str]) -> str:
    return " ".join(words)


def _addition(rng: random.Random) -> Task:
    a, b = rng.randint(1, 99), rng.randint(1, 99)
    if rng.random() < 0.5:
        return (
            "Add the two numbers.",
            f"{a} and {b}",
            str(a + b),
            f"What is {a} plus {b}?",
            f"{a} plus {b} is {a + b}.",
        )
    return f"What is {a} plus {b}?", "", str(a + b), f"Can you add {a} and {b}?", f"Sure: {a} + {b} = {a + b}."


def _subtraction(rng: random.Random) -> Task:
    a = rng.randint(10, 99)
    b = rng.randint(1, a)
    if rng.random() < 0.5:
        return (
            "Subtract the second number from the first.",
            f"{a} and {b}",
            str(a - b),
            f"What is {a} minus {b}?",
            f"{a} minus {b} is {a - b}.",
        )
    return f"What is {a} minus {b}?", "", str(a - b), f"Take {b} away from {a}.", f"{a} - {b} = {a - b}."


def _multiplication(rng: random.Random) -> Task:
    a, b = rng.randint(2, 12), rng.randint(2, 12)
    if rng.random() < 0.5:
        return (
            "Multiply the two numbers.",
            f"{a} and {b}",
            str(a * b),
            f"What is {a} times {b}?",
            f"{a} times {b} is {a * b}.",
        )
    return f"What is {a} times {b}?", "", str(a * b), f"Multiply {a} by {b}.", f"{a} x {b} = {a * b}."


def _reverse_words(rng: random.Random) -> Task:
    words = rng.sample(WORDS, rng.randint(3, 5))
    out = _join(words[::-1])
    return (
        "Reverse the order of the words.",
        _join(words),
        out,
        f"Please reverse the order of these words: {_join(words)}",
        out,
    )


def _sort_words(rng: random.Random) -> Task:
    words = rng.sample(WORDS, rng.randint(3, 5))
    out = _join(sorted(words))
    return (
        "Sort the words in alphabetical order.",
        _join(words),
        out,
        f"Put these words in alphabetical order: {_join(words)}",
        out,
    )


def _capitalise(rng: random.Random) -> Task:
    words = rng.sample(WORDS, rng.randint(2, 4))
    if rng.random() < 0.5:
        out = _join([w.capitalize() for w in words])
        return (
            "Capitalise the first letter of every word.",
            _join(words),
            out,
            f"Capitalise each word: {_join(words)}",
            out,
        )
    out = _join(words).upper()
    return "Write the text in upper case.", _join(words), out, f"Write this in capitals: {_join(words)}", out


def _count_letter(rng: random.Random) -> Task:
    word = rng.choice(WORDS)
    letter = rng.choice(sorted(set(word)))
    n = word.count(letter)
    times = "time" if n == 1 else "times"
    return (
        f"How many times does the letter '{letter}' appear in the word?",
        word,
        str(n),
        f"How many times does the letter '{letter}' appear in '{word}'?",
        f"The letter '{letter}' appears {n} {times} in '{word}'.",
    )


def _antonym(rng: random.Random) -> Task:
    pair = rng.choice(ANTONYMS)
    word, opposite = pair if rng.random() < 0.5 else pair[::-1]
    if rng.random() < 0.5:
        return (
            "Give the opposite of the word.",
            word,
            opposite,
            f"What is the opposite of '{word}'?",
            f"The opposite of '{word}' is '{opposite}'.",
        )
    return (
        f"What is the opposite of '{word}'?",
        "",
        opposite,
        f"Give me an antonym of '{word}'.",
        f"An antonym of '{word}' is '{opposite}'.",
    )


def _plural(rng: random.Random) -> Task:
    noun, plural = rng.choice(PLURALS)
    if rng.random() < 0.5:
        return (
            "Write the plural of the noun.",
            noun,
            plural,
            f"What is the plural of '{noun}'?",
            f"The plural of '{noun}' is '{plural}'.",
        )
    return (
        f"What is the plural of '{noun}'?",
        "",
        plural,
        f"How do I write more than one '{noun}'?",
        f"You write '{plural}'.",
    )


def _parity(rng: random.Random) -> Task:
    n = rng.randint(1, 999)
    answer = "even" if n % 2 == 0 else "odd"
    return (
        "Say whether the number is even or odd.",
        str(n),
        answer,
        f"Is {n} even or odd?",
        f"{n} is {answer}.",
    )


def _larger(rng: random.Random) -> Task:
    a, b = rng.sample(range(1, 1000), 2)
    return (
        "Which of the two numbers is larger?",
        f"{a} and {b}",
        str(max(a, b)),
        f"Which is larger, {a} or {b}?",
        f"{max(a, b)} is larger than {min(a, b)}.",
    )


def _spell_backwards(rng: random.Random) -> Task:
    word = rng.choice(WORDS)
    return (
        "Spell the word backwards.",
        word,
        word[::-1],
        f"How do you spell '{word}' backwards?",
        f"'{word}' backwards is '{word[::-1]}'.",
    )


TASKS: tuple[Callable[[random.Random], Task], ...] = (
    _addition,
    _subtraction,
    _multiplication,
    _reverse_words,
    _sort_words,
    _capitalise,
    _count_letter,
    _antonym,
    _plural,
    _parity,
    _larger,
    _spell_backwards,
)


def instruction_rows(rng: random.Random) -> list[dict[str, str]]:
    """``INSTRUCTION_ROWS`` distinct Alpaca-shaped records, the tasks interleaved in a seeded order."""
    rows: list[dict[str, str]] = []
    seen: set[tuple[str, str]] = set()
    while len(rows) < INSTRUCTION_ROWS:
        instruction, inp, output, _, _ = TASKS[len(rows) % len(TASKS)](rng)
        if (instruction, inp) in seen:
            continue
        seen.add((instruction, inp))
        rows.append({"instruction": instruction, "input": inp, "output": output})
    rng.shuffle(rows)
    return rows


def _message(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


def chat_rows(rng: random.Random) -> list[dict[str, list[dict[str, str]]]]:
    """``CHAT_ROWS`` conversations: optional system turn, 1-3 user/assistant exchanges, some small talk."""
    rows: list[dict[str, list[dict[str, str]]]] = []
    for i in range(CHAT_ROWS):
        messages: list[dict[str, str]] = []
        if rng.random() < 0.4:
            messages.append(_message("system", rng.choice(SYSTEM_PROMPTS)))
        if rng.random() < 0.15:
            hello, reply = rng.choice(GREETINGS)
            messages += [_message("user", hello), _message("assistant", reply)]
        # A third of the conversations ask two or three questions in a row.
        for _ in range(1 if i % 3 else rng.randint(2, 3)):
            _, _, _, question, answer = rng.choice(TASKS)(rng)
            messages += [_message("user", question), _message("assistant", answer)]
        if rng.random() < 0.2:
            thanks, reply = rng.choice(THANKS)
            messages += [_message("user", thanks), _message("assistant", reply)]
        rows.append({"messages": messages})
    return rows


def _jsonl(rows: list[dict[str, str]] | list[dict[str, list[dict[str, str]]]]) -> bytes:
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows).encode("utf-8")


def build() -> dict[str, bytes]:
    """The bytes of both files, keyed by file name."""
    rng = random.Random(SEED)
    instructions = instruction_rows(rng)
    chats = chat_rows(rng)
    return {INSTRUCTIONS_FILE: _jsonl(instructions), CHAT_FILE: _jsonl(chats)}


def main(argv: list[str] | None = None) -> int:
    """Write (or with ``--check`` compare) the shipped files; returns the process exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the shipped files instead of writing")
    parser.add_argument("--out", type=Path, default=ASSETS, help="folder to write into (default: the assets folder)")
    args = parser.parse_args(argv)
    stale = []
    for name, data in build().items():
        path = args.out / name
        if args.check:
            if not path.exists() or path.read_bytes() != data:
                stale.append(name)
            continue
        path.write_bytes(data)
        rows = data.count(b"\n")
        print(f"wrote {path} ({len(data)} bytes, {rows} rows)")
    if stale:
        print(f"stale: {', '.join(stale)} differ from a rebuild; run python scripts/build_finetune_assets.py")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
