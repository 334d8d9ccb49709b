"""GSM8K: final answers in references ("...#### 72") and in model responses ("\\boxed{72}",
"#### 72", the last number), and GSM8K's own JSONL read as a task set."""

from __future__ import annotations

import json
from decimal import Decimal

import pytest

from rft_rollout.rewards import final_answer, format_reward, get_reward, math_accuracy, math_accuracy_format
from rft_rollout.tasksets import load_taskset, parse_taskset, write_taskset

# The first two lines of GSM8K's train.jsonl, as published.
GSM8K_LINES = [
    {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many "
                 "clips in May. How many clips did Natalia sell altogether in April and May?",
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 "
               "clips altogether in April and May.\n#### 72"},
    {"question": "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of "
                 "babysitting. How much did she earn?",
     "answer": "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nWorking 50 minutes, she earned "
               "0.2 x 50 = $<<0.2*50=10>>10.\n#### 10"},
]
SOLUTION = GSM8K_LINES[0]["answer"]


@pytest.mark.parametrize("text, want", [
    (SOLUTION, "72"),                                      # a GSM8K reference: after "####"
    ("#### 72", "72"),
    ("#### 72 (48 in April + 24 in May)", "72"),           # the number after "####", not the last
    ("so the answer is \\boxed{72}.", "72"),               # boxed
    ("$\\boxed{72}$", "72"),
    ("\\boxed{72} because 48 + 24 = 72 and 3 more", "72"),  # the box wins over the last number
    ("\\boxed{1 + 2 = 3}", "3"),                           # the last number in the box
    ("#### 5 ... on reflection \\boxed{6}", "6"),          # the last mark wins
    ("\\boxed{6} ... on reflection #### 5", "5"),
    ("48 + 24 = 72", "72"),                                # no mark: the last number
    ("She earned $10.", "10"),                             # "$" and a trailing period
    ("#### $1,234", "1234"),                               # commas
    ("\\boxed{1{,}234}", "1234"),                          # LaTeX's braced comma
    ("\\boxed{\\$18.00}", "18"),                           # "3.50" == "3.5"
    ("\\boxed{18 \\text{ eggs}}", "18"),
    ("The total is 1,234,567 dollars", "1234567"),
    ("It fell to -4 degrees", "-4"),                       # negative
    ("#### -$5", "-5"),
    ("a loss of $-5", "-5"),
    ("\\boxed{-12.5}", "-12.5"),
    ("\u22127", "-7"),                                     # a typographic minus
    ("0.50 per minute", "0.5"),                            # decimals
    (".5", "0.5"),
    ("\\boxed{\\frac{3}{4}}", "0.75"),
    ("\\boxed{50\\%}", "50"),
    ("5-3", "3"),                                          # subtraction, not -3
    ("no number here", None),                              # no number
    ("\\boxed{B} though 3 was close", None),               # a boxed non-number is the answer
    ("", None),
])
def test_final_answer(text, want):
    assert final_answer(text) == (None if want is None else Decimal(want))


@pytest.mark.parametrize("response, want", [
    ("Natalia sold 24 in May, so 72 in all.\n#### 72", 1.0),
    ("She sold 48 + 24 = \\boxed{72} clips.", 1.0),
    ("48/2 = 24, 48 + 24 = 72", 1.0),
    ("The answer is 72.", 1.0),
    ("\\boxed{72.0}", 1.0),
    ("\\boxed{72} and 73", 1.0),
    ("\\boxed{24} then 72", 0.0),    # the boxed answer, not the last number
    ("#### 24", 0.0),
    ("72 is wrong; \\boxed{-72}", 0.0),
    ("seventy-two", 0.0),
    ("", 0.0),
])
def test_math_accuracy_on_a_gsm8k_reference(response, want):
    assert math_accuracy("q", response, SOLUTION) == want
    assert math_accuracy("q", response, "72") == want  # the loader's answer: the same verdict


