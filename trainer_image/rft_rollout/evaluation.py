"""Score the model an inference server serves on a taskset: `n` samples per task through the
completions API the explorer uses (prompts rendered as the explorer renders them), scored
with a reward function. Reports the mean reward (the accuracy, for a 0/1 reward) and pass@k.

A fixed `seed` makes sampled scores reproducible on the reference server (a per-request
`torch.Generator`) and on vLLM (per-request `seed`): two versions scored with the same seed
draw the same random numbers, so their difference is the models' difference, not luck. At
temperature 0 (greedy) the seed does not matter.

    result = evaluate(url, tasks, tokenizer, format_reward, n=16, temperature=1.0,
                      max_tokens=12, seed=0)
    result.mean_reward, result.pass_at_k[1], result.pass_at_k[16]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import requests

from rft_contract.names import SERVED_MODEL_NAME

from .explorer import render_prompt, resolve_prompt_format

RewardFn = Callable[[str, str, str], float]


@dataclass(frozen=True)
class EvalResult:
    rewards: list[list[float]]  # per task, per sample
    texts: list[list[str]]
    pass_at_k: dict[int, float] = field(default_factory=dict)  # k -> estimate (reward >= 1 passes)
    versions: frozenset[int | str] = frozenset()  # the weights versions the choices report

    @property
    def mean_reward(self) -> float:
        flat = [r for task in self.rewards for r in task]
        return sum(flat) / len(flat) if flat else 0.0


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from `n` samples of which `c` passed (Chen et al. 2021,
    the Codex paper): 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


# One completions request: the response's JSON and each choice's weights version (None when
# nothing says), as rft_rollout.rollouts.InferenceClient.complete returns them.
Complete = Callable[[dict[str, Any]], tuple[dict[str, Any], "list[int | str] | None"]]


def evaluate(url: str, tasks: Sequence[Mapping[str, str]], tokenizer: Any, reward_fn: RewardFn, *,
             max_tokens: int, timeout: float = 600.0, session: requests.Session | None = None,
             **kw: Any) -> EvalResult:
    """`score` through a plain POST to the server at `url` (its base URL). Raises
    requests.HTTPError when the server refuses a request."""
    http = session or requests.Session()

    def complete(body: dict[str, Any]) -> tuple[dict[str, Any], None]:
        r = http.post(f"{url.rstrip('/')}/v1/completions", json=body, timeout=timeout)
        r.raise_for_status()
        return r.json(), None

    return score(complete, tasks, tokenizer, reward_fn, max_tokens=max_tokens, **kw)


def score(complete: Complete, tasks: Sequence[Mapping[str, str]], tokenizer: Any, reward_fn: RewardFn, *,
          max_tokens: int, n: int = 1, temperature: float = 0.0, top_p: float = 1.0,
          seed: int | None = None, prompt_format: str | None = None, ks: Sequence[int] = (1,),
          model: str = SERVED_MODEL_NAME, tasks_per_request: int = 64) -> EvalResult:
    """`n` completions of each task's prompt, each scored with `reward_fn(task prompt,
    response, task answer)`. Requests carry up to `tasks_per_request` prompts; request i
    gets seed `seed + i`. pass@k for each k in `ks` that is <= n. `versions`: the weights
    versions the choices report (empty when none reports one)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    fmt = resolve_prompt_format(prompt_format, tokenizer)
    rewards: list[list[float]] = []
    texts: list[list[str]] = []
    versions: set[int | str] = set()
    for i, start in enumerate(range(0, len(tasks), tasks_per_request)):
        chunk = tasks[start:start + tasks_per_request]
        body: dict[str, Any] = {
            "model": model, "prompt": [render_prompt(t["prompt"], fmt, tokenizer) for t in chunk], "n": n,
            "max_tokens": max_tokens, "temperature": temperature, "top_p": top_p}
        if seed is not None:
            body["seed"] = seed + i
        if fmt == "chat":  # as the explorer sends them: the chat template wrote its special tokens
            body["add_special_tokens"] = False
        data, choice_versions = complete(body)
        versions.update(choice_versions or ())
        # The API numbers choices prompt-major: prompt p's samples are p*n .. p*n + n - 1.
        choices = sorted(data["choices"], key=lambda c: c["index"])
        if len(choices) != len(chunk) * n:
            raise ValueError(f"the server returned {len(choices)} choices for {len(chunk)} prompts x n={n}")
        for p, task in enumerate(chunk):
            out = [c["text"] for c in choices[p * n:(p + 1) * n]]
            texts.append(out)
            rewards.append([float(reward_fn(task["prompt"], x, task["answer"])) for x in out])
    passes = {k: sum(pass_at_k(n, sum(r >= 1.0 for r in task), k) for task in rewards) / len(rewards)
              for k in ks if k <= n} if rewards else {}
    return EvalResult(rewards=rewards, texts=texts, pass_at_k=passes, versions=frozenset(versions))
