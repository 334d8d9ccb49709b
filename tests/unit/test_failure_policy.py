"""The failure policy across the gang, from pods shaped as the API server reports them
(`PodView.from_pod`): fatalExitCodes win on any rank, otherwise the rank that ended first
(a deleted one: when its delete was requested) is the root cause; the cluster's
disruptions restart without using the budget, the kubelet's node-pressure evictions use
it. The pod helpers here serve test_terminating.py and test_logtail.py too."""

from datetime import timedelta

import pytest

from rft_contract import names
from rft_contract.spec import FailurePolicy, parse_spec
from rft_operator import failure_policy, logtail
from rft_operator.model import PodView
from rft_operator.reconcile import Observed, reconcile

from .testing import NOW, REF, SPEC, failed, gang_for, make_job, pod, pod_dict, status, views


# ------------------------------------------------------------------ fatal vs retryable, root cause

# id, pods, expected: phase, Failed/event reason, lastFailure.pod, restarts, disruptions
CASES = [
    ("fatal-on-rank-1-after-oom-on-rank-0", [failed(0, 137, -60, terminated_reason="OOMKilled"), failed(1, 78, -30)],
     (names.FAILED, names.REASON_FATAL_EXIT, "demo-trainer-1-1", 0, 0)),
    ("fatal-on-rank-0-after-oom-on-rank-1", [failed(0, 78, -30), failed(1, 137, -60, terminated_reason="OOMKilled")],
     (names.FAILED, names.REASON_FATAL_EXIT, "demo-trainer-1-0", 0, 0)),
    ("fatal-on-rank-1-beside-exit-1-on-rank-0", [failed(0, 1, -60), failed(1, 78, -30)],
     (names.FAILED, names.REASON_FATAL_EXIT, "demo-trainer-1-1", 0, 0)),
    ("fatal-on-rank-0-beside-exit-1-on-rank-1", [failed(0, 78, -30), failed(1, 1, -60)],
     (names.FAILED, names.REASON_FATAL_EXIT, "demo-trainer-1-0", 0, 0)),
    ("earliest-finish-decides-rank-1-first", [failed(0, 1, -30), failed(1, 137, -60)],
     (names.RESTARTING, names.REASON_RESTARTING, "demo-trainer-1-1", 1, 0)),
    ("earliest-finish-decides-rank-0-first", [failed(0, 137, -60), failed(1, 1, -30)],
     (names.RESTARTING, names.REASON_RESTARTING, "demo-trainer-1-0", 1, 0)),
    ("same-finish-lowest-rank", [failed(0, 1, -30), failed(1, 137, -30)],
     (names.RESTARTING, names.REASON_RESTARTING, "demo-trainer-1-0", 1, 0)),
    ("a-finish-time-beats-none", [pod_dict(1, 0, "Unknown"), failed(1, 1, -30)],
     (names.RESTARTING, names.REASON_RESTARTING, "demo-trainer-1-1", 1, 0)),
    # Disruptions: the cluster stopped the pod; the budget is not used.
    ("evicted-rank-restarts-without-budget",
     [pod_dict(1, 0, disrupted="EvictionByEvictionAPI", deleted_at=-1), pod_dict(1, 1)],
     (names.RESTARTING, names.REASON_POD_DISRUPTED, "demo-trainer-1-0", 0, 1)),
    ("preempted-rank-exited-143",
     [pod_dict(1, 0), failed(1, 143, -100, disrupted="PreemptionByScheduler", deleted_at=-110)],
     (names.RESTARTING, names.REASON_POD_DISRUPTED, "demo-trainer-1-1", 0, 1)),
    ("pod-gc", [pod_dict(1, 0, "Failed", disrupted="DeletionByPodGC", deleted_at=-100), pod_dict(1, 1)],
     (names.RESTARTING, names.REASON_POD_DISRUPTED, "demo-trainer-1-0", 0, 1)),
    # The kubelet's node-pressure eviction is often the job's own memory: it uses the budget.
    ("node-pressure-eviction-by-kubelet", [failed(0, 137, -100, disrupted="TerminationByKubelet"), pod_dict(1, 1)],
     (names.RESTARTING, names.REASON_RESTARTING, "demo-trainer-1-0", 1, 0)),
    ("disrupted-first-then-peer-crashed: a disruption",
     [pod_dict(1, 0, disrupted="DeletionByTaintManager", disrupted_at=-120, deleted_at=-120), failed(1, 1, -100)],
     (names.RESTARTING, names.REASON_POD_DISRUPTED, "demo-trainer-1-0", 0, 1)),
    ("crashed-first-then-peer-disrupted: a restart",
     [pod_dict(1, 0, disrupted="EvictionByEvictionAPI", disrupted_at=-50, deleted_at=-50), failed(1, 1, -100)],
     (names.RESTARTING, names.REASON_RESTARTING, "demo-trainer-1-1", 1, 0)),
    ("disrupted-first-but-fatal-peer-fails",
     [pod_dict(1, 0, disrupted="EvictionByEvictionAPI", disrupted_at=-120, deleted_at=-120), failed(1, 78, -100)],
     (names.FAILED, names.REASON_FATAL_EXIT, "demo-trainer-1-1", 0, 0)),
    ("deleted-by-hand-is-no-disruption", [pod_dict(1, 0, deleted_at=-1), pod_dict(1, 1)],
     (names.RESTARTING, names.REASON_RESTARTING, "demo-trainer-1-0", 1, 0)),
    # A deleted pod ended when its delete was requested, not at some later or unknown time:
    # the peer's NCCL abort 5 s later is its consequence, even outside retryableExitCodes.
    ("deleted-rank-0-then-rank-1-aborted",
     [pod_dict(1, 0, deleted_at=-5), failed(1, 134, 0)],
     (names.RESTARTING, names.REASON_RESTARTING, "demo-trainer-1-0", 1, 0)),
    ("deleted-rank-0-exited-143-then-rank-1-aborted",
     [failed(0, 143, -4, deleted_at=-5), failed(1, 134, 0)],
     (names.RESTARTING, names.REASON_RESTARTING, "demo-trainer-1-0", 1, 0)),
    ("rank-1-aborted-first-outside-the-allow-list-fails",
     [pod_dict(1, 0, deleted_at=-5), failed(1, 134, -10)],
     (names.FAILED, names.REASON_FATAL_EXIT, "demo-trainer-1-1", 0, 0)),
]
ALLOW_137 = {"deleted-rank-0-then-rank-1-aborted", "deleted-rank-0-exited-143-then-rank-1-aborted",
             "rank-1-aborted-first-outside-the-allow-list-fails"}


