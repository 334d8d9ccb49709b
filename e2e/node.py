"""The real node `local`: containerd + runc + bridge CNI, the kubelet, kube-proxy and CoreDNS.

They run as host processes of the local cluster (e2e/cluster.py starts and stops them and
records their PIDs with the control plane's). Pods are real containers from OCI images:
the project's images come from the local registry (e2e/registry.py), which containerd
reaches under the stable name ``REGISTRY_HOST`` whatever port the registry got.

One real node per host: a kubelet, a CNI bridge and kube-proxy's iptables chains are
host-wide. The node's host-side files live at fixed short paths (``NODE_ROOT``,
``NODE_RUN``; unix sockets must stay under 108 bytes); its configuration and logs in the
cluster's state directory; containerd's image store in the build cache
(``containerd_root()``), so a restarted node does not pull again. ``down`` stops everything and undoes every host change it
made (sysctls, iptables rules and chains, mounts, the bridge and veths, cgroups, files),
against a snapshot of the host taken before the first change.

What is real and what is not: containers, images, volumes, probes, logs/exec, Services
(kube-proxy iptables) and DNS (CoreDNS) are real. GPUs are an extended resource patched
into the node's status; no device is injected.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import shlex
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from .host import E2E_DIR, REPO_ROOT, ProcessRecord, cache_dir, free_port, read_versions

log = logging.getLogger("e2e.node")

NODE_NAME = "local"
NODE_COMPONENTS = ("containerd", "kubelet", "kube-proxy", "coredns")  # host processes, as the cluster records them
LOCAL_NODE_LABEL = "rft.dev/local-node"
LOCAL_TAINT = {"key": "rft.dev/local", "value": "true", "effect": "NoSchedule"}
GPU_RESOURCE = "nvidia.com/gpu"
BRIDGE = "rft0"
POD_SUBNET = "10.244.0.0/24"
GATEWAY = "10.244.0.1"  # the bridge's address: pods reach host services (S3, registry) here
CLUSTER_DOMAIN = "cluster.local"
REGISTRY_HOST = "registry.rft.local"  # containerd maps it to the local registry's port
PAUSE_IMAGE = "registry.k8s.io/pause:3.10"
NODE_ROOT = Path("/var/lib/rftjob-node")  # kubelet root, containerd root, CNI state, pod logs
NODE_RUN = Path("/run/rftjob-node")  # containerd's state and socket
OWNER_FILE = NODE_ROOT / "owner.json"
HOST_SNAPSHOT = NODE_ROOT / "host-before.json"
CONTAINERD_SOCK = NODE_RUN / "containerd.sock"
APT_PACKAGES = "containerd runc containernetworking-plugins iptables iproute2 buildah gcc"
CNI_BIN_DIR = Path("/usr/lib/cni")  # Debian's containernetworking-plugins

# Sysctls the kubelet, kube-proxy and the bridge plugin may set; saved before, restored after.
SYSCTLS = (
    "vm.overcommit_memory", "vm.panic_on_oom", "kernel.panic", "kernel.panic_on_oops",
    "kernel.keys.root_maxkeys", "kernel.keys.root_maxbytes", "net.ipv4.ip_forward",
    "net.ipv4.conf.all.forwarding", "net.ipv6.conf.all.forwarding",
    "net.ipv4.conf.all.route_localnet", "net.bridge.bridge-nf-call-iptables",
    "net.bridge.bridge-nf-call-ip6tables", "net.netfilter.nf_conntrack_max",
    "net.netfilter.nf_conntrack_tcp_timeout_established",
    "net.netfilter.nf_conntrack_tcp_timeout_close_wait",
)
IPTABLES = ("iptables", "ip6tables")
IPTABLES_TABLES = ("filter", "nat", "mangle", "raw")
CGROUP_ROOT = Path("/sys/fs/cgroup")
HOST_PATHS = ("/run/netns", "/var/log/containers", "/var/lib/cni", "/var/lib/kubelet",
              "/run/containerd", "/opt/containerd")
# Chains the kubelet, kube-proxy and CNI plugins create: the only ones restore touches.
OUR_CHAINS = ("KUBE-", "CNI-")
CGROUP_TOPS = ("kubepods", "k8s.io")  # kubelet's QoS tree; containerd's for non-CRI tasks


def containerd_root() -> Path:
    """containerd's root: its image store is a cache, kept across node restarts like the
    registry's storage (a real node keeps its images too); containers are not kept."""

    return cache_dir() / "containerd"


