"""Two operator replicas with Lease leader election (`--leader-elect`), as host processes
with the operator's identity against the real API server, jobs on KWOK nodes:

* only the leader acts; the other waits (and says so once);
* the leader SIGKILLed with 20 jobs in flight: the other leads within the lease duration
  (takeover seconds printed), and no child is created twice, no restart counted twice,
  no status write lost (a pod that failed just before the kill is restarted exactly once);
* a leader cut off from the API server (its connections hang) exits before the other
  takes over: renew deadline < lease duration.

Short timings keep it quick (lease 6 s, renew deadline 4 s, retry 1 s); the shipped
defaults are 15/10/2."""

from __future__ import annotations

import re
import threading
import time
from urllib.parse import urlsplit

import kubernetes
import pytest
import yaml

from rft_contract import names
from tests.conftest import wait_for
from tests.trainer.faultproxy import TcpProxy

from .operator_fixtures import (
    OperatorProcess, assert_takeover_kept_every_job, create_job, end_pod, job_manifest, jobs_in_flight, wait_phase,
    wait_status,
)

pytestmark = pytest.mark.integration
LEASE, OPERATOR_NS = "rftjob-operator", "rftjob-system"
DURATION, DEADLINE, RETRY = 6, 4, 1
ELECT = ("--leader-elect", "--leader-elect-namespace", OPERATOR_NS, "--leader-elect-lease-duration", str(DURATION),
         "--leader-elect-renew-deadline", str(DEADLINE), "--leader-elect-retry-period", str(RETRY))
LEADS = r"leader election: (\S+) leads\n"
WAITS = r"leader election: \S+ leads; this replica \(\S+\) waits"


@pytest.fixture
def replicas(cluster, installed, kubectl, tmp_path):
    """A function making operator replicas (the session's own operator paused meanwhile);
    each is stopped at the end, and the Lease removed."""
    paused = [o for o in OperatorProcess.started if o.running()]
    for other in paused:
        other.stop()
    kubectl("delete", "lease", LEASE, "-n", OPERATOR_NS, "--ignore-not-found")
    made: list[OperatorProcess] = []

    def make(name: str, kubeconfig=None) -> OperatorProcess:
        kc = kubeconfig or cluster.service_account_kubeconfig(OPERATOR_NS, "rftjob-operator",
                                                              tmp_path / f"{name}.kubeconfig")
        op = OperatorProcess(kc, tmp_path / f"{name}.log", ELECT)
        made.append(op)
        return op

    try:
        yield make
    finally:
        for op in made:
            op.stop()
        OperatorProcess.started[:] = [o for o in OperatorProcess.started if o not in made]
        kubectl("delete", "lease", LEASE, "-n", OPERATOR_NS, "--ignore-not-found")
        for other in paused:
            other.start()


def lease_holder(api) -> str:
    lease = kubernetes.client.CoordinationV1Api(api).read_namespaced_lease(LEASE, OPERATOR_NS)
    return lease.spec.holder_identity or ""


class Seen:
    """When things happened, as a thread sees them every 20 ms (the plain log format has no
    timestamps): the first log line of an operator matching a pattern, an operator's exit."""

    def __init__(self):
        self.times: dict[str, float] = {}
        self._checks: list[tuple[str, callable]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def line(self, key: str, op: OperatorProcess, pattern: str) -> None:
        since = op.log_offset()
        self._checks.append((key, lambda: op.logged(pattern, since)))

    def exit(self, key: str, op: OperatorProcess) -> None:
        self._checks.append((key, lambda: op.proc.poll() is not None))

    def _run(self) -> None:
        while not self._stop.is_set():
            for key, check in list(self._checks):
                if key not in self.times and check():
                    self.times[key] = time.monotonic()
            self._stop.wait(0.02)

    def wait(self, key: str, timeout: float) -> float:
        return wait_for(lambda: self.times.get(key), timeout, key, interval=0.05)

    def stop(self) -> None:
        self._stop.set()


def test_one_replica_leads_and_the_other_takes_over_when_it_dies(replicas, api, namespace):
    a, b = replicas("a"), replicas("b")
    a.start()
    b.start(ready=WAITS)
    leader = re.search(LEADS, a.log_path.read_text()).group(1)
    assert lease_holder(api) == leader
    assert not b.logged("rftjob-operator started")  # no handlers, no controller on the follower

    # 20 jobs in flight under the leader.
    children = jobs_in_flight(api, namespace, 20, 120)
    assert not b.logged(r"pods seen")  # the follower never reconciled anything

    # A pod fails and the leader dies at once: the failure may or may not have been
    # handled; either way it is counted once.
    seen = Seen()
    seen.line("b leads", b, LEADS)
    end_pod(api, namespace, "j00-trainer-1-0", 1)
    killed = time.monotonic()
    a.kill()
    took = seen.wait("b leads", DURATION + 30) - killed
    seen.stop()
    b.wait_logged("rftjob-operator started", 0, timeout=60)
    print(f"[leader] takeover {took:.1f}s after SIGKILL (lease duration {DURATION}s)")
    assert took <= DURATION + 2 * RETRY, took
    assert lease_holder(api) != leader

    assert_takeover_kept_every_job(api, namespace, children)


def test_a_leader_cut_off_from_the_api_server_exits_before_the_other_takes_over(
        replicas, api, namespace, cluster, tmp_path):
    kc = cluster.service_account_kubeconfig(OPERATOR_NS, "rftjob-operator", tmp_path / "cut.kubeconfig")
    config = yaml.safe_load(kc.read_text())
    upstream = urlsplit(config["clusters"][0]["cluster"]["server"])
    proxy = TcpProxy(upstream.hostname, upstream.port).start()
    config["clusters"][0]["cluster"]["server"] = f"https://127.0.0.1:{proxy.port}"
    kc.write_text(yaml.safe_dump(config))
    a, b = replicas("a", kubeconfig=kc), replicas("b")
    try:
        a.start()
        b.start(ready=WAITS)
        create_job(api, namespace, job_manifest("cut", trainer={"nodes": 1, "gpusPerNode": 1}))
        wait_phase(api, namespace, "cut", names.RUNNING, 120)

        seen = Seen()
        seen.line("b leads", b, LEADS)
        seen.exit("a exits", a)
        proxy.hang()  # requests sent now are never answered
        cut = time.monotonic()
        gone = seen.wait("a exits", DEADLINE + 10)
        took_over = seen.wait("b leads", DURATION + 30)
        seen.stop()
        assert a.proc.returncode == 1 and a.logged("leadership lost"), a.tail()
        b.wait_logged("rftjob-operator started", 0, timeout=60)
        print(f"[leader] cut-off leader exited {gone - cut:.1f}s after the cut; "
              f"the other led {took_over - cut:.1f}s after it")
        assert gone - cut <= DEADLINE + 2 * RETRY, gone - cut
        assert gone < took_over, (gone, took_over)
        # The new leader handles the job: a failure is restarted once.
        end_pod(api, namespace, "cut-trainer-1-0", 1)
        s = wait_status(api, namespace, "cut", lambda s: s.get("attempt") == 2, 120, "restart by the new leader")
        assert s["restarts"] == 1
    finally:
        proxy.stop()
