"""The owner webhook (rft_operator.ownerhook) against the real API server, with the
operator's real token (TokenRequest), as the default install has it (the session's
webhook, served on the host by tests/integration/conftest.py's `installed`): the made-up
job beside a real one is refused; so are a PATCH that re-points an owner reference and, in
a privileged namespace, a pod its job's spec does not render; each has an accepted twin.

The failure and rotation tests register a second configuration served by the test itself
(a URL clientConfig with its own CA), limited to the test's namespace, so no other test
waits on it. The webhook looks jobs up with the operator's token too: its RBAC suffices.
"""

from __future__ import annotations

import base64
import json
import ssl
import urllib.request
import uuid
from contextlib import contextmanager
from pathlib import Path

import kubernetes
import pytest
import yaml

from rft_contract import names
from rft_operator import ownerhook

from .conftest import wait_for
from .operator_fixtures import create_job, get_job, job_manifest
from .test_operator_token import BOX, DRY, accounts, refused, trainer_pod
from .test_rbac import OPERATOR_NS, OPERATOR_SA, managed_meta, client_as, refusal

pytestmark = pytest.mark.integration


@pytest.fixture
def operator_api(cluster, installed, tmp_path):
    return client_as(cluster, tmp_path, OPERATOR_NS, OPERATOR_SA)


@pytest.fixture
def certs(tmp_path):
    ca, cert, key = ownerhook.serving_pair(["127.0.0.1"])
    (tmp_path / "tls.crt").write_bytes(cert)
    (tmp_path / "tls.key").write_bytes(key)
    (tmp_path / "ca.crt").write_bytes(ca)
    return tmp_path


@contextmanager
def registered(api, operator_api, namespace: str, certs: Path):
    """The webhook served on the host and registered for `namespace` only."""
    server = ownerhook.OwnerWebhook(0, certs, ownerhook.api_get_job(operator_api), addr="127.0.0.1")
    admission = kubernetes.client.AdmissionregistrationV1Api(api)
    config = ownerhook.webhook_configuration(
        (certs / "ca.crt").read_bytes(), url=f"https://127.0.0.1:{server.port}",
        namespace_selector={"matchLabels": {"kubernetes.io/metadata.name": namespace}})
    config["metadata"]["name"] = f"{ownerhook.WEBHOOK_NAME}-{namespace}"
    admission.create_validating_webhook_configuration(config)
    try:
        yield server
    finally:
        admission.delete_validating_webhook_configuration(config["metadata"]["name"])
        server.stop()


@pytest.fixture
def webhook(api, operator_api, namespace, certs):
    with registered(api, operator_api, namespace, certs) as server:
        yield server


def ghost_account(ghost: dict) -> dict:
    return {"metadata": managed_meta(ghost, f"{ghost['metadata']['name']}-rft-x")}


def test_a_made_up_job_beside_a_real_one_gets_nothing(operator_api, api, kubectl, namespace):
    """The ghost job, in the default install (the session's webhook, `installed`): beside a
    real job, no ServiceAccount, no pod reading another application's Secret, no Event for
    `ghost`, and nothing created; `real`'s own children pass."""
    # Suspended: the session's host operator, which watches every namespace, starts nothing.
    job = create_job(api, namespace, job_manifest("real", suspend=True))
    accounts(kubectl, namespace, "real")
    accounts(kubectl, namespace, "ghost")
    core = kubernetes.client.CoreV1Api(operator_api)
    ghost = {"metadata": {"name": "ghost", "uid": str(uuid.uuid4())}}
    reader = {**BOX, "env": [{"name": "P", "valueFrom": {"secretKeyRef": {"name": "app-db", "key": "password"}}}]}
    ghost_pod = {"metadata": {**managed_meta(ghost, "ghost-trainer-1-0", "trainer"), "namespace": namespace},
                 "spec": {"serviceAccountName": "ghost-rft-trainer", "containers": [reader]}}
    words = ("rftjob-operator-owner", f"there is no RFTJob {namespace}/ghost")
    refused(lambda: core.create_namespaced_pod(namespace, ghost_pod), *words)  # for real, not a dry run
    refused(lambda: core.create_namespaced_service_account(namespace, ghost_account(ghost)), *words)
    event = {"metadata": {"generateName": "ghost.", "labels": {names.LABEL_MANAGED_BY: names.MANAGED_BY,
                                                                names.LABEL_JOB: "ghost"}},
             "involvedObject": {"apiVersion": names.API_VERSION, "kind": names.KIND, "name": "ghost",
                                "namespace": namespace, "uid": ghost["metadata"]["uid"]},
             "reason": "X", "message": "m", "type": "Normal"}
    refused(lambda: core.create_namespaced_event(namespace, event), *words)
    admin = kubernetes.client.CoreV1Api(api)
    assert not [p.metadata.name for p in admin.list_namespaced_pod(namespace).items
                if p.metadata.name.startswith("ghost")]

    # The real job's children pass; its name with another uid does not.
    assert refusal(lambda: core.create_namespaced_pod(namespace, trainer_pod(job, namespace), **DRY)) == (200, "")
    assert refusal(lambda: core.create_namespaced_service_account(
        namespace, {"metadata": managed_meta(job, "real-rft-x")}, **DRY)) == (200, "")
    forged = {"metadata": {"name": "real", "uid": str(uuid.uuid4())}}
    refused(lambda: core.create_namespaced_service_account(namespace, ghost_account(forged), **DRY),
            "rftjob-operator-owner")
    # What the operator itself writes, as it writes it (kube.post_event's labels).
    real_event = {**event, "metadata": {"generateName": "real.", "labels": {
        names.LABEL_MANAGED_BY: names.MANAGED_BY, names.LABEL_JOB: "real"}}, "involvedObject": {
        **event["involvedObject"], "name": "real", "uid": job["metadata"]["uid"]}}
    assert refusal(lambda: core.create_namespaced_event(namespace, real_event, **DRY)) == (200, "")


