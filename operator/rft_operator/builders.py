"""Pure functions: an RFTJob -> the child objects it should have. No I/O.

Names are deterministic (`<job>-trainer-<attempt>-<rank>`), so "create what is missing by
name, treat 409 as success, delete leftovers" is the whole idempotency mechanism.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from . import constants as c
from .api import RFTJobSpec

Obj = dict[str, Any]

# Non-root user of the trainer image (trainer_image/Dockerfile creates it).
IMAGE_UID = 1000


class JobRef:
    """Identity of the RFTJob that children point back to."""

    def __init__(self, name: str, namespace: str, uid: str):
        self.name, self.namespace, self.uid = name, namespace, uid

    @classmethod
    def from_body(cls, body: Obj) -> "JobRef":
        meta = body["metadata"]
        return cls(meta["name"], meta["namespace"], meta.get("uid", ""))


# ------------------------------------------------------------------ names


def service_name(job: str) -> str:
    return f"{job}-trainer"


def pod_name(job: str, attempt: int, rank: int) -> str:
    return f"{job}-trainer-{attempt}-{rank}"


def configmap_name(job: str) -> str:
    return f"{job}-config"


def status_role_name(job: str) -> str:
    return f"{job}-status-writer"


def own_service_account_name(job: str) -> str:
    return f"{job}-rftjob"


def trainer_service_account(job: str, spec: RFTJobSpec) -> str:
    return spec.trainer.service_account_name or own_service_account_name(job)


def inference_service_name(job: str) -> str:
    return f"{job}-inference"


def inference_pod_name(job: str, index: int) -> str:
    return f"{job}-inference-{index}"


def explorer_pod_name(job: str, index: int) -> str:
    return f"{job}-explorer-{index}"


def inference_endpoints(ref: "JobRef", spec: RFTJobSpec) -> list[str]:
    """Stable per-replica URLs (headless Service DNS); explorers balance over them."""
    inf = spec.inference
    if inf is None:
        return []
    svc = inference_service_name(ref.name)
    return [f"http://{inference_pod_name(ref.name, i)}.{svc}.{ref.namespace}.svc:{inf.port}"
            for i in range(inf.replicas)]


def master_addr(job: str, attempt: int, namespace: str) -> str:
    """Stable DNS name of rank 0 through the headless Service."""
    return f"{pod_name(job, attempt, 0)}.{service_name(job)}.{namespace}.svc"


# ------------------------------------------------------------------ helpers


def labels(job: str, role: str | None = None, attempt: int | None = None) -> dict[str, str]:
    out = {c.LABEL_JOB: job, c.LABEL_MANAGED_BY: c.MANAGED_BY}
    if role:
        out[c.LABEL_ROLE] = role
    if attempt is not None:
        out[c.LABEL_ATTEMPT] = str(attempt)
    return out


def owner_reference(ref: JobRef) -> Obj:
    return {
        "apiVersion": c.API_VERSION,
        "kind": c.KIND,
        "name": ref.name,
        "uid": ref.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _meta(ref: JobRef, name: str, lbls: dict[str, str], annotations: Obj | None = None) -> Obj:
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
    blob = json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


# ------------------------------------------------------------------ config


def build_trainer_config(ref: JobRef, spec: RFTJobSpec) -> Obj:
    """The resolved config the trainer reads (defaults applied; no secrets)."""
    data = spec.model_dump(mode="json", exclude={"suspend", "failure_policy"})
    data["checkpoint"].pop("credentials_secret", None)
    data["job"] = {"name": ref.name, "namespace": ref.namespace, "uid": ref.uid}
    return data


def build_configmap(ref: JobRef, spec: RFTJobSpec) -> Obj:
    config = build_trainer_config(ref, spec)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(
            ref,
            configmap_name(ref.name),
            labels(ref.name, c.ROLE_TRAINER),
            {c.ANNOTATION_SPEC_HASH: spec_hash(config)},
        ),
        "data": {c.CONFIG_FILE: json.dumps(config, indent=2, sort_keys=True)},
    }


# ------------------------------------------------------------------ RBAC


def build_service_account(ref: JobRef) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": _meta(ref, own_service_account_name(ref.name), labels(ref.name)),
    }


def build_status_role(ref: JobRef) -> Obj:
    """The job's pods may read and merge-patch the status of this one RFTJob, nothing else."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _meta(ref, status_role_name(ref.name), labels(ref.name)),
        "rules": [
            {
                "apiGroups": [c.GROUP],
                "resources": [f"{c.PLURAL}/status"],
                "resourceNames": [ref.name],
                "verbs": ["get", "patch"],
            },
            {
                # Sync agents watch their job (list/watch need a metadata.name field
                # selector to match resourceNames).
                "apiGroups": [c.GROUP],
                "resources": [c.PLURAL],
                "resourceNames": [ref.name],
                "verbs": ["get", "list", "watch"],
            },
        ],
    }


