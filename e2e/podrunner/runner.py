"""`PodRunner`: registers the node, watches its pods and Services, runs a worker per pod."""

from __future__ import annotations

import logging
import os
import shutil
import threading
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlsplit

from .api import _Api, _status_code
from .common import DEFAULT_NODE, DEFAULT_STATE_DIR, TERMINAL, _g, _kv, log
from .dns import build_hosts_files
from .logserver import _LogServerMixin, find_log
from .node import _NodeMixin, _meminfo_bytes, node_address
from .process import check_isolation
from .status import mark_node_restart
from .worker import _PodWorker


class PodRunner(_NodeMixin, _LogServerMixin):
    """Registers node `node` and runs the pods bound to it (see the package docstring)."""

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
                threading.Thread(target=mark_node_restart, args=(self._api, pod), daemon=True).start()
                return
            ip = self._allocate_ip(uid)
            if ip is None:
                log.warning(_kv("pod.no_ip", pod=f"{meta['namespace']}/{meta['name']}"))
                return
            worker = _PodWorker(self, pod, ip)
            self._workers[uid] = worker
        worker.start()

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
            for w, content in build_hosts_files(workers, services):
                w.write_hosts(content)

    # -- for the kubelet log endpoint

    def _container_running(self, ns: str, pod: str, container: str) -> bool:
        with self._lock:
            for w in self._workers.values():
                if w.ns == ns and w.pod_name == pod and not w.finished.is_set():
                    return any(c.name == container and (c.proc is not None or not c.done)
                               for c in w.inits + w.mains)
        return False
