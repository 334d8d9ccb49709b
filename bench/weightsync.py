"""Weight-sync benchmark: how long from the start of a version's export to every
inference replica serving it, for 1, 2, 4 and 8 replicas, on the S3 path and the fast
path side by side, and how many API reads the explorer makes per 1,000 completions.

    python bench/weightsync.py [--replicas 1,2,4,8] [--versions 3] [--paths s3,fast]
                               [--hidden 512 --layers 8] [--dtype fp32|bf16] [--fanout 2]
                               [--completions 200] [--out .local/bench/weightsync.json]
    python bench/weightsync.py --engine vllm [--replicas 1,2] [--versions 3]   (bench/vllm_reload.py)

As pods run it: a local control plane (KWOK inference pods), the operator as a subprocess
under its ServiceAccount, a SeaweedFS S3 server (e2e/s3server.py, the tests' server), and
per inference pod two processes, `python -m rft_serving.serve` (the reference engine) and
`python -m rft_serving.sync_agent --peer-port --fanout 2` with a token bound to its pod.
This process is trainer rank 0: the real exporter (export_hf through WeightExporter, wired
as the Trainer wires it) reporting as the trainer's ServiceAccount, with its weights
server on loopback for the fast path. For each replica count a fresh RFTJob is created,
the replicas converge to the base model (version 0), then versions alternate between the
paths: t0 is taken when the export starts, the end is the first watch event with
`status.weightSync.synced == "N/N"` at that version.

  s3    the export uploads every file, commits the manifest, then reports latestWeights;
        replica 0 reads S3, the others their parent in the relay tree
  fast  the export writes the files locally and announces the version (the trainer's
        server, the manifest's digest) as soon as the last one is written; replica 0
        streams it from the trainer, the others from their parent, while the upload runs

Columns (medians over the versions; seconds unless said):
  e2e        t0 -> all N replicas counted as serving the version
  raw        one version through S3 to one replica in plain boto3 (upload_file and
             download_file with the agents' 64 MiB parts, then from_pretrained in fp32, as
             the reference server loads on CPU), measured right before each pair of versions
  x raw      e2e / raw. The S3 path cannot beat 1 by much (it pays the upload, the
             download and the load in sequence); the fast path can, since the replicas'
             download overlaps the upload
  S3 MiB     bytes the agents read from S3 for that version (each agent's
             rft_sync_agent_fetched_bytes{source="s3"}); `x model` divides by its size
  announced  t0 -> the fast path's announcement (the files written and hashed locally)
  committed  t0 -> the manifest in S3 (the export's end)
  promote    t0 -> the operator's status.weightSync.target shows the version
  then the critical path, i.e. the replica whose entry became visible last:
  download, verify, reload   its own downloadSeconds/verifySeconds/reloadSeconds
  rest       target visible -> its entry visible, less its loadSeconds: the agent's watch
             noticing the target, and its report reaching ours
  count      last entry visible -> operator's synced == "N/N"
Where the CPU went (per version, t0 -> all serving; CPU seconds from /proc): the agents, the
engines, this process (the trainer's export, its weights server and upload), the S3 server,
the operator, and the rest (API server, etcd, KWOK, the kernel's own threads); `busy`: the
share of the machine's cores in use over the version, near 1.0 when the sync is CPU-bound.
The explorer's reads: `--completions` requests to replica 0 through rft_rollout's
InferenceClient, the versions read around each (the engine reports none, as vLLM 0.32),
once through the agents' records (explorer.ReplicaRecords) and once through the job's
status (KubeProgress.replica_version, the way before); API requests counted at the
explorer's client, as the explorer's ServiceAccount.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import boto3
import kubernetes
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from e2e.cluster import Cluster  # noqa: E402
from e2e.demo import install_api  # noqa: E402
from e2e.s3server import S3Server  # noqa: E402
from rft_contract import names  # noqa: E402
from rft_trainer.export import FastPath, WeightExporter, export_hf  # noqa: E402
from rft_trainer.parallelize import Runtime  # noqa: E402
from rft_trainer.reporting import StatusReporter  # noqa: E402
from rft_contract.s3 import S3Storage, split_uri  # noqa: E402
from rft_contract.relay import PeerServer  # noqa: E402
from rft_rollout.explorer import KubeProgress, ReplicaRecords  # noqa: E402
from rft_rollout import rollouts  # noqa: E402
from rft_rollout.rollouts import InferenceClient  # noqa: E402
from tests.fixtures.models import save_tiny_model  # noqa: E402

NS = "bench-ws"
PHASES = ("announced", "committed", "promote", "download", "verify", "reload", "rest", "count")
CPU_ROLES = ("agents", "engines", "trainer", "s3", "operator", "rest")
PIDS: dict[str, int] = {}  # the S3 server's and the operator's, once started


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process (all its threads) so far; 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def machine_cpu() -> tuple[float, float]:
    """(busy, all) CPU seconds of the whole machine so far (/proc/stat), every core."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = ticks[3] + ticks[4]  # idle, iowait
    total = sum(ticks[:8])  # guest time is counted inside user already
    hz = os.sysconf("SC_CLK_TCK")
    return (total - idle) / hz, total / hz