class NodeError(RuntimeError):
    """The real node could not be started or stopped."""


# --------------------------------------------------------------------------- host state


def _sysctl_path(key: str) -> Path:
    return Path("/proc/sys") / key.replace(".", "/")


def read_sysctls(keys=SYSCTLS) -> dict[str, str]:
    values = {}
    for key in keys:
        try:
            values[key] = _sysctl_path(key).read_text().strip()
        except OSError:
            pass  # module not loaded (bridge, conntrack): nothing to restore
    return values


def iptables_rules() -> dict[str, list[str]]:
    """`<binary> <table>` -> the chain declarations and rules, without counters."""
    out = {}
    for binary in IPTABLES:
        if shutil.which(binary) is None:
            continue
        for table in IPTABLES_TABLES:
            res = subprocess.run([f"{binary}-save", "-t", table], capture_output=True, text=True)
            if res.returncode != 0:
                continue
            lines = []
            for line in res.stdout.splitlines():
                if line.startswith(":"):
                    lines.append(line.split()[0])  # ":CHAIN POLICY [p:b]" -> ":CHAIN"
                elif line.startswith("-A"):
                    lines.append(line)
            out[f"{binary} {table}"] = lines
    return out


def mountpoints() -> list[str]:
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        points.append(fields[4].encode().decode("unicode_escape"))
    return points


def host_snapshot() -> dict[str, Any]:
    """What the node may change on the host, read back for restoring and for tests."""
    return {
        "boot_id": _boot_id(),
        "sysctls": read_sysctls(),
        "iptables": iptables_rules(),
        "mounts": mountpoints(),
        "cgroups": {top: [str(h) for h in _cgroup_hierarchies() if (h / top).exists()]
                    for top in CGROUP_TOPS},
        # Paths the kubelet hard-codes whatever its --root-dir (device-plugins socket).
        "paths": {p: os.path.lexists(p) for p in HOST_PATHS},
    }


