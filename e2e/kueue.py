"""Kueue (sigs.k8s.io/kueue) as a host process against the local control plane, for the
tests of the operator's Kueue integration.

The real manager (`bash e2e/build-binaries.sh kueue`, version in versions.env), the
module's own CRDs and webhook configurations, and none of a cluster install's services:

* CRDs as the module ships them (`config/components/crd/bases`): conversion strategy
  None; v1beta2 is the storage version and the only one used here.
* Its webhook server on 127.0.0.1 with a certificate for that address (e2e/pki.py); the
  module's webhook configurations rewritten to call it by `url:` with that CA, keeping
  only the webhooks of Kueue's own kinds (every built-in integration is off but batch/job,
  which an empty list defaults to; its webhooks are left out too: no test here runs a
  Job through Kueue). They are deleted when Kueue stops, so nothing in the cluster
  waits on a webhook that is gone (failurePolicy Fail); the CRDs stay.
* internalCertManagement off, no leader election, VisibilityOnDemand off (an APIService
  backed by an in-cluster Service), and `RFTJob.v1alpha1.rft.dev` as an external framework.
* Its metrics server is always HTTPS with a certificate read from the fixed path
  /etc/kueue/metrics/certs (cmd/kueue/main.go) when internal certificates are off. Kueue
  runs in a private mount namespace (`unshare --mount`, root) whose /etc is an overlay
  that adds that directory, so the host's /etc is never written.

    kueue = KueueProcess(cluster, state_dir)
    kueue.start()              # CRDs, webhooks, the process; returns once it is ready
    kueue.create_resource_flavor("gpu", node_labels={...}, tolerations=[...])
    kueue.create_cluster_queue("cq", "gpu", {"cpu": "8", "nvidia.com/gpu": "4"})
    kueue.create_local_queue("ns", "lq", "cq")
    kueue.get("Workload", "wl", "ns"); kueue.delete("ClusterQueue", "cq")
    kueue.log_path; kueue.stop()
"""

from __future__ import annotations

import base64
import os
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import yaml

from .cluster import ApiError, KubeApi
from .host import cache_dir, log_tail, read_versions, stop_group
from .pki import write_serving_pair
from .s3server import free_ports

GROUP = "kueue.x-k8s.io"
API_VERSION = f"{GROUP}/v1beta2"
# The RFTJob as Kueue's external framework: Kind.version.group.
EXTERNAL_FRAMEWORK = "RFTJob.v1alpha1.rft.dev"
# A bare list is defaulted to batch/job (apis/config/v1beta2/defaults.go): name it.
FRAMEWORKS = ["batch/job"]
FEATURE_GATES = "VisibilityOnDemand=false"
WEBHOOK_HOST = "127.0.0.1"
METRICS_CERT_DIR = "/etc/kueue/metrics/certs"  # fixed in cmd/kueue/main.go
WEBHOOK_CONFIGURATIONS = {  # kind -> name (a cluster install's names)
    "MutatingWebhookConfiguration": "kueue-mutating-webhook-configuration",
    "ValidatingWebhookConfiguration": "kueue-validating-webhook-configuration",
}
# kind -> (plural, namespaced), for the objects tests create.
KINDS = {
    "ResourceFlavor": ("resourceflavors", False),
    "ClusterQueue": ("clusterqueues", False),
    "LocalQueue": ("localqueues", True),
    "Workload": ("workloads", True),
    "WorkloadPriorityClass": ("workloadpriorityclasses", False),
    "Cohort": ("cohorts", False),
    "AdmissionCheck": ("admissionchecks", False),
    "Topology": ("topologies", False),
}
# Mounts the metrics certificate where Kueue reads it, in a mount namespace of its own:
# $1 the certificate dir, $2 an empty dir for the overlay's tmpfs, then the command.
MOUNT_SCRIPT = """set -e
mount -t tmpfs -o mode=0700 rft-kueue "$2"
mkdir "$2/upper" "$2/work"
mount -t overlay -o "lowerdir=/etc,upperdir=$2/upper,workdir=$2/work" rft-kueue /etc
mkdir -p {certs}
cp "$1/tls.crt" "$1/tls.key" {certs}/
shift 2
exec "$@"
""".format(certs=METRICS_CERT_DIR)


