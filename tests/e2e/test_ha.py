"""Two operator replicas (the Deployment as shipped: `--leader-elect`, 15 s lease, 10 s renew
deadline) on the real node, 20 jobs in flight on KWOK's nodes. The leader's process is
SIGKILLed (the kubelet restarts its container, which comes back as a candidate): the other
replica leads within the lease duration (takeover seconds printed), and no child is
created twice, no restart counted twice, no status write lost. Then the leader's pod is cut
off from the API server (an iptables rule in its network namespace): it exits before the
other takes the Lease. The step-by-step rules: tests/unit/test_leader.py; with short
timings between host processes: tests/integration/test_leader.py."""

from __future__ import annotations

import os
import subprocess
import time

import kubernetes
import psutil
import pytest

from e2e import demo
from rft_contract import names
from tests.conftest import wait_for
from tests.e2e.incluster import NAMESPACE, InClusterOperator, container_processes
from tests.integration.operator_fixtures import (
    OperatorProcess, assert_takeover_kept_every_job, end_pod, jobs_in_flight,
)

pytestmark = pytest.mark.e2e
LEASE_DURATION, RETRY = 15, 2  # the operator's defaults, which the Deployment keeps


@pytest.fixture(scope="module")
def replicas(cluster, node, images):
    paused = [o for o in OperatorProcess.started if o.running()]  # one operator at a time
    for other in paused:
        other.stop()
    op = InClusterOperator(cluster, images["operator"], replicas=2)
    try:
        op.install()
        api = kubernetes.config.new_client_from_config(str(cluster.kubeconfig))
        wait_for(lambda: len(ready_pods(api)) == 2, 120, "both replicas ready")
        # Until one of these two holds the Lease (an earlier module's operator may have).
        wait_for(lambda: holder(api).rsplit("_", 1)[0] in {p.metadata.name for p in ready_pods(api)},
                 60, "a replica of this install leading")
        yield api, op
    finally:
        op.stop()
        demo.uninstall_webhook(cluster)
        for other in paused:
            other.start()


def ready_pods(api) -> list:
    items = kubernetes.client.CoreV1Api(api).list_namespaced_pod(
        NAMESPACE, label_selector="app.kubernetes.io/name=rftjob-operator").items
    return [p for p in items if p.metadata.deletion_timestamp is None and p.status.phase == "Running"
            and all(cs.ready for cs in p.status.container_statuses or [])]


def holder(api) -> str:
    lease = kubernetes.client.CoordinationV1Api(api).read_namespaced_lease("rftjob-operator", NAMESPACE)
    return lease.spec.holder_identity or ""


@pytest.mark.timeout(900)
def test_the_other_replica_takes_over_when_the_leader_is_sigkilled(replicas, kubectl):
    api, op = replicas
    ns = f"ha-{int(time.time())}"
    kubectl("create", "namespace", ns)
    kubectl("label", "namespace", ns, f"{names.PSA_ENFORCE_LABEL}=baseline")
    try:
        leader = holder(api)
        by_name = {p.metadata.name: p for p in ready_pods(api)}
        leader_pod = by_name[leader.rsplit("_", 1)[0]]  # identity: <pod name>_<random>
        (other_pod,) = [p for n, p in by_name.items() if n != leader_pod.metadata.name]

        children = jobs_in_flight(api, ns, 20, 180)  # on KWOK's nodes: pods that "run" idle

        end_pod(api, ns, "j00-trainer-1-0", 1)  # a failure the dying leader may or may not handle
        (status,) = [cs for cs in leader_pod.status.container_statuses]
        procs = container_processes(status.container_id)
        assert procs, "the leader's processes were not found"
        killed = time.monotonic()
        for proc in procs:
            try:
                proc.kill()
            except psutil.Error:
                pass
        new = wait_for(lambda: (h := holder(api)) != leader and h, LEASE_DURATION + 30, "a new lease holder",
                       interval=0.1)
        took = time.monotonic() - killed
        which = "the other replica" if new.startswith(other_pod.metadata.name + "_") else "the restarted one"
        print(f"[ha] takeover {took:.1f}s after SIGKILL (lease duration {LEASE_DURATION}s) by {which}: {new}")
        # Usually the other replica (it has counted since before the kill); the killed
        # container, back within a second or two, can win when the other read the last
        # renewal late. Either way a new candidate, within the lease duration.
        assert took <= LEASE_DURATION + 2 * RETRY, took

        assert_takeover_kept_every_job(api, ns, children, 180)
        # The killed replica's container came back, as a waiting candidate.
        wait_for(lambda: len(ready_pods(api)) == 2, 120, "the killed replica back")
        restarted = kubernetes.client.CoreV1Api(api).read_namespaced_pod(leader_pod.metadata.name, NAMESPACE)
        assert restarted.status.container_statuses[0].restart_count >= 1
        assert holder(api) == new
    finally:
        kubectl("delete", "namespace", ns, "--wait=false", check=False)


def _lease(api):
    return kubernetes.client.CoordinationV1Api(api).read_namespaced_lease("rftjob-operator", NAMESPACE)


@pytest.mark.timeout(600)
def test_a_leader_cut_off_from_the_api_server_exits_before_the_other_leads(replicas, kubectl):
    """The leader pod's own network namespace drops its packets to the API server (an
    iptables rule there, as a partition between its node and the control plane would):
    it exits past its renew deadline, before the other replica takes the Lease."""
    api, op = replicas
    wait_for(lambda: len(ready_pods(api)) == 2 and holder(api).rsplit("_", 1)[0]
             in {p.metadata.name for p in ready_pods(api)}, 180, "two replicas, one of them leading")
    leader = holder(api)
    pod = next(p for p in ready_pods(api) if p.metadata.name == leader.rsplit("_", 1)[0])
    (status,) = pod.status.container_statuses
    restarts = status.restart_count
    pid = container_processes(status.container_id)[0].pid
    # The API server as pods reach it: the `kubernetes` Service (kube-proxy DNATs it on the host).
    svc = kubernetes.client.CoreV1Api(api).read_namespaced_service("kubernetes", "default").spec.cluster_ip
    rule = ["-p", "tcp", "-d", svc, "--dport", "443", "-j", "DROP"]
    # The pod's network namespace outlives the container (the kubelet restarts it there):
    # held open by a descriptor, for taking the rule out after.
    netns = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
    nsenter = ["nsenter", f"--net=/proc/self/fd/{netns}", "iptables"]
    subprocess.run([*nsenter, "-I", "OUTPUT", *rule], check=True, timeout=30, pass_fds=(netns,))
    cut = time.time()
    try:
        def exited():
            p = kubernetes.client.CoreV1Api(api).read_namespaced_pod(pod.metadata.name, NAMESPACE)
            cs = p.status.container_statuses[0]
            term = cs.last_state.terminated if cs.restart_count > restarts else None
            return term
        term = wait_for(exited, 60, "the cut-off leader's container to exit")
        new = wait_for(lambda: (h := holder(api)) not in ("", leader) and h, 60, "a new lease holder")
        acquired = _lease(api).spec.acquire_time.timestamp()
        gone = term.finished_at.timestamp()
        print(f"[ha] cut-off leader exited {gone - cut:.1f}s after the cut (code {term.exit_code}); "
              f"{new} took the lease {acquired - cut:.1f}s after it")
        assert term.exit_code == 1, term
        assert gone < acquired, (gone, acquired)
    finally:
        subprocess.run([*nsenter, "-D", "OUTPUT", *rule], timeout=30, pass_fds=(netns,))
        os.close(netns)
    wait_for(lambda: len(ready_pods(api)) == 2, 180, "the cut-off replica back")