def _cgroup_hierarchies() -> list[Path]:
    """Each v1 hierarchy, or the unified v2 root (where kubepods sits right under it)."""
    if (CGROUP_ROOT / "cgroup.controllers").exists():
        return [CGROUP_ROOT]
    try:
        return [p for p in CGROUP_ROOT.iterdir() if p.is_dir() and not p.is_symlink()]
    except OSError:
        return []


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _run(argv: list[str], check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(argv, capture_output=True, text=True)
    if check and res.returncode != 0:
        raise NodeError(f"{' '.join(argv)}: exit {res.returncode}: {res.stderr.strip()[:500]}")
    return res


# --------------------------------------------------------------------------- binaries


@dataclass(frozen=True)
class NodeBinaries:
    kubelet: Path
    kube_proxy: Path
    coredns: Path
    containerd: str
    ctr: str
    buildah: str

    @classmethod
    def locate(cls) -> "NodeBinaries":

        v = read_versions()
        bin_dir = cache_dir() / "bin"
        k8s = bin_dir / f"k8s-{v['K8S_VERSION']}"
        built = {"kubelet": k8s / "kubelet", "kube_proxy": k8s / "kube-proxy",
                 "coredns": bin_dir / f"coredns-{v['COREDNS_VERSION']}" / "coredns"}
        missing = [str(p) for p in built.values() if not os.access(p, os.X_OK)]
        if missing:
            raise NodeError("real-node binaries missing: " + ", ".join(missing)
                            + f"\nBuild them with: bash {E2E_DIR.relative_to(REPO_ROOT)}/build-binaries.sh")
        host = {name: shutil.which(name) for name in ("containerd", "ctr", "runc", "buildah", "gcc")}
        absent = [n for n, p in host.items() if p is None]
        if not (CNI_BIN_DIR / "bridge").exists():
            absent.append(f"CNI plugins in {CNI_BIN_DIR}")
        if absent:
            raise NodeError(f"missing on this host: {', '.join(absent)}\nInstall them with: "
                            f"apt-get install -y --no-install-recommends {APT_PACKAGES}")
        return cls(containerd=host["containerd"], ctr=host["ctr"], buildah=host["buildah"],
                   **built)


def pause_archive(buildah: str) -> Path:
    """The pod sandbox image (Kubernetes' own pause.c, static), built once and cached as
    a docker-archive: it is never pulled, so no registry is needed for it."""

    version = read_versions()["K8S_VERSION"]
    out = cache_dir() / "images" / f"pause-{version}.tar"
    if out.exists():
        return out
    if shutil.which("go") is None:
        raise NodeError("the pause image is built from Kubernetes' pause.c in the Go module cache: install Go")
    gomodcache = _run(["go", "env", "GOMODCACHE"]).stdout.strip()
    source = Path(gomodcache) / f"k8s.io/kubernetes@{version}" / "build/pause/linux/pause.c"
    if not source.exists():
        _run(["go", "mod", "download", f"k8s.io/kubernetes@{version}"])
    out.parent.mkdir(parents=True, exist_ok=True)
    work = out.parent / f"pause-{version}.build"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    try:
        _run(["gcc", "-Os", "-static", f"-DVERSION={version}-rftjob", "-o", str(work / "pause"),
              str(source)])
        _run(["strip", str(work / "pause")])
        ctr = _run([buildah, "from", "scratch"]).stdout.strip()
        try:
            _run([buildah, "copy", ctr, str(work / "pause"), "/pause"])
            _run([buildah, "config", "--entrypoint", '["/pause"]', "--user", "65535:65535", ctr])
            _run([buildah, "commit", "--rm", ctr, f"localhost/rftjob-pause:{version}"])
        except BaseException:
            _run([buildah, "rm", ctr], check=False)
            raise
        tmp = out.with_suffix(".tmp")
        tmp.unlink(missing_ok=True)  # left by an interrupted build: push refuses to overwrite
        _run([buildah, "push", f"localhost/rftjob-pause:{version}", f"docker-archive:{tmp}:{PAUSE_IMAGE}"])
        _run([buildah, "rmi", f"localhost/rftjob-pause:{version}"], check=False)
        tmp.rename(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


# --------------------------------------------------------------------------- the node


class RealNode:
    """The node's files and lifecycle; its processes are spawned through the cluster."""

    def __init__(self, cluster):  # an e2e.cluster.Cluster (which imports this module)
        self.cluster = cluster
        self.dir = cluster.state_dir / "node"

    # -- up

    def start(self, advertise_ip: str, tokens: dict[str, Path], gpus: int = 8,
              registry: str | None = None) -> None:
        """Starts containerd, the kubelet, kube-proxy and CoreDNS; returns once Ready.

        `tokens`: kubeconfigs for "kubelet", "kube-proxy" and "coredns" (cluster.py writes
        them with its other credentials). `registry`: the local registry's host:port.
        """
        b = NodeBinaries.locate()
        self._claim_host()
        self.dir.mkdir(parents=True, exist_ok=True)
        if not HOST_SNAPSHOT.exists():
            NODE_ROOT.mkdir(parents=True, exist_ok=True)
            _write_atomic(HOST_SNAPSHOT, json.dumps(host_snapshot(), indent=1))
        for d in (NODE_ROOT / "kubelet", containerd_root(), NODE_ROOT / "pod-logs", NODE_RUN):
            d.mkdir(parents=True, exist_ok=True)
        self._bridge()
        self._write_containerd_config(registry)
        self._spawn("containerd", [b.containerd, "--config", str(self.dir / "containerd.toml")])
        self.cluster.wait(lambda: self._ctr(b, "version").returncode == 0, 30,
                           "containerd's socket", "containerd")
        self.forget_containers()  # what a node that died (kill_node) left in the store
        res = self._ctr(b, "images", "import", str(pause_archive(b.buildah)))
        if res.returncode != 0:
            raise NodeError(f"importing the pause image: {res.stderr.strip()}")

        kubelet_config, healthz = self._write_kubelet_config(advertise_ip)
        self._spawn("kubelet", [
            str(b.kubelet), f"--config={kubelet_config}", f"--kubeconfig={tokens['kubelet']}",
            f"--hostname-override={NODE_NAME}", f"--node-ip={advertise_ip}",
            f"--root-dir={NODE_ROOT / 'kubelet'}", f"--cert-dir={NODE_ROOT / 'kubelet' / 'pki'}",
            f"--node-labels={LOCAL_NODE_LABEL}=true", "--v=1",
        ])
        self.cluster.wait(lambda: self.cluster.http_ok(f"http://127.0.0.1:{healthz}/healthz"),
                           60, "kubelet /healthz", "kubelet")
        proxy_healthz = self._spawn_kube_proxy(b, tokens["kube-proxy"])
        dns_ready = self._spawn_coredns(b, tokens["coredns"])
        self.cluster.wait(self._ready, 90, f"node {NODE_NAME} Ready", "kubelet")
        # Services and DNS answer before the first pod needs them.
        self.cluster.wait(lambda: self.cluster.http_ok(f"http://127.0.0.1:{proxy_healthz}/healthz"),
                           60, "kube-proxy's first sync", "kube-proxy")
        self.cluster.wait(lambda: self.cluster.http_ok(f"http://127.0.0.1:{dns_ready}/ready"),
                           60, "CoreDNS ready", "coredns")
        # A Node object kept from an earlier start is still cordoned by its drain.
        self.cluster.api().request("PATCH", f"/api/v1/nodes/{NODE_NAME}", {"spec": {"unschedulable": None}},
                                   content_type="application/merge-patch+json")
        if gpus:
            self.cluster.api().request("PATCH", f"/api/v1/nodes/{NODE_NAME}/status", {
                "status": {"capacity": {GPU_RESOURCE: str(gpus)}}}, content_type="application/merge-patch+json")
        log.info("node %s Ready (containerd, kubelet, kube-proxy, CoreDNS)", NODE_NAME)

    def _spawn(self, name: str, argv: list) -> None:
        """Through the cluster (pids.json), and into the host-wide owner file at once, so
        another cluster never takes a starting node for a dead one."""

        self.cluster.spawn(name, argv)
        self.record_processes([r for r in self.cluster.read_records() if r.name in NODE_COMPONENTS])

    def set_registry(self, registry: str) -> None:
        """Points `REGISTRY_HOST` at the registry's current address (read on every pull)."""
        hosts = self.dir / "certs.d" / REGISTRY_HOST
        hosts.mkdir(parents=True, exist_ok=True)
        (hosts / "hosts.toml").write_text(
            f'server = "http://{registry}"\n\n[host."http://{registry}"]\n'
            '  capabilities = ["pull", "resolve"]\n')

    def _claim_host(self) -> None:
        """One real node per host: refuses while another cluster's node is alive (or its
        claim is under a minute old and names no process yet: it is starting)."""
        import fcntl


        NODE_ROOT.mkdir(parents=True, exist_ok=True)
        with open(NODE_ROOT.parent / "rftjob-node.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            self._claim_locked(ProcessRecord)

    def _claim_locked(self, ProcessRecord) -> None:
        try:
            owner = json.loads(OWNER_FILE.read_text())
        except (OSError, ValueError):
            owner = None
        if owner and owner["state_dir"] != str(self.cluster.state_dir):
            alive = [r for r in (ProcessRecord(**p) for p in owner["processes"]) if r.find()]
            starting = not owner["processes"] and time.time() - OWNER_FILE.stat().st_mtime < 60
            if alive or starting:
                raise NodeError(
                    f"a real node already runs on this host for the cluster in {owner['state_dir']} "
                    f"(one per host); stop it with: python -m e2e.cluster down --state-dir {owner['state_dir']}")
            log.info("cleaning up the dead node of %s", owner["state_dir"])
            restore_host()
        NODE_ROOT.mkdir(parents=True, exist_ok=True)
        _write_atomic(OWNER_FILE, json.dumps({"state_dir": str(self.cluster.state_dir), "processes": []}))

    def owns_host(self) -> bool:
        """Whether the host's node (if any) is this cluster's, so its changes are ours to undo."""
        try:
            return json.loads(OWNER_FILE.read_text())["state_dir"] == str(self.cluster.state_dir)
        except (OSError, ValueError, KeyError):
            return False

    def record_processes(self, records: list) -> None:
        """Copies the node's process records to the host-wide owner file."""
        _write_atomic(OWNER_FILE, json.dumps({"state_dir": str(self.cluster.state_dir),
                                              "processes": [vars(r) for r in records]}))

    def _bridge(self) -> None:
        if not Path(f"/sys/class/net/{BRIDGE}").exists():
            _run(["ip", "link", "add", BRIDGE, "type", "bridge"])
            _run(["ip", "addr", "add", f"{GATEWAY}/{ipaddress.ip_network(POD_SUBNET).prefixlen}",
                  "dev", BRIDGE])
        _run(["ip", "link", "set", BRIDGE, "up"])
        cni = self.dir / "cni"
        cni.mkdir(parents=True, exist_ok=True)
        (cni / "10-rftjob.conflist").write_text(json.dumps({
            "cniVersion": "1.0.0", "name": "rftjob-pods",
            "plugins": [
                {"type": "bridge", "bridge": BRIDGE, "isGateway": True, "ipMasq": False,
                 "hairpinMode": True,
                 "ipam": {"type": "host-local", "dataDir": str(NODE_ROOT / "cni"),
                          "ranges": [[{"subnet": POD_SUBNET, "gateway": GATEWAY}]],
                          "routes": [{"dst": "0.0.0.0/0"}]}},
                {"type": "loopback"},
            ],
        }, indent=1))

    def _write_containerd_config(self, registry: str | None) -> None:
        cri = 'plugins."io.containerd.grpc.v1.cri"'
        (self.dir / "containerd.toml").write_text(f"""\
version = 2
root = "{containerd_root()}"
state = "{NODE_RUN / 'state'}"

[grpc]
  address = "{CONTAINERD_SOCK}"

[ttrpc]
  address = "{NODE_RUN / 'containerd.sock.ttrpc'}"

[{cri}]
  sandbox_image = "{PAUSE_IMAGE}"
  # No CAP_SYS_RESOURCE here: lowering oom_score_adj would fail.
  restrict_oom_score_adj = true

[{cri}.containerd]
  snapshotter = "overlayfs"
  # Keep the unpacked layers only: the registry holds the compressed copy.
  discard_unpacked_layers = true
  default_runtime_name = "runc"

[{cri}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"

[{cri}.containerd.runtimes.runc.options]
  SystemdCgroup = false
  Root = "{NODE_RUN / 'runc'}"

[plugins."io.containerd.internal.v1.opt"]
  path = "{NODE_ROOT / 'opt'}"

[{cri}.cni]
  bin_dir = "{CNI_BIN_DIR}"
  conf_dir = "{self.dir / 'cni'}"

[{cri}.registry]
  config_path = "{self.dir / 'certs.d'}"
""")
        if registry:
            self.set_registry(registry)

    def _write_kubelet_config(self, advertise_ip: str) -> tuple[Path, int]:

        healthz = free_port()
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            "address": advertise_ip, "port": free_port(), "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1", "healthzPort": healthz,
            "containerRuntimeEndpoint": f"unix://{CONTAINERD_SOCK}",
            "cgroupDriver": "cgroupfs", "failCgroupV1": False, "failSwapOn": False,
            # The API server calls the kubelet (logs, exec) with its client certificate;
            # everyone else is authenticated and authorised against the API server.
            "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True},
                               "x509": {"clientCAFile": str(self.cluster.ca_file)}},
            "authorization": {"mode": "Webhook"},
            "clusterDomain": CLUSTER_DOMAIN, "clusterDNS": [GATEWAY],
            "podCIDR": POD_SUBNET, "maxPods": 40,
            "registerWithTaints": [LOCAL_TAINT],
            "podLogsDir": str(NODE_ROOT / "pod-logs"),
            "volumePluginDir": str(NODE_ROOT / "volume-plugins"),
            # Imported images (the pause image) cannot be pulled again: never collect them.
            "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
            "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%",
                             "imagefs.available": "1%", "nodefs.inodesFree": "1%"},
            "serializeImagePulls": False,
            "shutdownGracePeriod": "0s",
        }
        path = self.dir / "kubelet-config.yaml"
        path.write_text(json.dumps(config, indent=1))
        return path, healthz

    def _spawn_kube_proxy(self, b: NodeBinaries, kubeconfig: Path) -> int:

        config = {
            "apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration",
            "clientConnection": {"kubeconfig": str(kubeconfig)},
            "hostnameOverride": NODE_NAME, "mode": "iptables", "clusterCIDR": POD_SUBNET,
            "bindAddress": "127.0.0.1",
            "healthzBindAddress": f"127.0.0.1:{free_port()}",
            "metricsBindAddress": f"127.0.0.1:{free_port()}",
            "iptables": {"localhostNodePorts": False},  # leaves route_localnet alone
            # Zeroes leave the host's conntrack sysctls alone.
            "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s",
                          "tcpCloseWaitTimeout": "0s"},
        }
        path = self.dir / "kube-proxy-config.yaml"
        path.write_text(json.dumps(config, indent=1))
        self._spawn("kube-proxy", [str(b.kube_proxy), f"--config={path}", "--v=1"])
        return int(config["healthzBindAddress"].rsplit(":", 1)[1])

    def _spawn_coredns(self, b: NodeBinaries, kubeconfig: Path) -> int:

        ready = free_port()
        corefile = self.dir / "Corefile"
        corefile.write_text(f"""\
.:53 {{
    bind {GATEWAY}
    errors
    ready 127.0.0.1:{ready}
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
        kubeconfig {kubeconfig} rftjob-local
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
    }}
    cache 5
}}
""")
        self._spawn("coredns", [str(b.coredns), "-conf", str(corefile)])
        return ready

    def _ctr(self, b: NodeBinaries, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([b.ctr, "--address", str(CONTAINERD_SOCK), "-n", "k8s.io", *args],
                              capture_output=True, text=True)

    def forget_containers(self) -> None:
        """Removes every container and sandbox from containerd (with their writable
        layers), keeping only images: the next start begins with no pods but no pulls.
        Runs after the kubelet stopped, while containerd still runs."""
        if not CONTAINERD_SOCK.exists():
            return
        b = NodeBinaries.locate()
        listed = self._ctr(b, "containers", "list", "--quiet")
        for cid in listed.stdout.split():
            self._ctr(b, "tasks", "kill", "--signal", "SIGKILL", cid)
            self._ctr(b, "tasks", "delete", "--force", cid)
            self._ctr(b, "containers", "delete", cid)

    def _ready(self) -> bool:
        node = self.cluster.api().get(f"/api/v1/nodes/{NODE_NAME}")
        conditions = {c["type"]: c["status"] for c in node.get("status", {}).get("conditions", [])}
        return conditions.get("Ready") == "True"

    # -- down

    def drain(self, timeout: float = 60) -> None:
        """Cordons the node and deletes its pods through the API, so the kubelet tears
        down their sandboxes (veths, IP leases, mounts) while it still runs."""
        api = self.cluster.api()
        try:
            api.request("PATCH", f"/api/v1/nodes/{NODE_NAME}", {"spec": {"unschedulable": True}},
                        content_type="application/merge-patch+json")
        except Exception as e:  # noqa: BLE001 - no API: the host cleanup does it by hand
            log.warning("cannot cordon %s (%s); cleaning up by hand", NODE_NAME, e)
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                pods = api.get(f"/api/v1/pods?fieldSelector=spec.nodeName%3D{NODE_NAME}")["items"]
            except Exception as e:  # noqa: BLE001 - a slow API server: retry until the deadline
                log.debug("listing the node's pods: %s", e)
                time.sleep(0.5)
                continue
            for pod in pods:
                meta = pod["metadata"]
                if not meta.get("deletionTimestamp"):
                    try:
                        api.request("DELETE", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}",
                                    {"gracePeriodSeconds": 0})
                    except Exception:  # noqa: BLE001 - already gone
                        pass
            if not pods and not _bridge_ports():
                return
            time.sleep(0.5)
        log.warning("pods on %s did not all stop within %.0fs; cleaning up by hand", NODE_NAME, timeout)