def test_lookups_come_from_a_watch_of_the_namespace_that_follows_its_jobs(operator_api, api, namespace):
    """`WatchedJobs` (what every replica serves from) with the operator's own identity: the
    namespace's first lookup goes to the API server and starts its watch; once that has
    listed, lookups send no request and follow each job created, deleted and re-created
    under the same name, keeping only its uid and spec."""
    jobs = ownerhook.WatchedJobs(operator_api)
    custom = kubernetes.client.CustomObjectsApi(api)

    def uid(name: str) -> str | None:
        return ((jobs(namespace, name) or {}).get("metadata") or {}).get("uid")

    def no_request(*_args):
        raise AssertionError("a lookup went to the API server")

    try:
        first = create_job(api, namespace, job_manifest("w1", suspend=True))
        assert uid("w1") == first["metadata"]["uid"]  # the API server's answer; the watch starts
        wait_for(lambda: jobs.watching(namespace), 30, "the namespace's watch to list its jobs")
        jobs.api = type("NoRequests", (), {"__call__": staticmethod(no_request), "fresh": staticmethod(no_request)})()
        assert uid("w1") == first["metadata"]["uid"]
        second = create_job(api, namespace, job_manifest("w2", suspend=True))
        wait_for(lambda: uid("w2") == second["metadata"]["uid"], 30, "the watch to see w2 created")
        assert set(jobs(namespace, "w2")) == {"metadata", "spec"}
        custom.delete_namespaced_custom_object(names.GROUP, names.VERSION, namespace, names.PLURAL, "w1")
        wait_for(lambda: uid("w1") is None, 60, "the watch to see w1 deleted")
        again = create_job(api, namespace, job_manifest("w1", suspend=True))
        wait_for(lambda: uid("w1") == again["metadata"]["uid"] != first["metadata"]["uid"], 30,
                 "the watch to see w1 re-created")
    finally:
        jobs.close()


