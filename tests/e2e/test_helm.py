"""The Helm chart on the local cluster's real node, as a platform team uses it: `helm
install` (the real Helm v4; two replicas electing a leader, a PodDisruptionBudget), a sample
RFTJob trained with the operator it installed, `helm upgrade` with changed values while
that job runs (the job goes on: no restart, no pod replaced), and `helm uninstall`, which keeps the CRD and every RFTJob (Helm never deletes
what it installed from crds/). Then the moves README's install section gives, each with a job
training across it: the previous release's chart upgraded to this one, and the previous
release's kustomize install upgraded, moved to Helm and back (e2e/releases.py)."""

from __future__ import annotations

import copy
import json
import uuid

import kubernetes
import pytest
import yaml

from e2e import demo, releases
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


GHOST = "ghost"
OWNER_POLICY = "rftjob-operator-owner"  # the previous release's owner check; this one's is the webhook


def ghost_refusal(cluster, ns: str, path) -> str:
    """What the API server answers the operator's own token (a new one: a token is bound to
    its ServiceAccount's uid, and a move re-creates it) creating a child for a made-up job:
    "403 ..." when refused, "created" when not."""
    token = cluster.service_account_kubeconfig(NAMESPACE, "rftjob-operator", path)
    operator = kubernetes.client.CoreV1Api(kubernetes.config.new_client_from_config(str(token)))
    ghost = {"metadata": {"name": f"{GHOST}-rft-trainer", "labels": {names.LABEL_JOB: GHOST,
                                                                     names.LABEL_MANAGED_BY: names.MANAGED_BY},
                          "ownerReferences": [{"apiVersion": names.API_VERSION, "kind": names.KIND, "name": GHOST,
                                               "uid": str(uuid.uuid4()), "controller": True}]}}
    try:
        operator.create_namespaced_service_account(ns, ghost, dry_run="All")
    except kubernetes.client.ApiException as e:
        return f"{e.status} {e.body}"
    return "created"


def wait_owner_webhook_refuses(cluster, ns: str, path) -> None:
    """The owner webhook in force: its refusal (until the certificate Job has set the
    caBundle the API server cannot call it, and fails closed with another message)."""
    wait_for(lambda: (r := ghost_refusal(cluster, ns, path)).startswith("403")
             and f"there is no RFTJob {ns}/{GHOST}" in r, 120, "the owner webhook to refuse the made-up job")


class TrainingJob:
    """The sample RFTJob in a namespace of its own, training from this module's S3."""

    def __init__(self, api, kubectl, s3, images, prefix: str, total_steps: int, interval: int):
        self.api, self.custom = api, kubernetes.client.CustomObjectsApi(api)
        self.ns = f"{prefix}-{uuid.uuid4().hex[:6]}"
        kubectl("create", "namespace", self.ns)
        kubectl("label", "namespace", self.ns, f"{names.PSA_ENFORCE_LABEL}=baseline")
        kubectl("apply", "-n", self.ns, "-f", str(CHART.parents[1] / "manifests/samples/s3-secret.example.yaml"))
        job = copy.deepcopy(SAMPLE)
        spec = job["spec"]
        spec["model"]["path"] = "s3://rft-helm/models/tiny"
        spec["explorer"]["tasksetUri"] = "s3://rft-helm/data/arith.jsonl"
        spec["checkpoint"].update(uri=f"s3://rft-helm/runs/{self.ns}", endpoint=s3.url, interval=interval)
        spec["trainer"].update(image=images["trainer"], totalSteps=total_steps)
        self.name = job["metadata"]["name"]
        self.custom.create_namespaced_custom_object(names.GROUP, names.VERSION, self.ns, names.PLURAL, job)

    def status(self) -> dict:
        return self.custom.get_namespaced_custom_object(
            names.GROUP, names.VERSION, self.ns, names.PLURAL, self.name).get("status") or {}

    def step(self) -> int:
        return (self.status().get("trainer") or {}).get("step") or 0

    def target(self) -> int:
        """The weight version the operator last promoted (`status.weightSync.target`): the
        operator writes it, so its moving on shows an operator at work."""
        return ((self.status().get("weightSync") or {}).get("target") or {}).get("version") or 0

    def pods(self, role: str | None = None) -> dict[str, str]:
        """The job's pods (of one role), name -> uid."""
        selector = f"{names.LABEL_JOB}={self.name}" + (f",{names.LABEL_ROLE}={role}" if role else "")
        pods = kubernetes.client.CoreV1Api(self.api).list_namespaced_pod(self.ns, label_selector=selector).items
        return {p.metadata.name: p.metadata.uid for p in pods}

    def goes_on(self, before: dict[str, str], what: str) -> None:
        """After a move: the job's pods are the same ones, the trainer steps on and the
        operator running after the move promotes its weights; no restart was counted. (The job never ends within a test: its totalSteps is large.)"""
        step, target = self.step(), self.target()
        wait_for(lambda: self.step() > step and self.target() > target, 300,
                 f"the job to train on and its weights to be promoted after {what}")
        assert self.pods() == before, f"a pod was replaced across {what}"
        s = self.status()
        assert s.get("phase") == "Running" and (s.get("restarts") or 0, s.get("attempt")) == (0, 1), s