def _bridge_ports() -> list[str]:
    try:
        return os.listdir(f"/sys/class/net/{BRIDGE}/brif")
    except OSError:
        return []


def _shim_processes() -> list[psutil.Process]:
    """containerd's shims for our socket (they outlive containerd) and their trees."""
    found = []
    for proc in psutil.process_iter(["name", "cmdline"]):
        cmd = proc.info["cmdline"] or []
        if proc.info["name"] and proc.info["name"].startswith("containerd-shim") \
                and str(CONTAINERD_SOCK) in cmd:
            found.append(proc)
    return found


def kill_shims() -> None:
    procs = []
    for shim in _shim_processes():
        try:
            procs.extend(shim.children(recursive=True))
        except psutil.Error:
            pass
        procs.append(shim)
    for proc in procs:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=10)


def restore_host() -> None:
    """Undoes what a node changed on the host, against the snapshot taken before it
    started. Safe to run twice; after a crash it cleans up what the dead node left."""
    try:
        before = json.loads(HOST_SNAPSHOT.read_text())
    except (OSError, ValueError):
        before = None
    kill_shims()
    # Mounts under the node's dirs and the network namespaces of its pods, deepest first;
    # only what appeared since the snapshot (never another runtime's).
    before_mounts = set(before["mounts"]) if before else set()
    ours = [m for m in mountpoints() if m not in before_mounts and (
        m.startswith((str(NODE_ROOT), str(NODE_RUN), str(containerd_root())))
        or m.startswith(("/run/netns/cni-", "/var/run/netns/cni-")) or m in ("/run/netns", "/var/run/netns"))]
    for point in sorted(set(ours), key=len, reverse=True):
        if subprocess.run(["umount", point], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", point], capture_output=True)
    for point in ours:
        if point.startswith(("/run/netns/cni-", "/var/run/netns/cni-")):
            try:
                os.unlink(point)
            except OSError:
                pass
    # veths on the bridge, then the bridge.
    for port in _bridge_ports():
        subprocess.run(["ip", "link", "del", port], capture_output=True)
    if Path(f"/sys/class/net/{BRIDGE}").exists():
        subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True)
    if before:
        if before.get("boot_id") == _boot_id():  # a reboot already reset these
            _restore_iptables(before["iptables"])
            _restore_sysctls(before["sysctls"])
        _remove_cgroups(before["cgroups"])
        paths = before["paths"]
    else:
        paths = {}
    _remove_container_log_links()
    for p in HOST_PATHS:
        if paths.get(p) is False and os.path.isdir(p) and not os.path.ismount(p):
            shutil.rmtree(p, ignore_errors=True)
    for d in (NODE_RUN, NODE_ROOT):
        shutil.rmtree(d, ignore_errors=True)
    # The CRI plugin's per-sandbox and per-container directories (its image records stay).
    for kind in ("sandboxes", "containers"):
        shutil.rmtree(containerd_root() / "io.containerd.grpc.v1.cri" / kind, ignore_errors=True)


