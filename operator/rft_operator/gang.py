"""The trainer gang's lifecycle and the failure policy. Pure, no I/O.

The gang is all-or-nothing: torchrun's static rendezvous needs every rank, so one failed
or vanished pod ends the attempt, and a restart is a whole new gang (`attempt + 1`, new
pod names) after `spec.failurePolicy.backoffSeconds`. Exit codes the policy calls fatal
and an exhausted restart budget fail the job instead. Suspend removes the pods and keeps
the checkpoints; resume starts a new attempt that resumes from the last checkpoint.

Phases: Pending (gang being created or scheduled) -> Running (every rank running) ->
Succeeded (every rank exited 0). A failure in Pending or Running goes to Restarting, then
Pending with the next attempt, or to Failed (fatal exit code, budget spent, invalid spec).
Suspended can be entered from any non-terminal phase.

Progress deadline: while the gang runs, `status.progress {step, attempt, since}` records
when the trainer's reported step (`status.trainer.step` of this attempt) last moved; the
record starts when the attempt's gang is first seen running, so the first step, model
download included, gets the same deadline as any other. A gang that has not stepped for
`spec.failurePolicy.progressDeadlineSeconds` is restarted like a failed pod, the failure
saying why from what the pods report (`Progress`). Pending, Restarting and Suspended
never run the clock, and a new attempt starts a new record.

`compute_gang` threads one immutable `Gang` value through small steps; nothing here reads
another concern's result.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import datetime

from rft_contract import names as c
from rft_contract.spec import RFTJobSpec

from . import policy
from .model import Event, Obj, PodView, compute_deletions
from .objects import JobRef
from .trainer_pods import build_trainer_pod

# The status fields this concern owns.
GANG_STATUS_KEYS = ("phase", "message", "attempt", "restarts", "startTime", "completionTime", "lastFailure",
                    "progress")

# status.trainer.waiting.reason -> what the trainer is waiting for, in words.
WAIT_WORDS = {c.WAIT_DATA: "waiting for experiences", c.WAIT_STALE: "waiting for fresh experiences"}


@dataclass(frozen=True)
class Progress:
    """What the progress deadline reads besides the pods: the trainer's report
    (`status.trainer`) and other concerns' hints on why it may not step (weight-sync lag,
    explorer throttle; "" when they have nothing to say)."""

    trainer: Obj = field(default_factory=dict)
    hints: tuple[str, ...] = ()


@dataclass(frozen=True)
class Gang:
    """The gang's status fields after this pass, and what to do about the trainer pods."""

    status: Obj  # GANG_STATUS_KEYS
    failed_reason: str | None = None  # reason of a failure decided in this pass
    events: tuple[Event, ...] = ()
    create: tuple[Obj, ...] = ()
    delete: tuple[str, ...] = ()
    requeue_after: float | None = None

    @property
    def phase(self) -> str | None:
        return self.status.get("phase")

    @property
    def attempt(self) -> int:
        return self.status["attempt"]


def compute_gang(ref: JobRef, spec: RFTJobSpec | None, spec_error: str, old: Obj,
                 pods: list[PodView], now: datetime, progress: Progress = Progress()) -> Gang:
    """One pass over the trainer pods. `old` is the stored operator status, `pods` the
    trainer pods of every attempt, `spec` None when the stored spec is invalid."""
    g = _start(old)
    if spec is None:
        return _fail(g, pods, now, c.REASON_INVALID_SPEC, spec_error)
    if g.phase in c.TERMINAL_PHASES:
        return _delete(g, [x for x in pods if x.active])
    if spec.suspend:
        g = _delete(g, [x for x in pods if x.active])
        return _set_phase(g, c.SUSPENDED, "suspended: pods removed, checkpoints kept", c.REASON_SUSPENDED)
    if g.phase == c.SUSPENDED:
        g = _next_attempt(g, "resumed", c.REASON_RESUMED)
    if g.attempt == 0:
        g = _set_phase(replace(g, status={**g.status, "attempt": 1}), c.PENDING, "starting attempt 1",
                       c.REASON_CREATED)
    if g.phase == c.RESTARTING:
        g = _restart_when_due(g, spec, pods, now)
        if g.phase == c.RESTARTING:
            return g
    return _run(g, ref, spec, old, pods, now, progress)


def _start(old: Obj) -> Gang:
    """The stored fields, with attempt 0 meaning "no gang started yet" and no restarts."""
    status = {k: old.get(k) for k in GANG_STATUS_KEYS}
    status["attempt"] = status["attempt"] or 0
    status["restarts"] = status["restarts"] or 0
    return Gang(status)


def _set_phase(g: Gang, phase: str, message: str, reason: str = "", warn: bool = False) -> Gang:
    """Set phase and message; a phase change is also reported as an event."""
    events = g.events
    if g.phase != phase:
        events += (Event("Warning" if warn else "Normal", reason or phase, message),)
    return replace(g, status={**g.status, "phase": phase, "message": message}, events=events)