def owner_policy(kubectl) -> str:
    return kubectl("get", "validatingadmissionpolicy,validatingadmissionpolicybinding", OWNER_POLICY,
                   "--ignore-not-found", "-o", "name").stdout.strip()


@pytest.mark.timeout(900)
def test_helm_install_train_upgrade_uninstall(helm, cluster, kubectl, s3, images, tmp_path):
    run, values = helm
    api = kubernetes.config.new_client_from_config(str(cluster.kubeconfig))
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

    job = TrainingJob(api, kubectl, s3, images, "helm", total_steps=10, interval=3)
    wait_for(lambda: job.step() >= 2, 400, "the job training")
    before = job.pods(names.ROLE_TRAINER)

    # The chart's defaults hold the owner webhook (its Job made the pair, the replicas
    # serve it): the operator's own token gets nothing for a made-up job beside this one.
    refused = ghost_refusal(cluster, job.ns, tmp_path / "op.kubeconfig")
    assert refused.startswith("403") and f"there is no RFTJob {job.ns}/{GHOST}" in refused, refused

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
    s = wait_for(lambda: (s := job.status()).get("phase") in ("Succeeded", "Failed") and s, 600, "the job to end")
    assert s["phase"] == "Succeeded", s
    assert (s.get("restarts") or 0, s.get("attempt")) == (0, 1), s
    assert job.pods(names.ROLE_TRAINER) == before  # not one trainer pod replaced across the upgrade

    # Uninstall: the operator goes; the CRD and the job stay (Helm keeps crds/).
    run("uninstall", RELEASE, "-n", NAMESPACE, "--wait")
    wait_for(lambda: not kubernetes.client.AppsV1Api(api).list_namespaced_deployment(NAMESPACE).items, 60,
             "the Deployment gone")
    assert not kubectl("get", "clusterrole", "rftjob-operator", "--ignore-not-found", "-o", "name").stdout.strip()
    kubectl("get", "crd", "rftjobs.rft.dev")
    assert job.status()["phase"] == "Succeeded"
    listed = json.loads(run("list", "-A", "-o", "json").stdout)
    assert not [r for r in listed if r["name"] == RELEASE], listed

    # Helm -> kustomize, as README says (`helm uninstall`, then `kubectl apply -k manifests/`):
    # the Secret the chart's Job wrote stays and is kept; the owner check is in force again.
    secret = kubectl("get", "secret", "rftjob-operator-webhook-tls", "-n", NAMESPACE, "-o",
                     "jsonpath={.metadata.resourceVersion}").stdout
    try:
        demo.install(cluster, images["operator"])
        wait_owner_webhook_refuses(cluster, job.ns, tmp_path / "op2.kubeconfig")
        assert kubectl("get", "secret", "rftjob-operator-webhook-tls", "-n", NAMESPACE, "-o",
                       "jsonpath={.metadata.resourceVersion}").stdout == secret  # the pair was current: kept
    finally:
        kubectl("delete", "deployment", "rftjob-operator", "-n", NAMESPACE, "--ignore-not-found")
    kubectl("delete", "namespace", job.ns, "--wait=false", check=False)


def as_before_the_previous_release(run, cluster, kubectl) -> None:
    """No operator and none of the owner webhook's objects (its configuration, Secret and Job,
    and the Service and identity of manifests/base/owner-webhook.yaml), as on a cluster that
    ran the previous release; a release a failed test before left behind goes too."""
    run("uninstall", RELEASE, "-n", NAMESPACE, "--wait", "--ignore-not-found", check=False)
    kubectl("delete", "deployment", "rftjob-operator", "-n", NAMESPACE, "--ignore-not-found")
    demo.uninstall_webhook(cluster)
    kubectl("delete", "-f", str(CHART.parents[1] / "manifests/base/owner-webhook.yaml"), "--ignore-not-found")


