"""rft_rollout.evaluator (spec.evaluation on trainer rank 0) against a real reference server
(in-process, tiny model): a score belongs to the version the server says served it, a due
version waits for the sync, a version never served is skipped at the timeout, and the
status record keeps the best."""

from __future__ import annotations

import pytest

from rft_contract.config import ConfigError, load_config
from rft_contract.podmetrics import TrainerMetrics
from rft_rollout.evaluator import EvaluationState, Evaluator, Outcome, metrics_of, summary
from rft_rollout.evaluation import EvalResult
from rft_rollout.tasksets import arithmetic
from rft_serving.serve import ReferenceServer
from tests.fixtures.models import save_tiny_model
from tests.trainer.test_explorer import job_config

TASKS = arithmetic(6, seed=5)
WAIT = 120.0  # a bound on each blocking wait, never reached when the feature works


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("policy") / "m", seed=0)


@pytest.fixture
def server(model_dir):
    s = ReferenceServer(host="127.0.0.1", port=0, served_model_name="policy", device="cpu", max_concurrency=2)
    s.start()
    s.load(str(model_dir), 0)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def make(model_dir, tokenizer, url, **evaluation) -> Evaluator:
    data = job_config(model_dir, "s3://unused/buffer", "s3://unused/tasks.jsonl")
    data["evaluation"] = {"taskset_uri": "s3://unused/eval.jsonl", **evaluation}
    config = load_config(data)
    return Evaluator(config, url, tokenizer=tokenizer, tasks=TASKS, poll_seconds=0.05)


def next_outcome(ev: Evaluator) -> Outcome:
    return ev.outcomes.get(timeout=WAIT)


def test_each_score_belongs_to_the_version_that_served_it(server, model_dir, tokenizer):
    ev = make(model_dir, tokenizer, server.url, samples_per_task=2, temperature=1.0, pass_at_k=[1, 2]).start()
    try:
        base = next_outcome(ev)  # the base model first, unasked
        assert base.version == 0 and not base.skipped
        assert len(base.result.rewards) == len(TASKS) and all(len(r) == 2 for r in base.result.rewards)
        assert set(base.result.pass_at_k) == {1, 2}
        ev.published(2)  # due, but the server still serves version 0: the evaluator waits for the sync
        server.load(str(model_dir), 2)
        scored = next_outcome(ev)
        assert scored.version == 2 and scored.result.versions == {2}
        # The same weights under the same seed score the same: the seed makes scores comparable.
        assert scored.result.texts == base.result.texts
    finally:
        ev.stop()


def test_a_newer_served_version_is_scored_instead_and_the_interval_spaces_them(server, model_dir, tokenizer):
    ev = make(model_dir, tokenizer, server.url, interval=3)
    server.load(str(model_dir), 4)  # the server moved on before the evaluator started
    ev.start()
    try:
        assert next_outcome(ev).version == 4
        assert not ev.due(5) and not ev.due(6) and ev.due(7)
        assert ev.due(10)  # total_steps: the final version is always due
        ev.published(6)  # not due: nothing is scored
        ev.published(7)
        server.load(str(model_dir), 7)
        assert next_outcome(ev).version == 7
        assert ev.outcomes.empty()
    finally:
        ev.stop()


def test_versions_published_while_a_score_runs_wait_for_the_interval(server, model_dir, tokenizer):
    """Versions 1..3 come out while the base is scored (its reward waits on a gate): none of
    them is 10 steps past the base, so the next score is version 10's, not 3's."""
    import threading

    gate, scoring = threading.Event(), threading.Event()

    def reward(prompt, response, answer):
        scoring.set()
        assert gate.wait(WAIT)
        return 0.0

    ev = make(model_dir, tokenizer, server.url, interval=10)
    ev.reward_fn = reward
    ev.start()
    try:
        assert scoring.wait(WAIT)  # the base's score is under way
        for version in (1, 2, 3):
            ev.published(version)
        server.load(str(model_dir), 3)
        gate.set()
        assert next_outcome(ev).version == 0
        ev.published(10)
        server.load(str(model_dir), 10)
        assert next_outcome(ev).version == 10
    finally:
        ev.stop()


def test_a_refused_request_skips_the_version_at_once(server, model_dir, tokenizer):
    ev = make(model_dir, tokenizer, server.url, max_tokens=10_000, timeout_seconds=3600)  # beyond the context
    ev.start()
    try:
        skipped = next_outcome(ev)
        assert skipped.skipped and skipped.version == 0 and "ClientError" in skipped.error
    finally:
        ev.stop()


def test_a_version_never_served_is_skipped_at_the_timeout(server, model_dir, tokenizer):
    ev = make(model_dir, tokenizer, server.url, timeout_seconds=0.5)
    ev.start()
    try:
        assert next_outcome(ev).version == 0
        ev.published(3)  # never loaded
        skipped = next_outcome(ev)
        assert skipped.skipped and skipped.version == 3 and skipped.result is None
        assert not ev.finish(5, 0.0)  # nothing scored the final version yet
    finally:
        ev.stop()


