"""A small kubelet: runs the pods bound to node ``local`` as processes on this host.

The local cluster (``e2e/cluster.py``) has a real control plane but no kubelet; KWOK only
fakes the lifecycle of pods on the fake GPU nodes. The pod runner registers one more node,
``local``, and actually runs the pods the scheduler binds to it, so the demo and the
end-to-end tests can execute real programs (operator, trainer, explorers) as pods.

Usage::

    python -m e2e.podrunner --kubeconfig K [--node local] [--state-dir .local/podrunner]
    python -m e2e.podrunner logs <namespace>/<pod> [container] [-f] [--state-dir DIR]

    runner = PodRunner(kubeconfig, node="local", state_dir=...)
    runner.start()      # registers the node, starts background threads, returns
    runner.log_path("ns", "pod", "main")
    runner.stop()       # kills every pod's processes; pods stay as they are in the API

SIGTERM/SIGINT stop the CLI the same way. The runner acts with the credentials of the
kubeconfig it is given, normally the cluster's admin kubeconfig: like a kubelet it needs
broad rights (read every Secret and ConfigMap its pods use, mint ServiceAccount tokens,
write node and pod status, delete pods), and it does not restrict itself to what the
Node authorizer would allow a real kubelet.

Node
    ``local`` is registered (if absent) with labels ``kubernetes.io/hostname=local``,
    ``rft.dev/local-node=true``, ``kubernetes.io/os=linux`` and the taint
    ``rft.dev/local=true:NoSchedule``, so only pods that tolerate it (and normally select
    ``rft.dev/local-node: "true"``) land here. It has no KWOK annotation, so KWOK leaves it
    alone. Its Lease in ``kube-node-lease`` is renewed every 10 s and its Ready condition
    every 20 s, so the node-lifecycle controller keeps it Ready while the runner lives.
    Capacity: this host's CPUs and memory, 110 pods, ``nvidia.com/gpu: 0``.

Pods (what each pod gets)
    * A loopback IP ``127.0.0.X`` (X in 2..254, unique among live pods). There is no
      network namespace: the whole 127/8 block routes to ``lo`` on Linux, so a process
      can bind its pod IP and others can dial it. Ports are shared with the host.
    * Mount and UTS namespaces. Every container process is started as
      ``unshare --mount --uts --propagation private -- /bin/sh -c <setup> ...``: the setup
      bind-mounts each volume at its real ``mountPath`` (``readOnly`` remounts it read-only),
      bind-mounts the pod's hosts file onto ``/etc/hosts``, sets the hostname to
      ``spec.hostname`` (or the pod name), changes to the working directory and execs the
      command. Programs therefore see exactly the paths a kubelet would give them
      (``/var/run/secrets/kubernetes.io/serviceaccount/token``, ``/etc/rft/config.json``,
      ``/dev/shm``), and the unmodified in-cluster Kubernetes client works. The rest of the
      filesystem is the host's: this repository's Python environment is "the image".
      Chosen over LD_PRELOAD tricks (nss_wrapper for names, path rewriting for files)
      because those only cover what they intercept: a static binary, a direct syscall or
      a Python ``open()`` of a hard-coded path would escape them, while a bind mount is
      seen by everything. The price: it needs root (CAP_SYS_ADMIN) for ``unshare(2)``
      and ``mount(2)``; ``start()`` checks this and fails with a clear error otherwise.
      Missing mount points are created (empty) on the host filesystem and left there;
      the mounts themselves exist only inside each container's mount namespace.
    * DNS through ``/etc/hosts`` (no DNS server): the runner writes each pod's hosts file
      in place (same inode, so the bind mount sees updates) whenever pods or Services
      change. Entries: ``localhost``; the pod's own IP with its FQDN and hostname; for
      each live pod with ``spec.hostname`` and ``spec.subdomain``
      ``<host>.<subdomain>.<ns>.svc.cluster.local``, ``...svc`` and ``<host>.<subdomain>.<ns>``;
      for each headless Service with a selector ``<svc>.<ns>.svc.cluster.local``,
      ``<svc>.<ns>.svc`` and ``<svc>.<ns>`` for each ready pod (on this node) it selects.
      Pods in the same namespace also get the short forms ``<host>.<subdomain>`` and
      ``<svc>`` (what the resolv.conf search path would give); ``hostAliases`` are added.
      ClusterIP Services are not resolvable (there is no kube-proxy).
    * Environment: the runner's own environment minus ``KUBECONFIG``, ``AWS_*`` and
      ``KUBERNETES_*``, plus ``KUBERNETES_SERVICE_HOST``/``KUBERNETES_SERVICE_PORT`` (the
      API server's real address from the kubeconfig; its serving certificate covers it),
      ``HOSTNAME``, then the container's ``envFrom`` and ``env`` (``value``, ``fieldRef``,
      ``resourceFieldRef``, ``secretKeyRef``, ``configMapKeyRef``, with ``optional``), with
      Kubernetes ``$(VAR)`` expansion (``$$`` escapes) in env values, command and args. A
      missing required Secret/ConfigMap/key leaves the container waiting with reason
      ``CreateContainerConfigError`` and is retried. ``command[0]`` ``python``/``python3``
      means ``sys.executable``. No Service link variables.
    * Volumes under ``<state>/pods/<ns>_<name>_<uid>/volumes/<vol>``: emptyDir (medium
      Memory lives under /dev/shm), hostPath, configMap, secret, downwardAPI and projected
      (serviceAccountToken from the TokenRequest API, bound to the pod, refreshed at 80%
      of its lifetime; configMap; secret; downwardAPI), with ``items``, ``optional``,
      ``defaultMode``/``mode`` and ``subPath``. The API server's automatic
      ``kube-api-access-*`` volume therefore works. ConfigMap/Secret contents are read
      when the pod starts and not refreshed afterwards. A volume that cannot be set up
      yet (e.g. a Secret not created yet) keeps the pod ContainerCreating and is retried;
      unsupported volume types (PVCs, ...) keep it there for good.
    * Containers: init containers in order (each must exit 0; a failure restarts it with
      back-off, or fails the pod under restartPolicy Never), then all containers at once,
      each in its own process group (``containerID: runner://<pid>``), stdout+stderr
      appended to ``<pod dir>/<container>.log``. restartPolicy Always/OnFailure/Never with
      crash back-off 1 s doubling to 30 s. Sidecar init containers (``restartPolicy:
      Always`` on an init container) are not supported: they run like ordinary init
      containers, so one that never exits keeps the pod initialising.
    * readinessProbe: httpGet (host defaults to the pod IP, numeric or named port),
      tcpSocket and exec (run with ``nsenter`` inside the container's namespaces), with
      initialDelaySeconds, periodSeconds, timeoutSeconds, successThreshold and
      failureThreshold. Without one a container is ready while it runs. Liveness and
      startup probes, lifecycle hooks, resource limits, securityContext (users,
      capabilities), termination messages and image pulls are ignored.
    * Status is patched (only on change) like a kubelet: phase, podIP(s), hostIP(s),
      startTime, conditions, (init)containerStatuses with state/lastState/restartCount.
    * Deletion: on a deletionTimestamp every container's process group gets SIGTERM, then
      SIGKILL after the grace period; the pod's directory and IP are released and the pod
      object is deleted with gracePeriodSeconds=0 (the kubelet's final delete). A pod
      deleted outright gets its processes killed. When the runner starts, pods on its
      node that it did not start (their processes died with a previous runner) and that
      are not finished are marked Failed with reason ``NodeRestart`` (exit code 137).
    * Logs: ``python -m e2e.podrunner logs ns/pod [container]`` prints
      ``<state>/pods/<ns>_<pod>_<uid>/<container>.log``. ``kubectl logs`` works too: the
      runner serves the kubelet's ``/containerLogs/{ns}/{pod}/{container}`` (``tailLines``,
      ``follow``, ``limitBytes``) over HTTPS with a self-signed certificate on the node's
      InternalIP and kubelet port (the API server does not verify kubelet certificates
      when no kubelet CA is configured). The endpoint does not authenticate callers; it
      only serves pod logs.

The runner's own log is ``<state>/podrunner.log`` (and stderr). If the runner dies
without stopping (SIGKILL), its pods' processes keep running; stop them by hand.
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import http.client
import ipaddress
import json
import logging
import math
import os
import re
import shlex
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Iterator
from urllib.parse import parse_qs, urlsplit

log = logging.getLogger("e2e.podrunner")

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_STATE_DIR = REPO_ROOT / ".local" / "podrunner"
DEFAULT_NODE = "local"

LOCAL_NODE_LABEL = "rft.dev/local-node"
LOCAL_TAINT = {"key": "rft.dev/local", "value": "true", "effect": "NoSchedule"}
LEASE_NAMESPACE = "kube-node-lease"
LEASE_DURATION_S = 40
LEASE_RENEW_S = 10
NODE_STATUS_S = 20
BACKOFF_START_S = 1.0
BACKOFF_MAX_S = 30.0
BACKOFF_RESET_S = 600.0  # a container that ran this long starts over at 1 s back-off
CONFIG_RETRY_S = 2.0  # CreateContainerConfigError / volume setup retry
TICK_S = 0.2
STOP_GRACE_S = 2.0  # runner stop: SIGTERM, this long, SIGKILL
MIN_TOKEN_SECONDS = 600
TERMINAL = ("Succeeded", "Failed")
SHM = Path("/dev/shm")


class PodRunnerError(RuntimeError):
    """The pod runner cannot run here (missing capability, bad kubeconfig, ...)."""


class _ConfigError(Exception):
    """A container's configuration refers to something missing (retried)."""


class _VolumeError(Exception):
    """A volume cannot be set up (yet)."""