def build_status_role_binding(ref: JobRef, spec: RFTJobSpec) -> Obj:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _meta(ref, status_role_name(ref.name), labels(ref.name)),
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": status_role_name(ref.name),
        },
        "subjects": [
            {
                "kind": "ServiceAccount",
                "name": trainer_service_account(ref.name, spec),
                "namespace": ref.namespace,
            }
        ],
    }


# ------------------------------------------------------------------ service


def build_headless_service(ref: JobRef, spec: RFTJobSpec) -> Obj:
    """Gives each trainer pod a stable DNS name `<pod>.<job>-trainer` for rendezvous."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(ref, service_name(ref.name), labels(ref.name, c.ROLE_TRAINER)),
        "spec": {
            "clusterIP": "None",
            # torchrun must resolve rank 0 before any pod is Ready.
            "publishNotReadyAddresses": True,
            "selector": {c.LABEL_JOB: ref.name, c.LABEL_ROLE: c.ROLE_TRAINER},
            "ports": [
                {
                    "name": "rendezvous",
                    "port": spec.trainer.master_port,
                    "targetPort": spec.trainer.master_port,
                }
            ],
        },
    }


# ------------------------------------------------------------------ pods


def _s3_env(spec: RFTJobSpec) -> list[Obj]:
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


def _trainer_env(ref: JobRef, spec: RFTJobSpec, attempt: int) -> list[Obj]:
    env = [
        {"name": c.ENV_JOB_NAME, "value": ref.name},
        {"name": c.ENV_JOB_NAMESPACE, "value": ref.namespace},
        {"name": c.ENV_JOB_UID, "value": ref.uid},
        {"name": c.ENV_ATTEMPT, "value": str(attempt)},
        {"name": c.ENV_CONFIG, "value": f"{c.CONFIG_MOUNT}/{c.CONFIG_FILE}"},
        {"name": c.ENV_POD_NAME, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
        # The base model is downloaded once per pod into its own volume, not the image's /tmp.
        {"name": "RFT_MODEL_CACHE", "value": c.MODEL_CACHE_MOUNT},
        # The trainer checkpoints on SIGTERM only if that fits in the grace period.
        {"name": "RFT_TERMINATION_GRACE_SECONDS", "value": str(spec.trainer.termination_grace_period_seconds)},
    ]
    env += _s3_env(spec)
    env += [{"name": e.name, "value": e.value} for e in spec.trainer.env]
    return env


def _resources(spec: RFTJobSpec) -> Obj:
    return _gpu_resources(spec.trainer.resources, spec.trainer.gpus_per_node)


def build_pod_security_context(spec: RFTJobSpec) -> Obj:
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
    sc = spec.trainer.security_context
    caps: Obj = {"drop": ["ALL"]}
    if sc.add_capabilities:
        caps["add"] = list(sc.add_capabilities)
    return {
        "allowPrivilegeEscalation": bool(sc.allow_privilege_escalation),
        "capabilities": caps,
    }


def build_torchrun_args(ref: JobRef, spec: RFTJobSpec, attempt: int, rank: int) -> list[str]:
    t = spec.trainer
    return [
        f"--nnodes={t.nodes}",
        f"--nproc-per-node={max(1, t.gpus_per_node)}",
        f"--node-rank={rank}",
        f"--master-addr={master_addr(ref.name, attempt, ref.namespace)}",
        f"--master-port={t.master_port}",
        "-m",
        "rft_trainer",
        "--config",
        f"{c.CONFIG_MOUNT}/{c.CONFIG_FILE}",
    ]


def build_trainer_pod(ref: JobRef, spec: RFTJobSpec, attempt: int, rank: int) -> Obj:
    t = spec.trainer
    name = pod_name(ref.name, attempt, rank)
    lbls = labels(ref.name, c.ROLE_TRAINER, attempt) | {c.LABEL_RANK: str(rank)}
    container: Obj = {
        "name": "trainer",
        "image": t.image,
        # torchrun's own CLI, through a wrapper that keeps the failed worker's exit code
        # (plain torchrun exits 1 for every failure, hiding fatal codes like 78).
        "command": ["python", "-m", "rft_trainer.launch"],
        "args": build_torchrun_args(ref, spec, attempt, rank),
        "env": _trainer_env(ref, spec, attempt),
        "ports": [{"name": "rendezvous", "containerPort": t.master_port}],
        "resources": _resources(spec),
        "securityContext": build_container_security_context(spec),
        "volumeMounts": [
            {"name": "config", "mountPath": c.CONFIG_MOUNT, "readOnly": True},
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": "model-cache", "mountPath": c.MODEL_CACHE_MOUNT},
        ],
    }
    if t.image_pull_policy:
        container["imagePullPolicy"] = t.image_pull_policy
    pod_spec: Obj = {
        "hostname": name,
        "subdomain": service_name(ref.name),
        "restartPolicy": "Never",
        "serviceAccountName": trainer_service_account(ref.name, spec),
        "terminationGracePeriodSeconds": t.termination_grace_period_seconds,
        "securityContext": build_pod_security_context(spec),
        "containers": [container],
        "volumes": [
            {"name": "config", "configMap": {"name": configmap_name(ref.name)}},
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": t.shm_size}},
            {"name": "model-cache", "emptyDir": {}},
        ],
    }
    _placement(pod_spec, spec)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": _meta(ref, name, lbls),
        "spec": pod_spec,
    }


def build_trainer_pods(ref: JobRef, spec: RFTJobSpec, attempt: int) -> list[Obj]:
    return [build_trainer_pod(ref, spec, attempt, r) for r in range(spec.trainer.nodes)]


# ------------------------------------------------------------------ inference and explorers


def _identity_env(ref: JobRef) -> list[Obj]:
    return [
        {"name": c.ENV_JOB_NAME, "value": ref.name},
        {"name": c.ENV_JOB_NAMESPACE, "value": ref.namespace},
        {"name": c.ENV_JOB_UID, "value": ref.uid},
        {"name": c.ENV_POD_NAME, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": c.ENV_POD_IP, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
    ]


def _gpu_resources(res, gpus: int) -> Obj:
    # Quantities go out as strings: the API accepts both, typed clients only strings.
    requests = {k: str(v) for k, v in res.requests.items()}
    limits = {k: str(v) for k, v in res.limits.items()}
    if gpus > 0:
        limits["nvidia.com/gpu"] = requests["nvidia.com/gpu"] = str(gpus)
    return {k: v for k, v in (("requests", requests), ("limits", limits)) if v}


def _engine_container(ref: JobRef, spec: RFTJobSpec) -> Obj:
    """The inference engine. The reference engine starts empty and is loaded by the sync
    agent; vLLM/SGLang start from the weights an init container fetched."""
    inf = spec.inference
    port, initial = str(inf.port), f"{c.WEIGHTS_MOUNT}/initial"
    commands = {
        "reference": (["python", "-m", "rft_trainer.serve"],
                      ["--port", port, "--served-model-name", c.SERVED_MODEL_NAME]),
        "vllm": (["vllm", "serve"], [initial, "--host", "0.0.0.0", "--port", port,
                                     "--served-model-name", c.SERVED_MODEL_NAME]),
        "sglang": (["python", "-m", "sglang.launch_server"],
                   ["--model-path", initial, "--host", "0.0.0.0", "--port", port,
                    "--served-model-name", c.SERVED_MODEL_NAME]),
    }
    command, args = commands[inf.engine]
    env = [{"name": c.ENV_POD_IP, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
           {"name": "PYTHONUNBUFFERED", "value": "1"}]
    if inf.engine == "vllm":
        env.append({"name": "VLLM_SERVER_DEV_MODE", "value": "1"})  # weight-update endpoints
    return {
        "name": "engine",
        "image": inf.image or spec.trainer.image,
        "command": command,
        "args": args,
        "env": env,
        "ports": [{"name": "http", "containerPort": inf.port}],
        "readinessProbe": {"httpGet": {"path": "/health", "port": inf.port},
                           "periodSeconds": 5, "failureThreshold": 2},
        "resources": _gpu_resources(inf.resources, inf.gpus_per_replica),
        "securityContext": build_container_security_context(spec),
        "volumeMounts": [{"name": "weights", "mountPath": c.WEIGHTS_MOUNT}],
    }


def _agent_container(ref: JobRef, spec: RFTJobSpec, name: str, extra_args: list[str]) -> Obj:
    inf = spec.inference
    return {
        "name": name,
        "image": spec.trainer.image,
        "command": ["python", "-m", "rft_trainer.sync_agent"],
        "args": ["--engine", inf.engine, "--engine-port", str(inf.port),
                 "--dest", c.WEIGHTS_MOUNT, *extra_args],
        "env": _identity_env(ref) + _s3_env(spec),
        "securityContext": build_container_security_context(spec),
        "volumeMounts": [{"name": "weights", "mountPath": c.WEIGHTS_MOUNT}],
    }


def _with_hash(pod: Obj) -> Obj:
    """Stamp the rendered pod's hash: the operator replaces a pod whose spec drifted."""
    pod["metadata"].setdefault("annotations", {})[c.ANNOTATION_SPEC_HASH] = spec_hash(pod["spec"])
    return pod


