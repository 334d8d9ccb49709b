"""The trainer gang's pods: one pod per node, named `<job>-trainer-<attempt>-<rank>`. Pure.

Every rank runs torchrun with a static rendezvous on rank 0's stable DNS name (the
headless `<job>-trainer` Service), so a gang is a fixed set of named pods per attempt and
a restart is a new attempt with new names. Terminated pods of earlier attempts keep their
names and logs.
"""

from __future__ import annotations

from rft_contract import names
from rft_contract.podenv import VARIABLES
from rft_contract.spec import RFTJobSpec

from .objects import (JobRef, Obj, build_container_security_context, build_metrics_port, build_pod, build_shm,
                      build_tracking_env, build_user_env, build_pod_security_context, build_resources, build_s3_env,
                      labels)
from .rollout_pods import inference_endpoints

WEIGHTS_PORT_NAME = "weights"


def build_trainer_env(ref: JobRef, spec: RFTJobSpec, attempt: int) -> list[Obj]:
    """What the trainer needs to find its job, its config and its checkpoint bucket."""
    env = [
        {"name": names.ENV_JOB_NAME, "value": ref.name},
        {"name": names.ENV_JOB_NAMESPACE, "value": ref.namespace},
        {"name": names.ENV_JOB_UID, "value": ref.uid},
        {"name": names.ENV_ATTEMPT, "value": str(attempt)},
        {"name": names.ENV_CONFIG, "value": f"{names.CONFIG_MOUNT}/{names.CONFIG_FILE}"},
        {"name": names.ENV_POD_NAME, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
        # The base model is downloaded once per node (local rank 0) into the model-cache
        # volume; the other ranks wait this long for it.
        {"name": VARIABLES["model_cache"], "value": names.MODEL_CACHE_MOUNT},
        {"name": VARIABLES["model_download_timeout"], "value": str(spec.model.cache.download_timeout_seconds)},
        # A resuming pod downloads the checkpoint once into the staging volume.
        {"name": VARIABLES["staging_dir"], "value": names.STAGING_MOUNT},
        # The trainer checkpoints on SIGTERM only if that fits in the grace period.
        {"name": "RFT_TERMINATION_GRACE_SECONDS", "value": str(spec.trainer.termination_grace_period_seconds)},
    ]
    env += build_s3_env(spec)
    env += build_tracking_env(spec)
    env += [build_user_env(e) for e in spec.trainer.env]
    return env


def build_weights_port(ports: list[Obj]) -> Obj:
    """Rank 0's weights server (the fast path, rft_trainer.export.FastPath): the relay's port
    (names.WEIGHTS_PEER_PORT) unless another port of the pod has it."""
    taken = {p["containerPort"] for p in ports if p.get("name") != WEIGHTS_PORT_NAME}
    port = next(p for p in range(names.WEIGHTS_PEER_PORT, names.WEIGHTS_PEER_PORT + len(taken) + 1)
                if p not in taken)
    return {"name": WEIGHTS_PORT_NAME, "containerPort": port}


def build_weights_env(port: Obj, transport: str = "files") -> list[Obj]:
    """Where rank 0 serves the weights and the address it announces them at; with
    `sync.transport: nccl`, that it also sends them over NCCL (rft_trainer.nccl_sender)."""
    env = [{"name": VARIABLES["weights_peer_port"], "value": str(port["containerPort"])},
           {"name": VARIABLES["pod_ip"], "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
    if transport != "files":  # absent by default: pods of every earlier job keep their spec hash
        env.append({"name": VARIABLES["weights_transport"], "value": transport})
    return env


def build_torchrun_args(ref: JobRef, spec: RFTJobSpec, attempt: int, rank: int) -> list[str]:
    """Static rendezvous: every rank knows the gang size and rank 0's address up front."""
    t = spec.trainer
    return [
        f"--nnodes={t.nodes}",
        f"--nproc-per-node={max(1, t.gpus_per_node)}",
        f"--node-rank={rank}",
        f"--master-addr={names.master_addr(ref.name, attempt, ref.namespace)}",
        f"--master-port={t.master_port}",
        "-m",
        "rft_trainer",
        "--config",
        f"{names.CONFIG_MOUNT}/{names.CONFIG_FILE}",
    ]


def build_trainer_container(ref: JobRef, spec: RFTJobSpec, attempt: int, rank: int) -> Obj:
    """Rank 0's pod also names the port of the trainer's /metrics (global rank 0 serves it):
    the other pods serve none, so the PodMonitor finds no target there."""
    t = spec.trainer
    ports, env = [{"name": "rendezvous", "containerPort": t.master_port}], build_trainer_env(ref, spec, attempt)
    if rank == 0:
        metrics_ports, metrics_env = build_metrics_port({t.master_port})
        ports, env = ports + metrics_ports, env + metrics_env
        if spec.evaluation is not None:  # rank 0 scores versions through the inference pods (the user's env last)
            env.insert(len(env) - len(spec.trainer.env),
                       {"name": names.ENV_INFERENCE_ENDPOINTS, "value": ",".join(inference_endpoints(ref, spec))})
        if spec.sync.fast_path:
            weights = build_weights_port(ports)
            ports, env = ports + [weights], build_weights_env(weights, spec.sync.transport) + env  # the user's env last
    container: Obj = {
        "name": "trainer",
        "image": t.image,
        # torchrun's own CLI, through a wrapper that keeps the failed worker's exit code
        # (plain torchrun exits 1 for every failure, hiding fatal codes like 78).
        "command": ["python", "-m", "rft_trainer.launch"],
        "args": build_torchrun_args(ref, spec, attempt, rank),
        "env": env,
        "ports": ports,
        "resources": build_resources(t.resources, t.gpus_per_node),
        "securityContext": build_container_security_context(spec),
        "volumeMounts": [
            {"name": "config", "mountPath": names.CONFIG_MOUNT, "readOnly": True},
            *build_shm(t.shm_size)[1],
            {"name": "model-cache", "mountPath": names.MODEL_CACHE_MOUNT},
            {"name": "staging", "mountPath": names.STAGING_MOUNT},
        ],
    }
    if t.image_pull_policy:
        container["imagePullPolicy"] = t.image_pull_policy
    return container


def build_model_cache_volume(spec: RFTJobSpec) -> Obj:
    """`spec.model.cache`: a hostPath or a PVC keeps the model across attempts (files are
    reused when size and checksum match); the default emptyDir lives as long as the pod."""
    cache = spec.model.cache
    if cache.host_path:
        return {"name": "model-cache", "hostPath": {"path": cache.host_path, "type": "DirectoryOrCreate"}}
    if cache.persistent_volume_claim:
        return {"name": "model-cache", "persistentVolumeClaim": {"claimName": cache.persistent_volume_claim}}
    return {"name": "model-cache", "emptyDir": _size_limited(cache.size_limit)}


def build_staging_volume(spec: RFTJobSpec) -> Obj:
    """Where a resuming pod downloads the checkpoint once for all its ranks."""
    return {"name": "staging", "emptyDir": _size_limited(spec.checkpoint.staging_size_limit)}


def _size_limited(limit: str | None) -> Obj:
    return {"sizeLimit": limit} if limit else {}


def build_trainer_pod(ref: JobRef, spec: RFTJobSpec, attempt: int, rank: int) -> Obj:
    """`restartPolicy: Never`: a failed rank ends the attempt; the operator decides
    whether the whole gang restarts (see `gang.py` and `failure_policy.py`)."""
    t = spec.trainer
    name = names.pod_name(ref.name, attempt, rank)
    lbls = labels(ref.name, names.ROLE_TRAINER, attempt) | {names.LABEL_RANK: str(rank)}
    pod_spec: Obj = {
        "hostname": name,
        "subdomain": names.service_name(ref.name),
        "restartPolicy": "Never",
        "serviceAccountName": names.service_account_name(ref.name, names.ROLE_TRAINER),
        "terminationGracePeriodSeconds": t.termination_grace_period_seconds,
        "securityContext": build_pod_security_context(spec),
        "containers": [build_trainer_container(ref, spec, attempt, rank)],
        "volumes": [
            {"name": "config", "configMap": {"name": names.configmap_name(ref.name)}},
            *build_shm(t.shm_size)[0],
            build_model_cache_volume(spec),
            build_staging_volume(spec),
        ],
    }
    return build_pod(ref, spec, name, lbls, pod_spec)


def build_trainer_pods(ref: JobRef, spec: RFTJobSpec, attempt: int) -> list[Obj]:
    return [build_trainer_pod(ref, spec, attempt, r) for r in range(spec.trainer.nodes)]
