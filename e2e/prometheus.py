"""A real Prometheus as a host process that scrapes the operator and evaluates its alert
rules, for the integration test of the alerts (tests/integration/test_prometheus.py), and
that finds the operator and the jobs' pods through the API server in the end-to-end test
(tests/e2e/test_rftjob.py: `monitor_scrape_config` turns the monitoring component's
ServiceMonitor and PodMonitor into the scrape jobs prometheus-operator would generate, as
no prometheus-operator runs here).

The server from Debian's `prometheus` package at the pinned version (`bash
e2e/build-binaries.sh promtool` keeps it beside promtool; PROMETHEUS_DEB_VERSION in
versions.env), and nothing of a cluster install:

* One static scrape job named `rftjob-operator-metrics`, the name the rules' `up{job=...}`
  use (the ServiceMonitor's in a cluster), with `honor_labels: true` as the ServiceMonitor
  has it: the per-job series carry the RFTJob's namespace and name as `namespace` and
  `job`, which a scrape would otherwise rename to `exported_*`.
* The rule groups of manifests/monitoring/prometheusrule.yaml unchanged: the
  PrometheusRule's `spec` is a plain rules file (`groups:`).
* Scrape and rule evaluation every second, storage in the state dir, the web API on a free
  loopback port.

    prom = PrometheusProcess(state_dir, target="127.0.0.1:9090")
    prom.start()             # returns once /-/ready answers
    prom.query('up{job="rftjob-operator-metrics"}')   # the instant vector's samples
    prom.alerts()            # pending and firing alerts
    prom.wait_alert("RFTJobStalled", {"namespace": "ns", "job": "j"}, timeout=60)
    prom.log_path; prom.stop()
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable

import yaml

from .host import REPO_ROOT, cached_binary, free_port, log_tail, stop_group

SCRAPE_JOB = "rftjob-operator-metrics"  # the rules' up{job=...} and the ServiceMonitor's job
RULES = REPO_ROOT / "manifests" / "monitoring" / "prometheusrule.yaml"
INTERVAL = "1s"  # scrape and evaluation: an alert's expression is seen within seconds


class PrometheusError(RuntimeError):
    """Prometheus could not be found or started, or did not answer as expected."""


def locate_binary() -> Path:
    return cached_binary("prometheus", "PROMETHEUS_DEB_VERSION", "prometheus", "promtool", PrometheusError)


# --------------------------------------------------------------------------- pure


def build_rule_file(prometheus_rule: dict[str, Any]) -> dict[str, Any]:
    """A PrometheusRule's `spec` is a rules file: `{groups: [...]}`."""
    spec = prometheus_rule.get("spec") or {}
    if prometheus_rule.get("kind") != "PrometheusRule" or not spec.get("groups"):
        raise ValueError("not a PrometheusRule with spec.groups")
    return {"groups": spec["groups"]}


def build_config(target: str | None, rule_files: list[str],
                 scrape_configs: list[dict[str, Any]] = ()) -> dict[str, Any]:
    """prometheus.yml: one static job scraping `target` (host:port; None: none) with the
    operator's own `namespace` and `job` labels kept, `scrape_configs` besides, and the
    given rule files."""
    static = [] if target is None else [{"job_name": SCRAPE_JOB, "honor_labels": True,
                                          "static_configs": [{"targets": [target]}]}]
    return {
        "global": {"scrape_interval": INTERVAL, "evaluation_interval": INTERVAL},
        "rule_files": rule_files,
        "scrape_configs": static + list(scrape_configs),
    }


# The parts of prometheus-operator's ServiceMonitor and PodMonitor that monitor_scrape_config
# understands; anything else in a monitor is refused, not silently dropped.
_MONITOR_KEYS = {"selector", "namespaceSelector", "endpoints", "podMetricsEndpoints"}
_ENDPOINT_KEYS = {"port", "path", "interval", "honorLabels", "relabelings"}
_RELABEL_KEYS = {"sourceLabels": "source_labels", "targetLabel": "target_label", "regex": "regex",
                 "replacement": "replacement", "action": "action", "separator": "separator"}


