"""What every child object of an RFTJob shares. Pure, no I/O.

Identity (JobRef, labels, the controller owner reference, metadata), the spec hash that
tells a drifted child apart, and the pod-level pieces that trainer, inference and explorer
pods must agree on: one service account, one security posture, one placement, scratch
space at /tmp, the same GPU requests and S3 environment. Kept in one place so the three
pod builders (`trainer_pods`, `rollout_pods`) and the static children (`children`) cannot
drift apart.

Names are deterministic (`rft_contract.names`), so "create what is missing by name, treat
409 as success, delete leftovers" is the whole idempotency mechanism.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Collection

from rft_contract import names
from rft_contract.checks import parse_quantity
from rft_contract.podmetrics import ENV_METRICS_PORT, METRICS_PORT, METRICS_PORT_NAME
from rft_contract.spec import EnvVar, RFTJobSpec
from rft_contract.trackers import TRACKERS

from .model import Obj


# Non-root user of the trainer image (trainer_image/Dockerfile creates it).
IMAGE_UID = 1000
# The emptyDir every container gets at `c.SCRATCH_MOUNT`.
SCRATCH_VOLUME = "tmp"


class JobRef:
    """Identity of the RFTJob that children point back to."""

    def __init__(self, name: str, namespace: str, uid: str):
        self.name, self.namespace, self.uid = name, namespace, uid

    @classmethod
    def from_body(cls, body: Obj) -> "JobRef":
        meta = body["metadata"]
        return cls(meta["name"], meta["namespace"], meta.get("uid", ""))


def pod_roles(spec: RFTJobSpec) -> list[str]:
    """The pod roles this job runs, each under its own ServiceAccount."""
    return [role for role, present in ((names.ROLE_TRAINER, True), (names.ROLE_INFERENCE, spec.inference is not None),
                                       (names.ROLE_EXPLORER, spec.explorer is not None)) if present]


def labels(job: str, role: str | None = None, attempt: int | None = None) -> dict[str, str]:
    out = {names.LABEL_JOB: job, names.LABEL_MANAGED_BY: names.MANAGED_BY}
    if role:
        out[names.LABEL_ROLE] = role
    if attempt is not None:
        out[names.LABEL_ATTEMPT] = str(attempt)
    return out


def owner_reference(ref: JobRef) -> Obj:
    """Controller reference: the garbage collector removes children with the job."""
    return {
        "apiVersion": names.API_VERSION,
        "kind": names.KIND,
        "name": ref.name,
        "uid": ref.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def build_meta(ref: JobRef, name: str, lbls: dict[str, str], annotations: Obj | None = None) -> Obj:
    meta: Obj = {
        "name": name,
        "namespace": ref.namespace,
        "labels": lbls,
        "ownerReferences": [owner_reference(ref)],
    }
    if annotations:
        meta["annotations"] = annotations
    return meta


def spec_hash(data: Any) -> str:
    """Short, order-independent digest: the operator replaces a child whose hash drifted."""
    blob = json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


# ------------------------------------------------------------------ pod pieces


def build_pod(ref: JobRef, spec: RFTJobSpec, name: str, lbls: dict[str, str], pod_spec: Obj) -> Obj:
    """A Pod object; every pod of the job gets the trainer's placement constraints, and
    every container scratch space and its log's last lines as its termination message
    when it fails (what `status.lastFailure.log` shows)."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": build_meta(ref, name, lbls),
        "spec": {**with_scratch_space(pod_spec), **build_placement(spec)},
    }


def with_scratch_space(pod_spec: Obj) -> Obj:
    """The pod spec with an emptyDir `tmp` mounted at /tmp in every container (init
    containers too) and HOME=/tmp where the container does not set HOME itself (a user's
    `trainer.env` may). With a read-only root filesystem this is where Python, torch
    (inductor, triton), Hugging Face and pip write their temporary files and caches."""
    out = {**pod_spec, "volumes": [*pod_spec.get("volumes", []), {"name": SCRATCH_VOLUME, "emptyDir": {}}]}
    for key in ("initContainers", "containers"):
        if key in pod_spec:
            out[key] = [_with_scratch_mount(x) for x in pod_spec[key]]
    return out


def _with_scratch_mount(container: Obj) -> Obj:
    env = container.get("env", [])
    # First, so that `$(HOME)` in a later value expands.
    home = [] if any(e["name"] == "HOME" for e in env) else [{"name": "HOME", "value": names.SCRATCH_MOUNT}]
    mounts = [*container.get("volumeMounts", []), {"name": SCRATCH_VOLUME, "mountPath": names.SCRATCH_MOUNT}]
    # The kubelet keeps the last 80 lines (2 KiB at most) of a failed container's log.
    return {**container, "env": home + env, "volumeMounts": mounts,
            "terminationMessagePolicy": "FallbackToLogsOnError"}


def build_placement(spec: RFTJobSpec) -> Obj:
    """Trainer, inference and explorer pods share the trainer's placement constraints."""
    t = spec.trainer
    out: Obj = {}
    if t.node_selector:
        out["nodeSelector"] = dict(t.node_selector)
    if t.tolerations:
        out["tolerations"] = [tol.model_dump(by_alias=True, exclude_none=True) for tol in t.tolerations]
    if t.priority_class_name:
        out["priorityClassName"] = t.priority_class_name
    if t.scheduler_name:
        out["schedulerName"] = t.scheduler_name
    return out


