"""Old pods stuck terminating (`terminating`): force-deleted once their grace period is well
over, and only when their node is gone or out of service; otherwise the gang waits and says
what an admin can do."""

import pytest

from rft_contract import names
from rft_operator import terminating
from rft_operator.reconcile import Observed, reconcile

from .testing import NODE, NOW, failed, gang_for, last_failure, make_job, pod_dict, status, views


# ------------------------------------------------------------------ stuck terminating

RESTARTING = status(names.RESTARTING, restarts=1, lastFailure=last_failure(-600))
MARGIN = terminating.FORCE_DELETE_MARGIN_SECONDS


GONE = {NODE: terminating.NODE_GONE}


@pytest.mark.parametrize("deleted_at, grace, want_force, want_requeue", [
    (-30 - MARGIN + 1, 30, False, 1.0),          # grace over, margin not yet: come back then
    (-10, 30, False, 20 + MARGIN),               # still within its grace period
    (-30 - MARGIN, 30, True, None),               # grace + margin over: force
    (-300 - MARGIN - 5, 300, True, None),         # a longer grace period counts too
], ids=["margin-not-over", "within-grace", "due", "due-long-grace"])
def test_old_pod_stuck_terminating_is_force_deleted_after_the_bound(deleted_at, grace, want_force, want_requeue):
    g = gang_for([pod_dict(1, 0, deleted_at=deleted_at, grace=grace), failed(1, 1, -600)], old=RESTARTING, nodes=GONE)
    assert g.phase == names.RESTARTING  # the next attempt waits until the pod is gone
    assert g.force_delete == (("demo-trainer-1-0",) if want_force else ())
    warnings = [e for e in g.events if e.reason == names.REASON_STUCK_TERMINATING]
    if want_force:
        assert len(warnings) == 1 and warnings[0].type == "Warning" and "demo-trainer-1-0" in warnings[0].message
    else:
        assert warnings == [] and g.requeue_after == pytest.approx(want_requeue)


STUCK = -30 - MARGIN - 1  # deleted this long ago, grace period 30 s: past the bound


# What the controller read of the node -> force-deleted? (Kubernetes' own rule: only once
# nothing can run the pod any more.)
@pytest.mark.parametrize("nodes, node, want_force", [
    ({NODE: terminating.NODE_GONE}, NODE, True),            # Node object deleted (404)
    ({NODE: terminating.NODE_OUT_OF_SERVICE}, NODE, True),  # tainted node.kubernetes.io/out-of-service
    ({NODE: terminating.NODE_UP}, NODE, False),              # there, NotReady: maybe partitioned, still running
    ({NODE: terminating.NODE_UNREADABLE}, NODE, False),      # 403: the operator may not read nodes
    ({}, NODE, False),                                  # not read at all: unknown
    ({}, "", True),                                     # never scheduled: nothing runs it
], ids=["node-gone", "out-of-service", "node-present", "node-unreadable", "unknown", "unscheduled"])
def test_force_delete_only_when_the_node_runs_nothing(nodes, node, want_force):
    g = gang_for([pod_dict(1, 0, deleted_at=STUCK, node=node), failed(1, 1, -600)], old=RESTARTING, nodes=nodes)
    assert g.phase == names.RESTARTING
    assert g.force_delete == (("demo-trainer-1-0",) if want_force else ())
    assert [(e.type, e.reason) for e in g.events] == [("Warning", names.REASON_STUCK_TERMINATING)]
    message = g.events[0].message
    if want_force:
        assert "force-deleting" in message and g.status.get("message") == RESTARTING.get("message")
        return
    # Kept waiting: the status message says why and what an admin can do; so does the event.
    assert g.status["message"] == message and g.stuck == message
    assert f"waiting for pod demo-trainer-1-0 (node {NODE}" in message
    for remedy in (f"kubectl delete node {NODE}",
                   f"kubectl taint node {NODE} node.kubernetes.io/out-of-service=nodeshutdown:NoExecute",
                   "kubectl delete pod -n team-a demo-trainer-1-0 --force --grace-period=0"):
        assert remedy in message
    if nodes.get(NODE) == terminating.NODE_UNREADABLE:
        assert "the operator may not read it" in message
    # The next pass, with the message stored: still waiting, no second event, no write.
    again = gang_for([pod_dict(1, 0, deleted_at=STUCK - 600), failed(1, 1, -600)],
                     old={**RESTARTING, "message": message}, nodes=nodes)
    assert (again.phase, again.force_delete, again.events, again.status["message"]) == (
        names.RESTARTING, (), (), message)