def _label(name: str) -> str:
    """A Kubernetes label key as Prometheus' discovery names it (`rft.dev/role` -> `rft_dev_role`)."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def monitor_scrape_config(monitor: dict[str, Any], discovery_url: str, interval: str | None = None) -> dict[str, Any]:
    """The scrape job prometheus-operator (v0.85) generates for a ServiceMonitor or PodMonitor
    with one endpoint, for a Prometheus outside the cluster: targets from Kubernetes service
    discovery (role `endpoints` or `pod`; served over HTTP SD at `discovery_url` by
    `KubernetesDiscovery`, as Debian's Prometheus is built without Kubernetes discovery),
    keep the targets the selector and
    endpoint port select, running pods only, label them `namespace`, `pod`, `container`
    (`service`, and `job` = the Service's name, for a ServiceMonitor; `job` =
    `<namespace>/<name>` for a PodMonitor) and apply the endpoint's relabelings.
    `interval` overrides the endpoint's (tests scrape every second). Fields this does not
    model raise ValueError, so a monitor that grows one is not tested as something else."""
    kind, meta, spec = monitor.get("kind"), monitor["metadata"], monitor.get("spec") or {}
    if kind not in ("ServiceMonitor", "PodMonitor"):
        raise ValueError(f"{kind} is not a ServiceMonitor or PodMonitor")
    pod = kind == "PodMonitor"
    endpoints = spec.get("podMetricsEndpoints" if pod else "endpoints") or []
    extra = set(spec) - _MONITOR_KEYS or {k for e in endpoints for k in e if k not in _ENDPOINT_KEYS}
    if extra or len(endpoints) != 1:
        raise ValueError(f"{kind} {meta['name']}: unsupported here: {sorted(extra) or f'{len(endpoints)} endpoints'}")
    endpoint, selector = endpoints[0], spec.get("selector") or {}
    meta_prefix = "__meta_kubernetes_pod" if pod else "__meta_kubernetes_service"
    relabel: list[dict[str, Any]] = []
    for key, value in (selector.get("matchLabels") or {}).items():
        relabel.append({"action": "keep", "regex": f"({value});true", "source_labels": [
            f"{meta_prefix}_label_{_label(key)}", f"{meta_prefix}_labelpresent_{_label(key)}"]})
    for expr in selector.get("matchExpressions") or []:
        if expr["operator"] != "Exists":
            raise ValueError(f"{kind} {meta['name']}: matchExpressions operator {expr['operator']} unsupported here")
        relabel.append({"action": "keep", "regex": "true",
                        "source_labels": [f"{meta_prefix}_labelpresent_{_label(expr['key'])}"]})
    port_label = "__meta_kubernetes_pod_container_port_name" if pod else "__meta_kubernetes_endpoint_port_name"
    relabel += [
        {"action": "keep", "source_labels": [port_label], "regex": endpoint["port"]},
        {"action": "drop", "source_labels": ["__meta_kubernetes_pod_phase"], "regex": "(Failed|Succeeded)"},
        {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
        {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
        {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
    ]
    if pod:
        relabel.append({"target_label": "job", "replacement": f"{meta['namespace']}/{meta['name']}"})
    else:
        relabel += [{"source_labels": ["__meta_kubernetes_service_name"], "target_label": "service"},
                    {"source_labels": ["__meta_kubernetes_service_name"], "target_label": "job"}]
    relabel.append({"target_label": "endpoint", "replacement": endpoint["port"]})
    for r in endpoint.get("relabelings") or []:
        if set(r) - set(_RELABEL_KEYS):
            raise ValueError(f"{kind} {meta['name']}: relabeling fields {sorted(set(r) - set(_RELABEL_KEYS))} "
                             "unsupported here")
        relabel.append({_RELABEL_KEYS[k]: v for k, v in r.items()})
    namespaces = spec.get("namespaceSelector") or {}
    query = "" if namespaces.get("any") else "?" + urllib.parse.urlencode(
        {"namespaces": ",".join(namespaces.get("matchNames") or [meta["namespace"]])})
    sd = {"url": f"{discovery_url}/{'pod' if pod else 'endpoints'}{query}", "refresh_interval": interval or "30s"}
    return {"job_name": f"{'podMonitor' if pod else 'serviceMonitor'}/{meta['namespace']}/{meta['name']}/0",
            "honor_labels": bool(endpoint.get("honorLabels")),
            "scrape_interval": interval or endpoint.get("interval") or INTERVAL,
            "metrics_path": endpoint.get("path") or "/metrics",
            "http_sd_configs": [sd], "relabel_configs": relabel}


# --------------------------------------------------------------------------- discovery


def _meta_labels(prefix: str, labels: dict[str, str] | None) -> dict[str, str]:
    out = {}
    for key, value in (labels or {}).items():
        out[f"{prefix}_label_{_label(key)}"] = value
        out[f"{prefix}_labelpresent_{_label(key)}"] = "true"
    return out


def _pod_meta(pod: dict[str, Any]) -> dict[str, str]:
    meta, status = pod["metadata"], pod.get("status") or {}
    return {"__meta_kubernetes_namespace": meta["namespace"], "__meta_kubernetes_pod_name": meta["name"],
            "__meta_kubernetes_pod_ip": status.get("podIP") or "",
            "__meta_kubernetes_pod_phase": status.get("phase") or "",
            **_meta_labels("__meta_kubernetes_pod", meta.get("labels"))}


def pod_targets(pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Kubernetes discovery's role `pod` for pods as the API serves them (camelCase): one
    target per declared container port of each pod with an IP, with the
    `__meta_kubernetes_pod_*` labels Prometheus' own discovery gives it."""
    groups = []
    for pod in pods:
        ip = (pod.get("status") or {}).get("podIP")
        if not ip:
            continue
        for container in pod["spec"]["containers"]:
            for port in container.get("ports") or []:
                groups.append({"targets": [f"{ip}:{port['containerPort']}"], "labels": {
                    **_pod_meta(pod), "__meta_kubernetes_pod_container_name": container["name"],
                    "__meta_kubernetes_pod_container_port_name": port.get("name", ""),
                    "__meta_kubernetes_pod_container_port_number": str(port["containerPort"])}})
    return groups


def endpoints_targets(services: list[dict[str, Any]], slices: list[dict[str, Any]],
                      pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Kubernetes discovery's role `endpoints` (read from EndpointSlices): one target per
    ready address and port of each Service, with the Service's labels and, for an address
    backed by a pod, the pod's and its container's."""
    by_service = {(s["metadata"]["namespace"], s["metadata"]["name"]): s for s in services}
    by_pod = {(p["metadata"]["namespace"], p["metadata"]["name"]): p for p in pods}
    groups = []
    for sl in slices:
        ns = sl["metadata"]["namespace"]
        service = by_service.get((ns, (sl["metadata"].get("labels") or {}).get("kubernetes.io/service-name")))
        if service is None:
            continue
        for endpoint in sl.get("endpoints") or []:
            ref = endpoint.get("targetRef") or {}
            pod = by_pod.get((ns, ref.get("name"))) if ref.get("kind") == "Pod" else None
            for port in sl.get("ports") or []:
                for address in endpoint.get("addresses") or []:
                    labels = {"__meta_kubernetes_namespace": ns,
                              "__meta_kubernetes_service_name": service["metadata"]["name"],
                              **_meta_labels("__meta_kubernetes_service", service["metadata"].get("labels")),
                              "__meta_kubernetes_endpoint_port_name": port.get("name") or "",
                              "__meta_kubernetes_endpoint_ready": str(
                                  (endpoint.get("conditions") or {}).get("ready", True)).lower()}
                    if pod is not None:
                        labels.update(_pod_meta(pod))
                        container = next((c["name"] for c in pod["spec"]["containers"]
                                          for p in c.get("ports") or [] if p["containerPort"] == port["port"]), "")
                        labels["__meta_kubernetes_pod_container_name"] = container
                    groups.append({"targets": [f"{address}:{port['port']}"], "labels": labels})
    return groups


class KubernetesDiscovery:
    """Prometheus' Kubernetes service discovery, roles `pod` and `endpoints`, served as HTTP
    SD from the test process (`/pod`, `/endpoints`, `?namespaces=a,b`), read from the API
    server with `api` (a kubernetes ApiClient) on each of Prometheus' refreshes."""

    def __init__(self, api) -> None:
        import kubernetes

        self.core = kubernetes.client.CoreV1Api(api)
        self.discovery = kubernetes.client.DiscoveryV1Api(api)
        self.serialize = api.sanitize_for_serialization
        self.server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        assert self.server is not None, "not started"
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def targets(self, role: str, namespaces: list[str]) -> list[dict[str, Any]]:
        def listed(namespaced, every) -> list[dict[str, Any]]:
            items = ([x for ns in namespaces for x in namespaced(ns).items] if namespaces else every().items)
            return [self.serialize(x) for x in items]

        pods = listed(self.core.list_namespaced_pod, self.core.list_pod_for_all_namespaces)
        if role == "pod":
            return pod_targets(pods)
        services = listed(self.core.list_namespaced_service, self.core.list_service_for_all_namespaces)
        slices = listed(self.discovery.list_namespaced_endpoint_slice,
                        self.discovery.list_endpoint_slice_for_all_namespaces)
        return endpoints_targets(services, slices, pods)

    def start(self) -> "KubernetesDiscovery":
        discovery = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                url = urllib.parse.urlsplit(self.path)
                role = url.path.strip("/")
                namespaces = [n for n in (urllib.parse.parse_qs(url.query).get("namespaces") or [""])[0].split(",")
                              if n]
                if role not in ("pod", "endpoints"):
                    self.send_error(404, f"no role {role!r}: pod or endpoints")
                    return
                try:
                    body = json.dumps(discovery.targets(role, namespaces)).encode()
                except Exception as e:  # noqa: BLE001 - Prometheus keeps the last targets and logs this
                    self.send_error(502, f"listing from the API server: {e}")
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, name="kubernetes-sd", daemon=True).start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    def __enter__(self) -> "KubernetesDiscovery":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def matches(alert: dict[str, Any], name: str, labels: dict[str, str], state: str) -> bool:
    """Whether an alert of /api/v1/alerts is `name` in `state` with (at least) `labels`."""
    have = alert.get("labels") or {}
    return (have.get("alertname") == name and alert.get("state") == state
            and all(have.get(k) == v for k, v in labels.items()))


def _wait(predicate: Callable[[], Any], timeout: float, what: str, died: Callable[[], str | None]) -> Any:
    """Polls `predicate` until it returns something truthy, and returns that; fails at once
    with `died()`'s message."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while True:
        message = died()
        if message:
            raise PrometheusError(message)
        try:
            value = predicate()
            if value:
                return value
        except Exception as e:  # noqa: BLE001 - not yet; reported on timeout
            last = e
        if time.monotonic() > deadline:
            raise PrometheusError(f"timed out after {timeout:.0f}s waiting for {what}"
                                  + (f" (last error: {last})" if last else ""))
        time.sleep(0.5)


# --------------------------------------------------------------------------- process


class PrometheusProcess:
    """Prometheus on the host, scraping `target` (host:port of the operator's /metrics)."""

    def __init__(self, state_dir: str | os.PathLike, target: str | None, rules: Path = RULES,
                 scrape_configs: list[dict[str, Any]] = ()):
        self.state_dir, self.target, self.rules = Path(state_dir), target, rules
        self.scrape_configs = list(scrape_configs)
        self.binary = locate_binary()
        self.log_path = self.state_dir / "prometheus.log"
        self.config_path = self.state_dir / "prometheus.yml"
        self.rules_path = self.state_dir / "rules.yml"
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self._http = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- lifecycle

    def start(self, timeout: float = 60) -> None:
        """Writes the rules and the configuration, starts the server, and returns once
        /-/ready answers (the rules are loaded by then: a bad rule file stops it first)."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.rules_path.write_text(yaml.safe_dump(build_rule_file(yaml.safe_load(self.rules.read_text()))))
        self.config_path.write_text(yaml.safe_dump(build_config(self.target, [str(self.rules_path)],
                                                                self.scrape_configs)))
        self.port = free_port()
        argv = [str(self.binary), f"--config.file={self.config_path}",
                f"--storage.tsdb.path={self.state_dir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=info"]
        with open(self.log_path, "ab") as log:
            # Its own session: a Ctrl-C of the tests does not reach it before stop() does.
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         cwd=self.state_dir, start_new_session=True)
        try:
            _wait(self._ready, timeout, "Prometheus' /-/ready", self._died)
        except PrometheusError as e:
            self.stop()
            raise PrometheusError(f"{e}\ntail of {self.log_path}:\n{self.tail()}") from None

    def stop(self, grace: float = 10) -> None:
        """SIGTERM, and SIGKILL after `grace` seconds."""
        stop_group(self.proc, grace)

    def __enter__(self) -> "PrometheusProcess":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, lines: int = 40) -> str:
        return log_tail(self.log_path, lines)

    def _died(self) -> str | None:
        if self.proc is not None and self.proc.poll() is not None:
            return f"prometheus exited with status {self.proc.returncode}"
        return None

    def _ready(self) -> bool:
        with self._http.open(f"{self.url}/-/ready", timeout=5) as resp:
            return resp.status == 200

    # -- the HTTP API

    def api(self, path: str, **params: str) -> Any:
        """GET /api/v1/<path>: its `data`, or PrometheusError with the server's error."""
        url = f"{self.url}/api/v1/{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
        try:
            with self._http.open(url, timeout=10) as resp:
                body = json.load(resp)
        except urllib.error.HTTPError as e:
            body = json.loads(e.read() or b"{}")
        if body.get("status") != "success":
            raise PrometheusError(f"GET {url}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's samples: [{"metric": {labels}, "value": [time, "value"]}]."""
        data = self.api("query", query=expr)
        if data["resultType"] != "vector":
            raise PrometheusError(f"{expr!r} is a {data['resultType']}, not an instant vector")
        return data["result"]

    def alerts(self) -> list[dict[str, Any]]:
        """The pending and firing alerts: [{"labels", "annotations", "state", "activeAt", "value"}]."""
        return self.api("alerts")["alerts"]

    def wait_alert(self, name: str, labels: dict[str, str] | None = None, timeout: float = 60,
                   state: str = "firing") -> dict[str, Any]:
        """Waits until alert `name` with (at least) `labels` is in `state`, and returns it;
        on timeout the error lists the alerts there are."""
        labels = labels or {}

        def found() -> dict[str, Any] | None:
            return next((a for a in self.alerts() if matches(a, name, labels, state)), None)

        try:
            return _wait(found, timeout, f"alert {name} {labels} {state}", self._died)
        except PrometheusError as e:
            seen = [(a["labels"], a["state"]) for a in self.alerts()] if self.running() else "(not running)"
            raise PrometheusError(f"{e}; alerts now: {seen}") from None
