"""The monitoring objects (manifests/monitoring/: the metrics Service, a ServiceMonitor, a
PodMonitor, the alert rules and the Grafana dashboard's ConfigMap) against
prometheus-operator's real CRDs (v0.85.0, from its Go module: `bash e2e/build-binaries.sh
prometheus_crds`), installed in the test cluster: the API server accepts them on a
server-side dry run, and refuses a broken one (so the schema is really checked).

Then the rules at work: a real Prometheus (Debian's 2.42 package, e2e/prometheus.py)
scrapes the session's operator every second and evaluates the PrometheusRule's groups
as they are; a job that never steps fires RFTJobProgressDeadlineExceeded for that job."""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from e2e.cluster import REPO_ROOT, cache_dir, read_versions
from e2e.prometheus import SCRAPE_JOB, PrometheusProcess
from rft_contract import names
from tests.conftest import wait_for

from .operator_fixtures import create_job, job_manifest, wait_phase, wait_status

pytestmark = pytest.mark.integration
MONITORING = REPO_ROOT / "manifests" / "monitoring"
KINDS = ("servicemonitors", "podmonitors", "prometheusrules")


@pytest.fixture(scope="module")
def prometheus_crds(cluster, kubectl) -> None:
    out = cache_dir() / "bin" / f"prometheus-operator-{read_versions()['PROMETHEUS_OPERATOR_VERSION']}" / "crds"
    files = [out / f"monitoring.coreos.com_{k}.yaml" for k in KINDS]
    if not all(f.exists() for f in files):
        subprocess.run(["bash", str(REPO_ROOT / "e2e" / "build-binaries.sh"), "prometheus_crds"], check=True,
                       timeout=600)
    for f in files:
        kubectl("apply", "--server-side", "--force-conflicts", "-f", str(f))
    kubectl("wait", "--for=condition=Established", "--timeout=60s",
            *(f"crd/{k}.monitoring.coreos.com" for k in KINDS))


