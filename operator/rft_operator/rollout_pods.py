"""The rollout pods: inference replicas and explorers. Pure, no I/O.

Unlike the trainer gang they live across trainer attempts, under stable names
(`<job>-inference-<i>`, `<job>-explorer-<i>`), and carry a hash of their rendered spec so
the reconcile can replace one whose spec drifted (`rollout.py`). An inference pod pairs
the engine with a sync agent on a shared weights volume; the agent loads whatever
`status.weightSync.target` names (docs/design.md, "Weight sync"), reading it from its
parent replica's agent (port `weights`) rather than S3 where it can (rft_contract.relay).
"""

from __future__ import annotations

from rft_contract import names
from rft_contract.engines import ENGINES, engine_command
from rft_contract.podmetrics import ENV_METRICS_PORT, METRICS_PORT_NAME
from rft_contract.spec import RFTJobSpec

from .objects import (JobRef, Obj, build_container_security_context, build_metrics_port, build_pod,
                      build_pod_security_context, build_shm, build_resources, build_s3_env, build_tracking_env,
                      build_user_env, labels, spec_hash)

# Weight relay (rft_contract.relay): each sync agent serves the weights it has to its
# children, replica i reading replica (i - 1) // WEIGHTS_FANOUT, so S3 serves a version
# about once whatever the replica count. Fanout 2 keeps a parent's upload at twice a
# download while the tree stays log2(replicas) deep (streamed: depth costs little).
WEIGHTS_FANOUT = 2
SUPERVISOR_PORT = 8473  # rft_serving.supervise's control server, on the pod's loopback
# Where the init container puts the engine's helpers (rft_serving.supervise, .vllm_worker).
HELPERS_MOUNT = "/opt/rft/engine"


def inference_endpoints(ref: JobRef, spec: RFTJobSpec) -> list[str]:
    """Stable per-replica URLs (headless Service DNS); explorers balance over them."""
    inf = spec.inference
    if inf is None:
        return []
    svc = names.inference_service_name(ref.name)
    return [f"http://{names.inference_pod_name(ref.name, i)}.{svc}.{ref.namespace}.svc:{inf.port}"
            for i in range(inf.replicas)]


