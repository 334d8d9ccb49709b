"""RFTJobs queued by a real Kueue (v0.17, built from its Go module, run as a host process
against the local control plane: `e2e/kueue.py`), with the operator as the job's
controller (`queueing.py`): quota, flavors, priorities and preemption, suspend, deletion.

Each test gets its own ClusterQueue of 16 GPUs (two 8-GPU trainer pods: one job of
`job_manifest`'s size fills it), flavor and LocalQueue, so tests do not share quota."""

from __future__ import annotations

import uuid

import kubernetes
import pytest

from rft_contract import names
from rft_operator import queueing

from .conftest import wait_for
from .operator_fixtures import (
    create_job, end_pod, events, get_job, job_manifest, patch_spec, pods, wait_phase, wait_status,
)

pytestmark = pytest.mark.integration

KUEUE = (queueing.GROUP, queueing.VERSION)
TOLERATION = {"key": "rft.dev/queue-test", "operator": "Exists", "effect": "NoSchedule"}


def custom(api) -> kubernetes.client.CustomObjectsApi:
    return kubernetes.client.CustomObjectsApi(api)


@pytest.fixture
def queue(kueue, api, namespace):
    """A ResourceFlavor (KWOK's node label, a toleration), a ClusterQueue of 16 GPUs that
    preempts lower priorities, a LocalQueue in the test's namespace, and two
    WorkloadPriorityClasses; all removed afterwards. Yields the LocalQueue's name and the
    priority classes' names."""
    tag = uuid.uuid4().hex[:6]
    flavor, cq, low, high = f"kwok-{tag}", f"gpus-{tag}", f"low-{tag}", f"high-{tag}"
    objs = [
        ("resourceflavors", None, {"apiVersion": queueing.API_VERSION, "kind": "ResourceFlavor",
                                   "metadata": {"name": flavor},
                                   "spec": {"nodeLabels": {"type": "kwok"}, "tolerations": [TOLERATION]}}),
        ("clusterqueues", None, {"apiVersion": queueing.API_VERSION, "kind": "ClusterQueue",
                                 "metadata": {"name": cq},
                                 "spec": {"namespaceSelector": {},
                                          "preemption": {"withinClusterQueue": "LowerPriority"},
                                          "resourceGroups": [{
                                              "coveredResources": ["cpu", "memory", "nvidia.com/gpu"],
                                              "flavors": [{"name": flavor, "resources": [
                                                  {"name": "cpu", "nominalQuota": "64"},
                                                  {"name": "memory", "nominalQuota": "1Ti"},
                                                  {"name": "nvidia.com/gpu", "nominalQuota": "16"}]}]}]}}),
        ("localqueues", namespace, {"apiVersion": queueing.API_VERSION, "kind": "LocalQueue",
                                    "metadata": {"name": "team", "namespace": namespace},
                                    "spec": {"clusterQueue": cq}}),
        ("workloadpriorityclasses", None, {"apiVersion": queueing.API_VERSION, "kind": "WorkloadPriorityClass",
                                           "metadata": {"name": low}, "value": 100}),
        ("workloadpriorityclasses", None, {"apiVersion": queueing.API_VERSION, "kind": "WorkloadPriorityClass",
                                           "metadata": {"name": high}, "value": 1000}),
    ]
    c = custom(api)
    for plural, ns, body in objs:
        if ns:
            c.create_namespaced_custom_object(*KUEUE, ns, plural, body)
        else:
            c.create_cluster_custom_object(*KUEUE, plural, body)
    wait_for(lambda: _active(c.get_cluster_custom_object(*KUEUE, "clusterqueues", cq)), 60, "ClusterQueue active")
    yield {"queue": "team", "cluster_queue": cq, "low": low, "high": high, "flavor": flavor}
    for plural, ns, body in reversed(objs):
        try:
            if ns:
                c.delete_namespaced_custom_object(*KUEUE, ns, plural, body["metadata"]["name"])
            else:
                c.delete_cluster_custom_object(*KUEUE, plural, body["metadata"]["name"])
        except kubernetes.client.ApiException as e:
            if e.status != 404:
                raise


def _active(obj: dict) -> bool:
    return any(x["type"] == "Active" and x["status"] == "True" for x in (obj.get("status") or {}).get("conditions", []))


def queued(name: str, queue_name: str, priority: str | None = None, **spec) -> dict:
    m = job_manifest(name, **spec)
    m["metadata"]["labels"] = {queueing.LABEL_QUEUE_NAME: queue_name}
    if priority:
        m["metadata"]["labels"][queueing.LABEL_PRIORITY_CLASS] = priority
    return m