def component_objects(tmp_path: Path) -> list[dict]:
    """`kubectl kustomize` of a kustomization that adds only the component."""
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "components": [os.path.relpath(MONITORING, tmp_path)]}))
    out = subprocess.run(["kubectl", "kustomize", str(tmp_path)], capture_output=True, text=True, timeout=60,
                         check=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def dry_run(kubectl, objects: list[dict]) -> subprocess.CompletedProcess:
    return kubectl("apply", "--dry-run=server", "-f", "-", input=yaml.safe_dump_all(objects), check=False)


def test_the_monitoring_component_is_accepted(prometheus_crds, installed, kubectl, tmp_path):
    objects = component_objects(tmp_path)
    assert sorted(o["kind"] for o in objects) == ["ConfigMap", "PodMonitor", "PrometheusRule", "Service",
                                                  "ServiceMonitor"]
    proc = dry_run(kubectl, objects)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("created (server dry run)") == 5, proc.stdout


def test_a_broken_rule_or_monitor_is_refused(prometheus_crds, installed, kubectl, tmp_path):
    objects = component_objects(tmp_path)
    rule = next(o for o in objects if o["kind"] == "PrometheusRule")
    rule["spec"]["groups"][0]["rules"][0]["for"] = "five minutes"
    proc = dry_run(kubectl, [rule])
    assert proc.returncode != 0 and "for" in proc.stderr, proc.stderr
    monitor = next(o for o in objects if o["kind"] == "ServiceMonitor")
    monitor["spec"]["endpoints"][0]["interval"] = "often"
    proc = dry_run(kubectl, [monitor])
    assert proc.returncode != 0 and "interval" in proc.stderr, proc.stderr


def test_the_charts_monitoring_objects_are_accepted(prometheus_crds, installed, kubectl):
    from tests.unit.test_chart import template  # the real Helm, built on demand

    rendered = template("--set", "monitoring.serviceMonitor.enabled=true", "--set", "monitoring.podMonitor.enabled=true",
                        "--set", "monitoring.prometheusRule.enabled=true",
                        "--set", "monitoring.grafanaDashboard.enabled=true",
                        "--set-string", "monitoring.grafanaDashboard.annotations.grafana_folder=RFT jobs")
    kinds = ("Service", "ServiceMonitor", "PodMonitor", "PrometheusRule", "ConfigMap")
    objects = [o for (kind, _, name), o in rendered.items()
               if kind in kinds and name != "rftjob-operator-webhook"]  # (in every install)
    assert len(objects) == 5, sorted(rendered)
    proc = dry_run(kubectl, objects)
    assert proc.returncode == 0 and proc.stdout.count("created (server dry run)") == 5, proc.stderr


# --------------------------------------------------------------------------- a real Prometheus

UP = f'up{{job="{SCRAPE_JOB}"}}'


def operator_metrics_port(operator) -> int:
    """The port the session operator serves /metrics on (its --metrics-port, else the
    default), checked against its log: the last start's metrics line must say it listens
    (another operator on this host may hold the default port: the line says so)."""
    from rft_operator.__main__ import DEFAULT_METRICS_PORT

    args = " ".join(operator.args)
    given = re.search(r"--metrics-port[= ](\d+)", args)
    port = int(given.group(1)) if given else DEFAULT_METRICS_PORT
    lines = re.findall(r"(serving metrics on|metrics disabled: cannot listen on) \S+:(\d+)",
                       operator.log_path.read_text(errors="replace"))
    if not lines or lines[-1] != ("serving metrics on", str(port)):
        pytest.fail(f"the session operator does not serve metrics on port {port} (last metrics line: "
                    f"{lines[-1] if lines else None}); give it a free one: --metrics-port in the "
                    f"`operator` fixture's args (tests/integration/conftest.py)")
    return port


@pytest.fixture(scope="module")
def prometheus(operator, tmp_path_factory) -> PrometheusProcess:
    version = read_versions()["PROMETHEUS_DEB_VERSION"]
    if not os.access(cache_dir() / "bin" / f"prometheus-{version}" / "prometheus", os.X_OK):
        subprocess.run(["bash", str(REPO_ROOT / "e2e" / "build-binaries.sh"), "promtool"], check=True, timeout=300)
    port = operator_metrics_port(operator)
    with PrometheusProcess(tmp_path_factory.mktemp("prometheus"), target=f"127.0.0.1:{port}") as prom:
        yield prom


def test_a_stalled_job_fires_its_alert_in_a_real_prometheus(prometheus, operator, api, namespace):
    """A job whose trainer never steps (KWOK's pods report nothing) passes its 5 s progress
    deadline; the operator restarts it with Progressing=False/ProgressDeadlineExceeded,
    Prometheus scrapes that as the job's condition series under the job's own `namespace`
    and `job` labels (honor_labels) and the unchanged rule fires for that job. The operator
    is up (no RFTJobOperatorDown, not even pending), and one restart of a budget of one
    makes RFTJobRestartBudgetNearlySpent's expression true (pending: its `for` is a minute,
    which promtool's tests cover)."""
    wait_for(lambda: prometheus.query(f"{UP} == 1"), 30, f"Prometheus to scrape the operator ({UP} == 1)")
    wait_for(lambda: not [a for a in prometheus.alerts() if a["labels"]["alertname"].startswith("RFTJobOperator")],
             10, "no RFTJobOperatorDown/NoLeader alert once the operator is scraped")

    # backoffSeconds: the gang stays Restarting, the budget's last restart unspent, for the test.
    create_job(api, namespace, job_manifest("stall", trainer={"nodes": 1, "gpusPerNode": 1}, failurePolicy={
        "progressDeadlineSeconds": 5, "maxRestarts": 1, "backoffSeconds": 120}))
    wait_phase(api, namespace, "stall", names.RUNNING, 60)
    running = time.monotonic()
    labels = {"namespace": namespace, "job": "stall"}
    alert = prometheus.wait_alert("RFTJobProgressDeadlineExceeded", labels, 45)
    fired = time.monotonic() - running
    status = wait_status(api, namespace, "stall", lambda s: s.get("restarts") == 1, 5, "the deadline's restart")
    assert status["lastFailure"]["reason"] == names.REASON_PROGRESS_DEADLINE
    assert alert["labels"]["severity"] == "warning"
    assert alert["annotations"]["summary"] == (
        f"RFTJob {namespace}/stall missed its progress deadline (Progressing=False).")
    print(f"RFTJobProgressDeadlineExceeded firing {fired:.1f}s after the job ran (deadline 5s)")

    budget = prometheus.wait_alert("RFTJobRestartBudgetNearlySpent", labels, 15, state="pending")
    assert budget["value"] == "1e+00", budget  # rftjob_job_restarts
    assert [s["value"][1] for s in prometheus.query(UP)] == ["1"]
    assert not [a for a in prometheus.alerts() if a["labels"]["alertname"] == "RFTJobOperatorDown"]
