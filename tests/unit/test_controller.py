"""The controller between the pure reconcile and the API: ownership on 409 (never adopt),
a 422 turned into InvalidSpec, errors described with the server's message, drift, force
deletions (fenced by the pod's Node) and leftover children applied. A fake API server
stands in for `Kube`."""

import asyncio
import copy
import json
import threading

from datetime import timedelta

import pytest
from kubernetes.client.rest import ApiException

from rft_contract import names
from rft_operator.controller import Controller, describe_error
from rft_operator.model import ChildView
from rft_operator.objects import JobRef, owner_reference

from .testing import NODE, NOW, UID, condition, last_failure, make_job, pod, status, views

KEY = ("team-a", "demo")


def api_error(status: int, message: str, reason: str = "") -> ApiException:
    e = ApiException(status=status, reason=reason or {409: "Conflict", 422: "Unprocessable Entity"}.get(status, "Err"))
    e.body = json.dumps({"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message,
                         "reason": "Invalid", "code": status}).encode()
    return e


class FakeKube:
    """Records writes; `existing` objects answer a create with 409, `refuse` with an error."""

    def __init__(self, job: dict):
        self.job, self.requests, self.seconds = job, 0, 0.0
        self.existing: dict[tuple[str, str], dict] = {}
        self.refuse: dict[tuple[str, str], ApiException] = {}
        self.calls: list[tuple] = []
        self.events: list[tuple[str, str, str]] = []
        self.nodes: dict[str, dict] = {}  # a node missing here answers 404
        self.node_errors: dict[str, ApiException] = {}

    def patch_status(self, ns, name, status, rv):
        # What the watch then delivers: the job with the new status and resourceVersion.
        self.job["status"] = {**self.job.get("status", {}), **copy.deepcopy(status)}
        self.job["metadata"]["resourceVersion"] = str(int(rv) + 1)
        return self.job["metadata"]["resourceVersion"]

    def post_event(self, body, type_, reason, message):
        self.events.append((type_, reason, message))

    def create(self, obj):
        key = (obj["kind"], obj["metadata"]["name"])
        self.calls.append(("create", *key))
        if key in self.refuse:
            raise self.refuse[key]
        return key not in self.existing

    def read(self, kind, ns, name):
        self.calls.append(("read", kind, name))
        return copy.deepcopy(self.existing[(kind, name)])

    def merge_patch(self, obj):
        self.calls.append(("merge_patch", obj["kind"], obj["metadata"]["name"]))

    def delete(self, obj):
        self.calls.append(("delete", obj["kind"], obj["metadata"]["name"]))

    def delete_pod(self, ns, name, grace_period_seconds=None):
        self.calls.append(("delete_pod", name, grace_period_seconds))

    def read_node(self, name):
        self.calls.append(("read_node", name))
        if name in self.node_errors:
            raise self.node_errors[name]
        return copy.deepcopy(self.nodes.get(name))


def controller(kube, pods=(), children=()):
    return Controller(kube, lambda key: kube.job if key == KEY else None, lambda key: list(pods),
                      lambda key: list(children), workers=1, clock=lambda: NOW)


def passes(ctl, n=2):
    """Run `n` passes over the job, as the queue would after each write's watch event."""
    async def go():
        for _ in range(n):
            await ctl.sync(KEY)
        await ctl.stop()
    asyncio.run(go())


def configmap(owner_refs):
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "demo-config", "namespace": "team-a", "ownerReferences": owner_refs},
            "data": {"hand": "made"}}


def test_existing_unowned_configmap_fails_the_job_and_is_left_alone():
    kube = FakeKube(make_job())
    kube.existing[("ConfigMap", "demo-config")] = configmap([])
    passes(controller(kube))
    status = kube.job["status"]
    assert (status["phase"], condition(status, names.COND_FAILED)["reason"]) == (
        names.FAILED, names.REASON_CHILD_CONFLICT)
    assert status["message"] == ("ConfigMap team-a/demo-config exists and is not owned by this RFTJob; "
                                 "delete or rename it")
    # Nothing written to it, and no pod started that would mount it.
    assert not [x for x in kube.calls if x[0] in ("merge_patch", "delete") and x[1] == "ConfigMap"]
    assert not [x for x in kube.calls if x[:2] == ("create", "Pod")]
    assert ("Warning", names.REASON_CHILD_CONFLICT, status["message"]) in kube.events


def test_configmap_controlled_by_someone_else_names_its_controller():
    kube = FakeKube(make_job())
    other = {"apiVersion": "apps/v1", "kind": "Deployment", "name": "web", "uid": "u-web", "controller": True}
    kube.existing[("ConfigMap", "demo-config")] = configmap([other])
    passes(controller(kube))
    assert "(its controller is Deployment web)" in kube.job["status"]["message"]


