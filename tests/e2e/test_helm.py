"""The Helm chart on the local cluster's real node, as a platform team uses it: `helm
install` (the real Helm v4; two replicas electing a leader, a PodDisruptionBudget), a sample
RFTJob trained with the operator it installed, `helm upgrade` with changed values while
that job runs (the job goes on: no restart, no pod replaced), and `helm uninstall`, which keeps the CRD and every RFTJob (Helm never deletes
what it installed from crds/)."""

from __future__ import annotations

import copy
import json
import uuid

import kubernetes
import pytest
import yaml

from e2e import demo
from e2e.node import LOCAL_NODE_LABEL, LOCAL_TAINT
from rft_contract import names
from tests.conftest import wait_for
from tests.e2e.conftest import s3_for_pods
from tests.integration.operator_fixtures import OperatorProcess
from tests.unit.test_chart import CHART, run_helm

pytestmark = pytest.mark.e2e
RELEASE, NAMESPACE = "rftjob-operator", "rftjob-system"
SAMPLE = yaml.safe_load((CHART.parents[1] / "manifests/samples/rftjob.yaml").read_text())


@pytest.fixture(scope="module")
def s3(s3_server, node):
    with s3_for_pods(s3_server, "rft-helm", 64) as proxy:
        yield proxy


@pytest.fixture(scope="module")
def helm(cluster, node, images, tmp_path_factory):
    """Runs helm against this cluster; the release is uninstalled at the end whatever
    happened (the other modules install the operator with kustomize)."""
    paused = [o for o in OperatorProcess.started if o.running()]  # one operator at a time
    for other in paused:
        other.stop()
    demo.uninstall_webhook(cluster)  # the kustomize install's (the chart's Job makes a new pair)
    name, digest = images["operator"].split("@")
    values = tmp_path_factory.mktemp("helm") / "values.yaml"
    # The operator's pod on the real node (KWOK's nodes run nothing), its image by digest.
    values.write_text(yaml.safe_dump({
        "image": {"repository": name, "digest": digest},
        "nodeSelector": {LOCAL_NODE_LABEL: "true"},
        "tolerations": [{"key": LOCAL_TAINT["key"], "operator": "Exists", "effect": "NoSchedule"}]}))

    def run(*args: str, check: bool = True):
        return run_helm(*args, "--kubeconfig", str(cluster.kubeconfig), check=check)

    try:
        yield run, values
    finally:
        run("uninstall", RELEASE, "-n", NAMESPACE, "--wait", "--ignore-not-found", check=False)
        # The release took the kustomize install's ServiceAccount and RBAC over and removed
        # them: back they come, and the host operators get new tokens (a token is bound to
        # its ServiceAccount's uid).
        demo.install_api(cluster)
        for other in paused:
            cluster.service_account_kubeconfig(NAMESPACE, "rftjob-operator", other.kubeconfig)
            other.start()


def operator_pods(api) -> list[kubernetes.client.V1Pod]:
    """The operator's ready replicas."""
    pods = kubernetes.client.CoreV1Api(api).list_namespaced_pod(
        NAMESPACE, label_selector="app.kubernetes.io/name=rftjob-operator").items
    return [p for p in pods if p.metadata.deletion_timestamp is None and p.status.phase == "Running"
            and all(cs.ready for cs in p.status.container_statuses or [])]


