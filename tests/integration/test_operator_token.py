"""A leaked operator token, used as an attacker would: the operator's ServiceAccount token
(TokenRequest), RBAC from manifests/base/rbac.yaml and the admission policies from
manifests/base/admission-policies.yaml, against the real API server (with its PodSecurity
admission). Every refusal has an accepted twin, so the refusal is the rule's doing and not
a broken request. Dry runs, except where the point is that nothing gets created.

The owner webhook is on, as in the default install (tests/integration/conftest.py's
`installed` serves it here): it looks up the RFTJob an object claims and holds a pod to
what that job's spec renders. What the token can still do is listed in docs/security.md
section.
"""

from __future__ import annotations

import copy
import uuid
from datetime import datetime, timezone

import kubernetes
import pytest

from rft_contract import names

from .conftest import wait_for
from .operator_fixtures import create_job, get_job, job_manifest
from .test_rbac import OPERATOR_NS, OPERATOR_SA, managed_meta, client_as, patch_status_as, refusal

pytestmark = pytest.mark.integration
DRY = {"dry_run": "All"}
BOX = {"name": "x", "image": "busybox"}


@pytest.fixture
def operator_api(cluster, installed, tmp_path):
    return client_as(cluster, tmp_path, OPERATOR_NS, OPERATOR_SA)


def refused(call, *words: str, code: int = 403) -> str:
    got, message = refusal(call)
    assert got == code and all(w in message for w in words), (got, message)
    return message


def refused_any(call, *words: str) -> None:
    """Refused (403) with one of `words`: two policies may both refuse, and the API server
    names one."""
    got, message = refusal(call)
    assert got == 403 and any(w in message for w in words), (got, message)


def refused_by_policy(code: int, message: str) -> bool:
    """Refused by the API server's PodSecurity admission or by our policy (not by the
    API's validation of a malformed pod, which would prove nothing)."""
    return code in (403, 422) and ("violates PodSecurity" in message or "rftjob-operator-" in message)


def trainer_pod(job: dict, namespace: str, name: str = "", **spec) -> dict:
    job_name = job["metadata"]["name"]
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {**managed_meta(job, name or f"{job_name}-trainer-9-0", "trainer"), "namespace": namespace},
            "spec": {"serviceAccountName": f"{job_name}-rft-trainer", "containers": [BOX], **spec}}


def accounts(kubectl, namespace: str, job: str) -> None:
    """The job's ServiceAccounts (as admin): a pod is admitted only if its account exists."""
    for role in ("trainer", "inference"):
        kubectl("create", "serviceaccount", f"{job}-rft-{role}", "-n", namespace, check=False)


# ------------------------------------------------------------------ the ghost job


