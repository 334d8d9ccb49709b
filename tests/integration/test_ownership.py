"""Ownership, refusals, drift, disruptions and a clean start, against the real API server:
the operator never adopts an object it did not create, fails a job whose children the API
server refuses as invalid (422) with the field in the message, restores children edited by
hand, removes keys and children the spec no longer renders (and nothing anyone else added),
restarts an evicted gang without using the restart budget, and starts without logging
errors."""

from __future__ import annotations

import json
import re
import time
from contextlib import contextmanager
from datetime import datetime, timezone

import kubernetes
import pytest

from rft_contract import names

from .conftest import wait_for
from .operator_fixtures import (
    create_job, get_job, hold_pod, job_manifest, patch_spec, pods, release_pod, wait_phase, wait_status,
)

pytestmark = pytest.mark.integration


def event_messages(api, namespace: str, name: str, type_: str = "Warning") -> list[tuple[str, str]]:
    items = kubernetes.client.CoreV1Api(api).list_namespaced_event(
        namespace, field_selector=f"involvedObject.name={name}").items
    return [(e.reason, e.message) for e in items if e.type == type_]


def test_operator_start_logs_no_errors(operator, api):
    """kopf scanned CRDs and namespaces at start, which the operator may not list, and
    logged errors for it ("customresourcedefinitions ... forbidden"). A quiet cluster (no
    job of an earlier test still being torn down, whose errors are no start's) first."""
    custom = kubernetes.client.CustomObjectsApi(api)
    wait_for(lambda: not custom.list_cluster_custom_object(names.GROUP, names.VERSION, names.PLURAL)["items"], 180,
             "earlier tests' jobs to be gone")
    operator.stop()
    since = operator.log_offset()
    operator.start()
    time.sleep(8)  # kopf's watchers and observers start after the startup handler
    with open(operator.log_path, "rb") as f:
        f.seek(since)
        log = f.read().decode(errors="replace")
    started = log.index("rftjob-operator started")
    bad = [line for line in log[started:].splitlines() if re.search(r"error|forbidden", line, re.IGNORECASE)]
    assert not bad, "\n".join(bad)


def test_existing_unlabelled_configmap_is_never_adopted(operator, api, namespace):
    core = kubernetes.client.CoreV1Api(api)
    mine = core.create_namespaced_config_map(namespace, {
        "metadata": {"name": "squat-config"}, "data": {"config.json": "{\"mine\": true}"}})
    create_job(api, namespace, job_manifest("squat"))
    status = wait_phase(api, namespace, "squat", names.FAILED, 60)
    want = f"ConfigMap {namespace}/squat-config exists and is not owned by this RFTJob; delete or rename it"
    assert status["message"] == want
    failed = {x["type"]: x for x in status["conditions"]}[names.COND_FAILED]
    assert (failed["reason"], failed["message"]) == (names.REASON_CHILD_CONFLICT, want)
    assert (names.REASON_CHILD_CONFLICT, want) in event_messages(api, namespace, "squat")
    after = core.read_namespaced_config_map("squat-config", namespace)
    assert after.metadata.resource_version == mine.metadata.resource_version  # untouched
    assert not after.metadata.owner_references and after.data == {"config.json": "{\"mine\": true}"}
    assert not pods(api, namespace, "squat")  # no pod ever mounted it


@contextmanager
def invalid_trainer_pods(api, kubectl, namespace: str, field: str):
    """While active, the API server refuses trainer pods in `namespace` as invalid (HTTP
    422, the field named in the message): a ValidatingAdmissionPolicy with reason Invalid.
    Active once a dry-run of such a pod is refused."""
    name = f"invalid-{namespace}"
    labels = "object.metadata.labels"
    policy = {
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": name},
        "spec": {"failurePolicy": "Fail",
                 "matchConstraints": {"resourceRules": [{"apiGroups": [""], "apiVersions": ["v1"],
                                                         "operations": ["CREATE"], "resources": ["pods"]}]},
                 "validations": [{
                     "expression": f"!has(object.metadata.labels) || !('{names.LABEL_ROLE}' in {labels})"
                                   f" || {labels}['{names.LABEL_ROLE}'] != '{names.ROLE_TRAINER}'",
                     "message": f"{field}: trainer pods need a GPU request here", "reason": "Invalid"}]}}
    binding = {
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": name},
        "spec": {"policyName": name, "validationActions": ["Deny"],
                 "matchResources": {"namespaceSelector": {
                     "matchLabels": {"kubernetes.io/metadata.name": namespace}}}}}
    kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": [policy, binding]}))
    probe = {"apiVersion": "v1", "kind": "Pod",
             "metadata": {"name": "invalid-probe", "labels": {names.LABEL_ROLE: names.ROLE_TRAINER}},
             "spec": {"containers": [{"name": "c", "image": "none"}]}}

    def refused() -> bool:
        try:
            kubernetes.client.CoreV1Api(api).create_namespaced_pod(namespace, probe, dry_run="All")
        except kubernetes.client.ApiException as e:
            return e.status == 422
        return False

    try:
        wait_for(refused, 30, "the admission policy to take effect")
        yield
    finally:
        kubectl("delete", "validatingadmissionpolicybinding", name, check=False)
        kubectl("delete", "validatingadmissionpolicy", name, check=False)


