"""What the end-to-end tests drive on the real node: the operator as its Deployment, and
the host processes of running containers (found by their cgroup, as `crictl inspect`
would report them)."""

from __future__ import annotations

import datetime as dt
import json
import re
import subprocess
from pathlib import Path

import psutil

from e2e import demo
from tests.conftest import wait_for

NAMESPACE, DEPLOYMENT = "rftjob-system", "rftjob-operator"


def container_processes(container_id: str) -> list[psutil.Process]:
    """The host processes of a container (`containerd://<id>`): its cgroup path ends with the id."""
    cid = container_id.split("://", 1)[1]
    found = []
    for proc in psutil.process_iter():
        try:
            if cid in Path(f"/proc/{proc.pid}/cgroup").read_text():
                found.append(proc)
        except (OSError, psutil.Error):
            pass
    return found


def pod_processes(pod) -> list[psutil.Process]:
    """Every process of a pod's running containers (a kubernetes client V1Pod)."""
    return [proc for cs in (pod.status.container_statuses or []) if cs.container_id and cs.state.running
            for proc in container_processes(cs.container_id)]


class InClusterOperator:
    """The operator Deployment from manifests/ with the image from the local registry.

    kill() takes it down hard and keeps it down (scaled to 0, its processes SIGKILLed:
    nothing is flushed or handed over, as when its node dies); start() brings it back and
    waits until it logs its start. Log positions are times (`kubectl logs --since-time`)."""

    def __init__(self, cluster, image: str, replicas: int = 1):
        self.cluster, self.image, self.replicas = cluster, image, replicas

    def _kubectl(self, *args: str, check: bool = True) -> str:
        return demo.kubectl(self.cluster, *args, check=check)

    def install(self) -> None:
        # Debug logging (the tests wait on reconcile lines) and a short resync, as the
        # integration tests run it.
        # One replica unless asked: most tests kill, hold and read the log of "the"
        # operator (the replicas' takeover has a test of its own, tests/e2e/test_ha.py).
        # A single replica killed and started again waits out its old Lease: a short one
        # (6 s; the Deployment's is 15) keeps those tests quick.
        short = ("--leader-elect-lease-duration=6", "--leader-elect-renew-deadline=4",
                 "--leader-elect-retry-period=1") if self.replicas == 1 else ()
        demo.install(self.cluster, self.image, extra_args=("--verbose", *short),
                     env={"RFT_RESYNC_SECONDS": "10"}, replicas=self.replicas)
        self.start(since="")

    def pods(self) -> list[dict]:
        out = self._kubectl("get", "pods", "-n", NAMESPACE, "-l", f"app.kubernetes.io/name={DEPLOYMENT}",
                            "-o", "json")
        return json.loads(out)["items"]

    def kill(self) -> None:
        """Frozen first (SIGSTOP: it can neither act on the kubelet's SIGTERM nor hand
        anything over), then scaled to 0 so nothing restarts it, then SIGKILLed."""
        procs = [proc for pod in self.pods()
                 for cs in pod.get("status", {}).get("containerStatuses") or []
                 if cs.get("containerID") and "running" in cs.get("state", {})
                 for proc in container_processes(cs["containerID"])]
        for proc in procs:
            try:
                proc.suspend()
            except psutil.Error:
                pass
        self._kubectl("scale", "deployment", DEPLOYMENT, "-n", NAMESPACE, "--replicas=0")
        for proc in procs:
            try:
                proc.kill()
            except psutil.Error:
                pass
        wait_for(lambda: not self.pods(), 60, "the operator pod gone")

    def start(self, since: str | None = None) -> None:
        since = self.log_offset() if since is None else since
        self._kubectl("scale", "deployment", DEPLOYMENT, "-n", NAMESPACE, f"--replicas={self.replicas}")
        self._kubectl("rollout", "status", f"deployment/{DEPLOYMENT}", "-n", NAMESPACE, "--timeout=120s")
        self.wait_logged("rftjob-operator started", since)

    def stop(self) -> None:
        self._kubectl("scale", "deployment", DEPLOYMENT, "-n", NAMESPACE, "--replicas=0", check=False)

    @staticmethod
    def log_offset() -> str:
        """Now, as `--since-time` takes it (the kubelet stamps each log line)."""
        return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")

    def logs(self, since: str = "", tail: int | None = None) -> str:
        """Every replica's log (one after the other)."""
        args = ["logs", "-l", f"app.kubernetes.io/name={DEPLOYMENT}", "-n", NAMESPACE, "--max-log-requests=10",
                f"--tail={tail or -1}"]  # with a selector kubectl shows 10 lines unless told
        if since:
            args.append(f"--since-time={since}")
        res = subprocess.run(["kubectl", f"--kubeconfig={self.cluster.kubeconfig}", *args],
                             capture_output=True, text=True, timeout=60)
        return res.stdout

    def logged(self, pattern: str, since: str = "") -> bool:
        return re.search(pattern, self.logs(since)) is not None

    def wait_logged(self, pattern: str, since: str, timeout: float = 90) -> None:
        try:
            wait_for(lambda: self.logged(pattern, since), timeout, f"operator log line /{pattern}/")
        except AssertionError as e:
            raise AssertionError(f"{e}\noperator log:\n{self.tail()}") from None

    def tail(self, n: int = 60) -> str:
        return self.logs(tail=n)
