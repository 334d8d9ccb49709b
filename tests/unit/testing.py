"""What the unit tests build their cases from, in one place (like JobSet's
`pkg/util/testing/wrappers.go`): the demo RFTJob and its clock, its status, its children
and its pods (as the operator's `PodView` or as the API server shows them), and the gang
concern run on such pods. A plain module, not a test file: every test file imports its
builders from here, never from another test file. `conftest.py` re-exports `NOW`, `SPEC`
and `make_job` for its fixtures."""

from __future__ import annotations

import copy
from datetime import datetime, timedelta, timezone
from typing import Any, Iterable

from rft_contract import names
from rft_contract.spec import parse_spec
from rft_contract.times import format_time
from rft_operator import gang
from rft_operator.builders import build_configmap
from rft_operator.model import PodView
from rft_operator.objects import JobRef
from rft_operator.reconcile import Observed
from rft_operator.rollout_pods import build_rollout_pods

# ------------------------------------------------------------------ the job

NOW = datetime(2026, 11, 30, 12, 0, 0, tzinfo=timezone.utc)
UID = "0000-1111"
REF = JobRef("demo", "team-a", UID)

SPEC = {
    "model": {"path": "s3://models/tiny-qwen"},
    "algorithm": {"name": "grpo", "learningRate": 1e-6},
    "trainer": {
        "image": "ghcr.io/rft-dev/trainer:0.1.0",
        "nodes": 2,
        "gpusPerNode": 8,
        "totalSteps": 100,
        "batchSize": 64,
        "resources": {"requests": {"cpu": "8", "memory": "64Gi"}},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    },
    "checkpoint": {
        "uri": "s3://ckpts/demo",
        "interval": 10,
        "credentialsSecret": "s3-creds",
        "endpoint": "http://minio.storage:9000",
    },
    "failurePolicy": {"maxRestarts": 2, "backoffSeconds": 30},
}
# The full loop: two inference replicas and one explorer beside the trainer.
LOOP = {**SPEC, "inference": {"replicas": 2, "port": 8000},
        "explorer": {"replicas": 1, "tasksetUri": "s3://data/a.jsonl"}}


def make_job(spec: dict | None = None, status: dict | None = None, generation: int = 1) -> dict:
    return {
        "apiVersion": "rft.dev/v1alpha1",
        "kind": "RFTJob",
        "metadata": {
            "name": "demo",
            "namespace": "team-a",
            "uid": UID,
            "generation": generation,
            "resourceVersion": "42",
        },
        "spec": copy.deepcopy(spec if spec is not None else SPEC),
        "status": status or {},
    }


def at(seconds: float) -> str:
    """NOW plus `seconds` (negative: earlier), as the API server writes a time."""
    return format_time(NOW + timedelta(seconds=seconds))


# ------------------------------------------------------------------ its status


def status(phase: str, attempt: int = 1, restarts: int = 0, **extra: Any) -> dict:
    """The job's status as stored: phase, attempt, restarts and any other fields."""
    return {"phase": phase, "attempt": attempt, "restarts": restarts, **extra}


def last_failure(seconds: float = 0, *, attempt: int = 1, rank: int = 1, exit_code: int = 1) -> dict:
    """status.lastFailure: trainer pod `rank` of `attempt` failed `seconds` from NOW."""
    return {"attempt": attempt, "pod": f"demo-trainer-{attempt}-{rank}", "exitCode": exit_code,
            "reason": names.REASON_POD_FAILED, "time": at(seconds)}


def condition(job_status: dict, type_: str) -> dict:
    """The condition of type `type_` in a job status."""
    return next(x for x in job_status["conditions"] if x["type"] == type_)


def cond(plan, type_: str) -> dict:
    """The condition of type `type_` in the status a reconcile plan writes."""
    return condition(plan.status, type_)


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386, as the API server applies application/merge-patch+json; `target` is kept."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_patch(out.get(k), v)
    return out


# ------------------------------------------------------------------ its static children

