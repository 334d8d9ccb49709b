"""Fixtures for running the operator against the local control plane.

The operator runs as a subprocess authenticated as the `rftjob-operator` ServiceAccount
from manifests/base/rbac.yaml (a token from the TokenRequest API), never as cluster-admin, so
a permission missing from the manifests fails these tests.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import kubernetes
import yaml

from rft_contract import names

from tests.conftest import wait_for

ROOT = Path(__file__).resolve().parents[2]


class OperatorProcess:
    # Every operator a test started: each watches every namespace, so a test that stops
    # "the" operator must first make sure it is the only one (`pause_others`).
    started: list["OperatorProcess"] = []

    def __init__(self, kubeconfig: Path, log_path: Path, args: tuple[str, ...] = ()):
        self.kubeconfig, self.log_path, self.args = kubeconfig, log_path, tuple(args)
        self.proc: subprocess.Popen | None = None
        OperatorProcess.started.append(self)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def pause_others(self) -> list["OperatorProcess"]:
        """Stop every other running operator (e.g. the integration tests' session one,
        which would otherwise reconcile the e2e jobs too); returns them to restart later."""
        others = [o for o in OperatorProcess.started if o is not self and o.running()]
        for o in others:
            o.stop()
        return others

    def start(self, ready: str = "rftjob-operator started") -> None:
        """Starts it and waits for the log line `ready` (a regular expression; a replica
        that waits for the leader Lease logs no start)."""
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig), "RFT_RESYNC_SECONDS": "10",
               "PYTHONUNBUFFERED": "1"}
        since = self.log_offset()  # the log is appended to: only this start's marker counts
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rft_operator", "--verbose", *self.args],
            env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
        )
        log.close()
        wait_for(lambda: self.logged(ready, since) or self._died(), 60, "operator start")
        assert self.proc.poll() is None, f"operator exited:\n{self.tail()}"

    def log_offset(self) -> int:
        """Where the log ends now: pass it to `logged`/`wait_logged` to look only at what follows."""
        return self.log_path.stat().st_size if self.log_path.exists() else 0

    def logged(self, pattern: str, since: int = 0) -> bool:
        """Whether the log after offset `since` matches the regular expression `pattern`."""
        with open(self.log_path, "rb") as f:
            f.seek(since)
            return re.search(pattern, f.read().decode(errors="replace")) is not None

    def wait_logged(self, pattern: str, since: int, timeout: float = 60) -> None:
        """Wait until the operator logged a line matching `pattern` after offset `since`
        (e.g. a pass over a job: with --verbose each pass logs "<ns>/<job>: <n> pods seen,
        phase A -> B, ...")."""
        try:
            wait_for(lambda: self.logged(pattern, since), timeout, f"operator log line /{pattern}/")
        except AssertionError as e:
            raise AssertionError(f"{e}\n{self.tail()}") from None

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
    return {"apiVersion": names.API_VERSION, "kind": names.KIND, "metadata": {"name": name}, "spec": spec}


def create_job(api, namespace: str, manifest: dict) -> dict:
    return kubernetes.client.CustomObjectsApi(api).create_namespaced_custom_object(
        names.GROUP, names.VERSION, namespace, names.PLURAL, manifest)


def get_job(api, namespace: str, name: str) -> dict:
    return kubernetes.client.CustomObjectsApi(api).get_namespaced_custom_object(
        names.GROUP, names.VERSION, namespace, names.PLURAL, name)


def patch_spec(api, namespace: str, name: str, spec: dict) -> dict:
    return kubernetes.client.CustomObjectsApi(api).patch_namespaced_custom_object(
        names.GROUP, names.VERSION, namespace, names.PLURAL, name, {"spec": spec})


def patch_status(api, namespace: str, name: str, status: dict) -> dict:
    """Merge-patch the status subresource, as the trainer's rank 0 does."""
    return kubernetes.client.CustomObjectsApi(api).patch_namespaced_custom_object_status(
        names.GROUP, names.VERSION, namespace, names.PLURAL, name, {"status": status})


def pod_deleting(api, namespace: str, pod: str) -> bool:
    return bool(kubernetes.client.CoreV1Api(api).read_namespaced_pod(pod, namespace).metadata.deletion_timestamp)


def pods(api, namespace: str, job: str) -> list:
    return kubernetes.client.CoreV1Api(api).list_namespaced_pod(
        namespace, label_selector=f"{names.LABEL_JOB}={job}").items


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
        pod, namespace, {"metadata": {"annotations": {names.KWOK_EXIT_ANNOTATION: str(exit_code)}}})


def events(api, namespace: str, name: str) -> list[str]:
    items = kubernetes.client.CoreV1Api(api).list_namespaced_event(
        namespace, field_selector=f"involvedObject.name={name}").items
    return [e.reason for e in sorted(items, key=lambda e: e.metadata.creation_timestamp)]


def gang_ranks(api, namespace: str, job: str) -> dict[int, list[int]]:
    """attempt -> sorted ranks of the trainer pods that exist, counted by their labels (not
    their names): a second gang under other names would show as extra ranks or attempts."""
    out: dict[int, list[int]] = {}
    for p in pods(api, namespace, job):
        labels = p.metadata.labels
        if labels.get(names.LABEL_ROLE, names.ROLE_TRAINER) == names.ROLE_TRAINER:
            out.setdefault(int(labels[names.LABEL_ATTEMPT]), []).append(int(labels[names.LABEL_RANK]))
    return {a: sorted(r) for a, r in sorted(out.items())}


