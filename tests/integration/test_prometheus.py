"""The monitoring objects (manifests/monitoring/: the metrics Service, a ServiceMonitor and
the alert rules) against prometheus-operator's real CRDs (v0.85.0, from its Go module:
`bash e2e/build-binaries.sh prometheus_crds`), installed in the test cluster: the API
server accepts them on a server-side dry run, and refuses a broken one (so the schema
is really checked)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

from e2e.cluster import REPO_ROOT, cache_dir, read_versions

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
    assert sorted(o["kind"] for o in objects) == ["PrometheusRule", "Service", "ServiceMonitor"]
    proc = dry_run(kubectl, objects)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("created (server dry run)") == 3, proc.stdout


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

    rendered = template("--set", "monitoring.serviceMonitor.enabled=true",
                        "--set", "monitoring.prometheusRule.enabled=true")
    objects = [o for (kind, _, _), o in rendered.items() if kind in ("Service", "ServiceMonitor", "PrometheusRule")]
    assert len(objects) == 3, sorted(rendered)
    proc = dry_run(kubectl, objects)
    assert proc.returncode == 0 and proc.stdout.count("created (server dry run)") == 3, proc.stderr
