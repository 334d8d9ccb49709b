"""The weight-sync protocol end to end against the local control plane and a real S3
server: the trainer's exporter writes versions, its reporter (as the job's own
ServiceAccount) announces them, the operator promotes them, and two sync agents (each
with a real reference inference server, as the job's ServiceAccount) load them and
report back. Inference pods are KWOK pods; the agents stand in for their containers by
using the pods' names. Replica 1 reads the weights from replica 0's relay server (found
through replica 0's status entry), and S3 only when replica 0 cannot deliver."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

import boto3
import kubernetes
import pytest
import requests
from botocore.config import Config

from rft_contract import names
from rft_contract.layout import weights_uri
from rft_contract.manifest import manifest_digest
from rft_trainer.export import FastPath, WeightExporter, export_hf
from rft_trainer.parallelize import Runtime
from rft_trainer.reporting import StatusReporter
from rft_contract.s3 import S3Storage
from rft_serving.serve import ReferenceServer
from rft_serving.engines import ReferenceEngine
from rft_serving.sync_agent import SyncAgent
from rft_contract.relay import PeerServer
from tests.fixtures.models import save_tiny_model
from tests.fixtures.s3bytes import S3ReadCounter
from tests.trainer.faultproxy import FaultProxy

from .conftest import wait_for
from .operator_fixtures import create_job, job_manifest, patch_spec, wait_status

pytestmark = pytest.mark.integration
JOB = "sync"
PODS = [f"{JOB}-inference-0", f"{JOB}-inference-1"]


class Replica:
    """A reference server plus its sync agent, running as one inference pod would."""

    def __init__(self, pod: str, as_job, tmp: Path, storage=None):
        self.pod, self.as_job, self.tmp, self.storage = pod, as_job, tmp, storage
        self.server = ReferenceServer(max_concurrency=1)
        self.server.start()
        # The agent's relay server, as the pod's sidecar runs it (--peer-port, --fanout 1 here:
        # replica 1 reads replica 0). A short wait for a parent that has not started a version.
        self.relay = PeerServer(tmp / pod, host="127.0.0.1", wait_seconds=2).start()
        self.start_agent()

    def start_agent(self) -> None:
        self.agent = SyncAgent(JOB, self.as_job.namespace, self.pod, ReferenceEngine(self.server.url),
                               self.tmp / self.pod, api=self.as_job.api, resync_seconds=2,
                               max_backoff=2, storage=self.storage, peer_server=self.relay,
                               peer_url=f"http://127.0.0.1:{self.relay.port}", fanout=1, peer_timeout=10)
        self.thread = threading.Thread(target=self.agent.run, name=self.pod, daemon=True)
        self.thread.start()

    def stop_agent(self) -> None:
        self.agent.stop()
        self.thread.join(10)

    def served(self) -> int | None:
        return requests.get(self.server.url + "/weights", timeout=5).json()["version"]

    def close(self) -> None:
        self.stop_agent()
        self.relay.stop()
        self.server.stop()


class JobClient:
    def __init__(self, api, namespace):
        self.api, self.namespace = api, namespace


@pytest.fixture
def setup(operator, api, namespace, cluster, bucket, s3_env, tmp_path):
    base = save_tiny_model(tmp_path / "base", seed=0)
    s3 = S3Storage()
    for f in base.iterdir():  # the base model, as a user uploads it: no manifest
        s3.write_bytes(f"s3://{bucket}/models/tiny/{f.name}", f.read_bytes())
    spec = job_manifest(JOB, model={"path": f"s3://{bucket}/models/tiny"},
                        checkpoint={"uri": f"s3://{bucket}/run", "endpoint": s3_env["AWS_ENDPOINT_URL"]},
                        inference={"replicas": 2, "gpusPerReplica": 1})
    create_job(api, namespace, spec)
    wait_for(lambda: len([p for p in kubernetes.client.CoreV1Api(api).list_namespaced_pod(
        namespace, label_selector=f"{names.LABEL_ROLE}={names.ROLE_INFERENCE}").items
        if p.status.phase == "Running"]) == 2, 90, "2 inference pods running")
    def as_identity(role: str, pod: str | None = None):
        """The role's own account; a sync agent's token is bound to its pod, as in the pod."""
        bound = (pod, kubernetes.client.CoreV1Api(api).read_namespaced_pod(pod, namespace).metadata.uid) if pod else None
        kc = cluster.service_account_kubeconfig(namespace, names.service_account_name(JOB, role),
                                                tmp_path / f"{pod or role}.kubeconfig", pod=bound)
        return kubernetes.client.CustomObjectsApi(kubernetes.config.new_client_from_config(str(kc)))

    as_trainer = as_identity(names.ROLE_TRAINER)
    as_agents = [as_identity(names.ROLE_INFERENCE, pod) for pod in PODS]
    proxy = FaultProxy(s3_env["AWS_ENDPOINT_URL"]).start()
    # Replica 0 reaches S3 through the fault proxy, with few retries, so faults show.
    flaky = S3Storage(client=boto3.client("s3", endpoint_url=proxy.url,
                                          config=Config(retries={"max_attempts": 2, "mode": "standard"})))
    direct = S3Storage()
    s3_reads_1 = S3ReadCounter().watch(direct.client)  # what replica 1 reads from S3
    replicas = [Replica(PODS[0], JobClient(as_agents[0], namespace), tmp_path, flaky),
                Replica(PODS[1], JobClient(as_agents[1], namespace), tmp_path, direct)]
    reporter = StatusReporter(JOB, namespace, as_trainer, min_interval=0)
    ctx = {"api": api, "ns": namespace, "root": f"s3://{bucket}/run", "replicas": replicas,
           "reporter": reporter, "proxy": proxy, "tmp": tmp_path, "versions": [], "s3_reads_1": s3_reads_1,
           "bytes": {}}
    yield ctx
    for r in replicas:
        r.close()
    reporter.close()
    proxy.stop()


def export(ctx, version: int) -> None:
    """What the trainer's sync_weight does: export (the real exporter), then report."""
    from transformers import AutoModelForCausalLM

    model_dir = save_tiny_model(ctx["tmp"] / f"v{version}", seed=version)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    rt = Runtime(rank=0, world_size=1, local_rank=0, device=__import__("torch").device("cpu"))
    manifest = export_hf(model, rt, S3Storage(), weights_uri(ctx["root"], version), str(model_dir),
                         version, dtype="fp32")
    ctx["versions"].append(version)
    ctx["bytes"][version] = manifest["bytes"]
    ctx["reporter"].report_weights(version, weights_uri(ctx["root"], version), manifest["id"],
                                   list(ctx["versions"]))


