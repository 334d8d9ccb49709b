"""Small pure policies with table-driven tests: exit codes, backoff, progress deadline,
conditions."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from rft_contract.spec import FailurePolicy

FATAL = "fatal"
RETRYABLE = "retryable"


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