def test_a_patch_keeps_one_owner_the_jobs_uid(operator_api, api, kubectl, namespace):
    """The uid on every write: a child the operator made (for real) cannot be re-pointed by
    a PATCH to another uid, given a second owner, or lose its controller flag; a PATCH that
    keeps the reference passes."""
    job = create_job(api, namespace, job_manifest("real", suspend=True))
    other = create_job(api, namespace, job_manifest("other", suspend=True))
    core = kubernetes.client.CoreV1Api(operator_api)
    # A child the operator renders (its ServiceAccount for the trainers): a session operator,
    # if one runs, keeps it rather than deleting it as a leftover.
    try:
        core.create_namespaced_service_account(namespace, {"metadata": managed_meta(job, "real-rft-trainer")})
    except kubernetes.client.ApiException as e:
        if e.status != 409:  # the session's operator made it first
            raise
    ref = managed_meta(job, "x")["ownerReferences"][0]

    def patch(refs: list, **kw):
        body = {"metadata": {"ownerReferences": refs, "annotations": {"touched": "yes"}}}
        # A merge patch replaces the list (a strategic one merges it by uid).
        return lambda: core.patch_namespaced_service_account("real-rft-trainer", namespace, body, **DRY,
                                                             _content_type="application/merge-patch+json", **kw)

    assert refusal(patch([ref])) == (200, "")  # the twin: same reference, another annotation
    for refs in ([{**ref, "uid": str(uuid.uuid4())}],  # a forged uid
                 [{**ref, "name": "other", "uid": other["metadata"]["uid"]}],  # another job's (label says real)
                 [ref, {**ref, "name": "other", "uid": other["metadata"]["uid"], "controller": False}],  # a second owner
                 [{**ref, "controller": False}]):  # no controller
        got, message = refusal(patch(refs))
        assert got == 403 and ("rftjob-operator-owner" in message or "rftjob-operator-scope" in message), (
            refs, got, message)
        # The webhook's own answer, whatever the API server names first.
        assert ownerhook.check(namespace, {"metadata": {**managed_meta(job, "x"), "ownerReferences": refs}},
                               "serviceaccounts", ownerhook.api_get_job(operator_api), "UPDATE") is not None
    # A JSON patch that swaps only the uid, as an attacker would send it: refused by the webhook.
    swap = [{"op": "replace", "path": "/metadata/ownerReferences/0/uid", "value": str(uuid.uuid4())}]
    refused(lambda: core.patch_namespaced_service_account("real-rft-trainer", namespace, swap, **DRY),
            "rftjob-operator-owner", "exactly one owner reference")
    got = kubernetes.client.CoreV1Api(api).read_namespaced_service_account("real-rft-trainer", namespace)
    assert [r.uid for r in got.metadata.owner_references] == [job["metadata"]["uid"]]


def test_in_a_privileged_namespace_a_pod_gets_only_what_its_own_spec_renders(operator_api, api, kubectl, namespace):
    """A cluster admin allowed privileged jobs in this namespace (rft.dev/pod-security and
    Pod Security's own level). The job `cached` renders a host path and SYS_PTRACE; a pod
    for it mounting the node's / or adding SYS_ADMIN, or a pod for `plain` (which renders
    neither) using them, is refused; what `cached` renders passes."""
    kubectl("label", "namespace", namespace, "rft.dev/pod-security=privileged",
            f"{names.PSA_ENFORCE_LABEL}=privileged", "--overwrite")
    privileged = {"securityContext": {"allowPrivileged": True, "addCapabilities": ["SYS_PTRACE"]}}
    cached = create_job(api, namespace, job_manifest(
        "cached", suspend=True, trainer=privileged,
        model={"path": "s3://models/tiny", "cache": {"hostPath": "/var/cache/rft-models"}}))
    plain = create_job(api, namespace, job_manifest("plain", suspend=True))
    accounts(kubectl, namespace, "cached")
    accounts(kubectl, namespace, "plain")
    core = kubernetes.client.CoreV1Api(operator_api)

    def pod(job, path="/var/cache/rft-models", add=("SYS_PTRACE",)):
        return trainer_pod(job, namespace, containers=[{**BOX, "securityContext": {"capabilities": {
            "drop": ["ALL"], "add": list(add)}}}], volumes=[{"name": "model-cache", "hostPath": {"path": path}}])

    assert refusal(lambda: core.create_namespaced_pod(namespace, pod(cached), **DRY)) == (200, "")
    refused(lambda: core.create_namespaced_pod(namespace, pod(cached, path="/"), **DRY),
            "rftjob-operator-owner", "spec.model.cache.hostPath")
    refused(lambda: core.create_namespaced_pod(namespace, pod(cached, add=("SYS_PTRACE", "SYS_ADMIN")), **DRY),
            "rftjob-operator-owner", "not SYS_ADMIN")
    refused(lambda: core.create_namespaced_pod(namespace, pod(plain), **DRY), "rftjob-operator-owner")
    refused(lambda: core.create_namespaced_pod(namespace, pod(plain, add=()), **DRY), "spec.model.cache.hostPath")