def wait_synced(ctx, version: int, timeout: float = 90) -> dict:
    status = wait_status(ctx["api"], ctx["ns"], JOB, lambda s: (
        (s.get("weightSync") or {}).get("target", {}).get("version") == version
        and s["weightSync"].get("synced") == "2/2"), timeout, f"2/2 replicas at version {version}")
    assert [r.served() for r in ctx["replicas"]] == [version, version]
    return status


def sync_condition(status: dict) -> dict:
    return next(x for x in status["conditions"] if x["type"] == names.COND_WEIGHTS_SYNCED)


def test_versions_pins_faults_and_restarts(setup, kubectl):
    ctx = setup
    status = wait_synced(ctx, 0)  # the base model (no manifest) before any export
    assert status["weightSync"]["target"]["uri"].endswith("/models/tiny")

    for v in (1, 2, 3):
        read_before = ctx["s3_reads_1"].bytes
        export(ctx, v)
        status = wait_synced(ctx, v)
        entries = status["weightSync"]["replicas"]
        entry = entries[PODS[1]]
        assert entry["id"] == status["weightSync"]["target"]["id"] and entry.get("error") is None
        assert entry["loadSeconds"] >= entry["downloadSeconds"] > 0 and entry["reloadSeconds"] > 0
        # Replica 1 got the files from replica 0 (checked against the manifest) and read
        # only the manifest from S3; replica 0 read S3.
        assert (entries[PODS[0]]["source"], entry["source"]) == ("s3", f"peer {PODS[0]}")
        assert entry["peer"].startswith("http://127.0.0.1:") and entries[PODS[0]]["peer"] != entry["peer"]
        assert 0 < ctx["s3_reads_1"].bytes - read_before < ctx["bytes"][v] / 20
    assert sync_condition(status)["status"] == "True"
    row = kubectl("get", "rftjob", JOB, "-n", ctx["ns"]).stdout.splitlines()[1].split()
    assert row[-3:-1] == ["3", "2/2"], row  # Weights and Synced columns (no checkpoint yet)

    # Roll back from git: pin version 2; both replicas serve it again.
    patch_spec(ctx["api"], ctx["ns"], JOB, {"sync": {"pinnedVersion": 2}})
    wait_synced(ctx, 2)

    # A pin to a version that does not exist: condition False, nothing breaks.
    patch_spec(ctx["api"], ctx["ns"], JOB, {"sync": {"pinnedVersion": 99}})
    status = wait_status(ctx["api"], ctx["ns"], JOB, lambda s: sync_condition(s)["reason"] == names.REASON_PIN_MISSING,
                         30, "PinnedVersionNotFound")
    assert "pinnedVersion=99" in sync_condition(status)["message"]
    assert status["weightSync"]["target"]["version"] == 2 and [r.served() for r in ctx["replicas"]] == [2, 2]
    patch_spec(ctx["api"], ctx["ns"], JOB, {"sync": {"pinnedVersion": None}})
    wait_synced(ctx, 3)

    # S3 refuses replica 0's downloads: the error shows in its entry, then it recovers.
    ctx["proxy"].fail_fraction = 1.0
    export(ctx, 4)
    status = wait_status(ctx["api"], ctx["ns"], JOB, lambda s: (s["weightSync"]["replicas"].get(PODS[0]) or {})
                         .get("error"), 60, "an error in replica 0's entry")
    entry = status["weightSync"]["replicas"][PODS[0]]
    assert "download" in entry["error"] and entry["version"] == 3 and entry["attempts"] >= 1
    assert "test-secret" not in str(status)
    ctx["proxy"].fail_fraction = 0.0
    status = wait_synced(ctx, 4)
    assert status["weightSync"]["replicas"][PODS[0]].get("error") is None

    # An agent that is down misses a version; restarted, it converges.
    ctx["replicas"][1].stop_agent()
    export(ctx, 5)
    wait_status(ctx["api"], ctx["ns"], JOB, lambda s: s["weightSync"].get("synced") == "1/2"
                and s["weightSync"]["target"]["version"] == 5, 60, "1/2 while an agent is down")
    ctx["replicas"][1].start_agent()
    wait_synced(ctx, 5)

    # Replica 0's relay server is gone (its advertised address refuses connections):
    # replica 1 reads the whole version from S3 instead.
    ctx["replicas"][0].relay.stop()
    read_before = ctx["s3_reads_1"].bytes
    export(ctx, 6)
    status = wait_synced(ctx, 6)
    assert status["weightSync"]["replicas"][PODS[1]]["source"] == f"peer {PODS[0]}, then s3"
    assert ctx["s3_reads_1"].bytes - read_before >= ctx["bytes"][6]


