"""The progress deadline (spec.failurePolicy.progressDeadlineSeconds), pass by pass through
`reconcile`, with the injected clock: a running gang whose trainer does not step for the
deadline is restarted like a failed pod, and the Progressing condition says why."""

from __future__ import annotations

from datetime import timedelta

import pytest

from rft_contract import names
from rft_operator import progress_deadline
from rft_operator.model import PodView
from rft_operator.reconcile import reconcile

from .testing import NOW, SPEC, condition, last_failure, make_job, observed, pod, rollout_pod, status

DEADLINE = 600
BASE = {**SPEC, "failurePolicy": {**SPEC["failurePolicy"], "progressDeadlineSeconds": DEADLINE}}


def merge(into: dict, patch: dict) -> dict:
    """JSON merge patch (RFC 7386), as the API server applies the operator's status."""
    out = dict(into)
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        elif isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        else:
            out[k] = v
    return out


class Sim:
    """One RFTJob, its trainer pods and the trainer's reports, reconciled at chosen times;
    each plan's status is merged back as the controller's write would be."""

    def __init__(self, spec: dict = BASE, status: dict | None = None):
        self.spec, self.status = spec, status or {}
        self.pods: dict[str, PodView] = {}
        self.plans = []

    def report(self, **trainer) -> None:
        """What the trainer's rank 0 merge-patches into status.trainer."""
        self.status = merge(self.status, {"trainer": trainer})

    def run_gang(self) -> None:
        """The scheduler and kubelet: every pod of the current attempt runs."""
        attempt = self.status["attempt"]
        for rank in range(2):
            self.pods[f"demo-trainer-{attempt}-{rank}"] = pod(attempt, rank)

    def at(self, seconds: float):
        plan = reconcile(make_job(self.spec, self.status), observed(self.pods.values()),
                         NOW + timedelta(seconds=seconds))
        self.status = merge(self.status, plan.status)
        for name in plan.delete_pods:  # KWOK-like: deleted pods go at once
            self.pods.pop(name, None)
        for obj in plan.create:  # rollout pods are left out: they never start here
            if obj["kind"] == "Pod" and obj["metadata"]["labels"][names.LABEL_ROLE] == names.ROLE_TRAINER:
                labels = obj["metadata"]["labels"]
                self.pods[obj["metadata"]["name"]] = pod(
                    int(labels[names.LABEL_ATTEMPT]), int(labels[names.LABEL_RANK]), "Pending")
        self.plans.append(plan)
        return plan

    def running(self, seconds: float = 0):
        """Create the job's gang and see it running at `seconds`."""
        self.at(seconds)
        self.run_gang()
        plan = self.at(seconds)
        assert self.status["phase"] == names.RUNNING
        return plan


def progress(status) -> tuple:
    """(step, attempt, since) of status.progress; a merge patch drops `step: null`."""
    p = status["progress"]
    return p.get("step"), p["attempt"], p["since"]


def progressing(job_status: dict) -> dict:
    return condition(job_status, names.COND_PROGRESSING)


def fired(plans) -> list:
    return [e for p in plans for e in p.events if e.reason == names.REASON_PROGRESS_DEADLINE]


def test_the_deadline_fires_once_and_restarts_the_gang_like_a_failure():
    sim = Sim()
    plan = sim.running(0)
    assert progress(sim.status) == (None, 1, "2026-11-30T12:00:00Z")
    assert plan.requeue_after == DEADLINE  # comes back when the deadline would pass
    assert progressing(sim.status)["status"] == "True" and progressing(sim.status)["reason"] == names.REASON_STEPPING

    plan = sim.at(DEADLINE)  # exactly the deadline: not past it
    assert sim.status["phase"] == names.RUNNING and plan.requeue_after == 0 and not fired(sim.plans)

    plan = sim.at(DEADLINE + 1)
    assert sim.status["phase"] == names.RESTARTING and sim.status["restarts"] == 1
    failure = sim.status["lastFailure"]
    assert (failure["attempt"], failure["reason"], failure["pod"], failure["exitCode"]) == (
        1, names.REASON_PROGRESS_DEADLINE, None, None)
    assert "attempt 1 reported no step in 601s" in failure["message"]
    assert "progressDeadlineSeconds=600" in failure["message"]
    assert sorted(plan.delete_pods) == ["demo-trainer-1-0", "demo-trainer-1-1"]
    got = progressing(sim.status)
    assert (got["status"], got["reason"]) == ("False", names.REASON_PROGRESS_DEADLINE)
    assert got["message"] == failure["message"]
    assert [(e.type, e.reason) for e in plan.events] == [("Warning", names.REASON_PROGRESS_DEADLINE),
                                                         ("Warning", names.REASON_RESTARTING)]
    assert plan.events[0].message == failure["message"]
    assert plan.requeue_after == 30  # the backoff

    # Restarting: the clock does not run, nothing fires again however late the pass.
    sim.at(DEADLINE + 20)
    assert sim.status["phase"] == names.RESTARTING and sim.status["restarts"] == 1
    sim.at(DEADLINE + 31)  # backoff over: attempt 2
    assert (sim.status["phase"], sim.status["attempt"]) == (names.PENDING, 2)
    assert progressing(sim.status)["reason"] == names.REASON_PROGRESS_DEADLINE  # until the next gang runs
    assert sorted(sim.pods) == ["demo-trainer-2-0", "demo-trainer-2-1"]
    sim.at(DEADLINE * 3)  # pods pending a long time: not counted
    sim.run_gang()
    sim.at(DEADLINE * 3 + 1)
    assert sim.status["phase"] == names.RUNNING and sim.status["restarts"] == 1
    assert progress(sim.status) == (None, 2, "2026-11-30T12:30:01Z")
    assert progressing(sim.status)["status"] == "True"
    assert len(fired(sim.plans)) == 1


