"""Identities, with real tokens from the TokenRequest API against the real API server:
RBAC (manifests/base/rbac.yaml, the per-job Roles) narrowed by the admission policies
(manifests/base/admission-policies.yaml).

* each pod role of a job writes only its own part of the status;
* the operator's identity reaches only what it manages (every path of the audit that led
  towards cluster-admin is refused);
* the namespaced install watches and touches only its namespaces.
"""

from __future__ import annotations

import json
import subprocess
import uuid
from pathlib import Path

import kubernetes
import pytest
import yaml
from kubernetes.client.rest import ApiException

from rft_contract import names
from rft_rollout.explorer import KubeProgress

from .conftest import wait_for
from .operator_fixtures import OperatorProcess, create_job, get_job, job_manifest, wait_phase

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
OPERATOR_NS, OPERATOR_SA = "rftjob-system", "rftjob-operator"


def client_as(cluster, tmp_path: Path, namespace: str, sa: str, pod: tuple[str, str] | None = None):
    kc = cluster.service_account_kubeconfig(namespace, sa, tmp_path / f"{sa}-{uuid.uuid4().hex[:6]}.kubeconfig",
                                            pod=pod)
    return kubernetes.config.new_client_from_config(str(kc))


def refusal(call) -> tuple[int, str]:
    """(HTTP status, the server's message) of a call expected to fail; (200, "") if it did not."""
    try:
        call()
    except ApiException as e:
        try:
            return e.status, json.loads(e.body)["message"]
        except (ValueError, KeyError, TypeError):
            return e.status, str(e.body)
    return 200, ""


def patch_status_as(client, namespace: str, job: str, status: dict):
    return lambda: kubernetes.client.CustomObjectsApi(client).patch_namespaced_custom_object_status(
        names.GROUP, names.VERSION, namespace, names.PLURAL, job, {"status": status})


def pod_ref(api, namespace: str, name: str) -> tuple[str, str]:
    return name, kubernetes.client.CoreV1Api(api).read_namespaced_pod(name, namespace).metadata.uid


def can_i(kubectl, user: str, *args) -> bool:
    return kubectl("auth", "can-i", *args, f"--as={user}", check=False).stdout.strip() == "yes"


# ------------------------------------------------------------------ the job's pods


