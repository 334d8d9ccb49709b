"""What bench/reconcile.py runs side by side on one KWOK cluster: our operator, Kubeflow's
training-operator (the peer, PyTorchJob) and bare pods (no operator: the floor).

Each side knows how to install what it needs once, start a fresh operator for a wave,
create one job of `pods` GPU pods, tell when its job object says Running, find the job a
pod belongs to, and read its operator's count of API writes.

Ours runs what the default install runs (`OURS_PARTS`; `without` turns parts off, for
diagnosis): the admission policies of manifests/base/admission-policies.yaml; the owner
webhook served by the operator process itself (`--webhook-port`, a serving pair for
127.0.0.1, registered by URL for the leader, the replica that also reconciles: in a
cluster the Service spreads the calls over both replicas; registered per wave, removed
when the wave ends, so no other side's writes wait on it, and the API server is seen to call
it before the wave starts); leader election with two replicas at the shipped timings (the
second waits); Kueue running (its CRDs and manager, no queues: the jobs are not queued, so
the operator watches Workloads but creates none).
"""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import kubernetes
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from e2e.cluster import Cluster, cache_dir, free_port  # noqa: E402
from e2e.demo import install_api, kubectl  # noqa: E402
from rft_contract import names  # noqa: E402
from rft_operator import ownerhook  # noqa: E402

GPU = "nvidia.com/gpu"
IMAGE = "trainer:bench"
PEER_VERSION = os.environ.get("TRAINING_OPERATOR_VERSION", "v1.9.3")
PEER_NAMESPACE = "kubeflow"
# Shipped defaults are 1 worker thread and 20 QPS (burst 30); matched concurrency, no cap.
PEER_ARGS = ("--enable-scheme=pytorchjob", "--controller-threads=16", "--kube-api-qps=1000",
             "--kube-api-burst=2000")
WRITE_METHODS = ("POST", "PUT", "PATCH", "DELETE")
CERT_DIR = Path("/tmp/k8s-webhook-server/serving-certs")  # fixed in training-operator's pkg/cert
OPERATOR_NS = "rftjob-system"
POLICIES = ROOT / "manifests/base/admission-policies.yaml"
# What ours runs by default, as the default install does; each can be turned off (`--without`).
OURS_PARTS = {
    "policies": "admission policies",
    "webhook": "owner webhook (served by the leader)",
    "leader": "leader election x2",
    "kueue-manager": "Kueue manager",  # without it: Kueue's CRDs only
    "kueue": "Kueue CRDs (jobs not queued)",
}
LEADER_WAITS = r"leader election: \S+ leads; this replica \(\S+\) waits"
PROBE_NS, PROBE_JOB = "bench-webhook-probe", "probe"  # a real (suspended) job beside which a made-up one is refused


def _http_get(url: str, timeout: float = 2.0) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.read().decode()
    except OSError:
        return None


def _wait(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None, log: Path | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc is not None and proc.poll() is not None:
            tail = log.read_text()[-3000:] if log else ""
            raise RuntimeError(f"{what}: the process exited with {proc.returncode}\n{tail}")
        time.sleep(0.2)  # polling a readiness endpoint, not synchronisation
    raise RuntimeError(f"{what}: not ready after {timeout}s")


class Side:
    name = ""
    job_label = ""  # the pod label naming its job
    has_operator = True

    def __init__(self, cluster: Cluster, state: Path):
        self.cluster, self.state = cluster, state
        self.proc: subprocess.Popen | None = None
        self.log: Path | None = None

    def install(self) -> None:
        pass

    def start(self, wave: int | str) -> None:
        pass

    def writes(self) -> int:
        return 0

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def create(self, api: kubernetes.client.ApiClient, namespace: str, name: str, pods: int) -> None:
        raise NotImplementedError

    def job_running(self, obj: dict[str, Any]) -> bool:
        return False

    def list_jobs(self, api: kubernetes.client.ApiClient, namespace: str):
        """The list/watch function of this side's job objects (None: no job objects)."""
        return None

    def error_lines(self) -> list[str]:
        return []

    def close(self) -> None:
        """At the end of the run."""
        self.stop()


def _pod(name: str, labels: dict[str, str]) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels},
            "spec": {"restartPolicy": "Never",
                     "containers": [{"name": "trainer", "image": IMAGE,
                                     "resources": {"limits": {GPU: "1"}, "requests": {GPU: "1"}}}]}}