@pytest.mark.parametrize("response, answer", [
    ("Weng earned \\boxed{\\$10}.", "#### 10"),
    ("$1,234.50", "1234.5"),
    ("#### 3.50", "3.5"),
    ("\\boxed{-0.25}", "-.25"),
    ("\\boxed{B}", "B"),               # a text reference against a box
    ("\\boxed{\\text{b}}", "B"),
])
def test_math_accuracy_matches(response, answer):
    assert get_reward("math_accuracy")("q", response, answer) == 1.0


@pytest.mark.parametrize("response, want", [
    ("\\boxed{72}", 1.0),
    ("The answer is $\\boxed{72}$.", 1.0),
    ("so \\boxed{1{,}234}.", 1.0),
    ("#### 72.", 1.0),
    ("#### $72", 1.0),
    ("$72", 1.0),
    ("72.", 1.0),
    ("\\boxed{72} eggs", 0.5 * 2 / 14),   # the box is not the end: partial
    ("\\boxed{x}", 0.0),
])
def test_format_accepts_boxed_and_gsm8k_marks(response, want):
    assert format_reward("q", response, "") == pytest.approx(want)
    assert math_accuracy_format("q", response, "72") == pytest.approx(
        0.9 * math_accuracy("q", response, "72") + 0.1 * want)


# ------------------------------------------------------------------ the task set


def test_gsm8k_jsonl_becomes_tasks(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in GSM8K_LINES) + "\n")
    tasks = load_taskset(str(path))
    assert tasks == [
        {"id": "task-1", "prompt": GSM8K_LINES[0]["question"], "answer": "72", "solution": SOLUTION},
        {"id": "task-2", "prompt": GSM8K_LINES[1]["question"], "answer": "10",
         "solution": GSM8K_LINES[1]["answer"]},
    ]
    assert write_taskset(str(tmp_path / "copy.jsonl"), tasks) == 2  # written tasks read back the same
    assert load_taskset(str(tmp_path / "copy.jsonl")) == tasks
    reward = get_reward("math_accuracy")
    for task, good, bad in zip(tasks, ["\\boxed{72}", "#### 10"], ["\\boxed{71}", "#### 1"]):
        assert reward(task["prompt"], good, task["answer"]) == 1.0
        assert reward(task["prompt"], good, task["solution"]) == 1.0
        assert reward(task["prompt"], bad, task["answer"]) == 0.0


def test_gsm8k_file_with_a_byte_order_mark_and_crlf(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + "\r\n".join(json.dumps(line) for line in GSM8K_LINES).encode())
    assert [t["answer"] for t in load_taskset(str(path))] == ["72", "10"]


def test_existing_layouts_are_unchanged():
    text = "\n".join([
        json.dumps({"id": "a", "prompt": "3+4=", "answer": "7"}),
        json.dumps({"question": "2+2=", "answer": 4}),
        json.dumps({"prompt": "pick", "answer": "B", "extra": [1]}),
    ])
    assert parse_taskset(text) == [{"id": "a", "prompt": "3+4=", "answer": "7"},
                                   {"id": "task-2", "prompt": "2+2=", "answer": "4"},
                                   {"id": "task-3", "prompt": "pick", "answer": "B"}]


@pytest.mark.parametrize("bad, message", [
    ('{"question": "q", "answer": "reasoning\\n####   "}',
     "line 3: 'answer' has nothing after its last '####'"),
    ('{"question": "q", "answer": "reasoning\\n#### 7"', "line 3: not valid JSON"),
    ('{"question": null, "answer": "#### 7"}', "line 3: 'question' must be a non-empty string"),
    ('{"prompt": "", "answer": "7"}', "line 3: 'prompt' must be a non-empty string"),
    ('{"question": "q"}', "line 3: missing key 'answer'"),
    ('"just a string"', "line 3: expected a JSON object"),
])
def test_a_malformed_gsm8k_line_names_its_number(bad, message):
    text = json.dumps(GSM8K_LINES[0]) + "\n\n" + bad + "\n"
    with pytest.raises(ValueError) as e:
        parse_taskset(text, "train.jsonl")
    assert str(e.value).startswith("train.jsonl: line 3: ") and message in str(e.value)