def test_each_pod_identity_writes_only_its_own_part(operator, api, namespace, cluster, tmp_path):
    job = "loop"
    create_job(api, namespace, job_manifest(job, inference={"replicas": 2, "gpusPerReplica": 1},
                                            explorer={"tasksetUri": "s3://ckpts/tasks.jsonl"}))
    create_job(api, namespace, job_manifest("other"))
    wanted = [names.pod_name(job, 1, 0), names.inference_pod_name(job, 0), names.inference_pod_name(job, 1),
              names.explorer_pod_name(job, 0)]
    core = kubernetes.client.CoreV1Api(api)
    wait_for(lambda: {p.metadata.name for p in core.list_namespaced_pod(namespace).items} >= set(wanted),
             90, "the job's trainer, inference and explorer pods")
    for name in wanted:  # each pod runs as its role's own account
        role = core.read_namespaced_pod(name, namespace).metadata.labels[names.LABEL_ROLE]
        assert core.read_namespaced_pod(name, namespace).spec.service_account_name == f"{job}-rft-{role}"

    trainer = client_as(cluster, tmp_path, namespace, f"{job}-rft-trainer", pod_ref(api, namespace, wanted[0]))
    sync0 = client_as(cluster, tmp_path, namespace, f"{job}-rft-inference", pod_ref(api, namespace, wanted[1]))
    explorer = client_as(cluster, tmp_path, namespace, f"{job}-rft-explorer", pod_ref(api, namespace, wanted[3]))
    unbound = client_as(cluster, tmp_path, namespace, f"{job}-rft-inference")
    own, other = f"{job}-inference-0", f"{job}-inference-1"

    # The trainer: status.trainer, nothing else, and not another job's. The API server's
    # RBAC authorizer reads RoleBindings from its own cache: a binding the operator just
    # created may take a moment to be in force (under load, the first patch saw a 403).
    wait_for(lambda: refusal(patch_status_as(trainer, namespace, job,
                                             {"trainer": {"step": 3, "progress": "3/100"}})) == (200, ""),
             30, "the trainer's RoleBinding in force")
    assert get_job(api, namespace, job)["status"]["trainer"]["step"] == 3
    for status in ({"phase": "Succeeded"}, {"restarts": 7}, {"conditions": []},
                   {"weightSync": {"replicas": {own: {"version": 9}}}}, {"weightSync": {"lagSteps": 0}}):
        code, message = refusal(patch_status_as(trainer, namespace, job, status))
        assert code == 403 and "may change only status.trainer" in message, (status, code, message)
    assert refusal(patch_status_as(trainer, namespace, "other", {"trainer": {"step": 1}}))[0] == 403
    # Fields the status model does not know are pruned at the top and in weightSync, so the
    # policy's field-by-field comparison leaves nothing unchecked there.
    patch_status_as(trainer, namespace, job, {"extra": "x", "weightSync": {"extra": "x"}})()
    stored = get_job(api, namespace, job)["status"]
    assert "extra" not in stored and "extra" not in (stored.get("weightSync") or {})

    # A sync agent: its own pod's replica entry only.
    wait_for(lambda: refusal(patch_status_as(sync0, namespace, job,
                                             {"weightSync": {"replicas": {own: {"version": 1}}}})) == (200, ""),
             30, "the inference RoleBinding in force")
    assert get_job(api, namespace, job)["status"]["weightSync"]["replicas"][own]["version"] == 1
    patch_status_as(api, namespace, job, {"weightSync": {"replicas": {other: {"version": 1}}}})()  # as admin
    for status in ({"weightSync": {"replicas": {other: {"version": 2}}}}, {"weightSync": {"replicas": {other: None}}},
                   {"weightSync": {"target": {"version": 5}}}, {"trainer": {"step": 99}}, {"phase": "Failed"}):
        code, message = refusal(patch_status_as(sync0, namespace, job, status))
        assert code == 403 and "may change only its own pod's entry" in message, (status, code, message)
    code, message = refusal(patch_status_as(unbound, namespace, job, {"weightSync": {"replicas": {own: {"version": 2}}}}))
    assert code == 403 and "bound token" in message, message

    # An explorer reads its job and writes nothing.
    wait_for(lambda: refusal(lambda: kubernetes.client.CustomObjectsApi(explorer).get_namespaced_custom_object(
        names.GROUP, names.VERSION, namespace, names.PLURAL, job)) == (200, ""), 30, "the explorer's RoleBinding in force")
    read = kubernetes.client.CustomObjectsApi(explorer).get_namespaced_custom_object(
        names.GROUP, names.VERSION, namespace, names.PLURAL, job)
    assert read["metadata"]["name"] == job
    # What the explorer process itself reads with that identity: the trainer's progress and
    # the sync agents' records (before: through rftjobs/status, refused with 403).
    progress = KubeProgress(kubernetes.client.CustomObjectsApi(explorer), job, namespace, total_steps=7)
    assert progress() == (3, 100, None, None)  # the progress the trainer reported above
    assert progress.replica_version(own) == 1  # sync0's entry, written above
    assert refusal(patch_status_as(explorer, namespace, job, {"trainer": {"step": 1}}))[0] == 403
    assert refusal(lambda: kubernetes.client.CustomObjectsApi(explorer).get_namespaced_custom_object(
        names.GROUP, names.VERSION, namespace, names.PLURAL, "other"))[0] == 403

    # The namespace's default account has nothing (no RoleBinding can name it any more).
    default = client_as(cluster, tmp_path, namespace, "default")
    assert refusal(patch_status_as(default, namespace, job, {"trainer": {"step": 1}}))[0] == 403


# ------------------------------------------------------------------ the operator