def test_no_fire_while_the_step_moves():
    sim = Sim()
    sim.running(0)
    for i, t in enumerate(range(DEADLINE - 10, DEADLINE * 10, DEADLINE - 10)):
        sim.report(step=i + 1, attempt=1)
        plan = sim.at(t)
        assert sim.status["progress"]["step"] == i + 1
        assert plan.requeue_after == DEADLINE  # counted from this step
        sim.at(t + DEADLINE)  # exactly the deadline after the step: still in time
    assert sim.status["phase"] == names.RUNNING and sim.status["restarts"] == 0 and not fired(sim.plans)
    assert progressing(sim.status)["message"].startswith("step 10 of attempt 1 reported at ")


def test_a_step_of_the_previous_attempt_is_not_progress_of_this_one():
    sim = Sim(status=status(names.PENDING, attempt=2, restarts=1))
    sim.report(step=7, attempt=1)
    sim.running(0)
    assert progress(sim.status)[0] is None
    sim.report(step=7, attempt=2)  # the resumed attempt reports where it resumed
    sim.at(DEADLINE)
    assert progress(sim.status) == (7, 2, "2026-11-30T12:10:00Z")
    sim.at(DEADLINE + DEADLINE)
    assert sim.status["phase"] == names.RUNNING


def test_the_message_carries_the_trainers_waiting_reason():
    sim = Sim()
    sim.running(0)
    sim.report(step=4, attempt=1, buffer={"droppedStale": 12, "consumed": {"e000": 40}},
               waiting={"reason": names.WAIT_DATA, "message": "no new shard in s3://ckpts/demo/buffer",
                        "since": "2026-11-30T12:00:10Z", "seconds": 5.0})
    sim.at(10)
    sim.at(10 + DEADLINE + 1)
    message = sim.status["lastFailure"]["message"]
    assert message.startswith("step 4 has not moved for 601s (spec.failurePolicy.progressDeadlineSeconds=600): ")
    # Counted from the trainer's `since` with the operator's clock, not its stale `seconds`.
    assert "trainer waiting for experiences for 601s (12 stale dropped): no new shard in s3://ckpts/demo/buffer" \
        in message
    assert progressing(sim.status)["message"] == message


def test_the_message_names_weight_sync_lag_and_explorers_not_running():
    spec = {**BASE, "inference": {"replicas": 2},
            "explorer": {"replicas": 2, "tasksetUri": "s3://data/tasks.jsonl"}}
    sim = Sim(spec)
    sim.running(0)
    sim.report(step=4, attempt=1, buffer={"droppedStale": 128, "consumed": {"e000": 384}},
               latestWeights={"version": 4, "uri": "s3://ckpts/demo/weights/step-00000004", "id": "abc"},
               waiting={"reason": names.WAIT_STALE, "since": "2026-11-30T12:00:00Z"})
    sim.status = merge(sim.status, {"weightSync": {"replicas": {
        "demo-inference-0": {"version": 4, "id": "abc"},
        "demo-inference-1": {"version": 2, "id": "old", "error": "SyncError: checksum mismatch"}}}})
    sim.at(1)
    sim.pods["demo-explorer-0"] = rollout_pod("demo-explorer-0", role=names.ROLE_EXPLORER)
    sim.pods["demo-explorer-1"] = rollout_pod("demo-explorer-1", "Pending", role=names.ROLE_EXPLORER)
    sim.at(DEADLINE + 2)
    assert sim.status["lastFailure"]["message"] == (
        "step 4 has not moved for 601s (spec.failurePolicy.progressDeadlineSeconds=600): "
        "trainer waiting for fresh experiences for 602s (128 stale dropped); "
        "weight sync 1/2 replicas at target version 4 (demo-inference-1 serves version 2), "
        "oldest served version 2 steps behind the trainer; demo-inference-1: SyncError: checksum mismatch; "
        "1/2 explorer pods running (demo-explorer-1 Pending)")


