"""rft_rollout.evaluation against a real reference server (in-process, tiny model): choices
map to their tasks, a fixed seed reproduces sampled scores, pass@k is Chen et al.'s
unbiased estimate."""

from __future__ import annotations

import pytest
import requests

from rft_rollout.evaluation import evaluate, pass_at_k
from rft_rollout.tasksets import arithmetic
from rft_serving.serve import ReferenceServer
from tests.fixtures.models import save_tiny_model

TASKS = arithmetic(5, seed=3)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from transformers import AutoTokenizer

    model_dir = save_tiny_model(tmp_path_factory.mktemp("policy") / "m", seed=0)
    server = ReferenceServer(host="127.0.0.1", port=0, served_model_name="policy", device="cpu")
    server.start()
    server.load(str(model_dir), 1)
    yield server.url, AutoTokenizer.from_pretrained(model_dir)
    server.stop()


@pytest.mark.parametrize("n, c, k, expected", [
    (4, 0, 1, 0.0), (4, 1, 1, 0.25), (4, 4, 1, 1.0), (4, 2, 2, 1 - 1 / 6), (4, 3, 2, 1.0), (10, 1, 10, 1.0),
])
def test_pass_at_k_is_the_unbiased_estimate(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected)


@pytest.mark.parametrize("n, c, k", [(4, 5, 1), (4, -1, 1), (4, 1, 0), (4, 1, 5)])
def test_pass_at_k_refuses_impossible_counts(n, c, k):
    with pytest.raises(ValueError, match="pass@k"):
        pass_at_k(n, c, k)


def test_each_task_gets_its_own_choices_whatever_the_request_grouping(served):
    url, tokenizer = served
    seen: list[tuple[str, str]] = []

    def reward(prompt: str, response: str, answer: str) -> float:
        seen.append((prompt, answer))
        return float(len(response))

    together = evaluate(url, TASKS, tokenizer, reward, max_tokens=6, n=2, tasks_per_request=2)
    alone = [evaluate(url, [t], tokenizer, lambda *a: 0.0, max_tokens=6, n=2) for t in TASKS]
    assert together.texts == [r.texts[0] for r in alone]  # greedy: the same text for each task
    assert [len(t) for t in together.texts] == [2] * len(TASKS)
    assert seen[::2] == [(t["prompt"], t["answer"]) for t in TASKS]  # the reward saw each task's own
    assert together.rewards == [[float(len(x)) for x in texts] for texts in together.texts]


def test_a_fixed_seed_reproduces_a_sampled_evaluation_and_another_seed_does_not(served):
    url, tokenizer = served

    def run(seed: int):
        return evaluate(url, TASKS, tokenizer, lambda p, r, a: float(len(r)), max_tokens=8, n=8,
                        temperature=1.0, seed=seed, tasks_per_request=3)

    first, again, other = run(7), run(7), run(8)
    assert first.texts == again.texts and first.mean_reward == again.mean_reward
    assert first.texts != other.texts
    assert len({x for texts in first.texts for x in texts}) > len(TASKS)  # sampled: not one text a task


def test_pass_at_k_and_the_mean_reward(served):
    url, tokenizer = served
    # Task i's samples pass when i is even: pass@1 = pass@4 = 3/5; mean reward = 3/5.
    index = {t["prompt"]: i for i, t in enumerate(TASKS)}
    result = evaluate(url, TASKS, tokenizer, lambda p, r, a: float(index[p] % 2 == 0), max_tokens=4, n=4,
                      temperature=1.0, seed=0, ks=(1, 4, 8))
    assert result.mean_reward == pytest.approx(0.6)
    assert result.pass_at_k == pytest.approx({1: 0.6, 4: 0.6})  # k=8 > n is left out


def test_a_refused_request_raises(served):
    url, tokenizer = served
    with pytest.raises(requests.HTTPError):
        evaluate(url, TASKS, tokenizer, lambda *a: 0.0, max_tokens=4, n=1000)
    with pytest.raises(ValueError, match="n must be"):
        evaluate(url, TASKS, tokenizer, lambda *a: 0.0, max_tokens=4, n=0)
