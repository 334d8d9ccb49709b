"""Drift repair by merge patch (ours) against server-side apply, on a real API server.

    python bench/ssa.py [--jobs 200] [--rounds 3]

Issue 25, item 5: the operator creates each static child with POST and brings a drifted one
back with a merge patch plus the `rft.dev/managed-keys` annotation (which label and
annotation keys it set, so it can remove the ones it no longer renders). Server-side apply
with a field manager (as Kubeflow Trainer does) records the same in managedFields. This
measures both on the operator's own rendered children (ConfigMap, Services,
ServiceAccounts, Roles, RoleBindings of the sample job) against a fresh local control plane:

  * writes per job: create every static child, then repair every one after a hand edit;
  * the API server's CPU seconds and the client's p50/p99 latency for those writes;
  * the stored size of a child (managedFields included);

and checks the two behaviours a switch would have to keep:

  * never adopt: a child's name held by someone else's object (no owner) must fail the
    job (`ChildConflict`), not be taken over;
  * a key the operator no longer renders is removed on repair, a key someone else added
    stays.

Sides take turns round by round in fresh namespaces; ratios are SSA / ours. No threshold
fails the run.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import kubernetes
import psutil
import yaml
from kubernetes.client.rest import ApiException

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from e2e.cluster import Cluster  # noqa: E402
from rft_contract.spec import parse_spec  # noqa: E402
from rft_operator import drift  # noqa: E402
from rft_operator.children import build_static_children  # noqa: E402
from rft_operator.kube import Kube  # noqa: E402
from rft_operator.objects import JobRef  # noqa: E402
from rft_operator.reconcile import with_managed_keys, with_spec_hash  # noqa: E402

MANAGER = "rftjob-operator"
APPLY = "application/apply-patch+yaml"
MERGE = "application/merge-patch+json"
SAMPLE = ROOT / "manifests" / "samples" / "rftjob.yaml"


def sample_spec() -> Any:
    docs = [d for d in yaml.safe_load_all(SAMPLE.read_text()) if d and d.get("kind") == "RFTJob"]
    return parse_spec(docs[0]["spec"])


def children(namespace: str, job: str, spec: Any) -> list[dict]:
    """The job's static children as the operator renders them, without owner references
    (no RFTJob exists here for the garbage collector to find)."""
    out = []
    for obj in build_static_children(JobRef(job, namespace, f"uid-{job}"), spec):
        obj = with_spec_hash(with_managed_keys(obj))
        obj["metadata"].pop("ownerReferences", None)
        out.append(obj)
    return out


def apiserver() -> psutil.Process:
    for p in psutil.process_iter(["name", "cmdline"]):
        if p.info["name"] == "kube-apiserver" or any("kube-apiserver" in a for a in (p.info["cmdline"] or [])[:1]):
            return p
    raise RuntimeError("no kube-apiserver process")


class Client:
    """The operator's own requests (`Kube.request`: plain JSON through the client's REST
    layer), timed."""

    def __init__(self, api: kubernetes.client.ApiClient):
        self.kube = Kube(api)
        self.seconds: list[float] = []

    def send(self, method: str, path: str, body: Any, content_type: str = "application/json",
             query: dict | None = None) -> Any:
        start = time.monotonic()
        try:
            return json.loads(self.kube.request(method, path, body, content_type, query))
        finally:
            self.seconds.append(time.monotonic() - start)

    def path(self, obj: dict, named: bool = True) -> str:
        meta = obj["metadata"]
        return self.kube.path(obj["kind"], meta["namespace"], meta["name"] if named else None)


def hand_edit(obj: dict) -> dict:
    """What a user or another controller does to a child: a label of ours changed."""
    return {"metadata": {"labels": {"app.kubernetes.io/managed-by": "someone"}}}


class Ours:
    name = "merge patch"

    def __init__(self, client: Client):
        self.c = client

    def create(self, obj: dict) -> None:
        self.c.send("POST", self.c.path(obj, named=False), obj)

    def repair(self, obj: dict, live: dict) -> None:
        self.c.send("PATCH", self.c.path(obj), drift.compute_patch(obj, live), MERGE)


class Apply:
    name = "server-side apply"

    def __init__(self, client: Client):
        self.c = client

    def create(self, obj: dict) -> None:
        self.c.send("PATCH", self.c.path(obj), self._applied(obj), APPLY,
                    {"fieldManager": MANAGER, "force": "true"})

    def repair(self, obj: dict, live: dict) -> None:
        self.create(obj)

    @staticmethod
    def _applied(obj: dict) -> dict:
        out = copy.deepcopy(obj)
        out["metadata"].get("annotations", {}).pop("rft.dev/managed-keys", None)  # what SSA replaces
        return out


def run_round(side: Any, core: Any, namespace: str, jobs: int, spec: Any) -> dict[str, float]:
    core.create_namespace({"metadata": {"name": namespace}})
    objs = [o for j in range(jobs) for o in children(namespace, f"job-{j:04d}", spec)]
    proc = apiserver()
    side.c.seconds.clear()
    cpu0 = sum(proc.cpu_times()[:2])
    for obj in objs:
        side.create(obj)
    for obj in objs:  # the drift, then the repair the operator's pass would do
        side.c.send("PATCH", side.c.path(obj), hand_edit(obj), MERGE)
    edits = len(objs)
    lives = [side.c.send("GET", side.c.path(obj), None) for obj in objs]
    reads = len(objs)
    for obj, live in zip(objs, lives):
        side.repair(obj, live)
    cpu = sum(proc.cpu_times()[:2]) - cpu0
    writes = [s for i, s in enumerate(side.c.seconds) if not (len(objs) <= i < len(objs) + edits + reads)]
    size = statistics.mean(len(json.dumps(side.c.send("GET", side.c.path(o), None))) for o in objs[:50])
    core.delete_namespace(namespace)
    return {"writes_per_job": len(writes) / jobs, "cpu_s": cpu, "p50_ms": 1000 * statistics.median(writes),
            "p99_ms": 1000 * statistics.quantiles(writes, n=100)[98], "bytes": size}


def check_semantics(side: Any, core: Any, namespace: str, spec: Any) -> dict[str, str]:
    """Never adopt, and removal of a key no longer rendered (with one someone else added)."""
    core.create_namespace({"metadata": {"name": namespace}})
    out = {}
    obj = next(o for o in children(namespace, "ghost", spec) if o["kind"] == "ConfigMap")
    core.create_namespaced_config_map(namespace, {"metadata": {"name": obj["metadata"]["name"]},
                                                  "data": {"theirs": "1"}})
    try:
        side.create(obj)
        live = core.read_namespaced_config_map(obj["metadata"]["name"], namespace)
        out["someone else's object"] = ("ADOPTED: the write succeeded and merged into it "
                                        f"(data keys {sorted(live.data)})")
    except ApiException as e:
        out["someone else's object"] = f"refused ({e.status}): never adopted"
    obj = next(o for o in children(namespace, "keys", spec) if o["kind"] == "ConfigMap")
    obj["metadata"]["labels"]["example.com/team"] = "a"  # a key outside our namespaces, rendered once
    obj = with_managed_keys({**obj, "metadata": {**obj["metadata"], "annotations": {
        k: v for k, v in (obj["metadata"].get("annotations") or {}).items() if k != "rft.dev/managed-keys"}}})
    side.create(obj)
    side.c.send("PATCH", side.c.path(obj), {"metadata": {"labels": {"example.com/user": "kept"}}}, MERGE)
    later = copy.deepcopy(obj)  # the next render no longer has the label
    del later["metadata"]["labels"]["example.com/team"]
    later = with_managed_keys({**later, "metadata": {**later["metadata"], "annotations": {
        k: v for k, v in (later["metadata"].get("annotations") or {}).items() if k != "rft.dev/managed-keys"}}})
    side.repair(later, side.c.send("GET", side.c.path(obj), None))
    labels = core.read_namespaced_config_map(obj["metadata"]["name"], namespace).metadata.labels or {}
    out["a label no longer rendered"] = "removed" if "example.com/team" not in labels else "LEFT BEHIND"
    out["a label someone else added"] = "kept" if "example.com/user" in labels else "REMOVED"
    core.delete_namespace(namespace)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    cluster = Cluster(Path(tempfile.mkdtemp(prefix="rft-bench-ssa-")))
    t0 = time.monotonic()
    cluster.up(num_gpu_nodes=0)
    print(f"cluster up in {time.monotonic() - t0:.1f}s")
    spec = sample_spec()
    try:
        api = kubernetes.config.new_client_from_config(str(cluster.kubeconfig))
        core = kubernetes.client.CoreV1Api(api)
        sides: list[Callable[[Client], Any]] = [Ours, Apply]
        results: dict[str, list[dict[str, float]]] = {s.name: [] for s in sides}
        for r in range(args.rounds):
            for make in sides[r % 2:] + sides[:r % 2]:
                side = make(Client(api))
                results[side.name].append(run_round(side, core, f"r{r}-{side.name.split()[0]}", args.jobs, spec))
        semantics = {s.name: check_semantics(s(Client(api)), core, f"sem-{s.name.split()[0]}", spec)
                     for s in sides}
    finally:
        cluster.down()

    def mean(name: str, key: str) -> float:
        return statistics.mean(x[key] for x in results[name])

    print(f"\n{args.jobs} jobs x {len(children('x', 'x', spec))} static children, {args.rounds} rounds per side")
    print(f"{'':28}{'writes/job':>11}{'apiserver CPU s':>17}{'p50 ms':>9}{'p99 ms':>9}{'stored bytes':>14}")
    for s in sides:
        print(f"{s.name:28}{mean(s.name, 'writes_per_job'):>11.1f}{mean(s.name, 'cpu_s'):>17.2f}"
              f"{mean(s.name, 'p50_ms'):>9.2f}{mean(s.name, 'p99_ms'):>9.2f}{mean(s.name, 'bytes'):>14.0f}")
    a, o = Apply.name, Ours.name
    print(f"{'ratio SSA / ours':28}{mean(a, 'writes_per_job') / mean(o, 'writes_per_job'):>11.2f}"
          f"{mean(a, 'cpu_s') / mean(o, 'cpu_s'):>17.2f}{mean(a, 'p50_ms') / mean(o, 'p50_ms'):>9.2f}"
          f"{mean(a, 'p99_ms') / mean(o, 'p99_ms'):>9.2f}{mean(a, 'bytes') / mean(o, 'bytes'):>14.2f}")
    for name, checks in semantics.items():
        print(f"\n{name}:")
        for what, got in checks.items():
            print(f"  {what}: {got}")


if __name__ == "__main__":
    main()
