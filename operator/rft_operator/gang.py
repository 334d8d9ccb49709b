"""The trainer gang's lifecycle and the failure policy. Pure, no I/O.

The gang is all-or-nothing: torchrun's static rendezvous needs every rank, so one failed
or vanished pod ends the attempt, and a restart is a whole new gang (`attempt + 1`, new
pod names) after `spec.failurePolicy.backoffSeconds`. Exit codes the policy calls fatal
and an exhausted restart budget fail the job instead. Suspend removes the pods and keeps
the checkpoints; resume starts a new attempt that resumes from the last checkpoint.

Phases: Pending (gang being created or scheduled) -> Running (every rank running) ->
Succeeded (every rank exited 0). A failure in Pending or Running goes to Restarting, then
Pending with the next attempt, or to Failed (fatal exit code, budget spent, invalid spec,
a child the API server refused). Suspended can be entered from any non-terminal phase.

Failure policy across the gang (`compute_failure`): one rank's failure usually takes the
others down with it (NCCL errors, torchrun's own shutdown), so the rank that ended first
is the root cause, except that a fatal exit code on any rank fails the job. A pod the
cluster disrupted (condition DisruptionTarget: evicted, preempted, drained, node pressure)
restarts the gang without using `maxRestarts`, counted in `status.disruptions`, if it is
the root cause. Old pods that outlive their grace period (a lost node never confirms the
deletion) are force-deleted after `policy.FORCE_DELETE_MARGIN_SECONDS`.

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
from datetime import datetime, timezone

from rft_contract import names as c
from rft_contract.spec import FailurePolicy, RFTJobSpec

from . import policy
from .model import Event, Obj, PodView, Refusal, compute_deletions
from .objects import JobRef
from .trainer_pods import build_trainer_pod

# The status fields this concern owns.
GANG_STATUS_KEYS = ("phase", "message", "attempt", "restarts", "disruptions", "startTime", "completionTime",
                    "lastFailure", "progress")

_NEVER = datetime.min.replace(tzinfo=timezone.utc)  # sorts pods that ended at no known time

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
class Failure:
    """What ends an attempt: the root-cause pod (None for the progress deadline), what
    `lastFailure` records of it, and the failure policy's verdict (`policy.FATAL`,
    `RETRYABLE`, `DISRUPTED`). `ended_at` and `rank` order the candidates."""

    pod: str | None
    exit_code: int | None
    reason: str
    message: str
    verdict: str = policy.RETRYABLE
    ended_at: datetime | None = None
    rank: int = -1

    def record(self, attempt: int, now: datetime) -> Obj:
        """`status.lastFailure`."""
        return {"attempt": attempt, "pod": self.pod, "exitCode": self.exit_code, "reason": self.reason,
                "message": self.message, "time": policy.format_time(now)}


@dataclass(frozen=True)
class Gang:
    """The gang's status fields after this pass, and what to do about the trainer pods."""

    status: Obj  # GANG_STATUS_KEYS
    failed_reason: str | None = None  # reason of a failure decided in this pass
    events: tuple[Event, ...] = ()
    create: tuple[Obj, ...] = ()
    delete: tuple[str, ...] = ()
    force_delete: tuple[str, ...] = ()  # pods stuck terminating: delete with grace period 0
    requeue_after: float | None = None

    @property
    def phase(self) -> str | None:
        return self.status.get("phase")

    @property
    def attempt(self) -> int:
        return self.status["attempt"]


def compute_gang(ref: JobRef, spec: RFTJobSpec | None, spec_error: str, old: Obj,
                 pods: list[PodView], now: datetime, progress: Progress = Progress(),
                 refusal: Refusal | None = None) -> Gang:
    """One pass over the trainer pods. `old` is the stored operator status, `pods` the
    trainer pods of every attempt, `spec` None when the stored spec is invalid, `refusal`
    a child the API server would not take for this job (it fails the job)."""
    g = _start(old)
    if spec is None:
        return _fail(g, pods, now, c.REASON_INVALID_SPEC, spec_error)
    if g.phase in c.TERMINAL_PHASES:
        return _delete(g, [x for x in pods if x.active])
    if refusal is not None:
        return _fail(g, pods, now, refusal.reason, refusal.message)
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
    status["disruptions"] = status["disruptions"] or 0
    return Gang(status)