def test_our_own_child_on_409_is_success():
    kube = FakeKube(make_job())
    kube.existing[("ConfigMap", "demo-config")] = configmap([owner_reference(JobRef("demo", "team-a", UID))])
    passes(controller(kube))
    assert kube.job["status"]["phase"] == names.PENDING
    # Its labels are gone (that is why the index missed it): patched back.
    assert ("merge_patch", "ConfigMap", "demo-config") in kube.calls


def test_child_of_a_deleted_job_with_the_same_name_waits_for_the_garbage_collector():
    kube = FakeKube(make_job())
    kube.existing[("ConfigMap", "demo-config")] = configmap([owner_reference(JobRef("demo", "team-a", "old-uid"))])
    ctl = controller(kube)
    passes(ctl)
    assert kube.job["status"]["phase"] == names.PENDING  # not failed
    assert ctl.errors == 0


def test_422_fails_the_job_with_the_field_named():
    kube = FakeKube(make_job())
    message = ('Pod "demo-trainer-1-1" is invalid: spec.containers[0].resources.requests: '
               'Invalid value: "9": must be less than or equal to cpu limit')
    kube.refuse[("Pod", "demo-trainer-1-1")] = api_error(422, message)
    ctl = controller(kube)
    first: list[int] = []

    async def go():
        await ctl.sync(KEY)  # writes the status, creates the children, the pod is refused
        first.append(len(kube.calls))
        await ctl.sync(KEY)  # fails the job with it
        await ctl.stop()
    asyncio.run(go())
    status = kube.job["status"]
    want = f"creating Pod team-a/demo-trainer-1-1: {message}"
    assert (status["phase"], status["message"]) == (names.FAILED, want)
    assert condition(status, names.COND_FAILED)["reason"] == names.REASON_INVALID_SPEC
    assert ("Warning", "CreateFailed", f"creating Pod team-a/demo-trainer-1-1: HTTP 422 Unprocessable Entity: "
            f"{message}") in kube.events
    assert ("Warning", names.REASON_INVALID_SPEC, want) in kube.events
    assert ctl.errors == 0
    assert not [x for x in kube.calls[first[0]:] if x[0] == "create"]  # the failed job creates nothing more


def test_a_pod_beyond_the_namespaces_pod_security_fails_the_job():
    """PodSecurity admission answers 403; no retry fixes it, so it fails the job like a 422
    (a 403 from elsewhere, e.g. a webhook that is down, is retried)."""
    kube = FakeKube(make_job())
    message = ('pods "demo-trainer-1-0" is forbidden: violates PodSecurity "baseline:latest": '
               'hostPath volumes (volume "model-cache")')
    kube.refuse[("Pod", "demo-trainer-1-0")] = api_error(403, message, "Forbidden")
    ctl = controller(kube)
    passes(ctl, 2)
    status = kube.job["status"]
    assert status["phase"] == names.FAILED and "violates PodSecurity" in status["message"]
    assert condition(status, names.COND_FAILED)["reason"] == names.REASON_INVALID_SPEC
    other = FakeKube(make_job())
    other.refuse[("Pod", "demo-trainer-1-0")] = api_error(403, "webhook x is down", "Forbidden")
    with pytest.raises(ApiException):  # to the queue, which retries it with backoff
        passes(controller(other), 2)
    assert other.job["status"]["phase"] != names.FAILED


def test_a_refusal_is_forgotten_for_a_new_generation():
    kube = FakeKube(make_job())
    kube.refuse[("Pod", "demo-trainer-1-0")] = api_error(422, "bad")
    ctl = controller(kube)
    passes(ctl, 1)
    assert ctl.observe(KEY, kube.job).refusal is not None
    assert ctl.observe(KEY, make_job(generation=2)).refusal is None


def test_transient_errors_are_retried_not_failed():
    kube = FakeKube(make_job())
    kube.refuse[("Pod", "demo-trainer-1-0")] = api_error(403, "admission webhook \"x\" is unavailable", "Forbidden")

    async def go():
        ctl = controller(kube)
        with pytest.raises(ApiException):
            await ctl.sync(KEY)
        await ctl.stop()
    asyncio.run(go())
    assert kube.job["status"]["phase"] == names.PENDING
    assert kube.events[-1][2].endswith('HTTP 403 Forbidden: admission webhook "x" is unavailable')


