"""Fixtures for running the operator against the local control plane.

The operator runs as a subprocess authenticated as the `rftjob-operator` ServiceAccount
from manifests/rbac.yaml (a token from the TokenRequest API), never as cluster-admin, so
a permission missing from the manifests fails these tests.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml

from rft_contract import names as c

from .conftest import wait_for

ROOT = Path(__file__).resolve().parents[2]


class OperatorProcess:
    def __init__(self, kubeconfig: Path, log_path: Path):
        self.kubeconfig, self.log_path = kubeconfig, log_path
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig), "RFT_RESYNC_SECONDS": "10",
               "PYTHONUNBUFFERED": "1"}
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rft_operator", "--verbose"],
            env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
        )
        log.close()
        wait_for(lambda: b"rftjob-operator started" in self.log_path.read_bytes()
                 or self._died(), 60, "operator start")
        assert self.proc.poll() is None, f"operator exited:\n{self.tail()}"

    def _died(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None

    def kill(self) -> None:
        """SIGKILL: no cleanup, like a crashed or OOM-killed operator pod."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])


@pytest.fixture(scope="session")
def installed(cluster) -> None:
    """Namespace, CRD and operator RBAC from the real manifests (not the Deployment:
    the operator runs here as a host process with the Deployment's identity)."""
    from e2e.demo import install

    install(cluster)


@pytest.fixture(scope="session")
def api(cluster) -> kubernetes.client.ApiClient:
    """A Python client authenticated as admin, for assertions."""
    return kubernetes.config.new_client_from_config(str(cluster.kubeconfig))


@pytest.fixture(scope="session")
def operator(cluster, installed, tmp_path_factory) -> OperatorProcess:
    d = tmp_path_factory.mktemp("operator")
    kc = cluster.service_account_kubeconfig("rftjob-system", "rftjob-operator", d / "operator.kubeconfig")
    op = OperatorProcess(Path(kc), d / "operator.log")
    op.start()
    yield op
    op.stop()


@pytest.fixture
def namespace(api, kubectl) -> str:
    name = f"t-{uuid.uuid4().hex[:8]}"
    kubectl("create", "namespace", name)
    yield name
    kubectl("delete", "namespace", name, "--wait=false", check=False)


# ------------------------------------------------------------------ helpers


def job_manifest(name: str, **spec_overrides: Any) -> dict:
    spec = {
        "model": {"path": "s3://models/tiny"},
        "algorithm": {"name": "grpo"},
        "trainer": {"image": "rftjob-trainer:test", "nodes": 2, "gpusPerNode": 8,
                    "totalSteps": 100, "batchSize": 16},
        "checkpoint": {"uri": "s3://ckpts/run"},
        "failurePolicy": {"maxRestarts": 3, "backoffSeconds": 1},
    }
    for key, value in spec_overrides.items():
        if isinstance(value, dict) and isinstance(spec.get(key), dict):
            spec[key] = {**spec[key], **value}
        else:
            spec[key] = value
    return {"apiVersion": c.API_VERSION, "kind": c.KIND, "metadata": {"name": name}, "spec": spec}


def create_job(api, namespace: str, manifest: dict) -> dict:
    return kubernetes.client.CustomObjectsApi(api).create_namespaced_custom_object(
        c.GROUP, c.VERSION, namespace, c.PLURAL, manifest)


def get_job(api, namespace: str, name: str) -> dict:
    return kubernetes.client.CustomObjectsApi(api).get_namespaced_custom_object(
        c.GROUP, c.VERSION, namespace, c.PLURAL, name)


def patch_spec(api, namespace: str, name: str, spec: dict) -> dict:
    return kubernetes.client.CustomObjectsApi(api).patch_namespaced_custom_object(
        c.GROUP, c.VERSION, namespace, c.PLURAL, name, {"spec": spec})


def pods(api, namespace: str, job: str) -> list:
    return kubernetes.client.CoreV1Api(api).list_namespaced_pod(
        namespace, label_selector=f"{c.LABEL_JOB}={job}").items


def wait_status(api, namespace: str, name: str, predicate, timeout: float = 60, what: str = "") -> dict:
    def check():
        status = get_job(api, namespace, name).get("status") or {}
        return status if predicate(status) else None
    try:
        return wait_for(check, timeout, what or f"{name} status")
    except AssertionError as e:
        status = (get_job(api, namespace, name).get("status") or {})
        raise AssertionError(f"{e}; status now: {yaml.safe_dump(status)}") from None


def wait_phase(api, namespace: str, name: str, phase: str, timeout: float = 60, **fields) -> dict:
    return wait_status(
        api, namespace, name,
        lambda s: s.get("phase") == phase and all(s.get(k) == v for k, v in fields.items()),
        timeout, f"{name} phase {phase} {fields or ''}",
    )


def end_pod(api, namespace: str, pod: str, exit_code: int) -> None:
    """Ask KWOK (our stage in e2e/kwok-stages.yaml) to end a running pod with this code."""
    kubernetes.client.CoreV1Api(api).patch_namespaced_pod(
        pod, namespace, {"metadata": {"annotations": {c.KWOK_EXIT_ANNOTATION: str(exit_code)}}})


def events(api, namespace: str, name: str) -> list[str]:
    items = kubernetes.client.CoreV1Api(api).list_namespaced_event(
        namespace, field_selector=f"involvedObject.name={name}").items
    return [e.reason for e in sorted(items, key=lambda e: e.metadata.creation_timestamp)]