# --------------------------------------------------------------------------- small helpers


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _now_micro() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _g(obj: Any, *keys: str, default: Any = None) -> Any:
    """obj[k1][k2]... or default when any level is missing or None."""
    for key in keys:
        if not isinstance(obj, dict) or obj.get(key) is None:
            return default
        obj = obj[key]
    return obj


def _kv(event: str, **fields: Any) -> str:
    """A structured log line: `event key=value ...`."""
    parts = [event]
    for key, value in fields.items():
        text = str(value)
        parts.append(f"{key}={json.dumps(text) if (not text or ' ' in text or '=' in text) else text}")
    return " ".join(parts)


def expand(text: str, mapping: Callable[[str], str | None]) -> str:
    """Kubernetes `$(VAR)` expansion (k8s.io/kubernetes third_party/forked/golang/expansion).

    `$(VAR)` becomes the variable's value when defined and stays as written otherwise;
    `$$` is an escaped `$`; any other `$` (or an unterminated `$(`) is kept literally.
    """
    out: list[str] = []
    checkpoint = 0
    cursor = 0
    n = len(text)
    while cursor < n:
        if text[cursor] == "$" and cursor + 1 < n:
            out.append(text[checkpoint:cursor])
            nxt = text[cursor + 1]
            if nxt == "$":
                out.append("$")
                advance = 1
            elif nxt == "(":
                close = text.find(")", cursor + 2)
                if close == -1:
                    out.append("$(")
                    advance = 1
                else:
                    name = text[cursor + 2:close]
                    value = mapping(name)
                    out.append(value if value is not None else f"$({name})")
                    advance = close - cursor
            else:
                out.append("$" + nxt)
                advance = 1
            cursor += advance
            checkpoint = cursor + 1
        cursor += 1
    out.append(text[checkpoint:])
    return "".join(out)


_LABEL_REF = re.compile(r"""metadata\.(labels|annotations)\[['"](.+)['"]\]""")


def _format_map(values: dict[str, str]) -> str:
    """The downward API's `key="value"` lines for labels/annotations."""
    return "\n".join(f"{k}={json.dumps(v)}" for k, v in sorted(values.items()))


def field_value(pod: dict, path: str, pod_ip: str | None = None, host_ip: str | None = None) -> str:
    """The value of a downward-API fieldRef on `pod` (pod/host IP overridable)."""
    meta = pod.get("metadata") or {}
    m = _LABEL_REF.fullmatch(path)
    if m:
        return (meta.get(m.group(1)) or {}).get(m.group(2), "")
    pod_ip = pod_ip if pod_ip is not None else _g(pod, "status", "podIP", default="")
    host_ip = host_ip if host_ip is not None else _g(pod, "status", "hostIP", default="")
    simple = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""),
        "metadata.labels": _format_map(meta.get("labels") or {}),
        "metadata.annotations": _format_map(meta.get("annotations") or {}),
        "spec.nodeName": _g(pod, "spec", "nodeName", default=""),
        "spec.serviceAccountName": _g(pod, "spec", "serviceAccountName", default=""),
        "status.podIP": pod_ip,
        "status.podIPs": pod_ip,
        "status.hostIP": host_ip,
        "status.hostIPs": host_ip,
    }
    if path not in simple:
        raise _ConfigError(f"unsupported fieldRef fieldPath {path!r}")
    return simple[path]


def _parse_quantity(value: Any):
    from kubernetes.utils import parse_quantity  # Decimal

    return parse_quantity(str(value))


def resource_value(container: dict, ref: dict, node_allocatable: dict[str, str]) -> str:
    """A resourceFieldRef (limits.cpu, requests.memory, ...) like the kubelet renders it."""
    resource = ref["resource"]
    kind, _, name = resource.partition(".")
    value = _g(container, "resources", kind, name)
    if value is None and kind == "limits":
        value = node_allocatable.get(name)
    if value is None:
        value = "0"
    divisor = _parse_quantity(ref.get("divisor") or "1")
    if divisor == 0:
        divisor = _parse_quantity("1")
    return str(math.ceil(_parse_quantity(value) / divisor))