@pytest.mark.timeout(900)
def test_helm_install_train_upgrade_uninstall(helm, cluster, kubectl, s3, images, tmp_path):
    run, values = helm
    api = kubernetes.config.new_client_from_config(str(cluster.kubeconfig))
    custom = kubernetes.client.CustomObjectsApi(api)
    # The integration tests applied the kustomize install's objects to this cluster before:
    # --take-ownership adopts them (--force-conflicts: kubectl owns their fields by
    # server-side apply), as for a team moving from kustomize to Helm. The Deployment goes
    # first: fields only kubectl set (a test's patch) would stay in it.
    kubectl("delete", "deployment", "rftjob-operator", "-n", NAMESPACE, "--ignore-not-found")
    run("install", RELEASE, str(CHART), "-n", NAMESPACE, "--create-namespace", "--take-ownership",
        "--force-conflicts", "-f", str(values), "--wait", "--timeout", "240s")
    first = wait_for(lambda: len(p := operator_pods(api)) == 2 and p, 120, "both operator replicas ready")
    assert all("--log-format=json" in p.spec.containers[0].args for p in first)
    kubectl("get", "poddisruptionbudget", "rftjob-operator", "-n", NAMESPACE)

    ns = f"helm-{uuid.uuid4().hex[:6]}"
    kubectl("create", "namespace", ns)
    kubectl("label", "namespace", ns, f"{names.PSA_ENFORCE_LABEL}=baseline")
    kubectl("apply", "-n", ns, "-f", str(CHART.parents[1] / "manifests/samples/s3-secret.example.yaml"))
    job = copy.deepcopy(SAMPLE)
    spec = job["spec"]
    spec["model"]["path"] = "s3://rft-helm/models/tiny"
    spec["explorer"]["tasksetUri"] = "s3://rft-helm/data/arith.jsonl"
    spec["checkpoint"].update(uri=f"s3://rft-helm/runs/{ns}", endpoint=s3.url, interval=3)
    spec["trainer"].update(image=images["trainer"], totalSteps=10)
    name = job["metadata"]["name"]
    custom.create_namespaced_custom_object(names.GROUP, names.VERSION, ns, names.PLURAL, job)

    def status() -> dict:
        return custom.get_namespaced_custom_object(names.GROUP, names.VERSION, ns, names.PLURAL, name).get("status") or {}

    def trainer_pods() -> dict[str, str]:
        pods = kubernetes.client.CoreV1Api(api).list_namespaced_pod(
            ns, label_selector=f"{names.LABEL_JOB}={name},{names.LABEL_ROLE}={names.ROLE_TRAINER}").items
        return {p.metadata.name: p.metadata.uid for p in pods}

    wait_for(lambda: ((status().get("trainer") or {}).get("step") or 0) >= 2, 400, "the job training")
    before = trainer_pods()

    # The chart's defaults hold the owner webhook (its Job made the pair, the replicas
    # serve it): the operator's own token gets nothing for a made-up job beside this one.
    token = cluster.service_account_kubeconfig(NAMESPACE, "rftjob-operator", tmp_path / "op.kubeconfig")
    operator = kubernetes.client.CoreV1Api(kubernetes.config.new_client_from_config(str(token)))
    ghost = {"metadata": {"name": "ghost-rft-trainer", "labels": {names.LABEL_JOB: "ghost",
                                                                  names.LABEL_MANAGED_BY: names.MANAGED_BY},
                          "ownerReferences": [{"apiVersion": names.API_VERSION, "kind": names.KIND, "name": "ghost",
                                               "uid": str(uuid.uuid4()), "controller": True}]}}
    with pytest.raises(kubernetes.client.ApiException) as refused:
        operator.create_namespaced_service_account(ns, ghost, dry_run="All")
    assert refused.value.status == 403 and f"there is no RFTJob {ns}/ghost" in str(refused.value.body)

    # An upgrade with changed values while the job trains: new replicas roll in (the leader
    # hands the Lease over as it stops), the metrics Service is added; the job carries on
    # as if nothing happened.
    run("upgrade", RELEASE, str(CHART), "-n", NAMESPACE, "-f", str(values), "--set", "logFormat=plain",
        "--set", "metrics.service.enabled=true", "--wait", "--timeout", "300s")
    old = {p.metadata.uid for p in first}
    second = wait_for(lambda: len(p := operator_pods(api)) == 2 and not {x.metadata.uid for x in p} & old and p,
                      120, "the upgraded replicas ready")
    assert all("--log-format=plain" in p.spec.containers[0].args for p in second)
    kubectl("get", "service", "rftjob-operator-metrics", "-n", NAMESPACE)
    s = wait_for(lambda: (s := status()).get("phase") in ("Succeeded", "Failed") and s, 600, "the job to end")
    assert s["phase"] == "Succeeded", s
    assert (s.get("restarts") or 0, s.get("attempt")) == (0, 1), s
    assert trainer_pods() == before  # not one trainer pod replaced across the upgrade

    # Uninstall: the operator goes; the CRD and the job stay (Helm keeps crds/).
    run("uninstall", RELEASE, "-n", NAMESPACE, "--wait")
    wait_for(lambda: not kubernetes.client.AppsV1Api(api).list_namespaced_deployment(NAMESPACE).items, 60,
             "the Deployment gone")
    assert not kubectl("get", "clusterrole", "rftjob-operator", "--ignore-not-found", "-o", "name").stdout.strip()
    kubectl("get", "crd", "rftjobs.rft.dev")
    assert status()["phase"] == "Succeeded"
    listed = json.loads(run("list", "-A", "-o", "json").stdout)
    assert not [r for r in listed if r["name"] == RELEASE], listed

    # Helm -> kustomize, as README says (`helm uninstall`, then `kubectl apply -k manifests/`):
    # the Secret the chart's Job wrote stays and is kept; the owner check is in force again.
    secret = kubectl("get", "secret", "rftjob-operator-webhook-tls", "-n", NAMESPACE, "-o",
                     "jsonpath={.metadata.resourceVersion}").stdout
    try:
        demo.install(cluster, images["operator"])
        # A new token: the one above was bound to the release's ServiceAccount, now gone.
        token = cluster.service_account_kubeconfig(NAMESPACE, "rftjob-operator", tmp_path / "op2.kubeconfig")
        operator = kubernetes.client.CoreV1Api(kubernetes.config.new_client_from_config(str(token)))


        def ghost_refusal() -> str:
            try:
                operator.create_namespaced_service_account(ns, ghost, dry_run="All")
            except kubernetes.client.ApiException as e:
                return f"{e.status} {e.body}"
            return "created"

        # (Until the Job has set the caBundle the API server cannot call it: failing closed.)
        wait_for(lambda: ghost_refusal().startswith("403") and f"there is no RFTJob {ns}/ghost" in ghost_refusal(),
                 120, "the owner webhook of the kustomize install to refuse the made-up job")
        assert kubectl("get", "secret", "rftjob-operator-webhook-tls", "-n", NAMESPACE, "-o",
                       "jsonpath={.metadata.resourceVersion}").stdout == secret  # the pair was current: kept
    finally:
        kubectl("delete", "deployment", "rftjob-operator", "-n", NAMESPACE, "--ignore-not-found")
    kubectl("delete", "namespace", ns, "--wait=false", check=False)
