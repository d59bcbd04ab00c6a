"""Reward functions for ``ponente-rl``: ``(prompt: str, completion: str, example: dict) -> float``.

``reward.function`` names one of the packaged rewards (:func:`exact_match`, :func:`regex_match`,
:func:`math_answer`) or any callable importable from ``PYTHONPATH`` as ``"module:name"``;
:func:`load_reward` resolves it (before any model loads, so a typo costs nothing).
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["PACKAGED_REWARDS", "RewardFn", "exact_match", "load_reward", "math_answer", "regex_match"]

RewardFn = Callable[[str, str, Mapping[str, Any]], float]
"""``reward(prompt, completion, example) -> float``: ``example`` is the data row (``answer`` and any other field)."""


def exact_match(prompt: str, completion: str, example: Mapping[str, Any]) -> float:
    """1.0 if the completion, stripped of surrounding white space, is the row's ``answer`` (stripped), else 0.0.

    Example:
        >>> exact_match("2+3=", " 5 ", {"answer": "5"}), exact_match("2+3=", "6", {"answer": 5})
        (1.0, 0.0)
    """
    return float(completion.strip() == str(example.get("answer", "")).strip())


def regex_match(prompt: str, completion: str, example: Mapping[str, Any]) -> float:
    """1.0 if the row's ``pattern`` (else its ``answer``, as a regular expression) matches the whole stripped
    completion, else 0.0.

    Example:
        >>> regex_match("", "  yes!", {"pattern": "yes!?"}), regex_match("", "no", {"answer": "y.*"})
        (1.0, 0.0)
    """
    pattern = example.get("pattern", example.get("answer", ""))
    return float(re.fullmatch(str(pattern), completion.strip()) is not None)


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?")
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def _number(text: str) -> float | None:
    text = text.replace(",", "").strip().rstrip(".")
    try:
        if "/" in text:
            num, den = text.split("/", 1)
            return float(num) / float(den)
        return float(text)
    except (ValueError, ZeroDivisionError):
        return None


def math_answer(prompt: str, completion: str, example: Mapping[str, Any]) -> float:
    r"""1.0 if the completion's final answer equals the row's ``answer`` as a number (within 1e-6), else 0.0.

    The final answer is the last ``\boxed{...}`` if there is one, else the last number in the completion
    (commas dropped; ``a/b`` fractions read as numbers). A non-numeric ``answer`` is compared as text.

    Example:
        >>> (
        ...     math_answer("", "so the total is 1,200.", {"answer": "1200"}),
        ...     math_answer("", r"\boxed{3/4}", {"answer": 0.75}),
        ... )
        (1.0, 1.0)
    """
    boxed = _BOXED.findall(completion)
    found = boxed[-1] if boxed else (_NUMBER.findall(completion) or [""])[-1]
    expected = str(example.get("answer", "")).strip()
    a, b = _number(found), _number(expected)
    if a is None or b is None:
        return float(found.strip() == expected and expected != "")
    return float(abs(a - b) <= 1e-6 * max(1.0, abs(b)))


PACKAGED_REWARDS: dict[str, RewardFn] = {
    "exact_match": exact_match,
    "regex_match": regex_match,
    "math_answer": math_answer,
}
"""The rewards ``reward.function`` names without a module."""


def load_reward(spec: str, *, key: str = "reward.function") -> RewardFn:
    """The reward callable ``spec`` names: a packaged reward (``"exact_match"``) or ``"module:name"``.

    Raises:
        ConfigError: one line naming ``key``, if the module does not import, has no such name, or it is not
            callable.
    """
    from ponente.trainer.config import ConfigError

    if spec in PACKAGED_REWARDS:
        return PACKAGED_REWARDS[spec]
    module_name, sep, name = spec.partition(":")
    if not sep or not module_name or not name:
        raise ConfigError(f"{key}: expected 'module:name' or one of {', '.join(PACKAGED_REWARDS)}, got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # an ImportError, or any error the module raises while importing
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise ConfigError(
            f"{key}: cannot import {module_name!r} ({type(exc).__name__}: {first}); is its folder on PYTHONPATH?"
        ) from exc
    fn = module
    for part in name.split("."):
        if not hasattr(fn, part):
            raise ConfigError(f"{key}: module {module_name!r} has no {name!r}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise ConfigError(f"{key}: {spec} is not callable (a reward is (prompt, completion, example) -> float)")
    return fn
