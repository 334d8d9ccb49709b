"""Small pure policies with table-driven tests: exit codes and disruptions, backoff,
progress deadline, pods stuck terminating, ownership and drift of children, conditions."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from rft_contract.spec import FailurePolicy

FATAL = "fatal"
RETRYABLE = "retryable"
DISRUPTED = "disrupted"  # the cluster stopped the pod: restart without using the budget

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


def classify_failure(code: int | None, disruption: str | None, policy: FailurePolicy) -> str:
    """A pod the cluster disrupted (DisruptionTarget: evicted, preempted, drained, node
    pressure) ended for the cluster's reasons, not the program's: its exit code (usually
    143, from SIGTERM) is not judged. Any other pod is judged by its exit code."""
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
    """Seconds until a terminating pod counts as stuck and is force-deleted (<= 0: now);
    None for a pod that is not being deleted. The deadline already includes the pod's
    grace period (the API server sets deletionTimestamp to request time + grace)."""
    if deletion_deadline is None:
        return None
    return margin - (now - deletion_deadline).total_seconds()


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


# ------------------------------------------------------------------ time


def format_time(t: datetime) -> str:
    return t.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(s: str | None) -> datetime | None:
    if not s:
        return None
    return datetime.strptime(s, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)


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
