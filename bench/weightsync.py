"""Weight-sync benchmark: how long from the trainer announcing new weights to every
inference replica serving them, for 1, 2, 4 and 8 replicas.

    python bench/weightsync.py [--replicas 1,2,4,8] [--versions 3] [--hidden 512 --layers 8]
                               [--dtype fp32|bf16] [--fanout 2] [--out .local/bench/weightsync.json]
    python bench/weightsync.py --engine vllm [--replicas 1,2] [--versions 3]   (bench/vllm_reload.py)

Runs the whole protocol as tests/integration/test_weightsync.py does: a local control
plane (KWOK inference pods), the operator as a subprocess under its ServiceAccount, a
SeaweedFS S3 server (e2e/s3server.py, the tests' server), and per pod a `ReferenceServer`
plus a `SyncAgent` with its relay server (rft_serving.relay, `--fanout` children per
replica as the pods run it; `--fanout 0`: every replica reads S3, the design before the
relay) in threads, as the inference ServiceAccount with a token bound to its pod. Versions are exported once with the real exporter (untimed) and announced with
`StatusReporter.report_weights`, as the trainer's ServiceAccount.
For each replica count a fresh RFTJob is created, the replicas converge to the base model
(version 0), then for each version t0 is taken just before report_weights and the end is
the first watch event with `status.weightSync.synced == "N/N"` at that version.

Columns (medians over the versions; seconds unless said):
  e2e       t0 -> all N replicas counted as serving the version
  S3 MiB    bytes S3 sent (every GetObject's body, counted by a botocore hook on every
            client in this process) between t0 and the end, i.e. the agents' reads of
            that version (manifests included); `x model` divides by the version's size
  x base    e2e / baseline. The baseline, measured in the same run against the same S3
            server (for each row: once before each of its versions, median), is the raw
            cost of one replica's work: boto3 `download_file` of every
            object of a version into a temp dir, then `AutoModelForCausalLM.from_pretrained`
            of that dir (fp32, as the reference server loads on CPU). It uses the agents'
            transfer settings (S3Storage: 64 MiB parts); boto3's default 8 MiB parts are
            printed for reference (against moto, which materialised the whole object for
            every ranged GET, they took 2-3x longer, so the ratio would have mostly measured
            part sizes). At N = 1 the ratio is the protocol's overhead (promotion,
            verification, the tokenizer load, reporting); for N > 1 it adds N replicas
            sharing one S3 server and 2 CPUs (expect roughly linear growth), and all
            servers and agents share this process's GIL, unlike real pods.
  promote   t0 -> operator's status.weightSync.target shows the version (trainer patch,
            operator watch + reconcile + status write)
  then the critical path, i.e. the replica whose entry became visible last:
  notice    target visible -> that agent starts downloading (its watch, an engine probe)
  download, verify, reload   the agent's own downloadSeconds/verifySeconds/reloadSeconds
  report    agent finished loading -> its status entry visible to us
  count     last entry visible -> operator's synced == "N/N"
Per version the row's components sum to its e2e; the printed medians need not.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import boto3
import kubernetes
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from e2e.cluster import Cluster  # noqa: E402
from e2e.demo import install_api  # noqa: E402
from e2e.s3server import S3Server  # noqa: E402
from rft_contract import names  # noqa: E402
from rft_contract.layout import weights_uri  # noqa: E402
from rft_trainer.export import export_hf  # noqa: E402
from rft_trainer.parallelize import Runtime  # noqa: E402
from rft_trainer.reporting import StatusReporter  # noqa: E402
from rft_contract.s3 import S3Storage, split_uri  # noqa: E402
from rft_serving.serve import ReferenceServer  # noqa: E402
from rft_serving.engines import ReferenceEngine  # noqa: E402
from rft_serving.sync_agent import SyncAgent  # noqa: E402
from rft_serving.relay import PeerServer  # noqa: E402
from tests.fixtures.models import save_tiny_model  # noqa: E402
from tests.fixtures.s3bytes import S3ReadCounter  # noqa: E402

NS = "bench-ws"
PHASES = ("promote", "notice", "download", "verify", "reload", "report", "count")


def start_s3(data_dir: Path) -> S3Server:
    """The S3 server, with this process's (and the operator's) environment pointing at it."""
    key, secret = "bench", "bench-secret"
    server = S3Server(data_dir, credentials={key: secret}).start()
    os.environ.update({"AWS_ENDPOINT_URL": server.endpoint, "AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret,
                       "AWS_REGION": "us-east-1", "AWS_DEFAULT_REGION": "us-east-1"})
    return server


class TimedEngine(ReferenceEngine):
    """Records when the agent asks the engine to load (monotonic, this process's clock)."""

    def __init__(self, url: str):
        super().__init__(url)
        self.load_began: dict[int, float] = {}

    def load(self, path: str, version: int, probe=None, tolerance=None):
        self.load_began[version] = time.monotonic()
        return super().load(path, version, probe, tolerance)


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


def export_versions(args, tmp: Path, bucket: str) -> list[dict]:
    """The base model (as a user uploads it: no manifest) and K exports (untimed)."""
    from transformers import AutoModelForCausalLM

    shape = dict(hidden=args.hidden, layers=args.layers, intermediate=args.intermediate or 3 * args.hidden)
    s3 = S3Storage()
    base = save_tiny_model(tmp / "base", seed=0, **shape)
    for f in base.iterdir():
        s3.write_bytes(f"s3://{bucket}/base/{f.name}", f.read_bytes())
    rt = Runtime(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    out = []
    for v in range(1, args.versions + 1):
        d = save_tiny_model(tmp / f"v{v}", seed=v, **shape)
        model = AutoModelForCausalLM.from_pretrained(str(d))
        uri = weights_uri(f"s3://{bucket}/run", v)
        m = export_hf(model, rt, s3, uri, str(d), v, dtype=args.dtype)
        out.append({"version": v, "uri": uri, "id": m["id"], "bytes": m["bytes"]})
        shutil.rmtree(d)
    return out


def baseline(uri: str, tmp: Path, transfer=None) -> dict:
    """One replica's raw work: plain boto3 download_file per object (listing included),
    then from_pretrained in fp32 (what the reference server does on CPU)."""
    from transformers import AutoModelForCausalLM

    s3 = boto3.client("s3")
    bucket, prefix = split_uri(uri)
    d = Path(tempfile.mkdtemp(dir=tmp))
    kw = {"Config": transfer} if transfer else {}
    t = time.perf_counter()
    for o in s3.list_objects_v2(Bucket=bucket, Prefix=prefix + "/")["Contents"]:
        s3.download_file(bucket, o["Key"], str(d / o["Key"][len(prefix) + 1:]), **kw)
    t_dl = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32)
    t_load = time.perf_counter()
    del model
    shutil.rmtree(d)
    return {"download": t_dl - t, "load": t_load - t_dl, "total": t_load - t}


def job_manifest(name: str, bucket: str, n: int) -> dict:
    return {"apiVersion": names.API_VERSION, "kind": names.KIND, "metadata": {"name": name}, "spec": {
        "model": {"path": f"s3://{bucket}/base"}, "algorithm": {"name": "grpo"},
        "trainer": {"image": "trainer:bench", "nodes": 1, "gpusPerNode": 0, "totalSteps": 100, "batchSize": 4},
        "checkpoint": {"uri": f"s3://{bucket}/run", "endpoint": os.environ["AWS_ENDPOINT_URL"]},
        "inference": {"replicas": n, "gpusPerReplica": 0}}}


def run_replicas(n: int, versions: list[dict], cluster, api, bucket: str, tmp: Path, timeout: float,
                 fanout: int, s3_reads: S3ReadCounter) -> list[dict]:
    """A fresh RFTJob with n replicas: converge to the base model, then time each version."""
    job = f"wsync-{n}"
    custom, core = kubernetes.client.CustomObjectsApi(api), kubernetes.client.CoreV1Api(api)
    custom.create_namespaced_custom_object(names.GROUP, names.VERSION, NS, names.PLURAL, job_manifest(job, bucket, n))
    with contextlib.ExitStack() as stack:
        stack.callback(lambda: custom.delete_namespaced_custom_object(names.GROUP, names.VERSION, NS, names.PLURAL, job))
        deadline = time.monotonic() + 90
        selector = f"{names.LABEL_JOB}={job},{names.LABEL_ROLE}={names.ROLE_INFERENCE}"
        while sum(p.status.phase == "Running" for p in core.list_namespaced_pod(NS, label_selector=selector).items) < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{job}: {n} inference pods not Running after 90s")
            time.sleep(0.2)
        def as_role(role: str, pod: str | None = None):
            """The role's own ServiceAccount; an agent's token is bound to its pod, as in the pod."""
            bound = (pod, core.read_namespaced_pod(pod, NS).metadata.uid) if pod else None
            kc = cluster.service_account_kubeconfig(NS, names.service_account_name(job, role),
                                                    tmp / f"{pod or job}.kubeconfig", pod=bound)
            return kubernetes.client.CustomObjectsApi(kubernetes.config.new_client_from_config(str(kc)))

        watch = JobWatch(api, job, n)
        watch.start()
        stack.callback(watch.stop.set)
        reporter = StatusReporter(job, NS, as_role(names.ROLE_TRAINER), min_interval=0)
        stack.callback(reporter.close)
        engines = {}
        for i in range(n):
            pod = names.inference_pod_name(job, i)
            server = ReferenceServer(max_concurrency=1)
            server.start()
            stack.callback(server.stop)
            engines[pod] = TimedEngine(server.url)
            relay = PeerServer(tmp / job / pod, host="127.0.0.1").start()
            stack.callback(relay.stop)
            agent = SyncAgent(job, NS, pod, engines[pod], tmp / job / pod, api=as_role(names.ROLE_INFERENCE, pod),
                              resync_seconds=2, max_backoff=2, peer_server=relay,
                              peer_url=f"http://127.0.0.1:{relay.port}", fanout=fanout)
            thread = threading.Thread(target=agent.run, daemon=True)
            thread.start()
            stack.callback(thread.join, 10)
            stack.callback(agent.stop)  # callbacks run last-in first-out: stop, join, then the server
        t = time.monotonic()
        watch.wait_synced(0, timeout)
        print(f"  {n} replica(s): base model (version 0) served by all after {time.monotonic() - t:.1f}s")
        rows = []
        transfer = S3Storage().transfer
        for k, w in enumerate(versions):
            # The raw baseline right before each timed sync, under the same load (this
            # machine is shared: a baseline taken minutes earlier can be 2x off).
            base = baseline(w["uri"], tmp, transfer)
            read_before = s3_reads.bytes
            t0 = time.monotonic()
            reporter.report_weights(w["version"], w["uri"], w["id"], [x["version"] for x in versions[:k + 1]])
            t_done = watch.wait_synced(w["version"], timeout)
            rows.append(breakdown(w["version"], t0, t_done, watch, engines))
            rows[-1]["baseline"] = base
            rows[-1]["s3_bytes"] = s3_reads.bytes - read_before
            rows[-1]["s3_x_model"] = rows[-1]["s3_bytes"] / w["bytes"]
            print(f"  {n} replica(s): version {w['version']} e2e {rows[-1]['e2e']:.2f}s "
                  f"(raw download + load just before: {base['total']:.2f}s), "
                  f"S3 read {rows[-1]['s3_bytes'] / 2**20:.1f} MiB ({rows[-1]['s3_x_model']:.2f}x the model), "
                  f"sources {sorted(set(r['source'] for r in rows[-1]['replicas'].values()))}")
    return rows


def breakdown(v: int, t0: float, t_done: float, watch: JobWatch, engines: dict) -> dict:
    """Timings of one version. Agent-side durations come from its status entry; the points
    in time are our monotonic clock: the watch's arrival times and TimedEngine's. The
    entries' `time` field is wall-clock with whole-second resolution, too coarse for
    sub-second phases, so `report` is (entry visible to our watch) - (the agent began the
    reload + reloadSeconds), which is the patch round trip plus watch delivery."""
    t_target = watch.target_at[v]
    replicas = {}
    for pod, eng in engines.items():
        t_entry, e = watch.entry_at[(pod, v)]
        fetch_began = eng.load_began[v] - e["downloadSeconds"] - e["verifySeconds"]
        replicas[pod] = {"visible": t_entry - t0, "notice": fetch_began - t_target,
                         "download": e["downloadSeconds"], "verify": e["verifySeconds"],
                         "reload": e["reloadSeconds"], "loadSeconds": e["loadSeconds"],
                         "source": e.get("source"),
                         "report": t_entry - (eng.load_began[v] + e["reloadSeconds"])}
    last = max(replicas, key=lambda p: replicas[p]["visible"])
    crit = replicas[last]
    row = {"version": v, "e2e": t_done - t0, "promote": t_target - t0, "critical": last,
           **{k: crit[k] for k in ("notice", "download", "verify", "reload", "report")},
           "count": t_done - t0 - crit["visible"], "replicas": replicas}
    row["download_mean"] = statistics.mean(r["download"] for r in replicas.values())
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=("reference", "vllm"), default="reference",
                    help="vllm: reload + probe on real vLLM engines vs a fresh start (bench/vllm_reload.py)")
    ap.add_argument("--replicas", default=None, help="comma-separated replica counts (default 1,2,4,8; vllm: 1,2)")
    ap.add_argument("--versions", type=int, default=3, help="versions timed per replica count")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=0, help="default 3 x hidden")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="export dtype")
    ap.add_argument("--timeout", type=float, default=180, help="per sync, seconds")
    ap.add_argument("--fanout", type=int, default=2,
                    help="relay children per replica, as the pods run it (0: every replica reads S3)")
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
    # The base model (version 0) has no manifest by design: one warning per replica is noise.
    logging.getLogger("rft_serving.sync_agent").addFilter(lambda r: "has no manifest.json" not in r.getMessage())

    s3_reads = S3ReadCounter().install()  # before any client exists: every one is counted
    tmp = Path(tempfile.mkdtemp(prefix="rft-bench-ws-"))
    ok = False
    with contextlib.ExitStack() as stack:
        stack.callback(lambda: shutil.rmtree(tmp, ignore_errors=True) if ok else
                       print(f"logs and state kept in {tmp}"))
        stack.callback(start_s3(tmp / "s3").stop)
        bucket = "rft-bench-ws"
        boto3.client("s3").create_bucket(Bucket=bucket)
        versions = export_versions(args, tmp, bucket)
        mib = versions[0]["bytes"] / 2**20
        print(f"exported {len(versions)} versions of {mib:.1f} MiB ({args.dtype})")
        base = [baseline(w["uri"], tmp, S3Storage().transfer) for w in versions]
        base_total = statistics.median(b["total"] for b in base)
        base_8mib = [baseline(w["uri"], tmp) for w in versions]  # boto3's default TransferConfig

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
        stack.callback(op.wait, 30)
        stack.callback(op.terminate)
        api = kubernetes.config.new_client_from_config(kc)
        results = {n: run_replicas(n, versions, cluster, api, bucket, tmp, args.timeout, args.fanout, s3_reads)
                   for n in counts}
        ok = True

    med = lambda rows, k: statistics.median(r[k] for r in rows)  # noqa: E731
    print(f"\nweight sync of {mib:.1f} MiB ({args.dtype}, hidden {args.hidden} x {args.layers} layers), "
          f"relay fanout {args.fanout}{' (off: every replica reads S3)' if not args.fanout else ''}, "
          f"median of {args.versions} versions, seconds")
    print(f"baseline before the cluster (boto3 download_file with 64 MiB parts + from_pretrained): {base_total:.2f} "
          f"(download {statistics.median(b['download'] for b in base):.2f}, "
          f"load {statistics.median(b['load'] for b in base):.2f}); "
          f"with boto3's default 8 MiB parts: {statistics.median(b['total'] for b in base_8mib):.2f}")
    print("breakdown along the critical path (the replica whose entry was visible last)")
    head = (f"{'replicas':>8} {'e2e':>6} {'base':>6} {'x base':>6} {'S3 MiB':>7} {'x model':>7} "
            + " ".join(f"{p:>8}" for p in PHASES) + f" {'dl mean':>8}")
    print(head)
    for n, rows in results.items():
        row_base = statistics.median(r["baseline"]["total"] for r in rows)
        print(f"{n:>8} {med(rows, 'e2e'):6.2f} {row_base:6.2f} {med(rows, 'e2e') / row_base:6.2f} "
              f"{max(r['s3_bytes'] for r in rows) / 2**20:7.1f} {max(r['s3_x_model'] for r in rows):7.2f} "
              + " ".join(f"{med(rows, p):8.2f}" for p in PHASES) + f" {med(rows, 'download_mean'):8.2f}")
    print("S3 MiB and x model: the largest of the versions (the goal is <= 1.1x at every count)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "mib": mib, "baseline": base, "baseline_total": base_total,
                               "baseline_default_transfer": base_8mib,
                               "results": {str(n): rows for n, rows in results.items()}}, indent=1))
    print(f"results in {out}")


if __name__ == "__main__":
    main()