def test_a_stuck_pod_goes_on_by_itself_once_gone():
    waiting = gang_for([pod_dict(1, 0, deleted_at=STUCK), failed(1, 1, -600)], old=RESTARTING,
                       nodes={NODE: terminating.NODE_UP})
    g = gang_for([failed(1, 1, -600)], old={**RESTARTING, "message": waiting.status["message"]})
    assert (g.phase, g.attempt, [e.reason for e in g.events]) == (names.PENDING, 2, [names.REASON_RESTARTED])


def test_stuck_nodes_are_only_those_of_pods_past_the_bound():
    pods = views(pod_dict(1, 0, deleted_at=STUCK, node="a"), pod_dict(1, 1, deleted_at=-10, node="b"),
                 pod_dict(1, 2, node="c"), pod_dict(1, 3, deleted_at=STUCK, node=""))
    assert terminating.stuck_nodes(pods, NOW) == {"a"}


def test_a_force_deleted_pod_is_not_forced_again():
    stuck = pod_dict(1, 0, deleted_at=-30 - MARGIN - 100)
    stuck["metadata"]["deletionGracePeriodSeconds"] = 0  # what the force delete leaves (e.g. a finalizer holds it)
    g = gang_for([stuck], old=RESTARTING, nodes=GONE)
    assert (g.phase, g.force_delete, g.events) == (names.RESTARTING, (), ())


def test_stale_attempt_stuck_terminating_blocks_the_new_gang_until_forced():
    old = status(names.PENDING, attempt=2, restarts=1)
    g = gang_for([pod_dict(1, 0, deleted_at=STUCK)], old=old, nodes=GONE)
    assert g.force_delete == ("demo-trainer-1-0",) and g.create == ()
    observed = Observed(pods=views(pod_dict(1, 0, deleted_at=STUCK)), nodes=GONE)
    plan = reconcile(make_job(status=old), observed, NOW)
    assert plan.force_delete_pods == ["demo-trainer-1-0"] and plan.delete_pods == []
    assert [e.reason for e in plan.events] == [names.REASON_STUCK_TERMINATING]
    # A node that may still run it: the new gang waits, and the Pending message says why.
    plan = reconcile(make_job(status=old), Observed(pods=observed.pods, nodes={NODE: terminating.NODE_UP}), NOW)
    assert plan.force_delete_pods == [] and not [x for x in plan.create if x["kind"] == "Pod"]
    assert plan.status["phase"] == names.PENDING and plan.status["message"].startswith("waiting for pod demo-trainer-1-0")
    assert [e.reason for e in plan.events] == [names.REASON_STUCK_TERMINATING]


# ------------------------------------------------------------------ the rules on their own


@pytest.mark.parametrize("node, want", [
    (None, terminating.NODE_GONE),  # 404
    ({"spec": {"taints": [{"key": "node.kubernetes.io/out-of-service", "value": "nodeshutdown",
                           "effect": "NoExecute"}]}}, terminating.NODE_OUT_OF_SERVICE),
    ({"spec": {"taints": [{"key": "node.kubernetes.io/unreachable", "effect": "NoExecute"}]},
      "status": {"conditions": [{"type": "Ready", "status": "Unknown"}]}}, terminating.NODE_UP),  # partitioned
    ({"spec": {}}, terminating.NODE_UP),
])
def test_classify_node(node, want):
    assert terminating.classify_node(node) == want


@pytest.mark.parametrize("node_name, state, want", [
    ("n", terminating.NODE_GONE, True), ("n", terminating.NODE_OUT_OF_SERVICE, True), ("n", terminating.NODE_UP, False),
    ("n", terminating.NODE_UNREADABLE, False), ("n", None, False), ("", None, True),
])
def test_may_force_delete(node_name, state, want):
    assert terminating.may_force_delete(node_name, {"n": state} if state else {}) is want
