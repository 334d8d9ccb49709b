"""Reward functions: built-in tables (GSM8K answers, negatives, decimals, commas), and
resolving "package.module:function" with clear errors."""

from __future__ import annotations

import math

import pytest

from rft_rollout.rewards import (
    BUILTINS,
    REWARD_LIMIT,
    final_answer,
    format_reward,
    get_reward,
    math_accuracy,
    math_accuracy_format,
)


@pytest.mark.parametrize("response, answer, want", [
    ("7", "7", 1.0),
    ("3+4=7", "7", 1.0),                       # the last number
    ("7.0", "7", 1.0),                         # numerically equal
    ("The answer is 42.", "#### 42", 1.0),     # trailing period is not a decimal point
    ("so 18 eggs", "Janet sells 16 - 3 - 4 = 9 eggs... 9 * 2 = 18\n#### 18", 1.0),  # GSM8K
    ("#### 18", "... 9 * 2 = 18\n#### 18", 1.0),
    ("#### 18 since 9*2", "#### 18", 1.0),     # the number after "####" wins over the last one
    ("1,234", "1234", 1.0),
    ("$1,000,000 total", "#### 1,000,000", 1.0),
    ("-5", "-5", 1.0),
    ("it is -3.5", "-3.50", 1.0),
    ("5-3", "2", 0.0),                         # a minus after a digit is subtraction: 3, not -3
    ("5-3", "3", 1.0),
    ("-4", "4", 0.0),
    ("0.5", ".5", 1.0),
    ("8", "7", 0.0),
    ("", "7", 0.0),
    ("no number", "7", 0.0),
    ("B", "b", 1.0),                           # a reference without a number is compared as text
    ("C", "B", 0.0),
])
def test_math_accuracy(response, answer, want):
    assert math_accuracy("q", response, answer) == want


@pytest.mark.parametrize("response, want", [
    ("42", 1.0), ("  -3.5\n", 1.0), ("1,000", 1.0),
    ("reasoning... #### 18", 1.0), ("#### -2", 1.0),
    ("12+3", 0.5 * 3 / 4),                     # partial: fraction of digits among non-space chars
    ("1 2", 0.5),                              # all digits, but not one number: below 1
    ("#### 5 more", 0.5 * 1 / 9),
    ("abc", 0.0), ("", 0.0), ("   ", 0.0),
])
def test_format(response, want):
    assert format_reward("q", response, "") == pytest.approx(want)


def test_math_accuracy_format_combines():
    assert math_accuracy_format("q", "7", "7") == pytest.approx(1.0)
    assert math_accuracy_format("q", "8", "7") == pytest.approx(0.1)
    assert math_accuracy_format("q", "x7", "7") == pytest.approx(0.9 + 0.1 * 0.25)


def test_final_answer():
    assert final_answer("a\n#### 1,234.5") == final_answer("1234.50")
    assert final_answer("nothing") is None


def test_builtins_resolve_by_name():
    for name in ("math_accuracy", "format", "math_accuracy_format"):
        fn = get_reward(name)
        assert fn("1+1=", "2", "2") == 1.0 and fn.__wrapped__ is BUILTINS[name]


# Used below through "module:function".
def half(prompt, response, answer):
    return 0.5


def infinite(prompt, response, answer):
    return math.inf


def not_a_number(prompt, response, answer):
    return math.nan


def a_string(prompt, response, answer):
    return "high"


class Scorer:
    @staticmethod
    def score(prompt, response, answer):
        return len(response)


NOT_CALLABLE = 3


def test_module_function():
    assert get_reward(f"{__name__}:half")("p", "r", "a") == 0.5
    assert get_reward(f"{__name__}:Scorer.score")("p", "abc", "a") == 3.0  # dotted attribute
    assert get_reward(f"{__name__}:infinite")("p", "r", "a") == REWARD_LIMIT  # clamped
    with pytest.raises(ValueError, match="returned nan"):
        get_reward(f"{__name__}:not_a_number")("p", "r", "a")
    with pytest.raises(ValueError, match="not a number"):
        get_reward(f"{__name__}:a_string")("p", "r", "a")


@pytest.mark.parametrize("spec, message", [
    ("accuracy", "unknown"),
    ("no_such_module_xyz:fn", "cannot import module 'no_such_module_xyz'"),
    (f"{__name__}:missing", "has no attribute 'missing'"),
    (f"{__name__}:NOT_CALLABLE", "not callable"),
    (":fn", "expected 'package.module:function'"),
    ("mod:", "expected 'package.module:function'"),
])
def test_bad_specs_name_the_problem_and_the_builtins(spec, message):
    with pytest.raises(ValueError) as e:
        get_reward(spec)
    assert message in str(e.value)
    assert "math_accuracy, math_accuracy_format" in str(e.value)
