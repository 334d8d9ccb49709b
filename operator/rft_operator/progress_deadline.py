"""The progress deadline: `status.progress` (when the trainer's step last moved) and whether
a running gang has gone `spec.failurePolicy.progressDeadlineSeconds` without a step, and why.

While the gang runs, `status.progress {step, attempt, since}` records when the trainer's
reported step (`status.trainer.step` of this attempt) last moved; the record starts when
the attempt's gang is first seen running, so the first step, model download included, gets
the same deadline as any other. A gang that has not stepped for the deadline is restarted
like a failed pod, the failure saying why from what the pods report (`Progress`). Pending,
Restarting and Suspended never run the clock (the gang asks only while Running), and a new
attempt starts a new record. Pure, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import datetime

from rft_contract import names
from rft_contract.spec import RFTJobSpec
from rft_contract.times import format_time, parse_time

from .model import Obj

# status.trainer.waiting.reason -> what the trainer is waiting for, in words.
WAIT_WORDS = {names.WAIT_DATA: "waiting for experiences", names.WAIT_STALE: "waiting for fresh experiences"}


@dataclass(frozen=True)
class Progress:
    """What the progress deadline reads besides the pods: the trainer's report
    (`status.trainer`) and other concerns' hints on why it may not step (weight-sync lag,
    explorer throttle; "" when they have nothing to say)."""

    trainer: Obj = field(default_factory=dict)
    hints: tuple[str, ...] = ()


@dataclass(frozen=True)
class ProgressCheck:
    """One running pass's verdict (`compute_progress_check`)."""

    record: Obj  # status.progress
    requeue_after: float | None = None  # not past the deadline yet: come back then
    stalled: str = ""  # past it: why (the failure's message)


def compute_progress_check(old_record: Obj | None, attempt: int, spec: RFTJobSpec, progress: Progress,
                           now: datetime) -> ProgressCheck:
    """Running: record when the step last moved; past the deadline, say why, for the gang to
    end the attempt like a failed pod. Otherwise when to come back: when it would pass."""
    # What an earlier attempt reported (its step, why it waited) says nothing about this
    # gang; this attempt's `waiting` (it names its attempt) does, before its first step.
    trainer = progress.trainer
    resumed = trainer.get("resumedFrom") or {}
    if trainer.get("attempt") not in (None, attempt):
        waiting = trainer.get("waiting") or {}
        progress = replace(progress, trainer={"waiting": waiting} if waiting.get("attempt") == attempt else {})
    step = progress.trainer.get("step")
    record = compute_progress_record(old_record, attempt, step, now, resumed)
    if step is not None and step >= spec.trainer.total_steps:
        return ProgressCheck(record)  # trained: the final export and save take what they take
    deadline = spec.failure_policy.progress_deadline_seconds
    if deadline and step is None and (progress.trainer.get("waiting") or {}).get("reason") == names.WAIT_PREPARING:
        # No step from this attempt yet and the trainer says it is still loading the model
        # (bounded by its own timeout) and resuming: the deadline counts from there.
        deadline += spec.model.cache.download_timeout_seconds
    left = progress_deadline_remaining(parse_time(record["since"]), deadline, now)
    if left is None:
        return ProgressCheck(record)
    if left >= 0:  # not past it yet: come back when it would be
        return ProgressCheck(record, requeue_after=left)
    return ProgressCheck(record, stalled=build_stall_message(record, progress, deadline, now))


def progress_deadline_remaining(since: datetime | None, deadline_seconds: int, now: datetime) -> float | None:
    """Seconds left before the progress deadline passes, counted from `since` (when the
    step last moved); negative once it has passed, i.e. once more than `deadline_seconds`
    went by without a step. None when there is no deadline (0 turns it off) or no clock."""
    if not deadline_seconds or since is None:
        return None
    return deadline_seconds - (now - since).total_seconds()


def compute_progress_record(old: Obj | None, attempt: int, step: int | None, now: datetime,
                            resumed: Obj | None = None) -> Obj:
    """`status.progress`: kept while (attempt, step) stays the same, restarted with
    `since: now` when either moves (or on the first pass that sees the gang running).
    `resumedFrom` ({step, checkpoint}) once this attempt's trainer has said where it
    started (`status.trainer.resumedFrom`; no checkpoint: a fresh start)."""
    if old and old.get("attempt") == attempt and old.get("step") == step and old.get("since"):
        record = old
    else:
        record = {"step": step, "attempt": attempt, "since": format_time(now)}
        if old and old.get("resumedFrom"):  # kept within an attempt; null (dropped) for the next
            record["resumedFrom"] = old["resumedFrom"] if old.get("attempt") == attempt else None
    if record.get("resumedFrom") is None and resumed and resumed.get("attempt") == attempt \
            and resumed.get("step") is not None:
        start = {"step": resumed["step"]}
        if resumed.get("checkpoint"):
            start["checkpoint"] = resumed["checkpoint"]
        record = {**record, "resumedFrom": start}
    return record


def build_stall_message(record: Obj, progress: Progress, deadline: int, now: datetime) -> str:
    """Why the deadline fired, from what the pods report: the trainer's own account
    (`status.trainer.waiting`), then the other concerns' hints."""
    idle = int((now - parse_time(record["since"])).total_seconds())
    step = record.get("step")
    head = (f"attempt {record['attempt']} reported no step in {idle}s" if step is None
            else f"step {step} has not moved for {idle}s")
    head += f" (spec.failurePolicy.progressDeadlineSeconds={deadline})"
    why = [x for x in (describe_trainer_wait(progress.trainer, now), *progress.hints) if x]
    return head + (": " + "; ".join(why) if why else "")


def describe_trainer_wait(trainer: Obj, now: datetime) -> str:
    """The trainer's reason for not stepping (rank 0 writes `status.trainer.waiting`), e.g.
    "trainer waiting for experiences for 1800s (12 stale dropped)"; "" when it gave none."""
    waiting = trainer.get("waiting") or {}
    if not waiting.get("reason"):
        return ""
    since = parse_time(waiting.get("since"))
    seconds = (now - since).total_seconds() if since else waiting.get("seconds")
    words = WAIT_WORDS.get(waiting["reason"], f"waiting ({waiting['reason']})")
    out = f"trainer {words}" + (f" for {int(seconds)}s" if seconds is not None else "")
    dropped = (trainer.get("buffer") or {}).get("droppedStale")
    if dropped:
        out += f" ({dropped} stale dropped)"
    return out + (f": {waiting['message']}" if waiting.get("message") else "")