def test_child_refused_as_invalid_fails_the_job_naming_the_field(operator, api, namespace, kubectl):
    field = "spec.containers[0].resources.requests"
    with invalid_trainer_pods(api, kubectl, namespace, field):
        create_job(api, namespace, job_manifest("refused"))
        status = wait_phase(api, namespace, "refused", names.FAILED, 60)
    failed = {x["type"]: x for x in status["conditions"]}[names.COND_FAILED]
    assert failed["reason"] == names.REASON_INVALID_SPEC
    assert status["message"].startswith(f"creating Pod {namespace}/refused-trainer-1-")
    assert field in status["message"] and "trainer pods need a GPU request here" in status["message"]
    warnings = event_messages(api, namespace, "refused")
    assert (names.REASON_INVALID_SPEC, status["message"]) in warnings
    create_failed = [m for r, m in warnings if r == "CreateFailed"]
    assert create_failed and "HTTP 422" in create_failed[0] and field in create_failed[0]
    assert status["restarts"] == 0


def test_children_edited_by_hand_are_restored(operator, api, namespace):
    create_job(api, namespace, job_manifest("drift"))
    wait_phase(api, namespace, "drift", names.RUNNING, 90)
    core, rbac = kubernetes.client.CoreV1Api(api), kubernetes.client.RbacAuthorizationV1Api(api)
    svc_name, rb_name = names.service_name("drift"), names.status_role_name("drift")
    port = core.read_namespaced_service(svc_name, namespace).spec.ports[0].port
    subjects = [{"kind": s.kind, "name": s.name, "namespace": s.namespace}
                for s in rbac.read_namespaced_role_binding(rb_name, namespace).subjects]
    assert all(s.metadata.annotations.get(names.ANNOTATION_SPEC_HASH) for s in (
        core.read_namespaced_service(svc_name, namespace), rbac.read_namespaced_role_binding(rb_name, namespace),
        core.read_namespaced_config_map(names.configmap_name("drift"), namespace)))

    merge = {"_content_type": "application/merge-patch+json"}  # lists replaced whole
    core.patch_namespaced_service(svc_name, namespace, {"spec": {"ports": [
        {"name": "rendezvous", "port": 1234, "targetPort": 1234}]}}, **merge)
    rbac.patch_namespaced_role_binding(rb_name, namespace, {"subjects": [
        *subjects, {"kind": "ServiceAccount", "name": "intruder", "namespace": namespace}]}, **merge)

    wait_for(lambda: [p.port for p in core.read_namespaced_service(svc_name, namespace).spec.ports] == [port],
             60, "the Service's port restored")
    wait_for(lambda: [s.name for s in rbac.read_namespaced_role_binding(rb_name, namespace).subjects]
             == [s["name"] for s in subjects], 60, "the RoleBinding's subjects restored")
    # Steady afterwards: no patch loop against the server's defaults.
    rv = core.read_namespaced_service(svc_name, namespace).metadata.resource_version
    time.sleep(12)  # more than one 10 s resync
    assert core.read_namespaced_service(svc_name, namespace).metadata.resource_version == rv
    assert get_job(api, namespace, "drift")["status"]["phase"] == names.RUNNING