def _delete(g: Gang, pods: list[PodView]) -> Gang:
    return replace(g, delete=compute_deletions(g.delete, pods))


def _next_attempt(g: Gang, verb: str, reason: str) -> Gang:
    attempt = g.attempt + 1
    g = replace(g, status={**g.status, "attempt": attempt})
    return _set_phase(g, c.PENDING, f"{verb}: starting attempt {attempt}", reason)


def _restart_when_due(g: Gang, spec: RFTJobSpec, pods: list[PodView], now: datetime) -> Gang:
    """In Restarting: tear the old gang down, then wait out the backoff. Still Restarting
    on return while waiting, Pending with the next attempt once due.

    Terminated pods are kept (they hold no resources, and their logs explain the
    failure); the garbage collector removes them with the job."""
    active = [x for x in pods if x.active or x.deleting]
    g = _delete(g, active)
    failed_at = policy.parse_time((g.status.get("lastFailure") or {}).get("time"))
    wait = policy.backoff_remaining(failed_at, spec.failure_policy.backoff_seconds, now)
    if wait > 0:
        return replace(g, requeue_after=wait)
    if active:  # old pods still terminating; their deletion events wake us
        return g
    return _next_attempt(g, "restarted", c.REASON_RESTARTED)


def _run(g: Gang, ref: JobRef, spec: RFTJobSpec, old: Obj, pods: list[PodView], now: datetime,
         progress: Progress) -> Gang:
    """Pending/Running: create the gang, watch it, apply the failure policy."""
    nodes, attempt = spec.trainer.nodes, g.attempt
    # Pods of earlier attempts: stop the live ones; keep terminated ones for their logs.
    stale = [x for x in pods if x.attempt != attempt and (x.active or x.deleting)]
    gang = {x.rank: x for x in pods if x.attempt == attempt}
    g = _delete(g, stale)

    failure = compute_first_failure(ref.name, old, attempt, gang, nodes)
    if failure:
        return _handle_failure(g, spec, failure, list(gang.values()), pods, now)
    if len(gang) == nodes and all(x.phase == "Succeeded" for x in gang.values()):
        g = _set_phase(g, c.SUCCEEDED, f"all {nodes} trainer pods succeeded", c.REASON_SUCCEEDED)
        return replace(g, status={**g.status, "completionTime": policy.format_time(now)})
    if len(gang) == nodes and all(x.phase in ("Running", "Succeeded") for x in gang.values()):
        g = _set_phase(g, c.RUNNING, f"all {nodes} trainer pods running", c.REASON_ALL_RUNNING)
        g = replace(g, status={**g.status, "startTime": g.status.get("startTime") or policy.format_time(now)})
        return _check_progress(g, spec, progress, list(gang.values()), pods, now)
    if not stale:  # a new gang starts only once the previous one is gone
        missing = [build_trainer_pod(ref, spec, attempt, r) for r in range(nodes) if r not in gang]
        g = replace(g, create=g.create + tuple(missing))
    ready = sum(1 for x in gang.values() if x.phase == "Running")
    # No event: waiting for pods to schedule is not news.
    return replace(g, status={**g.status, "phase": c.PENDING,
                              "message": f"attempt {attempt}: {ready}/{nodes} trainer pods running"})


def compute_first_failure(job: str, old: Obj, attempt: int, gang: dict[int, PodView], nodes: int) -> Obj | None:
    """The failure that ends this attempt, lowest rank first: a failed pod, a deleted or
    lost one, or (once the whole gang had been running) one that disappeared. None while
    the gang is healthy. A pod missing before the gang ever ran is simply recreated."""
    for rank in sorted(gang):
        x = gang[rank]
        if x.phase == "Failed":
            how = f" with exit code {x.exit_code}" if x.exit_code is not None else f" ({x.reason or 'no exit code'})"
            return {"pod": x.name, "exitCode": x.exit_code, "reason": c.REASON_POD_FAILED,
                    "message": f"pod {x.name} failed" + how}
        if x.phase == "Unknown" or x.deleting:
            return {"pod": x.name, "exitCode": None, "reason": c.REASON_POD_DELETED,
                    "message": f"pod {x.name} was deleted or lost its node"}
    if old.get("phase") == c.RUNNING and old.get("attempt") == attempt:
        # The whole gang was running; a vanished pod breaks the rendezvous.
        for rank in range(nodes):
            if rank not in gang:
                name = c.pod_name(job, attempt, rank)
                return {"pod": name, "exitCode": None, "reason": c.REASON_POD_DELETED,
                        "message": f"pod {name} disappeared"}
    return None