def test_zero_turns_the_deadline_off():
    spec = {**BASE, "failurePolicy": {**BASE["failurePolicy"], "progressDeadlineSeconds": 0}}
    sim = Sim(spec)
    plan = sim.running(0)
    assert plan.requeue_after is None
    plan = sim.at(86400 * 30)
    assert sim.status["phase"] == names.RUNNING and plan.requeue_after is None and not fired(sim.plans)
    assert sim.status["progress"]["since"] == "2026-11-30T12:00:00Z"  # still recorded
    assert "no progress deadline" in progressing(sim.status)["message"]


def test_the_deadline_spends_the_restart_budget_then_fails_the_job():
    sim = Sim(status=status(names.PENDING, attempt=3, restarts=2))  # maxRestarts: 2
    sim.running(0)
    plan = sim.at(DEADLINE + 1)
    assert sim.status["phase"] == names.FAILED and sim.status["restarts"] == 2
    assert sim.status["lastFailure"]["reason"] == names.REASON_PROGRESS_DEADLINE
    assert "restart budget exhausted after 2 restarts (spec.failurePolicy.maxRestarts=2)" in sim.status["message"]
    failed = condition(sim.status, names.COND_FAILED)
    assert (failed["status"], failed["reason"]) == ("True", names.REASON_PROGRESS_DEADLINE)
    assert progressing(sim.status)["reason"] == names.REASON_PROGRESS_DEADLINE
    assert sorted(plan.delete_pods) == ["demo-trainer-3-0", "demo-trainer-3-1"]
    assert [e.reason for e in plan.events] == [names.REASON_PROGRESS_DEADLINE, names.REASON_PROGRESS_DEADLINE]
    sim.at(DEADLINE * 5)
    assert condition(sim.status, names.COND_FAILED)["reason"] == names.REASON_PROGRESS_DEADLINE  # kept on later passes


@pytest.mark.parametrize("phase, spec", [
    (names.PENDING, BASE),
    (names.RESTARTING, BASE),
    (names.SUSPENDED, {**BASE, "suspend": True}),
])
def test_the_clock_does_not_run_outside_running(phase, spec):
    stuck = {"step": 3, "attempt": 1, "since": "2026-11-30T10:00:00Z"}
    sim = Sim(spec, status(phase, restarts=1, progress=stuck, lastFailure=last_failure()))
    if phase == names.PENDING:
        sim.pods = {"demo-trainer-1-0": pod(1, 0)}  # rank 1 unscheduled
    plan = sim.at(1)
    assert sim.status["phase"] == phase and sim.status["restarts"] == 1 and not fired([plan])
    assert sim.status["progress"] == stuck
    assert progressing(sim.status)["status"] == "False" and progressing(sim.status)["reason"] == phase


def test_a_record_of_an_earlier_attempt_is_replaced_not_counted():
    stuck = {"step": 3, "attempt": 1, "since": "2026-11-30T10:00:00Z"}
    sim = Sim(status=status(names.PENDING, attempt=2, restarts=1, progress=stuck))
    sim.running(0)
    assert progress(sim.status) == (None, 2, "2026-11-30T12:00:00Z")
    assert not fired(sim.plans)


def test_the_progress_record_keeps_its_time_until_step_or_attempt_moves():
    later = NOW + timedelta(seconds=5)
    old = {"step": 3, "attempt": 1, "since": "2026-11-30T12:00:00Z"}
    assert progress_deadline.compute_progress_record(old, 1, 3, later) is old
    assert progress_deadline.compute_progress_record(old, 1, 4, later)["since"] == "2026-11-30T12:00:05Z"
    assert progress_deadline.compute_progress_record(old, 2, 3, later) == {"step": 3, "attempt": 2, "since": "2026-11-30T12:00:05Z"}
    assert progress_deadline.compute_progress_record(None, 1, None, later) == {"step": None, "attempt": 1,
                                                                  "since": "2026-11-30T12:00:05Z"}


@pytest.mark.parametrize("trainer, want", [
    ({}, ""),
    ({"waiting": None}, ""),
    ({"waiting": {"reason": names.WAIT_DATA, "seconds": 42.7}}, "trainer waiting for experiences for 42s"),
    ({"waiting": {"reason": names.WAIT_DATA, "since": "not a time", "seconds": 3}},
     "trainer waiting for experiences for 3s"),
    ({"waiting": {"reason": names.WAIT_STALE, "since": "2026-11-30T11:30:00Z"}, "buffer": {"droppedStale": 0}},
     "trainer waiting for fresh experiences for 1800s"),
    ({"waiting": {"reason": "Other", "message": "why"}}, "trainer waiting (Other): why"),
])
def test_describe_trainer_wait(trainer, want):
    assert progress_deadline.describe_trainer_wait(trainer, NOW) == want