def build_inference_pod(ref: JobRef, spec: RFTJobSpec, index: int) -> Obj:
    """One inference replica: the engine plus its sync agent, sharing a weights volume.
    Stable names (`<job>-inference-<i>`) key the replica entries in status.weightSync."""
    name = inference_pod_name(ref.name, index)
    lbls = labels(ref.name, c.ROLE_INFERENCE) | {c.LABEL_REPLICA: str(index)}
    pod_spec: Obj = {
        "hostname": name,
        "subdomain": inference_service_name(ref.name),
        "restartPolicy": "Always",
        "serviceAccountName": trainer_service_account(ref.name, spec),
        "securityContext": build_pod_security_context(spec),
        "containers": [_engine_container(ref, spec), _agent_container(ref, spec, "sync-agent", [])],
        "volumes": [{"name": "weights", "emptyDir": {}}],
    }
    if spec.inference.engine != "reference":
        pod_spec["initContainers"] = [_agent_container(ref, spec, "fetch-weights",
                                                       ["--fetch-only", f"{c.WEIGHTS_MOUNT}/initial"])]
    _placement(pod_spec, spec)
    return _with_hash({"apiVersion": "v1", "kind": "Pod", "metadata": _meta(ref, name, lbls), "spec": pod_spec})


def build_explorer_pod(ref: JobRef, spec: RFTJobSpec, index: int) -> Obj:
    ex = spec.explorer
    name = explorer_pod_name(ref.name, index)
    lbls = labels(ref.name, c.ROLE_EXPLORER) | {c.LABEL_REPLICA: str(index)}
    env = _identity_env(ref) + [
        {"name": c.ENV_CONFIG, "value": f"{c.CONFIG_MOUNT}/{c.CONFIG_FILE}"},
        {"name": c.ENV_EXPLORER_INDEX, "value": str(index)},
        {"name": c.ENV_EXPLORER_REPLICAS, "value": str(ex.replicas)},
        {"name": c.ENV_INFERENCE_ENDPOINTS, "value": ",".join(inference_endpoints(ref, spec))},
    ] + _s3_env(spec)
    container: Obj = {
        "name": "explorer",
        "image": ex.image or spec.trainer.image,
        "command": ["python", "-m", "rft_trainer.explorer"],
        "args": ["--config", f"{c.CONFIG_MOUNT}/{c.CONFIG_FILE}"],
        "env": env,
        "securityContext": build_container_security_context(spec),
        "volumeMounts": [{"name": "config", "mountPath": c.CONFIG_MOUNT, "readOnly": True}],
    }
    pod_spec: Obj = {
        # Exit 0 once the trainer is done; a crash restarts in place and resumes.
        "restartPolicy": "OnFailure",
        "serviceAccountName": trainer_service_account(ref.name, spec),
        "securityContext": build_pod_security_context(spec),
        "containers": [container],
        "volumes": [{"name": "config", "configMap": {"name": configmap_name(ref.name)}}],
    }
    _placement(pod_spec, spec)
    return _with_hash({"apiVersion": "v1", "kind": "Pod", "metadata": _meta(ref, name, lbls), "spec": pod_spec})