class CpuMeter:
    """CPU seconds by role between `start` and `stop` (CPU_ROLES), and the machine's busy share."""

    def __init__(self, replicas: list["Replica"]):
        self.pids = {"agents": [r.procs[1].pid for r in replicas], "engines": [r.procs[0].pid for r in replicas],
                     "trainer": [os.getpid()], "s3": [PIDS["s3"]] if "s3" in PIDS else [],
                     "operator": [PIDS["operator"]] if "operator" in PIDS else []}

    def _read(self) -> tuple[dict[str, float], tuple[float, float]]:
        return {role: sum(cpu_seconds(p) for p in pids) for role, pids in self.pids.items()}, machine_cpu()

    def start(self) -> None:
        self._start = self._read()

    def stop(self) -> dict:
        (roles0, (busy0, all0)), (roles1, (busy1, all1)) = self._start, self._read()
        out = {role: roles1[role] - roles0[role] for role in roles0}
        out["rest"] = max(0.0, busy1 - busy0 - sum(out.values()))
        out["busy"] = (busy1 - busy0) / max(1e-9, all1 - all0)
        return out


def start_s3(data_dir: Path) -> S3Server:
    """The S3 server, with this process's (and the operator's) environment pointing at it."""
    key, secret = "bench", "bench-secret"
    server = S3Server(data_dir, credentials={key: secret}).start()
    os.environ.update({"AWS_ENDPOINT_URL": server.endpoint, "AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret,
                       "AWS_REGION": "us-east-1", "AWS_DEFAULT_REGION": "us-east-1"})
    return server


class JobWatch(threading.Thread):
    """A watch on one RFTJob recording when things first became visible. Raw lines decoded
    with json (as bench/reconcile.py does): cheaper than the typed client, and a watch
    timestamps each change as it arrives instead of up to one poll interval late."""

    def __init__(self, api, job: str, n: int):
        super().__init__(daemon=True)
        self.custom, self.job, self.n = kubernetes.client.CustomObjectsApi(api), job, n
        self.target_at: dict[int, float] = {}
        self.entry_at: dict[tuple[str, int], tuple[float, dict]] = {}
        self.synced_at: dict[int, float] = {}
        self.cond = threading.Condition()
        self.stop = threading.Event()

    def run(self) -> None:
        rv = None
        while not self.stop.is_set():
            try:
                resp = self.custom.list_namespaced_custom_object(
                    names.GROUP, names.VERSION, NS, names.PLURAL, field_selector=f"metadata.name={self.job}", watch=True,
                    resource_version=rv, timeout_seconds=10, _preload_content=False)
                for line in resp:
                    t = time.monotonic()
                    ev = json.loads(line)
                    if ev["type"] == "ERROR":
                        rv = None
                        break
                    rv = ev["object"]["metadata"]["resourceVersion"]
                    self.observe(ev["object"].get("status") or {}, t)
                    if self.stop.is_set():
                        return
            except Exception:  # noqa: BLE001 - reconnect
                time.sleep(0.2)

    def observe(self, status: dict, t: float) -> None:
        ws = status.get("weightSync") or {}
        target = ws.get("target") or {}
        v = target.get("version")
        if v is None:
            return
        with self.cond:
            self.target_at.setdefault(v, t)
            for pod, e in (ws.get("replicas") or {}).items():
                if e and e.get("version") == v and e.get("id") == target.get("id") and not e.get("error"):
                    self.entry_at.setdefault((pod, v), (t, e))
            if ws.get("synced") == f"{self.n}/{self.n}":
                self.synced_at.setdefault(v, t)
            self.cond.notify_all()

    def wait_synced(self, v: int, timeout: float) -> float:
        with self.cond:
            if not self.cond.wait_for(lambda: v in self.synced_at, timeout):
                raise TimeoutError(f"{self.job}: {self.n}/{self.n} replicas not at version {v} after {timeout}s")
            return self.synced_at[v]