class Ours(Side):
    name = "ours"
    job_label = names.LABEL_JOB

    def __init__(self, cluster: Cluster, state: Path, env: dict[str, str] | None = None,
                 without: tuple[str, ...] = ()):
        super().__init__(cluster, state)
        self.env = env or {}
        unknown = set(without) - set(OURS_PARTS)
        if unknown:
            raise ValueError(f"unknown parts {sorted(unknown)}; ours runs {', '.join(OURS_PARTS)}")
        self.parts = [p for p in OURS_PARTS
                      if p not in without and not (p == "kueue-manager" and "kueue" in without)]
        self.port = 0
        self.replicas: list[subprocess.Popen] = []  # the leader first
        self.logs: list[Path] = []
        self.cert_dir = state / "webhook-certs"
        self.kueue = None

    def describe(self) -> str:
        """What this side runs, for the report."""
        shown = [OURS_PARTS[p] for p in self.parts if p != "kueue-manager"]
        if "kueue-manager" in self.parts:
            shown[-1] = "Kueue running (its CRDs and manager; jobs not queued)"
        if "leader" not in self.parts and "webhook" in self.parts:
            shown[shown.index(OURS_PARTS["webhook"])] = "owner webhook (served by the operator)"
        off = [p for p in OURS_PARTS
               if p not in self.parts and not (p == "kueue-manager" and "kueue" not in self.parts)]
        return ("default install" + (f" without {', '.join(off)}" if off else "") + ": "
                + (", ".join(shown) if shown else "the operator alone"))

    def install(self) -> None:
        install_api(self.cluster)
        if "policies" not in self.parts:  # every binding of the install: no policy is evaluated
            for doc in yaml.safe_load_all(POLICIES.read_text()):
                if doc and doc.get("kind") == "ValidatingAdmissionPolicyBinding":
                    kubectl(self.cluster, "delete", "validatingadmissionpolicybinding", doc["metadata"]["name"],
                            "--ignore-not-found")
        # Until the new CRD's storage is up, a list answers 429, which the operator's first
        # list would log as an error.
        _wait(lambda: subprocess.run(["kubectl", f"--kubeconfig={self.cluster.kubeconfig}", "get", names.PLURAL, "-A"],
                                     capture_output=True).returncode == 0, 60, "the RFTJob CRD's storage")
        self.kubeconfig = self.cluster.service_account_kubeconfig(
            OPERATOR_NS, "rftjob-operator", self.state / "op.kubeconfig")
        if "kueue" in self.parts:  # before the operator: it watches Workloads where Kueue's API is served
            from e2e.kueue import KueueProcess

            self.kueue = KueueProcess(self.cluster, self.state / "kueue")
            if "kueue-manager" in self.parts:
                self.kueue.start()
            else:
                self.kueue.install_crds()
        if "webhook" in self.parts:
            ca, cert, key = ownerhook.serving_pair(["127.0.0.1"])
            self.cert_dir.mkdir(parents=True, exist_ok=True)
            for name, pem in (("ca.crt", ca), ("tls.crt", cert), ("tls.key", key)):
                (self.cert_dir / name).write_bytes(pem)
            # The webhook's probe: a made-up job's object beside this real one is refused.
            kubectl(self.cluster, "create", "namespace", PROBE_NS)
            probe = rftjob(PROBE_JOB, 1)
            probe["metadata"]["namespace"], probe["spec"]["suspend"] = PROBE_NS, True
            kubectl(self.cluster, "create", "-f", "-", input=json.dumps(probe))

    def _spawn(self, log: Path, metrics_port: int, webhook_port: int = 0) -> subprocess.Popen:
        args = ["--log-format=json", f"--metrics-port={metrics_port}"]
        if webhook_port:
            args += [f"--webhook-port={webhook_port}", f"--webhook-cert-dir={self.cert_dir}"]
        if "leader" in self.parts:  # the shipped timings (15/10/2 s)
            args += ["--leader-elect", f"--leader-elect-namespace={OPERATOR_NS}"]
        with open(log, "wb") as out:
            return subprocess.Popen([sys.executable, "-m", "rft_operator", *args],
                                    env={**os.environ, **self.env, "KUBECONFIG": str(self.kubeconfig)},
                                    stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)

    def start(self, wave: int | str) -> None:
        self.port = free_port()
        webhook = "webhook" in self.parts
        if "leader" in self.parts:  # one a crashed run left would hold the next leader for its duration
            kubectl(self.cluster, "delete", "lease", "rftjob-operator", "-n", OPERATOR_NS, "--ignore-not-found")
        ports = [free_port() if webhook else 0 for _ in range(2)]
        # The first replica leads (its log and metrics are the side's); the second waits.
        self.log = self.state / f"ours-{wave}.log"
        self.proc = self._spawn(self.log, self.port, ports[0])
        self.replicas, self.logs = [self.proc], [self.log]
        _wait(lambda: "rftjob-operator started" in self.log.read_text(), 60, "our operator", self.proc, self.log)
        if webhook:
            self._register_webhook(ports[0])
        if "leader" in self.parts:
            flog = self.state / f"ours-{wave}-waiting.log"
            follower = self._spawn(flog, free_port(), ports[1])
            self.replicas.append(follower)
            self.logs.append(flog)
            _wait(lambda: re.search(LEADER_WAITS, flog.read_text()) is not None, 60, "the second replica to wait",
                  follower, flog)

    def _register_webhook(self, port: int) -> None:
        config = ownerhook.webhook_configuration((self.cert_dir / "ca.crt").read_bytes(),
                                                 url=f"https://127.0.0.1:{port}")
        kubectl(self.cluster, "delete", "validatingwebhookconfiguration", ownerhook.WEBHOOK_NAME, "--ignore-not-found")
        kubectl(self.cluster, "create", "-f", "-", input=json.dumps(config))
        # Called: a dry-run ServiceAccount of a made-up job, by the operator's identity,
        # beside a real job (which the admission policies alone admit), is refused by it.
        api = kubernetes.config.new_client_from_config(str(self.kubeconfig))
        core = kubernetes.client.CoreV1Api(api)
        ghost = {"metadata": {"name": "ghost-rft-probe", "labels": {
            names.LABEL_JOB: "ghost", names.LABEL_MANAGED_BY: names.MANAGED_BY}, "ownerReferences": [{
                "apiVersion": names.API_VERSION, "kind": names.KIND, "name": "ghost",
                "uid": "00000000-0000-0000-0000-000000000000", "controller": True, "blockOwnerDeletion": True}]}}

        last = ["admitted"]

        def refused_by_webhook() -> bool:
            try:
                core.create_namespaced_service_account(PROBE_NS, ghost, dry_run="All")
            except kubernetes.client.ApiException as e:
                last[0] = f"{e.status} {e.body}"
                return e.status == 403 and f"there is no RFTJob {PROBE_NS}/ghost" in (e.body or "")
            last[0] = "admitted"
            return False

        try:
            _wait(refused_by_webhook, 30, "the API server to call the owner webhook", self.proc, self.log)
        except RuntimeError as e:
            raise RuntimeError(f"{e}; a made-up job's dry-run ServiceAccount: {last[0][:500]} "
                               f"(the operator's log: {self.log})") from None
        finally:
            api.close()

    def stop(self) -> None:
        # The webhook's configuration first (it fails closed: nothing may wait on a
        # stopped operator), then the waiting replica (else it would take over), the leader.
        if "webhook" in self.parts and self.replicas:
            kubectl(self.cluster, "delete", "validatingwebhookconfiguration", ownerhook.WEBHOOK_NAME,
                    "--ignore-not-found", check=False)
        for proc in reversed(self.replicas):
            self.proc = proc
            super().stop()
        self.replicas = []
        self.proc = None

    def close(self) -> None:
        """At the end of the run: Kueue stopped (its webhooks removed)."""
        self.stop()
        if self.kueue is not None and "kueue-manager" in self.parts:
            self.kueue.stop()
        self.kueue = None

    def writes(self) -> int:
        text = _http_get(f"http://127.0.0.1:{self.port}/metrics") or ""
        m = re.search(r"^rftjob_api_writes(?:_total)? (\S+)$", text, re.M)
        return int(float(m.group(1))) if m else 0

    def create(self, api, namespace: str, name: str, pods: int) -> None:
        kubernetes.client.CustomObjectsApi(api).create_namespaced_custom_object(
            names.GROUP, names.VERSION, namespace, names.PLURAL, rftjob(name, pods))

    def job_running(self, obj: dict[str, Any]) -> bool:
        return (obj.get("status") or {}).get("phase") == names.RUNNING

    def list_jobs(self, api, namespace: str):
        custom = kubernetes.client.CustomObjectsApi(api)
        return lambda **kw: custom.list_namespaced_custom_object(names.GROUP, names.VERSION, namespace, names.PLURAL, **kw)

    def error_lines(self) -> list[str]:
        return [x for log in self.logs for x in log.read_text().splitlines()
                if re.search(r'"severity": "(error|fatal)"', x) or "Traceback" in x]

    def reconciles(self) -> int:
        m = re.search(r"reconciles=(\d+)", self.log.read_text())
        return int(m.group(1)) if m else 0