# The train-only job's static children but its ConfigMap, as observed: (kind, name) -> spec hash.
STATIC = {
    ("ServiceAccount", "demo-rft-trainer"): "",
    ("Role", "demo-status-writer"): "",
    ("RoleBinding", "demo-status-writer"): "",
    ("Service", "demo-trainer"): "",
}
CURRENT_HASH = build_configmap(REF, parse_spec(SPEC))["metadata"]["annotations"][names.ANNOTATION_SPEC_HASH]


def observed(pods: Iterable[PodView] = (), cm_hash: str | None = CURRENT_HASH) -> Observed:
    """The train-only job's children as observed: its static children, its ConfigMap with
    `cm_hash` (None: missing) and `pods`."""
    children = dict(STATIC)
    if cm_hash is not None:
        children[("ConfigMap", "demo-config")] = cm_hash
    return Observed(pods=list(pods), children=children)


# ------------------------------------------------------------------ pods as the operator sees them


def pod(attempt: int, rank: int, phase: str = "Running", exit_code: int | None = None, *,
        deleting: bool = False, deletion_deadline: datetime | None = None, grace: int | None = None,
        node: str = "", owner_uid: str = "", disruption: str | None = None, **fields: Any) -> PodView:
    """Trainer pod `demo-trainer-<attempt>-<rank>` as a `PodView`. A `deletion_deadline`
    (its deletionTimestamp) makes it deleting, as on the API server; `grace` is its
    deletionGracePeriodSeconds, `node` its nodeName, `disruption` its DisruptionTarget
    reason. Other `PodView` fields (reason, finished_at, ...) pass through."""
    return PodView(f"demo-trainer-{attempt}-{rank}", attempt, rank, phase,
                   deleting or deletion_deadline is not None, exit_code, deletion_deadline=deletion_deadline,
                   deletion_grace_seconds=grace, node_name=node, owner_uid=owner_uid, disruption=disruption, **fields)


def rollout_pod(name: str, phase: str = "Running", *, role: str = names.ROLE_INFERENCE, spec_hash: str = "",
                deleting: bool = False) -> PodView:
    """An inference or explorer pod as a `PodView`: no attempt, no rank."""
    return PodView(name, -1, -1, phase, deleting, role=role, spec_hash=spec_hash)


def rollout_pods(spec: dict = LOOP, phase: str = "Running", *, drop: Iterable[str] = (), stale: Iterable[str] = (),
                 failed: Iterable[str] = (), deleting: Iterable[str] = (), extra: Iterable[str] = ()) -> list[PodView]:
    """The rollout pods `spec` renders as observed in `phase`, with some changed: `drop`
    missing, `stale` rendered from another spec, `failed` Failed, `deleting` being deleted,
    and `extra` inference replicas no longer wanted."""
    out = []
    for obj in build_rollout_pods(REF, parse_spec(spec)):
        meta = obj["metadata"]
        name = meta["name"]
        if name in drop:
            continue
        h = "stale" if name in stale else meta["annotations"][names.ANNOTATION_SPEC_HASH]
        out.append(rollout_pod(name, "Failed" if name in failed else phase, role=meta["labels"][names.LABEL_ROLE],
                               spec_hash=h, deleting=name in deleting))
    return out + [rollout_pod(n, spec_hash="x") for n in extra]


def views(*pods: dict) -> list[PodView]:
    """Pods as the API server shows them (`pod_dict`), as the operator reads them."""
    return [PodView.from_pod(p) for p in pods]


# ------------------------------------------------------------------ pods as the API server shows them

NODE = "gpu-node-1"


