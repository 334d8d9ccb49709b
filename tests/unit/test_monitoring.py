"""The monitoring component (manifests/monitoring/): the alert rules under the real promtool
(Debian's prometheus package, `bash e2e/build-binaries.sh promtool`, fetched on demand
here), every metric the rules and the Grafana dashboard name is one the operator
exports (read from a real scrape of `OperatorMetrics`), and the dashboard the component's
ConfigMap carries to Grafana's sidecar is the one checked here."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from e2e.cluster import REPO_ROOT, cache_dir, read_versions
from rft_operator.metrics import OperatorMetrics

from .test_chart import component
from .testing import make_job

MONITORING = REPO_ROOT / "manifests" / "monitoring"
RULE = MONITORING / "prometheusrule.yaml"
RULE_TESTS = MONITORING / "prometheusrule-tests.yaml"
DASHBOARD = MONITORING / "grafana-dashboard.json"


def promtool() -> Path:
    """The cached promtool, fetched if missing. Skips only outside CI when it cannot be had."""
    path = cache_dir() / "bin" / f"prometheus-{read_versions()['PROMETHEUS_DEB_VERSION']}" / "promtool"
    if not os.access(path, os.X_OK):
        proc = subprocess.run(["bash", str(REPO_ROOT / "e2e" / "build-binaries.sh"), "promtool"],
                              capture_output=True, text=True, timeout=600)
        if proc.returncode != 0 and not os.environ.get("CI"):
            pytest.skip(f"promtool missing and `bash e2e/build-binaries.sh promtool` failed (apt-get "
                        f"download prometheus; run apt-get update?): {proc.stderr[-500:]}")
        assert proc.returncode == 0, proc.stderr[-2000:]
    return path


def rule_groups() -> list[dict]:
    return yaml.safe_load(RULE.read_text())["spec"]["groups"]


def alerts() -> dict[str, dict]:
    return {r["alert"]: r for g in rule_groups() for r in g["rules"] if "alert" in r}


def run_promtool(*args: str, cwd: Path) -> str:
    proc = subprocess.run([str(promtool()), *args], capture_output=True, text=True, timeout=120, cwd=cwd)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    return proc.stdout


def test_promtool_checks_the_rules(tmp_path):
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": rule_groups()}))
    out = run_promtool("check", "rules", "rules.yaml", cwd=tmp_path)
    assert f"SUCCESS: {sum(len(g['rules']) for g in rule_groups())} rules found" in out, out


def test_promtool_rule_tests_pass(tmp_path):
    # promtool compares annotations verbatim; the cases check expressions, `for` and labels.
    groups = rule_groups()
    for g in groups:
        for r in g["rules"]:
            r.pop("annotations", None)
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}))
    (tmp_path / "tests.yaml").write_text(RULE_TESTS.read_text())
    out = run_promtool("test", "rules", "tests.yaml", cwd=tmp_path)
    assert "SUCCESS" in out, out


def test_every_alert_has_a_case_that_fires_and_one_that_must_not():
    firing, quiet = set(), set()
    for case in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        for t in case.get("alert_rule_test", []):
            (firing if t.get("exp_alerts") else quiet).add(t["alertname"])
    assert sorted(alerts()) == sorted(firing), "an alert without a case that fires it"
    assert sorted(alerts()) == sorted(quiet), "an alert without a case where it must not fire"


def test_every_alert_says_what_to_check_and_do():
    for name, rule in alerts().items():
        ann = rule.get("annotations") or {}
        assert ann.get("summary") and len(ann.get("runbook", "")) > 100, name
        assert rule["labels"]["severity"] in ("warning", "critical"), name


# ------------------------------------------------------------ metric names

# PromQL words that look like metric names: operators, modifiers, and the functions'
# names are told apart by the "(" that follows them.
KEYWORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right",
            "offset", "bool", "inf", "nan", "atan2"}
LABEL_LISTS = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects (a regex reading: strings, label matchers,
    ranges and grouping label lists are removed first, then function names)."""
    m = re.fullmatch(r"\s*label_values\((.*),\s*\w+\s*\)\s*", expr, re.S)  # Grafana's variable query
    if m:
        expr = m.group(1)
    expr = re.sub(r'"(\\.|[^"\\])*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}", "", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)
    expr = LABEL_LISTS.sub("", expr)
    words = re.findall(r"(?<![\w$.])([a-zA-Z_:][a-zA-Z0-9_:]*)(\s*\()?", expr)
    return {w for w, call in words if not call and w.lower() not in KEYWORDS}


def test_the_regex_finds_the_metrics_of_an_expression():
    expr = ('rftjob_trainer_step - (rftjob_last_checkpoint_step or rftjob_trainer_step * 0) > 2 * '
            'max by (namespace, job) (rate(x_total{job="up", a=~"b|c"}[5m] offset 1h)) '
            'and on (namespace) group_left (phase) absent(up{job="a"} == 1)')
    assert metric_names(expr) == {"rftjob_trainer_step", "rftjob_last_checkpoint_step", "x_total", "up"}
    assert metric_names('label_values(rftjob_job_phase{namespace="$namespace"}, job)') == {"rftjob_job_phase"}
    assert metric_names("time() - 1e3") == set()


def exported_names() -> set[str]:
    """Every sample and family name a scrape of a busy operator shows."""
    m = OperatorMetrics()
    m.track_writes(type("K", (), {"requests": 3, "seconds": 0.5})())
    m.reconciles.inc()
    m.reconcile_seconds.observe(0.01)
    status = {"phase": "Running", "restarts": 1,
              "trainer": {"step": 12, "lastCheckpoint": {"step": 10, "time": "2026-11-30T11:00:00Z"}},
              "progress": {"step": 12, "attempt": 2, "since": "2026-11-30T11:59:00Z"},
              "weightSync": {"lagSteps": 2, "syncedReplicas": 1, "desiredReplicas": 2},
              "conditions": [{"type": "Progressing", "status": "True", "reason": "Stepping"}]}
    m.observe_job(("team-a", "demo"), make_job(status=status))
    text = generate_latest(m.registry).decode()
    names = set()
    for fam in text_string_to_metric_families(text):
        names.add(fam.name)
        names.update(s.name for s in fam.samples)
    return names


def dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    for var in dash["templating"]["list"]:
        q = var.get("query")
        if var["type"] == "query":
            exprs.append(q["query"] if isinstance(q, dict) else q)
    return exprs


def test_rules_and_dashboard_name_only_exported_metrics():
    known = exported_names() | {"up"}  # `up`: Prometheus' own, per target
    exprs = [r["expr"] for r in alerts().values()] + dashboard_exprs()
    used: set[str] = set()
    for expr in exprs:
        names = metric_names(expr)
        assert names, f"no metric found in {expr!r}"
        assert names <= known, f"{expr!r} names {sorted(names - known)}, which the operator does not export"
        used |= names
    # Each per-job gauge has a panel or an alert (the rest are counters and the histogram's parts).
    gauges = {n for n in known if n.startswith("rftjob_") and not n.endswith(("_total", "_created", "_bucket",
                                                                              "_count", "_sum"))}
    assert gauges - used <= {"rftjob_reconciles", "rftjob_reconcile_errors", "rftjob_api_writes",
                             "rftjob_api_write_seconds", "rftjob_reconcile_duration_seconds"}, gauges - used


def test_the_dashboard_has_one_job_and_the_fleet():
    dash = json.loads(DASHBOARD.read_text())
    assert {v["name"] for v in dash["templating"]["list"]} >= {"namespace", "job"}
    rows = [p["title"] for p in dash["panels"] if p["type"] == "row"]
    assert rows == ["Job: $namespace/$job", "Fleet"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    job_exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", []) if "$job" in t["expr"]]
    assert job_exprs and all('namespace="$namespace"' in e for e in job_exprs)


def test_the_configmap_carries_this_dashboard_to_grafanas_sidecar(tmp_path):
    cm = component(tmp_path)[("ConfigMap", "rftjob-system", "rftjob-operator-dashboard")]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"  # the sidecar's default label
    (key, text), = cm["data"].items()
    assert key.endswith(".json")  # the sidecar writes it under this name; Grafana loads *.json
    assert json.loads(text) == json.loads(DASHBOARD.read_text())
    assert text == DASHBOARD.read_text()