class GatedUploads:
    """The trainer's S3 storage with its file uploads held at a gate (real S3 behind it):
    what an upload that takes long looks like to the replicas."""

    def __init__(self, storage: S3Storage):
        self.storage, self.gate, self.started = storage, threading.Event(), threading.Event()

    def upload_file(self, path, uri):
        self.started.set()
        assert self.gate.wait(120), "the test never opened the gate"
        return self.storage.upload_file(path, uri)

    def __getattr__(self, name):
        return getattr(self.storage, name)


def trainer_server(root: Path) -> FastPath:
    """Rank 0's weights server, as FastPath.start opens it in the pod (here on loopback)."""
    server = PeerServer(root, host="127.0.0.1").start()
    return FastPath(root, server, f"http://127.0.0.1:{server.port}")


def fast_exporter(ctx, storage, fast: FastPath, announced: dict, digest: str | None = None) -> WeightExporter:
    """The trainer's wiring (rft_trainer.trainer.Trainer) of its exporter on the fast path:
    report each version when it is served from the trainer, and again once committed.
    `digest`: announce this instead of the manifest's (what a replica must refuse)."""
    reporter = ctx["reporter"]

    def on_announce(step, uri, manifest, a):
        announced[step] = {**a, "manifest": digest or a["manifest"]}
        reporter.report_weights(step, uri, manifest["id"], None, **announced[step])

    def on_publish(step, uri, manifest, versions, seconds):
        reporter.report_weights(step, uri, manifest["id"], versions, **announced.get(step, {}))

    def write(storage, dest, dtype, stage=None):
        from transformers import AutoModelForCausalLM

        version = int(dest.rstrip("/").rsplit("-", 1)[-1])
        model_dir = save_tiny_model(ctx["tmp"] / f"v{version}", seed=version)
        model = AutoModelForCausalLM.from_pretrained(str(model_dir))
        rt = Runtime(rank=0, world_size=1, local_rank=0, device=__import__("torch").device("cpu"))
        m = export_hf(model, rt, storage, dest, str(model_dir), version, dtype="fp32", stage=stage)
        ctx["bytes"][version] = m["bytes"]
        return m

    return WeightExporter(storage, ctx["root"], "fp32", keep=5, pinned=None, write=write,
                          on_publish=on_publish, fast=fast, on_announce=on_announce)


