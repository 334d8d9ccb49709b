"""The cluster fixtures live in tests/conftest.py (shared with tests/e2e); `wait_for`
stays importable from here for the integration tests. The operator's fixtures are here,
defined once: a session fixture imported into several test modules is a separate fixture in
each (pytest registers it per module), and two session operators reconciled the same jobs."""

import uuid
from pathlib import Path

import kubernetes
import pytest

from rft_contract import names
from tests.conftest import wait_for  # noqa: F401

from e2e.host import free_port

from .operator_fixtures import OperatorProcess


# The host's stand-in for the install's owner webhook configuration (the in-cluster one,
# rftjob-operator-owner, calls the operator's Service; e2e tests install and remove it).
HOST_WEBHOOK = "rftjob-operator-owner-host"
# A namespace with this label is left to the in-cluster install's webhook alone (the e2e
# tests that prove the default install refuses on its own).
IN_CLUSTER_ONLY = "rft.dev/test-owner-webhook"


@pytest.fixture(scope="session")
def installed(cluster, tmp_path_factory):
    """What the default install applies, but for the Deployment: namespace, CRD, operator
    RBAC, the admission policies, and the owner webhook, served here for the session (the
    operator runs here as a host process with the Deployment's identity; in a cluster every
    replica serves the webhook, here this process does). Its configuration is the
    install's, but for calling a URL on this host with this session's CA."""
    from e2e.demo import install_api as install
    from rft_operator import ownerhook

    install(cluster)
    d = tmp_path_factory.mktemp("owner-webhook")
    ca, cert, key = ownerhook.serving_pair(["127.0.0.1"])
    (d / "tls.crt").write_bytes(cert)
    (d / "tls.key").write_bytes(key)
    kc = cluster.service_account_kubeconfig("rftjob-system", "rftjob-operator", d / "operator.kubeconfig")
    # It looks jobs up as admin: the e2e tests delete and re-create the operator's
    # ServiceAccount (the Helm test's uninstall), which would void a token of the operator's
    # for the rest of the session. (test_owner_webhook.py's own webhook looks them up with
    # the operator's token: its RBAC suffices.)
    server = ownerhook.OwnerWebhook(
        0, d, ownerhook.api_get_job(kubernetes.config.new_client_from_config(str(cluster.kubeconfig))),
        addr="127.0.0.1")
    admin = kubernetes.client.AdmissionregistrationV1Api(kubernetes.config.new_client_from_config(str(cluster.kubeconfig)))
    config = ownerhook.webhook_configuration(ca, url=f"https://127.0.0.1:{server.port}", namespace_selector={
        "matchExpressions": [{"key": IN_CLUSTER_ONLY, "operator": "DoesNotExist"}]})
    config["metadata"]["name"] = HOST_WEBHOOK
    try:
        admin.delete_validating_webhook_configuration(HOST_WEBHOOK)  # a crashed session's
    except kubernetes.client.ApiException as e:
        if e.status != 404:
            raise
    admin.create_validating_webhook_configuration(config)
    # The API server loads a new configuration asynchronously: on once it refuses a made-up job.
    operator = kubernetes.client.CoreV1Api(kubernetes.config.new_client_from_config(str(kc)))
    ghost = {"metadata": {"name": "ghost-rft-probe", "labels": {names.LABEL_JOB: "ghost",
                                                                names.LABEL_MANAGED_BY: names.MANAGED_BY},
                          "ownerReferences": [{"apiVersion": names.API_VERSION, "kind": names.KIND, "name": "ghost",
                                               "uid": str(uuid.uuid4()), "controller": True}]}}

    def refused() -> bool:
        try:
            operator.create_namespaced_service_account("default", ghost, dry_run="All")
        except kubernetes.client.ApiException as e:
            return "there is no RFTJob default/ghost" in (e.body or "")
        return False

    wait_for(refused, 30, "the API server to call the owner webhook")
    yield server
    admin.delete_validating_webhook_configuration(HOST_WEBHOOK)
    server.stop()


@pytest.fixture(scope="session")
def api(cluster) -> kubernetes.client.ApiClient:
    """A Python client authenticated as admin, for assertions."""
    return kubernetes.config.new_client_from_config(str(cluster.kubeconfig))


@pytest.fixture(scope="session")
def operator(cluster, installed, kueue, tmp_path_factory) -> OperatorProcess:
    # Kueue first: the operator watches Workloads from its start where Kueue's API is served.
    d = tmp_path_factory.mktemp("operator")
    kc = cluster.service_account_kubeconfig("rftjob-system", "rftjob-operator", d / "operator.kubeconfig")
    # Metrics on a free port: another run on this host may hold the default (test_prometheus.py scrapes it).
    op = OperatorProcess(Path(kc), d / "operator.log", args=("--metrics-port", str(free_port())))
    op.start()
    yield op
    op.stop()


@pytest.fixture
def namespace(api, kubectl) -> str:
    name = f"t-{uuid.uuid4().hex[:8]}"
    kubectl("create", "namespace", name)
    # The operator runs job pods only where Pod Security is enforced (a cluster admin's label).
    kubectl("label", "namespace", name, f"{names.PSA_ENFORCE_LABEL}=baseline")
    yield name
    kubectl("delete", "namespace", name, "--wait=false", check=False)