def test_what_an_earlier_attempt_reported_is_not_in_the_message():
    sim = Sim(status=status(names.PENDING, attempt=2, restarts=1))
    sim.report(step=7, attempt=1, waiting={"reason": names.WAIT_DATA, "since": "2026-11-30T11:00:00Z"},
               buffer={"droppedStale": 3})
    sim.running(0)
    sim.at(DEADLINE + 1)
    assert sim.status["lastFailure"]["message"] == (
        "attempt 2 reported no step in 601s (spec.failurePolicy.progressDeadlineSeconds=600)")


def test_a_trainer_still_preparing_gets_the_model_download_timeout_on_top():
    """Loading a large model (bounded by model.cache.downloadTimeoutSeconds, 3600 by
    default) is not a stall; once the trainer reports a step the plain deadline applies."""
    sim = Sim()
    sim.running(0)
    sim.report(waiting={"reason": names.WAIT_PREPARING, "message": "loading the model", "attempt": 1})
    plan = sim.at(DEADLINE + 1)
    assert sim.status["phase"] == names.RUNNING and not fired(sim.plans)
    assert plan.requeue_after == DEADLINE + 3600 - (DEADLINE + 1)
    sim.at(DEADLINE + 3600 + 1)
    assert sim.status["phase"] == names.RESTARTING and len(fired(sim.plans)) == 1


def test_preparing_reported_by_this_attempt_counts_although_the_step_is_an_earlier_attempts():
    sim = Sim()
    sim.running(0)
    sim.report(step=7, attempt=1)
    sim.at(1)
    sim.at(DEADLINE + 2)  # attempt 1 stalled at step 7
    sim.at(DEADLINE + 40)  # backoff over: attempt 2
    sim.run_gang()
    sim.at(DEADLINE + 41)
    assert (sim.status["phase"], sim.status["attempt"]) == (names.RUNNING, 2)
    sim.report(waiting={"reason": names.WAIT_PREPARING, "message": "resuming", "attempt": 2})
    sim.at(2 * DEADLINE + 50)
    assert sim.status["phase"] == names.RUNNING and sim.status["restarts"] == 1
    sim.at(DEADLINE + 41 + DEADLINE + 3600 + 1)
    assert sim.status["restarts"] == 2


def test_no_deadline_after_the_last_step():
    """The final export and blocking save follow the last step; they may take long."""
    sim = Sim()
    sim.running(0)
    sim.report(step=100, attempt=1)  # totalSteps
    plan = sim.at(DEADLINE * 5)
    assert sim.status["phase"] == names.RUNNING and not fired(sim.plans) and plan.requeue_after is None


def test_progress_says_where_this_attempt_resumed_from():
    ckpt = "s3://b/ckpt/step-00000005"
    sim = Sim()
    sim.running(0)
    assert "resumedFrom" not in sim.status["progress"]  # nothing reported yet
    sim.report(attempt=1, resumedFrom={"attempt": 1, "step": 0, "checkpoint": None})
    sim.at(1)
    assert sim.status["progress"]["resumedFrom"] == {"step": 0}  # a fresh start
    sim.report(attempt=1, step=3)
    sim.at(2)  # the step moved, the record restarts: where it began stays
    assert sim.status["progress"]["resumedFrom"] == {"step": 0} and sim.status["progress"]["step"] == 3
    # The next attempt: nothing until its own trainer reports, then its own start.
    sim = Sim(status=status(names.PENDING, attempt=2, restarts=1, progress=sim.status["progress"],
                            trainer=sim.status["trainer"]))
    sim.running(3)
    assert "resumedFrom" not in sim.status["progress"], sim.status["progress"]
    sim.report(attempt=2, resumedFrom={"attempt": 2, "step": 5, "checkpoint": ckpt})
    sim.at(4)
    assert sim.status["progress"]["resumedFrom"] == {"step": 5, "checkpoint": ckpt}


@pytest.mark.parametrize("ago, deadline, left", [
    (0, 600, 600), (599.5, 600, 0.5), (600, 600, 0),  # exactly the deadline: not past it yet
    (601, 600, -1),                                     # past it: negative
    (10**6, 0, None),                                   # 0 turns it off
    (None, 600, None),                                  # no clock running
])
def test_progress_deadline_remaining(ago, deadline, left):
    since = None if ago is None else NOW - timedelta(seconds=ago)
    assert progress_deadline.progress_deadline_remaining(since, deadline, NOW) == left
