"""Reward functions: `fn(prompt: str, response: str, answer: str) -> float`.

Built-ins (by name in `spec.explorer.reward`):

    math_accuracy         1.0 if the response's final number equals the reference's final
                          answer numerically ("42", "42.0" and "42" match; "1,234" is 1234),
                          else 0.0. The reference may be GSM8K style ("...#### 42"). The
                          response's final number is the one after its last "####" if it
                          has one, else its last number. A reference without any number is
                          compared as text (stripped, case-insensitive), e.g. "B".
    format                1.0 if the stripped response is exactly one number, or ends with
                          "#### <number>"; else partial credit 0.5 * (fraction of non-space
                          characters that are digits), so a tiny random character-level
                          policy gets a gradient towards numeric answers, while a
                          well-formed answer always beats any partial one ("1 2" < "12").
    math_accuracy_format  0.9 * math_accuracy + 0.1 * format.

Anything else is "package.module:function" (the attribute may be dotted, e.g.
"pkg.mod:Scorer.score"). `get_reward` wraps the function so every reward is a finite float
in [-REWARD_LIMIT, REWARD_LIMIT]: infinities are clamped, NaN or a non-number is a
ValueError naming the function (a broken reward should fail loudly, not train on noise).
"""

from __future__ import annotations

import functools
import importlib
import math
import re
from decimal import Decimal, InvalidOperation
from typing import Callable

RewardFn = Callable[[str, str, str], float]
REWARD_LIMIT = 1e6

# A number: optional sign (only when not preceded by a digit, so "5-3" is 5 and 3, not
# 5 and -3), thousands separators, decimals; ".5" too.
_NUMBER = r"(?:(?<![0-9])-)?(?:(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)"
_NUMBER_RE = re.compile(_NUMBER)
_ONLY_NUMBER_RE = re.compile(rf"\s*{_NUMBER}\s*")
_FINAL_MARK_RE = re.compile(rf"####\s*{_NUMBER}\s*$")


def parse_number(text: str) -> Decimal | None:
    """`"1,234.50"` -> Decimal("1234.50"); None if `text` is not a number."""
    try:
        value = Decimal(text.replace(",", ""))
    except InvalidOperation:
        return None
    return value if value.is_finite() else None


def last_number(text: str) -> Decimal | None:
    """The last number in `text`, or None."""
    found = _NUMBER_RE.findall(text)
    return parse_number(found[-1]) if found else None


def final_answer(text: str) -> Decimal | None:
    """The number after the last "####" (GSM8K), else the last number in `text`."""
    if "####" in text:
        match = _NUMBER_RE.search(text.rsplit("####", 1)[1])
        if match:
            return parse_number(match.group())
    return last_number(text)


def math_accuracy(prompt: str, response: str, answer: str) -> float:
    reference = final_answer(answer)
    if reference is None:
        return float(response.strip().lower() == answer.strip().lower())
    got = final_answer(response)
    return float(got is not None and got == reference)


def format_reward(prompt: str, response: str, answer: str) -> float:
    text = response.strip()
    if _ONLY_NUMBER_RE.fullmatch(text) or _FINAL_MARK_RE.search(text):
        return 1.0
    chars = [c for c in text if not c.isspace()]
    if not chars:
        return 0.0
    return 0.5 * sum(c.isdigit() for c in chars) / len(chars)


def math_accuracy_format(prompt: str, response: str, answer: str) -> float:
    return 0.9 * math_accuracy(prompt, response, answer) + 0.1 * format_reward(prompt, response, answer)


BUILTINS: dict[str, RewardFn] = {
    "math_accuracy": math_accuracy,
    "format": format_reward,
    "math_accuracy_format": math_accuracy_format,
}


def get_reward(spec: str) -> RewardFn:
    """A built-in by name, or "package.module:function"; the result returns finite floats."""
    fn = BUILTINS.get(spec) or _import(spec)
    return _checked(fn, spec)


def _import(spec: str) -> RewardFn:
    names = ", ".join(sorted(BUILTINS))
    if ":" not in spec:
        raise ValueError(f"reward {spec!r}: unknown; use a built-in ({names}) or 'package.module:function'")
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"reward {spec!r}: expected 'package.module:function' (built-ins: {names})")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"reward {spec!r}: cannot import module {module_name!r}: {e} (built-ins: {names})") from e
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"reward {spec!r}: module {module_name!r} has no attribute {attr!r} (built-ins: {names})")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"reward {spec!r}: {attr!r} is a {type(obj).__name__}, not callable (built-ins: {names})")
    return obj


def _checked(fn: RewardFn, spec: str) -> RewardFn:
    @functools.wraps(fn)
    def reward(prompt: str, response: str, answer: str) -> float:
        value = fn(prompt, response, answer)
        try:
            r = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"reward {spec!r} returned {value!r}, not a number") from None
        if math.isnan(r):
            raise ValueError(f"reward {spec!r} returned nan for response {response[:80]!r}")
        return min(max(r, -REWARD_LIMIT), REWARD_LIMIT)

    return reward
