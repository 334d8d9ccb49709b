"""A real, local Kubernetes control plane for integration tests and the demo.

Runs etcd, kube-apiserver, kube-controller-manager and kube-scheduler as plain processes
(no Docker), plus KWOK, which plays the kubelets of a few fake GPU nodes and drives pods
through the lifecycle in ``e2e/kwok-stages.yaml``; optionally the real node ``local``
(e2e/node.py: containerd, kubelet, kube-proxy, CoreDNS; one per host). Ports are picked
free at runtime; everything listens on 127.0.0.1 except the API server, which pods reach
at the host's address (token or certificate authentication only), so several clusters
(the demo and a test run, say) can coexist in different state directories.

Binaries come from ``bash e2e/build-binaries.sh`` (versions in ``e2e/versions.env``).

Public API::

    c = Cluster(state_dir)
    c.up(num_gpu_nodes=4, gpus_per_node=8)   # no-op when already up and healthy
    c.kubeconfig, c.server, c.ca_file        # admin kubeconfig path, https URL, CA path
    c.service_account_kubeconfig("ns", "sa", path)  # kubeconfig acting as that SA
    c.status(); c.down()
    ExistingCluster(kubeconfig)   # kubeconfig/server/ca_file/service_account_kubeconfig
                                  # for a cluster started elsewhere (e.g. by `make demo`)

CLI: ``python -m e2e.cluster up|down|status|env [--state-dir DIR]``.
"""

from __future__ import annotations

import argparse
import base64
import ipaddress
import json
import logging
import os
import secrets
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import psutil
import yaml

from .host import (  # noqa: F401  (E2E_DIR, VERSIONS_FILE, free_port: re-exported for callers)
    E2E_DIR, REPO_ROOT, VERSIONS_FILE, ClusterError, ProcessRecord, cache_dir, free_port, log_tail, read_versions,
    stop_processes,
)
from .node import BRIDGE, NODE_COMPONENTS, NodeBinaries, RealNode, kill_shims, restore_host
from .host import write_private
from .pki import write_client_cert, write_kubeconfig, write_pki

log = logging.getLogger("e2e.cluster")

STAGES_FILE = E2E_DIR / "kwok-stages.yaml"
DEFAULT_STATE_DIR = REPO_ROOT / ".local" / "cluster"

SERVICE_CIDR = "10.96.0.0/16"
POD_CIDR = "10.0.0.0/16"  # KWOK hands out fake pod IPs from here; nothing ever dials them
SA_ISSUER = "https://kubernetes.default.svc.cluster.local"
KWOK_NODE_ANNOTATION = ("kwok.x-k8s.io/node", "fake")
GPU_RESOURCE = "nvidia.com/gpu"

# Start order.
COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")
# With the real node (e2e/node.py), started after these and stopped before them.
# Stop order, tier by tier: the node's services, the kubelet before the runtime it
# drives; the API server drains in ~1s once its clients are gone, and etcd once the API
# server is (stopping all at once takes 10s or more).
STOP_TIERS = (("coredns", "kube-proxy"), ("kubelet",), ("containerd",),
              ("kwok", "kube-scheduler", "kube-controller-manager"), ("kube-apiserver",), ("etcd",))

# Admin-token identity; the other components get their own (see _write_credentials).
ADMIN_USER = "rft-admin"
COREDNS_USER = "rft-coredns"
# The API server's client certificate towards kubelets (kubeadm's name for it).
KUBELET_CLIENT_USER = "kube-apiserver-kubelet-client"


# --------------------------------------------------------------------------- binaries


