"""The RFTJob's conditions: Checkpointed, Running, Suspended, Succeeded, Failed,
Progressing, WeightsSynced when the job serves inference, Admitted when Kueue queues it,
and kstatus' Ready, Reconciling
and Stalled (what Flux and cli-utils read). Pure, no I/O.

Every condition the operator manages is written on every pass, True or False, so
`kubectl wait --for=condition=...` works both ways; the merge (`compute_conditions`)
moves `lastTransitionTime` only when a status flips and keeps conditions others own.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from rft_contract import names
from rft_contract.times import format_time

from .model import Obj


@dataclass(frozen=True)
class Cond:
    """One condition as a concern wants it; `compute_conditions` merges it into the stored list."""

    type: str
    status: bool
    reason: str
    message: str = ""


def compute_job_conditions(old_conditions: list[Obj] | None, gang_status: Obj, failed_reason: str | None,
                           trainer: Obj, sync_cond: Cond | None, generation: int | None,
                           now: datetime, progress_deadline: int = 0, queue_cond: Cond | None = None) -> list[Obj]:
    """The merged condition list: this pass's phase and message (`gang_status`), the
    trainer's last committed checkpoint, progress against `progress_deadline`
    (spec.failurePolicy.progressDeadlineSeconds), the WeightsSynced condition if any, and
    Kueue's Admitted for a job it queues."""
    reason = failed_reason or compute_failed_reason(old_conditions)
    new = [build_checkpointed(trainer.get("lastCheckpoint") or {})]
    new += build_phase_conditions(gang_status.get("phase"), gang_status.get("message") or "", reason)
    new.append(build_progressing(gang_status, reason, progress_deadline))
    if sync_cond is not None:
        new.append(sync_cond)
    if queue_cond is not None:
        new.append(queue_cond)
    new += build_kstatus(gang_status.get("phase"), gang_status.get("message") or "", reason, sync_cond)
    return compute_conditions(old_conditions, new, generation, now)


def build_kstatus(phase: str | None, message: str, failed_reason: str, sync_cond: Cond | None) -> list[Cond]:
    """Ready, Reconciling and Stalled as kstatus reads them (without them it calls every
    RFTJob Current, a failed one included). Stalled is True on Failed (reason and message
    the failure's); Ready is True when the job is where its spec wants it: Running with
    every replica on the latest weights (or no inference), Succeeded, or Suspended;
    Reconciling is True otherwise (Pending, Restarting, weights on their way), with the
    phase or the weight sync's reason. A spec edit not yet observed is kstatus' own
    InProgress (status.observedGeneration)."""
    phase = phase or names.PENDING
    if phase == names.FAILED:
        return [Cond(names.COND_READY, False, failed_reason, message),
                Cond(names.COND_RECONCILING, False, failed_reason, ""),
                Cond(names.COND_STALLED, True, failed_reason, message)]
    if phase == names.RUNNING and sync_cond is not None and not sync_cond.status \
            and sync_cond.reason != names.REASON_NO_REPLICAS:  # inference scaled to 0: nothing to wait for
        busy = (sync_cond.reason, sync_cond.message)
    elif phase in (names.RUNNING, names.SUCCEEDED, names.SUSPENDED):
        return [Cond(names.COND_READY, True, phase, message),
                Cond(names.COND_RECONCILING, False, phase, ""),
                Cond(names.COND_STALLED, False, phase, "")]
    else:
        busy = (phase, message)
    return [Cond(names.COND_READY, False, *busy),
            Cond(names.COND_RECONCILING, True, *busy),
            Cond(names.COND_STALLED, False, phase, "")]


def compute_failed_reason(old_conditions: list[Obj] | None) -> str:
    """A failed job keeps the reason it failed with (FatalExitCode, ...) on later passes,
    which no longer know why."""
    return next(
        (x.get("reason") for x in old_conditions or []
         if x.get("type") == names.COND_FAILED and x.get("status") == "True"),
        names.FAILED,
    )