def test_only_children_this_job_controls_are_observed():
    ours = pod(1, 0, owner_uid=UID)
    old = pod(1, 1, owner_uid="old-uid")
    children = [ChildView("Service", "demo-trainer", "h", UID), ChildView("ConfigMap", "demo-config", "h", "")]
    observed = controller(FakeKube(make_job()), [ours, old], children).observe(KEY, make_job())
    assert [p.name for p in observed.pods] == ["demo-trainer-1-0"]
    assert list(observed.children) == [("Service", "demo-trainer")]


def test_recreate_and_force_deletions_are_applied():
    kube = FakeKube(make_job(status=status(names.PENDING, attempt=2, restarts=1)))
    stuck = pod(1, 0, deleting=True, owner_uid=UID, deletion_deadline=NOW.replace(hour=11), grace=30, node="gone")
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
               "metadata": {"name": "demo-status-writer", "namespace": "team-a", "labels": {},
                            "ownerReferences": [owner_reference(JobRef("demo", "team-a", UID))]},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "other"},
               "subjects": []}
    passes(controller(kube, [stuck], [ChildView.from_object("RoleBinding", binding)]), 1)
    assert ("delete_pod", "demo-trainer-1-0", 0) in kube.calls
    # The other children's writes go side by side; this one's delete comes before its create.
    assert [x[0] for x in kube.calls if x[1:] == ("RoleBinding", "demo-status-writer")] == ["delete", "create"]


@pytest.mark.parametrize("error, want", [
    (api_error(422, 'Pod "p" is invalid: spec.containers[0].image: Required value'),
     'HTTP 422 Unprocessable Entity: Pod "p" is invalid: spec.containers[0].image: Required value'),
    (api_error(500, "x" * 2000, "Internal Server Error"), "HTTP 500 Internal Server Error: " + "x" * 597 + "..."),
    (ApiException(status=503, reason="Service Unavailable"), "HTTP 503 Service Unavailable"),
    (RuntimeError("boom"), "RuntimeError: boom"),
])
def test_describe_carries_the_servers_message(error, want):
    assert describe_error(error) == want


def test_describe_never_shows_the_request():
    e = api_error(422, "ConfigMap \"c\" is invalid: data: Too long")
    e.headers = {"Authorization": "Bearer secret"}
    assert "secret" not in describe_error(e) and "data: Too long" in describe_error(e)


# ------------------------------------------------------------------ pods stuck terminating

RESTARTING = status(names.RESTARTING, restarts=1, message="pod demo-trainer-1-1 failed",
                    lastFailure=last_failure(-3600))


def stuck_pod(seconds_past_deadline=600, node=NODE):
    return pod(1, 0, deleting=True, owner_uid=UID, node=node,
               deletion_deadline=NOW - timedelta(seconds=seconds_past_deadline), grace=30)


def node(ready="False", taints=()):
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE},
            "spec": {"taints": list(taints)},
            "status": {"conditions": [{"type": "Ready", "status": ready, "reason": "NodeStatusUnknown"}]}}


OUT_OF_SERVICE = {"key": "node.kubernetes.io/out-of-service", "value": "nodeshutdown", "effect": "NoExecute"}
FORBIDDEN = api_error(403, f'nodes "{NODE}" is forbidden: User "system:serviceaccount:rft:op" cannot get '
                      'resource "nodes"', "Forbidden")


@pytest.mark.parametrize("setup, want_force", [
    (lambda k: None, True),                                          # Node gone (404)
    (lambda k: k.nodes.update({NODE: node(taints=[OUT_OF_SERVICE])}), True),
    (lambda k: k.nodes.update({NODE: node()}), False),              # present, NotReady: maybe partitioned
    (lambda k: k.node_errors.update({NODE: FORBIDDEN}), False),     # namespaced install: may not read nodes
], ids=["node-gone", "out-of-service", "node-not-ready", "node-unreadable"])
def test_a_stuck_pod_is_force_deleted_only_when_its_node_runs_nothing(setup, want_force):
    kube = FakeKube(make_job(status=RESTARTING))
    setup(kube)
    ctl = controller(kube, [stuck_pod()])
    passes(ctl, 3)  # each pass sees the status the previous one wrote
    forced = [x for x in kube.calls if x[0] == "delete_pod" and x[2] == 0]
    warnings = [m for t, r, m in kube.events if (t, r) == ("Warning", names.REASON_STUCK_TERMINATING)]
    assert ("read_node", NODE) in kube.calls and ctl.errors == 0
    if want_force:
        assert forced and "force-deleting" in warnings[0]
        return
    assert forced == [] and len(warnings) == 1  # one event, not one per pass
    status = kube.job["status"]
    assert (status["phase"], status["message"]) == (names.RESTARTING, warnings[0])
    assert f"kubectl delete node {NODE}" in warnings[0] and "out-of-service=nodeshutdown:NoExecute" in warnings[0]