@dataclass(frozen=True)
class Binaries:
    """Paths of the pinned control-plane binaries in the build cache."""

    etcd: Path
    kube_apiserver: Path
    kube_controller_manager: Path
    kube_scheduler: Path
    kwok: Path

    @classmethod
    def locate(cls) -> "Binaries":
        """Finds every binary, or fails naming the missing ones and how to build them."""
        v = read_versions()
        bin_dir = cache_dir() / "bin"
        k8s = bin_dir / f"k8s-{v['K8S_VERSION']}"
        found = cls(
            etcd=bin_dir / f"etcd-{v['ETCD_VERSION']}" / "etcd",
            kube_apiserver=k8s / "kube-apiserver",
            kube_controller_manager=k8s / "kube-controller-manager",
            kube_scheduler=k8s / "kube-scheduler",
            kwok=bin_dir / f"kwok-{v['KWOK_VERSION']}" / "kwok",
        )
        missing = [str(p) for p in vars(found).values() if not os.access(p, os.X_OK)]
        if missing:
            raise ClusterError(
                "control-plane binaries missing: " + ", ".join(missing)
                + f"\nBuild them with: bash {E2E_DIR.relative_to(REPO_ROOT)}/build-binaries.sh"
                " (cached under $RFT_CACHE, default ~/.cache/rftjob)"
            )
        return found


# --------------------------------------------------------------------------- host facts


def advertise_address() -> str:
    """A non-loopback IPv4 address of this host.

    kube-apiserver advertises it as the `kubernetes` Service's endpoint (pods on the real
    node reach the API server there) and rejects loopback. The real node's bridge is
    skipped: its address goes away with the node.
    """

    for name, addrs in psutil.net_if_addrs().items():
        if name == BRIDGE:
            continue
        for addr in addrs:
            if addr.family != socket.AF_INET:
                continue
            ip = ipaddress.IPv4Address(addr.address)
            if not (ip.is_loopback or ip.is_link_local or ip.is_unspecified):
                return str(ip)
    raise ClusterError(
        "no non-loopback IPv4 address found on this host; kube-apiserver needs one for "
        "--advertise-address (bring up any interface with an IPv4 address, e.g. a dummy one)"
    )


# --------------------------------------------------------------------------- API client


class ApiError(ClusterError):
    """The API server answered with an HTTP error."""

    def __init__(self, method: str, path: str, status: int, body: str):
        super().__init__(f"{method} {path}: HTTP {status}: {body[:500]}")
        self.status = status


class KubeApi:
    """A minimal JSON client for the few raw API calls the harness makes.

    Deliberately not the kubernetes package: it keeps global configuration, and this
    module must not disturb the configuration of the code under test.
    """

    def __init__(self, server: str, context: ssl.SSLContext, token: str | None = None):
        self.server = server.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        # Never route through a proxy: every cluster here is on loopback.
        self._opener = urllib.request.build_opener(
            urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=context)
        )

    def request(self, method: str, path: str, body: Any = None, timeout: float = 10,
                content_type: str = "application/json") -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.server + path, data=data, method=method, headers={
            **self._headers, "Accept": "application/json", "Content-Type": content_type,
        })
        try:
            with self._opener.open(req, timeout=timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            raise ApiError(method, path, e.code, e.read().decode(errors="replace")) from None
        ctype = resp.headers.get("Content-Type", "")
        return json.loads(raw) if "json" in ctype else raw.decode(errors="replace")

    def get(self, path: str) -> Any:
        return self.request("GET", path)

    def post(self, path: str, body: Any) -> Any:
        return self.request("POST", path, body)


def _client_context(ca_file: Path | None, insecure: bool = False) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(ca_file) if ca_file else None)
    if insecure:  # only for health probes of loopback components with self-signed certs
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


# --------------------------------------------------------------------------- processes


# --------------------------------------------------------------------------- clusters


class _KubeconfigAccess:
    """What tests need from any cluster: its kubeconfig, server, CA and SA kubeconfigs."""

    kubeconfig: Path
    server: str
    ca_file: Path

    def api(self) -> KubeApi:
        raise NotImplementedError

    def service_account_kubeconfig(
        self, namespace: str, name: str, path: str | os.PathLike, expiration_seconds: int = 86400,
        pod: tuple[str, str] | None = None,
    ) -> Path:
        """Writes a kubeconfig that authenticates as ServiceAccount `namespace/name`.

        The token comes from the TokenRequest API, exactly as a pod's projected token
        would, so code run with this kubeconfig has the SA's real RBAC and nothing more.
        `pod` (name, uid) binds the token to that pod, as the kubelet does: the API server
        then tells admission which pod is asking (userInfo.extra pod-name).
        """
        spec: dict[str, Any] = {"expirationSeconds": expiration_seconds}
        if pod is not None:
            spec["boundObjectRef"] = {"apiVersion": "v1", "kind": "Pod", "name": pod[0], "uid": pod[1]}
        resp = self.api().post(
            f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token",
            {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec},
        )
        token = resp["status"]["token"]
        user = f"system:serviceaccount:{namespace}:{name}"
        return write_kubeconfig(Path(path), self.server, self.ca_file.read_bytes(), user, token)