def build_pod_security_context(spec: RFTJobSpec) -> Obj:
    """Restricted by default (non-root image user, RuntimeDefault seccomp); relaxed only
    by explicit `spec.trainer.securityContext` fields."""
    sc = spec.trainer.security_context
    uid = IMAGE_UID if sc.run_as_user is None else sc.run_as_user
    return {
        "runAsNonRoot": sc.run_as_non_root if sc.run_as_non_root is not None else uid != 0,
        "runAsUser": uid,
        "runAsGroup": IMAGE_UID if sc.run_as_group is None else sc.run_as_group,
        "fsGroup": IMAGE_UID if sc.fs_group is None else sc.fs_group,
        "seccompProfile": {"type": sc.seccomp_profile or "RuntimeDefault"},
    }


def build_container_security_context(spec: RFTJobSpec) -> Obj:
    """The same for every container of every pod: no escalation, all capabilities dropped,
    a read-only root filesystem, unless `spec.trainer.securityContext` relaxes them."""
    sc = spec.trainer.security_context
    caps: Obj = {"drop": ["ALL"]}
    if sc.add_capabilities:
        caps["add"] = list(sc.add_capabilities)
    return {
        "allowPrivilegeEscalation": bool(sc.allow_privilege_escalation),
        "capabilities": caps,
        # Writable: the pod's volumes only, /tmp among them (`with_scratch_space`).
        "readOnlyRootFilesystem": sc.read_only_root_filesystem,
    }


def build_resources(res, gpus: int) -> Obj:
    """Requests/limits with `gpus` NVIDIA GPUs added to both."""
    # Quantities go out as strings: the API accepts both, typed clients only strings.
    requests = {k: str(v) for k, v in res.requests.items()}
    limits = {k: str(v) for k, v in res.limits.items()}
    if gpus > 0:
        limits["nvidia.com/gpu"] = requests["nvidia.com/gpu"] = str(gpus)
    return {k: v for k, v in (("requests", requests), ("limits", limits)) if v}


def build_s3_env(spec: RFTJobSpec) -> list[Obj]:
    """S3 endpoint, region and credentials for every container that reads or writes the
    checkpoint bucket."""
    ck = spec.checkpoint
    env: list[Obj] = []
    if ck.endpoint:
        env.append({"name": "AWS_ENDPOINT_URL", "value": ck.endpoint})
    if ck.region:
        env.append({"name": "AWS_REGION", "value": ck.region})
    if ck.credentials_secret:
        # Referenced, never copied: the values stay in the Secret.
        for key, optional in (
            ("AWS_ACCESS_KEY_ID", False),
            ("AWS_SECRET_ACCESS_KEY", False),
            ("AWS_SESSION_TOKEN", True),
        ):
            ref = {"name": ck.credentials_secret, "key": key}
            if optional:
                ref["optional"] = True
            env.append({"name": key, "valueFrom": {"secretKeyRef": ref}})
    return env


def build_user_env(e: EnvVar) -> Obj:
    """One `trainer.env` or `inference.env` entry: a literal, or a reference to a Secret's key."""
    if e.value_from is None:
        return {"name": e.name, "value": e.value or ""}
    return {"name": e.name, "valueFrom": {"secretKeyRef": e.value_from.secret_key_ref.model_dump(
        by_alias=True, exclude_none=True)}}


def build_shm(size: str) -> tuple[list[Obj], list[Obj]]:
    """/dev/shm as a memory-backed emptyDir of `size`: (volumes, mounts); none for "0"
    (the container keeps the runtime's default)."""
    if (parse_quantity(size) or 0) <= 0:
        return [], []
    return ([{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": size}}],
            [{"name": "dshm", "mountPath": "/dev/shm"}])


def build_metrics_port(taken: Collection[int] = ()) -> tuple[list[Obj], list[Obj]]:
    """The `metrics` container port of a program that serves rft_contract.podmetrics, and
    its environment: (ports, env). 9400 unless another port of the pod has it (the engine's
    `inference.port`, `trainer.masterPort`), then the next free one, passed as
    RFT_METRICS_PORT (9400 needs none). The monitoring component's PodMonitor scrapes it."""
    port = next(p for p in range(METRICS_PORT, METRICS_PORT + len(taken) + 1) if p not in taken)
    env = [] if port == METRICS_PORT else [{"name": ENV_METRICS_PORT, "value": str(port)}]
    return [{"name": METRICS_PORT_NAME, "containerPort": port}], env


def build_tracking_env(spec: RFTJobSpec) -> list[Obj]:
    """Each tracker's Secret (`tracking.mlflow.credentialsSecret`, ...: the catalogue's,
    rft_contract.trackers) as secretKeyRefs, one per key, for the trainer pods (only rank 0
    sends to the trackers, but every rank runs the same pod spec) and the explorers (their
    runs of rollout figures)."""
    env: list[Obj] = []
    for tracker in TRACKERS.values():
        secret = tracker.secret_in(spec.tracking)
        for key in tracker.secret_keys if secret else ():
            # Referenced, never copied: the values stay in the Secret.
            ref: Obj = {"name": secret, "key": key.name}
            if key.optional:
                ref["optional"] = True
            env.append({"name": key.name, "valueFrom": {"secretKeyRef": ref}})
    return env