def _write_file(path: Path, data: bytes, mode: int) -> None:
    """Writes `data` atomically (temp file + rename in the same directory)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _write_in_place(path: Path, data: bytes, create: bool = False) -> None:
    """Rewrites a file keeping its inode (bind mounts of it see the new content)."""
    flags = os.O_WRONLY | (os.O_CREAT if create else 0)
    fd = os.open(path, flags, 0o644)
    try:
        os.write(fd, data)
        os.ftruncate(fd, len(data))
    finally:
        os.close(fd)


def _safe_rel(path: str) -> str:
    """A relative path inside a volume (no absolute paths, no `..`)."""
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if not parts or ".." in parts or path.startswith("/"):
        raise _VolumeError(f"invalid path {path!r}")
    return "/".join(parts)


def _meminfo_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 1024**3


def node_address() -> str:
    """The node's InternalIP: the cluster's advertise address, else 127.0.0.1."""
    try:
        from .cluster import advertise_address

        return advertise_address()
    except Exception:  # noqa: BLE001 - any failure: fall back to loopback
        return "127.0.0.1"


def check_isolation() -> None:
    """Fails unless mount+UTS namespaces and bind mounts work (needs root/CAP_SYS_ADMIN)."""
    missing = [tool for tool in ("unshare", "mount", "hostname", "nsenter") if not shutil.which(tool)]
    if missing:
        raise PodRunnerError(
            f"the pod runner needs {', '.join(missing)} (util-linux) on PATH to isolate pods"
        )
    with tempfile.TemporaryDirectory(prefix="podrunner-check-") as tmp:
        src, dst = Path(tmp, "src"), Path(tmp, "dst")
        src.mkdir()
        dst.mkdir()
        script = (f"mount --bind {shlex.quote(str(src))} {shlex.quote(str(dst))}"
                  f" && mount -o remount,bind,ro {shlex.quote(str(dst))}"
                  " && hostname podrunner-check")
        try:
            proc = subprocess.run(
                ["unshare", "--mount", "--uts", "--propagation", "private", "--", "/bin/sh", "-c", script],
                capture_output=True, text=True, timeout=20,
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            proc = None
            detail = str(e)
        else:
            detail = (proc.stderr or proc.stdout).strip()
        if proc is None or proc.returncode != 0:
            raise PodRunnerError(
                "the pod runner isolates pods with Linux mount and UTS namespaces and bind "
                "mounts, which need CAP_SYS_ADMIN (run it as root, on a kernel/sandbox that "
                "allows unshare(CLONE_NEWNS|CLONE_NEWUTS) and mount(2)); the check "
                f"`unshare --mount --uts -- mount --bind ...; hostname ...` failed: {detail}"
            )


# --------------------------------------------------------------------------- API access


class _Api:
    """JSON over the `kubernetes` package's ApiClient (plain dicts, API field names).

    A private Configuration: the global default client configuration is left alone.
    """

    def __init__(self, kubeconfig: str | os.PathLike):
        from kubernetes import client, config

        cfg = client.Configuration()
        try:
            config.load_kube_config(config_file=str(kubeconfig), client_configuration=cfg,
                                    persist_config=False)
        except Exception as e:  # noqa: BLE001
            raise PodRunnerError(f"cannot load kubeconfig {kubeconfig}: {e}") from e
        cfg.connection_pool_maxsize = 32
        self.server = cfg.host
        self.ca_file = cfg.ssl_ca_cert
        self._client = client.ApiClient(cfg)
        self._lock = threading.Lock()
        self._open: set[Any] = set()

    def request(self, method: str, path: str, body: Any = None, query: list | None = None,
                content_type: str | None = None, timeout: float = 30, stream: bool = False) -> Any:
        from kubernetes.client.exceptions import ApiException

        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type or "application/json"
        req = self._client.param_serialize(method, path, query_params=list(query or []),
                                           header_params=headers, body=body,
                                           auth_settings=["BearerToken"])
        resp = self._client.call_api(*req, _request_timeout=timeout)
        if stream and 200 <= resp.status < 300:
            return resp.response
        data = resp.read()
        if not 200 <= resp.status < 300:
            text = data.decode(errors="replace") if data else ""
            ApiException.from_response(http_resp=resp, body=text, data=None)
            raise ApiException(status=resp.status, reason=resp.reason, body=text)
        return json.loads(data) if data else None

    def get(self, path: str, **kw: Any) -> Any:
        return self.request("GET", path, **kw)

    def post(self, path: str, body: Any) -> Any:
        return self.request("POST", path, body)

    def merge_patch(self, path: str, body: Any) -> Any:
        return self.request("PATCH", path, body, content_type="application/merge-patch+json")

    def delete(self, path: str, body: Any = None) -> Any:
        return self.request("DELETE", path, body)

    def watch(self, path: str, query: list, timeout_s: int) -> Iterator[dict]:
        """Watch events (dicts with type/object) until the server ends the stream."""
        from kubernetes.watch.watch import iter_resp_lines

        resp = self.request("GET", path, query=query + [("watch", "true"),
                                                        ("timeoutSeconds", str(timeout_s))],
                            timeout=(10, timeout_s + 15), stream=True)
        with self._lock:
            self._open.add(resp)
        try:
            for line in iter_resp_lines(resp):
                if line:
                    yield json.loads(line)
        finally:
            with self._lock:
                self._open.discard(resp)
            resp.release_conn()

    def close_watches(self) -> None:
        """Unblocks every running watch (used on stop)."""
        with self._lock:
            responses = list(self._open)
        for resp in responses:
            try:
                if hasattr(resp, "shutdown"):
                    resp.shutdown()
                resp.close()
            except Exception:  # noqa: BLE001
                pass

    def close(self) -> None:
        self.close_watches()
        try:
            self._client.close()
        except Exception:  # noqa: BLE001
            pass


def _status_code(e: Exception) -> int | None:
    return getattr(e, "status", None)


# --------------------------------------------------------------------------- containers


class _Container:
    """Runtime state of one (init) container of a pod."""

    def __init__(self, spec: dict, init: bool, waiting_reason: str):
        self.spec = spec
        self.name: str = spec["name"]
        self.init = init
        self.proc: subprocess.Popen | None = None
        self.pid: int | None = None
        self.restart_count = 0
        self.ever_started = False
        self.state: dict = {"waiting": {"reason": waiting_reason}}
        self.last_state: dict = {}
        self.started_at: str | None = None
        self.started_mono = 0.0
        self.ready = False
        self.done = False  # terminated and will not restart
        self.exit_code: int | None = None
        self.next_start = 0.0
        self.backoff = BACKOFF_START_S
        self.env: dict[str, str] = {}
        self.workdir = "/"
        # readiness probe
        self.probe_next = 0.0
        self.probe_successes = 0
        self.probe_failures = 0

    @property
    def running(self) -> bool:
        return self.proc is not None

    def status(self) -> dict:
        status = {
            "name": self.name,
            "image": self.spec.get("image", ""),
            "imageID": "",
            "ready": bool(self.ready),
            "restartCount": self.restart_count,
            "started": self.running,
            "state": self.state,
            "lastState": self.last_state,
        }
        if self.pid is not None:
            status["containerID"] = f"runner://{self.pid}"
        return status


# --------------------------------------------------------------------------- pods


class _PodWorker(threading.Thread):
    """Runs one pod: volumes, containers, probes, status, termination."""

    def __init__(self, runner: "PodRunner", pod: dict, ip: str):
        meta = pod["metadata"]
        super().__init__(name=f"pod-{meta['namespace']}/{meta['name']}", daemon=True)
        self.runner = runner
        self.api = runner._api
        self.pod = pod
        self.uid: str = meta["uid"]
        self.ns: str = meta["namespace"]
        self.pod_name: str = meta["name"]
        self.ip = ip
        self.dir = runner.pods_dir / f"{self.ns}_{self.pod_name}_{self.uid}"
        self.hosts_path = self.dir / "etc-hosts"
        spec = pod.get("spec") or {}
        self.hostname = (spec.get("hostname") or self.pod_name)[:63].rstrip("-.")
        self.subdomain = spec.get("subdomain") or ""
        self.restart_policy = spec.get("restartPolicy") or "Always"
        has_init = bool(spec.get("initContainers"))
        self.inits = [_Container(c, True, "PodInitializing") for c in spec.get("initContainers") or []]
        self.mains = [_Container(c, False, "PodInitializing" if has_init else "ContainerCreating")
                      for c in spec.get("containers") or []]
        if has_init:
            self.inits[0].state = {"waiting": {"reason": "PodInitializing"}}
        self.start_time = _now()
        self.volume_paths: dict[str, Path] = {}
        self.volumes_ready = False
        self.volume_error: str | None = None
        self.next_volume_try = 0.0
        self.shm_dirs: list[Path] = []
        self.tokens: list[dict] = []
        self.init_idx = 0
        self.initialized = not has_init
        self.init_failed = False
        self.phase = "Pending"
        self.terminal = False
        self.ready = False
        self.cond_times: dict[str, tuple[str, str]] = {}
        self.last_published: dict | None = None
        self.next_publish_try = 0.0
        self.wake = threading.Event()
        self.delete_deadline: float | None = None  # set when the API deletes the pod
        self.removed = False  # pod object gone without our final delete
        self.stopping = False  # runner stops
        self.finished = threading.Event()  # thread done
        self._hosts_content: bytes | None = None

    # -- control (called from other threads)

    def update(self, pod: dict) -> None:
        self.pod = pod
        meta = pod.get("metadata") or {}
        if meta.get("deletionTimestamp"):
            grace = meta.get("deletionGracePeriodSeconds")
            if grace is None:
                grace = _g(pod, "spec", "terminationGracePeriodSeconds", default=30)
            deadline = time.monotonic() + max(0, int(grace))
            if self.delete_deadline is None or deadline < self.delete_deadline:
                self.delete_deadline = deadline
        self.wake.set()

    def remove(self) -> None:
        self.removed = True
        self.wake.set()

    def stop(self) -> None:
        self.stopping = True
        self.wake.set()

    @property
    def live(self) -> bool:
        """Holds an IP and appears in DNS."""
        return not self.terminal and not self.finished.is_set() and self.delete_deadline is None

    def write_hosts(self, content: str) -> None:
        data = content.encode()
        if data == self._hosts_content:
            return
        try:
            _write_in_place(self.hosts_path, data, create=True)
            self._hosts_content = data
        except OSError:
            pass  # being cleaned up

    # -- main loop

    def run(self) -> None:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self.runner._refresh_hosts()  # creates this pod's hosts file
            log.info(_kv("pod.start", pod=f"{self.ns}/{self.pod_name}", ip=self.ip, uid=self.uid))
            while True:
                self.wake.clear()
                if self.stopping:
                    self._kill_all(STOP_GRACE_S)
                    self._remove_shm()
                    return
                if self.removed:
                    self._kill_all(0)
                    self._cleanup()
                    log.info(_kv("pod.removed", pod=f"{self.ns}/{self.pod_name}"))
                    return
                if self.delete_deadline is not None:
                    self._terminate_and_delete()
                    return
                if not self.terminal:
                    self._step()
                self._publish()
                self.wake.wait(1.0 if self.terminal else TICK_S)
        except Exception:  # noqa: BLE001
            log.exception(_kv("pod.worker_crashed", pod=f"{self.ns}/{self.pod_name}"))
            self._kill_all(0)
        finally:
            self.finished.set()
            self.runner._worker_done(self)

    def _step(self) -> None:
        now = time.monotonic()
        if not self.volumes_ready:
            if now < self.next_volume_try:
                return
            try:
                self._setup_volumes()
                self.volumes_ready = True
                self.volume_error = None
            except (_VolumeError, _ConfigError) as e:
                self._volume_failed(str(e), now)
                return
            except Exception as e:  # noqa: BLE001 - API errors etc.: retry
                self._volume_failed(f"{type(e).__name__}: {e}", now)
                return
        self._refresh_tokens()
        if not self.initialized:
            c = self.inits[self.init_idx]
            self._step_container(c, now)
            if c.done:
                if c.exit_code == 0:
                    self.init_idx += 1
                    if self.init_idx == len(self.inits):
                        self.initialized = True
                        for m in self.mains:
                            m.state = {"waiting": {"reason": "ContainerCreating"}}
                    else:
                        self.inits[self.init_idx].state = {"waiting": {"reason": "PodInitializing"}}
                else:
                    self.init_failed = True
            if not self.initialized:
                self._update_phase()
                return
        for c in self.mains:
            self._step_container(c, now)
        for c in self.mains:
            self._probe(c, now)
        self._update_phase()

    def _volume_failed(self, message: str, now: float) -> None:
        if message != self.volume_error:
            log.warning(_kv("pod.volume_setup_failed", pod=f"{self.ns}/{self.pod_name}", error=message))
        self.volume_error = message
        self.next_volume_try = now + CONFIG_RETRY_S
        for c in (self.inits[:1] if self.inits else self.mains):
            c.state = {"waiting": {"reason": "ContainerCreating", "message": message}}

    def _update_phase(self) -> None:
        old_ready = self.ready
        if self.init_failed:
            phase = "Failed"
        elif not self.initialized:
            phase = "Pending"
        elif self.mains and all(c.done for c in self.mains):
            phase = "Succeeded" if all(c.exit_code == 0 for c in self.mains) else "Failed"
        elif any(c.ever_started for c in self.mains):
            phase = "Running"
        else:
            phase = "Pending"
        if phase != self.phase:
            log.info(_kv("pod.phase", pod=f"{self.ns}/{self.pod_name}", phase=phase))
        self.phase = phase
        self.ready = phase == "Running" and all(c.ready for c in self.mains)
        if phase in TERMINAL:
            self.terminal = True
            self.ready = False
            for c in self.inits + self.mains:  # containers that never ran
                if not c.done and c.proc is None and "waiting" in c.state:
                    c.done = True
            self._remove_shm()
            self.runner._release_ip(self)
        if self.ready != old_ready or self.terminal:
            self.runner._refresh_hosts()

    # -- containers

    def _step_container(self, c: _Container, now: float) -> None:
        if c.proc is not None:
            rc = c.proc.poll()
            if rc is None:
                return
            self._on_exit(c, rc, now)
            return
        if c.done or now < c.next_start:
            return
        self._start_container(c, now)

    def _will_restart(self, c: _Container, rc: int) -> bool:
        if c.init:
            return rc != 0 and self.restart_policy != "Never"
        if self.restart_policy == "Always":
            return True
        if self.restart_policy == "OnFailure":
            return rc != 0
        return False

    def _on_exit(self, c: _Container, rc: int, now: float) -> None:
        code = rc if rc >= 0 else 128 - rc  # killed by signal N: 128+N
        terminated = {
            "exitCode": code,
            "reason": "Completed" if code == 0 else "Error",
            "startedAt": c.started_at,
            "finishedAt": _now(),
            "containerID": f"runner://{c.pid}",
        }
        c.proc = None
        c.ready = False
        c.exit_code = code
        c.probe_successes = c.probe_failures = 0
        log.info(_kv("container.exit", pod=f"{self.ns}/{self.pod_name}", container=c.name, code=code))
        if self._will_restart(c, code) and not self.stopping and self.delete_deadline is None:
            if now - c.started_mono >= BACKOFF_RESET_S:
                c.backoff = BACKOFF_START_S
            delay = c.backoff
            c.backoff = min(c.backoff * 2, BACKOFF_MAX_S)
            c.next_start = now + delay
            c.last_state = {"terminated": terminated}
            c.state = {"waiting": {
                "reason": "CrashLoopBackOff",
                "message": f"back-off {delay:g}s restarting failed container={c.name} pod={self.pod_name}",
            }}
        else:
            c.state = {"terminated": terminated}
            c.done = True

    def _start_container(self, c: _Container, now: float) -> None:
        try:
            env = self._resolve_env(c.spec)
        except _ConfigError as e:
            c.state = {"waiting": {"reason": "CreateContainerConfigError", "message": str(e)}}
            c.next_start = now + CONFIG_RETRY_S
            return
        except Exception as e:  # noqa: BLE001 - API trouble: same treatment
            c.state = {"waiting": {"reason": "CreateContainerConfigError", "message": f"{type(e).__name__}: {e}"}}
            c.next_start = now + CONFIG_RETRY_S
            return
        lookup = env.get
        command = [expand(a, lookup) for a in c.spec.get("command") or []]
        args = [expand(a, lookup) for a in c.spec.get("args") or []]
        argv = command + args
        if not argv:
            c.state = {"waiting": {"reason": "CreateContainerError",
                                   "message": "no command: the pod runner has no image entrypoint"}}
            c.next_start = now + CONFIG_RETRY_S
            return
        if argv[0] in ("python", "python3"):
            argv[0] = sys.executable
        full_env = {**self.runner._base_env, "HOSTNAME": self.hostname, **env}
        workdir = c.spec.get("workingDir") or str(self.dir)
        try:
            script = self._setup_script(c, workdir, full_env)
        except _VolumeError as e:
            c.state = {"waiting": {"reason": "CreateContainerConfigError", "message": str(e)}}
            c.next_start = now + CONFIG_RETRY_S
            return
        log_path = self.dir / f"{c.name}.log"
        try:
            with open(log_path, "ab") as logf:
                proc = subprocess.Popen(
                    ["unshare", "--mount", "--uts", "--propagation", "private", "--",
                     "/bin/sh", "-c", script, "sh", *argv],
                    stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                    cwd=self.dir, env=full_env, start_new_session=True,
                )
        except OSError as e:
            c.state = {"waiting": {"reason": "RunContainerError", "message": str(e)}}
            c.next_start = now + c.backoff
            c.backoff = min(c.backoff * 2, BACKOFF_MAX_S)
            return
        if c.ever_started:
            c.restart_count += 1
        c.ever_started = True
        c.proc, c.pid = proc, proc.pid
        c.env, c.workdir = full_env, workdir
        c.started_at = _now()
        c.started_mono = now
        c.state = {"running": {"startedAt": c.started_at}}
        c.exit_code = None
        probe = c.spec.get("readinessProbe")
        c.ready = probe is None
        c.probe_successes = c.probe_failures = 0
        if probe:
            c.probe_next = now + float(probe.get("initialDelaySeconds") or 0)
        log.info(_kv("container.start", pod=f"{self.ns}/{self.pod_name}", container=c.name,
                     pid=proc.pid, restarts=c.restart_count))

    def _setup_script(self, c: _Container, workdir: str, env: dict[str, str]) -> str:
        """The shell run inside the new namespaces before exec'ing the command."""
        q = shlex.quote
        lines = ["set -e"]
        mounts = []
        for m in c.spec.get("volumeMounts") or []:
            name = m["name"]
            if name not in self.volume_paths:
                raise _VolumeError(f"volumeMount {name!r}: no such volume")
            source = self.volume_paths[name]
            sub = m.get("subPath") or ""
            if m.get("subPathExpr"):
                sub = expand(m["subPathExpr"], env.get)
            if sub:
                source = source / _safe_rel(sub)
                if not source.exists():
                    source.mkdir(parents=True, exist_ok=True)
            target = m["mountPath"]
            if not target.startswith("/"):
                raise _VolumeError(f"volumeMount {name!r}: mountPath must be absolute")
            mounts.append((target, source, bool(m.get("readOnly"))))
        mounts.sort(key=lambda t: t[0].rstrip("/").count("/"))  # parents before children
        for target, source, _ in mounts:
            # Missing mount points are made here, after the parent mounts: a nested one
            # lands inside its parent volume, a top-level one on the host filesystem.
            if source.is_dir():
                lines.append(f"mkdir -p {q(target)}")
            else:
                lines.append(f"[ -e {q(target)} ] || {{ mkdir -p {q(str(Path(target).parent))} && : > {q(target)}; }}")
            lines.append(f"mount --bind {q(str(source))} {q(target)}")
        for target, _, read_only in mounts:
            if read_only:
                lines.append(f"mount -o remount,bind,ro {q(target)}")
        lines.append(f"mount --bind {q(str(self.hosts_path))} /etc/hosts")
        lines.append(f"hostname {q(self.hostname)}")
        lines.append(f"mkdir -p {q(workdir)} && cd {q(workdir)}")
        lines.append('exec "$@"')
        return "\n".join(lines)

    # -- env

    def _resolve_env(self, spec: dict) -> dict[str, str]:
        env: dict[str, str] = {}
        for src in spec.get("envFrom") or []:
            prefix = src.get("prefix") or ""
            if "configMapRef" in src:
                ref = src["configMapRef"]
                data = self._config_map(ref["name"], bool(ref.get("optional")), _ConfigError)
            elif "secretRef" in src:
                ref = src["secretRef"]
                data = self._secret(ref["name"], bool(ref.get("optional")), _ConfigError)
            else:
                continue
            for key, value in (data or {}).items():
                env[prefix + key] = value.decode(errors="replace")
        for item in spec.get("env") or []:
            name = item["name"]
            if "valueFrom" in item:
                value = self._value_from(item["valueFrom"], spec)
                if value is None:  # optional and missing
                    continue
            else:
                value = expand(item.get("value") or "", env.get)
            env[name] = value
        return env

    def _value_from(self, src: dict, container: dict) -> str | None:
        if "fieldRef" in src:
            return field_value(self.pod, src["fieldRef"]["fieldPath"], self.ip, self.runner.node_ip)
        if "resourceFieldRef" in src:
            return resource_value(container, src["resourceFieldRef"], self.runner.allocatable)
        for kind, getter in (("secretKeyRef", self._secret), ("configMapKeyRef", self._config_map)):
            if kind in src:
                ref = src[kind]
                optional = bool(ref.get("optional"))
                data = getter(ref["name"], optional, _ConfigError)
                if data is None:
                    return None
                if ref["key"] not in data:
                    if optional:
                        return None
                    what = "secret" if kind == "secretKeyRef" else "configmap"
                    raise _ConfigError(f"couldn't find key {ref['key']} in {what} {self.ns}/{ref['name']}")
                return data[ref["key"]].decode(errors="replace")
        raise _ConfigError(f"unsupported valueFrom {sorted(src)}")

    def _secret(self, name: str, optional: bool, error: type) -> dict[str, bytes] | None:
        try:
            obj = self.api.get(f"/api/v1/namespaces/{self.ns}/secrets/{name}")
        except Exception as e:  # noqa: BLE001
            if _status_code(e) == 404:
                if optional:
                    return None
                raise error(f'secret "{name}" not found') from None
            raise
        return {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}

    def _config_map(self, name: str, optional: bool, error: type) -> dict[str, bytes] | None:
        try:
            obj = self.api.get(f"/api/v1/namespaces/{self.ns}/configmaps/{name}")
        except Exception as e:  # noqa: BLE001
            if _status_code(e) == 404:
                if optional:
                    return None
                raise error(f'configmap "{name}" not found') from None
            raise
        data = {k: v.encode() for k, v in (obj.get("data") or {}).items()}
        data.update({k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()})
        return data

    # -- volumes

    def _setup_volumes(self) -> None:
        paths: dict[str, Path] = {}
        self.tokens = []
        for vol in (self.pod.get("spec") or {}).get("volumes") or []:
            paths[vol["name"]] = self._materialise(vol)
        self.volume_paths = paths

    def _materialise(self, vol: dict) -> Path:
        name = vol["name"]
        target = self.dir / "volumes" / name
        if "emptyDir" in vol:
            if (vol["emptyDir"] or {}).get("medium") == "Memory" and SHM.is_dir():
                target = SHM / "podrunner" / self.uid / name
                if target.parent not in self.shm_dirs:
                    self.shm_dirs.append(target.parent)
            target.mkdir(parents=True, exist_ok=True)
            return target
        if "hostPath" in vol:
            hp = vol["hostPath"]
            path = Path(hp["path"])
            kind = hp.get("type") or ""
            if kind == "DirectoryOrCreate":
                path.mkdir(parents=True, exist_ok=True)
            elif kind == "FileOrCreate" and not path.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                path.touch()
            if not path.exists():
                raise _VolumeError(f"hostPath {path} does not exist")
            return path
        target.mkdir(parents=True, exist_ok=True)
        if "configMap" in vol or "secret" in vol:
            self._write_source(target, vol, int(_g(vol, "configMap" if "configMap" in vol else "secret",
                                                    "defaultMode", default=0o644)))
            return target
        if "downwardAPI" in vol:
            self._write_downward(target, vol["downwardAPI"].get("items") or [],
                                 int(vol["downwardAPI"].get("defaultMode") or 0o644))
            return target
        if "projected" in vol:
            proj = vol["projected"]
            mode = int(proj.get("defaultMode") or 0o644)
            for src in proj.get("sources") or []:
                if "serviceAccountToken" in src:
                    tok = src["serviceAccountToken"]
                    entry = {"path": target / _safe_rel(tok["path"]), "mode": mode,
                             "audience": tok.get("audience") or "",
                             "seconds": max(MIN_TOKEN_SECONDS, int(tok.get("expirationSeconds") or 3600)),
                             "refresh_at": 0.0}
                    self._write_token(entry)
                    self.tokens.append(entry)
                elif "configMap" in src or "secret" in src:
                    self._write_source(target, src, mode)
                elif "downwardAPI" in src:
                    self._write_downward(target, src["downwardAPI"].get("items") or [], mode)
                else:
                    raise _VolumeError(f"volume {name}: unsupported projected source {sorted(src)}")
            return target
        kinds = sorted(k for k in vol if k != "name")
        raise _VolumeError(f"volume {name}: type {', '.join(kinds)} is not supported by the pod runner")

    def _write_source(self, target: Path, src: dict, default_mode: int) -> None:
        """A configMap or secret (volume or projected source) as files."""
        if "configMap" in src:
            ref = src["configMap"]
            data = self._config_map(ref["name"], bool(ref.get("optional")), _VolumeError)
        else:
            ref = src["secret"]
            data = self._secret(ref.get("secretName") or ref.get("name"), bool(ref.get("optional")),
                                _VolumeError)
        if data is None:
            return  # optional and absent: empty
        items = ref.get("items")
        if items is None:
            items = [{"key": k, "path": k} for k in data]
        for item in items:
            if item["key"] not in data:
                if ref.get("optional"):
                    continue
                raise _VolumeError(f"couldn't find key {item['key']} in {ref.get('name') or ref.get('secretName')}")
            _write_file(target / _safe_rel(item["path"]), data[item["key"]],
                        int(item.get("mode") or default_mode))

    def _write_downward(self, target: Path, items: list, default_mode: int) -> None:
        for item in items:
            if "fieldRef" in item:
                value = field_value(self.pod, item["fieldRef"]["fieldPath"], self.ip, self.runner.node_ip)
            elif "resourceFieldRef" in item:
                ref = item["resourceFieldRef"]
                container = next((c for c in (self.pod.get("spec") or {}).get("containers") or []
                                  if c["name"] == ref.get("containerName")), {})
                value = resource_value(container, ref, self.runner.allocatable)
            else:
                continue
            _write_file(target / _safe_rel(item["path"]), value.encode(), int(item.get("mode") or default_mode))

    def _write_token(self, entry: dict) -> None:
        spec = self.pod.get("spec") or {}
        sa = spec.get("serviceAccountName") or "default"
        body = {
            "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
            "spec": {
                "expirationSeconds": entry["seconds"],
                "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": self.pod_name, "uid": self.uid},
            },
        }
        if entry["audience"]:
            body["spec"]["audiences"] = [entry["audience"]]
        try:
            resp = self.api.post(f"/api/v1/namespaces/{self.ns}/serviceaccounts/{sa}/token", body)
        except Exception as e:  # noqa: BLE001
            raise _VolumeError(f"cannot get a token for ServiceAccount {self.ns}/{sa}: "
                               f"{_status_code(e) or type(e).__name__}") from None
        _write_file(entry["path"], resp["status"]["token"].encode(), entry["mode"])
        lifetime = entry["seconds"]
        try:
            expires = dt.datetime.fromisoformat(resp["status"]["expirationTimestamp"].replace("Z", "+00:00"))
            lifetime = max(60.0, (expires - dt.datetime.now(dt.timezone.utc)).total_seconds())
        except (KeyError, ValueError, TypeError):
            pass
        entry["refresh_at"] = time.monotonic() + 0.8 * lifetime

    def _refresh_tokens(self) -> None:
        now = time.monotonic()
        for entry in self.tokens:
            if now >= entry["refresh_at"]:
                try:
                    self._write_token(entry)
                    log.info(_kv("pod.token_refreshed", pod=f"{self.ns}/{self.pod_name}", path=entry["path"]))
                except _VolumeError as e:
                    log.warning(_kv("pod.token_refresh_failed", pod=f"{self.ns}/{self.pod_name}", error=e))
                    entry["refresh_at"] = now + 10

    # -- probes

    def _probe(self, c: _Container, now: float) -> None:
        probe = c.spec.get("readinessProbe")
        if not probe or c.proc is None or now < c.probe_next:
            return
        c.probe_next = now + float(probe.get("periodSeconds") or 10)
        ok = self._run_probe(c, probe)
        if ok:
            c.probe_failures = 0
            c.probe_successes += 1
            if not c.ready and c.probe_successes >= int(probe.get("successThreshold") or 1):
                c.ready = True
                log.info(_kv("container.ready", pod=f"{self.ns}/{self.pod_name}", container=c.name))
        else:
            c.probe_successes = 0
            c.probe_failures += 1
            if c.ready and c.probe_failures >= int(probe.get("failureThreshold") or 3):
                c.ready = False
                log.info(_kv("container.unready", pod=f"{self.ns}/{self.pod_name}", container=c.name))

    def _port(self, c: _Container, port: Any) -> int:
        if isinstance(port, int) or (isinstance(port, str) and port.isdigit()):
            return int(port)
        for p in c.spec.get("ports") or []:
            if p.get("name") == port:
                return int(p["containerPort"])
        raise ValueError(f"no port named {port!r}")

    def _run_probe(self, c: _Container, probe: dict) -> bool:
        timeout = float(probe.get("timeoutSeconds") or 1)
        try:
            if "httpGet" in probe:
                h = probe["httpGet"]
                host = h.get("host") or self.ip
                port = self._port(c, h.get("port"))
                if (h.get("scheme") or "HTTP").upper() == "HTTPS":
                    ctx = ssl._create_unverified_context()  # noqa: S323 - kubelet does not verify either
                    conn = http.client.HTTPSConnection(host, port, timeout=timeout, context=ctx)
                else:
                    conn = http.client.HTTPConnection(host, port, timeout=timeout)
                try:
                    headers = {x["name"]: x["value"] for x in h.get("httpHeaders") or []}
                    headers.setdefault("User-Agent", "kube-probe/podrunner")
                    conn.request("GET", h.get("path") or "/", headers=headers)
                    return 200 <= conn.getresponse().status < 400
                finally:
                    conn.close()
            if "tcpSocket" in probe:
                t = probe["tcpSocket"]
                with socket.create_connection((t.get("host") or self.ip, self._port(c, t.get("port"))),
                                              timeout=timeout):
                    return True
            if "exec" in probe:
                argv = list(probe["exec"].get("command") or [])
                if argv and argv[0] in ("python", "python3"):
                    argv[0] = sys.executable
                result = subprocess.run(
                    ["nsenter", f"--target={c.pid}", "--mount", "--uts", f"--wd={c.workdir}", "--", *argv],
                    env=c.env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL, timeout=timeout,
                )
                return result.returncode == 0
        except Exception:  # noqa: BLE001 - any failure is a failed probe
            return False
        return False

    # -- status

    def _condition(self, ctype: str, ok: bool, reason: str | None = None, message: str | None = None) -> dict:
        status = "True" if ok else "False"
        prev = self.cond_times.get(ctype)
        if prev is None or prev[0] != status:
            self.cond_times[ctype] = (status, _now())
        cond = {"type": ctype, "status": status, "lastTransitionTime": self.cond_times[ctype][1]}
        if not ok and reason:
            cond["reason"] = reason
            if message:
                cond["message"] = message
        return cond

    def _status(self) -> dict:
        current = _g(self.pod, "status", "conditions", default=[])
        scheduled = next((c for c in current if c.get("type") == "PodScheduled"), None)
        managed = {"PodReadyToStartContainers", "Initialized", "Ready", "ContainersReady", "PodScheduled"}
        others = [c for c in current if c.get("type") not in managed]  # e.g. DisruptionTarget
        unready = [c.name for c in self.mains if not c.ready]
        pending_init = [c.name for c in self.inits if not (c.done and c.exit_code == 0)]
        ready_reason = "PodCompleted" if self.terminal else "ContainersNotReady"
        ready_msg = None if self.terminal else f"containers with unready status: [{' '.join(unready)}]"
        conditions = [
            self._condition("PodReadyToStartContainers", self.volumes_ready),
            self._condition("Initialized", self.initialized, "ContainersNotInitialized",
                            f"containers with incomplete status: [{' '.join(pending_init)}]"),
            self._condition("Ready", self.ready, ready_reason, ready_msg),
            self._condition("ContainersReady", self.ready, ready_reason, ready_msg),
            scheduled or {"type": "PodScheduled", "status": "True", "lastTransitionTime": self.start_time},
            *others,
        ]
        status = {
            "phase": self.phase,
            "hostIP": self.runner.node_ip,
            "hostIPs": [{"ip": self.runner.node_ip}],
            "podIP": self.ip,
            "podIPs": [{"ip": self.ip}],
            "startTime": self.start_time,
            "conditions": conditions,
            "containerStatuses": [c.status() for c in self.mains],
        }
        if self.inits:
            status["initContainerStatuses"] = [c.status() for c in self.inits]
        return status

    def _publish(self, force: bool = False) -> None:
        status = self._status()
        if status == self.last_published:
            return
        now = time.monotonic()
        if now < self.next_publish_try and not force:
            return
        try:
            self.api.merge_patch(f"/api/v1/namespaces/{self.ns}/pods/{self.pod_name}/status",
                                 {"metadata": {"uid": self.uid}, "status": status})
            self.last_published = status
        except Exception as e:  # noqa: BLE001 - retried on a later tick
            code = _status_code(e)
            if code == 404:
                self.last_published = status  # gone; the watch will tell us
            else:
                log.warning(_kv("pod.status_patch_failed", pod=f"{self.ns}/{self.pod_name}",
                                error=code or f"{type(e).__name__}: {e}"))
                self.next_publish_try = now + 1.0

    # -- termination

    def _signal_all(self, sig: int, containers: list[_Container]) -> None:
        for c in containers:
            if c.pid is None:
                continue
            try:
                os.killpg(c.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def _kill_all(self, grace: float) -> None:
        """SIGTERM every running container's process group, SIGKILL after `grace` s."""
        running = [c for c in self.inits + self.mains if c.proc is not None]
        if not running:
            return
        if grace > 0:
            self._signal_all(signal.SIGTERM, running)
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline and any(c.proc.poll() is None for c in running):
                if self.delete_deadline is not None and self.delete_deadline < deadline:
                    deadline = self.delete_deadline  # deleted again with a shorter grace
                self.wake.wait(0.1)
                self.wake.clear()
        self._signal_all(signal.SIGKILL, running)
        now = time.monotonic()
        for c in running:
            try:
                c.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                log.warning(_kv("container.unkillable", pod=f"{self.ns}/{self.pod_name}", pid=c.pid))
                continue
            self._on_exit(c, c.proc.returncode, now)

    def _terminate_and_delete(self) -> None:
        grace = max(0.0, self.delete_deadline - time.monotonic())
        log.info(_kv("pod.terminate", pod=f"{self.ns}/{self.pod_name}", grace=f"{grace:.0f}s"))
        self.ready = False
        self.runner._release_ip(self)
        self.runner._refresh_hosts()
        self._kill_all(grace)
        self._update_phase_after_kill()
        self._publish(force=True)
        self._cleanup()
        self.runner._final_delete(self.ns, self.pod_name, self.uid)

    def _update_phase_after_kill(self) -> None:
        if self.phase in TERMINAL or not self.mains:
            return
        if all(c.done for c in self.mains):
            self.phase = "Succeeded" if all(c.exit_code == 0 for c in self.mains) else "Failed"
        self.terminal = True

    def _remove_shm(self) -> None:
        for d in self.shm_dirs:
            shutil.rmtree(d, ignore_errors=True)

    def _cleanup(self) -> None:
        self._remove_shm()
        self.runner._release_ip(self)
        shutil.rmtree(self.dir, ignore_errors=True)
        self.runner._refresh_hosts()


# --------------------------------------------------------------------------- the runner


class PodRunner:
    """Registers node `node` and runs the pods bound to it (see the module docstring)."""

    def __init__(self, kubeconfig: str | os.PathLike, node: str = DEFAULT_NODE,
                 state_dir: str | os.PathLike = DEFAULT_STATE_DIR):
        self.kubeconfig = Path(kubeconfig).resolve()
        self.node = node
        self.state_dir = Path(state_dir).resolve()
        self.pods_dir = self.state_dir / "pods"
        self.node_ip = "127.0.0.1"
        self.allocatable: dict[str, str] = {}
        self.kubelet_port = 0
        self._api: _Api | None = None
        self._base_env: dict[str, str] = {}
        self._lock = threading.RLock()
        self._dns_lock = threading.Lock()
        self._workers: dict[str, _PodWorker] = {}  # uid -> worker (until the pod is gone)
        self._ips: dict[str, str] = {}  # uid -> ip
        self._next_ip = 2
        self._services: dict[tuple[str, str], dict] = {}
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._log_handler: logging.Handler | None = None
        self._log_server: ThreadingHTTPServer | None = None
        self._node_uid: str | None = None
        self._started = False

    # -- public API

    def start(self) -> "PodRunner":
        """Checks isolation support, registers the node and starts the background threads."""
        if self._started:
            return self
        check_isolation()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.pods_dir.mkdir(parents=True, exist_ok=True)
        self._setup_logging()
        self._api = _Api(self.kubeconfig)
        self.node_ip = node_address()
        cpus = os.cpu_count() or 1
        self.allocatable = {"cpu": str(cpus), "memory": str(_meminfo_bytes()), "pods": "110",
                            "nvidia.com/gpu": "0", "ephemeral-storage": str(shutil.disk_usage(self.state_dir).total)}
        self._base_env = self._make_base_env()
        self._stop.clear()
        self._start_log_server()
        try:
            self._register_node()
        except Exception:
            self._stop_log_server()
            raise
        for target, name in ((self._heartbeat_loop, "heartbeat"), (self._pod_loop, "pod-watch"),
                             (self._service_loop, "service-watch")):
            t = threading.Thread(target=target, name=f"podrunner-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        self._started = True
        log.info(_kv("runner.started", node=self.node, node_ip=self.node_ip, kubelet_port=self.kubelet_port,
                     state_dir=self.state_dir, api=self._api.server))
        return self

    def stop(self) -> None:
        """Kills every pod's processes (pods stay as they are in the API) and stops."""
        if not self._started:
            return
        self._stop.set()
        self._api.close_watches()
        with self._lock:
            workers = list(self._workers.values())
        for w in workers:
            w.stop()
        for w in workers:
            w.join(timeout=30)
        for t in self._threads:
            t.join(timeout=15)
        self._threads.clear()
        self._stop_log_server()
        self._api.close()
        self._started = False
        log.info(_kv("runner.stopped", node=self.node))
        if self._log_handler is not None:
            log.removeHandler(self._log_handler)
            self._log_handler.close()
            self._log_handler = None

    def __enter__(self) -> "PodRunner":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def log_path(self, namespace: str, pod: str, container: str | None = None) -> Path | None:
        """The log file of a container of a pod run here (newest pod of that name)."""
        return find_log(self.state_dir, namespace, pod, container)

    # -- setup

    def _setup_logging(self) -> None:
        handler = logging.FileHandler(self.state_dir / "podrunner.log")
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(threadName)s %(message)s"))
        handler.setLevel(logging.INFO)
        log.addHandler(handler)
        if log.level == logging.NOTSET or log.level > logging.INFO:
            log.setLevel(logging.INFO)
        self._log_handler = handler

    def _make_base_env(self) -> dict[str, str]:
        """The runner's environment ("the image"), minus credentials, plus the service env."""
        env = {k: v for k, v in os.environ.items()
               if k != "KUBECONFIG" and not k.startswith("AWS_") and not k.startswith("KUBERNETES_")}
        url = urlsplit(self._api.server)
        host = url.hostname or "127.0.0.1"
        port = str(url.port or 443)
        env.update({
            "KUBERNETES_SERVICE_HOST": host, "KUBERNETES_SERVICE_PORT": port,
            "KUBERNETES_SERVICE_PORT_HTTPS": port, "KUBERNETES_PORT": f"tcp://{host}:{port}",
        })
        for var in ("NO_PROXY", "no_proxy"):
            if any(k.lower() in ("http_proxy", "https_proxy") for k in env):
                env[var] = ",".join(x for x in (env.get(var, ""), host, "127.0.0.0/8", "localhost") if x)
        return env

    # -- node

    def _node_status(self) -> dict:
        now = _now()
        resources = dict(self.allocatable)
        uname = os.uname()

        def cond(ctype: str, status: str, reason: str, message: str) -> dict:
            return {"type": ctype, "status": status, "reason": reason, "message": message,
                    "lastHeartbeatTime": now, "lastTransitionTime": self._cond_since}

        boot_id = ""
        try:
            boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        except OSError:
            pass
        machine_id = ""
        try:
            machine_id = Path("/etc/machine-id").read_text().strip()
        except OSError:
            pass
        return {
            "capacity": resources,
            "allocatable": resources,
            "addresses": [{"type": "InternalIP", "address": self.node_ip},
                          {"type": "Hostname", "address": self.node}],
            "conditions": [
                cond("MemoryPressure", "False", "KubeletHasSufficientMemory", "pod runner"),
                cond("DiskPressure", "False", "KubeletHasNoDiskPressure", "pod runner"),
                cond("PIDPressure", "False", "KubeletHasSufficientPID", "pod runner"),
                cond("Ready", "True", "KubeletReady", "pod runner is posting ready status"),
            ],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": self.kubelet_port}},
            "nodeInfo": {
                "machineID": machine_id, "systemUUID": machine_id, "bootID": boot_id,
                "kernelVersion": uname.release, "osImage": f"{uname.sysname} (pod runner)",
                "containerRuntimeVersion": "runner://0.1", "kubeletVersion": self._kube_version,
                "kubeProxyVersion": "", "operatingSystem": "linux",
                "architecture": {"x86_64": "amd64", "aarch64": "arm64"}.get(uname.machine, uname.machine),
            },
        }

    def _register_node(self) -> None:
        api = self._api
        try:
            self._kube_version = api.get("/version").get("gitVersion", "v0.0.0")
        except Exception as e:  # noqa: BLE001
            raise PodRunnerError(f"cannot reach the API server at {api.server}: {e}") from e
        self._cond_since = _now()
        labels = {"kubernetes.io/hostname": self.node, LOCAL_NODE_LABEL: "true",
                  "kubernetes.io/os": "linux", "kubernetes.io/arch": self._node_status()["nodeInfo"]["architecture"]}
        body = {"apiVersion": "v1", "kind": "Node",
                "metadata": {"name": self.node, "labels": labels},
                "spec": {"taints": [LOCAL_TAINT]},
                "status": self._node_status()}
        try:
            node = api.post("/api/v1/nodes", body)
            log.info(_kv("node.registered", node=self.node))
        except Exception as e:  # noqa: BLE001
            if _status_code(e) != 409:
                raise PodRunnerError(f"cannot register node {self.node}: {e}") from e
            node = api.get(f"/api/v1/nodes/{self.node}")
            annotations = _g(node, "metadata", "annotations", default={})
            if annotations.get("kwok.x-k8s.io/node"):
                raise PodRunnerError(f"node {self.node} is managed by KWOK; pick another --node name")
            taints = [t for t in _g(node, "spec", "taints", default=[])
                      if not t.get("key", "").startswith("node.kubernetes.io/")]
            if not any(t.get("key") == LOCAL_TAINT["key"] for t in taints):
                taints.append(LOCAL_TAINT)
            node = api.merge_patch(f"/api/v1/nodes/{self.node}",
                                   {"metadata": {"labels": labels}, "spec": {"taints": taints}})
            node = api.merge_patch(f"/api/v1/nodes/{self.node}/status", {"status": self._node_status()})
            log.info(_kv("node.reused", node=self.node))
        self._node_uid = node["metadata"]["uid"]
        self._renew_lease()

    def _renew_lease(self) -> None:
        api = self._api
        path = f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NAMESPACE}/leases/{self.node}"
        spec = {"holderIdentity": self.node, "leaseDurationSeconds": LEASE_DURATION_S,
                "renewTime": _now_micro()}
        try:
            api.merge_patch(path, {"spec": spec})
        except Exception as e:  # noqa: BLE001
            if _status_code(e) != 404:
                raise
            owner = [{"apiVersion": "v1", "kind": "Node", "name": self.node, "uid": self._node_uid}]
            api.post(f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NAMESPACE}/leases",
                     {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                      "metadata": {"name": self.node, "namespace": LEASE_NAMESPACE, "ownerReferences": owner},
                      "spec": spec})

    def _heartbeat_loop(self) -> None:
        next_status = time.monotonic() + NODE_STATUS_S
        while not self._stop.wait(LEASE_RENEW_S):
            try:
                self._renew_lease()
                if time.monotonic() >= next_status:
                    try:
                        self._api.merge_patch(f"/api/v1/nodes/{self.node}/status",
                                              {"status": self._node_status()})
                    except Exception as e:  # noqa: BLE001
                        if _status_code(e) != 404:
                            raise
                        log.warning(_kv("node.missing", node=self.node, action="re-register"))
                        self._register_node()
                    next_status = time.monotonic() + NODE_STATUS_S
            except Exception as e:  # noqa: BLE001
                if not self._stop.is_set():
                    log.warning(_kv("node.heartbeat_failed", node=self.node, error=f"{type(e).__name__}: {e}"))

    # -- watches

    def _watch_loop(self, path: str, query: list, on_list: Callable[[list], None],
                    on_event: Callable[[str, dict], None], what: str) -> None:
        """List, then watch from the list's resourceVersion; relist on any trouble."""
        failures = 0
        while not self._stop.is_set():
            try:
                listing = self._api.get(path, query=query)
                rv = listing["metadata"]["resourceVersion"]
                on_list(listing.get("items") or [])
                failures = 0
                while not self._stop.is_set():
                    relist = False
                    for event in self._api.watch(path, query + [("resourceVersion", rv),
                                                               ("allowWatchBookmarks", "true")], 60):
                        etype, obj = event.get("type"), event.get("object") or {}
                        if etype == "ERROR":
                            relist = True  # 410 Gone and friends
                            break
                        rv = _g(obj, "metadata", "resourceVersion", default=rv)
                        if etype != "BOOKMARK":
                            on_event(etype, obj)
                    if relist:
                        break
            except Exception as e:  # noqa: BLE001
                if self._stop.is_set():
                    return
                failures += 1
                level = logging.DEBUG if failures == 1 else logging.WARNING
                log.log(level, _kv("watch.failed", what=what, error=f"{type(e).__name__}: {e}"))
                self._stop.wait(min(5.0, 0.5 * failures))

    def _pod_loop(self) -> None:
        self._watch_loop("/api/v1/pods", [("fieldSelector", f"spec.nodeName={self.node}")],
                         self._on_pod_list, self._on_pod_event, "pods")

    def _service_loop(self) -> None:
        self._watch_loop("/api/v1/services", [], self._on_service_list, self._on_service_event, "services")

    def _on_service_list(self, items: list) -> None:
        with self._lock:
            self._services = {(s["metadata"]["namespace"], s["metadata"]["name"]): s for s in items}
        self._refresh_hosts()

    def _on_service_event(self, etype: str, svc: dict) -> None:
        key = (svc["metadata"]["namespace"], svc["metadata"]["name"])
        with self._lock:
            if etype == "DELETED":
                self._services.pop(key, None)
            else:
                self._services[key] = svc
        self._refresh_hosts()

    def _on_pod_list(self, items: list) -> None:
        seen = {p["metadata"]["uid"] for p in items}
        with self._lock:
            gone = [w for uid, w in self._workers.items() if uid not in seen]
        for w in gone:
            self._on_pod_event("DELETED", w.pod)
        for pod in items:
            self._on_pod_event("MODIFIED", pod)

    def _on_pod_event(self, etype: str, pod: dict) -> None:
        if self._stop.is_set():
            return
        meta = pod.get("metadata") or {}
        uid = meta.get("uid")
        if _g(pod, "spec", "nodeName") != self.node or not uid:
            return
        with self._lock:
            worker = self._workers.get(uid)
            if etype == "DELETED":
                if worker is not None:
                    self._workers.pop(uid, None)
                    worker.remove()
                return
            if worker is not None:
                if worker.finished.is_set() and meta.get("deletionTimestamp"):
                    self._workers.pop(uid, None)  # finished already; only the final delete left
                    threading.Thread(target=self._final_delete, args=(meta["namespace"], meta["name"], uid),
                                     daemon=True).start()
                else:
                    worker.update(pod)
                return
            phase = _g(pod, "status", "phase", default="Pending")
            if meta.get("deletionTimestamp"):
                # Never ran here (or ran under a previous runner): nothing to stop.
                threading.Thread(target=self._final_delete, args=(meta["namespace"], meta["name"], uid),
                                 daemon=True).start()
                return
            if phase in TERMINAL:
                return
            if _g(pod, "status", "startTime") or _g(pod, "status", "containerStatuses"):
                threading.Thread(target=self._mark_node_restart, args=(pod,), daemon=True).start()
                return
            ip = self._allocate_ip(uid)
            if ip is None:
                log.warning(_kv("pod.no_ip", pod=f"{meta['namespace']}/{meta['name']}"))
                return
            worker = _PodWorker(self, pod, ip)
            self._workers[uid] = worker
        worker.start()

    def _mark_node_restart(self, pod: dict) -> None:
        """A pod this runner did not start but that was started here: its processes are gone."""
        meta = pod["metadata"]
        now = _now()
        message = "the pod runner restarted; the pod's processes are gone"
        spec = pod.get("spec") or {}
        existing = {s["name"]: s for s in _g(pod, "status", "containerStatuses", default=[])}
        statuses = []
        for c in spec.get("containers") or []:
            old = existing.get(c["name"], {})
            state = old.get("state") or {}
            if "terminated" in state:
                statuses.append({**old, "ready": False, "started": False})
                continue
            terminated = {"exitCode": 137, "reason": "NodeRestart", "message": message,
                          "startedAt": _g(state, "running", "startedAt", default=now), "finishedAt": now}
            if old.get("containerID"):
                terminated["containerID"] = old["containerID"]
            statuses.append({"name": c["name"], "image": c.get("image", ""), "imageID": "",
                             "ready": False, "started": False, "restartCount": old.get("restartCount", 0),
                             "state": {"terminated": terminated}, "lastState": old.get("lastState") or {},
                             **({"containerID": old["containerID"]} if old.get("containerID") else {})})
        conditions = []
        for cond in _g(pod, "status", "conditions", default=[]):
            if cond.get("type") in ("Ready", "ContainersReady") and cond.get("status") == "True":
                cond = {**cond, "status": "False", "reason": "PodFailed", "lastTransitionTime": now}
            conditions.append(cond)
        try:
            self._api.merge_patch(f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status",
                                  {"metadata": {"uid": meta["uid"]},
                                   "status": {"phase": "Failed", "reason": "NodeRestart", "message": message,
                                              "conditions": conditions, "containerStatuses": statuses}})
            log.info(_kv("pod.node_restart", pod=f"{meta['namespace']}/{meta['name']}"))
        except Exception as e:  # noqa: BLE001
            log.warning(_kv("pod.node_restart_failed", pod=f"{meta['namespace']}/{meta['name']}", error=e))

    def _final_delete(self, ns: str, name: str, uid: str) -> None:
        """The kubelet's last word: delete the pod object now that nothing runs."""
        for d in self.pods_dir.glob(f"{ns}_{name}_{uid}"):
            shutil.rmtree(d, ignore_errors=True)
        try:
            self._api.delete(f"/api/v1/namespaces/{ns}/pods/{name}",
                             {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0,
                              "preconditions": {"uid": uid}})
            log.info(_kv("pod.deleted", pod=f"{ns}/{name}"))
        except Exception as e:  # noqa: BLE001
            if _status_code(e) not in (404, 409):
                log.warning(_kv("pod.delete_failed", pod=f"{ns}/{name}", error=e))

    def _worker_done(self, worker: _PodWorker) -> None:
        with self._lock:
            if worker.removed or worker.delete_deadline is not None:
                if self._workers.get(worker.uid) is worker:
                    self._workers.pop(worker.uid, None)
        self._release_ip(worker)

    # -- IPs and DNS

    def _allocate_ip(self, uid: str) -> str | None:
        with self._lock:
            used = set(self._ips.values())
            for i in range(253):
                x = 2 + (self._next_ip - 2 + i) % 253
                ip = f"127.0.0.{x}"
                if ip not in used:
                    self._ips[uid] = ip
                    self._next_ip = x + 1 if x < 254 else 2
                    return ip
        return None

    def _release_ip(self, worker: _PodWorker) -> None:
        with self._lock:
            if self._ips.get(worker.uid) == worker.ip:
                del self._ips[worker.uid]

    def _refresh_hosts(self) -> None:
        """Rewrites every live pod's hosts file (in place) from pods and Services."""
        with self._dns_lock:
            with self._lock:
                workers = [w for w in self._workers.values() if w.live]
                services = list(self._services.items())
            entries: list[tuple[str, str, list[str], list[str]]] = []
            for w in workers:
                if w.subdomain:
                    base = f"{w.hostname}.{w.subdomain}.{w.ns}"
                    entries.append((w.ip, w.ns, [f"{base}.svc.cluster.local", f"{base}.svc", base],
                                    [f"{w.hostname}.{w.subdomain}"]))
            for (ns, name), svc in sorted(services, key=lambda kv: kv[0]):
                spec = svc.get("spec") or {}
                selector = spec.get("selector") or {}
                if spec.get("clusterIP") != "None" or not selector:
                    continue
                for w in workers:
                    labels = _g(w.pod, "metadata", "labels", default={})
                    if w.ns == ns and (w.ready or spec.get("publishNotReadyAddresses")) and all(
                            labels.get(k) == v for k, v in selector.items()):
                        entries.append((w.ip, ns, [f"{name}.{ns}.svc.cluster.local", f"{name}.{ns}.svc",
                                                   f"{name}.{ns}"], [name]))
            for w in workers:
                lines = ["# Managed by the pod runner (e2e/podrunner.py).",
                         "127.0.0.1\tlocalhost", "::1\tip6-localhost ip6-loopback"]
                own = [f"{w.hostname}.{w.subdomain}.{w.ns}.svc.cluster.local"] if w.subdomain else []
                lines.append(f"{w.ip}\t{' '.join(own + [w.hostname])}")
                for alias in _g(w.pod, "spec", "hostAliases", default=[]):
                    if alias.get("ip") and alias.get("hostnames"):
                        lines.append(f"{alias['ip']}\t{' '.join(alias['hostnames'])}")
                for ip, ns, names, short in entries:
                    lines.append(f"{ip}\t{' '.join(names + (short if ns == w.ns else []))}")
                w.write_hosts("\n".join(lines) + "\n")

    # -- kubelet log endpoint

    def _start_log_server(self) -> None:
        cert, key = self.state_dir / "kubelet.crt", self.state_dir / "kubelet.key"
        _self_signed(cert, key, self.node, self.node_ip)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(cert, key)
        runner = self

        class Handler(_LogHandler):
            pass

        Handler.runner = runner
        try:
            server = ThreadingHTTPServer((self.node_ip, 0), Handler)
        except OSError as e:
            log.warning(_kv("kubelet_server.unavailable", error=e))
            return
        server.daemon_threads = True
        server.handle_error = lambda request, address: log.debug(_kv("kubelet_server.error", peer=address))
        # Handshakes happen in the handler threads, not in the accept loop.
        server.socket = ctx.wrap_socket(server.socket, server_side=True, do_handshake_on_connect=False)
        self.kubelet_port = server.server_address[1]
        self._log_server = server
        t = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.5},
                             name="podrunner-kubelet-server", daemon=True)
        t.start()

    def _stop_log_server(self) -> None:
        if self._log_server is not None:
            self._log_server.shutdown()
            self._log_server.server_close()
            self._log_server = None

    def _container_running(self, ns: str, pod: str, container: str) -> bool:
        with self._lock:
            for w in self._workers.values():
                if w.ns == ns and w.pod_name == pod and not w.finished.is_set():
                    return any(c.name == container and (c.proc is not None or not c.done)
                               for c in w.inits + w.mains)
        return False


