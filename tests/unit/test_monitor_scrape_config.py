"""e2e/prometheus.monitor_scrape_config: the scrape job prometheus-operator would generate
for the monitoring component's ServiceMonitor and PodMonitor, which the end-to-end test's
real Prometheus uses to find the operator and the jobs' pods (tests/e2e/test_rftjob.py)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from e2e.prometheus import endpoints_targets, monitor_scrape_config, pod_targets

MONITORING = Path(__file__).resolve().parents[2] / "manifests" / "monitoring"


def load(name: str) -> dict:
    return yaml.safe_load((MONITORING / name).read_text())


def relabel(config: dict, labels: dict[str, str]) -> dict[str, str] | None:
    """Prometheus' relabelling of one discovered target (keep, drop, replace; anchored
    regexes), enough to check the generated rules: the target's labels, or None if dropped."""
    import re

    labels = dict(labels)
    for rule in config["relabel_configs"]:
        value = rule.get("separator", ";").join(labels.get(s, "") for s in rule.get("source_labels", []))
        regex = re.compile(f"^(?:{rule.get('regex', '(.*)')})$")
        action = rule.get("action", "replace")
        if action == "keep" and not regex.match(value):
            return None
        if action == "drop" and regex.match(value):
            return None
        if action == "replace" and (m := regex.match(value)):
            labels[rule["target_label"]] = m.expand(rule.get("replacement", "$1").replace("$1", r"\1"))
    return {k: v for k, v in labels.items() if not k.startswith("__")}


def pod_target(port: str = "metrics", phase: str = "Running", **pod_labels: str) -> dict[str, str]:
    t = {"__meta_kubernetes_namespace": "team-a", "__meta_kubernetes_pod_name": "demo-trainer-1-0",
         "__meta_kubernetes_pod_container_name": "trainer", "__meta_kubernetes_pod_container_port_name": port,
         "__meta_kubernetes_pod_phase": phase}
    for key, value in pod_labels.items():
        t[f"__meta_kubernetes_pod_label_{key}"] = value
        t[f"__meta_kubernetes_pod_labelpresent_{key}"] = "true"
    return t


JOB_POD = {"app_kubernetes_io_managed_by": "rftjob-operator", "rft_dev_role": "trainer", "rft_dev_job": "demo"}


def test_the_podmonitor_finds_the_jobs_metrics_ports_in_any_namespace():
    config = monitor_scrape_config(load("podmonitor.yaml"), "http://sd", interval="1s")
    assert config["http_sd_configs"] == [{"url": "http://sd/pod", "refresh_interval": "1s"}]  # any namespace
    assert (config["scrape_interval"], config["metrics_path"], config["honor_labels"]) == ("1s", "/metrics", False)
    assert relabel(config, pod_target(**JOB_POD)) == {
        "namespace": "team-a", "pod": "demo-trainer-1-0", "container": "trainer",
        "job": "rftjob-system/rftjob-pods", "endpoint": "metrics", "rftjob": "demo", "role": "trainer"}


@pytest.mark.parametrize("target", [
    pod_target(port="weights", **JOB_POD),  # another port of a job's pod
    pod_target(**{**JOB_POD, "app_kubernetes_io_managed_by": "someone-else"}),
    pod_target(**{k: v for k, v in JOB_POD.items() if k != "rft_dev_role"}),  # not a job role's pod
    pod_target(phase="Succeeded", **JOB_POD),
], ids=["other-port", "other-manager", "no-role", "succeeded"])
def test_the_podmonitor_keeps_nothing_else(target):
    assert relabel(monitor_scrape_config(load("podmonitor.yaml"), "http://sd"), target) is None


def test_the_servicemonitor_scrapes_the_operators_service_with_its_labels_honoured():
    config = monitor_scrape_config(load("servicemonitor.yaml"), "http://sd")
    assert config["http_sd_configs"] == [
        {"url": "http://sd/endpoints?namespaces=rftjob-system", "refresh_interval": "30s"}]
    assert config["honor_labels"] is True and config["scrape_interval"] == "30s"
    target = {"__meta_kubernetes_namespace": "rftjob-system", "__meta_kubernetes_service_name": "rftjob-operator-metrics",
              "__meta_kubernetes_service_label_app_kubernetes_io_name": "rftjob-operator",
              "__meta_kubernetes_service_labelpresent_app_kubernetes_io_name": "true",
              "__meta_kubernetes_endpoint_port_name": "metrics", "__meta_kubernetes_pod_name": "op-1",
              "__meta_kubernetes_pod_container_name": "operator", "__meta_kubernetes_pod_phase": "Running"}
    # job = the Service's name: the alert rules' up{job="rftjob-operator-metrics"}
    assert relabel(config, target)["job"] == "rftjob-operator-metrics"
    assert relabel(config, {**target, "__meta_kubernetes_endpoint_port_name": "http"}) is None


