"""Fixtures for end-to-end tests: the integration tests' local cluster plus a pod runner
(e2e/podrunner/) that runs the pods bound to its node as host processes."""

from __future__ import annotations

import uuid

import pytest

from e2e.cluster import ExistingCluster
from e2e.podrunner import PodRunner
from tests.conftest import wait_for  # the cluster fixtures come from tests/conftest.py


def _node_ready(kubectl_json, name: str) -> bool:
    node = kubectl_json("get", "node", name)
    conditions = {c["type"]: c["status"] for c in node["status"].get("conditions", [])}
    return conditions.get("Ready") == "True"


@pytest.fixture(scope="module")
def runner(cluster, kubectl, kubectl_json, tmp_path_factory):
    """A started PodRunner for this module, its node Ready.

    On a fresh cluster the node is `local`, as in the demo. On a reused cluster
    (RFT_KUBECONFIG) a uniquely named node is used (another runner may own `local`);
    tests pin pods to `runner.node` with the kubernetes.io/hostname label either way.
    """
    node = f"local-test-{uuid.uuid4().hex[:6]}" if isinstance(cluster, ExistingCluster) else "local"
    pod_runner = PodRunner(cluster.kubeconfig, node=node, state_dir=tmp_path_factory.mktemp("podrunner"))
    pod_runner.start()
    try:
        wait_for(lambda: _node_ready(kubectl_json, node), 30, f"node {node} Ready")
        yield pod_runner
    finally:
        pod_runner.stop()
        if node != "local":
            kubectl("delete", "node", node, "--wait=false", check=False)