def ghost_refused(operator_api, api, namespace: str) -> None:
    """Waits until the API server calls the webhook for this namespace (it loads a new
    configuration asynchronously): the operator's ServiceAccount for a made-up job beside
    a real one, refused by name."""
    create_job(api, namespace, job_manifest("real", suspend=True))
    core = kubernetes.client.CoreV1Api(operator_api)
    ghost = {"metadata": {"name": "ghost", "uid": str(uuid.uuid4())}}
    wait_for(lambda: "there is no RFTJob" in refusal(
        lambda: core.create_namespaced_service_account(namespace, ghost_account(ghost), **DRY))[1], 30,
        "the webhook to refuse the made-up job")


def test_other_identities_and_unlabelled_objects_never_wait_on_it(webhook, operator_api, api, namespace):
    """Registered for the operator's labelled objects only: with the webhook stopped (so
    that a call to it fails closed, as the operator's own create shows), the admin still
    creates a labelled object and the namespace's other objects."""
    ghost_refused(operator_api, api, namespace)
    webhook.stop()
    core = kubernetes.client.CoreV1Api(operator_api)
    real = get_job(api, namespace, "real")
    got, message = refusal(lambda: core.create_namespaced_service_account(
        namespace, {"metadata": managed_meta(real, "real-rft-x")}, **DRY))
    assert got >= 500 and "failed calling webhook" in message, (got, message)  # called, and fails closed
    admin = kubernetes.client.CoreV1Api(api)
    ghost = {"metadata": {"name": "ghost", "uid": str(uuid.uuid4())}}
    labelled = {"metadata": {**managed_meta(ghost, "admin-made")}}
    assert refusal(lambda: admin.create_namespaced_config_map(namespace, labelled, **DRY)) == (200, "")
    assert refusal(lambda: admin.create_namespaced_config_map(
        namespace, {"metadata": {"name": "plain"}}, **DRY)) == (200, "")


def test_it_fails_closed_and_serves_a_rotated_certificate(webhook, operator_api, api, namespace, certs):
    ghost_refused(operator_api, api, namespace)
    job = get_job(api, namespace, "real")
    core = kubernetes.client.CoreV1Api(operator_api)
    account = {"metadata": managed_meta(job, "real-rft-x")}
    assert refusal(lambda: core.create_namespaced_service_account(namespace, account, **DRY)) == (200, "")

    # A new pair on disk: the next handshake presents it (no restart).
    ca, cert, key = ownerhook.serving_pair(["127.0.0.1"])
    (certs / "tls.key").write_bytes(key)
    (certs / "tls.crt").write_bytes(cert)
    context = ssl.create_default_context(cadata=ca.decode())
    request = urllib.request.Request(f"https://127.0.0.1:{webhook.port}{ownerhook.PATH}", method="POST",
                                     data=json.dumps({"request": {"uid": "u", "operation": "DELETE"}}).encode())
    with urllib.request.urlopen(request, context=context, timeout=10) as r:
        assert json.load(r)["response"] == {"uid": "u", "allowed": True}
    # The API server still trusts only the old CA: once its kept-alive connection (which the
    # server closes after its next answer) is gone, the call fails, and so does the create.
    wait_for(lambda: refusal(lambda: core.create_namespaced_service_account(namespace, account, **DRY))[0] >= 500,
             30, "a new connection, with the new pair the API server does not trust")
    got, message = refusal(lambda: core.create_namespaced_service_account(namespace, account, **DRY))
    assert got >= 500 and "failed calling webhook" in message, (got, message)