def test_fast_path_replicas_serve_a_version_before_its_upload_ends_and_only_the_announced_one(setup, caplog):
    """The trainer serves each version from its pod while its S3 upload is held: both
    replicas load it (replica 0 from the trainer, replica 1 from replica 0), every file
    checked against the manifest whose digest the trainer announced, before any byte of
    it is in S3. With the trainer's server gone they wait for the commit (no error), then
    read S3. A manifest that is not the announced one is refused, from a peer and from S3."""
    ctx = setup
    caplog.set_level(logging.INFO, logger="rft_serving.weights")
    wait_synced(ctx, 0)
    gated = GatedUploads(S3Storage())
    root = ctx["tmp"] / "trainer-weights"
    root.mkdir()
    fast = trainer_server(root)
    announced: dict = {}
    exporter = fast_exporter(ctx, gated, fast, announced)
    s3 = S3Storage()
    try:
        # 1. Served from the trainer while the upload is held at the gate.
        read_before = ctx["s3_reads_1"].bytes
        done = threading.Thread(target=exporter.publish, args=(1,), daemon=True)
        done.start()
        status = wait_synced(ctx, 1)
        target = status["weightSync"]["target"]
        assert target["peer"] == fast.url and target["manifest"] == announced[1]["manifest"]
        entries = status["weightSync"]["replicas"]
        assert (entries[PODS[0]]["source"], entries[PODS[1]]["source"]) == ("peer trainer", f"peer {PODS[0]}")
        assert gated.started.is_set() and not s3.list(weights_uri(ctx["root"], 1) + "/")  # nothing in S3 yet
        assert ctx["s3_reads_1"].bytes == read_before  # replica 1 read nothing from S3, not even a manifest
        gated.gate.set()
        done.join(60)
        committed = json.loads(s3.read_bytes(weights_uri(ctx["root"], 1) + "/manifest.json"))
        assert manifest_digest(committed) == announced[1]["manifest"]  # the commit is what was served

        # 2. The trainer's server is gone and the upload held: the replicas wait for the
        # commit without reporting an error, then read S3.
        gated.gate.clear()
        fast.server.stop()
        done = threading.Thread(target=exporter.publish, args=(2,), daemon=True)
        done.start()
        wait_status(ctx["api"], ctx["ns"], JOB, lambda s: s["weightSync"]["target"]["version"] == 2, 60, "target 2")
        waiting = lambda pod: any("waiting for version 2 in S3" in r.getMessage() and r.threadName == pod  # noqa: E731
                                  for r in caplog.records)
        wait_for(lambda: all(waiting(p) for p in PODS), 60, "both agents waiting for the commit")
        assert not any((e or {}).get("error") for e in job_status(ctx)["weightSync"]["replicas"].values())
        assert [r.served() for r in ctx["replicas"]] == [1, 1]
        gated.gate.set()
        done.join(60)
        status = wait_synced(ctx, 2)
        # Replica 0 read S3; replica 1 still read replica 0 (the relay does not need the trainer).
        entries = status["weightSync"]["replicas"]
        assert (entries[PODS[0]]["source"], entries[PODS[1]]["source"]) == ("s3", f"peer {PODS[0]}")

        # 3. An announcement whose digest is not the manifest's (the trainer's server sends
        # the real one): refused from the peer and from S3, and said so; version 2 serves on.
        fast.stop()
        fast = trainer_server(root)
        exporter = fast_exporter(ctx, S3Storage(), fast, announced, digest="sha256:" + "0" * 64)
        exporter.publish(3)
        status = wait_status(ctx["api"], ctx["ns"], JOB, lambda s: "not the one announced" in str(
            (s["weightSync"]["replicas"].get(PODS[0]) or {}).get("error")), 60, "the wrong digest refused")
        assert status["weightSync"]["replicas"][PODS[0]]["version"] == 2 and ctx["replicas"][0].served() == 2
        assert any("from peer trainer is not the one announced" in r.getMessage() for r in caplog.records)
    finally:
        gated.gate.set()
        fast.stop()


def job_status(ctx) -> dict:
    return kubernetes.client.CustomObjectsApi(ctx["api"]).get_namespaced_custom_object(
        names.GROUP, names.VERSION, ctx["ns"], names.PLURAL, JOB).get("status") or {}