def save_models(args, tmp: Path, bucket: str, count: int) -> list[Path]:
    """The base model (as a user uploads it: no manifest) in S3, and `count` model
    directories the versions cycle through (untimed)."""
    shape = dict(hidden=args.hidden, layers=args.layers, intermediate=args.intermediate or 3 * args.hidden)
    s3 = S3Storage()
    base = save_tiny_model(tmp / "base", seed=0, **shape)
    for f in base.iterdir():
        s3.write_bytes(f"s3://{bucket}/base/{f.name}", f.read_bytes())
    return [save_tiny_model(tmp / f"model-{k}", seed=k + 1, **shape) for k in range(count)]


def baseline(uri: str, tmp: Path, transfer=None) -> dict:
    """The raw cost of one version going through S3 to one replica, in plain boto3: the
    download_file of every object (listing included), their upload_file back under a
    scratch prefix (what a trainer's upload of the version costs), and from_pretrained in
    fp32 (what the reference server does on CPU)."""
    from transformers import AutoModelForCausalLM

    s3 = boto3.client("s3")
    bucket, prefix = split_uri(uri)
    d = Path(tempfile.mkdtemp(dir=tmp))
    kw = {"Config": transfer} if transfer else {}
    t = time.perf_counter()
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix=prefix + "/")["Contents"]]
    for key in keys:
        s3.download_file(bucket, key, str(d / key[len(prefix) + 1:]), **kw)
    t_dl = time.perf_counter()
    for key in keys:
        s3.upload_file(str(d / key[len(prefix) + 1:]), bucket, f"baseline/{key[len(prefix) + 1:]}", **kw)
    t_up = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32)
    t_load = time.perf_counter()
    del model
    shutil.rmtree(d)
    return {"download": t_dl - t, "upload": t_up - t_dl, "load": t_load - t_up, "total": t_load - t}