class ExistingCluster(_KubeconfigAccess):
    """A cluster someone else runs (e.g. `make demo`), reached through its kubeconfig.

    Supports token and client-certificate kubeconfigs (what this harness and most local
    tools write); exec/auth-provider plugins are rejected with a clear error.
    """

    def __init__(self, kubeconfig: str | os.PathLike):
        self.kubeconfig = Path(kubeconfig).resolve()
        config = yaml.safe_load(self.kubeconfig.read_text())
        ctx = _named(config, "contexts", config.get("current-context"))["context"]
        cluster = _named(config, "clusters", ctx["cluster"])["cluster"]
        self._user = _named(config, "users", ctx["user"])["user"] or {}
        self.server = cluster["server"]
        self._tmp = Path(tempfile.mkdtemp(prefix="rft-kubeconfig-"))
        weakref.finalize(self, shutil.rmtree, self._tmp, True)
        self.ca_file = self._material(cluster, "certificate-authority", "ca.crt")
        if self.ca_file is None:
            raise ClusterError(f"{self.kubeconfig}: cluster has no certificate authority")

    def _material(self, section: dict, key: str, filename: str) -> Path | None:
        """A PEM file for `key`, whether given as a path or as embedded `key-data`."""
        if section.get(f"{key}-data"):
            path = self._tmp / filename
            write_private(path, base64.b64decode(section[f"{key}-data"]))
            return path
        if section.get(key):
            return (self.kubeconfig.parent / section[key]).resolve()
        return None

    def api(self) -> KubeApi:
        context = _client_context(self.ca_file)
        token = self._user.get("token")
        if token is None and self._user.get("tokenFile"):
            token = Path(self._user["tokenFile"]).read_text().strip()
        cert = self._material(self._user, "client-certificate", "client.crt")
        key = self._material(self._user, "client-key", "client.key")
        if cert and key:
            context.load_cert_chain(cert, key)
        elif token is None:
            raise ClusterError(
                f"{self.kubeconfig}: only token or client-certificate users are supported"
            )
        return KubeApi(self.server, context, token)


def _named(config: dict, section: str, name: str | None) -> dict:
    for item in config.get(section) or []:
        if item.get("name") == name:
            return item
    raise ClusterError(f"kubeconfig has no {section[:-1]} named {name!r}")