def _set_phase(g: Gang, phase: str, message: str, reason: str = "", warn: bool = False) -> Gang:
    """Set phase and message; a phase change is also reported as an event."""
    events = g.events
    if g.phase != phase:
        events += (Event("Warning" if warn else "Normal", reason or phase, message),)
    return replace(g, status={**g.status, "phase": phase, "message": message}, events=events)


def _delete(g: Gang, pods: list[PodView]) -> Gang:
    return replace(g, delete=compute_deletions(g.delete, pods))


def _requeue(g: Gang, seconds: float) -> Gang:
    """Come back in `seconds`, or earlier if something else asked for it."""
    return replace(g, requeue_after=seconds if g.requeue_after is None else min(g.requeue_after, seconds))


def _force_stuck(g: Gang, pods: list[PodView], now: datetime) -> Gang:
    """Old pods the next gang waits for, still terminating `FORCE_DELETE_MARGIN_SECONDS`
    after their grace period ended (a node that is gone never confirms the deletion), are
    force-deleted (grace period 0) with one Warning event naming them. Until then, come
    back when the first would be due: no event will. A pod forced once is not forced again."""
    due, waits = [], []
    for x in pods:
        left = None if x.force_deleted else policy.force_delete_remaining(x.deletion_deadline, now)
        if left is not None and left <= 0:
            due.append(x.name)
        elif left is not None:
            waits.append(left)
    if waits:
        g = _requeue(g, min(waits))
    if not due:
        return g
    message = (f"pod{'s' if len(due) > 1 else ''} {', '.join(due)} still terminating "
               f"{int(policy.FORCE_DELETE_MARGIN_SECONDS)}s after the grace period ended (node lost or "
               "kubelet not responding?): force-deleting (grace period 0) so the next gang can start")
    return replace(g, force_delete=g.force_delete + tuple(due),
                   events=g.events + (Event("Warning", c.REASON_FORCE_DELETED, message),))


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
    g = _force_stuck(_delete(g, active), active, now)
    failed_at = policy.parse_time((g.status.get("lastFailure") or {}).get("time"))
    wait = policy.backoff_remaining(failed_at, spec.failure_policy.backoff_seconds, now)
    if wait > 0:
        return _requeue(g, wait)
    if active:  # old pods still terminating; their deletion events (or the force deadline) wake us
        return g
    return _next_attempt(g, "restarted", c.REASON_RESTARTED)


def _run(g: Gang, ref: JobRef, spec: RFTJobSpec, old: Obj, pods: list[PodView], now: datetime,
         progress: Progress) -> Gang:
    """Pending/Running: create the gang, watch it, apply the failure policy."""
    nodes, attempt = spec.trainer.nodes, g.attempt
    # Pods of earlier attempts: stop the live ones; keep terminated ones for their logs.
    stale = [x for x in pods if x.attempt != attempt and (x.active or x.deleting)]
    gang = {x.rank: x for x in pods if x.attempt == attempt}
    g = _force_stuck(_delete(g, stale), stale, now)

    failure = compute_failure(ref.name, old, attempt, gang, nodes, spec.failure_policy)
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


def compute_failure(job: str, old: Obj, attempt: int, gang: dict[int, PodView], nodes: int,
                    fp: FailurePolicy) -> Failure | None:
    """The failure that ends this attempt; None while the gang is healthy.

    Every rank that ended is a candidate: a failed pod, a lost (`Unknown`) or deleted one,
    a disrupted one, and, once the whole gang had been running, a missing one (a pod
    missing before the gang ever ran is simply recreated). The root cause is
      1. the first fatal candidate: a fatal exit code on any rank fails the job, whatever
         ended first (the program said a restart cannot help);
      2. else the first to end: `PodView.ended_at` (when it was disrupted, else when its
         trainer container exited), pods without a time after those with one, rank
         breaking ties, missing pods last. A disrupted root cause restarts without using the budget; a crash
         that came first does use it, even if another rank was disrupted later.
    """
    ended = sorted((_pod_failure(x, fp) for x in gang.values() if x.phase in ("Failed", "Unknown") or x.deleting),
                   key=lambda f: (f.ended_at is None, f.ended_at or _NEVER, f.rank))
    if old.get("phase") == c.RUNNING and old.get("attempt") == attempt:
        # The whole gang was running; a vanished pod breaks the rendezvous. Nothing is
        # known of it, so it comes after every pod that is still there to tell.
        for rank in range(nodes):
            if rank not in gang:
                name = c.pod_name(job, attempt, rank)
                ended.append(Failure(name, None, c.REASON_POD_DELETED, f"pod {name} disappeared", rank=rank))
    if not ended:
        return None
    root = next((f for f in ended if f.verdict == policy.FATAL), ended[0])
    if len(ended) > 1:
        others = len(ended) - 1
        root = replace(root, message=f"{root.message} ({others} other rank{'s' if others > 1 else ''} "
                                     f"also ended)")
    return root


