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


@pytest.fixture(scope="session")
def installed(cluster) -> None:
    """Namespace, CRD and operator RBAC from the real manifests (not the Deployment:
    the operator runs here as a host process with the Deployment's identity)."""
    from e2e.demo import install_api as install

    install(cluster)


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