@pytest.mark.parametrize("case, pods, want", CASES, ids=[x[0] for x in CASES])
def test_root_cause_across_the_gang(case, pods, want):
    g = gang_for(pods, **({"retryableExitCodes": [137]} if case in ALLOW_137 else {}))
    failure = g.status["lastFailure"]
    got = (g.phase, g.events[-1].reason, failure["pod"], g.status["restarts"], g.status["disruptions"])
    assert got == want
    assert g.events[-1].type == "Warning"
    assert failure["pod"] in g.status["message"]
    if want[1] == names.REASON_POD_DISRUPTED:
        assert failure["reason"] == names.REASON_POD_DISRUPTED and "maxRestarts" in g.status["message"]


# DisruptionTarget reason (and the pod's status.reason) -> whether the restart is free.
@pytest.mark.parametrize("reason, status_reason, free", [
    ("EvictionByEvictionAPI", None, True),  # kubectl drain, descheduler
    ("PreemptionByScheduler", None, True),
    ("DeletionByTaintManager", None, True),  # node not ready / unreachable, NoExecute
    ("DeletionByPodGC", None, True),  # node gone
    ("TerminationByKubelet", "Evicted", False),  # node pressure: often the job's own memory
    ("TerminationByKubelet", None, False),
    ("TerminationByKubelet", "Terminated", True),  # graceful node shutdown
])
def test_which_disruptions_use_the_budget(reason, status_reason, free):
    pod = failed(0, 137, -100, disrupted=reason)
    pod["status"]["reason"] = status_reason
    g = gang_for([pod, pod_dict(1, 1)], old=status(names.RUNNING))
    assert (g.status["restarts"], g.status["disruptions"]) == ((0, 1) if free else (1, 0))
    assert g.status["lastFailure"]["reason"] == names.REASON_POD_DISRUPTED  # recorded with its reason either way
    assert reason in g.status["lastFailure"]["message"]
    assert failure_policy.classify_failure(137, reason, parse_spec(SPEC).failure_policy, status_reason) == (
        failure_policy.DISRUPTED if free else failure_policy.RETRYABLE)


