"""The Helm chart (charts/rftjob-operator) against the kustomize installs it mirrors, with
the real Helm v4 and helm-unittest (`bash e2e/build-binaries.sh helm`, built on demand here):

* its copies of the generated CRD and admission policies are current (no Helm needed);
* `helm lint --strict` passes with the default and the namespaced values;
* `helm template` equals `kubectl kustomize manifests/` object for object (with
  `namespace.create=true`; by default the release namespace is Helm's to create), and
  the namespaced values equal `manifests/namespaced/`;
* the helm-unittest suites in the chart's tests/ (the values switches) pass."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from e2e.cluster import REPO_ROOT, cache_dir, read_versions

CHART = REPO_ROOT / "charts" / "rftjob-operator"
NAMESPACED = ["--set", "namespace.create=true", "--set", "watchNamespaces={rft-jobs}",
              "--set", "createWatchNamespaces=true"]


def helm_tools() -> tuple[Path, Path]:
    """(helm, untt), built into the cache if missing."""
    v = read_versions()
    out = cache_dir() / "bin" / f"helm-{v['HELM_VERSION']}"
    helm, untt = out / "helm", out / f"untt-{v['HELM_UNITTEST_VERSION']}"
    if not (os.access(helm, os.X_OK) and os.access(untt, os.X_OK)):
        subprocess.run(["bash", str(REPO_ROOT / "e2e" / "build-binaries.sh"), "helm"], check=True, timeout=1800)
    return helm, untt


def run_helm(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    helm, _ = helm_tools()
    # Helm's own state (repositories, plugins, cache) in a place of its own, not ~/.config.
    env = {**os.environ, "HELM_CONFIG_HOME": str(cache_dir() / "helm" / "config"),
           "HELM_CACHE_HOME": str(cache_dir() / "helm" / "cache"),
           "HELM_DATA_HOME": str(cache_dir() / "helm" / "data")}
    proc = subprocess.run([str(helm), *args], capture_output=True, text=True, timeout=300, env=env)
    if check:
        assert proc.returncode == 0, f"helm {' '.join(args)}:\n{proc.stdout}\n{proc.stderr}"
    return proc


def objects(text: str) -> dict[tuple[str, str, str], dict]:
    """(kind, namespace, name) -> object, from a YAML stream."""
    out = {}
    for doc in yaml.safe_load_all(text):
        if doc:
            key = (doc["kind"], doc["metadata"].get("namespace", ""), doc["metadata"]["name"])
            assert key not in out, f"{key} twice"
            out[key] = doc
    return out


def template(*args: str) -> dict[tuple[str, str, str], dict]:
    return objects(run_helm("template", "rftjob-operator", str(CHART), "--namespace", "rftjob-system",
                            "--include-crds", *args).stdout)


def kustomize(path: str) -> dict[tuple[str, str, str], dict]:
    out = subprocess.run(["kubectl", "kustomize", str(REPO_ROOT / path)], capture_output=True, text=True,
                         timeout=60, check=True)
    return objects(out.stdout)


def assert_same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want), f"only in the chart: {sorted(set(got) - set(want))}; " \
                                        f"only in kustomize: {sorted(set(want) - set(got))}"
    for key in want:
        assert got[key] == want[key], f"{key} differs:\nchart: {json.dumps(got[key], indent=1)}\n" \
                                      f"kustomize: {json.dumps(want[key], indent=1)}"


def test_the_charts_copies_of_the_generated_files_are_current():
    fix = "run `make crd`"
    assert (CHART / "crds" / "rftjob.yaml").read_text() == (REPO_ROOT / "crds" / "rftjob.yaml").read_text(), fix
    policies = (REPO_ROOT / "manifests" / "base" / "admission-policies.yaml").read_text()
    wrapped = (CHART / "templates" / "admission-policies.yaml").read_text()
    assert wrapped == "{{- if .Values.admissionPolicies.enabled }}\n" + policies + "{{- end }}\n", fix
    webhook = (REPO_ROOT / "manifests" / "base" / "owner-webhook-configuration.yaml").read_text()
    assert (CHART / "templates" / "owner-webhook-configuration.yaml").read_text() == webhook.replace(
        "namespace: rftjob-system", "namespace: {{ .Release.Namespace }}"), fix


@pytest.mark.timeout(1800)  # builds Helm on a cold machine
@pytest.mark.parametrize("values", [[], NAMESPACED], ids=["cluster", "namespaced"])
def test_helm_lint_strict(values):
    run_helm("lint", "--strict", str(CHART), "--namespace", "rftjob-system", *values)


@pytest.mark.timeout(1800)
def test_the_chart_renders_what_kustomize_installs():
    want = kustomize("manifests")
    assert_same(template("--set", "namespace.create=true"), want)
    # By default the release's namespace is Helm's (`--create-namespace`), not the chart's.
    assert_same(template(), {k: v for k, v in want.items() if k != ("Namespace", "", "rftjob-system")})


@pytest.mark.timeout(1800)
def test_the_namespaced_values_render_what_the_namespaced_kustomization_installs():
    assert_same(template(*NAMESPACED), kustomize("manifests/namespaced"))


@pytest.mark.timeout(1800)
def test_helm_unittest_suites():
    _, untt = helm_tools()
    proc = subprocess.run([str(untt), "--strict", "--color=false", str(CHART)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    # Every suite ran (a misnamed file would be skipped silently).
    suites = sorted(p.name for p in (CHART / "tests").glob("*_test.yaml"))
    assert f"Test Suites: {len(suites)} passed, {len(suites)} total" in proc.stdout, proc.stdout[-3000:]


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("value, name", [
    ("metrics.port=http", "metrics.port"),
    ("monitoring.grafanaDashboard.folder=RFT", "folder"),  # a value the chart does not know (a typo)
    ("monitoring.grafanaDashboard.labelValue=1", "monitoring.grafanaDashboard.labelValue"),  # --set-string
])
def test_bad_values_are_refused_by_name(value, name):
    proc = run_helm("template", "x", str(CHART), "--set", value, check=False)
    assert proc.returncode != 0 and name in proc.stderr.replace("/", "."), proc.stderr


# ------------------------------------------------------------------ the monitoring switches
# The chart's monitoring switches render what the kustomize component manifests/monitoring/
# adds, object for object (the dashboard's ConfigMap too: same data, same labels), the
# chart's PrometheusRule template is generated from the component's rule file, and its
# dashboard is a copy of the component's.

RULE = REPO_ROOT / "manifests" / "monitoring" / "prometheusrule.yaml"
RULE_TEMPLATE = CHART / "templates" / "monitoring-prometheusrule.yaml"
DASHBOARD = REPO_ROOT / "manifests" / "monitoring" / "grafana-dashboard.json"
DASHBOARD_COPY = CHART / "dashboards" / "rftjob-operator.json"  # Helm reads no file outside the chart
MONITORING_ON = ["--set", "monitoring.serviceMonitor.enabled=true", "--set", "monitoring.podMonitor.enabled=true",
                 "--set", "monitoring.prometheusRule.enabled=true", "--set", "monitoring.grafanaDashboard.enabled=true"]
MONITORING_KINDS = {"Service", "ServiceMonitor", "PodMonitor", "PrometheusRule", "ConfigMap"}


def build_rule_template(rule_file: str) -> str:
    """The chart's template: the rule file's spec as Go raw strings (the alerts' own
    {{ $labels }} pass through Helm), each backquote printed on its own."""
    head, spec = rule_file.split("\nspec:\n", 1)
    meta = RULE_TEMPLATE.read_text().split("{{`", 1)[0]
    return meta + "{{`" + ("spec:\n" + spec).replace("`", '`}}{{ "`" }}{{`') + "`}}\n{{- end }}\n"


def test_the_charts_rule_template_is_generated_from_the_component():
    want = build_rule_template(RULE.read_text())
    if os.environ.get("RFT_REGENERATE"):
        RULE_TEMPLATE.write_text(want)
    assert RULE_TEMPLATE.read_text() == want, "RFT_REGENERATE=1 pytest tests/unit/test_chart.py"


def test_the_charts_dashboard_is_the_components():
    if os.environ.get("RFT_REGENERATE"):
        DASHBOARD_COPY.write_text(DASHBOARD.read_text())
    assert DASHBOARD_COPY.read_text() == DASHBOARD.read_text(), "RFT_REGENERATE=1 pytest tests/unit/test_chart.py"


def component(tmp_path) -> dict:
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "components": [os.path.relpath(REPO_ROOT / "manifests" / "monitoring", tmp_path)]}))
    out = subprocess.run(["kubectl", "kustomize", str(tmp_path)], capture_output=True, text=True, timeout=60,
                         check=True).stdout
    return objects(out)


@pytest.mark.timeout(1800)
def test_the_monitoring_values_render_what_the_component_adds(tmp_path):
    webhook = ("Service", "rftjob-system", "rftjob-operator-webhook")  # in every install, not the component's
    got = {k: v for k, v in template(*MONITORING_ON).items() if k[0] in MONITORING_KINDS and k != webhook}
    assert_same(got, component(tmp_path))
    assert ("ConfigMap", "rftjob-system", "rftjob-operator-dashboard") in got  # the dashboard's, compared too
    # Off by default: the chart as before (tests/unit/test_chart.py compares it with manifests/).
    assert not {k for k in template() if k[0] in {"ServiceMonitor", "PodMonitor", "PrometheusRule", "ConfigMap"}}


@pytest.mark.timeout(1800)
def test_helm_lint_strict_with_monitoring():
    run_helm("lint", "--strict", str(CHART), "--namespace", "rftjob-system", *MONITORING_ON)
