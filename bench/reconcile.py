"""Reconcile benchmark: N jobs x P GPU pods on KWOK, our operator against Kubeflow's
training-operator (the peer) and against bare pods (the floor).

    python bench/reconcile.py [--jobs 100] [--pods 4] [--waves 3] [--peer] [--profile FILE]
                              [--without PART,...] [--json FILE]

Starts its own local control plane (real kube-apiserver, etcd, scheduler,
controller-manager, KWOK nodes with room for one wave). Each wave of each side gets a
fresh namespace and a fresh operator; sides take turns wave by wave, so a load that
comes and goes on the machine hits them alike. A wave: start the operator, run one job on
the idle cluster (the baseline; it also proves the operator is up), then create the N jobs
as fast as the API server takes them (8 client threads) and wait until every job is
Running. Per side it prints:
  * create -> all of the job's pods Running, p50/p99 (watch on pods);
  * create -> the job's status says Running, p50/p99 (watch on the job objects; ours:
    phase Running, once every pod runs; the peer: condition Running, which it sets once
    its master pod runs), and the lag from the last pod Running to that status;
  * API writes per job (the operator's own counter: ours `rftjob_api_writes`, the peer's
    client-go `rest_client_requests_total` for POST/PUT/PATCH/DELETE), read before and
    after the wave;
  * operator CPU per pod over the wave (from the first create until the operator is idle
    again; start-up, imports and the baseline job are printed apart), peak RSS, error lines
    in its log;
and the ratios of ours to the peer and to bare pods, with the goals of issue 38 (pods p99 <=
1.0x the peer and <= 2x bare pods, status lag p99 <= 1 s, CPU per pod <= 1.5x the peer,
writes per job <= 13). No thresholds fail the run
(tests/integration/test_reconcile_guard.py runs a small one and fails on a gross regression
against bare pods).

Ours runs what the default install runs (bench/reconcile_sides.py, `OURS_PARTS`): the
admission policies, the owner webhook served by the operator process (by the leader),
leader election with two replicas, Kueue running (no queues, the jobs not queued); the first
line of the report says so. `--without policies,webhook,leader,kueue-manager,kueue` turns
parts off, for diagnosis (`kueue-manager`: Kueue's CRDs only, not its manager). The table's
admission rows read the API server's own metrics over the wave: the time its admission
policies took per job (all of them, whoever wrote), the owner webhook's calls per job (and
those that got no answer: with failurePolicy Fail the write fails and is retried), and
its mean call.

`--json FILE`: the figures, machine-readable (per side p50/p99 of both latencies, jobs,
jobs not Running, writes, CPU, errors; the ratios of ours to bare pods and to the peer).

The peer is built from the Go module proxy on first use (`bash e2e/build-binaries.sh
training_operator`, cached under $RFT_CACHE) and run with 16 threads and no client QPS cap
(`--controller-threads=16 --kube-api-qps=1000 --kube-api-burst=2000`).

`--profile FILE`: py-spy samples our operator during an extra wave, left out of the figures
(raw collapsed stacks to FILE), and the top functions by own and inclusive samples are printed.
Only the thread holding the GIL is sampled (`--gil`): the samples are where the Python CPU
goes, not where threads wait.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures as cf
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import kubernetes
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from e2e.cluster import Cluster  # noqa: E402
from e2e.demo import kubectl  # noqa: E402
from rft_contract import names  # noqa: E402
from reconcile_sides import OURS_PARTS, Bare, Ours, Peer, Side  # noqa: E402

# ------------------------------------------------------------------ watching


class Watcher(threading.Thread):
    """Records when each object first satisfies `pred`: a list, then a watch resumed from
    the last resourceVersion seen (raw JSON lines: decoding into the typed client's models
    would eat the GIL and delay the timestamps we are taking)."""

    def __init__(self, list_fn: Callable[..., Any], pred: Callable[[dict], bool], label: str = ""):
        super().__init__(daemon=True)
        self.list_fn, self.pred, self.label = list_fn, pred, label
        self.seen: dict[str, float] = {}
        self.group: dict[str, str] = {}  # object name -> value of `label` (the job of a pod)
        self.stop = threading.Event()
        self.listed = threading.Event()

    def _see(self, obj: dict, now: float) -> None:
        name = obj["metadata"]["name"]
        if self.label:
            self.group[name] = (obj["metadata"].get("labels") or {}).get(self.label, "")
        if name not in self.seen and self.pred(obj):
            self.seen[name] = now

    def run(self) -> None:
        rv = None
        while not self.stop.is_set():
            try:
                if rv is None:
                    listing = json.loads(self.list_fn(_preload_content=False).data)
                    now = time.monotonic()
                    for obj in listing["items"]:
                        self._see(obj, now)
                    rv = listing["metadata"]["resourceVersion"]
                    self.listed.set()
                resp = self.list_fn(watch=True, resource_version=rv, timeout_seconds=10,
                                    allow_watch_bookmarks=True, _preload_content=False)
                for line in resp:
                    event = json.loads(line)
                    if event["type"] == "ERROR":  # 410 Gone: list again
                        rv = None
                        break
                    rv = event["object"]["metadata"]["resourceVersion"]
                    if event["type"] in ("ADDED", "MODIFIED"):
                        self._see(event["object"], time.monotonic())
                    if self.stop.is_set():
                        break
            except Exception as e:  # a dropped watch: resume from rv
                print(f"  (watch restarted: {type(e).__name__})", file=sys.stderr)


def pod_running(obj: dict) -> bool:
    return (obj.get("status") or {}).get("phase") == "Running"


# ------------------------------------------------------------------ one wave


@dataclass
class Totals:
    """One side's figures, summed over its waves."""

    pods_lat: list[float] = field(default_factory=list)  # create -> all pods Running
    status_lat: list[float] = field(default_factory=list)  # create -> job status Running
    lag: list[float] = field(default_factory=list)  # last pod Running -> job status Running
    baseline: list[float] = field(default_factory=list)
    missing: int = 0
    jobs: int = 0
    pods: int = 0
    writes: int = 0
    cpu: float = 0.0  # seconds, over the waves
    cpu_start: list[float] = field(default_factory=list)  # start-up + baseline job, per wave
    rss: int = 0
    errors: int = 0
    reconciles: int = 0
    admission: collections.Counter = field(default_factory=collections.Counter)  # API server's, over the waves


