"""Rendered children: golden snapshots plus the properties that must never regress.

Regenerate the snapshots after an intended change with `UPDATE_GOLDEN=1 pytest tests/unit`.
"""

import json
import os
from pathlib import Path

import pytest
import yaml

from rft_contract import names
from rft_operator import builders
from rft_contract.spec import parse_spec

from .testing import REF, SPEC

GOLDEN = Path(__file__).parent / "golden"


def check_golden(name: str, obj) -> None:
    path = GOLDEN / f"{name}.yaml"
    text = yaml.safe_dump(obj, sort_keys=True, width=100)
    if os.environ.get("UPDATE_GOLDEN"):
        path.write_text(text)
    assert path.exists(), f"missing {path}: run with UPDATE_GOLDEN=1"
    assert text == path.read_text(), f"{name} differs from {path} (UPDATE_GOLDEN=1 to accept)"


@pytest.fixture
def spec():
    return parse_spec(SPEC)


def test_golden_trainer_pod(spec):
    check_golden("trainer-pod-attempt2-rank1", builders.build_trainer_pod(REF, spec, 2, 1))


def test_golden_static_children(spec):
    check_golden("static-children", builders.build_static_children(REF, spec))


def test_pod_identity_and_rendezvous(spec):
    pod = builders.build_trainer_pod(REF, spec, 3, 1)
    assert pod["metadata"]["name"] == "demo-trainer-3-1"
    assert pod["metadata"]["labels"] == {
        names.LABEL_JOB: "demo", names.LABEL_ROLE: "trainer", names.LABEL_ATTEMPT: "3", names.LABEL_RANK: "1",
        names.LABEL_MANAGED_BY: names.MANAGED_BY,
    }
    assert pod["metadata"]["ownerReferences"][0]["uid"] == "0000-1111"
    ps = pod["spec"]
    assert (ps["hostname"], ps["subdomain"]) == ("demo-trainer-3-1", "demo-trainer")
    args = ps["containers"][0]["args"]
    assert "--nnodes=2" in args and "--nproc-per-node=8" in args and "--node-rank=1" in args
    assert "--master-addr=demo-trainer-3-0.demo-trainer.team-a.svc" in args
    assert args[args.index("-m") + 1] == "rft_trainer"
    env = {e["name"]: e for e in ps["containers"][0]["env"]}
    assert env[names.ENV_ATTEMPT]["value"] == "3" and env[names.ENV_JOB_NAME]["value"] == "demo"


def test_gpus_are_requested_from_gpus_per_node(spec):
    res = builders.build_trainer_pod(REF, spec, 1, 0)["spec"]["containers"][0]["resources"]
    assert res["limits"]["nvidia.com/gpu"] == "8" and res["requests"]["nvidia.com/gpu"] == "8"
    cpu_only = parse_spec({**SPEC, "trainer": {**SPEC["trainer"], "gpusPerNode": 0}})
    res = builders.build_trainer_pod(REF, cpu_only, 1, 0)["spec"]["containers"][0]["resources"]
    assert "nvidia.com/gpu" not in res.get("limits", {})
    args = builders.build_trainer_pod(REF, cpu_only, 1, 0)["spec"]["containers"][0]["args"]
    assert "--nproc-per-node=1" in args


def test_secrets_are_referenced_never_copied(spec):
    pod = builders.build_trainer_pod(REF, spec, 1, 0)
    env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
    assert env["AWS_SECRET_ACCESS_KEY"] == {
        "name": "AWS_SECRET_ACCESS_KEY",
        "valueFrom": {"secretKeyRef": {"name": "s3-creds", "key": "AWS_SECRET_ACCESS_KEY"}},
    }
    config = json.loads(builders.build_configmap(REF, spec)["data"][names.CONFIG_FILE])
    assert "credentials_secret" not in config["checkpoint"]
    assert config["checkpoint"]["endpoint"] == "http://minio.storage:9000"


def test_restricted_security_context_by_default(spec):
    pod = builders.build_trainer_pod(REF, spec, 1, 0)["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    csc = pod["containers"][0]["securityContext"]
    assert csc == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                   "readOnlyRootFilesystem": True}