def _self_signed(cert_path: Path, key_path: Path, node: str, ip: str) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{node}@podrunner")])
    now = dt.datetime.now(dt.timezone.utc)
    sans = [x509.DNSName(node), x509.IPAddress(ipaddress.ip_address(ip))]
    if ip != "127.0.0.1":
        sans.append(x509.IPAddress(ipaddress.ip_address("127.0.0.1")))
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=365))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .sign(key, hashes.SHA256()))
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


class _LogHandler(BaseHTTPRequestHandler):
    """The kubelet's /containerLogs endpoint (what `kubectl logs` reaches via the API server)."""

    runner: PodRunner
    server_version = "podrunner"

    def setup(self) -> None:
        self.request.settimeout(30)
        self.request.do_handshake()
        super().setup()

    def log_message(self, fmt: str, *args: Any) -> None:  # quiet
        log.debug("kubelet-server " + fmt, *args)

    def _reply(self, code: int, text: str) -> None:
        data = text.encode()
        self.send_response(code)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 - http.server API
        url = urlsplit(self.path)
        parts = [p for p in url.path.split("/") if p]
        if parts == ["healthz"]:
            return self._reply(200, "ok")
        if len(parts) != 4 or parts[0] != "containerLogs":
            return self._reply(404, "not found")
        _, ns, pod, container = parts
        q = parse_qs(url.query)
        path = self.runner.log_path(ns, pod, container)
        if path is None:
            return self._reply(404, f"no logs for container {container!r} of pod {ns}/{pod} on this node")
        try:
            tail = int(q.get("tailLines", ["-1"])[0])
            limit = int(q.get("limitBytes", ["-1"])[0])
        except ValueError:
            return self._reply(400, "bad tailLines/limitBytes")
        follow = q.get("follow", ["false"])[0] in ("true", "1")
        try:
            data = path.read_bytes()
        except OSError:
            return self._reply(404, "log gone")
        if tail >= 0:
            lines = data.splitlines(keepends=True)
            data = b"".join(lines[-tail:]) if tail else b""
        if limit >= 0:
            data = data[:limit]
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.end_headers()
        try:
            self.wfile.write(data)
            self.wfile.flush()
            if not follow:
                return
            sent = len(data)
            offset = path.stat().st_size
            stop = self.runner._stop
            while not stop.is_set() and (limit < 0 or sent < limit):
                try:
                    size = path.stat().st_size
                except OSError:
                    return
                if size > offset:
                    with open(path, "rb") as f:
                        f.seek(offset)
                        chunk = f.read(size - offset)
                    offset = size
                    if limit >= 0:
                        chunk = chunk[:limit - sent]
                    self.wfile.write(chunk)
                    self.wfile.flush()
                    sent += len(chunk)
                elif not self.runner._container_running(ns, pod, container):
                    return
                else:
                    stop.wait(0.2)
        except (BrokenPipeError, ConnectionResetError, ssl.SSLError):
            return