def _check_progress(g: Gang, spec: RFTJobSpec, progress: Progress, gang: list[PodView],
                    pods: list[PodView], now: datetime) -> Gang:
    """Running: record when the step last moved; past the deadline, end the attempt like
    a failed pod. Otherwise come back when the deadline would pass."""
    # What an earlier attempt reported (its step, why it waited) says nothing about this
    # gang; this attempt's `waiting` (it names its attempt) does, before its first step.
    trainer = progress.trainer
    if trainer.get("attempt") not in (None, g.attempt):
        waiting = trainer.get("waiting") or {}
        progress = replace(progress, trainer={"waiting": waiting} if waiting.get("attempt") == g.attempt else {})
    step = progress.trainer.get("step")
    record = compute_progress_record(g.status.get("progress"), g.attempt, step, now)
    g = replace(g, status={**g.status, "progress": record})
    if step is not None and step >= spec.trainer.total_steps:
        return g  # trained: the final export and save take what they take
    deadline = spec.failure_policy.progress_deadline_seconds
    if deadline and step is None and (progress.trainer.get("waiting") or {}).get("reason") == c.WAIT_PREPARING:
        # No step from this attempt yet and the trainer says it is still loading the model
        # (bounded by its own timeout) and resuming: the deadline counts from there.
        deadline += spec.model.cache.download_timeout_seconds
    left = policy.progress_deadline_remaining(policy.parse_time(record["since"]), deadline, now)
    if left is None:
        return g
    if left >= 0:  # not past it yet: come back when it would be
        return replace(g, requeue_after=left)
    message = build_stall_message(record, progress, deadline, now)
    failure = {"pod": None, "exitCode": None, "reason": c.REASON_PROGRESS_DEADLINE, "message": message}
    g = replace(g, events=g.events + (Event("Warning", c.REASON_PROGRESS_DEADLINE, message),))
    return _handle_failure(g, spec, failure, gang, pods, now, exhausted=c.REASON_PROGRESS_DEADLINE)


def compute_progress_record(old: Obj | None, attempt: int, step: int | None, now: datetime) -> Obj:
    """`status.progress`: kept while (attempt, step) stays the same, restarted with
    `since: now` when either moves (or on the first pass that sees the gang running)."""
    if old and old.get("attempt") == attempt and old.get("step") == step and old.get("since"):
        return old
    return {"step": step, "attempt": attempt, "since": policy.format_time(now)}


def build_stall_message(record: Obj, progress: Progress, deadline: int, now: datetime) -> str:
    """Why the deadline fired, from what the pods report: the trainer's own account
    (`status.trainer.waiting`), then the other concerns' hints."""
    idle = int((now - policy.parse_time(record["since"])).total_seconds())
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
    since = _parse_time_or_none(waiting.get("since"))
    seconds = (now - since).total_seconds() if since else waiting.get("seconds")
    words = WAIT_WORDS.get(waiting["reason"], f"waiting ({waiting['reason']})")
    out = f"trainer {words}" + (f" for {int(seconds)}s" if seconds is not None else "")
    dropped = (trainer.get("buffer") or {}).get("droppedStale")
    if dropped:
        out += f" ({dropped} stale dropped)"
    return out + (f": {waiting['message']}" if waiting.get("message") else "")


def _parse_time_or_none(value: object) -> datetime | None:
    """A time another writer reported; one this operator cannot read is no time at all."""
    try:
        return policy.parse_time(value) if isinstance(value, str) else None
    except ValueError:
        return None


def _handle_failure(g: Gang, spec: RFTJobSpec, failure: Obj, gang: list[PodView],
                    pods: list[PodView], now: datetime, exhausted: str = c.REASON_BACKOFF_LIMIT) -> Gang:
    """Record the failure, then fail the job (fatal code, budget spent) or restart the gang.
    `exhausted` is the Failed reason when the budget is spent."""
    fp = spec.failure_policy
    restarts = g.status["restarts"]
    record = {"attempt": g.attempt, **failure, "time": policy.format_time(now)}
    g = replace(g, status={**g.status, "lastFailure": record})
    if policy.classify_exit_code(failure["exitCode"], fp) == policy.FATAL:
        return _fail(g, pods, now, c.REASON_FATAL_EXIT,
                     f"{failure['message']}; exit code {failure['exitCode']} is fatal under "
                     "spec.failurePolicy (fatalExitCodes/retryableExitCodes); fix the cause and "
                     "create the job again")
    if not policy.should_restart(restarts, fp):
        return _fail(g, pods, now, exhausted,
                     f"{failure['message']}; restart budget exhausted after {restarts} "
                     f"restarts (spec.failurePolicy.maxRestarts={fp.max_restarts})")
    restarts += 1
    g = _delete(replace(g, status={**g.status, "restarts": restarts}), [x for x in gang if x.active])
    g = _set_phase(g, c.RESTARTING, f"{failure['message']}; restart {restarts}/{fp.max_restarts} "
                   f"in {fp.backoff_seconds}s", c.REASON_RESTARTING, warn=True)
    return replace(g, requeue_after=float(fp.backoff_seconds))


def _fail(g: Gang, pods: list[PodView], now: datetime, reason: str, message: str) -> Gang:
    """Terminal: stop every live trainer pod; keep the first completion time."""
    g = _set_phase(_delete(g, [x for x in pods if x.active]), c.FAILED, message, reason, warn=True)
    done = g.status.get("completionTime") or policy.format_time(now)
    return replace(g, status={**g.status, "completionTime": done}, failed_reason=reason)
