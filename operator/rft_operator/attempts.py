"""The story of a job's gang attempts, for the person on call: `status.attempts` (where each
of the last few started and ended, and why) and an event when an attempt's trainer says
where it resumed from. Pure, no I/O.

Inputs are what this pass decided (the gang's status: attempt, phase, lastFailure) and
what the trainer reported (`status.trainer`: `resumedFrom` of its attempt, its last step).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from datetime import datetime

from rft_contract import names
from rft_contract.times import format_time

from .model import Event, Obj

KEEP = 5  # attempts kept in status: enough for a story, a bounded status
REASON_RESUMED_FROM = "ResumedFromCheckpoint"


@dataclass(frozen=True)
class Attempts:
    records: list[Obj] | None  # None: unchanged
    events: tuple[Event, ...] = ()


def compute_attempts(old: list[Obj] | None, gang_status: Obj, trainer: Obj, now: datetime,
                     failed_reason: str | None = None) -> Attempts:
    """The attempt history after this pass: a record for the current attempt once it
    exists, its start once its trainer reports `resumedFrom`, its end (last reported step,
    why) once it ended: a failure recorded for it, or the job Succeeded, Failed or
    Suspended. Records of earlier attempts never change."""
    records = copy.deepcopy(old or [])
    attempt = gang_status.get("attempt") or 0
    if attempt < 1:
        return Attempts(None)
    events: tuple[Event, ...] = ()
    by_attempt = {r["attempt"]: r for r in records}
    current = by_attempt.get(attempt)
    if current is None:
        current = {"attempt": attempt}
        records.append(current)
    # Earlier attempts that ended without a record of it (the operator was down, say).
    for r in records:
        if r is not current and r.get("reason") is None:
            r["reason"] = "Unknown"
    resumed = trainer.get("resumedFrom") or {}
    if resumed.get("attempt") == attempt and resumed.get("step") is not None and "startStep" not in current:
        _put(current, startStep=resumed["step"], checkpoint=resumed.get("checkpoint"))
        if attempt > 1 or current["startStep"]:
            events += (_resumed_event(attempt, current["startStep"], current.get("checkpoint")),)
    if current.get("reason") is None:
        reason, when = _ended(attempt, gang_status, now, failed_reason)
        if reason is not None:
            steps = trainer.get("step") if trainer.get("attempt") == attempt else None
            _put(current, endStep=steps if steps is not None else current.get("startStep"), reason=reason, ended=when)
    records = records[-KEEP:]
    return Attempts(records if records != (old or []) else None, events)


def _put(record: Obj, **fields: object) -> None:
    """Only the known: the API server drops a null it stores no schema for, and a record
    with one would differ from its stored self on every pass (a status write each time)."""
    record.update({k: v for k, v in fields.items() if v is not None})


def _ended(attempt: int, gang_status: Obj, now: datetime, failed_reason: str | None) -> tuple[str | None, str | None]:
    """Why the current attempt ended and when, or (None, None) while it runs."""
    failure = gang_status.get("lastFailure") or {}
    if failure.get("attempt") == attempt:
        return failure.get("reason"), failure.get("time")
    phase = gang_status.get("phase")
    if phase == names.SUCCEEDED:
        return names.SUCCEEDED, gang_status.get("completionTime") or format_time(now)
    if phase == names.SUSPENDED:
        return names.SUSPENDED, format_time(now)
    if phase == names.FAILED:  # not of a pod: an invalid spec, a refused child
        return failed_reason or names.FAILED, gang_status.get("completionTime") or format_time(now)
    return None, None


def _resumed_event(attempt: int, step: int | None, checkpoint: str | None) -> Event:
    if checkpoint:
        return Event("Normal", REASON_RESUMED_FROM, f"attempt {attempt} resumed from step {step} ({checkpoint})")
    return Event("Warning" if attempt > 1 else "Normal", REASON_RESUMED_FROM,
                 f"attempt {attempt} started from step {step or 0}: no checkpoint to resume from")