class KueueError(RuntimeError):
    """Kueue could not be found, installed or started."""


@dataclass(frozen=True)
class KueueFiles:
    """The pinned binary, CRDs and webhook manifests in the build cache."""

    binary: Path
    crds: Path
    webhooks: Path

    @classmethod
    def locate(cls) -> "KueueFiles":
        version = read_versions()["KUEUE_VERSION"]
        out = cache_dir() / "bin" / f"kueue-{version}"
        files = cls(out / "kueue", out / "crds", out / "manifests.yaml")
        if not os.access(files.binary, os.X_OK) or not files.webhooks.is_file() or not files.crds.is_dir():
            raise KueueError(f"Kueue {version} missing in {out}; build it with "
                             f"`bash e2e/build-binaries.sh kueue` (Go toolchain, a few minutes)")
        return files


# --------------------------------------------------------------------------- pure


def build_configuration(ports: dict[str, int], cert_dir: Path) -> dict[str, Any]:
    """Kueue's Configuration: webhook, probes and metrics on loopback ports, no
    certificate management, no leader election, no waitForPodsReady."""
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "namespace": "kueue-system",
        "manageJobsWithoutQueueName": False,
        "internalCertManagement": {"enable": False},
        "webhook": {"host": WEBHOOK_HOST, "port": ports["webhook"], "certDir": str(cert_dir)},
        "health": {"healthProbeBindAddress": f"127.0.0.1:{ports['health']}"},
        "metrics": {"bindAddress": f"127.0.0.1:{ports['metrics']}"},
        "leaderElection": {"leaderElect": False},  # defaulted to true otherwise
        "integrations": {"frameworks": FRAMEWORKS, "externalFrameworks": [EXTERNAL_FRAMEWORK]},
    }


def build_webhook_configurations(manifests: str, base_url: str, ca_pem: bytes) -> list[dict[str, Any]]:
    """The module's webhook configurations with only the webhooks of Kueue's own kinds,
    each calling `base_url` + its path with `ca_pem` instead of the in-cluster Service."""
    ca = base64.b64encode(ca_pem).decode()
    configs = []
    for doc in yaml.safe_load_all(manifests):
        if not doc:
            continue
        hooks = []
        for hook in doc["webhooks"]:
            if not all(GROUP in rule.get("apiGroups", []) for rule in hook["rules"]):
                continue
            path = hook["clientConfig"]["service"]["path"]
            hooks.append({**hook, "clientConfig": {"url": base_url + path, "caBundle": ca}})
        configs.append({"apiVersion": doc["apiVersion"], "kind": doc["kind"],
                        "metadata": {"name": WEBHOOK_CONFIGURATIONS[doc["kind"]]}, "webhooks": hooks})
    return configs


def object_path(kind: str, name: str | None = None, namespace: str | None = None) -> str:
    """The API path of a Kueue object (its collection without `name`)."""
    plural, namespaced = KINDS[kind]
    if namespaced and not namespace:
        raise ValueError(f"{kind} is namespaced: pass namespace")
    path = f"/apis/{API_VERSION}" + (f"/namespaces/{namespace}" if namespaced else "") + f"/{plural}"
    return path + (f"/{name}" if name else "")