def _placement(pod_spec: Obj, spec: RFTJobSpec) -> None:
    """Trainer, inference and explorer pods share the trainer's placement constraints."""
    t = spec.trainer
    if t.node_selector:
        pod_spec["nodeSelector"] = dict(t.node_selector)
    if t.tolerations:
        pod_spec["tolerations"] = [tol.model_dump(by_alias=True, exclude_none=True) for tol in t.tolerations]
    if t.priority_class_name:
        pod_spec["priorityClassName"] = t.priority_class_name
    if t.scheduler_name:
        pod_spec["schedulerName"] = t.scheduler_name


def build_inference_service(ref: JobRef, spec: RFTJobSpec) -> Obj:
    """Headless: DNS names per replica (`<pod>.<job>-inference`) for explorers, and the
    Service for anything else that wants to query the policy."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(ref, inference_service_name(ref.name), labels(ref.name, c.ROLE_INFERENCE)),
        "spec": {
            "clusterIP": "None",
            "selector": {c.LABEL_JOB: ref.name, c.LABEL_ROLE: c.ROLE_INFERENCE},
            "ports": [{"name": "http", "port": spec.inference.port, "targetPort": spec.inference.port}],
        },
    }


def build_rollout_pods(ref: JobRef, spec: RFTJobSpec) -> list[Obj]:
    """Desired inference and explorer pods (they live across trainer attempts)."""
    out = []
    if spec.inference is not None:
        out += [build_inference_pod(ref, spec, i) for i in range(spec.inference.replicas)]
    if spec.explorer is not None:
        out += [build_explorer_pod(ref, spec, i) for i in range(spec.explorer.replicas)]
    return out


def build_static_children(ref: JobRef, spec: RFTJobSpec) -> list[Obj]:
    """Everything but the pods: these live as long as the job, across attempts."""
    out = []
    if not spec.trainer.service_account_name:
        out.append(build_service_account(ref))
    out += [
        build_status_role(ref),
        build_status_role_binding(ref, spec),
        build_configmap(ref, spec),
        build_headless_service(ref, spec),
    ]
    if spec.inference is not None:
        out.append(build_inference_service(ref, spec))
    return out
