"""The owner webhook (rft_operator.ownerhook) against the real API server, with the
operator's real token (TokenRequest): the made-up job beside a real one, which the
admission policies alone admit, is refused; the real job's children still pass.

The API server calls the webhook served here on the host (a URL clientConfig with this
test's own CA); the configuration is limited to the test's namespace, so no other test
waits on it. The webhook looks jobs up with the operator's token too: its RBAC suffices.
"""

from __future__ import annotations

import json
import ssl
import urllib.request
import uuid
from contextlib import contextmanager
from pathlib import Path

import kubernetes
import pytest

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


def test_a_made_up_job_beside_a_real_one_gets_nothing(operator_api, api, kubectl, namespace, certs):
    """The gap the policies leave (each evaluates one RFTJob of the namespace), shown
    without the webhook, then closed with it: no ServiceAccount, no pod reading another
    application's Secret, no Event for `ghost`; `real`'s own children pass."""
    # Suspended: the session's host operator, which watches every namespace, starts nothing.
    job = create_job(api, namespace, job_manifest("real", suspend=True))
    accounts(kubectl, namespace, "real")
    accounts(kubectl, namespace, "ghost")
    core = kubernetes.client.CoreV1Api(operator_api)
    ghost = {"metadata": {"name": "ghost", "uid": str(uuid.uuid4())}}
    reader = {**BOX, "env": [{"name": "P", "valueFrom": {"secretKeyRef": {"name": "app-db", "key": "password"}}}]}
    ghost_pod = {"metadata": {**managed_meta(ghost, "ghost-trainer-1-0", "trainer"), "namespace": namespace},
                 "spec": {"serviceAccountName": "ghost-rft-trainer", "containers": [reader]}}
    # Without the webhook: the policies admit it (dry run), once they see `real`.
    wait_for(lambda: refusal(lambda: core.create_namespaced_pod(namespace, ghost_pod, **DRY)) == (200, ""), 30,
             "the policies to admit the ghost's pod (the gap)")

    with registered(api, operator_api, namespace, certs):
        words = ("rftjob-operator-owner", f"there is no RFTJob {namespace}/ghost")
        wait_for(lambda: refusal(lambda: core.create_namespaced_pod(namespace, ghost_pod, **DRY))[0] == 403, 30,
                 "the webhook to be called")
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
                                     data=json.dumps({"request": {"uid": "u", "operation": "UPDATE"}}).encode())
    with urllib.request.urlopen(request, context=context, timeout=10) as r:
        assert json.load(r)["response"] == {"uid": "u", "allowed": True}
    # The API server still trusts only the old CA: the call fails, and so does the create.
    got, message = refusal(lambda: core.create_namespaced_service_account(namespace, account, **DRY))
    assert got >= 500 and "failed calling webhook" in message, (got, message)