def build_checkpointed(checkpoint: Obj) -> Cond:
    """True once the trainer reported a committed checkpoint (`status.trainer.lastCheckpoint`)."""
    step = checkpoint.get("step")
    if step is None:
        return Cond(names.COND_CHECKPOINTED, False, names.REASON_NO_CHECKPOINT, "no checkpoint committed yet")
    return Cond(names.COND_CHECKPOINTED, True, names.REASON_CHECKPOINT_SAVED, f"step {step} at {checkpoint.get('uri')}")


def build_phase_conditions(phase: str | None, message: str, failed_reason: str) -> list[Cond]:
    """One condition per phase a user waits for; only the current phase's is True. Running
    always carries the phase message (why it is not running yet), the others only while True."""
    return [
        Cond(names.COND_RUNNING, phase == names.RUNNING, phase or names.PENDING, message),
        Cond(names.COND_SUSPENDED, phase == names.SUSPENDED,
             names.REASON_SUSPENDED if phase == names.SUSPENDED else names.REASON_NOT_SUSPENDED,
             message if phase == names.SUSPENDED else ""),
        Cond(names.COND_SUCCEEDED, phase == names.SUCCEEDED, phase or names.PENDING,
             message if phase == names.SUCCEEDED else ""),
        Cond(names.COND_FAILED, phase == names.FAILED,
             failed_reason if phase == names.FAILED else phase or names.PENDING,
             message if phase == names.FAILED else ""),
    ]


def build_progressing(gang_status: Obj, failed_reason: str, deadline: int) -> Cond:
    """True (`Stepping`) while the gang runs within the progress deadline: the clock in
    `status.progress` restarts whenever the trainer's step moves. False otherwise, with the
    phase as the reason, except that a deadline that ended an attempt stays the reason
    (`ProgressDeadlineExceeded`, with the failure's message) while the gang restarts, until
    the next attempt runs, or in the job that failed of it. The message changes only with
    the step, so it costs no status write of its own."""
    phase = gang_status.get("phase") or names.PENDING
    if phase == names.RUNNING:
        record = gang_status.get("progress") or {}
        step, attempt, since = record.get("step"), record.get("attempt"), record.get("since")
        what = (f"attempt {attempt}: no step reported since {since}" if step is None
                else f"step {step} of attempt {attempt} reported at {since}")
        limit = (f"; restarted after {deadline}s without a step (spec.failurePolicy.progressDeadlineSeconds)"
                 if deadline else "; no progress deadline (spec.failurePolicy.progressDeadlineSeconds=0)")
        return Cond(names.COND_PROGRESSING, True, names.REASON_STEPPING, what + limit)
    failure = gang_status.get("lastFailure") or {}
    if failure.get("reason") == names.REASON_PROGRESS_DEADLINE and (
            (phase == names.RESTARTING and failure.get("attempt") == gang_status.get("attempt"))
            or (phase == names.PENDING and failure.get("attempt") == (gang_status.get("attempt") or 0) - 1)
            or (phase == names.FAILED and failed_reason == names.REASON_PROGRESS_DEADLINE)):
        return Cond(names.COND_PROGRESSING, False, names.REASON_PROGRESS_DEADLINE, failure.get("message") or "")
    return Cond(names.COND_PROGRESSING, False, phase, "")


def compute_conditions(
    old: list[dict[str, Any]] | None, new: list[Cond], generation: int | None, now: datetime
) -> list[dict[str, Any]]:
    """Merge desired conditions into the old list, Kubernetes-style.

    `lastTransitionTime` moves only when `status` flips; reason/message/generation update
    freely. Conditions we do not manage (e.g. ones the trainer adds) are kept.
    """
    by_type = {x["type"]: dict(x) for x in (old or [])}
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
    return sorted(by_type.values(), key=lambda x: x["type"])
