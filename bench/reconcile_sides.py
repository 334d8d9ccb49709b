"""What bench/reconcile.py runs side by side on one KWOK cluster: our operator, Kubeflow's
training-operator (the peer, PyTorchJob) and bare pods (no operator: the floor).

Each side knows how to install what it needs once, start a fresh operator for a wave,
create one job of `pods` GPU pods, tell when its job object says Running, find the job a
pod belongs to, and read its operator's count of API writes.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from e2e.cluster import Cluster, cache_dir, free_port  # noqa: E402
from e2e.demo import install_api, kubectl  # noqa: E402
from rft_contract import names  # noqa: E402

GPU = "nvidia.com/gpu"
IMAGE = "trainer:bench"
PEER_VERSION = os.environ.get("TRAINING_OPERATOR_VERSION", "v1.9.3")
PEER_NAMESPACE = "kubeflow"
# Shipped defaults are 1 worker thread and 20 QPS (burst 30); matched concurrency, no cap.
PEER_ARGS = ("--enable-scheme=pytorchjob", "--controller-threads=16", "--kube-api-qps=1000",
             "--kube-api-burst=2000")
WRITE_METHODS = ("POST", "PUT", "PATCH", "DELETE")
CERT_DIR = Path("/tmp/k8s-webhook-server/serving-certs")  # fixed in training-operator's pkg/cert


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


def _pod(name: str, labels: dict[str, str]) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels},
            "spec": {"restartPolicy": "Never",
                     "containers": [{"name": "trainer", "image": IMAGE,
                                     "resources": {"limits": {GPU: "1"}, "requests": {GPU: "1"}}}]}}


class Ours(Side):
    name = "ours"
    job_label = names.LABEL_JOB

    def __init__(self, cluster: Cluster, state: Path, env: dict[str, str] | None = None):
        super().__init__(cluster, state)
        self.env = env or {}
        self.port = 0

    def install(self) -> None:
        install_api(self.cluster)
        # Until the new CRD's storage is up, a list answers 429, which the operator's first
        # list would log as an error.
        _wait(lambda: subprocess.run(["kubectl", f"--kubeconfig={self.cluster.kubeconfig}", "get", names.PLURAL, "-A"],
                                     capture_output=True).returncode == 0, 60, "the RFTJob CRD's storage")
        self.kubeconfig = self.cluster.service_account_kubeconfig(
            "rftjob-system", "rftjob-operator", self.state / "op.kubeconfig")

    def start(self, wave: int | str) -> None:
        self.port = free_port()
        self.log = self.state / f"ours-{wave}.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rft_operator", "--log-format=json", f"--metrics-port={self.port}"],
            env={**os.environ, **self.env, "KUBECONFIG": str(self.kubeconfig)},
            stdout=open(self.log, "wb"), stderr=subprocess.STDOUT, cwd=ROOT)
        _wait(lambda: "rftjob-operator started" in self.log.read_text(), 60, "our operator", self.proc, self.log)

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
        return [x for x in self.log.read_text().splitlines()
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