def test_a_monitor_field_it_does_not_model_is_refused_not_dropped():
    monitor = copy.deepcopy(load("podmonitor.yaml"))
    monitor["spec"]["podMetricsEndpoints"][0]["scheme"] = "https"
    with pytest.raises(ValueError, match=r"scheme"):
        monitor_scrape_config(monitor, "http://sd")
    monitor = copy.deepcopy(load("podmonitor.yaml"))
    monitor["spec"]["selector"]["matchExpressions"][0]["operator"] = "NotIn"
    with pytest.raises(ValueError, match="NotIn"):
        monitor_scrape_config(monitor, "http://sd")


# ------------------------------------------------------------------ discovery (KubernetesDiscovery)

POD = {"metadata": {"namespace": "team-a", "name": "demo-inference-0",
                    "labels": {"app.kubernetes.io/managed-by": "rftjob-operator", "rft.dev/role": "inference",
                               "rft.dev/job": "demo"}},
       "spec": {"containers": [{"name": "server", "ports": [{"name": "http", "containerPort": 8000}]},
                               {"name": "sync-agent", "ports": [{"name": "weights", "containerPort": 8001},
                                                                {"name": "metrics", "containerPort": 9400}]}]},
       "status": {"podIP": "10.88.0.7", "phase": "Running"}}


def test_pod_discovery_gives_each_declared_port_and_the_podmonitor_keeps_the_metrics_one():
    groups = pod_targets([POD, {**POD, "status": {"phase": "Pending"}}])  # no IP yet: no target
    assert [g["targets"] for g in groups] == [["10.88.0.7:8000"], ["10.88.0.7:8001"], ["10.88.0.7:9400"]]
    config = monitor_scrape_config(load("podmonitor.yaml"), "http://sd")
    kept = [(g["targets"], relabel(config, g["labels"])) for g in groups if relabel(config, g["labels"])]
    assert kept == [(["10.88.0.7:9400"], {
        "namespace": "team-a", "pod": "demo-inference-0", "container": "sync-agent",
        "job": "rftjob-system/rftjob-pods", "endpoint": "metrics", "rftjob": "demo", "role": "inference"})]


def test_endpoints_discovery_labels_the_operators_service_and_pod():
    service = {"metadata": {"namespace": "rftjob-system", "name": "rftjob-operator-metrics",
                            "labels": {"app.kubernetes.io/name": "rftjob-operator"}}}
    pod = {"metadata": {"namespace": "rftjob-system", "name": "op-1", "labels": {}},
           "spec": {"containers": [{"name": "operator", "ports": [{"name": "metrics", "containerPort": 9090}]}]},
           "status": {"podIP": "10.88.0.3", "phase": "Running"}}
    endpoint_slice = {"metadata": {"namespace": "rftjob-system",
                                   "labels": {"kubernetes.io/service-name": "rftjob-operator-metrics"}},
                      "ports": [{"name": "metrics", "port": 9090}],
                      "endpoints": [{"addresses": ["10.88.0.3"], "conditions": {"ready": True},
                                     "targetRef": {"kind": "Pod", "name": "op-1"}}]}
    (group,) = endpoints_targets([service], [endpoint_slice], [pod])
    assert group["targets"] == ["10.88.0.3:9090"]
    assert relabel(monitor_scrape_config(load("servicemonitor.yaml"), "http://sd"), group["labels"]) == {
        "namespace": "rftjob-system", "pod": "op-1", "container": "operator", "service": "rftjob-operator-metrics",
        "job": "rftjob-operator-metrics", "endpoint": "metrics"}
    assert endpoints_targets([], [endpoint_slice], [pod]) == []  # a slice of no Service listed