def managed_meta(job: dict, name: str, role: str | None = None) -> dict:
    labels = {names.LABEL_JOB: job["metadata"]["name"], names.LABEL_MANAGED_BY: names.MANAGED_BY}
    if role:
        labels[names.LABEL_ROLE] = role
    owner = {"apiVersion": names.API_VERSION, "kind": names.KIND, "name": job["metadata"]["name"],
             "uid": job["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}
    return {"name": name, "labels": labels, "ownerReferences": [owner]}


def _pod(meta: dict, sa: str, namespace: str) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {**meta, "namespace": namespace},
            "spec": {"serviceAccountName": sa, "containers": [{"name": "x", "image": "busybox"}]}}


def test_operator_identity_reaches_only_what_it_manages(installed, api, cluster, namespace, kubectl, tmp_path):
    """Every path of the audit, with the operator's real token; all dry runs, so a policy
    that fails to refuse harms nothing. Each refusal has an accepted twin, so the refusal
    is the rule's doing and not a broken request."""
    # (Names below are ones no operator creates.) Its spec renders the relaxations beyond
    # baseline tried below (the owner webhook admits only what the job's spec renders).
    job = create_job(api, namespace, job_manifest(
        "owner", model={"path": "s3://models/tiny", "cache": {"hostPath": "/mnt/models"}},
        trainer={"securityContext": {"allowPrivileged": True, "addCapabilities": ["SYS_ADMIN", "NET_BIND_SERVICE"],
                                     "seccompProfile": "Unconfined"}}))
    op = client_as(cluster, tmp_path, OPERATOR_NS, OPERATOR_SA)
    core, rbac = kubernetes.client.CoreV1Api(op), kubernetes.client.RbacAuthorizationV1Api(op)
    custom = kubernetes.client.CustomObjectsApi(op)
    dry = {"dry_run": "All"}

    no_job = "there is no RFTJob"

    def refused(call, *words: str) -> None:
        """Refused, with one of `words` in the message."""
        code, message = refusal(call)
        # (No RFTJob of that name there: the owner webhook may be the one the API server names.)
        assert code in ((403, 422) if no_job in words else (403,)) and any(w in message for w in words), \
            (code, message)

    # Cluster objects that are not ours (namespaces without an RFTJob: nothing at all).
    refused(lambda: core.patch_namespaced_config_map("extension-apiserver-authentication", "kube-system",
                                                    {"data": {"x": "y"}}, **dry), "kube-* namespaces", no_job)
    refused(lambda: core.delete_namespaced_service("kubernetes", "default", **dry), "objects it manages", no_job)
    refused(lambda: rbac.create_namespaced_role("kube-system", {
        "metadata": managed_meta(job, "owner-status-writer"), "rules": []}, **dry), "kube-* namespaces", no_job)
    # A user's own ConfigMap in a job namespace is not ours either.
    kubectl("create", "configmap", "users", "-n", namespace, "--from-literal=a=b")
    refused(lambda: core.patch_namespaced_config_map("users", namespace, {"data": {"a": "c"}}, **dry),
            "objects it manages")

    # Pods: only as the job's own account for the pod's role (the accounts must exist for
    # the API server to get as far as the policy).
    for sa in ("owner-rft-trainer", "owner-rft-inference"):  # (an operator may have made the first)
        kubectl("create", "serviceaccount", sa, "-n", namespace, check=False)
    refused(lambda: core.create_namespaced_pod("kube-system", _pod(
        managed_meta(job, "owner-trainer-9-0", "trainer"), "clusterrole-aggregation-controller", "kube-system"),
        **dry), "kube-* namespaces", no_job)
    refused(lambda: core.create_namespaced_pod(namespace, _pod(
        managed_meta(job, "owner-trainer-9-0", "trainer"), "default", namespace), **dry), "own ServiceAccount")
    refused(lambda: core.create_namespaced_pod(namespace, _pod(
        managed_meta(job, "owner-trainer-9-0", "trainer"), "owner-rft-inference", namespace), **dry), "own ServiceAccount")
    trainer_pod = lambda **spec: {**_pod(managed_meta(job, "owner-trainer-9-0", "trainer"),  # noqa: E731
                                         "owner-rft-trainer", namespace),
                                  "spec": {"serviceAccountName": "owner-rft-trainer", **spec}}
    box = {"name": "x", "image": "busybox"}
    host_words = ("privileged pods, pods in the host's namespaces", "violates PodSecurity")
    for spec in ({"containers": [box], "nodeName": "kwok-gpu-0"},
                 {"containers": [{**box, "ports": [{"containerPort": 80, "hostPort": 80}]}]},
                 {"containers": [box], "initContainers": [{**box, "name": "init", "securityContext": {"privileged": True}}]},
                 {"containers": [box], "hostNetwork": True}):
        refused(lambda: core.create_namespaced_pod(namespace, trainer_pod(**spec), **dry), *host_words)
    for volume in ({"name": "s", "secret": {"secretName": "x"}},
                   {"name": "s", "projected": {"sources": [{"secret": {"name": "x"}}]}}):
        refused(lambda: core.create_namespaced_pod(namespace, trainer_pod(containers=[box], volumes=[volume]), **dry),
                "key by key")
    refused(lambda: core.create_namespaced_pod(namespace, trainer_pod(
        containers=[{**box, "envFrom": [{"secretRef": {"name": "x"}}]}]), **dry), "key by key")
    refused(lambda: core.create_namespaced_pod(namespace, trainer_pod(
        containers=[box], volumes=[{"name": "etc", "hostPath": {"path": "/etc/kubernetes"}}]), **dry),
        "only as a trainer pod's model cache", "violates PodSecurity")
    # Beyond baseline (the model cache on a host path, Unconfined, other capabilities) needs
    # an admin's namespace labels; without them the refusal (ours, a 422, or Pod Security's,
    # a 403 "violates PodSecurity") fails the job (tests/unit/test_controller.py).
    cache = {"name": "model-cache", "hostPath": {"path": "/mnt/models", "type": "DirectoryOrCreate"}}
    beyond = [trainer_pod(containers=[box], volumes=[cache]),
              trainer_pod(containers=[{**box, "securityContext": {"capabilities": {"add": ["SYS_ADMIN"]}}}]),
              trainer_pod(containers=[box], securityContext={"seccompProfile": {"type": "Unconfined"}})]
    for pod in beyond:
        code, message = refusal(lambda: core.create_namespaced_pod(namespace, pod, **dry))
        assert (code == 422 and "rft.dev/pod-security=privileged" in message) or \
            (code == 403 and "violates PodSecurity" in message), (code, message)
    baseline = trainer_pod(containers=[{**box, "securityContext": {"capabilities": {"add": ["NET_BIND_SERVICE"]}}}])
    core.create_namespaced_pod(namespace, baseline, **dry)
    # An admin's consent: our label, and Pod Security's own level to match.
    kubectl("label", "namespace", namespace, "rft.dev/pod-security=privileged",
            f"{names.PSA_ENFORCE_LABEL}=privileged", "--overwrite")
    for pod in beyond:
        wait_for(lambda: refusal(lambda: core.create_namespaced_pod(namespace, pod, **dry)) == (200, ""), 30,
                 "the policy to see the namespace label")
    unowned = {"name": "loose", "labels": {names.LABEL_JOB: "owner", names.LABEL_MANAGED_BY: names.MANAGED_BY}}
    refused(lambda: core.create_namespaced_pod(namespace, _pod(unowned, "owner-rft-trainer", namespace), **dry),
            "objects it manages")
    core.create_namespaced_pod(namespace, _pod(managed_meta(job, "owner-trainer-9-0", "trainer"), "owner-rft-trainer",
                                               namespace), **dry)

    # Services: ClusterIP without external IPs.
    service = {"metadata": managed_meta(job, "owner-probe"), "spec": {"ports": [{"port": 80}]}}
    refused(lambda: core.create_namespaced_service(namespace, {
        **service, "spec": {**service["spec"], "externalIPs": ["203.0.113.7"]}}, **dry), "externalIPs")
    refused(lambda: core.create_namespaced_service(namespace, {
        **service, "spec": {**service["spec"], "type": "NodePort"}}, **dry), "ClusterIP")
    core.create_namespaced_service(namespace, service, **dry)

    # Roles reach only the job; bindings bind only the job's Roles to the job's accounts.
    rules = [{"apiGroups": [names.GROUP], "resources": [f"{names.PLURAL}/status"], "resourceNames": ["owner"],
              "verbs": ["get", "patch"]}]
    refused(lambda: rbac.create_namespaced_role(namespace, {
        "metadata": managed_meta(job, "owner-status-probe"),
        "rules": [{**rules[0], "resourceNames": ["someone-else"]}]}, **dry), "reach only the RFTJob")
    role = {"metadata": managed_meta(job, "owner-status-probe"), "rules": rules}
    rbac.create_namespaced_role(namespace, role, **dry)
    # A binding is checked against its Role, which must exist: made for real, as admin.
    kubernetes.client.RbacAuthorizationV1Api(api).create_namespaced_role(namespace, role)
    binding = {"metadata": managed_meta(job, "owner-status-probe"),
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "owner-status-probe"},
               "subjects": [{"kind": "ServiceAccount", "name": "owner-rft-trainer", "namespace": namespace}]}
    # The API server checks a binding against its Role from a cache: wait until it has the Role.
    wait_for(lambda: refusal(lambda: rbac.create_namespaced_role_binding(namespace, binding, **dry)) == (200, ""),
             30, "the new Role to reach the API server's RBAC cache")
    refused(lambda: rbac.create_namespaced_role_binding(namespace, {
        **binding, "subjects": [{"kind": "ServiceAccount", "name": "default", "namespace": namespace}]}, **dry),
        "job's own ServiceAccounts")

    # Status: patch, never a whole-object update; never the spec; no Secrets at all.
    body = get_job(api, namespace, "owner")
    assert refusal(lambda: custom.replace_namespaced_custom_object_status(
        names.GROUP, names.VERSION, namespace, names.PLURAL, "owner", body, **dry))[0] == 403
    user = f"system:serviceaccount:{OPERATOR_NS}:{OPERATOR_SA}"
    assert can_i(kubectl, user, "update", "rftjobs.rft.dev", "--subresource=finalizers", "-A")
    assert can_i(kubectl, user, "patch", "rftjobs.rft.dev", "--subresource=status", "-A")
    assert not can_i(kubectl, user, "update", "rftjobs.rft.dev", "--subresource=status", "-A")
    assert not can_i(kubectl, user, "patch", "rftjobs.rft.dev", "-A")  # the spec belongs to the user
    assert not can_i(kubectl, user, "get", "secrets", "-A")
    assert can_i(kubectl, user, "get", "nodes") and not can_i(kubectl, user, "list", "nodes")
    assert not can_i(kubectl, user, "create", "clusterrolebindings")


