"""The Kueue harness (e2e/kueue.py) runs the real Kueue here: a Workload made by hand is
admitted into a ClusterQueue's flavor, one that does not fit the rest of the quota waits
with Kueue's reason, and gets the quota once the first is marked Finished by a merge
patch of its status (what a job controller integrated with Kueue writes)."""

from __future__ import annotations

import uuid

import pytest

from e2e.kueue import API_VERSION

from .conftest import wait_for

pytestmark = pytest.mark.integration

GPU = "nvidia.com/gpu"


def workload(name: str, queue: str, count: int, gpus: int, **spec) -> dict:
    container = {"name": "trainer", "image": "rftjob-trainer:test", "resources": {
        "requests": {"cpu": "1", "memory": "1Gi", GPU: str(gpus)}, "limits": {GPU: str(gpus)}}}
    pod_set = {"name": "trainer", "count": count,
               "template": {"spec": {"restartPolicy": "Never", "containers": [container]}}}
    return {"apiVersion": API_VERSION, "kind": "Workload", "metadata": {"name": name},
            "spec": {"queueName": queue, "podSets": [pod_set], **spec}}


def condition(obj: dict, kind: str) -> dict | None:
    return next((c for c in obj.get("status", {}).get("conditions", []) if c["type"] == kind), None)


def is_true(obj: dict, kind: str) -> bool:
    c = condition(obj, kind)
    return c is not None and c["status"] == "True"


def admitted(kueue, namespace: str, name: str) -> dict | None:
    """The Workload once Kueue admitted it."""
    wl = kueue.get("Workload", name, namespace)
    return wl if is_true(wl, "Admitted") else None


@pytest.fixture
def queues(kueue, namespace):
    """A flavor, a ClusterQueue of 8 CPUs, 32Gi and 4 GPUs in it, a LocalQueue `lq`."""
    suffix = uuid.uuid4().hex[:6]
    flavor, cq = f"gpu-{suffix}", f"cq-{suffix}"
    kueue.create_resource_flavor(
        flavor, node_labels={"rft.dev/pool": "gpu"},
        tolerations=[{"key": GPU, "operator": "Exists", "effect": "NoSchedule"}])
    kueue.create_cluster_queue(cq, flavor, {"cpu": "8", "memory": "32Gi", GPU: "4"})
    kueue.create_local_queue(namespace, "lq", cq)
    yield flavor, cq
    for name in ("first", "second"):
        kueue.delete("Workload", name, namespace, wait=30)
    kueue.delete("LocalQueue", "lq", namespace, wait=30)
    kueue.delete("ClusterQueue", cq, wait=30)
    kueue.delete("ResourceFlavor", flavor, wait=30)


def test_kueue_admits_a_workload_and_queues_one_over_quota(kueue, namespace, queues):
    flavor, cq = queues
    rf = kueue.get("ResourceFlavor", flavor)
    assert "kueue.x-k8s.io/resource-in-use" in rf["metadata"]["finalizers"]  # its mutating webhook
    assert rf["spec"]["tolerations"][0]["key"] == GPU
    wait_for(lambda: is_true(kueue.get("ClusterQueue", cq), "Active"), 30, "the ClusterQueue to be Active")

    kueue.create({**workload("first", "lq", count=2, gpus=1), "metadata": {"name": "first", "namespace": namespace}})
    first = wait_for(lambda: admitted(kueue, namespace, "first"), 60, "Kueue to admit `first`")
    admission = first["status"]["admission"]
    assert admission["clusterQueue"] == cq
    [assignment] = admission["podSetAssignments"]
    assert assignment["name"] == "trainer" and assignment["count"] == 2
    assert assignment["flavors"] == {"cpu": flavor, "memory": flavor, GPU: flavor}
    assert assignment["resourceUsage"][GPU] == "2"
    assert is_true(first, "QuotaReserved")

    # 2 x 2 GPUs: within the ClusterQueue's 4, over the 2 that `first` leaves.
    kueue.create_priority_class(f"high-{cq}", 1000, "for the harness test")
    try:
        ref = {"group": "kueue.x-k8s.io", "kind": "WorkloadPriorityClass", "name": f"high-{cq}"}
        second = workload("second", "lq", count=2, gpus=2, priorityClassRef=ref, priority=1000)
        kueue.create({**second, "metadata": {"name": "second", "namespace": namespace}})

        def pending() -> dict | None:
            c = condition(kueue.get("Workload", "second", namespace), "QuotaReserved")
            return c if c and c["status"] == "False" and c.get("message") else None

        reserved = wait_for(pending, 60, "Kueue to leave `second` pending with a reason")
        assert reserved["reason"] == "Pending"
        assert GPU in reserved["message"] and flavor in reserved["message"], reserved["message"]
        assert not is_true(kueue.get("Workload", "second", namespace), "Admitted")

        # A client marks `first` Finished with a merge patch of its status; Kueue frees its quota.
        conditions = first["status"]["conditions"] + [{
            "type": "Finished", "status": "True", "reason": "Succeeded", "message": "done by the test",
            "lastTransitionTime": first["metadata"]["creationTimestamp"]}]
        kueue.patch_status("Workload", "first", namespace, {"conditions": conditions})
        second = wait_for(lambda: admitted(kueue, namespace, "second"), 60,
                          "Kueue to admit `second` once `first` finished")
        assert second["status"]["admission"]["podSetAssignments"][0]["resourceUsage"][GPU] == "4"
        assert is_true(kueue.get("Workload", "first", namespace), "Finished")
    finally:
        kueue.delete("WorkloadPriorityClass", f"high-{cq}")