def _remove_container_log_links() -> None:
    d = Path("/var/log/containers")
    if not d.is_dir():
        return
    for link in d.iterdir():
        if link.is_symlink() and os.readlink(link).startswith(str(NODE_ROOT)):
            link.unlink()


def _ours(line: str) -> bool:
    """A chain of ours (`:KUBE-...`), a rule in one, or a rule jumping to one."""
    if line.startswith(":"):
        return line[1:].startswith(OUR_CHAINS)
    args = shlex.split(line)
    chain = args[1] if len(args) > 1 else ""
    target = args[args.index("-j") + 1] if "-j" in args[:-1] else ""
    return chain.startswith(OUR_CHAINS) or target.startswith(OUR_CHAINS)


def _restore_iptables(before: dict[str, list[str]]) -> None:
    """Removes the KUBE-*/CNI-* chains, and the rules in or jumping to them, that were not
    there before; other programs' rules are never touched."""
    now = iptables_rules()
    for key, lines in now.items():
        binary, table = key.split()
        old = set(before.get(key, []))
        new = [line for line in lines if line not in old and _ours(line)]
        # Rules first (in reverse, so jumps go before their targets), then the chains.
        for line in reversed(new):
            if line.startswith("-A"):
                # iptables-save quotes comments in double quotes, as a shell would.
                subprocess.run([binary, "-t", table, "-D", *shlex.split(line[3:])], capture_output=True)
        chains = [line[1:] for line in new if line.startswith(":")]
        for chain in chains:
            subprocess.run([binary, "-t", table, "-F", chain], capture_output=True)
        for chain in chains:
            subprocess.run([binary, "-t", table, "-X", chain], capture_output=True)


def _restore_sysctls(before: dict[str, str]) -> None:
    for key, value in before.items():
        path = _sysctl_path(key)
        try:
            if path.read_text().strip() != value:
                path.write_text(value + "\n")
        except OSError as e:
            log.warning("cannot restore sysctl %s=%s: %s", key, value, e)


def _remove_cgroups(before: dict[str, list[str]]) -> None:
    for top in CGROUP_TOPS:
        had = set(before.get(top, []))
        for hierarchy in _cgroup_hierarchies():
            root = hierarchy / top
            if str(hierarchy) in had or not root.is_dir():
                continue
            for dirpath, _, _ in sorted(os.walk(root), key=lambda w: len(w[0]), reverse=True):
                try:
                    os.rmdir(dirpath)
                except OSError:
                    pass