def test_nodes_are_read_only_for_pods_past_the_bound():
    kube = FakeKube(make_job(status=RESTARTING))
    passes(controller(kube, [stuck_pod(seconds_past_deadline=10)]), 1)  # within the margin
    assert not [x for x in kube.calls if x[0] == "read_node"]
    kube = FakeKube(make_job(status={**RESTARTING, "phase": names.FAILED}))
    passes(controller(kube, [stuck_pod()]), 1)  # a finished job waits for nothing
    assert not [x for x in kube.calls if x[0] == "read_node"]


def test_read_nodes_classifies_what_it_reads():
    kube = FakeKube(make_job())
    kube.nodes.update({"up": node("True"), "down": node(taints=[OUT_OF_SERVICE])})
    kube.node_errors["hidden"] = FORBIDDEN
    kube.node_errors["flaky"] = api_error(503, "unavailable", "Service Unavailable")
    got = controller(kube).read_nodes(["up", "down", "gone", "hidden", "flaky"])
    assert got == {"up": "up", "down": "out-of-service", "gone": "gone", "hidden": "unreadable",
                   "flaky": "unreadable"}


def test_children_the_spec_no_longer_renders_are_deleted():
    kube = FakeKube(make_job(status=status(names.RUNNING)))
    explorer_sa = {"apiVersion": "v1", "kind": "ServiceAccount",
                   "metadata": {"name": "demo-rft-explorer", "namespace": "team-a",
                                "labels": {names.LABEL_JOB: "demo", names.LABEL_MANAGED_BY: names.MANAGED_BY},
                                "ownerReferences": [owner_reference(JobRef("demo", "team-a", UID))]}}
    passes(controller(kube, [], [ChildView.from_object("ServiceAccount", explorer_sa)]), 1)
    assert ("delete", "ServiceAccount", "demo-rft-explorer") in kube.calls


def test_a_steps_writes_go_side_by_side_pods_wait_for_what_they_use_bindings_for_roles():
    kube = FakeKube(make_job())
    first = {"ConfigMap", "Service", "ServiceAccount"}
    together = threading.Barrier(len(first), timeout=10)  # breaks unless all are in flight at once
    created: list[str] = []
    create = kube.create

    def create_together(obj):
        if obj["kind"] in ("Pod", "Role"):
            assert first <= set(created)  # a pod's account, config and name exist
            assert "RoleBinding" not in created  # pods do not wait for the slow RBAC writes
        elif obj["kind"] == "RoleBinding":
            assert "Role" in created  # the API server reads the Role it binds
        else:
            together.wait()
        created.append(obj["kind"])
        return create(obj)

    kube.create = create_together
    ctl = Controller(kube, lambda key: kube.job, lambda key: [], lambda key: [], workers=2, clock=lambda: NOW)
    passes(ctl, 1)
    assert sorted(created) == sorted([*first, "Role", "RoleBinding", "Pod", "Pod"])
    assert ctl.errors == 0


def test_a_pass_waits_for_the_children_it_created_to_reach_the_informers(monkeypatch):
    from rft_operator import controller as controller_module

    kube = FakeKube(make_job())
    sent: list[dict] = []
    create = kube.create
    kube.create = lambda obj: sent.append(obj) or create(obj)
    shown: list = []  # what the informers show
    pods = lambda key: views(*(o for o in shown if o["kind"] == "Pod"))  # noqa: E731
    children = lambda key: [ChildView.from_object(o["kind"], o) for o in shown if o["kind"] != "Pod"]  # noqa: E731

    def creates():
        return [x for x in kube.calls if x[0] == "create"]

    async def go(expect_seconds):
        monkeypatch.setattr(controller_module, "EXPECT_SECONDS", expect_seconds)
        ctl = Controller(kube, lambda key: kube.job, pods, children, workers=1, clock=lambda: NOW)
        await ctl.sync(KEY)  # the status, 5 static children and 2 pods
        first = len(creates())
        await ctl.sync(KEY)  # a pod event came first: nothing is created twice
        second = len(creates())
        waiting = ctl.awaits_children(KEY)  # a static child's ADDED event then requeues the job
        shown.extend(sent)  # the informers catch up
        await ctl.sync(KEY)
        assert not ctl.awaits_children(KEY)
        await ctl.stop()
        assert waiting or expect_seconds == 0
        return first, second, len(creates()), ctl.reconciles

    assert asyncio.run(go(10.0)) == (7, 7, 7, 2)  # the waiting pass did not reconcile
    kube.job, kube.calls, shown[:], sent[:] = make_job(), [], [], []
    assert asyncio.run(go(0.0))[:2] == (7, 14)  # past the wait, it trusts what it sees