# --------------------------------------------------------------------------- logs helper


def find_log(state_dir: str | os.PathLike, namespace: str, pod: str, container: str | None = None) -> Path | None:
    """`<state>/pods/<ns>_<pod>_<uid>/<container>.log` of the newest such pod dir.

    Without a container name, the only container's log (None when there are several).
    """
    dirs = sorted(Path(state_dir, "pods").glob(f"{glob_escape(namespace)}_{glob_escape(pod)}_*"),
                  key=lambda p: p.stat().st_mtime, reverse=True)
    for d in dirs:
        if d.name.count("_") != 2:
            continue
        if container:
            path = d / f"{container}.log"
            if path.exists():
                return path
            continue
        logs = sorted(d.glob("*.log"))
        if len(logs) == 1:
            return logs[0]
    return None


def glob_escape(text: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", text)


def _logs_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.podrunner logs",
                                     description="Print a container's log of a pod run by the pod runner.")
    parser.add_argument("pod", help="NAMESPACE/POD")
    parser.add_argument("container", nargs="?", help="container (default: the only one)")
    parser.add_argument("-f", "--follow", action="store_true", help="keep printing new output")
    parser.add_argument("--state-dir", default=os.environ.get("RFT_PODRUNNER_STATE_DIR", DEFAULT_STATE_DIR))
    args = parser.parse_args(argv)
    if "/" not in args.pod:
        parser.error("pod must be NAMESPACE/POD")
    ns, name = args.pod.split("/", 1)
    path = find_log(args.state_dir, ns, name, args.container)
    if path is None:
        pod_dirs = list(Path(args.state_dir, "pods").glob(f"{glob_escape(ns)}_{glob_escape(name)}_*"))
        containers = sorted({p.stem for d in pod_dirs for p in d.glob("*.log")})
        hint = f" (containers: {', '.join(containers)})" if containers else ""
        print(f"error: no log for {args.pod}{' container ' + args.container if args.container else ''}"
              f" under {Path(args.state_dir) / 'pods'}{hint}", file=sys.stderr)
        return 1
    out = sys.stdout.buffer
    with open(path, "rb") as f:
        while True:
            chunk = f.read(65536)
            if chunk:
                out.write(chunk)
                out.flush()
            elif args.follow:
                time.sleep(0.3)
            else:
                return 0


