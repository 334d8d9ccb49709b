from datetime import timedelta

import pytest

from rft_operator import policy
from rft_contract.spec import FailurePolicy
from rft_operator.policy import Cond

from .conftest import NOW


@pytest.mark.parametrize(
    "code, fatal, retryable, expected",
    [
        (None, [78], None, policy.RETRYABLE),   # evicted / node lost: no exit code
        (1, [78], None, policy.RETRYABLE),
        (137, [78], None, policy.RETRYABLE),    # SIGKILL (OOM, preemption)
        (78, [78], None, policy.FATAL),         # EX_CONFIG: the default fatal code
        (3, [3, 4], None, policy.FATAL),
        (1, [], [137, 143], policy.FATAL),      # allow-list: anything else is fatal
        (143, [], [137, 143], policy.RETRYABLE),
        (78, [78], [78, 1], policy.FATAL),      # fatal wins
        (None, [], [137], policy.RETRYABLE),    # no code is never fatal
    ],
)
def test_classify_exit_code(code, fatal, retryable, expected):
    fp = FailurePolicy(fatal_exit_codes=fatal, retryable_exit_codes=retryable)
    assert policy.classify_exit_code(code, fp) == expected


@pytest.mark.parametrize("restarts, max_restarts, expected", [(0, 0, False), (0, 3, True), (2, 3, True), (3, 3, False)])
def test_should_restart(restarts, max_restarts, expected):
    assert policy.should_restart(restarts, FailurePolicy(max_restarts=max_restarts)) is expected


@pytest.mark.parametrize("ago, backoff, left", [(0, 30, 30), (10, 30, 20), (30, 30, 0), (99, 30, 0), (None, 30, 0)])
def test_backoff_remaining(ago, backoff, left):
    failed_at = None if ago is None else NOW - timedelta(seconds=ago)
    assert policy.backoff_remaining(failed_at, backoff, NOW) == left


@pytest.mark.parametrize("ago, deadline, left", [
    (0, 600, 600), (599.5, 600, 0.5), (600, 600, 0),  # exactly the deadline: not past it yet
    (601, 600, -1),                                     # past it: negative
    (10**6, 0, None),                                   # 0 turns it off
    (None, 600, None),                                  # no clock running
])
def test_progress_deadline_remaining(ago, deadline, left):
    since = None if ago is None else NOW - timedelta(seconds=ago)
    assert policy.progress_deadline_remaining(since, deadline, NOW) == left


def test_time_roundtrip():
    assert policy.parse_time(policy.format_time(NOW)) == NOW
    assert policy.parse_time(None) is None


def test_conditions_transition_time_moves_only_on_flip():
    first = policy.compute_conditions(None, [Cond("Running", False, "Pending", "wait")], 1, NOW)
    later = NOW + timedelta(minutes=5)
    same = policy.compute_conditions(first, [Cond("Running", False, "Pending", "still")], 2, later)
    flipped = policy.compute_conditions(same, [Cond("Running", True, "AllPodsRunning")], 2, later)
    assert same[0]["lastTransitionTime"] == first[0]["lastTransitionTime"]
    assert same[0]["message"] == "still" and same[0]["observedGeneration"] == 2
    assert flipped[0]["lastTransitionTime"] == policy.format_time(later)
    assert flipped[0]["status"] == "True"


def test_conditions_keep_foreign_types():
    old = [{"type": "Checkpointed", "status": "True", "reason": "Saved", "message": "", "lastTransitionTime": "x"}]
    out = policy.compute_conditions(old, [Cond("Running", True, "AllPodsRunning")], 1, NOW)
    assert {c["type"] for c in out} == {"Checkpointed", "Running"}