def run_jobs(side: Side, api, namespace: str, jobs: list[str], pods: int, timeout: float):
    """Creates the jobs; returns per job (create -> all pods Running, create -> status
    Running or None) and how many did not get there in time."""
    core = kubernetes.client.CoreV1Api(api)
    pod_watch = Watcher(lambda **kw: core.list_namespaced_pod(namespace, **kw), pod_running, side.job_label)
    list_jobs = side.list_jobs(api, namespace)
    job_watch = Watcher(list_jobs, side.job_running) if list_jobs else None
    for w in (pod_watch, job_watch):
        if w:
            w.start()
            w.listed.wait(30)
    created: dict[str, float] = {}

    def create(name: str) -> None:
        t = time.monotonic()
        side.create(api, namespace, name, pods)
        created[name] = t

    with cf.ThreadPoolExecutor(8) as pool:
        list(pool.map(create, jobs))

    def running_pods() -> collections.Counter:
        return collections.Counter(pod_watch.group.get(p) for p in list(pod_watch.seen))

    def done() -> bool:
        counts = running_pods()
        return (all(counts[n] >= pods for n in jobs)
                and (job_watch is None or all(n in job_watch.seen for n in jobs)))

    deadline = time.monotonic() + timeout
    while not done() and time.monotonic() < deadline:
        time.sleep(0.1)  # polling what the watch threads recorded
    for w in (pod_watch, job_watch):
        if w:
            w.stop.set()
    out, missing = [], 0
    by_job: dict[str, list[float]] = collections.defaultdict(list)
    for p, t in list(pod_watch.seen.items()):
        by_job[pod_watch.group.get(p, "")].append(t)
    for n in jobs:
        if len(by_job[n]) < pods or (job_watch and n not in job_watch.seen):
            missing += 1
            continue
        status = job_watch.seen[n] - created[n] if job_watch else None
        out.append((max(by_job[n]) - created[n], status))
    return out, missing


