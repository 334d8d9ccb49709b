"""Fixtures shared by every test layer.

* A real S3-compatible server (SeaweedFS, see e2e/s3server.py: over HTTP on loopback,
  SigV4-authenticated) for every S3 path (trainer, sync agents, explorers), with the
  environment variables the operator sets. Its binary missing is an error, as below.
* The local control plane (see e2e/cluster.py), one per session for tests/integration and
  tests/e2e. By default the session starts its own cluster in a temp dir and stops it at
  the end. Set RFT_KUBECONFIG to reuse a running one instead (e.g. the demo's, from
  `python -m e2e.cluster env`). Missing binaries are an error, never a skip: a CI run
  that silently skips every integration test would look green while proving nothing.
* The one exception: tests marked `real_vllm` run vLLM's CPU build, which needs AVX2 and
  F16C (rft_serving.cpu_isa); on a CPU without them they skip with the flags it lacks
  named, and pytest's summary counts them. The header says which kernels this CPU gets.
"""

import json
import os
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import pytest

from e2e import vllm_env
from e2e.cluster import Cluster, ExistingCluster
from e2e.s3server import S3Server

# access key -> secret key: the tests' own, and the demo's (the e2e jobs use the sample's
# Secret, manifests/samples/s3-secret.example.yaml).
S3_CREDENTIALS = {"test": "test-secret", "rftdemo": "rftdemo-secret-change-me"}


def pytest_report_header(config) -> str:
    return f"cpu: {vllm_env.compute_cpu_fit()[1]}"


def pytest_collection_modifyitems(config, items) -> None:
    runs, why = vllm_env.compute_cpu_fit()
    if runs:
        return
    skip = pytest.mark.skip(reason=f"this CPU cannot run vLLM's CPU build: {why}")
    for item in items:
        if "real_vllm" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory):
    """The endpoint URL of a SeaweedFS S3 server for the whole session."""
    with S3Server(tmp_path_factory.mktemp("s3"), credentials=S3_CREDENTIALS) as server:
        yield server.endpoint


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    key, secret = "test", S3_CREDENTIALS["test"]
    env = {"AWS_ENDPOINT_URL": s3_server, "AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret,
           "AWS_REGION": "us-east-1", "AWS_DEFAULT_REGION": "us-east-1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env


@pytest.fixture
def bucket(s3_env, request):
    """A fresh bucket, emptied and removed after the test (each bucket is a SeaweedFS
    collection, so its volumes go and their disk with them)."""
    import boto3

    name = f"t-{uuid.uuid4().hex[:10]}"
    client = boto3.client("s3")
    client.create_bucket(Bucket=name)
    yield name
    remove_bucket(client, name)


def remove_bucket(client, name: str) -> None:
    """Deletes every object of `name`, then the bucket; best effort (a test that stopped
    the server, or removed the bucket itself, leaves nothing to do)."""
    try:
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=name):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                client.delete_objects(Bucket=name, Delete={"Objects": keys, "Quiet": True})
        client.delete_bucket(Bucket=name)
    except Exception:  # noqa: BLE001 - cleanup; the test's own outcome stands
        pass

def wait_for(predicate: Callable[[], Any], timeout: float = 60, message: str = "condition",
             interval: float = 0.5) -> Any:
    """Polls `predicate` until it returns something truthy, and returns that.

    Exceptions from the predicate count as "not yet" (the object may not exist yet);
    the last one is reported if the deadline passes.
    """
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while True:
        try:
            value = predicate()
            if value:
                return value
        except Exception as e:  # noqa: BLE001 - reported on timeout
            last_error = e
        if time.monotonic() > deadline:
            detail = f" (last error: {last_error})" if last_error else ""
            raise AssertionError(f"timed out after {timeout}s waiting for {message}{detail}")
        time.sleep(interval)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    """The cluster under test: RFT_KUBECONFIG's, or a fresh one for this session."""
    existing = os.environ.get("RFT_KUBECONFIG")
    if existing:
        yield ExistingCluster(existing)
        return
    local = Cluster(tmp_path_factory.mktemp("cluster"))
    local.up()  # cleans up after itself if it fails
    try:
        yield local
    finally:
        local.down()


@pytest.fixture(scope="session")
def kubeconfig(cluster) -> Path:
    """Path of the admin kubeconfig."""
    return Path(cluster.kubeconfig)


@pytest.fixture(scope="session")
def admin_env(kubeconfig: Path) -> dict[str, str]:
    """os.environ with KUBECONFIG pointing at the admin kubeconfig (for subprocesses)."""
    return {**os.environ, "KUBECONFIG": str(kubeconfig)}


@pytest.fixture(scope="session")
def kubectl(admin_env: dict[str, str]):
    """Runs kubectl as admin (or with `kubeconfig=`); raises with stderr on failure."""

    def run(*args: str, input: str | None = None, kubeconfig: str | os.PathLike | None = None,
            check: bool = True) -> subprocess.CompletedProcess:
        env = dict(admin_env)
        if kubeconfig is not None:
            env["KUBECONFIG"] = str(kubeconfig)
        proc = subprocess.run(["kubectl", *args], input=input, env=env, capture_output=True,
                              text=True, timeout=60)
        if check and proc.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({proc.returncode}): {proc.stderr}")
        return proc

    return run


@pytest.fixture(scope="session")
def kubectl_json(kubectl):
    """kubectl ... -o json, parsed."""
    return lambda *args, **kw: json.loads(kubectl(*args, "-o", "json", **kw).stdout)


@pytest.fixture(name="wait_for")
def wait_for_fixture():
    """The wait_for helper, for tests that prefer fixtures to imports."""
    return wait_for


@pytest.fixture
def namespace(kubectl, kubectl_json) -> str:
    """A fresh namespace per test, ready for pods (its default ServiceAccount exists)."""
    name = f"it-{uuid.uuid4().hex[:8]}"
    kubectl("create", "namespace", name)
    wait_for(lambda: kubectl_json("get", "serviceaccount", "default", "-n", name),
             30, f"ServiceAccount {name}/default")
    yield name
    kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture(scope="session")
def kueue(cluster, tmp_path_factory):
    """The real Kueue (e2e/kueue.py, `bash e2e/build-binaries.sh kueue`) as a host process
    against the session's cluster: its CRDs, its webhooks (by URL, for Kueue's own kinds),
    RFTJob as an external framework. `create_resource_flavor`, `create_cluster_queue`,
    `create_local_queue`, `create_priority_class`, `create`, `get`, `patch_status`,
    `delete`; its log at `kueue.log_path`. Stopped, and its webhooks removed, at the end."""
    from e2e.kueue import KueueProcess

    process = KueueProcess(cluster, tmp_path_factory.mktemp("kueue"))
    process.start()
    yield process
    process.stop()
