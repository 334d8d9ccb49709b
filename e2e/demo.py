"""`make demo`: a local cluster, the operator, and the sample RFTJob, end to end.

    python -m e2e.demo up      # cluster + CRD + operator + sample job; watch it run
    python -m e2e.demo down    # stop the operator and the cluster

The operator runs as a host process with the identity of its Deployment (the
`rftjob-operator` ServiceAccount from manifests/rbac.yaml), so what works here is what
the RBAC manifests allow. Trainer pods land on KWOK's fake GPU nodes (simulated pods:
they reach Running but run no code; the end-to-end issue adds a real pod runner).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from .cluster import DEFAULT_STATE_DIR, REPO_ROOT, Cluster, ClusterError

JOB, NAMESPACE = "demo", "default"


def kubectl(cluster: Cluster, *args: str, check: bool = True) -> str:
    out = subprocess.run(["kubectl", f"--kubeconfig={cluster.kubeconfig}", *args],
                         capture_output=True, text=True)
    if check and out.returncode != 0:
        raise ClusterError(f"kubectl {' '.join(args)}: {out.stderr.strip()}")
    return out.stdout


def _pid_file(cluster: Cluster) -> Path:
    return cluster.state_dir / "operator.pid"


def start_operator(cluster: Cluster) -> None:
    pid_file = _pid_file(cluster)
    if pid_file.exists() and psutil.pid_exists(int(pid_file.read_text())):
        print(f"[demo] operator already running (pid {pid_file.read_text()})")
        return
    kc = cluster.service_account_kubeconfig(
        "rftjob-system", "rftjob-operator", cluster.state_dir / "operator.kubeconfig")
    log = open(cluster.logs_dir / "operator.log", "ab")
    proc = subprocess.Popen(
        [sys.executable, "-m", "rft_operator", "--log-format=json"],
        env={**os.environ, "KUBECONFIG": str(kc), "PYTHONUNBUFFERED": "1"},
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO_ROOT,
    )
    pid_file.write_text(str(proc.pid))
    print(f"[demo] operator started (pid {proc.pid}); log: {cluster.logs_dir / 'operator.log'}")


def stop_operator(cluster: Cluster) -> None:
    pid_file = _pid_file(cluster)
    if not pid_file.exists():
        return
    pid = int(pid_file.read_text())
    try:
        proc = psutil.Process(pid)
        if "rft_operator" in " ".join(proc.cmdline()):
            proc.send_signal(signal.SIGTERM)
            proc.wait(20)
    except (psutil.NoSuchProcess, psutil.TimeoutExpired):
        pass
    pid_file.unlink(missing_ok=True)


def watch(cluster: Cluster, until: str, timeout: float) -> None:
    """Prints `kubectl get rftjobs` whenever it changes, until the phase is reached."""
    deadline, last = time.monotonic() + timeout, ""
    while time.monotonic() < deadline:
        table = kubectl(cluster, "get", "rftjobs", "-n", NAMESPACE, "-o", "wide")
        if table != last:
            print(table.rstrip(), flush=True)
            last = table
        phase = kubectl(cluster, "get", "rftjob", JOB, "-n", NAMESPACE,
                        "-o", "jsonpath={.status.phase}", check=False)
        if phase == until:
            return
        time.sleep(1)  # a display refresh, not synchronisation
    raise ClusterError(f"{JOB} did not reach {until} within {timeout:.0f}s; "
                       f"see {cluster.logs_dir / 'operator.log'}")


def up(cluster: Cluster) -> None:
    t0 = time.monotonic()
    cluster.up()
    print(f"[demo] control plane ready in {time.monotonic() - t0:.1f}s")
    for f in ("manifests/namespace.yaml", "crds/rftjob.yaml", "manifests/rbac.yaml"):
        kubectl(cluster, "apply", "--server-side", "-f", str(REPO_ROOT / f))
    kubectl(cluster, "wait", "--for=condition=Established", "crd/rftjobs.rft.dev", "--timeout=60s")
    start_operator(cluster)
    print(kubectl(cluster, "apply", "-k", str(REPO_ROOT / "manifests" / "samples")).rstrip())
    watch(cluster, "Running", timeout=180)
    print()
    print(kubectl(cluster, "get", "pods", "-n", NAMESPACE, "-l", f"rft.dev/job={JOB}", "-o", "wide").rstrip())
    print()
    print(f"[demo] {JOB} is Running after {time.monotonic() - t0:.1f}s. Try:")
    print(f"  export KUBECONFIG={cluster.kubeconfig}")
    print(f"  kubectl describe rftjob {JOB}")
    print(f"  kubectl annotate pod {JOB}-trainer-1-1 rft.dev/kwok-exit-code=1   # fail a pod: attempt 2")
    print(f"  kubectl patch rftjob {JOB} --type=merge -p '{{\"spec\":{{\"suspend\":true}}}}'")
    print("  make down")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m e2e.demo")
    ap.add_argument("command", choices=["up", "down"])
    ap.add_argument("--state-dir", default=os.environ.get("RFT_STATE_DIR", DEFAULT_STATE_DIR))
    args = ap.parse_args(argv)
    cluster = Cluster(args.state_dir)
    try:
        if args.command == "up":
            up(cluster)
        else:
            stop_operator(cluster)
            cluster.down()
    except ClusterError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