def job_manifest(name: str, bucket: str, n: int) -> dict:
    return {"apiVersion": names.API_VERSION, "kind": names.KIND, "metadata": {"name": name}, "spec": {
        "model": {"path": f"s3://{bucket}/base"}, "algorithm": {"name": "grpo"},
        "trainer": {"image": "trainer:bench", "nodes": 1, "gpusPerNode": 0, "totalSteps": 100, "batchSize": 4},
        "checkpoint": {"uri": f"s3://{bucket}/{name}", "endpoint": os.environ["AWS_ENDPOINT_URL"]},
        "inference": {"replicas": n, "gpusPerReplica": 0},
        # A KWOK explorer pod: its ServiceAccount is what the API-read count runs as.
        "explorer": {"replicas": 1, "tasksetUri": f"s3://{bucket}/arith.jsonl", "rolloutsPerTask": 4}}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Replica:
    """One inference pod's two containers as two processes, as the pod runs them: the
    reference server (`python -m rft_serving.serve`) and its sync agent (`python -m
    rft_serving.sync_agent --peer-port --fanout`, with a token bound to its pod)."""

    def __init__(self, job: str, i: int, kubeconfig: Path, tmp: Path, fanout: int, stack: contextlib.ExitStack,
                 threads: int = 0):
        self.pod = names.inference_pod_name(job, i)
        self.engine_url = f"http://127.0.0.1:{free_port()}"
        self.peer_port, self.metrics_port = free_port(), free_port()
        env = {**os.environ, "KUBECONFIG": str(kubeconfig), "RFT_POD_IP": "127.0.0.1",
               "RFT_METRICS_PORT": str(self.metrics_port),
               "PYTHONPATH": os.pathsep.join(str(ROOT / d) for d in ("contract", "trainer_image", "."))}
        logs = tmp / "logs"
        logs.mkdir(exist_ok=True)
        self.procs = [
            subprocess.Popen([sys.executable, "-m", "rft_serving.serve", "--host", "127.0.0.1",
                              "--port", self.engine_url.rsplit(":", 1)[1], "--max-concurrency", "1",
                              "--threads", str(threads)],
                             env=env, stdout=open(logs / f"{self.pod}-engine.log", "wb"), stderr=subprocess.STDOUT),
            subprocess.Popen([sys.executable, "-m", "rft_serving.sync_agent", "--engine", "reference",
                              "--engine-url", self.engine_url, "--dest", str(tmp / job / self.pod), "--job", job,
                              "--namespace", NS, "--pod", self.pod, "--peer-port", str(self.peer_port),
                              "--fanout", str(fanout)],
                             env=env, stdout=open(logs / f"{self.pod}-agent.log", "wb"), stderr=subprocess.STDOUT)]
        for p in self.procs:
            stack.callback(_end, p)


    def fetched(self) -> dict[str, float]:
        """The agent's rft_sync_agent_fetched_bytes by source (its /metrics)."""
        import requests

        out = {"s3": 0.0, "peer": 0.0}
        text = requests.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).text
        for line in text.splitlines():
            if line.startswith("rft_sync_agent_fetched_bytes_total{"):
                source = line.split('source="', 1)[1].split('"', 1)[0]
                out[source] = float(line.rsplit(" ", 1)[1])
        return out


def fetched_delta(replicas: list[Replica], before: list[dict], size: int, timeout: float = 30) -> float:
    """S3 bytes the agents fetched since `before`, once every agent counted a whole version
    (s3 + peer = its size: the count follows the status entry by a moment)."""
    deadline = time.monotonic() + timeout
    while True:
        now = [r.fetched() for r in replicas]
        if all(a["s3"] + a["peer"] - b["s3"] - b["peer"] >= size for a, b in zip(now, before)) \
                or time.monotonic() > deadline:
            return sum(a["s3"] - b["s3"] for a, b in zip(now, before))
        time.sleep(0.1)


def _end(p: subprocess.Popen) -> None:
    p.terminate()
    try:
        p.wait(10)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