def test_what_the_spec_no_longer_renders_goes_and_what_others_added_stays(operator, api, namespace):
    """Dropping a ServiceAccount annotation from the spec removes it from the live
    ServiceAccounts (an annotation someone else added stays); dropping spec.explorer, then
    spec.inference, deletes their ServiceAccounts, the explorers' Role and RoleBinding and
    the inference Service."""
    job, role_arn, cost = "shrink", "eks.amazonaws.com/role-arn", "example.com/cost-center"
    sa_annotations = {role_arn: "arn:aws:iam::1:role/x", cost: "42"}
    create_job(api, namespace, job_manifest(job, serviceAccountAnnotations=sa_annotations,
                                            inference={"replicas": 1, "gpusPerReplica": 1},
                                            explorer={"tasksetUri": "s3://ckpts/tasks.jsonl"}))
    core, rbac = kubernetes.client.CoreV1Api(api), kubernetes.client.RbacAuthorizationV1Api(api)
    trainer_sa, explorer_sa = names.service_account_name(job, names.ROLE_TRAINER), names.service_account_name(job, names.ROLE_EXPLORER)
    reader, inference_sa = names.status_reader_role_name(job), names.service_account_name(job, names.ROLE_INFERENCE)

    def annotations(name: str) -> dict:
        return core.read_namespaced_service_account(name, namespace).metadata.annotations or {}

    wait_for(lambda: cost in annotations(explorer_sa) and rbac.read_namespaced_role_binding(reader, namespace), 60,
             "the explorer's ServiceAccount and RoleBinding")
    by_hand = {"metadata": {"annotations": {"example.com/by-hand": "y"}}}
    core.patch_namespaced_service_account(trainer_sa, namespace, by_hand)

    patch_spec(api, namespace, job, {"serviceAccountAnnotations": {cost: None}, "explorer": None})
    wait_for(lambda: cost not in annotations(trainer_sa), 60, "the dropped annotation removed")
    assert annotations(trainer_sa)[role_arn] == "arn:aws:iam::1:role/x"
    assert annotations(trainer_sa)["example.com/by-hand"] == "y"  # not ours: kept

    def gone(read, name: str) -> bool:
        try:
            read(name, namespace)
        except kubernetes.client.ApiException as e:
            return e.status == 404
        return False

    wait_for(lambda: all(gone(read, name) for read, name in [
        (core.read_namespaced_service_account, explorer_sa), (rbac.read_namespaced_role, reader),
        (rbac.read_namespaced_role_binding, reader)]), 60, "the explorers' identity deleted")
    patch_spec(api, namespace, job, {"inference": None})
    wait_for(lambda: gone(core.read_namespaced_service_account, inference_sa)
             and gone(core.read_namespaced_service, names.inference_service_name(job)), 60,
             "the inference children deleted")
    assert not gone(core.read_namespaced_service_account, trainer_sa)
    assert get_job(api, namespace, job)["status"]["phase"] != names.FAILED


def test_evicted_trainer_restarts_the_gang_without_using_the_budget(operator, api, namespace):
    create_job(api, namespace, job_manifest("evict"))
    wait_phase(api, namespace, "evict", names.RUNNING, 90)
    core, pod = kubernetes.client.CoreV1Api(api), "evict-trainer-1-0"
    hold_pod(api, namespace, pod)  # keeps the evicted pod visible (terminating) until released
    try:
        asked = datetime.now(timezone.utc)
        core.create_namespaced_pod_eviction(pod, namespace, {
            "apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": pod, "namespace": namespace}})
        evicted = core.read_namespaced_pod(pod, namespace)
        disruption = [x for x in evicted.status.conditions or [] if x.type == "DisruptionTarget"]
        assert disruption and (disruption[0].status, disruption[0].reason) == ("True", "EvictionByEvictionAPI")
        # deletionTimestamp is the request time plus the grace period, not the request time.
        grace = evicted.metadata.deletion_grace_period_seconds
        assert grace and (evicted.metadata.deletion_timestamp - asked).total_seconds() >= grace - 2

        status = wait_status(api, namespace, "evict", lambda s: s.get("disruptions") == 1, 60, "the disruption")
        assert (status["phase"], status["restarts"]) == (names.RESTARTING, 0)
        assert (status["lastFailure"]["reason"], status["lastFailure"]["pod"]) == (names.REASON_POD_DISRUPTED, pod)
    finally:
        release_pod(api, namespace, pod)
    status = wait_phase(api, namespace, "evict", names.RUNNING, 90, attempt=2)
    assert (status["restarts"], status["disruptions"]) == (0, 1)
    assert names.REASON_POD_DISRUPTED in [r for r, _ in event_messages(api, namespace, "evict")]