def _wait(predicate: Callable[[], Any], timeout: float, what: str, died: Callable[[], str | None]) -> None:
    """Polls `predicate` until it holds; fails at once with `died()`'s message."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while True:
        message = died()
        if message:
            raise KueueError(message)
        try:
            if predicate():
                return
        except Exception as e:  # noqa: BLE001 - not yet; reported on timeout
            last = e
        if time.monotonic() > deadline:
            raise KueueError(f"timed out after {timeout:.0f}s waiting for {what}"
                             + (f" (last error: {last})" if last else ""))
        time.sleep(0.5)


# --------------------------------------------------------------------------- process


class KueueProcess:
    """The Kueue manager on the host, with its CRDs and webhooks in `cluster`."""

    def __init__(self, cluster, state_dir: str | os.PathLike, extra_args: tuple[str, ...] = ()):
        self.cluster, self.state_dir = cluster, Path(state_dir)
        self.extra_args = tuple(extra_args)
        self.files = KueueFiles.locate()
        self.log_path = self.state_dir / "kueue.log"
        self.config_path = self.state_dir / "config.yaml"
        self.cert_dir = self.state_dir / "certs"
        self.ports: dict[str, int] = {}
        self.proc: subprocess.Popen | None = None
        self.api: KubeApi = cluster.api()

    @property
    def metrics_url(self) -> str:
        """HTTPS (cert_dir/ca.crt); a bearer token the API server authorizes for /metrics."""
        return f"https://127.0.0.1:{self.ports['metrics']}/metrics"

    # -- lifecycle

    def start(self, timeout: float = 120) -> None:
        """CRDs, configuration, webhooks, then the process; returns once it is ready and
        the API server calls its webhooks."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.install_crds()
        write_serving_pair(self.cert_dir, [WEBHOOK_HOST])
        self.ports = dict(zip(("webhook", "health", "metrics"), free_ports(3)))
        self.config_path.write_text(yaml.safe_dump(build_configuration(self.ports, self.cert_dir)))
        self.apply_webhooks()
        self._spawn()
        try:
            _wait(self._ready, timeout, "Kueue's readiness endpoint", self._died)
            _wait(self._webhooks_called, 30, "the API server to call Kueue's webhooks", self._died)
        except KueueError as e:
            self.stop()
            raise KueueError(f"{e}\n{self.failure_report()}") from None

    def stop(self, grace: float = 15) -> None:
        """Deletes the webhook configurations (Kueue objects are admitted again without
        it), then SIGTERM, and SIGKILL after `grace` seconds."""
        self.delete_webhooks()
        stop_group(self.proc, grace)

    def __enter__(self) -> "KueueProcess":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, lines: int = 60) -> str:
        return log_tail(self.log_path, lines)

    def failure_report(self, lines: int = 30) -> str:
        """Kueue's error lines (a flag error comes first, before the usage text), then the
        tail of its log."""
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        errors = [line for line in text.splitlines()
                  if '"level":"error"' in line or line.startswith(("flag provided", "invalid value", "mount:"))]
        report = f"errors in {self.log_path}:\n" + "\n".join(errors[-10:]) + "\n" if errors else ""
        return report + f"tail of {self.log_path}:\n{log_tail(self.log_path, lines)}"

    def _spawn(self) -> None:
        overlay = self.state_dir / "etc-overlay"
        overlay.mkdir(exist_ok=True)
        argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", MOUNT_SCRIPT, "kueue-mounts",
                str(self.cert_dir), str(overlay),
                str(self.files.binary), f"--config={self.config_path}", f"--kubeconfig={self.cluster.kubeconfig}",
                f"--feature-gates={FEATURE_GATES}", *self.extra_args]
        with open(self.log_path, "ab") as log:
            # Its own session: a Ctrl-C of the tests does not reach it before stop() does.
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         cwd=self.state_dir, start_new_session=True)

    def _died(self) -> str | None:
        if self.proc is not None and self.proc.poll() is not None:
            return f"kueue exited with status {self.proc.returncode}"
        return None

    def _ready(self) -> bool:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(f"http://127.0.0.1:{self.ports['health']}/readyz", timeout=5) as resp:
            return resp.status == 200

    def _webhooks_called(self) -> bool:
        """A dry-run ResourceFlavor comes back with the finalizer Kueue's mutating webhook adds."""
        probe = {"apiVersion": API_VERSION, "kind": "ResourceFlavor", "metadata": {"name": "rft-kueue-probe"}}
        created = self.api.request("POST", object_path("ResourceFlavor") + "?dryRun=All", probe)
        return f"{GROUP}/resource-in-use" in created["metadata"].get("finalizers", [])

    # -- installation

    def install_crds(self, timeout: float = 60) -> None:
        """Creates (or replaces) Kueue's CRDs and waits until each is Established."""
        names = []
        for path in sorted(self.files.crds.glob("*.yaml")):
            crd = yaml.safe_load(path.read_text())
            self._apply("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd)
            names.append(crd["metadata"]["name"])

        def established() -> bool:
            for name in names:
                crd = self.api.get(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}")
                if not any(c["type"] == "Established" and c["status"] == "True"
                           for c in crd.get("status", {}).get("conditions", [])):
                    return False
            return True

        _wait(established, timeout, "Kueue's CRDs to be Established", lambda: None)

    def apply_webhooks(self) -> None:
        base_url = f"https://{WEBHOOK_HOST}:{self.ports['webhook']}"
        for config in build_webhook_configurations(self.files.webhooks.read_text(), base_url,
                                                   (self.cert_dir / "ca.crt").read_bytes()):
            plural = config["kind"].lower() + "s"
            self._apply(f"/apis/admissionregistration.k8s.io/v1/{plural}", config)

    def delete_webhooks(self) -> None:
        for kind, name in WEBHOOK_CONFIGURATIONS.items():
            try:
                self.api.request("DELETE", f"/apis/admissionregistration.k8s.io/v1/{kind.lower()}s/{name}")
            except ApiError as e:
                if e.status != 404:
                    raise

    def _apply(self, collection: str, obj: dict) -> None:
        """Create, or replace what is there under that name."""
        try:
            self.api.post(collection, obj)
        except ApiError as e:
            if e.status != 409:
                raise
            current = self.api.get(f"{collection}/{obj['metadata']['name']}")
            obj = {**obj, "metadata": {**obj["metadata"], "resourceVersion": current["metadata"]["resourceVersion"]}}
            self.api.request("PUT", f"{collection}/{obj['metadata']['name']}", obj)

    # -- objects

    def create(self, obj: dict) -> dict:
        """Creates a Kueue object (apiVersion defaults to kueue.x-k8s.io/v1beta2)."""
        obj = {"apiVersion": API_VERSION, **obj}
        meta = obj["metadata"]
        return self.api.post(object_path(obj["kind"], namespace=meta.get("namespace")), obj)

    def get(self, kind: str, name: str, namespace: str | None = None) -> dict:
        return self.api.get(object_path(kind, name, namespace))

    def patch_status(self, kind: str, name: str, namespace: str | None, status: dict) -> dict:
        """A JSON merge patch of the status subresource (lists, conditions too, are replaced)."""
        return self.api.request("PATCH", object_path(kind, name, namespace) + "/status", {"status": status},
                                content_type="application/merge-patch+json")

    def delete(self, kind: str, name: str, namespace: str | None = None, wait: float = 0) -> None:
        """Deletes it (gone already is fine); with `wait`, until it is gone (Kueue lifts
        its resource-in-use finalizer once nothing uses it)."""
        path = object_path(kind, name, namespace)
        try:
            self.api.request("DELETE", path)
        except ApiError as e:
            if e.status == 404:
                return
            raise
        if wait:
            _wait(lambda: self._gone(path), wait, f"{kind} {name} to be deleted", self._died)

    def _gone(self, path: str) -> bool:
        try:
            self.api.get(path)
            return False
        except ApiError as e:
            if e.status == 404:
                return True
            raise

    def create_resource_flavor(self, name: str, node_labels: dict[str, str] | None = None,
                               tolerations: list[dict] | None = None, **spec: Any) -> dict:
        spec = {**({"nodeLabels": node_labels} if node_labels else {}),
                **({"tolerations": tolerations} if tolerations else {}), **spec}
        return self.create({"kind": "ResourceFlavor", "metadata": {"name": name}, "spec": spec})

    def create_cluster_queue(self, name: str, flavor: str, quotas: dict[str, str], **spec: Any) -> dict:
        """One resource group: `quotas` (resource -> nominal quota) in `flavor`; every
        namespace may use it unless `spec` says otherwise."""
        group = {"coveredResources": list(quotas), "flavors": [{"name": flavor, "resources": [
            {"name": resource, "nominalQuota": quota} for resource, quota in quotas.items()]}]}
        spec = {"namespaceSelector": {}, "resourceGroups": [group], **spec}
        return self.create({"kind": "ClusterQueue", "metadata": {"name": name}, "spec": spec})

    def create_local_queue(self, namespace: str, name: str, cluster_queue: str) -> dict:
        return self.create({"kind": "LocalQueue", "metadata": {"name": name, "namespace": namespace},
                            "spec": {"clusterQueue": cluster_queue}})

    def create_priority_class(self, name: str, value: int, description: str = "") -> dict:
        return self.create({"kind": "WorkloadPriorityClass", "metadata": {"name": name}, "value": value,
                            **({"description": description} if description else {})})
