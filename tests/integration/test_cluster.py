"""The local control plane is the real thing: real API server, scheduler,
controller-manager and RBAC, with KWOK standing in only for kubelets.

Later integration tests (the operator's) rely on each of these properties.
"""

from __future__ import annotations

import json

import pytest

from e2e.cluster import ApiError, ExistingCluster, read_versions

pytestmark = pytest.mark.integration

EXIT_ANNOTATION = "rft.dev/kwok-exit-code"


def gpu_pod(name: str, gpus: int = 2) -> str:
    """A pod manifest asking for GPUs; the image is never pulled (KWOK runs nothing)."""
    return json.dumps({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Never",
            "containers": [{
                "name": "trainer", "image": "registry.invalid/trainer:test",
                "resources": {"limits": {"nvidia.com/gpu": str(gpus)}},
            }],
        },
    })


class Pods:
    """Creates pods in the test's namespace and waits for KWOK to move them along."""

    def __init__(self, kubectl, kubectl_json, wait_for, namespace: str):
        self.kubectl, self.get_json, self.wait_for = kubectl, kubectl_json, wait_for
        self.namespace = namespace

    def get(self, name: str) -> dict:
        return self.get_json("get", "pod", name, "-n", self.namespace)

    def start(self, name: str) -> dict:
        """Creates a GPU pod and waits until it runs; returns the running pod."""
        self.kubectl("apply", "-n", self.namespace, "-f", "-", input=gpu_pod(name))

        def running():
            pod = self.get(name)
            return pod if pod["status"].get("phase") == "Running" and pod["status"].get("podIP") else None

        return self.wait_for(running, 60, f"pod {self.namespace}/{name} Running with a podIP")

    def annotate_exit(self, name: str, code: int) -> None:
        self.kubectl("annotate", "pod", name, "-n", self.namespace, f"{EXIT_ANNOTATION}={code}")

    def wait_phase(self, name: str, phase: str) -> dict:
        def reached():
            pod = self.get(name)
            return pod if pod["status"].get("phase") == phase else None

        return self.wait_for(reached, 60, f"pod {self.namespace}/{name} phase {phase}")


@pytest.fixture
def pods(kubectl, kubectl_json, wait_for, namespace) -> Pods:
    return Pods(kubectl, kubectl_json, wait_for, namespace)


def test_server_reports_pinned_version(kubectl):
    out = json.loads(kubectl("version", "-o", "json").stdout)
    assert out["serverVersion"]["gitVersion"] == read_versions()["K8S_VERSION"]


def test_fake_gpu_nodes_are_ready(kubectl_json):
    nodes = kubectl_json("get", "nodes", "-l", "type=kwok")["items"]
    assert nodes, "no KWOK nodes"
    for node in nodes:
        assert node["status"]["allocatable"]["nvidia.com/gpu"] == "8"
        ready = {c["type"]: c["status"] for c in node["status"]["conditions"]}["Ready"]
        assert ready == "True", node["metadata"]["name"]


def test_scheduler_places_gpu_pod_on_kwok_node(pods):
    pod = pods.start("gpu")
    assert pod["spec"]["nodeName"].startswith("kwok-gpu-")  # bound by kube-scheduler, not us
    scheduled = {c["type"]: c["status"] for c in pod["status"]["conditions"]}
    assert scheduled.get("PodScheduled") == "True"


def test_exit_code_annotation_fails_pod(pods):
    pods.start("crash")
    pods.annotate_exit("crash", 3)
    pod = pods.wait_phase("crash", "Failed")
    terminated = pod["status"]["containerStatuses"][0]["state"]["terminated"]
    assert terminated["exitCode"] == 3
    assert terminated["reason"] == "Error"


def test_exit_code_zero_succeeds_pod(pods):
    pods.start("done")
    pods.annotate_exit("done", 0)
    pod = pods.wait_phase("done", "Succeeded")
    terminated = pod["status"]["containerStatuses"][0]["state"]["terminated"]
    assert terminated["exitCode"] == 0
    assert terminated["reason"] == "Completed"


def test_garbage_collector_removes_orphans(kubectl, kubectl_json, wait_for, namespace):
    kubectl("create", "configmap", "owner", "-n", namespace)
    owner = kubectl_json("get", "configmap", "owner", "-n", namespace)
    child = {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "child", "ownerReferences": [{
            "apiVersion": "v1", "kind": "ConfigMap", "name": "owner",
            "uid": owner["metadata"]["uid"],
        }]},
    }
    kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(child))
    kubectl("delete", "configmap", "owner", "-n", namespace)

    def child_gone():
        return kubectl("get", "configmap", "child", "-n", namespace, check=False).returncode != 0

    wait_for(child_gone, 60, "the garbage collector to delete the orphaned child")


def test_service_account_kubeconfig_has_only_its_rbac(cluster, kubectl, tmp_path, namespace):
    kubectl("create", "serviceaccount", "nobody", "-n", namespace)
    path = cluster.service_account_kubeconfig(namespace, "nobody", tmp_path / "sa.kubeconfig")

    whoami = json.loads(kubectl("auth", "whoami", "-o", "json", kubeconfig=path).stdout)
    assert whoami["status"]["userInfo"]["username"] == f"system:serviceaccount:{namespace}:nobody"

    denied = kubectl("get", "secrets", "-n", namespace, kubeconfig=path, check=False)
    assert denied.returncode != 0
    assert "Forbidden" in denied.stderr

    with pytest.raises(ApiError) as err:
        ExistingCluster(path).api().get(f"/api/v1/namespaces/{namespace}/secrets")
    assert err.value.status == 403