HOLD_FINALIZER = "test.rft.dev/hold"


def hold_pod(api, namespace: str, pod: str) -> None:
    """A finalizer of ours: once deleted, the pod stays (terminating) until `release_pod`,
    a deterministic window in which the old gang is still going away."""
    kubernetes.client.CoreV1Api(api).patch_namespaced_pod(
        pod, namespace, {"metadata": {"finalizers": [HOLD_FINALIZER]}})


def release_pod(api, namespace: str, pod: str) -> None:
    try:
        kubernetes.client.CoreV1Api(api).patch_namespaced_pod(pod, namespace, {"metadata": {"finalizers": None}})
    except kubernetes.client.ApiException as e:
        if e.status != 404:
            raise


@contextmanager
def refusing_trainer_pods(api, namespace: str, attempt: int, ranks_from: int):
    """While active, the API server refuses trainer pods of `attempt` with rank >= `ranks_from`
    in `namespace` (a ValidatingAdmissionPolicy, CEL in the API server): the operator's gang
    creation stops half way, deterministically. Active once a dry-run of such a pod is refused."""
    adm, name = kubernetes.client.AdmissionregistrationV1Api(api), f"refuse-{namespace}"
    labels = "object.metadata.labels"
    expression = (f"!has(object.metadata.labels) || !('{names.LABEL_ATTEMPT}' in {labels}) || "
                  f"!('{names.LABEL_RANK}' in {labels}) || {labels}['{names.LABEL_ATTEMPT}'] != '{attempt}' || "
                  f"int({labels}['{names.LABEL_RANK}']) < {ranks_from}")
    adm.create_validating_admission_policy({
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": name},
        "spec": {"failurePolicy": "Fail",
                 "matchConstraints": {"resourceRules": [{"apiGroups": [""], "apiVersions": ["v1"],
                                                         "operations": ["CREATE"], "resources": ["pods"]}]},
                 "validations": [{"expression": expression, "message": "refused by the test",
                                  "reason": "Forbidden"}]}})  # 403: transient, retried
    adm.create_validating_admission_policy_binding({
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": name},
        "spec": {"policyName": name, "validationActions": ["Deny"],
                 "matchResources": {"namespaceSelector": {
                     "matchLabels": {"kubernetes.io/metadata.name": namespace}}}}})
    probe = {"apiVersion": "v1", "kind": "Pod",
             "metadata": {"name": "refusal-probe",
                          "labels": {names.LABEL_ATTEMPT: str(attempt), names.LABEL_RANK: str(ranks_from)}},
             "spec": {"containers": [{"name": "c", "image": "none"}]}}

    def refused() -> bool:
        try:
            kubernetes.client.CoreV1Api(api).create_namespaced_pod(namespace, probe, dry_run="All")
        except kubernetes.client.ApiException as e:
            return "refused by the test" in (e.body or "")
        return False

    try:
        wait_for(refused, 30, "the admission policy to take effect")
        yield
    finally:
        adm.delete_validating_admission_policy_binding(name)
        adm.delete_validating_admission_policy(name)
        wait_for(lambda: not refused(), 30, "the admission policy to be gone")


# ------------------------------------------------------------------ leader takeover


def jobs_in_flight(api, namespace: str, count: int = 20, timeout: float = 180) -> dict[str, str]:
    """`count` one-pod jobs j00, j01, ... Running on KWOK's nodes; their pods' name -> uid."""
    jobs = [f"j{i:02d}" for i in range(count)]
    for n in jobs:
        create_job(api, namespace, job_manifest(n, trainer={"nodes": 1, "gpusPerNode": 1}))
    for n in jobs:
        wait_phase(api, namespace, n, names.RUNNING, timeout)
    return {p.metadata.name: p.metadata.uid for n in jobs for p in pods(api, namespace, n)}


def assert_takeover_kept_every_job(api, namespace: str, children: dict[str, str], timeout: float = 120) -> None:
    """After a new leader took over from one killed right after j00's pod failed: j00 is
    restarted once (whether or not the old leader saw the failure), the others' pods are
    the same objects (none replaced or added, no restart counted), and new work is done."""
    s = wait_status(api, namespace, "j00", lambda s: s.get("attempt") == 2 and s.get("phase") == names.RUNNING,
                    timeout, "j00 restarted by the new leader")
    assert s["restarts"] == 1, s
    create_job(api, namespace, job_manifest("late", trainer={"nodes": 1, "gpusPerNode": 1}))
    wait_phase(api, namespace, "late", names.RUNNING, timeout)
    jobs = sorted({k.split("-")[0] for k in children} - {"j00"})
    for n in jobs:
        st = get_job(api, namespace, n)["status"]
        assert (st["phase"], st.get("restarts", 0), st["attempt"]) == (names.RUNNING, 0, 1), (n, st)
    now = {p.metadata.name: p.metadata.uid for n in jobs for p in pods(api, namespace, n)}
    assert now == {k: v for k, v in children.items() if not k.startswith("j00-")}
    # j00: attempt 1's failed pod kept for its logs, one gang for attempt 2, nothing more.
    j00 = sorted(p.metadata.name for p in pods(api, namespace, "j00") if "-trainer-" in p.metadata.name)
    assert j00 == ["j00-trainer-1-0", "j00-trainer-2-0"], j00