def _pod_failure(x: PodView, fp: FailurePolicy) -> Failure:
    verdict = policy.classify_failure(x.exit_code, x.disruption, fp)
    if x.disruption:
        reason, message = c.REASON_POD_DISRUPTED, f"pod {x.name} was disrupted ({x.disruption})"
    elif x.phase == "Failed":
        how = f" with exit code {x.exit_code}" if x.exit_code is not None else f" ({x.reason or 'no exit code'})"
        reason, message = c.REASON_POD_FAILED, f"pod {x.name} failed" + how
    else:
        reason, message = c.REASON_POD_DELETED, f"pod {x.name} was deleted or lost its node"
    return Failure(x.name, x.exit_code, reason, message, verdict, x.ended_at, x.rank)


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
    failure = Failure(None, None, c.REASON_PROGRESS_DEADLINE, message)
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


def _handle_failure(g: Gang, spec: RFTJobSpec, failure: Failure, gang: list[PodView],
                    pods: list[PodView], now: datetime, exhausted: str = c.REASON_BACKOFF_LIMIT) -> Gang:
    """Record the failure, then fail the job (fatal code, budget spent) or restart the gang
    (a disruption without using the budget). `exhausted` is the Failed reason when the
    budget is spent."""
    fp = spec.failure_policy
    restarts = g.status["restarts"]
    g = replace(g, status={**g.status, "lastFailure": failure.record(g.attempt, now)})
    if failure.verdict == policy.FATAL:
        return _fail(g, pods, now, c.REASON_FATAL_EXIT,
                     f"{failure.message}; exit code {failure.exit_code} is fatal under "
                     "spec.failurePolicy (fatalExitCodes/retryableExitCodes); fix the cause and "
                     "create the job again")
    if failure.verdict == policy.DISRUPTED:
        disruptions = g.status["disruptions"] + 1
        g = replace(g, status={**g.status, "disruptions": disruptions})
        return _restart(g, spec, gang, f"{failure.message}; disruption {disruptions}, restarting without "
                        f"using spec.failurePolicy.maxRestarts", c.REASON_POD_DISRUPTED)
    if not policy.should_restart(restarts, fp):
        return _fail(g, pods, now, exhausted,
                     f"{failure.message}; restart budget exhausted after {restarts} "
                     f"restarts (spec.failurePolicy.maxRestarts={fp.max_restarts})")
    restarts += 1
    g = replace(g, status={**g.status, "restarts": restarts})
    return _restart(g, spec, gang, f"{failure.message}; restart {restarts}/{fp.max_restarts}", c.REASON_RESTARTING)


def _restart(g: Gang, spec: RFTJobSpec, gang: list[PodView], message: str, reason: str) -> Gang:
    """Delete the gang and wait out the backoff in Restarting (a Warning event says why)."""
    backoff = spec.failure_policy.backoff_seconds
    g = _delete(g, [x for x in gang if x.active])
    g = _set_phase(g, c.RESTARTING, f"{message} in {backoff}s", reason, warn=True)
    return _requeue(g, float(backoff))


def _fail(g: Gang, pods: list[PodView], now: datetime, reason: str, message: str) -> Gang:
    """Terminal: stop every live trainer pod; keep the first completion time."""
    g = _set_phase(_delete(g, [x for x in pods if x.active]), c.FAILED, message, reason, warn=True)
    done = g.status.get("completionTime") or policy.format_time(now)
    return replace(g, status={**g.status, "completionTime": done}, failed_reason=reason)
