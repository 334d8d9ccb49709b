from datetime import timedelta

import pytest

from rft_operator import policy
from rft_contract import times
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
    assert times.parse_time(times.format_time(NOW)) == NOW
    assert times.parse_time(None) is None and times.parse_time("not a time") is None
    assert times.parse_time("2026-11-30T12:00:00.250+01:00") == NOW.replace(hour=11, microsecond=250000)


def test_conditions_transition_time_moves_only_on_flip():
    first = policy.compute_conditions(None, [Cond("Running", False, "Pending", "wait")], 1, NOW)
    later = NOW + timedelta(minutes=5)
    same = policy.compute_conditions(first, [Cond("Running", False, "Pending", "still")], 2, later)
    flipped = policy.compute_conditions(same, [Cond("Running", True, "AllPodsRunning")], 2, later)
    assert same[0]["lastTransitionTime"] == first[0]["lastTransitionTime"]
    assert same[0]["message"] == "still" and same[0]["observedGeneration"] == 2
    assert flipped[0]["lastTransitionTime"] == times.format_time(later)
    assert flipped[0]["status"] == "True"


def test_conditions_keep_foreign_types():
    old = [{"type": "Checkpointed", "status": "True", "reason": "Saved", "message": "", "lastTransitionTime": "x"}]
    out = policy.compute_conditions(old, [Cond("Running", True, "AllPodsRunning")], 1, NOW)
    assert {c["type"] for c in out} == {"Checkpointed", "Running"}


@pytest.mark.parametrize("node, want", [
    (None, policy.NODE_GONE),  # 404
    ({"spec": {"taints": [{"key": "node.kubernetes.io/out-of-service", "value": "nodeshutdown",
                           "effect": "NoExecute"}]}}, policy.NODE_OUT_OF_SERVICE),
    ({"spec": {"taints": [{"key": "node.kubernetes.io/unreachable", "effect": "NoExecute"}]},
      "status": {"conditions": [{"type": "Ready", "status": "Unknown"}]}}, policy.NODE_UP),  # partitioned
    ({"spec": {}}, policy.NODE_UP),
])
def test_classify_node(node, want):
    assert policy.classify_node(node) == want


@pytest.mark.parametrize("node_name, state, want", [
    ("n", policy.NODE_GONE, True), ("n", policy.NODE_OUT_OF_SERVICE, True), ("n", policy.NODE_UP, False),
    ("n", policy.NODE_UNREADABLE, False), ("n", None, False), ("", None, True),
])
def test_may_force_delete(node_name, state, want):
    assert policy.may_force_delete(node_name, {"n": state} if state else {}) is want


@pytest.mark.parametrize("rendered, live, want", [
    # Our namespace: a key we no longer render goes; anyone else's stays.
    ({"rft.dev/job": "j"}, {"rft.dev/job": "j", "rft.dev/old": "x", "example.com/x": "y"},
     {"rft.dev/job": "j", "rft.dev/old": None}),
    # Listed by the previous render (`rft.dev/managed-keys`): goes once not rendered.
    ({"rft.dev/spec-hash": "h"},
     {"rft.dev/spec-hash": "g", "a.io/k": "1", "b.io/k": "2", "rft.dev/managed-keys": '{"annotations":["a.io/k"]}'},
     {"rft.dev/spec-hash": "h", "a.io/k": None, "rft.dev/managed-keys": None}),
    ({"rft.dev/spec-hash": "h"}, {}, {"rft.dev/spec-hash": "h"}),
])
def test_compute_patch_removes_only_keys_we_rendered(rendered, live, want):
    obj = {"kind": "ServiceAccount", "metadata": {"name": "sa", "annotations": rendered}}
    patch = policy.compute_patch(obj, {"metadata": {"annotations": live}})
    assert patch["metadata"]["annotations"] == want and obj["metadata"]["annotations"] == rendered  # not mutated


def test_build_managed_keys_lists_keys_outside_our_namespaces():
    assert policy.build_managed_keys({"labels": {"rft.dev/job": "j", "app.kubernetes.io/managed-by": "x"},
                                      "annotations": {"rft.dev/spec-hash": "h"}}) == ""
    assert policy.build_managed_keys({"annotations": {"b.io/k": "1", "a.io/k": "2", "rft.dev/spec-hash": "h"}}) == (
        '{"annotations":["a.io/k","b.io/k"]}')
