"""Task sets: the prompts explorers roll out, as JSONL on local disk or S3.

One task per line: {"id": "...", "prompt": "...", "answer": "..."}. `question` is accepted
for `prompt` (GSM8K's field name); a number is accepted as `answer` and kept as text; `id`
defaults to "task-<line number>". Blank lines and a UTF-8 byte order mark are skipped.

GSM8K's own JSONL reads as is: {"question": "...", "answer": "...reasoning...\\n#### 72"}
becomes {"id": "task-<n>", "prompt": "<question>", "answer": "72", "solution": "<the
full answer text>"}: an answer with "####" keeps what follows its last "####" as the
answer and the whole text as `solution` (the rewards see `answer`; `solution` is kept for
reference; a line's own string `solution` is kept too, so written tasks read back the
same). Other keys of a line are ignored.

    python -m rft_rollout.tasksets arithmetic --n 256 --seed 0 --out s3://data/arith.jsonl

writes a synthetic set of one-step sums ("3+4=" -> "7") over the tiny test vocabulary
(digits and "+-*= ?", see tests/fixtures/models.py), so a tiny model can learn it in a demo.
"""

from __future__ import annotations

import argparse
import json
import operator
import random
import sys
from typing import Any, Iterable

from rft_contract.podenv import PodEnv
from rft_contract.storage import get_storage

_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


def arithmetic(n: int, seed: int = 0, max_operand: int = 9, ops: str = "+-") -> list[dict[str, str]]:
    """`n` tasks "a<op>b=" with operands in [0, max_operand]; answers may be negative."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if max_operand < 0:
        raise ValueError(f"max_operand must be >= 0, got {max_operand}")
    if not ops or any(op not in _OPS for op in ops):
        raise ValueError(f"ops must be a non-empty combination of {''.join(_OPS)!r}, got {ops!r}")
    rng = random.Random(seed)
    tasks = []
    for i in range(n):
        a, b, op = rng.randint(0, max_operand), rng.randint(0, max_operand), rng.choice(ops)
        tasks.append({"id": f"arith-{i:06d}", "prompt": f"{a}{op}{b}=", "answer": str(_OPS[op](a, b))})
    return tasks


def parse_taskset(text: str, where: str = "taskset") -> list[dict[str, str]]:
    """Tasks from JSONL text; ValueError naming the line and the problem."""
    tasks = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            tasks.append(_parse_task(line, f"{where}: line {lineno}", lineno))
    if not tasks:
        raise ValueError(f"{where}: no tasks")
    return tasks


def _parse_task(line: str, where: str, lineno: int) -> dict[str, str]:
    try:
        obj = json.loads(line)
    except ValueError as e:
        raise ValueError(f"{where}: not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    key = "prompt" if "prompt" in obj else "question"
    if key not in obj:
        raise ValueError(f"{where}: missing key 'prompt' (or 'question')")
    prompt = obj[key]
    if not isinstance(prompt, str) or not prompt:
        raise ValueError(f"{where}: {key!r} must be a non-empty string, got {prompt!r}")
    if "answer" not in obj:
        raise ValueError(f"{where}: missing key 'answer'")
    answer = obj["answer"]
    if isinstance(answer, bool) or not isinstance(answer, str | int | float):
        raise ValueError(f"{where}: 'answer' must be a string or a number, got {answer!r}")
    task_id = obj.get("id", f"task-{lineno}")
    task = {"id": str(task_id), "prompt": prompt, "answer": str(answer)}
    if isinstance(obj.get("solution"), str):
        task["solution"] = obj["solution"]
    if isinstance(answer, str) and "####" in answer:  # GSM8K: "...reasoning...\n#### 72"
        final = answer.rsplit("####", 1)[1].strip()
        if not final:
            raise ValueError(f"{where}: 'answer' has nothing after its last '####' (GSM8K's final answer)")
        task.update(answer=final, solution=answer)
    return task


def load_taskset(uri: str, env: PodEnv | None = None) -> list[dict[str, str]]:
    """Read a JSONL task set from a local path, file:// or s3:// URI; `env`: the pod's S3
    knobs (`JobConfig.env`)."""
    data = get_storage(uri, env).read_bytes(uri)
    try:
        text = data.decode("utf-8-sig")  # tolerates a byte order mark
    except UnicodeDecodeError as e:
        raise ValueError(f"{uri}: not UTF-8: {e}") from None
    return parse_taskset(text, uri)


def write_taskset(uri: str, tasks: Iterable[dict[str, Any]]) -> int:
    """Write tasks as JSONL (one object replaced atomically); returns the number written."""
    lines = [json.dumps(t, ensure_ascii=False, separators=(",", ":")) for t in tasks]
    get_storage(uri).write_bytes(uri, ("\n".join(lines) + "\n").encode() if lines else b"")
    return len(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rft_rollout.tasksets")
    sub = ap.add_subparsers(dest="command", required=True)
    arith = sub.add_parser("arithmetic", help="synthetic one-step arithmetic over the tiny vocabulary")
    arith.add_argument("--n", type=int, default=256)
    arith.add_argument("--seed", type=int, default=0)
    arith.add_argument("--max-operand", type=int, default=9)
    arith.add_argument("--ops", default="+-")
    arith.add_argument("--out", required=True, help="local path or s3:// URI of the JSONL to write")
    args = ap.parse_args(argv)
    try:
        tasks = arithmetic(args.n, seed=args.seed, max_operand=args.max_operand, ops=args.ops)
    except ValueError as e:
        ap.error(str(e))
    count = write_taskset(args.out, tasks)
    print(f"wrote {count} tasks to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
