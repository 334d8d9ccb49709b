"""Small pure policies with table-driven tests: exit codes and disruptions, backoff,
progress deadline, pods stuck terminating and their nodes, ownership and drift of children,
conditions."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from rft_contract.names import ANNOTATION_MANAGED_KEYS, GROUP, LABEL_MANAGED_BY
from rft_contract.spec import FailurePolicy
from rft_contract.times import format_time

FATAL = "fatal"
RETRYABLE = "retryable"
DISRUPTED = "disrupted"  # the cluster stopped the pod: restart without using the budget

# DisruptionTarget reasons say the cluster stopped the pod for reasons of its own:
# EvictionByEvictionAPI (drain, descheduler), PreemptionByScheduler, DeletionByTaintManager
# (node not ready or unreachable), DeletionByPodGC (node gone). TerminationByKubelet is the
# exception: the kubelet's node-pressure eviction is often the job's own memory use.
TERMINATION_BY_KUBELET = "TerminationByKubelet"
# The kubelet also uses TerminationByKubelet for a graceful node shutdown, and then sets the
# pod's status.reason to this ("Shutdown" before Kubernetes 1.27); node pressure sets "Evicted".
NODE_SHUTDOWN_REASONS = ("Terminated", "Shutdown")

# How long past its deletion deadline (deletionTimestamp = request + grace period) a pod may
# stay terminating before it is force-deleted: a kubelet that is alive confirms well within.
FORCE_DELETE_MARGIN_SECONDS = 60.0


def classify_exit_code(code: int | None, policy: FailurePolicy) -> str:
    """Whether a failed trainer pod's exit code may be retried.

    No exit code (evicted, node lost, deleted) is always retryable: the program did not
    say it was broken. `fatalExitCodes` win; when `retryableExitCodes` is set it is an
    allow-list and anything else is fatal.
    """
    if code is None:
        return RETRYABLE
    if code in policy.fatal_exit_codes:
        return FATAL
    if policy.retryable_exit_codes is not None and code not in policy.retryable_exit_codes:
        return FATAL
    return RETRYABLE


def classify_failure(code: int | None, disruption: str | None, policy: FailurePolicy,
                     status_reason: str | None = None) -> str:
    """A pod the cluster disrupted (DisruptionTarget: evicted, preempted, tainted away,
    garbage-collected, its node shut down) ended for the cluster's reasons, not the
    program's: DISRUPTED, its exit code (usually 143, from SIGTERM) not judged. A pod the
    kubelet evicted for node pressure (`TerminationByKubelet`, status.reason "Evicted")
    is RETRYABLE: it uses the restart budget like a crash (the pressure is often the job's
    own memory), but its exit code is the kill's, not judged either. Any other pod is
    judged by its exit code."""
    if disruption == TERMINATION_BY_KUBELET and status_reason not in NODE_SHUTDOWN_REASONS:
        return RETRYABLE
    if disruption:
        return DISRUPTED
    return classify_exit_code(code, policy)


def should_restart(restarts: int, policy: FailurePolicy) -> bool:
    """True while the restart budget allows another attempt."""
    return restarts < policy.max_restarts


def backoff_remaining(failed_at: datetime | None, backoff_seconds: float, now: datetime) -> float:
    """Seconds left before the next attempt may start (0 when due)."""
    if failed_at is None:
        return 0.0
    elapsed = (now - failed_at).total_seconds()
    return max(0.0, backoff_seconds - elapsed)


def progress_deadline_remaining(since: datetime | None, deadline_seconds: int, now: datetime) -> float | None:
    """Seconds left before the progress deadline passes, counted from `since` (when the
    step last moved); negative once it has passed, i.e. once more than `deadline_seconds`
    went by without a step. None when there is no deadline (0 turns it off) or no clock."""
    if not deadline_seconds or since is None:
        return None
    return deadline_seconds - (now - since).total_seconds()


def force_delete_remaining(deletion_deadline: datetime | None, now: datetime,
                           margin: float = FORCE_DELETE_MARGIN_SECONDS) -> float | None:
    """Seconds until a terminating pod counts as stuck (<= 0: it is); None for a pod that
    is not being deleted. The deadline already includes the pod's grace period (the API
    server sets deletionTimestamp to request time + grace)."""
    if deletion_deadline is None:
        return None
    return margin - (now - deletion_deadline).total_seconds()


# What the operator knows of the Node of a pod stuck terminating (`classify_node`).
NODE_GONE = "gone"  # 404: its pods run nowhere
NODE_OUT_OF_SERVICE = "out-of-service"  # an admin says it is down (the taint below)
NODE_UP = "up"  # it exists and nobody said it is down: it may still run the pod
NODE_UNREADABLE = "unreadable"  # the operator may not read it (a namespaced install: 403)
OUT_OF_SERVICE_TAINT = "node.kubernetes.io/out-of-service"


def classify_node(node: dict[str, Any] | None) -> str:
    """A Node object as read (None: 404). Kubernetes' rule for force-deleting a pod whose
    kubelet never confirms: only once the node is known to run nothing, i.e. its Node
    object is gone or carries the `out-of-service` taint (the admin's statement that it
    is shut down). NotReady is not enough: a partitioned node still runs its pods."""
    if node is None:
        return NODE_GONE
    if any(t.get("key") == OUT_OF_SERVICE_TAINT for t in (node.get("spec") or {}).get("taints") or []):
        return NODE_OUT_OF_SERVICE
    return NODE_UP


def may_force_delete(node_name: str, nodes: dict[str, str]) -> bool:
    """Whether a pod stuck terminating on `node_name` may be force-deleted: its node is
    gone or out of service, or it never had one (nothing runs it). Unknown: no."""
    return not node_name or nodes.get(node_name) in (NODE_GONE, NODE_OUT_OF_SERVICE)


# ------------------------------------------------------------------ children

OURS, PREVIOUS, FOREIGN = "ours", "previous", "foreign"


def classify_owner(live_meta: dict[str, Any], job_name: str, job_uid: str, job_kind: str) -> str:
    """Whose is an existing child named like one of ours? `ours` when its controller
    ownerReference is this job (by uid); `previous` when it is a deleted job of the same
    name (another uid: the garbage collector is removing it, wait); `foreign` otherwise
    (no controller, or another controller): never adopt it."""
    ref = next((r for r in live_meta.get("ownerReferences") or [] if r.get("controller")), None)
    if ref is None:
        return FOREIGN
    if ref.get("uid") == job_uid:
        return OURS
    if ref.get("kind") == job_kind and ref.get("name") == job_name:
        return PREVIOUS
    return FOREIGN


def covers(live: Any, want: Any) -> bool:
    """Whether the live value still holds everything the operator rendered: every key of
    a rendered dict with a covering value (the API server's defaults, e.g. a port's
    protocol, are extra keys and fine), lists element by element with the same length
    (an added port or subject is drift), scalars equal."""
    if isinstance(want, dict):
        return isinstance(live, dict) and all(k in live and covers(live[k], v) for k, v in want.items())
    if isinstance(want, list):
        return isinstance(live, list) and len(live) == len(want) and all(map(covers, live, want))
    return live == want


def is_our_key(key: str) -> bool:
    """A label or annotation key in the operator's own namespaces."""
    return key.startswith(f"{GROUP}/") or key == LABEL_MANAGED_BY