def pod_dict(attempt: int, rank: int, phase: str = "Running", *, exit_code: int | None = None,
             finished: float | None = None, disrupted: str | None = None, disrupted_at: float = -120,
             deleted_at: float | None = None, grace: int = 30, terminated_reason: str = "Error",
             node: str = NODE, said: str = "") -> dict:
    """A trainer pod as `kubectl get pod -o json` shows it. `finished`, `disrupted_at` and
    `deleted_at` are seconds from NOW; `deleted_at` is when the delete request came: the API
    server sets deletionTimestamp to that plus the grace period."""
    name = f"demo-trainer-{attempt}-{rank}"
    meta = {
        "name": name, "namespace": "team-a", "uid": f"uid-{name}", "resourceVersion": "1000",
        "creationTimestamp": at(-600),
        "labels": {names.LABEL_JOB: "demo", names.LABEL_MANAGED_BY: names.MANAGED_BY,
                   names.LABEL_ROLE: names.ROLE_TRAINER,
                   names.LABEL_ATTEMPT: str(attempt), names.LABEL_RANK: str(rank)},
        "ownerReferences": [{"apiVersion": names.API_VERSION, "kind": names.KIND, "name": "demo", "uid": UID,
                             "controller": True, "blockOwnerDeletion": True}],
    }
    if deleted_at is not None:
        meta["deletionTimestamp"] = at(deleted_at + grace)
        meta["deletionGracePeriodSeconds"] = grace
    conditions = [{"type": t, "status": "True" if phase == "Running" else "False", "lastProbeTime": None,
                   "lastTransitionTime": at(-590)} for t in ("Initialized", "Ready", "ContainersReady")]
    conditions.append({"type": "PodScheduled", "status": "True", "lastProbeTime": None,
                       "lastTransitionTime": at(-595)})
    if disrupted:
        conditions.append({"type": "DisruptionTarget", "status": "True", "reason": disrupted,
                           "message": "Eviction API: evicting", "lastProbeTime": None,
                           "lastTransitionTime": at(disrupted_at)})
    if exit_code is None:
        state = {"running": {"startedAt": at(-590)}}
    else:
        state = {"terminated": {"exitCode": exit_code, "reason": terminated_reason, "startedAt": at(-590),
                                "finishedAt": at(finished if finished is not None else -60),
                                "containerID": f"containerd://{rank}"}}
        if said:  # the kubelet's termination message: with FallbackToLogsOnError, the log's tail
            state["terminated"]["message"] = said
    pod_status = {"phase": phase, "conditions": conditions, "hostIP": "10.0.0.1", "podIP": f"10.1.0.{rank}",
                  "startTime": at(-595), "qosClass": "Burstable",
                  "containerStatuses": [{"name": "trainer", "image": "trainer:0.1", "imageID": "", "ready": False,
                                         "restartCount": 0, "started": exit_code is None, "state": state,
                                         "lastState": {}, "containerID": f"containerd://{rank}"}]}
    if phase == "Failed" and disrupted == "TerminationByKubelet":
        pod_status["reason"] = "Evicted"
        conditions[-1]["message"] = "The node was low on resource: memory. Threshold quantity: 100Mi, available: 0."
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
            "spec": {"containers": [{"name": "trainer"}], "nodeName": node}, "status": pod_status}


def failed(rank: int, code: int, finished: float, **kw: Any) -> dict:
    """Rank `rank` of attempt 1, Failed with exit code `code` `finished` seconds from NOW."""
    return pod_dict(1, rank, "Failed", exit_code=code, finished=finished, **kw)


# ------------------------------------------------------------------ the gang concern on them


def gang_for(pods: Iterable[dict], old: dict | None = None, after: float = 0, nodes: dict | None = None,
             **failure_policy: Any) -> gang.Gang:
    """The gang concern on `pods` (as the API server shows them) `after` seconds past NOW,
    with spec.failurePolicy's fields overridden by `failure_policy`; `old` is the stored
    status (default: attempt 1 running, no restarts)."""
    spec = parse_spec({**SPEC, "failurePolicy": {**SPEC["failurePolicy"], **failure_policy}})
    old = old or status(names.RUNNING)
    return gang.compute_gang(REF, spec, "", old, views(*pods), NOW + timedelta(seconds=after), nodes=nodes)