class Cluster(_KubeconfigAccess):
    """A local control plane whose files all live in `state_dir`.

    Layout: admin.kubeconfig, pids.json, logs/<component>.log, pki/, kubeconfigs/,
    etcd-data/, kwok-home/. Processes run in their own sessions so the cluster outlives
    the process that started it; pids.json lets any later process stop it.
    """

    def __init__(self, state_dir: str | os.PathLike = DEFAULT_STATE_DIR):
        self.state_dir = Path(state_dir).resolve()

    # -- paths and identity

    @property
    def kubeconfig(self) -> Path:
        return self.state_dir / "admin.kubeconfig"

    @property
    def ca_file(self) -> Path:
        return self.state_dir / "pki" / "ca.crt"

    @property
    def server(self) -> str:
        """The API server URL, read back from the admin kubeconfig."""
        if not self.kubeconfig.exists():
            raise ClusterError(f"no cluster in {self.state_dir} (run `up` first)")
        config = yaml.safe_load(self.kubeconfig.read_text())
        return config["clusters"][0]["cluster"]["server"]

    @property
    def logs_dir(self) -> Path:
        return self.state_dir / "logs"

    @property
    def _pids_file(self) -> Path:
        return self.state_dir / "pids.json"

    def api(self) -> KubeApi:
        config = yaml.safe_load(self.kubeconfig.read_text())
        token = config["users"][0]["user"]["token"]
        return KubeApi(self.server, _client_context(self.ca_file), token)

    # -- lifecycle

    @property
    def has_real_node(self) -> bool:
        return (self.state_dir / "node").is_dir()

    def up(self, num_gpu_nodes: int = 4, gpus_per_node: int = 8, real_node: bool = False,
           registry: str | None = None) -> None:
        """Starts the control plane and fake GPU nodes; returns once it is usable.

        `real_node`: also the real node `local` (e2e/node.py: containerd, kubelet,
        kube-proxy, CoreDNS), pulling the project's images from `registry` (host:port).
        A no-op when this state dir already holds a healthy cluster of that shape;
        leftovers of a dead one are stopped and wiped first. On failure everything
        started is stopped again.
        """
        binaries = Binaries.locate()
        if real_node:

            NodeBinaries.locate()  # fail before starting anything
        if self.status()["healthy"]:
            log.info("cluster in %s is already up", self.state_dir)
            if real_node:
                self.start_node(gpus_per_node, registry)
            return
        self.down()
        self._wipe_state()
        started = time.monotonic()
        try:
            self._start(binaries)
            self._create_gpu_nodes(num_gpu_nodes, gpus_per_node)
            self._wait_nodes_ready(num_gpu_nodes)
            self.wait(lambda: self._exists("/api/v1/namespaces/default/serviceaccounts/default"),
                       60, "the default ServiceAccount", "kube-controller-manager")
            if real_node:
                self.start_node(gpus_per_node, registry)
        except BaseException:
            self.down()
            raise
        log.info("cluster up in %.1fs: %s (KUBECONFIG=%s)",
                 time.monotonic() - started, self.server, self.kubeconfig)

    def down(self) -> None:
        """Stops the processes recorded in pids.json (and only those), clients first.

        With the real node, its pods are deleted through the API first (the kubelet
        tears down their sandboxes), and every host change it made is undone last."""
        self.stop_node()
        records = self.read_records()
        for tier in STOP_TIERS:
            stop_processes([r for r in records if r.name in tier])
        if records:
            log.info("stopped %s", ", ".join(r.name for r in records))
        self._pids_file.unlink(missing_ok=True)

    def status(self) -> dict[str, Any]:
        """Which recorded components are alive, and whether the API server is ready."""
        records = {r.name: r for r in self.read_records()}
        components = {
            name: ("running" if records[name].find() else "dead") if name in records else "absent"
            for name in COMPONENTS + (NODE_COMPONENTS if self.has_real_node else ())
        }
        healthy = all(s == "running" for s in components.values()) and self._readyz_ok()
        return {
            "state_dir": str(self.state_dir),
            "server": self.server if self.kubeconfig.exists() else None,
            "kubeconfig": str(self.kubeconfig),
            "healthy": healthy,
            "components": components,
        }

    # -- startup steps

    def _start(self, b: Binaries) -> None:
        """Writes credentials, then starts each component once its dependency is ready."""
        advertise_ip = advertise_address()
        pki = self.state_dir / "pki"
        write_pki(pki, advertise_ip)
        etcd_url = f"http://127.0.0.1:{free_port()}"
        etcd_peer = f"http://127.0.0.1:{free_port()}"
        server = f"https://127.0.0.1:{free_port()}"
        kubeconfigs = self._write_credentials(server)
        # The API server's identity towards kubelets (logs, exec, port-forward): no group,
        # only what start_node binds to it (system:kubelet-api-admin), not system:masters.
        cert, key = write_client_cert(pki, "apiserver-kubelet-client", KUBELET_CLIENT_USER, "")

        self.spawn("etcd", [
            str(b.etcd), "--name=rft", f"--data-dir={self.state_dir / 'etcd-data'}",
            f"--listen-client-urls={etcd_url}", f"--advertise-client-urls={etcd_url}",
            f"--listen-peer-urls={etcd_peer}", f"--initial-advertise-peer-urls={etcd_peer}",
            f"--initial-cluster=rft={etcd_peer}", "--initial-cluster-state=new",
            "--unsafe-no-fsync", "--log-level=warn",
        ])
        self.wait(lambda: self.http_ok(etcd_url + "/health"), 30, "etcd /health", "etcd")

        self.spawn("kube-apiserver", [
            str(b.kube_apiserver),
            f"--etcd-servers={etcd_url}",
            # Every address: pods reach it at the advertise address, through the
            # `kubernetes` Service whose endpoints it publishes itself.
            "--bind-address=0.0.0.0", f"--secure-port={server.rsplit(':', 1)[1]}",
            "--anonymous-auth=false",  # reachable beyond loopback: every request authenticates
            f"--advertise-address={advertise_ip}",
            f"--cert-dir={pki}",
            f"--tls-cert-file={pki / 'apiserver.crt'}",
            f"--tls-private-key-file={pki / 'apiserver.key'}",
            f"--client-ca-file={pki / 'ca.crt'}",
            # Published for the controller-manager's and scheduler's delegated authn
            # (they log errors every few seconds without it); no key exists to use it.
            f"--requestheader-client-ca-file={pki / 'front-proxy-ca.crt'}",
            "--requestheader-allowed-names=front-proxy-client",
            "--requestheader-username-headers=X-Remote-User",
            "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            f"--token-auth-file={pki / 'tokens.csv'}",
            "--authorization-mode=Node,RBAC",
            # On top of the defaults; OpenShift enables it: setting blockOwnerDeletion on a
            # child needs `update` on the owner's finalizers (the operator's RBAC has it).
            "--enable-admission-plugins=OwnerReferencesPermissionEnforcement",
            f"--service-account-issuer={SA_ISSUER}",
            f"--service-account-key-file={pki / 'sa.pub'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--allow-privileged=true",
            # Fake nodes have no reachable kubelet; never resolve or dial their names. The
            # real node's kubelet is called with this client certificate.
            "--kubelet-preferred-address-types=InternalIP",
            f"--kubelet-client-certificate={cert}", f"--kubelet-client-key={key}",
            "--profiling=false",
        ])
        self.wait(self._readyz_ok, 120, "kube-apiserver /readyz", "kube-apiserver")

        common = ["--leader-elect=false", "--bind-address=127.0.0.1", "--profiling=false"]
        kcm_port, sched_port = free_port(), free_port()
        kcm = kubeconfigs["kube-controller-manager"]
        self.spawn("kube-controller-manager", [
            str(b.kube_controller_manager), *common,
            f"--kubeconfig={kcm}", f"--authentication-kubeconfig={kcm}",
            f"--authorization-kubeconfig={kcm}",
            f"--secure-port={kcm_port}", f"--cert-dir={self.state_dir / 'kcm-certs'}",
            "--controllers=*", "--use-service-account-credentials=true",
            f"--service-account-private-key-file={pki / 'sa.key'}",
            f"--root-ca-file={pki / 'ca.crt'}",
            f"--cluster-signing-cert-file={pki / 'ca.crt'}",
            f"--cluster-signing-key-file={pki / 'ca.key'}",
        ])
        sched = kubeconfigs["kube-scheduler"]
        self.spawn("kube-scheduler", [
            str(b.kube_scheduler), *common,
            f"--kubeconfig={sched}", f"--authentication-kubeconfig={sched}",
            f"--authorization-kubeconfig={sched}",
            f"--secure-port={sched_port}", f"--cert-dir={self.state_dir / 'scheduler-certs'}",
        ])
        self.spawn("kwok", [
            str(b.kwok), f"--kubeconfig={kubeconfigs['kwok']}", f"--config={STAGES_FILE}",
            "--manage-nodes-with-annotation-selector=" + "=".join(KWOK_NODE_ANNOTATION),
            f"--cidr={POD_CIDR}",
            "--node-lease-duration-seconds=40",  # kubelet-style leases, renewed every ~10s
        ], env={"HOME": str(self.state_dir / "kwok-home")})  # ignore any ~/.kwok/kwok.yaml
        self.wait(lambda: self.http_ok(f"https://127.0.0.1:{kcm_port}/healthz", insecure=True),
                   60, "kube-controller-manager /healthz", "kube-controller-manager")
        self.wait(lambda: self.http_ok(f"https://127.0.0.1:{sched_port}/healthz", insecure=True),
                   60, "kube-scheduler /healthz", "kube-scheduler")

    def _write_credentials(self, server: str) -> dict[str, Path]:
        """One bearer token per component, so audit/RBAC see distinct identities.

        The controller-manager and scheduler use their built-in identities (bound by the
        API server's bootstrap RBAC); the admin and KWOK (which plays every kubelet) are
        in system:masters. Tokens only ever live in 0600 files, never on command lines.
        """
        pki = self.state_dir / "pki"
        identities = {  # name -> (user, groups)
            "admin": (ADMIN_USER, "system:masters"),
            "kube-controller-manager": ("system:kube-controller-manager", ""),
            "kube-scheduler": ("system:kube-scheduler", ""),
            "kwok": ("rft-kwok", "system:masters"),
            # The real node's components (e2e/node.py); bootstrap RBAC binds the first two.
            "kubelet": ("system:node:local", "system:nodes"),
            "kube-proxy": ("system:kube-proxy", ""),
            "coredns": (COREDNS_USER, ""),
        }
        ca_pem = (pki / "ca.crt").read_bytes()
        rows, paths = [], {}
        for name, (user, groups) in identities.items():
            token = secrets.token_urlsafe(32)
            rows.append(f'{token},{user},{user},"{groups}"' if groups else f"{token},{user},{user}")
            path = self.kubeconfig if name == "admin" else self.state_dir / "kubeconfigs" / f"{name}.kubeconfig"
            paths[name] = write_kubeconfig(path, server, ca_pem, user, token)
        write_private(pki / "tokens.csv", ("\n".join(rows) + "\n").encode())
        return paths

    def start_node(self, gpus: int = 8, registry: str | None = None) -> None:
        """Starts the real node `local` (e2e/node.py) on this running cluster; with
        `registry` (host:port) its containerd pulls the project's images from there.
        When the node already runs, only the registry address is updated."""

        node = RealNode(self)
        if self.has_real_node and all(self.status()["components"][n] == "running"
                                      for n in NODE_COMPONENTS):
            if registry:
                node.set_registry(registry)
            return
        self.stop_node()
        api = self.api()
        # What CoreDNS' kubernetes plugin reads (kubeadm's system:coredns role).
        _create(api, "/apis/rbac.authorization.k8s.io/v1/clusterroles", {
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
            "metadata": {"name": "rftjob-local:coredns"},
            "rules": [{"apiGroups": [""], "resources": ["endpoints", "services", "pods", "namespaces"],
                       "verbs": ["list", "watch"]},
                      {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                       "verbs": ["list", "watch"]}]})
        _bind_user(api, "rftjob-local:coredns", "rftjob-local:coredns", COREDNS_USER)
        # The kubelet authorizes the API server's calls by SubjectAccessReview (webhook mode).
        _bind_user(api, "rftjob-local:apiserver-kubelet-client", "system:kubelet-api-admin", KUBELET_CLIENT_USER)
        kubeconfigs = self.state_dir / "kubeconfigs"
        try:
            node.start(advertise_address(), {name: kubeconfigs / f"{name}.kubeconfig"
                                             for name in ("kubelet", "kube-proxy", "coredns")},
                       gpus=gpus, registry=registry)
        except BaseException:
            self.stop_node()
            raise
        finally:
            if node.owns_host():
                node.record_processes([r for r in self.read_records() if r.name in NODE_COMPONENTS])

    def kill_node(self) -> None:
        """The node dies: its processes and every container SIGKILLed at once, no drain
        (pods stay bound to it in the API), then the host cleaned up as after a reboot."""
        if not self.has_real_node:
            return

        node = RealNode(self)
        records = self.read_records()
        for r in records:
            if r.name in NODE_COMPONENTS and (proc := r.find()) is not None:
                proc.kill()
        if node.owns_host():  # the shims are found by the host-wide socket path
            kill_shims()
        stop_processes([r for r in records if r.name in NODE_COMPONENTS], grace=0)
        self._write_records([r for r in records if r.name not in NODE_COMPONENTS])
        if node.owns_host():
            restore_host()
        shutil.rmtree(node.dir, ignore_errors=True)

    def stop_node(self) -> None:
        """Stops the real node: its pods are deleted through the API first (the kubelet
        tears down their sandboxes), then its processes; then every host change it made
        is undone. The control plane keeps running; the Node object stays NotReady."""
        if not self.has_real_node:
            return

        node = RealNode(self)
        records = self.read_records()
        if any(r.name == "kubelet" and r.find() for r in records) and self._readyz_ok():
            node.drain()
        for tier in STOP_TIERS:
            if tier == ("containerd",) and any(r.name == "containerd" and r.find() for r in records):
                node.forget_containers()
            stop_processes([r for r in records if r.name in tier and r.name in NODE_COMPONENTS])
        self._write_records([r for r in self.read_records() if r.name not in NODE_COMPONENTS])
        if node.owns_host():
            restore_host()
        shutil.rmtree(node.dir, ignore_errors=True)

    def _create_gpu_nodes(self, count: int, gpus: int) -> None:
        """Registers fake nodes that KWOK manages (selected by its annotation)."""
        api = self.api()
        resources = {"cpu": "64", "memory": "512Gi", "pods": "110", GPU_RESOURCE: str(gpus)}
        for i in range(count):
            name = f"kwok-gpu-{i}"
            node = {
                "apiVersion": "v1", "kind": "Node",
                "metadata": {
                    "name": name,
                    "annotations": {KWOK_NODE_ANNOTATION[0]: KWOK_NODE_ANNOTATION[1]},
                    "labels": {"type": "kwok", "kubernetes.io/hostname": name,
                               "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64"},
                },
                # Nodes are the one kind whose status may be set on create.
                "status": {"capacity": resources, "allocatable": resources},
            }
            try:
                api.post("/api/v1/nodes", node)
            except ApiError as e:
                if e.status != 409:
                    raise

    def _wait_nodes_ready(self, count: int) -> None:
        """Waits until every fake node is Ready and schedulable (not-ready taint gone)."""
        def ready() -> bool:
            nodes = self.api().get("/api/v1/nodes?labelSelector=type%3Dkwok")["items"]
            return len(nodes) >= count and all(_node_schedulable(n) for n in nodes)
        self.wait(ready, 90, f"{count} Ready KWOK nodes", "kwok")

    # -- processes

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        """Starts a component in its own session, logging to logs/<name>.log."""
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        if env and "HOME" in env:
            Path(env["HOME"]).mkdir(parents=True, exist_ok=True)
        with open(self.logs_dir / f"{name}.log", "ab") as logf:
            proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                cwd=self.state_dir, env={**os.environ, **(env or {})}, start_new_session=True,
            )
        record = ProcessRecord(name, proc.pid, psutil.Process(proc.pid).create_time(),
                               os.path.realpath(argv[0]))
        self._write_records(self.read_records() + [record])
        log.info("started %s (pid %d)", name, proc.pid)

    def read_records(self) -> list[ProcessRecord]:
        try:
            data = json.loads(self._pids_file.read_text())
        except (OSError, ValueError):
            return []
        return [ProcessRecord(**r) for r in data.get("processes", [])]

    def _write_records(self, records: list[ProcessRecord]) -> None:
        self._pids_file.write_text(json.dumps({"processes": [vars(r) for r in records]}, indent=2))

    def _wipe_state(self) -> None:
        """Removes what a previous cluster left, keeping anything else in the dir."""
        for entry in ("etcd-data", "pki", "kubeconfigs", "logs", "kwok-home", "kcm-certs",
                      "scheduler-certs", "admin.kubeconfig", "pids.json", "node"):
            path = self.state_dir / entry
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
        self.state_dir.mkdir(parents=True, exist_ok=True)

    # -- probes

    def wait(self, predicate: Callable[[], bool], timeout: float, what: str, component: str) -> None:
        """Polls `predicate`; fails fast if a component died, else after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        last_error = None
        while True:
            for record in self.read_records():
                if record.find() is None:
                    raise ClusterError(
                        f"{record.name} exited while waiting for {what}; tail of "
                        f"{self.logs_dir / (record.name + '.log')}:\n{log_tail(self.logs_dir / (record.name + '.log'))}"
                    )
            try:
                if predicate():
                    return
                last_error = None
            except Exception as e:  # noqa: BLE001 - not ready yet; reported on timeout
                last_error = e
            if time.monotonic() > deadline:
                log_file = self.logs_dir / f"{component}.log"
                raise ClusterError(
                    f"timed out after {timeout:.0f}s waiting for {what} ({component})"
                    + (f"; last error: {last_error}" if last_error else "")
                    + f"\ntail of {log_file}:\n{log_tail(log_file)}"
                )
            time.sleep(0.5)

    def http_ok(self, url: str, insecure: bool = False) -> bool:
        """A plain GET answering 200 (health endpoints need no credentials)."""
        return KubeApi(url, _client_context(None, insecure)).request("GET", "", timeout=5) is not None

    def _readyz_ok(self) -> bool:
        if not self.kubeconfig.exists() or not self.ca_file.exists():
            return False
        try:
            return self.api().get("/readyz") == "ok"
        except (OSError, ClusterError, ValueError):
            return False

    def _exists(self, path: str) -> bool:
        try:
            self.api().get(path)
            return True
        except ApiError as e:
            if e.status == 404:
                return False
            raise


def _create(api: KubeApi, path: str, body: dict) -> None:
    """POST, where an existing object of that name is fine."""
    try:
        api.post(path, body)
    except ApiError as e:
        if e.status != 409:
            raise


def _bind_user(api: KubeApi, name: str, cluster_role: str, user: str) -> None:
    """A ClusterRoleBinding `name` of `cluster_role` to the certificate user `user`."""
    rbac = "rbac.authorization.k8s.io"
    _create(api, f"/apis/{rbac}/v1/clusterrolebindings", {
        "apiVersion": f"{rbac}/v1", "kind": "ClusterRoleBinding", "metadata": {"name": name},
        "roleRef": {"apiGroup": rbac, "kind": "ClusterRole", "name": cluster_role},
        "subjects": [{"kind": "User", "apiGroup": rbac, "name": user}]})


def _node_schedulable(node: dict) -> bool:
    conditions = {c["type"]: c["status"] for c in node.get("status", {}).get("conditions", [])}
    taints = {t["key"] for t in node.get("spec", {}).get("taints", [])}
    return conditions.get("Ready") == "True" and "node.kubernetes.io/not-ready" not in taints


# --------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.cluster", description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=["up", "down", "status", "env"])
    parser.add_argument("--state-dir", default=os.environ.get("RFT_STATE_DIR", DEFAULT_STATE_DIR),
                        help="where the cluster keeps its files (default: %(default)s)")
    parser.add_argument("--gpu-nodes", type=int, default=4, help="fake GPU nodes (up)")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (up)")
    parser.add_argument("--real-node", action="store_true",
                        help="also the real node `local`: containerd, kubelet, kube-proxy, CoreDNS (up)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[cluster] %(message)s", stream=sys.stderr)

    cluster = Cluster(args.state_dir)
    try:
        if args.command == "up":
            cluster.up(num_gpu_nodes=args.gpu_nodes, gpus_per_node=args.gpus_per_node,
                       real_node=args.real_node)
            print(f"export KUBECONFIG={cluster.kubeconfig}")
        elif args.command == "down":
            cluster.down()
        elif args.command == "status":
            status = cluster.status()
            print(json.dumps(status, indent=2))
            return 0 if status["healthy"] else 1
        elif args.command == "env":
            print(f"export KUBECONFIG={cluster.kubeconfig}")
    except ClusterError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