def test_a_pinned_job_skips_a_due_version_at_once(server, model_dir, tokenizer):
    """spec.sync.pinnedVersion set while the job runs: the replica keeps serving the pin, so
    a due version is skipped at once, not after timeoutSeconds (nor is the final one waited for)."""
    ev = make(model_dir, tokenizer, server.url, timeout_seconds=3600)
    pins = iter([None, "best"])  # unpinned at the first look, pinned at the next
    ev.pinned, ev.pin_check_seconds = (lambda: next(pins)), 0.0
    ev.start()
    try:
        assert next_outcome(ev).version == 0
        ev.published(3)
        skipped = next_outcome(ev)
        assert skipped.skipped and "pinnedVersion is best" in skipped.error
    finally:
        ev.stop()


def test_finish_waits_for_the_final_version(server, model_dir, tokenizer):
    ev = make(model_dir, tokenizer, server.url, interval=100)
    ev.start()
    try:
        assert next_outcome(ev).version == 0
        server.load(str(model_dir), 9)
        assert ev.finish(9, WAIT)  # not due by the interval: finish asks for it all the same
        assert next_outcome(ev).version == 9
    finally:
        ev.stop()


def test_stop_ends_an_evaluation_waiting_for_its_version(server, model_dir, tokenizer):
    ev = make(model_dir, tokenizer, server.url, timeout_seconds=3600)
    ev.start()
    assert next_outcome(ev).version == 0
    ev.published(5)
    ev.stop()
    ev._thread.join(WAIT)
    assert not ev._thread.is_alive() and ev.outcomes.empty()


def test_an_empty_taskset_is_a_config_error(model_dir, tokenizer, server):
    data = job_config(model_dir, "s3://unused/buffer", "s3://unused/tasks.jsonl")
    data["evaluation"] = {"taskset_uri": "s3://unused/eval.jsonl"}
    with pytest.raises(ConfigError, match="evaluation.tasksetUri"):
        Evaluator(load_config(data), server.url, tokenizer=tokenizer, tasks=[])


def scored(version: int, rewards: list[list[float]], pass_at_k=None) -> Outcome:
    return Outcome(version, 1.5, result=EvalResult(rewards=rewards, texts=[], pass_at_k=pass_at_k or {},
                                                   versions=frozenset({version})))


def test_the_status_keeps_the_last_and_the_best():
    state = EvaluationState()
    first = state.update(scored(0, [[0.0], [1.0]], {1: 0.5}), step=0)
    assert first["last"]["accuracy"] == 0.5 and first["best"]["version"] == 0
    assert first["last"]["passAtK"] == {"1": 0.5} and first["summary"] == "0.500@v0"
    state.update(scored(4, [[1.0], [1.0]]), step=4)
    after = state.update(scored(8, [[0.0], [1.0]]), step=9)
    assert after["last"]["version"] == 8 and after["last"]["step"] == 9
    assert after["best"]["version"] == 4 and after["summary"] == "0.500@v8 best 1.000@v4"
    assert after["evaluated"] == 3 and after["error"] is None
    skipped = state.update(Outcome(12, 60.0, error="HTTP 503", skipped=True), step=12)
    assert skipped["skipped"] == 1 and skipped["error"] == "version 12: HTTP 503"
    assert skipped["last"]["version"] == 8  # a skipped version is no score
    # An attempt resumed at step 6 exports 7.. again: the records of version 8 go, 4 stays.
    resumed = EvaluationState(skipped, up_to=6)
    assert resumed.last is None and resumed.best_version == 4
    # A resumed attempt starts from the job's status: its best stays the best.
    again = EvaluationState(skipped, up_to=12)
    assert again.best_version == 4 and again.evaluated == 3
    assert again.update(scored(16, [[1.0], [1.0]]), step=16)["best"]["version"] == 4  # a tie keeps the earlier


def test_metrics_for_the_trackers_and_prometheus():
    outcome = scored(4, [[1.0, 0.0]], {1: 0.5, 2: 1.0})
    assert metrics_of(outcome) == {"eval/accuracy": 0.5, "eval/version": 4.0, "eval/pass@1": 0.5,
                                   "eval/pass@2": 1.0}
    m = TrainerMetrics()
    m.observe_evaluation(4, outcome.result, {"version": 4, "accuracy": 0.5}, seconds=1.5)
    m.observe_evaluation(5, None, None, skipped=True)
    reg = m.registry
    assert reg.get_sample_value("rft_trainer_eval_accuracy") == 0.5
    assert reg.get_sample_value("rft_trainer_eval_pass_at_k", {"k": "2"}) == 1.0
    assert reg.get_sample_value("rft_trainer_eval_best_version") == 4
    assert reg.get_sample_value("rft_trainer_evaluations_total", {"result": "scored"}) == 1
    assert reg.get_sample_value("rft_trainer_evaluations_total", {"result": "skipped"}) == 1


def test_summary_without_a_score():
    assert summary(None, None) is None