def test_blocking_owner_deletion_needs_the_finalizers_right(installed, api, cluster, namespace, kubectl, tmp_path):
    """The local cluster enforces OwnerReferencesPermissionEnforcement (as OpenShift does):
    an identity that may create ConfigMaps but lacks `update` on rftjobs/finalizers cannot
    create a child that blocks its RFTJob's deletion, which is why the operator holds it."""
    job = create_job(api, namespace, job_manifest("owner"))
    kubectl("create", "serviceaccount", "maker", "-n", namespace)
    kubectl("create", "role", "maker", "--verb=create", "--resource=configmaps", "-n", namespace)
    kubectl("create", "rolebinding", "maker", "--role=maker", f"--serviceaccount={namespace}:maker", "-n", namespace)
    maker = kubernetes.client.CoreV1Api(client_as(cluster, tmp_path, namespace, "maker"))
    meta = managed_meta(job, "owner-extra")
    code, message = refusal(lambda: maker.create_namespaced_config_map(namespace, {"metadata": meta}, dry_run="All"))
    assert code == 403 and "blockOwnerDeletion" in message, (code, message)
    meta["ownerReferences"][0]["blockOwnerDeletion"] = False
    maker.create_namespaced_config_map(namespace, {"metadata": meta}, dry_run="All")