def test_node_pressure_eviction_says_what_ran_out_and_fails_once_the_budget_is_spent():
    pods = [failed(0, 137, -100, disrupted="TerminationByKubelet"), pod_dict(1, 1)]
    g = gang_for(pods)
    assert "evicted by the kubelet for node pressure" in g.status["message"]
    assert "low on resource: memory" in g.status["lastFailure"]["message"]
    g = gang_for(pods, old=status(names.RUNNING, restarts=2))  # maxRestarts 2
    assert (g.phase, g.failed_reason) == (names.FAILED, names.REASON_BACKOFF_LIMIT)
    # Its exit code is the kill's: not judged, even outside an allow-list.
    assert gang_for(pods, retryableExitCodes=[1]).phase == names.RESTARTING


def test_message_counts_the_other_ranks_that_ended():
    g = gang_for([failed(0, 1, -60), failed(1, 137, -30), pod_dict(1, 2, "Unknown"), pod_dict(1, 3)],
                 old=status(names.RUNNING))
    assert g.status["lastFailure"]["pod"] == "demo-trainer-1-0"
    assert "(2 other ranks also ended)" in g.status["lastFailure"]["message"]


def test_disruption_restarts_even_with_the_budget_spent():
    pods = [pod_dict(1, 0, disrupted="EvictionByEvictionAPI", deleted_at=-1), pod_dict(1, 1)]
    g = gang_for(pods, old=status(names.RUNNING, restarts=2, disruptions=4))  # maxRestarts 2
    assert (g.phase, g.status["restarts"], g.status["disruptions"]) == (names.RESTARTING, 2, 5)
    assert g.delete == ("demo-trainer-1-1",) and g.requeue_after == 30.0
    # The same crash with the budget spent fails the job.
    g = gang_for([failed(0, 1, -60), pod_dict(1, 1)], old=status(names.RUNNING, restarts=2))
    assert (g.phase, g.failed_reason) == (names.FAILED, names.REASON_BACKOFF_LIMIT)


def test_disruptions_reach_the_status_through_reconcile():
    pods = views(pod_dict(1, 0, disrupted="EvictionByEvictionAPI", deleted_at=-1), pod_dict(1, 1))
    plan = reconcile(make_job(status=status(names.RUNNING)), Observed(pods=pods), NOW)
    assert (plan.status["restarts"], plan.status["disruptions"]) == (0, 1)
    assert plan.status["lastFailure"]["reason"] == names.REASON_POD_DISRUPTED
    assert [(e.type, e.reason) for e in plan.events] == [("Warning", names.REASON_POD_DISRUPTED)]


# ------------------------------------------------------------------ parsing


def test_pod_view_reads_what_the_policy_needs():
    v = PodView.from_pod(failed(1, 143, -100, disrupted="PreemptionByScheduler", disrupted_at=-110,
                                deleted_at=-110, grace=30))
    assert (v.exit_code, v.disruption, v.deleting, v.force_deleted) == (143, "PreemptionByScheduler", True, False)
    assert v.finished_at == NOW - timedelta(seconds=100)
    assert v.ended_at == v.disrupted_at == NOW - timedelta(seconds=110)
    assert v.deletion_deadline == NOW - timedelta(seconds=80)  # request time + grace period
    assert v.owner_uid == REF.uid
    plain = PodView.from_pod(pod_dict(1, 0))
    assert (plain.disruption, plain.finished_at, plain.deletion_deadline, plain.ended_at) == (None, None, None, None)
    false_condition = pod_dict(1, 0)
    false_condition["status"]["conditions"].append({"type": "DisruptionTarget", "status": "False"})
    assert PodView.from_pod(false_condition).disruption is None


# ------------------------------------------------------------------ what the failed program said

TRACEBACK = "\n".join([f"[rank1] INFO step {i}" for i in range(60)] + [
    "Traceback (most recent call last):", '  File "checkpoint.py", line 3, in save',
    "botocore.exceptions.ClientError: An error occurred (SlowDown) when calling the UploadPart operation", ""])


def test_a_failed_pods_last_log_lines_are_in_last_failure_and_its_last_line_in_the_message():
    g = gang_for([pod_dict(1, 0), failed(1, 1, -30, said=TRACEBACK)])
    failure = g.status["lastFailure"]
    assert failure["message"].startswith("pod demo-trainer-1-1 failed with exit code 1: botocore.exceptions.ClientError")
    assert failure["log"].endswith("when calling the UploadPart operation")
    assert "Traceback (most recent call last):" in failure["log"]
    assert len(failure["log"]) <= logtail.LOG_TAIL_CHARS
    assert failure["log"].startswith("[rank1] INFO step")  # whole lines only
    assert "failed with exit code 1: botocore" in g.status["message"]