def test_a_job_that_does_not_exist_gets_nothing(operator_api, api, kubectl, namespace):
    """The audit's escalation, for real (no dry run): in a namespace with no RFTJob the
    operator's token made a ServiceAccount and a pod for a job `ghost` that reads another
    application's Secret. Refused, and nothing is created."""
    core = kubernetes.client.CoreV1Api(operator_api)
    kubectl("create", "secret", "generic", "app-db", "-n", namespace, "--from-literal=password=hunter2")
    ghost = {"metadata": {"name": "ghost", "uid": str(uuid.uuid4())}}
    kubectl("create", "serviceaccount", "ghost-rft-trainer", "-n", namespace)  # as if it had got that far
    refused(lambda: core.create_namespaced_service_account(namespace, {"metadata": managed_meta(ghost, "ghost-rft-x")}),
            "rftjob-operator-owner", f"there is no RFTJob {namespace}/ghost")
    # A second owner (a ConfigMap the garbage collector cannot delete) does not help.
    meta = managed_meta(ghost, "ghost-trainer-1-0", "trainer")
    admin = kubernetes.client.CoreV1Api(api)
    ca = wait_for(lambda: next((m.metadata.uid for m in admin.list_namespaced_config_map(namespace).items
                                if m.metadata.name == "kube-root-ca.crt"), None), 60, "kube-root-ca.crt")
    meta["ownerReferences"].append({"apiVersion": "v1", "kind": "ConfigMap", "name": "kube-root-ca.crt", "uid": ca})
    reader = {**BOX, "env": [{"name": "P", "valueFrom": {"secretKeyRef": {"name": "app-db", "key": "password"}}}]}
    pod = {"metadata": meta, "spec": {"serviceAccountName": "ghost-rft-trainer", "containers": [reader]}}
    got, message = refusal(lambda: core.create_namespaced_pod(namespace, pod))
    # The scope policy (one owner) and the owner webhook both refuse; the API server names one.
    assert got == 403 and ("ValidatingAdmissionPolicy 'rftjob-operator-scope'" in message
                           or "rftjob-operator-owner" in message), (got, message)
    assert [p.metadata.name for p in admin.list_namespaced_pod(namespace).items] == []
    assert "ghost-rft-x" not in [s.metadata.name for s in admin.list_namespaced_service_account(namespace).items]

    # With a real RFTJob in the namespace: its name with another uid, or a second owner,
    # are refused too; the real job's own child passes.
    job = create_job(api, namespace, job_manifest("real"))
    accounts(kubectl, namespace, "real")
    forged = copy.deepcopy(job)
    forged["metadata"]["uid"] = str(uuid.uuid4())
    refused(lambda: core.create_namespaced_pod(namespace, trainer_pod(forged, namespace), **DRY),
            "belong to an RFTJob that exists")
    two = trainer_pod(job, namespace)
    two["metadata"]["ownerReferences"].append(meta["ownerReferences"][1])
    refused_any(lambda: core.create_namespaced_pod(namespace, two, **DRY), "exactly one owner reference",
                "belong to an RFTJob that exists")
    wait_for(lambda: refusal(lambda: core.create_namespaced_pod(namespace, trainer_pod(job, namespace), **DRY))
             == (200, ""), 30, "the policy to see the new RFTJob")


# ------------------------------------------------------------------ Pod Security