def test_security_context_relaxed_only_explicitly():
    baseline = parse_spec({**SPEC, "trainer": {**SPEC["trainer"], "securityContext": {
        "runAsUser": 0, "addCapabilities": ["NET_BIND_SERVICE"]}}})
    pod = builders.build_trainer_pod(REF, baseline, 1, 0)["spec"]
    assert pod["securityContext"]["runAsUser"] == 0 and pod["securityContext"]["runAsNonRoot"] is False
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["containers"][0]["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]}
    # Beyond baseline only with the documented opt-in.
    privileged = parse_spec({**SPEC, "trainer": {**SPEC["trainer"], "securityContext": {
        "allowPrivileged": True, "addCapabilities": ["IPC_LOCK"], "seccompProfile": "Unconfined"}}})
    pod = builders.build_trainer_pod(REF, privileged, 1, 0)["spec"]
    assert pod["securityContext"]["seccompProfile"] == {"type": "Unconfined"}
    assert pod["containers"][0]["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}


def test_status_role_is_limited_to_this_job(spec):
    role = builders.build_status_role(REF)
    assert role["rules"] == [
        {"apiGroups": ["rft.dev"], "resources": ["rftjobs/status"], "resourceNames": ["demo"],
         "verbs": ["get", "patch"]},
        {"apiGroups": ["rft.dev"], "resources": ["rftjobs"], "resourceNames": ["demo"],
         "verbs": ["get", "list", "watch"]},  # sync agents watch their own job only
    ]


@pytest.mark.parametrize("extra, roles", [
    ({}, ["trainer"]),
    ({"inference": {"replicas": 1}}, ["trainer", "inference"]),
    ({"inference": {"replicas": 1}, "explorer": {"tasksetUri": "s3://bucket/tasks.jsonl"}},
     ["trainer", "inference", "explorer"]),
])
def test_each_pod_role_runs_as_its_own_service_account(extra, roles):
    spec = parse_spec({**SPEC, **extra})
    children = builders.build_static_children(REF, spec)
    accounts = [o["metadata"]["name"] for o in children if o["kind"] == "ServiceAccount"]
    assert accounts == [f"demo-rft-{r}" for r in roles]
    bindings = {o["roleRef"]["name"]: [s["name"] for s in o["subjects"]]
                for o in children if o["kind"] == "RoleBinding"}
    # Only the trainer and the sync agents may write the status; explorers only read.
    assert bindings.pop("demo-status-writer") == [f"demo-rft-{r}" for r in roles if r != "explorer"]
    assert bindings == ({"demo-status-reader": ["demo-rft-explorer"]} if "explorer" in roles else {})
    pods = [builders.build_trainer_pod(REF, spec, 1, 0), *builders.build_rollout_pods(REF, spec)]
    for pod in pods:
        assert pod["spec"]["serviceAccountName"] == f"demo-rft-{pod['metadata']['labels'][names.LABEL_ROLE]}"


def test_reader_role_only_reads_this_job():
    assert builders.build_reader_role(REF)["rules"] == [
        {"apiGroups": ["rft.dev"], "resources": ["rftjobs"], "resourceNames": ["demo"],
         "verbs": ["get", "list", "watch"]}]


TRACKING = {"mlflow": {"trackingUri": "https://mlflow.example", "experiment": "rft",
                        "credentialsSecret": "mlflow-creds"},
            "wandb": {"project": "rft", "apiKeySecret": "wandb-key"}}


@pytest.mark.parametrize("role", ["trainer", "explorer"])  # the explorers log their rollouts to runs of their own
def test_tracking_secrets_are_referenced_key_by_key(role):
    spec = parse_spec({**LOOP, "tracking": TRACKING})
    pod = (builders.build_trainer_pod(REF, spec, 1, 0) if role == "trainer"
           else builders.build_explorer_pod(REF, spec, 0))
    env = pod["spec"]["containers"][0]["env"]
    tracking = [e for e in env if e["name"].startswith(("MLFLOW_", "WANDB_"))]
    ref = lambda secret, key, **kw: {"name": key, "valueFrom": {"secretKeyRef": {  # noqa: E731
        "name": secret, "key": key, **kw}}}
    # MLflow takes a username and password or a token: each key is optional.
    assert tracking == [ref("mlflow-creds", "MLFLOW_TRACKING_USERNAME", optional=True),
                        ref("mlflow-creds", "MLFLOW_TRACKING_PASSWORD", optional=True),
                        ref("mlflow-creds", "MLFLOW_TRACKING_TOKEN", optional=True),
                        ref("wandb-key", "WANDB_API_KEY")]
    assert all("value" not in e for e in tracking)


@pytest.mark.parametrize("tracking", [None, {"tensorboard": {}},
                                      {"mlflow": {"trackingUri": "https://mlflow.example", "experiment": "rft"},
                                       "wandb": {"project": "rft", "mode": "offline"}}])
def test_tracking_without_secrets_adds_no_env(tracking):
    extra = {"tracking": tracking} if tracking is not None else {}
    env = builders.build_trainer_pod(REF, parse_spec({**SPEC, **extra}), 1, 0)["spec"]["containers"][0]["env"]
    assert not [e for e in env if e["name"].startswith(("MLFLOW_", "WANDB_"))]


def test_user_env_from_a_secret_is_a_reference():
    env = [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
           {"name": "NCCL_DEBUG", "value": "INFO"}]
    spec = parse_spec({**SPEC, "trainer": {**SPEC["trainer"], "env": env}})
    rendered = builders.build_trainer_pod(REF, spec, 1, 0)["spec"]["containers"][0]["env"][-2:]
    assert rendered == env
    with pytest.raises(ValueError, match="set value or valueFrom, not both"):
        parse_spec({**SPEC, "trainer": {**SPEC["trainer"], "env": [{**env[0], "value": "hf_x"}]}})


def test_config_map_carries_no_env_values():
    spec = parse_spec({**SPEC, "trainer": {**SPEC["trainer"], "env": [{"name": "WANDB_API_KEY", "value": "k-123"}]}})
    data = builders.build_configmap(REF, spec)["data"]
    assert "k-123" not in json.dumps(data) and "WANDB_API_KEY" not in json.dumps(data)
    env = builders.build_trainer_pod(REF, spec, 1, 0)["spec"]["containers"][0]["env"]
    assert {"name": "WANDB_API_KEY", "value": "k-123"} in env


def test_config_hash_changes_with_spec(spec):
    a = builders.build_configmap(REF, spec)["metadata"]["annotations"][names.ANNOTATION_SPEC_HASH]
    more = parse_spec({**SPEC, "trainer": {**SPEC["trainer"], "totalSteps": 200}})
    b = builders.build_configmap(REF, more)["metadata"]["annotations"][names.ANNOTATION_SPEC_HASH]
    assert a != b


LOOP = {**SPEC, "inference": {"replicas": 2, "gpusPerReplica": 1, "port": 8000},
        "explorer": {"replicas": 1, "tasksetUri": "s3://data/arith.jsonl", "rolloutsPerTask": 4}}


def test_golden_inference_and_explorer_pods():
    spec = parse_spec(LOOP)
    check_golden("inference-pod-1", builders.build_inference_pod(REF, spec, 1))
    check_golden("explorer-pod-0", builders.build_explorer_pod(REF, spec, 0))


def test_inference_pods_pair_the_engine_with_a_sync_agent_on_one_weights_volume():
    spec = parse_spec(LOOP)
    pod = builders.build_inference_pod(REF, spec, 0)
    engine, agent = pod["spec"]["containers"]
    assert pod["metadata"]["name"] == "demo-inference-0" and pod["spec"]["subdomain"] == "demo-inference"
    assert pod["metadata"]["labels"][names.LABEL_ROLE] == names.ROLE_INFERENCE
    assert engine["command"] == ["python", "-m", "rft_serving.serve"] and engine["image"] == SPEC["trainer"]["image"]
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert engine["readinessProbe"]["httpGet"] == {"path": "/health", "port": 8000}
    assert agent["command"] == ["python", "-m", "rft_serving.sync_agent"] and "resources" not in agent
    assert {m["mountPath"] for m in engine["volumeMounts"]} == {m["mountPath"] for m in agent["volumeMounts"]}
    env = {e["name"]: e for e in agent["env"]}
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "s3-creds"
    assert env[names.ENV_POD_NAME]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert "initContainers" not in pod["spec"]  # the reference engine starts empty


def test_vllm_engine_needs_its_image_and_fetches_weights_before_start():
    spec = parse_spec({**LOOP, "inference": {**LOOP["inference"], "engine": "vllm", "image": "vllm/vllm-openai:v0.11"}})
    pod = builders.build_inference_pod(REF, spec, 0)
    engine = pod["spec"]["containers"][0]
    assert engine["image"] == "vllm/vllm-openai:v0.11"
    # The API server module, not `vllm serve` (the CPU wheel's CLI cannot find its own
    # package name), under the supervisor the sync agent restarts it through.
    assert engine["command"] == ["python3", "-m", "rft_serving.supervise"]
    argv = engine["args"]
    assert argv[argv.index("--") + 1:argv.index("--") + 4] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--worker-extension-cls") + 1] == "rft_serving.vllm_worker.RFTWorkerExtension"
    assert "--fetch-only" in pod["spec"]["initContainers"][0]["args"]


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_the_engine_runs_the_helpers_the_init_container_installs(engine):
    """Any image with the engine works: the init container (our image) copies rft_serving's
    helpers to a volume the engine mounts read-only and has on its PYTHONPATH, and the agent
    reaches the supervisor on the control port the engine's command opens."""
    engine_c, agent, fetch = _engine_and_fetch(engine)
    helpers = fetch["args"][fetch["args"].index("--install-helpers") + 1]
    fetch_mount = {m["name"]: m for m in fetch["volumeMounts"]}["engine-helpers"]
    engine_mount = {m["name"]: m for m in engine_c["volumeMounts"]}["engine-helpers"]
    assert fetch_mount["mountPath"] == engine_mount["mountPath"] == helpers and engine_mount["readOnly"]
    assert {e["name"]: e.get("value") for e in engine_c["env"]}["PYTHONPATH"] == helpers
    control = engine_c["args"][engine_c["args"].index("--control-port") + 1]
    assert agent["args"][agent["args"].index("--supervisor-port") + 1] == control
    ports = {int(control), engine_c["ports"][0]["containerPort"], agent["ports"][0]["containerPort"]}
    assert len(ports) == 3


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_the_engine_gets_a_memory_backed_dev_shm(engine):
    """vLLM's engine core and workers exchange requests and weights through /dev/shm (a
    container runtime's default 64 MiB is too small for it to start)."""
    engine_c, _, _ = _engine_and_fetch(engine)
    spec = parse_spec({**LOOP, "inference": {**LOOP["inference"], "engine": engine, "image": f"{engine}:1"}})
    volumes = {v["name"]: v for v in builders.build_inference_pod(REF, spec, 0)["spec"]["volumes"]}
    mount = {m["mountPath"]: m["name"] for m in engine_c["volumeMounts"]}["/dev/shm"]
    assert volumes[mount]["emptyDir"] == {"medium": "Memory", "sizeLimit": "1Gi"}


def test_shm_size_zero_renders_no_dev_shm_volume(spec):
    """shmSize "0": no memory-backed /dev/shm (the runtime's default stays), for the
    trainer and the engine alike; the pods stay consistent (no mount without its volume)."""
    trainer_spec = parse_spec({**SPEC, "trainer": {**SPEC["trainer"], "shmSize": "0"}})
    pod = builders.build_trainer_pod(REF, trainer_spec, 1, 0)
    assert "dshm" not in {v["name"] for v in pod["spec"]["volumes"]}
    assert "/dev/shm" not in {m["mountPath"] for m in pod["spec"]["containers"][0]["volumeMounts"]}
    engine = parse_spec({**LOOP, "inference": {**LOOP["inference"], "engine": "vllm", "image": "v:1", "shmSize": "0"}})
    pod = builders.build_inference_pod(REF, engine, 0)
    assert "dshm" not in {v["name"] for v in pod["spec"]["volumes"]}
    assert all("/dev/shm" not in {m["mountPath"] for m in x["volumeMounts"]} for x in pod["spec"]["containers"])
    assert "dshm" in {v["name"] for v in builders.build_trainer_pod(REF, spec, 1, 0)["spec"]["volumes"]}


@pytest.mark.parametrize("port", [8471, 8472, 8473])
def test_the_supervisor_port_avoids_the_engine_and_relay_ports(port):
    spec = parse_spec({**LOOP, "inference": {**LOOP["inference"], "engine": "vllm", "image": "v:1", "port": port}})
    engine_c, agent = builders.build_inference_pod(REF, spec, 0)["spec"]["containers"]
    control = int(engine_c["args"][engine_c["args"].index("--control-port") + 1])
    assert control not in (port, agent["ports"][0]["containerPort"])


def test_inference_args_and_env_reach_the_engine_last():
    spec = parse_spec({**LOOP, "inference": {**LOOP["inference"], "engine": "vllm", "image": "v:1",
                                             "args": ["--dtype", "float32"],
                                             "env": [{"name": "VLLM_CPU_KVCACHE_SPACE", "value": "1"}]},
                       "sync": {"probeTolerance": 0.01}})
    engine_c, agent = builders.build_inference_pod(REF, spec, 0)["spec"]["containers"]
    assert engine_c["args"][-2:] == ["--dtype", "float32"]  # after the operator's: a repeated flag wins
    assert {"name": "VLLM_CPU_KVCACHE_SPACE", "value": "1"} in engine_c["env"]
    assert agent["args"][agent["args"].index("--probe-tolerance") + 1] == "0.01"


def test_inference_env_cannot_take_the_engines_own_variables():
    with pytest.raises(ValueError, match="spec.inference.env must not set PYTHONPATH"):
        parse_spec({**LOOP, "inference": {**LOOP["inference"], "engine": "vllm", "image": "v:1",
                                          "env": [{"name": "PYTHONPATH", "value": "/x"}]}})


def _engine_and_fetch(engine: str):
    spec = parse_spec({**LOOP, "inference": {**LOOP["inference"], "engine": engine, "image": f"{engine}:1"}})
    pod = builders.build_inference_pod(REF, spec, 0)
    engine_c, agent = pod["spec"]["containers"]
    (fetch,) = pod["spec"]["initContainers"]
    return engine_c, agent, fetch


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_engines_start_from_the_link_the_agent_keeps_current(engine):
    """The init container fetches to <dest>/initial, the engine starts from it, and the agent
    (same --dest) re-points that link after every load (rft_serving.sync_agent.INITIAL_LINK;
    tests/trainer/test_engines.py checks the two agree)."""
    engine_c, agent, fetch = _engine_and_fetch(engine)
    dest = agent["args"][agent["args"].index("--dest") + 1]
    assert fetch["args"][fetch["args"].index("--dest") + 1] == dest
    initial = fetch["args"][fetch["args"].index("--fetch-only") + 1]
    assert initial == f"{dest}/initial" and initial in engine_c["args"]
    assert engine_c["args"][engine_c["args"].index("--host") + 1] == "0.0.0.0"
    assert engine_c["args"][engine_c["args"].index("--served-model-name") + 1] == names.SERVED_MODEL_NAME


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("dtype, flag", [("fp32", "float32"), ("bf16", "bfloat16"), ("fp16", "float16")])
def test_engines_serve_in_the_exports_dtype_unless_the_args_say_otherwise(engine, dtype, flag):
    """vLLM's "auto" serves an fp32 export in 16 bits, which the fp32 probe refuses at
    every reload: the engine gets sync.dtype; inference.args come after (the last wins)."""
    inference = {**LOOP["inference"], "engine": engine, "image": f"{engine}:1"}
    spec = parse_spec({**LOOP, "inference": inference, "sync": {"dtype": dtype}})
    argv = builders.build_inference_pod(REF, spec, 0)["spec"]["containers"][0]["args"]
    assert argv[argv.index("--dtype") + 1] == flag
    spec = parse_spec({**LOOP, "inference": {**inference, "args": ["--dtype", "half"]}, "sync": {"dtype": dtype}})
    argv = builders.build_inference_pod(REF, spec, 0)["spec"]["containers"][0]["args"]
    assert argv[len(argv) - 1 - argv[::-1].index("--dtype") + 1] == "half"


def test_vllm_serves_the_dev_mode_weight_routes():
    engine_c, _, _ = _engine_and_fetch("vllm")
    env = {e["name"]: e.get("value") for e in engine_c["env"]}
    assert env["VLLM_SERVER_DEV_MODE"] == "1"  # /pause, /collective_rpc, /weight_info, ... (vLLM 0.32.0)
    assert engine_c["readinessProbe"]["httpGet"]["path"] == "/health"


def test_sglang_binds_all_interfaces_and_probes_ready():
    engine_c, _, _ = _engine_and_fetch("sglang")
    argv = engine_c["args"]
    assert argv[argv.index("--") + 1:argv.index("--") + 4] == ["python3", "-m", "sglang.launch_server"]
    assert "--weight-version" not in engine_c["args"]  # "default" until the agent labels a load
    # SGLang 0.5.23's /health generates a token and takes >= 1 s: past the probe's timeout.
    assert engine_c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert "VLLM_SERVER_DEV_MODE" not in {e["name"] for e in engine_c["env"]}


def test_explorers_get_every_replica_endpoint_and_their_index():
    spec = parse_spec({**LOOP, "explorer": {**LOOP["explorer"], "replicas": 3}})
    pods = [builders.build_explorer_pod(REF, spec, i) for i in range(3)]
    env = {e["name"]: e.get("value") for e in pods[2]["spec"]["containers"][0]["env"]}
    assert env[names.ENV_INFERENCE_ENDPOINTS] == (
        "http://demo-inference-0.demo-inference.team-a.svc:8000,"
        "http://demo-inference-1.demo-inference.team-a.svc:8000")
    assert env[names.ENV_EXPLORER_INDEX] == "2" and env[names.ENV_EXPLORER_REPLICAS] == "3"
    assert pods[0]["spec"]["restartPolicy"] == "OnFailure"


def test_rollout_pod_hash_changes_with_the_spec_but_not_with_the_pin():
    a = builders.build_explorer_pod(REF, parse_spec(LOOP), 0)
    pinned = builders.build_explorer_pod(REF, parse_spec({**LOOP, "sync": {"pinnedVersion": 2}}), 0)
    hotter = builders.build_explorer_pod(REF, parse_spec(
        {**LOOP, "explorer": {**LOOP["explorer"], "image": "other:1"}}), 0)
    h = lambda pod: pod["metadata"]["annotations"][names.ANNOTATION_SPEC_HASH]  # noqa: E731
    assert h(a) == h(pinned) and h(a) != h(hotter)


def _volumes(spec) -> dict:
    pod = builders.build_trainer_pod(REF, spec, 1, 0)["spec"]
    mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    return {v["name"]: (v, mounts.get(v["name"])) for v in pod["volumes"]}


def _with_cache(**cache):
    # A hostPath is beyond the Pod Security baseline: it needs the documented opt-in.
    trainer = {**SPEC["trainer"], "securityContext": {"allowPrivileged": True}} if "hostPath" in cache else SPEC["trainer"]
    return parse_spec({**SPEC, "trainer": trainer, "model": {**SPEC["model"], "cache": cache}})


@pytest.mark.parametrize("cache, volume", [
    ({}, {"emptyDir": {}}),
    ({"sizeLimit": "40Gi"}, {"emptyDir": {"sizeLimit": "40Gi"}}),
    ({"hostPath": "/mnt/rft-models"}, {"hostPath": {"path": "/mnt/rft-models", "type": "DirectoryOrCreate"}}),
    ({"persistentVolumeClaim": "models-rwx"}, {"persistentVolumeClaim": {"claimName": "models-rwx"}}),
])
def test_model_cache_volume_follows_spec_model_cache(cache, volume):
    got, mount = _volumes(_with_cache(**cache))["model-cache"]
    assert got == {"name": "model-cache", **volume} and mount == names.MODEL_CACHE_MOUNT


def test_model_download_timeout_reaches_the_trainer():
    env = {e["name"]: e.get("value") for e in
           builders.build_trainer_pod(REF, _with_cache(downloadTimeoutSeconds=7200), 1, 0)["spec"]["containers"][0]["env"]}
    assert env["RFT_MODEL_DOWNLOAD_TIMEOUT"] == "7200" and env["RFT_MODEL_CACHE"] == names.MODEL_CACHE_MOUNT


@pytest.mark.parametrize("limit, empty_dir", [(None, {}), ("200Gi", {"sizeLimit": "200Gi"})])
def test_staging_volume_is_an_emptydir_sized_by_checkpoint_staging_size_limit(limit, empty_dir):
    checkpoint = {**SPEC["checkpoint"], **({"stagingSizeLimit": limit} if limit else {})}
    spec = parse_spec({**SPEC, "checkpoint": checkpoint})
    got, mount = _volumes(spec)["staging"]
    assert got == {"name": "staging", "emptyDir": empty_dir} and mount == names.STAGING_MOUNT
    env = {e["name"]: e.get("value") for e in builders.build_trainer_pod(REF, spec, 1, 0)["spec"]["containers"][0]["env"]}
    assert env[names.ENV_STAGING_DIR] == names.STAGING_MOUNT


# Every role's pod, with init containers: vLLM's inference pod fetches weights first.
ALL_ROLES = {**LOOP, "inference": {**LOOP["inference"], "engine": "vllm", "image": "vllm:1"}}


def _all_containers(spec) -> list[tuple[str, dict, dict]]:
    """(pod/container, container, pod spec) for every container of every pod role."""
    pods = [builders.build_trainer_pod(REF, spec, 1, 0), *builders.build_rollout_pods(REF, spec)]
    return [(f"{pod['metadata']['name']}/{x['name']}", x, pod["spec"]) for pod in pods
            for x in pod["spec"].get("initContainers", []) + pod["spec"]["containers"]]


def test_every_container_is_read_only_with_a_writable_tmp_and_home():
    containers = _all_containers(parse_spec(ALL_ROLES))
    assert {name.split("/")[1] for name, _, _ in containers} == {
        "trainer", "engine", "sync-agent", "fetch-weights", "explorer"}
    for name, x, pod in containers:
        assert x["securityContext"]["readOnlyRootFilesystem"] is True, name
        assert {"name": "tmp", "mountPath": "/tmp"} in x["volumeMounts"], name
        assert [e for e in x["env"] if e["name"] == "HOME"] == [{"name": "HOME", "value": "/tmp"}], name
        assert {"name": "tmp", "emptyDir": {}} in pod["volumes"], name
        # The volumes a program writes to stay: shared memory, caches, weights.
        assert all(m["name"] in {v["name"] for v in pod["volumes"]} for m in x["volumeMounts"]), name
    trainer = _volumes(parse_spec(ALL_ROLES))
    assert trainer["dshm"][1] == "/dev/shm" and trainer["tmp"] == ({"name": "tmp", "emptyDir": {}}, "/tmp")


def test_read_only_root_filesystem_opt_out_reaches_every_container():
    trainer = {**ALL_ROLES["trainer"], "securityContext": {"readOnlyRootFilesystem": False}}
    spec = parse_spec({**ALL_ROLES, "trainer": trainer})
    for name, x, _ in _all_containers(spec):
        assert x["securityContext"]["readOnlyRootFilesystem"] is False, name
        assert {"name": "tmp", "mountPath": "/tmp"} in x["volumeMounts"], name
    # A pod setting, not the programs': the ConfigMap (and its hash) does not carry it.
    config = builders.build_configmap(REF, spec)
    assert "security_context" not in json.loads(config["data"][names.CONFIG_FILE])["trainer"]
    assert config == builders.build_configmap(REF, parse_spec(ALL_ROLES))
    # Rollout pods carry a spec hash: switching it replaces them.
    h = lambda pod: pod["metadata"]["annotations"][names.ANNOTATION_SPEC_HASH]  # noqa: E731
    assert [h(p) for p in builders.build_rollout_pods(REF, spec)] != [
        h(p) for p in builders.build_rollout_pods(REF, parse_spec(ALL_ROLES))]


def test_home_set_in_trainer_env_wins():
    trainer = {**SPEC["trainer"], "env": [{"name": "HOME", "value": "/var/cache/rft/models/home"}]}
    pod = builders.build_trainer_pod(REF, parse_spec({**SPEC, "trainer": trainer}), 1, 0)
    env = pod["spec"]["containers"][0]["env"]
    assert [e for e in env if e["name"] == "HOME"] == [{"name": "HOME", "value": "/var/cache/rft/models/home"}]


# ------------------------------------------------------------------ /metrics of the job's pods
# rft_contract.podmetrics: the trainer's rank 0, each sync agent and each explorer serve it
# on a port named `metrics` (the monitoring component's PodMonitor selects it by name).

def _ports(container) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container.get("ports", [])}


def _pod_ports(pod) -> list[int]:
    return [p["containerPort"] for c in pod["spec"]["containers"] for p in c.get("ports", [])]


def test_only_the_rank_0_trainer_pod_names_a_metrics_port(spec):
    rank0, rank1 = (builders.build_trainer_pod(REF, spec, 1, r)["spec"]["containers"][0] for r in (0, 1))
    assert _ports(rank0) == {"rendezvous": spec.trainer.master_port, "metrics": 9400, "weights": 8471}
    assert "metrics" not in _ports(rank1)  # nothing listens there: no target to be down
    assert "weights" not in _ports(rank1)  # rank 0 exports
    assert not any(e["name"] == "RFT_METRICS_PORT" for c in (rank0, rank1) for e in c["env"])


def test_the_trainers_metrics_port_moves_aside_for_the_rendezvous():
    spec = parse_spec({**SPEC, "trainer": {**SPEC["trainer"], "masterPort": 9400}})
    (c,) = builders.build_trainer_pod(REF, spec, 1, 0)["spec"]["containers"]
    assert _ports(c) == {"rendezvous": 9400, "metrics": 9401, "weights": 8471}
    assert {e["name"]: e.get("value") for e in c["env"]}["RFT_METRICS_PORT"] == "9401"


def test_rank_0_serves_the_weights_fast_path_on_a_free_port_unless_it_is_off():
    spec = parse_spec({**SPEC, "trainer": {**SPEC["trainer"], "masterPort": 8471}})
    (c,) = builders.build_trainer_pod(REF, spec, 1, 0)["spec"]["containers"]
    assert _ports(c)["weights"] == 8472
    env = {e["name"]: e for e in c["env"]}
    assert env["RFT_WEIGHTS_PEER_PORT"]["value"] == "8472"
    assert env["RFT_POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    off = parse_spec({**SPEC, "sync": {"fastPath": False}})
    (c,) = builders.build_trainer_pod(REF, off, 1, 0)["spec"]["containers"]
    assert "weights" not in _ports(c) and not any(e["name"] == "RFT_WEIGHTS_PEER_PORT" for e in c["env"])


def test_with_evaluation_rank_0_gets_the_inference_endpoints_before_the_users_env():
    user = [{"name": "USER_LAST", "value": "1"}]
    spec = parse_spec({**LOOP, "trainer": {**LOOP["trainer"], "nodes": 2, "env": user},
                       "evaluation": {"tasksetUri": "s3://data/heldout.jsonl"}})
    (rank0,) = builders.build_trainer_pod(REF, spec, 1, 0)["spec"]["containers"]
    (rank1,) = builders.build_trainer_pod(REF, spec, 1, 1)["spec"]["containers"]
    names_ = [e["name"] for e in rank0["env"]]
    assert names_[-1] == "USER_LAST" and names.ENV_INFERENCE_ENDPOINTS in names_
    endpoints = next(e["value"] for e in rank0["env"] if e["name"] == names.ENV_INFERENCE_ENDPOINTS)
    assert endpoints == ",".join(builders.inference_endpoints(REF, spec)) and endpoints.count("http://") == 2
    assert not any(e["name"] == names.ENV_INFERENCE_ENDPOINTS for e in rank1["env"])
    (plain,) = builders.build_trainer_pod(REF, parse_spec(LOOP), 1, 0)["spec"]["containers"]
    assert not any(e["name"] == names.ENV_INFERENCE_ENDPOINTS for e in plain["env"])  # no evaluation: as before


def test_the_sync_agent_and_the_explorer_name_a_metrics_port_and_the_engine_none():
    spec = parse_spec(LOOP)
    engine, agent = builders.build_inference_pod(REF, spec, 0)["spec"]["containers"]
    (explorer,) = builders.build_explorer_pod(REF, spec, 0)["spec"]["containers"]
    assert _ports(agent)["metrics"] == _ports(explorer)["metrics"] == 9400
    assert "metrics" not in _ports(engine)
    assert not any(e["name"] == "RFT_METRICS_PORT" for c in (engine, agent, explorer) for e in c["env"])


@pytest.mark.parametrize("engine", ["reference", "vllm"])
def test_the_sync_agents_metrics_port_moves_aside_for_an_engine_on_it(engine):
    spec = parse_spec({**LOOP, "inference": {**LOOP["inference"], "port": 9400, "engine": engine, "image": "e:1"}})
    pod = builders.build_inference_pod(REF, spec, 0)
    agent = pod["spec"]["containers"][1]
    assert _ports(agent)["metrics"] == 9401
    assert {e["name"]: e.get("value") for e in agent["env"]}["RFT_METRICS_PORT"] == "9401"
    assert len(_pod_ports(pod)) == len(set(_pod_ports(pod)))


@pytest.mark.parametrize("port", [8000, 9400])
def test_the_metrics_endpoint_leaves_the_rollout_pods_spec_hash_alone(port):
    """An operator upgrade that adds the port replaces no running inference or explorer pod:
    their hash is the one rendered without it (port and RFT_METRICS_PORT)."""
    spec = parse_spec({**LOOP, "inference": {**LOOP["inference"], "port": port}})
    for pod in builders.build_rollout_pods(REF, spec):
        bare = {**pod["spec"], "containers": []}
        for c in pod["spec"]["containers"]:
            c = {k: v for k, v in c.items() if k != "terminationMessagePolicy"}
            ports = [p for p in c.pop("ports", []) if p["name"] != "metrics"]
            c["env"] = [e for e in c["env"] if e["name"] != "RFT_METRICS_PORT"]
            bare["containers"].append({**c, "ports": ports} if ports else c)
        assert pod["metadata"]["annotations"][names.ANNOTATION_SPEC_HASH] == builders.spec_hash(bare)


def test_every_pod_of_a_job_has_distinct_container_ports():
    spec = parse_spec(ALL_ROLES)
    pods = builders.build_rollout_pods(REF, spec) + builders.build_trainer_pods(REF, spec, 1)
    for pod in pods:
        assert len(_pod_ports(pod)) == len(set(_pod_ports(pod))), pod["metadata"]["name"]


def test_weights_over_nccl_start_vllm_with_its_backend_and_tell_rank_0_and_the_agents():
    """sync.transport nccl: vLLM's --weight-transfer-config before the user's args, rank 0's
    RFT_WEIGHTS_TRANSPORT, the agents' --transport; none of it by default (no spec hash moves)."""
    vllm = {**LOOP, "inference": {**LOOP["inference"], "engine": "vllm", "image": "e:1", "args": ["--seed", "1"]}}
    for sync, on in (({"transport": "nccl"}, True), ({}, False)):
        spec = parse_spec({**vllm, "sync": sync})
        (trainer,) = builders.build_trainer_pod(REF, spec, 1, 0)["spec"]["containers"]
        env = {e["name"]: e.get("value") for e in trainer["env"]}
        engine, agent = builders.build_inference_pod(REF, spec, 0)["spec"]["containers"]
        if on:
            assert env["RFT_WEIGHTS_TRANSPORT"] == "nccl"
            i = engine["args"].index("--weight-transfer-config")
            assert json.loads(engine["args"][i + 1]) == {"backend": "nccl"} and engine["args"][-2:] == ["--seed", "1"]
            assert agent["args"][agent["args"].index("--transport") + 1] == "nccl"
        else:
            assert "RFT_WEIGHTS_TRANSPORT" not in env and "--weight-transfer-config" not in engine["args"]
            assert "--transport" not in agent["args"]