def test_a_deleted_pods_log_is_not_its_failure():
    g = gang_for([pod_dict(1, 0), failed(1, 143, -30, deleted_at=-40, said="terminated\n")])
    assert "log" not in g.status["lastFailure"]
    assert g.status["lastFailure"]["message"] == "pod demo-trainer-1-1 was deleted"


def test_an_oom_killed_pod_says_so_and_quotes_no_unrelated_line():
    g = gang_for([pod_dict(1, 0), failed(1, 137, -30, terminated_reason="OOMKilled", said="[rank1] INFO step 12\n")])
    failure = g.status["lastFailure"]
    assert failure["message"] == "pod demo-trainer-1-1 failed with exit code 137 (OOMKilled)"
    assert failure["log"] == "[rank1] INFO step 12"


# ------------------------------------------------------------------ compute_failure on its own


@pytest.mark.parametrize("old, gang_pods, want", [  # the gang-wide rules: above
    (status(names.RUNNING), {0: pod(1, 0), 1: pod(1, 1)}, None),
    (status(names.PENDING), {0: pod(1, 0)}, None),  # never ran: the missing pod is just created
    (status(names.RUNNING), {0: pod(1, 0)}, ("demo-trainer-1-1", None, names.REASON_POD_DELETED, "disappeared")),
    (status(names.RUNNING, 2), {0: pod(1, 0)}, None),  # the running gang was another attempt
    (status(names.RUNNING), {0: pod(1, 0, "Unknown"), 1: pod(1, 1, "Failed", 1)}, ("demo-trainer-1-0", None, names.REASON_POD_DELETED, "lost its node")),
    (status(names.RUNNING), {0: pod(1, 0), 1: pod(1, 1, "Failed", 137)}, ("demo-trainer-1-1", 137, names.REASON_POD_FAILED, "exit code 137")),
    (status(names.RUNNING), {1: pod(1, 1, "Failed")}, ("demo-trainer-1-1", None, names.REASON_POD_FAILED, "(no exit code)")),
])
def test_compute_failure(old, gang_pods, want):
    got = failure_policy.compute_failure("demo", old, 1, gang_pods, 2, parse_spec(SPEC).failure_policy)
    if want is None:
        assert got is None
    else:
        assert (got.pod, got.exit_code, got.reason) == want[:3] and want[3] in got.message


# ------------------------------------------------------------------ the tables


@pytest.mark.parametrize(
    "code, fatal, retryable, expected",
    [
        (None, [78], None, failure_policy.RETRYABLE),   # evicted / node lost: no exit code
        (1, [78], None, failure_policy.RETRYABLE),
        (137, [78], None, failure_policy.RETRYABLE),    # SIGKILL (OOM, preemption)
        (78, [78], None, failure_policy.FATAL),         # EX_CONFIG: the default fatal code
        (3, [3, 4], None, failure_policy.FATAL),
        (1, [], [137, 143], failure_policy.FATAL),      # allow-list: anything else is fatal
        (143, [], [137, 143], failure_policy.RETRYABLE),
        (78, [78], [78, 1], failure_policy.FATAL),      # fatal wins
        (None, [], [137], failure_policy.RETRYABLE),    # no code is never fatal
    ],
)
def test_classify_exit_code(code, fatal, retryable, expected):
    fp = FailurePolicy(fatal_exit_codes=fatal, retryable_exit_codes=retryable)
    assert failure_policy.classify_exit_code(code, fp) == expected


@pytest.mark.parametrize("restarts, max_restarts, expected", [(0, 0, False), (0, 3, True), (2, 3, True), (3, 3, False)])
def test_should_restart(restarts, max_restarts, expected):
    assert failure_policy.should_restart(restarts, FailurePolicy(max_restarts=max_restarts)) is expected


@pytest.mark.parametrize("ago, backoff, left", [(0, 30, 30), (10, 30, 20), (30, 30, 0), (99, 30, 0), (None, 30, 0)])
def test_backoff_remaining(ago, backoff, left):
    failed_at = None if ago is None else NOW - timedelta(seconds=ago)
    assert failure_policy.backoff_remaining(failed_at, backoff, NOW) == left