def cpu_seconds(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def wait_idle(proc: psutil.Process, timeout: float = 20.0) -> None:
    """Until the operator has used under 10 ms of CPU in the last second (it finishes its
    queue, e.g. the last status writes), so the wave's CPU is all counted."""
    deadline, last = time.monotonic() + timeout, cpu_seconds(proc)
    while time.monotonic() < deadline:
        time.sleep(1.0)  # sampling CPU time, not synchronisation
        now = cpu_seconds(proc)
        if now - last < 0.01:
            return
        last = now


def sample_rss(pid: int, stop: threading.Event, out: list[int]) -> None:
    try:
        proc = psutil.Process(pid)
        while not stop.is_set():
            out.append(proc.memory_info().rss)
            time.sleep(0.1)  # sampling period, not synchronisation
    except psutil.NoSuchProcess:
        return


OURS_HOOK = 'name="rftjob-operator-owner[^}]*'
ADMISSION_METRICS = {  # the API server's /metrics: what is summed (regular expressions, one value each)
    # Every evaluation of every admission policy (the ValidatingAdmissionPolicy plugin's time).
    "policy_seconds": r"^apiserver_admission_controller_admission_duration_seconds_sum"
                      r'\{name="ValidatingAdmissionPolicy",[^}]*\} (\S+)$',
    "webhook_calls": r"^apiserver_admission_webhook_admission_duration_seconds_count\{" + OURS_HOOK + r"\} (\S+)$",
    "webhook_seconds": r"^apiserver_admission_webhook_admission_duration_seconds_sum\{" + OURS_HOOK + r"\} (\S+)$",
    # Calls that got no answer (refused connection, EOF, timeout): the write fails (failurePolicy Fail).
    "webhook_failures":
        r'^apiserver_admission_webhook_rejection_count\{error_type="(?!no_error)[^"]*",' + OURS_HOOK + r"\} (\S+)$",
}


def admission(cluster: Cluster) -> collections.Counter:
    """Seconds in admission policies, owner-webhook calls (their seconds, those that got no
    answer) so far, from the API server's metrics."""
    text = kubectl(cluster, "get", "--raw", "/metrics", check=False)
    return collections.Counter({k: sum(float(x) for x in re.findall(rx, text, re.M))
                                for k, rx in ADMISSION_METRICS.items()})


def run_wave(side: Side, cluster: Cluster, api, wave: int | str, args, totals: Totals, profile: str | None,
             cleanup: bool = True) -> None:
    namespace = f"{side.name}-{wave}"
    kubectl(cluster, "create", "namespace", namespace)
    kubectl(cluster, "label", "namespace", namespace, f"{names.PSA_ENFORCE_LABEL}=baseline")  # job pods need it
    rss: list[int] = []
    stop = threading.Event()
    proc = None
    spy = None
    try:
        if side.has_operator:
            side.start(wave)
            proc = psutil.Process(side.proc.pid)
            threading.Thread(target=sample_rss, args=(side.proc.pid, stop, rss), daemon=True).start()
        base, missing = run_jobs(side, api, namespace, ["baseline"], args.pods, 120)
        if base:
            totals.baseline.append(base[0][1] if base[0][1] is not None else base[0][0])
        cpu0, writes0 = (cpu_seconds(proc), side.writes()) if proc else (0.0, 0)
        adm0 = admission(cluster)
        if profile and proc:
            # --gil: only the thread holding the GIL, i.e. where the Python CPU goes.
            spy = subprocess.Popen(["py-spy", "record", "--pid", str(proc.pid), "--rate", "200", "--gil",
                                    "--format", "raw", "--output", profile, "--nonblocking"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        jobs = [f"job-{i:04d}" for i in range(args.jobs)]
        results, missing = run_jobs(side, api, namespace, jobs, args.pods, args.timeout)
        if proc:
            wait_idle(proc)
            totals.cpu += cpu_seconds(proc) - cpu0
            totals.cpu_start.append(cpu0)
            totals.writes += side.writes() - writes0
        totals.admission.update(admission(cluster) - adm0)
        if spy:
            spy.send_signal(signal.SIGINT)
            spy.wait(60)
    finally:
        stop.set()
        if side.has_operator:
            side.stop()
    totals.rss = max([totals.rss, *rss])
    totals.missing += missing
    totals.jobs += len(results)
    totals.pods += len(results) * args.pods
    for pods_at, status_at in results:
        totals.pods_lat.append(pods_at)
        if status_at is not None:
            totals.status_lat.append(status_at)
            totals.lag.append(status_at - pods_at)
    if side.has_operator:
        errors = side.error_lines()
        totals.errors += len(errors)
        for line in errors[:3]:
            print(f"  {side.name} wave {wave} error: {line[:300]}")
        if isinstance(side, Ours):
            totals.reconciles += side.reconciles()
    print(f"  wave {wave} {side.name}: {len(results)} jobs, create -> all pods Running p50 "
          f"{pct([p for p, _ in results], 0.5):.2f}s" + (f", {missing} not Running in time" if missing else ""),
          flush=True)
    if cleanup:  # the next wave starts on an empty cluster
        kubectl(cluster, "delete", "namespace", namespace, "--wait=true", "--timeout=600s")


# ------------------------------------------------------------------ report


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def report(args, totals: dict[str, Totals], nodes: int, ours_install: str = "") -> None:
    sides = list(totals)
    print(f"\n{args.jobs} jobs x {args.pods} pods, {args.waves} wave(s) per side, sides interleaved; "
          f"{nodes} KWOK nodes x {args.gpus_per_node} GPUs; {os.cpu_count()} cores, load average at the end "
          f"{os.getloadavg()[0]:.1f} (other work on the machine shows here)")
    if ours_install:
        print(f"  ours: {ours_install}")

    def ms(x: float) -> str:
        return f"{1000 * x:.1f} ms"

    rows: list[tuple[str, Callable[[Totals], str]]] = [
        ("create -> all pods Running p50 / p99", lambda t: f"{pct(t.pods_lat, .5):.2f} / {pct(t.pods_lat, .99):.2f} s"),
        ("create -> job status Running p50 / p99",
         lambda t: f"{pct(t.status_lat, .5):.2f} / {pct(t.status_lat, .99):.2f} s" if t.status_lat else "-"),
        ("last pod Running -> status p50 / p99",
         lambda t: f"{pct(t.lag, .5):.2f} / {pct(t.lag, .99):.2f} s" if t.lag else "-"),
        ("baseline: 1 job, idle cluster", lambda t: f"{statistics.median(t.baseline):.2f} s" if t.baseline else "-"),
        ("API writes per job", lambda t: f"{t.writes / t.jobs:.1f}" if t.cpu else "-"),
        ("operator CPU per pod (wave)", lambda t: ms(t.cpu / t.pods) if t.cpu else "-"),
        ("operator CPU at start + baseline", lambda t: f"{statistics.median(t.cpu_start):.2f} s" if t.cpu_start else "-"),
        ("operator peak RSS", lambda t: f"{t.rss / 2**20:.0f} MiB" if t.rss else "-"),
        ("error lines in its log", lambda t: str(t.errors) if t.cpu else "-"),
        # (per job created: a job that never ran made its writes too)
        ("admission policies: time per job", lambda t: ms(t.admission["policy_seconds"] / (t.jobs + t.missing))),
        ("owner webhook: calls / unanswered per job",
         lambda t: f"{t.admission['webhook_calls'] / (t.jobs + t.missing):.1f} / "
                   f"{t.admission['webhook_failures'] / (t.jobs + t.missing):.1f}"
         if t.admission["webhook_calls"] else "-"),
        ("owner webhook: mean call", lambda t: ms(t.admission["webhook_seconds"] / t.admission["webhook_calls"])
         if t.admission["webhook_calls"] else "-"),
        ("jobs not Running in time", lambda t: str(t.missing)),
    ]
    print(f"  {'':40s}" + "".join(f"{s:>18s}" for s in sides))
    for label, fn in rows:
        print(f"  {label:40s}" + "".join(f"{fn(totals[s]) if totals[s].jobs else '-':>18s}" for s in sides))
    ours = totals.get("ours")
    if ours and ours.reconciles:
        print(f"  ours: {ours.reconciles / (ours.jobs + args.waves):.1f} reconciles per job")
    peer, bare = totals.get("peer"), totals.get("bare")
    if ours and ours.jobs and peer and peer.jobs:
        p99 = pct(ours.pods_lat, .99) / pct(peer.pods_lat, .99)
        cpu = (ours.cpu / ours.pods) / (peer.cpu / peer.pods)
        print("\n  ours / peer:")
        print(f"    create -> all pods Running  p50 {pct(ours.pods_lat, .5) / pct(peer.pods_lat, .5):.2f}x  "
              f"p99 {p99:.2f}x   (goal p99 <= 1.0x: {'met' if p99 <= 1.0 else 'NOT met'})")
        print(f"    create -> status Running    p50 {pct(ours.status_lat, .5) / pct(peer.status_lat, .5):.2f}x  "
              f"p99 {pct(ours.status_lat, .99) / pct(peer.status_lat, .99):.2f}x")
        print(f"    operator CPU per pod        {cpu:.2f}x   (goal <= 1.5x: {'met' if cpu <= 1.5 else 'NOT met'})")
        print(f"    API writes per job          {(ours.writes / ours.jobs) / (peer.writes / peer.jobs):.2f}x")
        print(f"    peak RSS                    {ours.rss / peer.rss:.2f}x")
    if ours and ours.jobs:
        lag99, writes = pct(ours.lag, .99), ours.writes / ours.jobs
        print(f"  ours: status within 1 s of the last pod Running at p99: {lag99:.2f} s "
              f"({'met' if lag99 <= 1.0 else 'NOT met'}); writes per job {writes:.1f} "
              f"(goal <= 13: {'met' if writes <= 13 else 'NOT met'})")
        if bare and bare.jobs:
            p99 = pct(ours.pods_lat, .99) / pct(bare.pods_lat, .99)
            print(f"  ours / bare pods: create -> all pods Running p50 "
                  f"{pct(ours.pods_lat, .5) / pct(bare.pods_lat, .5):.2f}x  "
                  f"p99 {p99:.2f}x   (goal p99 <= 2x: {'met' if p99 <= 2 else 'NOT met'})")


def figures(args, totals: dict[str, Totals], nodes: int, ours_install: str) -> dict[str, Any]:
    """What --json writes: per side and the ratios (None where a side did not run)."""
    def side(t: Totals) -> dict[str, Any]:
        return {"jobs": t.jobs, "missing": t.missing,
                "pods_p50": pct(t.pods_lat, .5), "pods_p99": pct(t.pods_lat, .99),
                "status_p50": pct(t.status_lat, .5) if t.status_lat else None,
                "status_p99": pct(t.status_lat, .99) if t.status_lat else None,
                "baseline": statistics.median(t.baseline) if t.baseline else None,
                "writes_per_job": t.writes / t.jobs if t.jobs and t.cpu else None,
                "cpu_per_pod_s": t.cpu / t.pods if t.pods and t.cpu else None,
                "rss_bytes": t.rss or None, "errors": t.errors,
                "admission": {k: t.admission[k] for k in ADMISSION_METRICS}}

    def ratios(a: Totals | None, b: Totals | None) -> dict[str, float] | None:
        if not (a and a.jobs and b and b.jobs):
            return None
        return {"pods_p50": pct(a.pods_lat, .5) / pct(b.pods_lat, .5),
                "pods_p99": pct(a.pods_lat, .99) / pct(b.pods_lat, .99)}

    ours = totals.get("ours")
    return {"jobs": args.jobs, "pods": args.pods, "waves": args.waves, "nodes": nodes, "cores": os.cpu_count(),
            "load_average": os.getloadavg()[0], "ours_install": ours_install,
            "sides": {name: side(t) for name, t in totals.items()},
            "ours_over_bare": ratios(ours, totals.get("bare")), "ours_over_peer": ratios(ours, totals.get("peer"))}


def summarize_profile(path: str, top: int = 25) -> None:
    """py-spy's raw output: one `frame;frame;... count` line per distinct stack."""
    own, incl, total = collections.Counter(), collections.Counter(), 0
    for line in Path(path).read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack:
            continue
        count = int(n)
        frames = [re.sub(r":\d+\)$", ")", f) for f in stack.split(";")]  # per function, not line
        total += count
        own[frames[-1]] += count
        for f in set(frames):
            incl[f] += count
    print(f"\nprofile {path}: {total} samples")
    for title, counter in (("own", own), ("inclusive", incl)):
        print(f"  top {top} by {title} samples:")
        for f, n in counter.most_common(top):
            print(f"    {100 * n / max(1, total):5.1f}%  {f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=100)
    ap.add_argument("--pods", type=int, default=4)
    ap.add_argument("--waves", type=int, default=3, help="waves per side (each a fresh namespace and operator)")
    ap.add_argument("--peer", action="store_true", help="also run Kubeflow's training-operator (built on first use)")
    ap.add_argument("--sides", default="ours,bare", help="comma-separated: ours, peer, bare")
    ap.add_argument("--gpu-nodes", type=int, default=0,
                    help="fake 8-GPU nodes; default: room for one wave's pods plus 10%% (there is no gang "
                         "scheduler, so an over-full cluster strands half-scheduled gangs)")
    ap.add_argument("--gpus-per-node", type=int, default=8,
                    help="GPUs of each fake node (more, fewer nodes: 1,000 jobs need ~70 nodes of 64, which KWOK "
                         "keeps Ready on 2 cores, rather than 551 of 8)")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--profile", metavar="FILE", help="py-spy our operator's first wave; raw stacks to FILE")
    ap.add_argument("--without", default="", metavar="PART,...",
                    help="diagnosis: ours without these parts of the default install: "
                         + ", ".join(OURS_PARTS) + " (kueue-manager: Kueue's CRDs only)")
    ap.add_argument("--json", metavar="FILE", help="also write the figures to FILE as JSON")
    args = ap.parse_args()
    sides = [s for s in args.sides.split(",") if s] + (["peer"] if args.peer and "peer" not in args.sides else [])
    without = tuple(p for p in args.without.split(",") if p)
    if set(without) - set(OURS_PARTS):
        ap.error(f"--without: unknown {', '.join(sorted(set(without) - set(OURS_PARTS)))}; "
                 f"the parts are {', '.join(OURS_PARTS)}")
    if args.gpu_nodes <= 0:
        args.gpu_nodes = -(-((args.jobs + 1) * args.pods * 11 // 10) // args.gpus_per_node)

    state = Path(tempfile.mkdtemp(prefix="rft-bench-"))
    cluster = Cluster(state)
    t0 = time.monotonic()
    cluster.up(num_gpu_nodes=args.gpu_nodes, gpus_per_node=args.gpus_per_node)
    print(f"cluster up with {args.gpu_nodes} KWOK nodes in {time.monotonic() - t0:.1f}s (state in {state})")
    kinds = {"ours": lambda c, st: Ours(c, st, without=without), "peer": Peer, "bare": Bare}
    sides = [kinds[n](cluster, state) for n in sides]
    totals = {s.name: Totals() for s in sides}
    ours = next((s for s in sides if isinstance(s, Ours)), None)
    ours_install = ours.describe() if ours else ""
    if ours:
        print(f"ours: {ours_install}", flush=True)
    try:
        for s in sides:
            s.install()
        api = kubernetes.config.new_client_from_config(str(cluster.kubeconfig))
        if args.profile and ours:  # a wave of its own: the sampler slows the machine down
            run_wave(ours, cluster, api, "profiled", args, Totals(), args.profile)
        for wave in range(args.waves):
            order = sides[wave % len(sides):] + sides[:wave % len(sides)]
            for s in order:
                last = wave == args.waves - 1 and s is order[-1]
                run_wave(s, cluster, api, wave, args, totals[s.name], None, cleanup=not last)
    finally:
        for s in sides:
            try:
                s.close()
            except Exception as e:  # noqa: BLE001 - the cluster goes down regardless
                print(f"  {s.name}: stopping failed: {e}", file=sys.stderr)
        cluster.down()
    report(args, totals, args.gpu_nodes, ours_install)
    if args.json:
        Path(args.json).write_text(json.dumps(figures(args, totals, args.gpu_nodes, ours_install), indent=1))
    if args.profile and Path(args.profile).exists():
        summarize_profile(args.profile)


if __name__ == "__main__":
    main()