def compute_patch(rendered: dict[str, Any], live: dict[str, Any] | None) -> dict[str, Any]:
    """The merge patch that brings a live child back to `rendered`: the rendered object,
    plus null for each label and annotation the live object has, the operator rendered
    before and no longer renders. Ours are the keys in our namespaces (`is_our_key`) and
    the ones the previous render listed in `rft.dev/managed-keys`; any other key (the API
    server's, another controller's, a user's) stays. `live`: the child's live fields
    (`model.managed_fields`) or the whole object."""
    meta = (live or {}).get("metadata") or {}
    listed = json.loads((meta.get("annotations") or {}).get(ANNOTATION_MANAGED_KEYS) or "{}")
    out = copy.deepcopy(rendered)
    for part in ("labels", "annotations"):
        want = out["metadata"].get(part) or {}
        stale = {k: None for k in meta.get(part) or {}
                 if k not in want and (is_our_key(k) or k in listed.get(part, ()))}
        if stale:
            out["metadata"][part] = {**want, **stale}
    return out


def build_managed_keys(meta: dict[str, Any]) -> str:
    """The `rft.dev/managed-keys` value for rendered metadata: its label and annotation
    keys outside our namespaces (e.g. spec.serviceAccountAnnotations), so the next render
    knows to remove those it drops; "" when there are none."""
    keys = {part: sorted(k for k in meta.get(part) or {} if not is_our_key(k)) for part in ("labels", "annotations")}
    keys = {part: v for part, v in keys.items() if v}
    return json.dumps(keys, sort_keys=True, separators=(",", ":")) if keys else ""


# ------------------------------------------------------------------ conditions


@dataclass(frozen=True)
class Cond:
    type: str
    status: bool
    reason: str
    message: str = ""


def compute_conditions(
    old: list[dict[str, Any]] | None, new: list[Cond], generation: int | None, now: datetime
) -> list[dict[str, Any]]:
    """Merge desired conditions into the old list, Kubernetes-style.

    `lastTransitionTime` moves only when `status` flips; reason/message/generation update
    freely. Conditions we do not manage (e.g. ones the trainer adds) are kept.
    """
    by_type = {c["type"]: dict(c) for c in (old or [])}
    for cond in new:
        status = "True" if cond.status else "False"
        prev = by_type.get(cond.type)
        changed = prev is None or prev.get("status") != status
        by_type[cond.type] = {
            "type": cond.type,
            "status": status,
            "reason": cond.reason,
            "message": cond.message,
            "lastTransitionTime": format_time(now) if changed else prev.get("lastTransitionTime"),
            "observedGeneration": generation,
        }
    return sorted(by_type.values(), key=lambda c: c["type"])
