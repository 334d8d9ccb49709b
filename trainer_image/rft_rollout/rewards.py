"""Reward functions: `fn(prompt: str, response: str, answer: str) -> float`.

Built-ins (by name in `spec.explorer.reward`):

    math_accuracy         1.0 if the response's final answer equals the reference's final
                          answer numerically ("42", "42.0", "$42" and "42." match; "1,234" is
                          1234; "3.50" is 3.5), else 0.0. A final answer is the number in the
                          text's last answer mark, "\\boxed{...}" or "#### ..." (GSM8K),
                          whichever comes last, else the text's last number. So the reference
                          may be a GSM8K solution ("...#### 42") and the response may answer
                          "\\boxed{42}", "#### 42" or just end with 42. A reference without any
                          number is compared as text (stripped, case-insensitive), e.g. "B",
                          against the whole response or its last answer mark ("\\boxed{B}").
    format                1.0 if the stripped response is exactly one number, or ends with
                          "#### <number>" or "\\boxed{<number>}" (a trailing "." or "$" is
                          fine); else partial credit 0.5 * (fraction of non-space characters
                          that are digits), so a tiny random character-level policy gets a
                          gradient towards numeric answers, while a well-formed answer always
                          beats any partial one ("1 2" < "12").
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

# A number: an optional sign (only when not preceded by a digit, so "5-3" is 5 and 3, not
# 5 and -3) and "$" ("-5", "$5", "-$5", "$-5"), thousands separators, decimals; ".5" too.
_NUMBER = r"(?:(?<![0-9])-\$?|\$-?)?(?:(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)"
_NUMBER_RE = re.compile(_NUMBER)
_END = r"[\s.$]*"  # what may follow a well-formed final answer: space, a period, a closing "$"
_ONLY_NUMBER_RE = re.compile(rf"\s*{_NUMBER}\.?\s*")
_FINAL_HASHES_RE = re.compile(rf"####\s*{_NUMBER}{_END}$")
_BOXED_RE = re.compile(r"\\(?:boxed|fbox)(?:\s*\{|\s+(?=\S))")
_LATEX_TEXT_RE = re.compile(r"\\(?:text|textbf|textrm|mathrm|mbox)\s*\{([^{}]*)\}")
_LATEX_PLAIN = (("{,}", ","), ("\\$", "$"), ("\\%", "%"), ("\\!", ""), ("\\,", ""), ("\\ ", " "))
_BOXED_NUMBER_RE = re.compile(rf"\s*{_NUMBER}\s*%?\.?\s*")
_FRAC_RE = re.compile(rf"\s*(-)?\s*\\[dt]?frac\s*\{{\s*({_NUMBER})\s*\}}\s*\{{\s*({_NUMBER})\s*\}}\s*")


def parse_number(text: str) -> Decimal | None:
    """`"1,234.50"` -> Decimal("1234.50"), `"$-5"` -> Decimal("-5"); None if not a number."""
    try:
        value = Decimal(text.replace(",", "").replace("$", ""))
    except InvalidOperation:
        return None
    return value if value.is_finite() else None


def last_number(text: str) -> Decimal | None:
    """The last number in `text`, or None."""
    found = _NUMBER_RE.findall(text)
    return parse_number(found[-1]) if found else None


def final_mark(text: str) -> tuple[str, str, int] | None:
    """The text's last answer mark as (kind, content, end): ("boxed", what is inside the
    braces of "\\boxed{...}" (or the word after "\\boxed "), the index after it) or
    ("####", all the text after "####", len(text)); whichever comes last; None without
    one. An unclosed "\\boxed{" (a cut-off response) is no mark."""
    text = text.replace("\u2212", "-")  # a typographic minus
    hashes, boxed = text.rfind("####"), None
    for m in _BOXED_RE.finditer(text, hashes + 1):
        if m.group().endswith("{"):
            content = _braced(text, m.end())
            if content is not None:
                boxed = ("boxed", content, m.end() + len(content) + 1)
        else:
            word = text[m.end():].split(None, 1)[0]
            boxed = ("boxed", word, m.end() + len(word))
    if boxed is not None:
        return boxed
    return ("####", text[hashes + 4:], len(text)) if hashes >= 0 else None


def _braced(text: str, start: int) -> str | None:
    """`text[start:]` up to the brace closing an already open "{"; None if unclosed."""
    depth = 1
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i]
    return None


def _plain(boxed: str) -> str:
    """LaTeX in a box made plain: \\text{...}, "1{,}234", "\\$", "\\%", thin spaces."""
    boxed = _LATEX_TEXT_RE.sub(r"\1", boxed)
    for latex, plain in _LATEX_PLAIN:
        boxed = boxed.replace(latex, plain)
    return boxed


def _mark_number(kind: str, content: str) -> Decimal | None:
    """GSM8K "####": the first number after it; a box: \\frac{a}{b}, else its last number."""
    if kind == "####":
        match = _NUMBER_RE.search(content)
        return parse_number(match.group()) if match else None
    content = _plain(content)
    frac = _FRAC_RE.fullmatch(content)
    if frac:
        num, den = parse_number(frac.group(2)), parse_number(frac.group(3))
        if num is None or not den:
            return None
        return (-num if frac.group(1) else num) / den
    return last_number(content)


def final_answer(text: str) -> Decimal | None:
    """The number in the last answer mark ("\\boxed{...}" or GSM8K's "####"), else the last
    number in `text`; None without any number, or when the last mark is a box without one
    (the model boxed a non-number: that is its answer)."""
    mark = final_mark(text)
    if mark is not None:
        value = _mark_number(mark[0], mark[1])
        if value is not None or mark[0] == "boxed":
            return value
    return last_number(text.replace("\u2212", "-"))


def _text_answer(text: str) -> str:
    """The last answer mark's content, else the whole text; stripped, lower case."""
    mark = final_mark(text)
    return (_plain(mark[1]) if mark is not None else text).strip().lower()


def math_accuracy(prompt: str, response: str, answer: str) -> float:
    reference = final_answer(answer)
    if reference is None:
        want = _text_answer(answer)
        return float(response.strip().lower() == want or _text_answer(response) == want)
    got = final_answer(response)
    return float(got is not None and got == reference)


def format_reward(prompt: str, response: str, answer: str) -> float:
    text = response.strip().replace("\u2212", "-")
    if _ONLY_NUMBER_RE.fullmatch(text) or _FINAL_HASHES_RE.search(text):
        return 1.0
    mark = final_mark(text)
    if mark is not None and mark[0] == "boxed" and re.fullmatch(_END, text[mark[2]:]):
        plain = _plain(mark[1])
        if _BOXED_NUMBER_RE.fullmatch(plain) or _FRAC_RE.fullmatch(plain):
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