def workload(api, ns: str, job: str) -> dict | None:
    try:
        return custom(api).get_namespaced_custom_object(*KUEUE, ns, "workloads", queueing.workload_name(job))
    except kubernetes.client.ApiException as e:
        if e.status == 404:
            return None
        raise


def live_pods(api, ns: str, job: str) -> list:
    return [p for p in pods(api, ns, job) if p.status.phase in ("Pending", "Running")]


def condition(status: dict, type_: str) -> dict:
    return next((x for x in status.get("conditions") or [] if x["type"] == type_), {})


def test_a_job_over_the_quota_stays_pending_with_kueues_reason_and_no_pods(operator, api, namespace, queue, kubectl):
    create_job(api, namespace, queued("big", queue["queue"], trainer={"nodes": 4, "batchSize": 32}))  # 32 GPUs > 16
    status = wait_status(api, namespace, "big",
                         lambda s: "insufficient quota" in condition(s, names.COND_ADMITTED).get("message", ""),
                         60, "Kueue's reason in the Admitted condition")
    assert status["phase"] == names.PENDING
    assert condition(status, names.COND_ADMITTED)["status"] == "False"
    assert status["queue"]["state"] == "Queued" and status["queue"]["workload"] == "rftjob-big"
    assert "insufficient quota" in status["message"]
    wl = workload(api, namespace, "big")
    assert wl["spec"]["podSets"][0]["count"] == 4
    assert wl["metadata"]["ownerReferences"][0]["name"] == "big"
    assert not pods(api, namespace, "big")
    out = kubectl("get", "rftjobs", "-n", namespace).stdout.splitlines()
    assert out[0].split()[-2:] == ["QUEUE", "AGE"] and out[1].split()[1] == "Pending"
    assert "Queued" in out[1].split()


def test_the_second_job_waits_for_the_first_and_pods_carry_the_flavor(operator, api, namespace, queue):
    create_job(api, namespace, queued("first", queue["queue"]))
    status = wait_phase(api, namespace, "first", names.RUNNING, 90)
    assert status["queue"] == {"name": "team", "state": "Admitted", "workload": "rftjob-first",
                               "clusterQueue": queue["cluster_queue"]}
    for p in pods(api, namespace, "first"):
        assert p.spec.node_selector.get("type") == "kwok"
        assert any(t.key == TOLERATION["key"] for t in p.spec.tolerations)
        assert p.metadata.labels[queueing.LABEL_PODSET] == "trainer"
    wait_for(lambda: queueing.is_true(workload(api, namespace, "first"), queueing.PODS_READY), 30, "PodsReady")

    create_job(api, namespace, queued("second", queue["queue"]))
    status = wait_status(api, namespace, "second", lambda s: (s.get("queue") or {}).get("state") == "Queued"
                         and "insufficient" in s.get("message", ""), 60, "second queued")
    assert not pods(api, namespace, "second")

    for rank in (0, 1):
        end_pod(api, namespace, f"first-trainer-1-{rank}", 0)
    wait_phase(api, namespace, "first", names.SUCCEEDED, 60)
    # The Workload's Finished condition is its own write, after the job's status: wait for it.
    finished = wait_for(lambda: queueing.find_condition(workload(api, namespace, "first"), queueing.FINISHED),
                        30, "the Workload's Finished condition")
    assert finished["status"] == "True" and finished["reason"] == "Succeeded"
    wait_phase(api, namespace, "second", names.RUNNING, 90)


def test_a_high_priority_job_preempts_a_low_one_which_resumes_later(operator, api, namespace, queue):
    create_job(api, namespace, queued("low", queue["queue"], queue["low"]))
    wait_phase(api, namespace, "low", names.RUNNING, 90, attempt=1)
    assert workload(api, namespace, "low")["spec"]["priority"] == 100

    create_job(api, namespace, queued("high", queue["queue"], queue["high"]))
    status = wait_status(api, namespace, "low", lambda s: s.get("disruptions") == 1, 60, "low evicted")
    assert status["phase"] == names.PENDING and status["restarts"] == 0 and status["attempt"] == 2
    wait_for(lambda: names.REASON_EVICTED in events(api, namespace, "low"), 30, "the Evicted event")
    wait_phase(api, namespace, "high", names.RUNNING, 90)
    assert not live_pods(api, namespace, "low")  # the low job's gang is gone before the high one runs
    wl = workload(api, namespace, "low")
    assert "admission" not in wl["status"]  # cleared by the operator, not by Kueue
    assert queueing.find_condition(wl, queueing.REQUEUED)["status"] == "True"

    for rank in (0, 1):
        end_pod(api, namespace, f"high-trainer-1-{rank}", 0)
    wait_phase(api, namespace, "high", names.SUCCEEDED, 60)
    status = wait_phase(api, namespace, "low", names.RUNNING, 90, attempt=2)
    assert status["restarts"] == 0 and status["disruptions"] == 1
    assert sorted(p.metadata.name for p in live_pods(api, namespace, "low")) == ["low-trainer-2-0", "low-trainer-2-1"]