def test_job_pods_and_children_pass_the_operator_policy(operator, api, namespace, kubectl):
    """The policy refuses nothing the operator really creates: a job with every pod role
    gets all its children (the operator runs with the installed policy in force)."""
    job = "full"
    create_job(api, namespace, job_manifest(job, inference={"replicas": 1, "gpusPerReplica": 1},
                                            explorer={"tasksetUri": "s3://ckpts/tasks.jsonl"}))
    wait_phase(api, namespace, job, names.RUNNING, 90)
    kinds = "pods,services,configmaps,serviceaccounts,roles,rolebindings"
    found = set(kubectl("get", kinds, "-n", namespace, "-l", f"{names.LABEL_JOB}={job}", "-o", "name").stdout.split())
    assert {f"serviceaccount/{job}-rft-{r}" for r in ("trainer", "inference", "explorer")} <= found
    assert {f"role.rbac.authorization.k8s.io/{job}-status-{r}" for r in ("writer", "reader")} <= found
    assert f"pod/{names.explorer_pod_name(job, 0)}" in found and f"pod/{names.inference_pod_name(job, 0)}" in found


# ------------------------------------------------------------------ namespaced install


def test_namespaced_install_reaches_only_its_namespaces(installed, api, cluster, kubectl, tmp_path):
    """manifests/namespaced/ rendered for a watched namespace and an operator namespace of
    this test's own: the operator runs with that identity and `--namespace`, reconciles a
    job in its namespace and neither sees nor can touch another."""
    suffix = uuid.uuid4().hex[:6]
    watched, elsewhere, op_ns = f"w-{suffix}", f"x-{suffix}", f"op-{suffix}"
    rendered = subprocess.run(["kubectl", "kustomize", str(ROOT / "manifests" / "namespaced")],
                              capture_output=True, text=True, check=True).stdout
    docs = [d for d in yaml.safe_load_all(rendered) if d]
    # No cluster-wide right for the operator; the one ClusterRole is the webhook's
    # certificate Job's, for that one webhook configuration.
    cluster_rbac = [d for d in docs if d["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    assert {d["metadata"]["name"] for d in cluster_rbac} == {"rftjob-operator-webhook-certs"}
    assert [r["resourceNames"] for d in cluster_rbac if d["kind"] == "ClusterRole" for r in d["rules"]] \
        == [["rftjob-operator-owner"]]
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=rft-jobs" in args
    # The Role grants exactly what the cluster install's ClusterRole grants in a namespace.
    cluster_rules = [r for r in next(d for d in yaml.safe_load_all((ROOT / "manifests/base/rbac.yaml").read_text())
                                     if d and d["kind"] == "ClusterRole")["rules"]
                     if r["resources"] not in (["nodes"], ["resourceflavors", "workloadpriorityclasses"])]  # cluster-scoped
    assert next(d for d in docs if d["kind"] == "Role" and d["metadata"]["name"] == "rftjob-operator")["rules"] \
        == cluster_rules

    identity = [d for d in docs if d["kind"] in ("ServiceAccount", "Role", "RoleBinding")
                and d["metadata"]["name"] == "rftjob-operator"]
    text = yaml.safe_dump_all(identity).replace("rft-jobs", watched).replace(OPERATOR_NS, op_ns)
    for ns in (watched, elsewhere, op_ns):
        kubectl("create", "namespace", ns)
        kubectl("label", "namespace", ns, f"{names.PSA_ENFORCE_LABEL}=baseline")
    others = []
    try:
        kubectl("apply", "-f", "-", input=text)
        user = f"system:serviceaccount:{op_ns}:{OPERATOR_SA}"
        assert can_i(kubectl, user, "create", "pods", "-n", watched)
        assert not can_i(kubectl, user, "create", "pods", "-n", elsewhere)
        assert not can_i(kubectl, user, "list", "rftjobs.rft.dev", "-A")

        op = OperatorProcess(cluster.service_account_kubeconfig(op_ns, OPERATOR_SA, tmp_path / "ns.kubeconfig"),
                             tmp_path / "operator.log", args=(f"--namespace={watched}",))
        others = op.pause_others()  # a cluster-wide operator would reconcile `elsewhere` too
        create_job(api, elsewhere, job_manifest("ignored"))
        op.start()
        try:
            create_job(api, watched, job_manifest("seen"))
            wait_phase(api, watched, "seen", names.RUNNING, 90)
            assert "status" not in get_job(api, elsewhere, "ignored"), "the namespaced operator reached out"
            log = op.log_path.read_text(errors="replace")
            assert "forbidden" not in log.lower() and "Not enough permissions" not in log, op.tail()
        finally:
            op.stop()
    finally:
        for other in others:
            other.start()
        for ns in (watched, elsewhere, op_ns):
            kubectl("delete", "namespace", ns, "--wait=false", check=False)


def test_manifests_pass_server_side_dry_run(installed, kubectl):
    out = kubectl("apply", "-k", str(ROOT / "manifests"), "--dry-run=server")
    assert "customresourcedefinition.apiextensions.k8s.io/rftjobs.rft.dev" in out.stdout
    assert "deployment.apps/rftjob-operator" in out.stdout
    assert "validatingadmissionpolicy.admissionregistration.k8s.io/rftjob-status-writers" in out.stdout
    # A server-side dry run creates no namespace: the watched one must exist for its Role.
    kubectl("create", "namespace", "rft-jobs", check=False)
    namespaced = kubectl("apply", "-k", str(ROOT / "manifests" / "namespaced"), "--dry-run=server")
    assert "role.rbac.authorization.k8s.io/rftjob-operator" in namespaced.stdout
    samples = kubectl("apply", "-k", str(ROOT / "manifests" / "samples"), "--dry-run=server")
    assert "rftjob.rft.dev/demo" in samples.stdout