@pytest.mark.timeout(900)
def test_the_previous_releases_chart_upgraded_with_a_job_running(helm, cluster, kubectl, s3, images, tmp_path):
    """README's Helm upgrade (`helm upgrade` to this chart) from the previous release, whose
    owner check was the policy rftjob-operator-owner: the policy goes, the owner webhook is in
    force, and a job training across the upgrade goes on with the same pods."""
    run, values = helm
    api = kubernetes.config.new_client_from_config(str(cluster.kubeconfig))
    as_before_the_previous_release(run, cluster, kubectl)
    job = None
    try:
        # The release's CRD first, as its chart's crds/ installed it (the snapshot leaves them out).
        demo.kubectl(cluster, "apply", "--server-side", "--force-conflicts", "-f", "-", input=releases.crd())
        kubectl("wait", "--for=condition=Established", "crd/rftjobs.rft.dev", "--timeout=60s")
        run("install", RELEASE, str(releases.chart()), "-n", NAMESPACE, "--create-namespace", "--take-ownership",
            "--force-conflicts", "-f", str(values), "--wait", "--timeout", "240s")
        wait_for(lambda: len(operator_pods(api)) == 2, 120, "both replicas of the previous release ready")
        assert owner_policy(kubectl), "the previous release's chart installs its owner policy"
        job = TrainingJob(api, kubectl, s3, images, "helm-prev", total_steps=100_000, interval=5)
        wait_for(lambda: job.step() >= 1 and job.target() >= 1, 400, "the job training under the previous release")
        before = job.pods()

        run("upgrade", RELEASE, str(CHART), "-n", NAMESPACE, "-f", str(values), "--wait", "--timeout", "300s")
        assert not owner_policy(kubectl), "helm upgrade removes the previous release's owner policy"
        wait_owner_webhook_refuses(cluster, job.ns, tmp_path / "op.kubeconfig")
        job.goes_on(before, "the upgrade from the previous release's chart")
    finally:
        run("uninstall", RELEASE, "-n", NAMESPACE, "--wait", "--ignore-not-found", check=False)
        if job:  # its pods gone before the next test: they would share the node's two cores with it
            kubectl("delete", "namespace", job.ns, "--timeout=180s", check=False)


@pytest.mark.timeout(1200)
def test_the_previous_kustomize_install_upgraded_moved_to_helm_and_back_with_a_job_running(
        helm, cluster, kubectl, s3, images, tmp_path):
    """README's moves, in its words, each with the same job training across it: the previous
    release's `kubectl apply -k manifests/` upgraded to this one's, kustomize -> Helm, and
    Helm -> kustomize. After each the owner webhook refuses a made-up job, no pod of the job
    was replaced, and the operator running after the move promotes the trainer's next weights."""
    run, values = helm
    api = kubernetes.config.new_client_from_config(str(cluster.kubeconfig))
    as_before_the_previous_release(run, cluster, kubectl)
    job = None
    try:
        demo.install(cluster, images["operator"], manifests=releases.manifests())
        assert owner_policy(kubectl), "the previous release's kustomize install has its owner policy"
        job = TrainingJob(api, kubectl, s3, images, "kust-prev", total_steps=100_000, interval=5)
        wait_for(lambda: job.step() >= 1 and job.target() >= 1, 400, "the job training under the previous release")
        before = job.pods()

        # From an earlier release (README): its owner policy goes, then the install is applied.
        kubectl("delete", "validatingadmissionpolicybinding,validatingadmissionpolicy", OWNER_POLICY,
                "--ignore-not-found")
        demo.install(cluster, images["operator"])  # (deletes the certificate Job first, as README does)
        assert not owner_policy(kubectl)
        wait_owner_webhook_refuses(cluster, job.ns, tmp_path / "op1.kubeconfig")
        job.goes_on(before, "the upgrade of the kustomize install")

        # kustomize -> Helm.
        kubectl("delete", "deployment", "rftjob-operator", "-n", NAMESPACE)
        kubectl("delete", "job", demo.CERTS_JOB, "-n", NAMESPACE, "--ignore-not-found")
        run("install", RELEASE, str(CHART), "-n", NAMESPACE, "--take-ownership", "--force-conflicts",
            "-f", str(values), "--wait", "--timeout", "240s")
        wait_owner_webhook_refuses(cluster, job.ns, tmp_path / "op2.kubeconfig")
        job.goes_on(before, "the move to Helm")

        # Helm -> kustomize.
        run("uninstall", RELEASE, "-n", NAMESPACE, "--wait")
        demo.install(cluster, images["operator"])
        wait_owner_webhook_refuses(cluster, job.ns, tmp_path / "op3.kubeconfig")
        job.goes_on(before, "the move back to kustomize")
    finally:
        run("uninstall", RELEASE, "-n", NAMESPACE, "--wait", "--ignore-not-found", check=False)
        kubectl("delete", "deployment", "rftjob-operator", "-n", NAMESPACE, "--ignore-not-found")
        if job:  # its pods gone before the next test: they would share the node's two cores with it
            kubectl("delete", "namespace", job.ns, "--timeout=180s", check=False)