def rftjob(name: str, pods: int) -> dict:
    return {
        "apiVersion": names.API_VERSION, "kind": names.KIND, "metadata": {"name": name},
        "spec": {
            "model": {"path": "s3://models/tiny"}, "algorithm": {"name": "grpo"},
            "trainer": {"image": IMAGE, "nodes": pods, "gpusPerNode": 1, "totalSteps": 10, "batchSize": 4},
            "checkpoint": {"uri": "s3://ckpt/bench"},
        },
    }


class Peer(Side):
    """Kubeflow's training-operator, built by `bash e2e/build-binaries.sh training_operator`.
    It runs under the admin identity, watching every namespace as ours does."""

    name = "peer"
    job_label = "training.kubeflow.org/job-name"

    def __init__(self, cluster: Cluster, state: Path, args: tuple[str, ...] = PEER_ARGS):
        super().__init__(cluster, state)
        self.args = args
        self.dir = cache_dir() / "bin" / f"training-operator-{PEER_VERSION}"
        self.ports: dict[str, int] = {}

    def install(self) -> None:
        if not os.access(self.dir / "training-operator", os.X_OK):
            subprocess.run(["bash", str(ROOT / "e2e/build-binaries.sh"), "training_operator"], check=True,
                           env={**os.environ, "TRAINING_OPERATOR_VERSION": PEER_VERSION})
        kubectl(self.cluster, "apply", "--server-side", "-f", str(self.dir / "crds/kubeflow.org_pytorchjobs.yaml"))
        # Until the CRD has conditions at all, `kubectl wait` fails instead of waiting.
        def established() -> bool:
            crd = json.loads(kubectl(self.cluster, "get", "crd/pytorchjobs.kubeflow.org", "-o=json"))
            return any(x.get("type") == "Established" and x.get("status") == "True"
                       for x in (crd.get("status") or {}).get("conditions") or [])
        _wait(established, 60, "the PyTorchJob CRD")
        kubectl(self.cluster, "create", "namespace", PEER_NAMESPACE)
        # The cert rotator only updates this Secret (it never creates it), and reports ready
        # once it has put its CA into the webhook configuration: one with no webhooks, so
        # the API server calls nothing. The webhook server wants its directory.
        kubectl(self.cluster, "create", "secret", "generic", "training-operator-webhook-cert", "-n", PEER_NAMESPACE)
        kubectl(self.cluster, "apply", "-f", "-", input=json.dumps({
            "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
            "metadata": {"name": "validator.training-operator.kubeflow.org"}, "webhooks": []}))
        CERT_DIR.mkdir(parents=True, exist_ok=True)
        for f in CERT_DIR.glob("*"):  # a previous run's certificates match no Secret of this cluster
            f.unlink()
        # Its own identity, as in its Deployment: a ServiceAccount's requests share the API
        # server's priority level (API Priority and Fairness) with ours; the admin's are exempt.
        kubectl(self.cluster, "create", "serviceaccount", "training-operator", "-n", PEER_NAMESPACE)
        kubectl(self.cluster, "create", "clusterrolebinding", "training-operator", "--clusterrole=cluster-admin",
                f"--serviceaccount={PEER_NAMESPACE}:training-operator")
        self.kubeconfig = self.cluster.service_account_kubeconfig(
            PEER_NAMESPACE, "training-operator", self.state / "peer.kubeconfig")

    def _mount_certs(self) -> bool:
        """What the kubelet does in its pod: the rotator writes the certificates into the
        Secret and waits until they appear in its certificate directory."""
        if (CERT_DIR / "tls.crt").exists():
            return True
        secret = json.loads(kubectl(self.cluster, "get", "secret", "training-operator-webhook-cert",
                                    "-n", PEER_NAMESPACE, "-o=json"))
        data = secret.get("data") or {}
        if not {"tls.crt", "tls.key", "ca.crt"} <= set(data):
            return False
        for name, value in data.items():
            (CERT_DIR / name).write_bytes(base64.b64decode(value))
        return True

    def start(self, wave: int | str) -> None:
        self.ports = {k: free_port() for k in ("metrics", "probe", "webhook")}
        self.log = self.state / f"peer-{wave}.log"
        self.proc = subprocess.Popen(
            [str(self.dir / "training-operator"), *self.args,
             f"--metrics-bind-address=127.0.0.1:{self.ports['metrics']}",
             f"--health-probe-bind-address=127.0.0.1:{self.ports['probe']}",
             f"--webhook-server-port={self.ports['webhook']}"],
            env={**os.environ, "KUBECONFIG": str(self.kubeconfig), "MY_POD_NAMESPACE": PEER_NAMESPACE},
            stdout=open(self.log, "wb"), stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{self.ports['probe']}/readyz"
        # The rotator looks for the files after 1, 2, 4, 8... s: the first wave waits longest.
        _wait(lambda: self._mount_certs() and _http_get(url) is not None, 180, "training-operator /readyz",
              self.proc, self.log)

    def writes(self) -> int:
        text = _http_get(f"http://127.0.0.1:{self.ports['metrics']}/metrics") or ""
        total = 0.0
        for line in text.splitlines():
            if line.startswith("rest_client_requests_total{"):
                m = re.search(r'method="([A-Z]+)"', line)
                if m and m.group(1) in WRITE_METHODS:
                    total += float(line.rsplit(" ", 1)[1])
        return int(total)

    def create(self, api, namespace: str, name: str, pods: int) -> None:
        kubernetes.client.CustomObjectsApi(api).create_namespaced_custom_object(
            "kubeflow.org", "v1", namespace, "pytorchjobs", pytorchjob(name, pods))

    def job_running(self, obj: dict[str, Any]) -> bool:
        return any(x.get("type") == "Running" and x.get("status") == "True"
                   for x in (obj.get("status") or {}).get("conditions") or [])

    def list_jobs(self, api, namespace: str):
        custom = kubernetes.client.CustomObjectsApi(api)
        return lambda **kw: custom.list_namespaced_custom_object("kubeflow.org", "v1", namespace, "pytorchjobs", **kw)

    def error_lines(self) -> list[str]:
        return [x for x in self.log.read_text().splitlines() if "\tERROR\t" in x]


def pytorchjob(name: str, pods: int) -> dict:
    """A master and pods-1 workers, one GPU each, as a torchrun gang of `pods` nodes."""
    def replica(n: int) -> dict:
        return {"replicas": n, "restartPolicy": "Never", "template": {"spec": {"containers": [
            {"name": "pytorch", "image": IMAGE, "resources": {"limits": {GPU: "1"}, "requests": {GPU: "1"}}}]}}}
    specs = {"Master": replica(1)}
    if pods > 1:
        specs["Worker"] = replica(pods - 1)
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": name},
            "spec": {"pytorchReplicaSpecs": specs}}


class Bare(Side):
    """The floor: the same number of GPU pods, created directly (no operator, no job)."""

    name = "bare"
    job_label = "bench.rft.dev/job"
    has_operator = False

    def create(self, api, namespace: str, name: str, pods: int) -> None:
        core = kubernetes.client.CoreV1Api(api)
        for rank in range(pods):
            core.create_namespaced_pod(namespace, _pod(f"{name}-{rank}", {self.job_label: name}))