# One case per control of the Pod Security Standards: (name, the pod's spec as refused,
# the accepted twin). Baseline, in a namespace enforcing baseline.
CONTAINER = lambda **sc: {"containers": [{**BOX, "securityContext": sc}]}  # noqa: E731
BASELINE = [
    # (The API server's validation wants hostNetwork with hostProcess.)
    ("hostProcess", {**CONTAINER(windowsOptions={"hostProcess": True}), "hostNetwork": True},
     CONTAINER(windowsOptions={"hostProcess": False})),
    ("hostNetwork", {"containers": [BOX], "hostNetwork": True}, {"containers": [BOX], "hostNetwork": False}),
    ("hostPID", {"containers": [BOX], "hostPID": True}, {"containers": [BOX], "hostPID": False}),
    ("hostIPC", {"containers": [BOX], "hostIPC": True}, {"containers": [BOX], "hostIPC": False}),
    ("privileged", CONTAINER(privileged=True), CONTAINER(privileged=False)),
    ("capabilities", CONTAINER(capabilities={"add": ["SYS_ADMIN"]}), CONTAINER(capabilities={"add": ["CHOWN"]})),
    ("hostPath", {"containers": [BOX], "volumes": [{"name": "h", "hostPath": {"path": "/etc"}}]},
     {"containers": [BOX], "volumes": [{"name": "h", "emptyDir": {}}]}),
    ("hostPorts", {"containers": [{**BOX, "ports": [{"containerPort": 80, "hostPort": 80}]}]},
     {"containers": [{**BOX, "ports": [{"containerPort": 80}]}]}),
    ("appArmor", CONTAINER(appArmorProfile={"type": "Unconfined"}), CONTAINER(appArmorProfile={"type": "RuntimeDefault"})),
    ("seLinux type", CONTAINER(seLinuxOptions={"type": "spc_t"}), CONTAINER(seLinuxOptions={"type": "container_t"})),
    ("seLinux user", CONTAINER(seLinuxOptions={"user": "system_u"}), CONTAINER(seLinuxOptions={"level": "s0:c1"})),
    # (PodSecurity's baseline allows Unmasked in a user namespace since Kubernetes 1.33; our
    # policy does not: no job needs it.)
    ("procMount", {**CONTAINER(procMount="Unmasked"), "hostUsers": False},
     {**CONTAINER(procMount="Default"), "hostUsers": False}),
    ("seccomp", {"containers": [BOX], "securityContext": {"seccompProfile": {"type": "Unconfined"}}},
     {"containers": [BOX], "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}}}),
    ("sysctls", {"containers": [BOX], "securityContext": {"sysctls": [{"name": "kernel.msgmax", "value": "1"}]}},
     {"containers": [BOX], "securityContext": {"sysctls": [{"name": "net.ipv4.tcp_syncookies", "value": "1"}]}}),
]
# Restricted adds these, in a namespace enforcing restricted; the twin is the operator's
# own default (non-root, no escalation, ALL dropped, RuntimeDefault).
RESTRICTED_OK = {"securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "seccompProfile": {"type": "RuntimeDefault"}},
                 "containers": [{**BOX, "securityContext": {"allowPrivilegeEscalation": False,
                                                            "capabilities": {"drop": ["ALL"]}}}]}


def _restricted(change) -> dict:
    spec = copy.deepcopy(RESTRICTED_OK)
    change(spec)
    return spec


RESTRICTED = [
    ("allowPrivilegeEscalation", _restricted(lambda s: s["containers"][0]["securityContext"].update(
        allowPrivilegeEscalation=True))),
    ("runAsNonRoot", _restricted(lambda s: s["securityContext"].pop("runAsNonRoot"))),
    ("runAsUser 0", _restricted(lambda s: s["securityContext"].update(runAsUser=0))),
    ("seccomp unset", _restricted(lambda s: s["securityContext"].pop("seccompProfile"))),
    ("capabilities not dropped", _restricted(lambda s: s["containers"][0]["securityContext"].pop("capabilities"))),
    ("volume type", _restricted(lambda s: s.update(volumes=[{"name": "n", "nfs": {"server": "x", "path": "/"}}]))),
]


@pytest.mark.parametrize("name, bad, good", BASELINE, ids=[b[0] for b in BASELINE])
def test_each_baseline_control_is_enforced_on_the_operators_pods(operator_api, api, kubectl, namespace,
                                                                 name, bad, good):
    # The spec adds CHOWN (baseline allows it): the owner webhook admits only what it renders.
    job = create_job(api, namespace, job_manifest("psa", trainer={"securityContext": {"addCapabilities": ["CHOWN"]}}))
    accounts(kubectl, namespace, "psa")
    core = kubernetes.client.CoreV1Api(operator_api)
    wait_for(lambda: refusal(lambda: core.create_namespaced_pod(namespace, trainer_pod(job, namespace, **good), **DRY))
             == (200, ""), 30, f"the twin of {name} to be admitted")
    got, message = refusal(lambda: core.create_namespaced_pod(namespace, trainer_pod(job, namespace, **bad), **DRY))
    assert refused_by_policy(got, message), (name, got, message)


@pytest.mark.parametrize("name, bad", RESTRICTED, ids=[r[0] for r in RESTRICTED])
def test_each_restricted_control_is_enforced_where_the_namespace_asks(operator_api, api, kubectl, namespace,
                                                                      name, bad):
    kubectl("label", "namespace", namespace, f"{names.PSA_ENFORCE_LABEL}=restricted", "--overwrite")
    job = create_job(api, namespace, job_manifest("psa"))
    accounts(kubectl, namespace, "psa")
    core = kubernetes.client.CoreV1Api(operator_api)
    wait_for(lambda: refusal(lambda: core.create_namespaced_pod(
        namespace, trainer_pod(job, namespace, **RESTRICTED_OK), **DRY)) == (200, ""), 30, "the restricted twin")
    got, message = refusal(lambda: core.create_namespaced_pod(namespace, trainer_pod(job, namespace, **bad), **DRY))
    assert refused_by_policy(got, message), (name, got, message)


def test_job_pods_need_a_namespace_that_enforces_pod_security(operator_api, api, kubectl, namespace):
    job = create_job(api, namespace, job_manifest("psa"))
    accounts(kubectl, namespace, "psa")
    core = kubernetes.client.CoreV1Api(operator_api)
    kubectl("label", "namespace", namespace, f"{names.PSA_ENFORCE_LABEL}-")
    wait_for(lambda: refusal(lambda: core.create_namespaced_pod(namespace, trainer_pod(job, namespace), **DRY))[0]
             == 422, 30, "the policy to see the label gone")
    refused(lambda: core.create_namespaced_pod(namespace, trainer_pod(job, namespace), **DRY),
            f"{names.PSA_ENFORCE_LABEL}=baseline", code=422)
    kubectl("label", "namespace", namespace, f"{names.PSA_ENFORCE_LABEL}=privileged")
    refused(lambda: core.create_namespaced_pod(namespace, trainer_pod(job, namespace), **DRY),
            f"{names.PSA_ENFORCE_LABEL}=baseline", code=422)


# ------------------------------------------------------------------ volumes


def test_pods_mount_only_what_the_spec_renders(operator_api, api, kubectl, namespace):
    job = create_job(api, namespace, job_manifest("vol", model={"path": "s3://models/tiny",
                                                                "cache": {"persistentVolumeClaim": "models"}}))
    accounts(kubectl, namespace, "vol")
    core = kubernetes.client.CoreV1Api(operator_api)
    pod = lambda *volumes: trainer_pod(job, namespace, volumes=list(volumes))  # noqa: E731
    good = [{"name": "scratch", "emptyDir": {}},
            {"name": "config", "configMap": {"name": "vol-config"}},
            {"name": "model-cache", "persistentVolumeClaim": {"claimName": "models"}},
            {"name": "token", "projected": {"sources": [{"serviceAccountToken": {"path": "t"}}]}}]
    wait_for(lambda: refusal(lambda: core.create_namespaced_pod(namespace, pod(*good), **DRY)) == (200, ""), 30,
             "the spec's own volumes to be admitted")
    words = "mounts only what the job's spec renders"
    for bad in ({"name": "nfs", "nfs": {"server": "203.0.113.9", "path": "/"}},
                {"name": "model-cache", "persistentVolumeClaim": {"claimName": "another-apps-data"}},
                {"name": "data", "persistentVolumeClaim": {"claimName": "models"}},
                {"name": "config", "configMap": {"name": "someone-elses"}},
                {"name": "p", "projected": {"sources": [{"configMap": {"name": "someone-elses"}}]}}):
        refused(lambda: core.create_namespaced_pod(namespace, pod(good[0], bad), **DRY), words)


def test_pods_read_only_the_secrets_their_spec_names(operator_api, api, kubectl, namespace):
    """A real job's pod is no way into another application's Secret: only the Secrets the
    RFTJob names (S3 credentials, env secretKeyRefs) reach its pods."""
    job = create_job(api, namespace, job_manifest("sec", trainer={
        **job_manifest("sec")["spec"]["trainer"],
        "env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}]}))
    accounts(kubectl, namespace, "sec")
    core = kubernetes.client.CoreV1Api(operator_api)
    credentials = job["spec"]["checkpoint"].get("credentialsSecret")
    reads = lambda *secret_names: trainer_pod(job, namespace, containers=[{  # noqa: E731
        **BOX, "env": [{"name": f"S{i}", "valueFrom": {"secretKeyRef": {"name": n, "key": "k"}}}
                       for i, n in enumerate(secret_names)]}])
    named = ["hf"] + ([credentials] if credentials else [])
    wait_for(lambda: refusal(lambda: core.create_namespaced_pod(namespace, reads(*named), **DRY)) == (200, ""), 30,
             "a pod reading the spec's own Secrets to be admitted")
    refused(lambda: core.create_namespaced_pod(namespace, reads("hf", "app-db"), **DRY),
            "read only the Secrets their RFTJob's spec names")
    init = trainer_pod(job, namespace, containers=[BOX], initContainers=[{**BOX, "name": "i", "env": [
        {"name": "P", "valueFrom": {"secretKeyRef": {"name": "app-db", "key": "password"}}}]}])
    refused(lambda: core.create_namespaced_pod(namespace, init, **DRY), "read only the Secrets")


# ------------------------------------------------------------------ events


def test_events_only_about_the_namespaces_rftjobs(operator_api, api, kubectl, namespace):
    job = create_job(api, namespace, job_manifest("ev"))
    core = kubernetes.client.CoreV1Api(operator_api)
    events = kubernetes.client.EventsV1Api(operator_api)

    labels = {names.LABEL_MANAGED_BY: names.MANAGED_BY, names.LABEL_JOB: "ev"}  # as the operator labels its Events

    def event(ns: str, about: dict, **meta) -> dict:
        return {"metadata": {"name": f"x.{uuid.uuid4().hex[:8]}", "namespace": ns, "labels": labels, **meta},
                "involvedObject": about, "reason": "Test", "message": "m", "type": "Normal"}

    rftjob = {"apiVersion": names.API_VERSION, "kind": names.KIND, "name": "ev", "namespace": namespace,
              "uid": job["metadata"]["uid"]}
    wait_for(lambda: refusal(lambda: core.create_namespaced_event(namespace, event(namespace, rftjob), **DRY))
             == (200, ""), 30, "an Event about the job to be admitted")
    # The scope rule and the owner webhook (no RFTJob there) both refuse this one; the API
    # server names one.
    refused_any(lambda: core.create_namespaced_event(
        "kube-system", event("kube-system", {**rftjob, "namespace": "kube-system"}), **DRY),
        "does not act in the kube-* namespaces", "there is no RFTJob kube-system/ev")
    pod = {"apiVersion": "v1", "kind": "Pod", "name": "someone", "namespace": namespace}
    # About a pod: the scope rule refuses, and so does the owner rule (a pod's reference is no
    # RFTJob's uid); the API server names whichever it evaluated first.
    either = ("only about the RFTJobs", "belong to an RFTJob that exists")
    refused_any(lambda: core.create_namespaced_event(namespace, event(namespace, pod), **DRY), *either)
    refused(lambda: core.create_namespaced_event(namespace, event(namespace, {**rftjob, "uid": str(uuid.uuid4())}),
                                                 **DRY), "belong to an RFTJob that exists")
    refused(lambda: core.create_namespaced_event(namespace, event(namespace, rftjob, labels={}), **DRY),
            "only about the RFTJobs")  # unlabelled: the owner check would not see it
    # events.k8s.io names the object `regarding`.
    new = {"metadata": {"name": f"y.{uuid.uuid4().hex[:8]}", "namespace": namespace, "labels": labels},
           "regarding": pod,
           "reason": "Test", "note": "m", "type": "Normal", "action": "Test", "reportingController": "x/y",
           "reportingInstance": "x", "eventTime": datetime.now(timezone.utc).replace(microsecond=1)}
    refused_any(lambda: events.create_namespaced_event(namespace, new, **DRY), *either)
    events.create_namespaced_event(namespace, {**new, "regarding": rftjob}, **DRY)


# ------------------------------------------------------------------ the status


def test_the_operator_writes_only_its_own_status_fields(operator_api, api, namespace):
    create_job(api, namespace, job_manifest("st"))
    pod = "st-inference-0"
    patch_status_as(api, namespace, "st", {"trainer": {"step": 2, "progress": "2/10"},  # as admin
                                           "weightSync": {"replicas": {pod: {"version": 2}, "gone": {"version": 1}}}})()
    for status in ({"trainer": {"latestWeights": {"version": 99, "uri": "s3://evil/w", "id": "x"}}},
                   {"trainer": {"step": 3}},
                   {"weightSync": {"replicas": {pod: {"version": 3}}}},
                   {"weightSync": {"replicas": {"new-pod": {"version": 3}}}}):
        refused(patch_status_as(operator_api, namespace, "st", status), "rftjob-operator's identity may not write")
    # Its own: phase, conditions, the sync target; pruning an entry of a pod that is gone.
    for status in ({"phase": "Running", "message": "m"}, {"weightSync": {"target": {"version": 2}}},
                   {"weightSync": {"replicas": {"gone": None}}}):
        assert refusal(patch_status_as(operator_api, namespace, "st", status)) == (200, ""), status
    stored = get_job(api, namespace, "st")["status"]
    assert stored["trainer"]["step"] == 2 and set(stored["weightSync"]["replicas"]) == {pod}


# ------------------------------------------------------------------ Kueue's Workloads


def test_workloads_only_for_the_namespaces_rftjobs(operator_api, api, namespace, kueue):
    """RBAC grants the operator Workloads (queueing.py); the policies hold it to its own:
    labelled, controlled by an RFTJob of the namespace with its uid."""
    wl_api = kubernetes.client.CustomObjectsApi(operator_api)

    def create(meta: dict):
        body = {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload", "metadata": meta,
                "spec": {"queueName": "q", "podSets": [{"name": "main", "count": 1, "template": {"spec": {
                    "containers": [{"name": "c", "image": "busybox"}]}}}]}}
        return lambda: wl_api.create_namespaced_custom_object("kueue.x-k8s.io", "v1beta2", namespace, "workloads",
                                                              body, dry_run="All")

    ghost = {"metadata": {"name": "ghost", "uid": str(uuid.uuid4())}}  # no RFTJob in the namespace yet
    refused(create(managed_meta(ghost, "rftjob-ghost")), "rftjob-operator-owner", f"there is no RFTJob {namespace}/ghost")
    job = create_job(api, namespace, job_manifest("real"))
    refused(create({"name": "foreign"}), "rftjob-operator-scope", "only touch objects it manages")
    forged = copy.deepcopy(job)
    forged["metadata"]["uid"] = str(uuid.uuid4())
    wait_for(lambda: refusal(create(managed_meta(job, "rftjob-real"))) == (200, ""), 30,
             "the job's own Workload accepted")
    refused(create(managed_meta(forged, "rftjob-real")), "belong to an RFTJob that exists")


# ------------------------------------------------------------------ tracking Secrets


def test_pods_read_the_tracking_secrets_their_spec_names(operator_api, api, kubectl, namespace):
    """spec.tracking's Secrets (MLflow credentials, the W&B key) reach the trainer pods as
    the operator renders them; another Secret under the same variable names does not."""
    from rft_contract.spec import parse_spec
    from rft_operator.objects import build_tracking_env

    tracking = {"mlflow": {"trackingUri": "https://mlflow.example", "experiment": "rft",
                           "credentialsSecret": "mlflow-creds"},
                "wandb": {"project": "rft", "apiKeySecret": "wandb-key"}}
    job = create_job(api, namespace, job_manifest("trk", tracking=tracking))
    accounts(kubectl, namespace, "trk")
    core = kubernetes.client.CoreV1Api(operator_api)
    env = build_tracking_env(parse_spec(job["spec"]))
    assert {e["valueFrom"]["secretKeyRef"]["name"] for e in env} == {"mlflow-creds", "wandb-key"}
    pod = lambda env: trainer_pod(job, namespace, containers=[{**BOX, "env": env}])  # noqa: E731
    wait_for(lambda: refusal(lambda: core.create_namespaced_pod(namespace, pod(env), **DRY)) == (200, ""), 30,
             "a pod reading the spec's tracking Secrets to be admitted")
    for secret in ("mlflow-creds", "wandb-key"):
        other = [{**e, "valueFrom": {"secretKeyRef": {**e["valueFrom"]["secretKeyRef"], "name": "app-db"}}}
                 if e["valueFrom"]["secretKeyRef"]["name"] == secret else e for e in env]
        refused(lambda: core.create_namespaced_pod(namespace, pod(other), **DRY),
                "read only the Secrets their RFTJob's spec names")