class Trainer:
    """Trainer rank 0's side in this process: the real exporter (export_hf through
    WeightExporter, as rft_trainer.trainer.Trainer wires it) on the S3 path or the fast
    path (its weights server on loopback), reporting as the trainer's ServiceAccount."""

    def __init__(self, reporter: StatusReporter, root: str, dtype: str, tmp: Path, models: list[Path]):
        from transformers import AutoModelForCausalLM

        self.reporter, self.root, self.dtype = reporter, root, dtype
        self.models = [(str(d), AutoModelForCausalLM.from_pretrained(str(d))) for d in models]
        self.rt = Runtime(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
        (tmp / "trainer-weights").mkdir(exist_ok=True)
        server = PeerServer(tmp / "trainer-weights", host="127.0.0.1").start()
        self.fast = FastPath(tmp / "trainer-weights", server, f"http://127.0.0.1:{server.port}")
        self.announced: dict[int, dict] = {}
        self.announced_at: dict[int, float] = {}
        self.bytes: dict[int, int] = {}

    def exporter(self, fast: bool) -> WeightExporter:
        def write(storage, dest, dtype, stage=None):
            version = int(dest.rstrip("/").rsplit("-", 1)[-1])
            model_dir, model = self.models[version % len(self.models)]
            m = export_hf(model, self.rt, storage, dest, model_dir, version, dtype=dtype, stage=stage)
            self.bytes[version] = m["bytes"]
            return m

        def on_announce(step, uri, manifest, announced):
            self.announced_at[step] = time.monotonic()
            self.announced[step] = dict(announced)
            self.reporter.report_weights(step, uri, manifest["id"], None, **announced)

        def on_publish(step, uri, manifest, versions, seconds):
            self.reporter.report_weights(step, uri, manifest["id"], versions, **self.announced.get(step, {}))

        return WeightExporter(S3Storage(), self.root, self.dtype, keep=5, pinned=None, write=write,
                              on_publish=on_publish, fast=self.fast if fast else None,
                              on_announce=on_announce)

    def close(self) -> None:
        self.fast.stop()


def api_reads(job: str, replica: Replica, as_explorer, completions: int) -> dict:
    """The explorer's reads for the versions of `completions` requests to one replica whose
    engine reports none (vLLM 0.32): through the agent's record (ReplicaRecords), and the
    way before it, the job's status (KubeProgress.replica_version). API reads are counted
    at the explorer's client."""
    out = {}
    # The reference engine reports each response's version; vLLM 0.32 does not, and that is
    # the case the explorer reads versions for: its reports are ignored here.
    reported, rollouts.engine_versions = rollouts.engine_versions, lambda data, header: None
    try:
        for way in ("agent", "status"):
            out[way] = _reads(job, replica, as_explorer, completions, way)
    finally:
        rollouts.engine_versions = reported
    return out


def _reads(job: str, replica: Replica, as_explorer, completions: int, way: str) -> dict:
    """`completions` requests, the versions read one `way`: "agent" or "status"."""
    kube = KubeProgress(as_explorer, job, NS, 100)
    version_of = (ReplicaRecords([replica.engine_url], [replica.pod], replica.peer_port, kube) if way == "agent"
                  else (lambda i: kube.replica_version(replica.pod)))
    client = InferenceClient([replica.engine_url], version_of=version_of)
    counted = count_api_calls(as_explorer.api_client)
    t = time.perf_counter()
    versions = []
    for _ in range(completions):
        got = client.complete({"model": names.SERVED_MODEL_NAME, "prompt": "1+1=", "max_tokens": 1})
        versions += got.versions or []
    return {"api_reads_per_1000": counted() * 1000 / completions,
            "agent_reads_per_1000": (version_of.reads * 1000 / completions) if way == "agent" else 0,
            "versioned": sum(isinstance(v, int) for v in versions) / max(1, len(versions)),
            "seconds_per_1000": (time.perf_counter() - t) * 1000 / completions}


def count_api_calls(api_client) -> Callable[[], int]:
    """Counts the requests `api_client` sends from now on (every call goes through call_api)."""
    calls = [0]
    original = api_client.call_api

    def counting(*a, **kw):
        calls[0] += 1
        return original(*a, **kw)

    api_client.call_api = counting
    return lambda: calls[0]


def run_replicas(n: int, args, cluster, api, bucket: str, tmp: Path, models: list[Path]) -> dict:
    """A fresh RFTJob with n replicas (each its two processes): converge to the base model,
    then time versions, alternating the S3 path and the fast path."""
    job = f"wsync-{n}"
    custom, core = kubernetes.client.CustomObjectsApi(api), kubernetes.client.CoreV1Api(api)
    custom.create_namespaced_custom_object(names.GROUP, names.VERSION, NS, names.PLURAL, job_manifest(job, bucket, n))
    paths = [p for p in args.paths.split(",")]
    rows: dict[str, list[dict]] = {p: [] for p in paths}
    with contextlib.ExitStack() as stack:
        stack.callback(lambda: custom.delete_namespaced_custom_object(names.GROUP, names.VERSION, NS, names.PLURAL, job))
        deadline = time.monotonic() + 90
        selector = f"{names.LABEL_JOB}={job},{names.LABEL_ROLE}={names.ROLE_INFERENCE}"
        while sum(p.status.phase == "Running" for p in core.list_namespaced_pod(NS, label_selector=selector).items) < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{job}: {n} inference pods not Running after 90s")
            time.sleep(0.2)

        def kubeconfig(role: str, pod: str | None = None) -> Path:
            """The role's own ServiceAccount; an agent's token is bound to its pod, as in the pod."""
            bound = (pod, core.read_namespaced_pod(pod, NS).metadata.uid) if pod else None
            return cluster.service_account_kubeconfig(NS, names.service_account_name(job, role),
                                                      tmp / f"{pod or job + '-' + role}.kubeconfig", pod=bound)

        def as_role(role: str):
            return kubernetes.client.CustomObjectsApi(kubernetes.config.new_client_from_config(str(kubeconfig(role))))

        watch = JobWatch(api, job, n)
        watch.start()
        stack.callback(watch.stop.set)
        reporter = StatusReporter(job, NS, as_role(names.ROLE_TRAINER), min_interval=0)
        stack.callback(reporter.close)
        threads = args.engine_threads if args.engine_threads >= 0 else max(1, (os.cpu_count() or 1) // n)
        replicas = [Replica(job, i, kubeconfig(names.ROLE_INFERENCE, names.inference_pod_name(job, i)), tmp,
                            args.fanout, stack, threads) for i in range(n)]
        trainer = Trainer(reporter, f"s3://{bucket}/{job}", args.dtype, tmp, models)
        stack.callback(trainer.close)
        exporters = {p: trainer.exporter(p == "fast") for p in paths}
        t = time.monotonic()
        watch.wait_synced(0, args.timeout)
        print(f"  {n} replica(s): base model (version 0) served by all after {time.monotonic() - t:.1f}s")
        transfer = S3Storage().transfer
        cpu = CpuMeter(replicas)
        version = 0
        for k in range(args.versions):
            # The raw baseline right before each pair of timed syncs, under the same load
            # (this machine is shared: a baseline taken minutes earlier can be 2x off).
            base = baseline(f"s3://{bucket}/{job}/weights/step-{version:08d}" if version
                            else f"s3://{bucket}/base", tmp, transfer)
            for path in paths:
                version += 1
                fetched_before = [r.fetched() for r in replicas]
                cpu.start()
                t0 = time.monotonic()
                exporters[path].publish(version)
                t_committed = time.monotonic()
                t_done = watch.wait_synced(version, args.timeout)
                row = breakdown(version, t0, t_done, watch, replicas)
                row.update(path=path, baseline=base, committed=t_committed - t0, cpu=cpu.stop(),
                           announced=trainer.announced_at.get(version, t_committed) - t0,
                           s3_bytes=fetched_delta(replicas, fetched_before, trainer.bytes[version]))
                row["bytes"] = trainer.bytes[version]
                row["s3_x_model"] = row["s3_bytes"] / row["bytes"]
                rows[path].append(row)
                print(f"  {n} replica(s), {path:>4}: version {version} e2e {row['e2e']:.2f}s (raw just before: "
                      f"{base['total']:.2f}s), upload committed at {row['committed']:.2f}s, "
                      f"S3 read {row['s3_bytes'] / 2**20:.1f} MiB ({row['s3_x_model']:.2f}x the model), "
                      f"sources {sorted(set(r['source'] for r in row['replicas'].values()))}")
        reads = api_reads(job, replicas[0], as_role(names.ROLE_EXPLORER), args.completions) if args.completions else {}
        if reads:
            print(f"  {n} replica(s): explorer API reads per 1,000 completions: "
                  f"{reads['agent']['api_reads_per_1000']:.0f} through the agents' records "
                  f"({reads['agent']['agent_reads_per_1000']:.0f} agent reads), "
                  f"{reads['status']['api_reads_per_1000']:.0f} through the job's status")
    return {"rows": rows, "api_reads": reads}


def breakdown(v: int, t0: float, t_done: float, watch: JobWatch, replicas: list[Replica]) -> dict:
    """Timings of one version. Agent-side durations come from its status entry; the points
    in time are our monotonic clock (the watch's arrival times). `rest` is what the critical
    replica's entry does not account for: the agent noticing the target (its watch) and
    its report reaching our watch."""
    t_target = watch.target_at[v]
    out = {}
    for r in replicas:
        t_entry, e = watch.entry_at[(r.pod, v)]
        out[r.pod] = {"visible": t_entry - t0, "download": e["downloadSeconds"], "verify": e["verifySeconds"],
                      "reload": e["reloadSeconds"], "loadSeconds": e["loadSeconds"], "source": e.get("source")}
        out[r.pod]["rest"] = t_entry - t_target - e["loadSeconds"]
    last = max(out, key=lambda p: out[p]["visible"])
    crit = out[last]
    row = {"version": v, "e2e": t_done - t0, "promote": t_target - t0, "critical": last,
           **{k: crit[k] for k in ("download", "verify", "reload", "rest")},
           "count": t_done - t0 - crit["visible"], "replicas": out}
    row["download_mean"] = statistics.mean(r["download"] for r in out.values())
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=("reference", "vllm"), default="reference",
                    help="vllm: reload + probe on real vLLM engines vs a fresh start (bench/vllm_reload.py)")
    ap.add_argument("--replicas", default=None, help="comma-separated replica counts (default 1,2,4,8; vllm: 1,2)")
    ap.add_argument("--versions", type=int, default=3, help="versions timed per path and replica count")
    ap.add_argument("--paths", default="s3,fast", help="s3 (replicas read each version once it is committed), "
                                                      "fast (the trainer serves it while it uploads), or both")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=0, help="default 3 x hidden")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="export dtype")
    ap.add_argument("--timeout", type=float, default=180, help="per sync, seconds")
    ap.add_argument("--engine-threads", type=int, default=-1,
                    help="each reference engine's torch threads: -1 (default) this machine's cores / replicas, as "
                         "pods' CPU limits give them (rft_serving.serve reads the limit); 0 torch's default (every "
                         "engine sized for the whole machine)")
    ap.add_argument("--fanout", type=int, default=2,
                    help="relay children per replica, as the pods run it (0: every replica reads S3)")
    ap.add_argument("--completions", type=int, default=200,
                    help="requests timed for the explorer's API reads (0: skip), at each replica count")
    ap.add_argument("--out", default=str(ROOT / ".local" / "bench" / "weightsync.json"))
    args = ap.parse_args()
    if args.engine == "vllm":
        import vllm_reload

        args.replicas = args.replicas or "1,2"
        args.out = args.out.replace("weightsync.json", "weightsync-vllm.json")
        return vllm_reload.run(args)
    args.replicas = args.replicas or "1,2,4,8"
    counts = [int(x) for x in args.replicas.split(",")]
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()

    tmp = Path(tempfile.mkdtemp(prefix="rft-bench-ws-"))
    ok = False
    with contextlib.ExitStack() as stack:
        stack.callback(lambda: shutil.rmtree(tmp, ignore_errors=True) if ok else
                       print(f"logs and state kept in {tmp}"))
        s3 = start_s3(tmp / "s3")
        stack.callback(s3.stop)
        PIDS["s3"] = s3.pid
        bucket = "rft-bench-ws"
        boto3.client("s3").create_bucket(Bucket=bucket)
        models = save_models(args, tmp, bucket, 3)
        cluster = Cluster(tmp / "cluster")
        t = time.monotonic()
        cluster.up()
        stack.callback(cluster.down)
        print(f"cluster up in {time.monotonic() - t:.1f}s")
        kc = str(cluster.kubeconfig)
        install_api(cluster)
        subprocess.run(["kubectl", f"--kubeconfig={kc}", "create", "namespace", NS], check=True, capture_output=True)
        subprocess.run(["kubectl", f"--kubeconfig={kc}", "label", "namespace", NS, f"{names.PSA_ENFORCE_LABEL}=baseline"],
                       check=True, capture_output=True)  # job pods run only where Pod Security is enforced
        op_kc = cluster.service_account_kubeconfig("rftjob-system", "rftjob-operator", tmp / "op.kubeconfig")
        op = subprocess.Popen([sys.executable, "-m", "rft_operator"], env={**os.environ, "KUBECONFIG": str(op_kc)},
                              stdout=open(tmp / "operator.log", "wb"), stderr=subprocess.STDOUT, cwd=ROOT)
        PIDS["operator"] = op.pid
        stack.callback(op.wait, 30)
        stack.callback(op.terminate)
        api = kubernetes.config.new_client_from_config(kc)
        results = {n: run_replicas(n, args, cluster, api, bucket, tmp, models) for n in counts}
        ok = True

    med = lambda rows, k: statistics.median(r[k] for r in rows)  # noqa: E731
    mib = statistics.median(r["bytes"] for res in results.values() for rows in res["rows"].values()
                            for r in rows) / 2**20
    print(f"\nweight sync of {mib:.1f} MiB ({args.dtype}, hidden {args.hidden} x {args.layers} layers), every "
          f"agent and engine its own process, relay fanout {args.fanout}, median of {args.versions} versions per "
          f"path, seconds from the start of the export to all replicas serving the version")
    print("raw: one version through S3 to one replica in plain boto3 (upload_file + download_file, 64 MiB parts) "
          "+ from_pretrained, measured before each pair of versions")
    head = (f"{'replicas':>8} {'path':>5} {'e2e':>6} {'raw':>6} {'x raw':>6} {'S3 MiB':>7} {'x model':>7} "
            + " ".join(f"{p:>8}" for p in PHASES))
    print(head)
    for n, res in results.items():
        for path, rows in res["rows"].items():
            row_base = statistics.median(r["baseline"]["total"] for r in rows)
            print(f"{n:>8} {path:>5} {med(rows, 'e2e'):6.2f} {row_base:6.2f} {med(rows, 'e2e') / row_base:6.2f} "
                  f"{max(r['s3_bytes'] for r in rows) / 2**20:7.1f} {max(r['s3_x_model'] for r in rows):7.2f} "
                  + " ".join(f"{med(rows, p):8.2f}" for p in PHASES))
    print("S3 MiB and x model: bytes the agents read from S3 for that version (the largest of the versions; "
          "the goal is <= 1.1x)")
    print(f"\nwhere the CPU went, CPU seconds per version (medians; {os.cpu_count()} cores), and the machine's "
          f"busy share over the version")
    print(f"{'replicas':>8} {'path':>5} {'e2e':>6} " + " ".join(f"{r:>8}" for r in CPU_ROLES) + f" {'total':>6} {'busy':>5}")
    for n, res in results.items():
        for path, rows in res["rows"].items():
            cpu = {k: statistics.median(r["cpu"][k] for r in rows) for k in (*CPU_ROLES, "busy")}
            total = statistics.median(sum(r["cpu"][k] for k in CPU_ROLES) for r in rows)
            print(f"{n:>8} {path:>5} {med(rows, 'e2e'):6.2f} " + " ".join(f"{cpu[k]:8.2f}" for k in CPU_ROLES)
                  + f" {total:6.2f} {cpu['busy']:5.2f}")
    for n, res in results.items():
        if res["api_reads"]:
            a, st = res["api_reads"]["agent"], res["api_reads"]["status"]
            print(f"explorer API reads per 1,000 completions ({n} replica(s)): {a['api_reads_per_1000']:.0f} with the "
                  f"agents' records ({a['versioned']:.0%} of samples versioned), {st['api_reads_per_1000']:.0f} "
                  f"through the job's status ({st['versioned']:.0%})")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "results": {str(n): r for n, r in results.items()}}, indent=1))
    print(f"results in {out}")


if __name__ == "__main__":
    main()