def test_the_certificate_jobs_identity_makes_the_pair_and_the_operators_cannot_touch_it(
        api, operator_api, cluster, kubectl, tmp_path):
    """`ownerhook certs` as the install's Job runs it: with that Job's own ServiceAccount and
    RBAC from manifests/base/owner-webhook.yaml, against the install's configuration (here
    limited to namespaces no test has, so nothing waits on a webhook nobody serves). It
    writes the pair and sets the caBundle; run again, it keeps both. The operator's token
    can neither read that Secret nor change or delete the configuration (a leaked token that
    could set failurePolicy: Ignore would have escalated), and the Job's identity can touch
    nothing else."""
    root = Path(__file__).resolve().parents[2] / "manifests" / "base"
    identity = [d for d in yaml.safe_load_all((root / "owner-webhook.yaml").read_text())
                if d and d["kind"] in ("ServiceAccount", "Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding")]
    config = yaml.safe_load((root / "owner-webhook-configuration.yaml").read_text())
    config["webhooks"][0]["namespaceSelector"] = {"matchLabels": {"rft.dev/no-such-namespace": "true"}}
    kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=yaml.safe_dump_all(identity + [config]))
    admission = kubernetes.client.AdmissionregistrationV1Api(api)
    core = kubernetes.client.CoreV1Api(api)
    try:
        certs = kubernetes.config.new_client_from_config(str(cluster.service_account_kubeconfig(
            OPERATOR_NS, "rftjob-operator-webhook-certs", tmp_path / "certs.kubeconfig")))
        certs_core = kubernetes.client.CoreV1Api(certs)
        certs_admission = kubernetes.client.AdmissionregistrationV1Api(certs)
        kubectl("delete", "secret", ownerhook.TLS_SECRET, "-n", OPERATOR_NS, "--ignore-not-found")

        ca = wait_for(lambda: ownerhook.ensure_serving_secret(certs_core, OPERATOR_NS), 30,
                      "the Job's RBAC in force")
        ownerhook.ensure_ca_bundle(certs_admission, ca, timeout=30)
        secret = core.read_namespaced_secret(ownerhook.TLS_SECRET, OPERATOR_NS)
        got = admission.read_validating_webhook_configuration(ownerhook.WEBHOOK_NAME)
        assert [h.client_config.ca_bundle for h in got.webhooks] == [base64.b64encode(ca).decode()]
        assert got.webhooks[0].failure_policy == "Fail" and got.webhooks[0].client_config.service.name == \
            ownerhook.SERVICE_NAME
        data = {k: base64.b64decode(v) for k, v in secret.data.items()}
        assert ownerhook.is_pair_current(data, ownerhook.service_hosts(OPERATOR_NS))
        # Run again: the current pair is kept, nothing is written.
        assert ownerhook.ensure_serving_secret(certs_core, OPERATOR_NS) == ca
        ownerhook.ensure_ca_bundle(certs_admission, ca, timeout=30)
        assert core.read_namespaced_secret(ownerhook.TLS_SECRET, OPERATOR_NS).metadata.resource_version == \
            secret.metadata.resource_version

        # A pair that is no longer current (here: a certificate that is not its key's) is
        # replaced; until the replicas present the new one the configuration trusts both
        # CAs, and the next run, finding the new pair current, the new CA alone.
        core.patch_namespaced_secret(ownerhook.TLS_SECRET, OPERATOR_NS, {"data": {
            "tls.key": base64.b64encode(ownerhook.serving_pair(["x"])[2]).decode()}})
        both = ownerhook.ensure_serving_secret(certs_core, OPERATOR_NS)
        assert both.endswith(ca) and len(both) > len(ca)
        ownerhook.ensure_ca_bundle(certs_admission, both, timeout=30)
        new = ownerhook.ensure_serving_secret(certs_core, OPERATOR_NS)
        assert new != ca and both.startswith(new)
        ownerhook.ensure_ca_bundle(certs_admission, new, timeout=30)
        assert [h.client_config.ca_bundle for h in admission.read_validating_webhook_configuration(
            ownerhook.WEBHOOK_NAME).webhooks] == [base64.b64encode(new).decode()]

        # The operator's token: no read of the key, no change to the configuration.
        op_core = kubernetes.client.CoreV1Api(operator_api)
        op_admission = kubernetes.client.AdmissionregistrationV1Api(operator_api)
        assert refusal(lambda: op_core.read_namespaced_secret(ownerhook.TLS_SECRET, OPERATOR_NS))[0] == 403
        ignore = {"webhooks": [{"name": config["webhooks"][0]["name"], "failurePolicy": "Ignore"}]}
        assert refusal(lambda: op_admission.patch_validating_webhook_configuration(
            ownerhook.WEBHOOK_NAME, ignore))[0] == 403
        assert refusal(lambda: op_admission.delete_validating_webhook_configuration(ownerhook.WEBHOOK_NAME))[0] == 403
        # The Job's identity: that one configuration and Secret, nothing else (its twin above).
        assert refusal(lambda: certs_core.read_namespaced_secret("default-token-none", OPERATOR_NS))[0] == 403
        assert refusal(lambda: certs_admission.delete_validating_webhook_configuration(
            ownerhook.WEBHOOK_NAME))[0] == 403
        assert refusal(lambda: certs_admission.read_validating_webhook_configuration(
            "rftjob-operator-owner-host"))[0] == 403
    finally:
        kubectl("delete", "validatingwebhookconfiguration", ownerhook.WEBHOOK_NAME, "--ignore-not-found")
        kubectl("delete", "secret", ownerhook.TLS_SECRET, "-n", OPERATOR_NS, "--ignore-not-found")
