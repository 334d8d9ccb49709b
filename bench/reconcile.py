"""Reconcile benchmark: N RFTJobs x P trainer pods on KWOK GPU nodes.

    python bench/reconcile.py [--jobs 100] [--pods 4] [--gpu-nodes 50]

Starts its own local control plane (real kube-apiserver, etcd, scheduler,
controller-manager, KWOK), runs the operator as a subprocess under its ServiceAccount,
creates the jobs as fast as the API server takes them, and reports:
  * create -> phase Running latency (p50/p99/max), measured from a watch on rftjobs
    (a job is Running only once all its pods are Running);
  * API write requests per job made by the operator (its own counter, logged at exit);
  * the operator's peak RSS (sampled every 100 ms);
  * as a baseline measured in the same run, the latency for a single job on the idle
    cluster, so the ratio shows the cost of load rather than of this machine.
No thresholds: it prints numbers.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import kubernetes
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from e2e.cluster import Cluster  # noqa: E402
from e2e.demo import install_api as install  # noqa: E402
from rft_contract import names as c  # noqa: E402


def manifest(name: str, pods: int) -> dict:
    return {
        "apiVersion": c.API_VERSION, "kind": c.KIND, "metadata": {"name": name},
        "spec": {
            "model": {"path": "s3://models/tiny"}, "algorithm": {"name": "grpo"},
            "trainer": {"image": "trainer:bench", "nodes": pods, "gpusPerNode": 1,
                        "totalSteps": 10, "batchSize": 4},
            "checkpoint": {"uri": "s3://ckpt/bench"},
        },
    }


class RunningWatcher(threading.Thread):
    """Records when each object (RFTJob or pod) is first seen Running."""

    def __init__(self, list_fn, *args, key=lambda o: o["metadata"]["name"]):
        super().__init__(daemon=True)
        self.list_fn, self.args, self.key = list_fn, args, key
        self.running_at: dict[str, float] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        # Raw watch lines, decoded with json: the typed client's model decoding would eat
        # the GIL and delay the timestamps we are trying to take.
        while not self.stop.is_set():
            resp = self.list_fn(*self.args, watch=True, timeout_seconds=5, _preload_content=False)
            for line in resp:
                obj = json.loads(line)["object"]
                if (obj.get("status") or {}).get("phase") == c.RUNNING:
                    self.running_at.setdefault(self.key(obj), time.monotonic())
                if self.stop.is_set():
                    break


def sample_rss(pid: int, stop: threading.Event, out: list[int]) -> None:
    proc = psutil.Process(pid)
    while not stop.is_set():
        try:
            out.append(proc.memory_info().rss)
        except psutil.NoSuchProcess:
            return
        time.sleep(0.1)  # sampling period, not synchronisation


def run_wave(api, namespace: str, names: list[str], pods: int, timeout: float):
    """Creates the jobs; returns per job (create->all pods Running, create->job Running)."""
    custom = kubernetes.client.CustomObjectsApi(api)
    jobs = RunningWatcher(custom.list_namespaced_custom_object, c.GROUP, c.VERSION, namespace, c.PLURAL)
    pod_watch = RunningWatcher(kubernetes.client.CoreV1Api(api).list_namespaced_pod, namespace,
                               key=lambda o: o["metadata"]["name"])
    jobs.start()
    pod_watch.start()
    created: dict[str, float] = {}

    def create(name: str) -> None:
        custom.create_namespaced_custom_object(c.GROUP, c.VERSION, namespace, c.PLURAL, manifest(name, pods))
        created[name] = time.monotonic()

    with cf.ThreadPoolExecutor(8) as pool:
        list(pool.map(create, names))
    deadline = time.monotonic() + timeout
    while len(jobs.running_at) < len(names) and time.monotonic() < deadline:
        time.sleep(0.2)
    jobs.stop.set()
    pod_watch.stop.set()
    missing = set(names) - set(jobs.running_at)
    if missing:
        print(f"WARNING: {len(missing)} jobs not Running after {timeout}s, e.g. {sorted(missing)[:3]}")
    out = []
    for n in names:
        if n in missing:
            continue
        pods_at = [t for p, t in pod_watch.running_at.items() if p.startswith(f"{n}-trainer-")]
        out.append((max(pods_at) - created[n] if len(pods_at) == pods else float("nan"),
                    jobs.running_at[n] - created[n]))
    return out


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=100)
    ap.add_argument("--pods", type=int, default=4)
    ap.add_argument("--gpu-nodes", type=int, default=0,
                    help="fake 8-GPU nodes; default: room for every pod plus 10%% (there is no gang "
                         "scheduler, so an over-full cluster strands half-scheduled gangs)")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--profile", metavar="FILE", help="run the operator under cProfile, stats to FILE")
    args = ap.parse_args()
    if args.gpu_nodes <= 0:
        args.gpu_nodes = -(-((args.jobs + 1) * args.pods * 11 // 10) // 8)

    state = Path(tempfile.mkdtemp(prefix="rft-bench-"))
    cluster = Cluster(state)
    t0 = time.monotonic()
    cluster.up(num_gpu_nodes=args.gpu_nodes, gpus_per_node=8)
    print(f"cluster up with {args.gpu_nodes} KWOK nodes in {time.monotonic() - t0:.1f}s")
    kc = str(cluster.kubeconfig)
    install(cluster)
    subprocess.run(["kubectl", f"--kubeconfig={kc}", "create", "namespace", "bench"], check=True,
                   capture_output=True)
    op_kc = cluster.service_account_kubeconfig("rftjob-system", "rftjob-operator", state / "op.kubeconfig")
    log_path = state / "operator.log"
    profile = ["-m", "cProfile", "-o", args.profile] if args.profile else []
    proc = subprocess.Popen([sys.executable, *profile, "-m", "rft_operator", "--log-format=json"],
                            env={**os.environ, "KUBECONFIG": str(op_kc)},
                            stdout=open(log_path, "wb"), stderr=subprocess.STDOUT, cwd=ROOT)
    rss: list[int] = []
    stop = threading.Event()
    threading.Thread(target=sample_rss, args=(proc.pid, stop, rss), daemon=True).start()
    try:
        api = kubernetes.config.new_client_from_config(kc)
        baseline = run_wave(api, "bench", ["baseline"], args.pods, args.timeout)[0][1]
        names = [f"job-{i:04d}" for i in range(args.jobs)]
        t1 = time.monotonic()
        results = run_wave(api, "bench", names, args.pods, args.timeout)
        pod_lat = [p for p, _ in results]
        lat = [j for _, j in results]
        wall = time.monotonic() - t1
        cpu = psutil.Process(proc.pid).cpu_times()
        op_cpu = cpu.user + cpu.system
    finally:
        proc.terminate()
        proc.wait(60)
        stop.set()
        cluster.down()
    m = re.search(r"reconciles=(\d+) api_writes=(\d+) errors=(\d+) write_seconds=([0-9.]+)", log_path.read_text())
    reconciles, writes, errors = (int(x) for x in m.groups()[:3]) if m else (0, 0, -1)
    write_ms = 1000 * float(m.group(4)) / max(1, writes) if m else float("nan")
    total_jobs = args.jobs + 1
    print(f"\n{args.jobs} RFTJobs x {args.pods} pods ({args.jobs * args.pods} pods) on {args.gpu_nodes} KWOK nodes")
    print(f"  baseline (1 job, idle cluster): create->Running {baseline:.2f}s")
    print(f"  create->Running p50 {statistics.median(lat):.2f}s  p99 {pct(lat, 0.99):.2f}s  "
          f"max {max(lat):.2f}s  (p50/baseline {statistics.median(lat) / baseline:.1f}x)")
    lag = [j - p for p, j in results]
    print(f"  create->all pods Running (scheduler + KWOK) p50 {statistics.median(pod_lat):.2f}s  "
          f"p99 {pct(pod_lat, 0.99):.2f}s")
    print(f"  last pod Running->job Running (operator lag) p50 {statistics.median(lag):.2f}s  "
          f"p99 {pct(lag, 0.99):.2f}s")
    print(f"  all {len(lat)} Running within {wall:.1f}s of the first create ({args.jobs / wall:.1f} jobs/s)")
    print(f"  operator: {reconciles / total_jobs:.1f} reconciles/job, {writes / total_jobs:.1f} API writes/job, "
          f"{write_ms:.0f} ms/write, {errors} errors, peak RSS {max(rss) / 2**20:.0f} MiB, CPU {op_cpu:.1f}s "
          f"({1000 * op_cpu / (args.jobs * args.pods):.1f} ms/pod)")
    print(f"  (writes/job floor: 5 static children + {args.pods} pods + 2 status patches + 2 events = {9 + args.pods})")


if __name__ == "__main__":
    main()