def test_suspend_deactivates_the_workload_and_resume_queues_it_again(operator, api, namespace, queue):
    create_job(api, namespace, queued("pause", queue["queue"]))
    wait_phase(api, namespace, "pause", names.RUNNING, 90)
    patch_spec(api, namespace, "pause", {"suspend": True})
    wait_phase(api, namespace, "pause", names.SUSPENDED, 60)
    wait_for(lambda: workload(api, namespace, "pause")["spec"]["active"] is False, 30, "Workload deactivated")
    wait_for(lambda: not live_pods(api, namespace, "pause"), 60, "pods gone")
    wait_for(lambda: "admission" not in (workload(api, namespace, "pause").get("status") or {}), 60,
             "quota given back")
    assert get_job(api, namespace, "pause")["spec"]["suspend"] is True  # the operator never writes the spec

    patch_spec(api, namespace, "pause", {"suspend": False})
    wait_phase(api, namespace, "pause", names.RUNNING, 90, attempt=2)
    assert workload(api, namespace, "pause")["spec"]["active"] is True


def test_deleting_the_job_deletes_its_workload(operator, api, namespace, queue):
    create_job(api, namespace, queued("gone", queue["queue"]))
    wait_for(lambda: workload(api, namespace, "gone"), 30, "Workload created")
    custom(api).delete_namespaced_custom_object(names.GROUP, names.VERSION, namespace, names.PLURAL, "gone",
                                                body={"propagationPolicy": "Foreground"})
    wait_for(lambda: workload(api, namespace, "gone") is None, 60, "Workload garbage-collected")


def test_a_queue_that_does_not_exist_leaves_the_job_pending_with_kueues_reason(operator, api, namespace, queue):
    create_job(api, namespace, queued("lost", "no-such-queue"))
    status = wait_status(api, namespace, "lost",
                         lambda s: "no-such-queue" in condition(s, names.COND_ADMITTED).get("message", "")
                         and "doesn't exist" in condition(s, names.COND_ADMITTED).get("message", ""),
                         60, "Kueue's reason")
    assert status["phase"] == names.PENDING and not pods(api, namespace, "lost")
    assert operator.running()


def test_the_operator_restarted_during_an_eviction_loses_nothing(operator, api, namespace, queue, kueue):
    """Kueue evicts the job while the operator is down (for a high-priority Workload made by
    hand); the restarted operator reads the eviction from the Workload, stops the gang,
    counts one disruption and gives the quota back, so the preemptor is admitted."""
    create_job(api, namespace, queued("low", queue["queue"], queue["low"]))
    wait_phase(api, namespace, "low", names.RUNNING, 90, attempt=1)
    operator.kill()
    try:
        custom(api).create_namespaced_custom_object(*KUEUE, namespace, "workloads", {
            "apiVersion": queueing.API_VERSION, "kind": "Workload", "metadata": {"name": "urgent"},
            "spec": {"queueName": queue["queue"], "priority": 1000,
                     "priorityClassRef": {"group": queueing.GROUP, "kind": "WorkloadPriorityClass",
                                          "name": queue["high"]},
                     "podSets": [{"name": "main", "count": 1, "template": {"spec": {
                         "restartPolicy": "Never", "containers": [{"name": "c", "image": "none", "resources": {
                             "requests": {"nvidia.com/gpu": "16"}, "limits": {"nvidia.com/gpu": "16"}}}]}}}]}})
        wait_for(lambda: queueing.is_true(workload(api, namespace, "low"), queueing.EVICTED), 60, "Kueue evicts low")
        assert len(live_pods(api, namespace, "low")) == 2  # nobody stopped them yet
    finally:
        operator.start()
    wait_for(lambda: queueing.is_true(custom(api).get_namespaced_custom_object(
        *KUEUE, namespace, "workloads", "urgent"), queueing.ADMITTED), 90, "the preemptor admitted")
    # The job's status follows the Workload event that admission made: a later pass.
    status = wait_status(api, namespace, "low", lambda s: (s.get("queue") or {}).get("state") == "Queued", 30,
                         "low queued again")
    assert status["disruptions"] == 1 and status["restarts"] == 0 and status["attempt"] == 2
    assert status["phase"] == names.PENDING
    assert not live_pods(api, namespace, "low")
    custom(api).delete_namespaced_custom_object(*KUEUE, namespace, "workloads", "urgent")
    wait_phase(api, namespace, "low", names.RUNNING, 90, attempt=2)