# --------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "logs":
        return _logs_main(argv[1:])
    if argv and argv[0] == "run":
        argv = argv[1:]
    parser = argparse.ArgumentParser(prog="python -m e2e.podrunner",
                                     description=__doc__.split("\n")[0],
                                     epilog="Also: python -m e2e.podrunner logs NAMESPACE/POD [CONTAINER]")
    parser.add_argument("--kubeconfig", default=os.environ.get("KUBECONFIG"),
                        help="admin kubeconfig of the cluster (default: $KUBECONFIG)")
    parser.add_argument("--node", default=DEFAULT_NODE, help="node name (default: %(default)s)")
    parser.add_argument("--state-dir", default=os.environ.get("RFT_PODRUNNER_STATE_DIR", DEFAULT_STATE_DIR),
                        help="pod directories, logs and the runner's log (default: %(default)s)")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    args = parser.parse_args(argv)
    if not args.kubeconfig:
        parser.error("--kubeconfig (or $KUBECONFIG) is required")
    stderr = logging.StreamHandler(sys.stderr)
    stderr.setFormatter(logging.Formatter("[podrunner] %(levelname)s %(message)s"))
    log.addHandler(stderr)
    log.setLevel(logging.DEBUG if args.verbose else logging.INFO)
    log.propagate = False

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    runner = PodRunner(args.kubeconfig, node=args.node, state_dir=args.state_dir)
    try:
        runner.start()
    except PodRunnerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    log.info(_kv("runner.ready", logs=runner.state_dir / "pods", hint="python -m e2e.podrunner logs NS/POD"))
    try:
        stop.wait()
    finally:
        runner.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