def _identity_env(ref: JobRef) -> list[Obj]:
    return [
        {"name": names.ENV_JOB_NAME, "value": ref.name},
        {"name": names.ENV_JOB_NAMESPACE, "value": ref.namespace},
        {"name": names.ENV_JOB_UID, "value": ref.uid},
        {"name": names.ENV_POD_NAME, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": names.ENV_POD_IP, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
    ]


def _engine_command(spec: RFTJobSpec) -> list[str]:
    """The engine's command line: its profile's (rft_contract.engines), then `inference.args`
    (a repeated flag wins). A supervised engine (vLLM, SGLang) runs under
    rft_serving.supervise (the sync agent restarts it through it: a reload that broke the
    engine, or weights that fail the probe) from the helpers the init container copied
    (`HELPERS_MOUNT`, on PYTHONPATH), so any image with the engine works; it starts from
    `initial`, the weights the init container fetched and the agent re-points at every
    version it loads (a LoRA job's adapters load onto the base, which it stays). Engines
    serve in `sync.dtype`, the dtype of the exports and of their probes. A LoRA job gets the
    profile's `lora_flags` (vLLM: run-time adapters; the base then serves apart,
    rft_contract.engines.adapter_policy)."""
    inf = spec.inference
    profile = ENGINES[inf.engine]
    lora = spec.model.lora
    command = engine_command(profile, inf.port, names.SERVED_MODEL_NAME, spec.sync.dtype,
                             f"{names.WEIGHTS_MOUNT}/initial", lora=lora.rank if lora is not None else None)
    if spec.sync.transport == "nccl":  # its NCCL weight-transfer backend (rft_contract.nccl)
        command += profile.nccl_flags
    if not profile.supervised:
        return [*command, *inf.args]
    return ["python3", "-m", "rft_serving.supervise", "--control-port", str(supervisor_port(spec)), "--",
            *command, *inf.args]


def _engine_container(ref: JobRef, spec: RFTJobSpec) -> Obj:
    """The inference engine, ready when its profile's readiness path answers 200."""
    inf = spec.inference
    profile = ENGINES[inf.engine]
    env = [{"name": names.ENV_POD_IP, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
           {"name": "PYTHONUNBUFFERED", "value": "1"}]
    mounts = [{"name": "weights", "mountPath": names.WEIGHTS_MOUNT}]
    if profile.supervised:
        env.append({"name": "PYTHONPATH", "value": HELPERS_MOUNT})
        mounts.append({"name": "engine-helpers", "mountPath": HELPERS_MOUNT, "readOnly": True})
        mounts += build_shm(inf.shm_size)[1]  # the engines' shared-memory queues
    env += [{"name": k, "value": v} for k, v in profile.env]  # e.g. vLLM's weight-update routes
    if spec.model.lora is not None:  # e.g. vLLM's run-time adapter routes
        env += [{"name": k, "value": v} for k, v in profile.lora_env]
    env += [build_user_env(e) for e in inf.env]
    command = _engine_command(spec)
    return {
        "name": "engine",
        "image": inf.image or spec.trainer.image,
        "command": command[:3],
        "args": command[3:],
        "env": env,
        "ports": [{"name": "http", "containerPort": inf.port}],
        "readinessProbe": {"httpGet": {"path": profile.readiness_path, "port": inf.port},
                           "periodSeconds": 5, "failureThreshold": 2},
        "resources": build_resources(inf.resources, inf.gpus_per_replica),
        "securityContext": build_container_security_context(spec),
        "volumeMounts": mounts,
    }


def weights_peer_port(spec: RFTJobSpec) -> int:
    """The sync agent's relay port (names.agent_port)."""
    return names.agent_port(spec.inference.port)


def supervisor_port(spec: RFTJobSpec) -> int:
    """The engine supervisor's control port (127.0.0.1 only): one the engine and the relay
    do not use."""
    taken = {spec.inference.port, weights_peer_port(spec)}
    return next(p for p in range(SUPERVISOR_PORT, SUPERVISOR_PORT + 3) if p not in taken)


def _agent_container(ref: JobRef, spec: RFTJobSpec, name: str, extra_args: list[str]) -> Obj:
    """The sync agent (sidecar), or with `--fetch-only` the init container that fetches
    the initial weights for engines that cannot start empty. Both read from the parent
    replica first (`--fanout`); the sidecar also serves its children (`--peer-port`)."""
    inf = spec.inference
    return {
        "name": name,
        "image": spec.trainer.image,
        "command": ["python", "-m", "rft_serving.sync_agent"],
        "args": ["--engine", inf.engine, "--engine-port", str(inf.port),
                 "--dest", names.WEIGHTS_MOUNT, "--fanout", str(WEIGHTS_FANOUT), *extra_args],
        "volumeMounts": [{"name": "weights", "mountPath": names.WEIGHTS_MOUNT}],
        "env": _identity_env(ref) + build_s3_env(spec),
        "securityContext": build_container_security_context(spec),
    }


def _sync_agent_container(ref: JobRef, spec: RFTJobSpec) -> Obj:
    port = weights_peer_port(spec)
    extra = ["--peer-port", str(port)]
    if ENGINES[spec.inference.engine].supervised:
        extra += ["--supervisor-port", str(supervisor_port(spec))]
    if spec.sync.probe_tolerance is not None:
        extra += ["--probe-tolerance", str(spec.sync.probe_tolerance)]
    if spec.sync.transport != "files":
        extra += ["--transport", spec.sync.transport]
    agent = _agent_container(ref, spec, "sync-agent", extra)
    metrics_ports, metrics_env = build_metrics_port({spec.inference.port, port, supervisor_port(spec)})
    agent["ports"] = [{"name": "weights", "containerPort": port}, *metrics_ports]
    agent["env"] += metrics_env
    return agent


# Container fields that change nothing the program sees, left out of the hash so that an
# operator upgrade that adds one does not replace every running explorer and inference pod:
# pods created before it keep running without it until something else replaces them.
UNHASHED_CONTAINER_FIELDS = ("terminationMessagePolicy",)


def _hashed(container: Obj) -> Obj:
    """What of a container the spec hash covers: not the UNHASHED_CONTAINER_FIELDS, nor the
    /metrics endpoint (`build_metrics_port`: its port and RFT_METRICS_PORT), for the same
    reason: the upgrade that added it replaces no running pod (those go unscraped until
    something else replaces them)."""
    out = {k: v for k, v in container.items() if k not in UNHASHED_CONTAINER_FIELDS}
    ports = [x for x in out.get("ports", []) if x["name"] != METRICS_PORT_NAME]
    if len(ports) < len(out.get("ports", [])):
        out["env"] = [x for x in out.get("env", []) if x["name"] != ENV_METRICS_PORT]
        if ports:
            out["ports"] = ports
        else:
            del out["ports"]
    return out


def _with_hash(pod: Obj) -> Obj:
    """Stamp the rendered pod's hash: the operator replaces a pod whose spec drifted."""
    spec = {**pod["spec"]}
    for kind in ("initContainers", "containers"):
        if kind in spec:
            spec[kind] = [_hashed(x) for x in spec[kind]]
    pod["metadata"].setdefault("annotations", {})[names.ANNOTATION_SPEC_HASH] = spec_hash(spec)
    return pod


def build_inference_pod(ref: JobRef, spec: RFTJobSpec, index: int) -> Obj:
    """One inference replica: the engine plus its sync agent, sharing a weights volume.
    Stable names (`<job>-inference-<i>`) key the replica entries in status.weightSync."""
    name = names.inference_pod_name(ref.name, index)
    lbls = labels(ref.name, names.ROLE_INFERENCE) | {names.LABEL_REPLICA: str(index)}
    pod_spec: Obj = {
        "hostname": name,
        "subdomain": names.inference_service_name(ref.name),
        "restartPolicy": "Always",
        "serviceAccountName": names.service_account_name(ref.name, names.ROLE_INFERENCE),
        "securityContext": build_pod_security_context(spec),
        "containers": [_engine_container(ref, spec), _sync_agent_container(ref, spec)],
        "volumes": [{"name": "weights", "emptyDir": {}}],
    }
    if ENGINES[spec.inference.engine].supervised:  # it cannot start empty: the init container fetches
        fetch = _agent_container(ref, spec, "fetch-weights", ["--fetch-only", f"{names.WEIGHTS_MOUNT}/initial",
                                                              "--install-helpers", HELPERS_MOUNT])
        fetch["volumeMounts"].append({"name": "engine-helpers", "mountPath": HELPERS_MOUNT})
        pod_spec["initContainers"] = [fetch]
        pod_spec["volumes"] += [{"name": "engine-helpers", "emptyDir": {}}, *build_shm(spec.inference.shm_size)[0]]
    return _with_hash(build_pod(ref, spec, name, lbls, pod_spec))


def _explorer_container(ref: JobRef, spec: RFTJobSpec, index: int) -> Obj:
    ex = spec.explorer
    env = _identity_env(ref) + [
        {"name": names.ENV_CONFIG, "value": f"{names.CONFIG_MOUNT}/{names.CONFIG_FILE}"},
        {"name": names.ENV_EXPLORER_INDEX, "value": str(index)},
        {"name": names.ENV_EXPLORER_REPLICAS, "value": str(ex.replicas)},
        {"name": names.ENV_INFERENCE_ENDPOINTS, "value": ",".join(inference_endpoints(ref, spec))},
    ] + build_s3_env(spec) + build_tracking_env(spec)
    metrics_ports, metrics_env = build_metrics_port()
    return {
        "name": "explorer",
        "image": ex.image or spec.trainer.image,
        "command": ["python", "-m", "rft_rollout.explorer"],
        "args": ["--config", f"{names.CONFIG_MOUNT}/{names.CONFIG_FILE}"],
        "env": env + metrics_env,
        "ports": metrics_ports,
        "securityContext": build_container_security_context(spec),
        "volumeMounts": [{"name": "config", "mountPath": names.CONFIG_MOUNT, "readOnly": True}],
    }


def build_explorer_pod(ref: JobRef, spec: RFTJobSpec, index: int) -> Obj:
    """One explorer: rollouts against every inference replica, experience to the buffer."""
    name = names.explorer_pod_name(ref.name, index)
    lbls = labels(ref.name, names.ROLE_EXPLORER) | {names.LABEL_REPLICA: str(index)}
    pod_spec: Obj = {
        # Exit 0 once the trainer is done; a crash restarts in place and resumes.
        "restartPolicy": "OnFailure",
        "serviceAccountName": names.service_account_name(ref.name, names.ROLE_EXPLORER),
        "securityContext": build_pod_security_context(spec),
        "containers": [_explorer_container(ref, spec, index)],
        "volumes": [{"name": "config", "configMap": {"name": names.configmap_name(ref.name)}}],
    }
    return _with_hash(build_pod(ref, spec, name, lbls, pod_spec))


def build_rollout_pods(ref: JobRef, spec: RFTJobSpec) -> list[Obj]:
    """Desired inference and explorer pods (they live across trainer attempts)."""
    out = []
    if spec.inference is not None:
        out += [build_inference_pod(ref, spec, i) for i in range(spec.inference.replicas)]
    if spec.explorer is not None:
        out += [build_explorer_pod(ref, spec, i) for i in range(spec.explorer.replicas)]
    return out
