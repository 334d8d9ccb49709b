"""The trainer gang's lifecycle: one pass over the trainer pods decides the phase, what to
create and delete, and when to come back (`compute_gang`). Pure, no I/O.

The gang is all-or-nothing: torchrun's static rendezvous needs every rank, so one failed
or vanished pod ends the attempt, and a restart is a whole new gang (`attempt + 1`, new
pod names) after `spec.failurePolicy.backoffSeconds`. What ends an attempt and whether it
restarts is the failure policy's (`failure_policy`); a running gang that stopped stepping
is the progress deadline's (`progress_deadline`); old pods that will not go, the
force-delete rule's (`terminating`). Suspend removes the pods and keeps the checkpoints;
resume starts a new attempt that resumes from the last checkpoint.

Phases: Pending (gang being created or scheduled) -> Running (every rank running) ->
Succeeded (every rank exited 0). A failure in Pending or Running goes to Restarting, then
Pending with the next attempt, or to Failed (fatal exit code, budget spent, invalid spec,
a child the API server refused). Suspended can be entered from any non-terminal phase.

`compute_gang` threads one immutable `Gang` value through small steps; nothing here reads
another concern's result.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime

from rft_contract import names
from rft_contract.failures import DISRUPTED, FAILURE_ACTIONS, FATAL, RETRYABLE, FailureAction
from rft_contract.spec import RFTJobSpec
from rft_contract.times import format_time, parse_time

from . import failure_policy, progress_deadline, terminating
from .failure_policy import Failure
from .model import Event, Obj, PodView, Refusal, compute_deletions
from .objects import JobRef
from .progress_deadline import Progress
from .queueing import Queue
from .trainer_pods import build_trainer_pod

# The status fields this concern owns.
GANG_STATUS_KEYS = ("phase", "message", "attempt", "restarts", "disruptions", "startTime", "completionTime",
                    "lastFailure", "progress")


@dataclass(frozen=True)
class Gang:
    """The gang's status fields after this pass, and what to do about the trainer pods."""

    status: Obj  # GANG_STATUS_KEYS
    failed_reason: str | None = None  # reason of a failure decided in this pass
    events: tuple[Event, ...] = ()
    create: tuple[Obj, ...] = ()
    delete: tuple[str, ...] = ()
    force_delete: tuple[str, ...] = ()  # pods stuck terminating: delete with grace period 0
    stuck: str = ""  # pods stuck terminating that may not be forced: why we wait, what to do
    requeue_after: float | None = None

    @property
    def phase(self) -> str | None:
        return self.status.get("phase")

    @property
    def attempt(self) -> int:
        return self.status["attempt"]


def compute_gang(ref: JobRef, spec: RFTJobSpec | None, spec_error: str, old: Obj,
                 pods: list[PodView], now: datetime, progress: Progress = Progress(),
                 refusal: Refusal | None = None, nodes: dict[str, str] | None = None,
                 queue: Queue | None = None) -> Gang:
    """One pass over the trainer pods. `old` is the stored operator status, `pods` the
    trainer pods of every attempt, `spec` None when the stored spec is invalid, `refusal`
    a child the API server would not take for this job (it fails the job), `nodes` what is
    known of the nodes of pods stuck terminating (`terminating.stuck_nodes`; `terminating.NODE_*`),
    `queue` what Kueue decided for a job it queues (`queueing.read_queue`; None: not queued)."""
    g = _start(old)
    if spec is None:
        return _fail(g, pods, now, names.REASON_INVALID_SPEC, spec_error)
    if g.phase in names.TERMINAL_PHASES:
        return _delete(g, [x for x in pods if x.active])
    if refusal is not None:
        return _fail(g, pods, now, refusal.reason, refusal.message)
    if spec.suspend:
        g = _delete(g, [x for x in pods if x.active])
        return _set_phase(g, names.SUSPENDED, "suspended: pods removed, checkpoints kept", names.REASON_SUSPENDED)
    if g.phase == names.SUSPENDED:
        g = _next_attempt(g, "resumed", names.REASON_RESUMED)
    if queue is not None and queue.conflict:
        return _fail(g, pods, now, names.REASON_INVALID_SPEC, queue.conflict)
    if queue is not None and not queue.admitted and not _succeeded(g, spec, pods):
        return _hold(g, ref, pods, queue, now, nodes or {})
    if g.attempt == 0:
        g = _set_phase(replace(g, status={**g.status, "attempt": 1}), names.PENDING, "starting attempt 1",
                       names.REASON_CREATED)
    if g.phase == names.RESTARTING:
        g = _restart_when_due(g, ref, spec, pods, now, nodes or {})
        if g.phase == names.RESTARTING:
            return g
    return _run(g, ref, spec, old, pods, now, progress, nodes or {})


def _succeeded(g: Gang, spec: RFTJobSpec, pods: list[PodView]) -> bool:
    """Every rank of the current attempt exited 0: the job is done, whatever Kueue says now."""
    gang = [x for x in pods if x.attempt == g.attempt]
    return len(gang) == spec.trainer.nodes and all(x.phase == "Succeeded" for x in gang)


def _hold(g: Gang, ref: JobRef, pods: list[PodView], queue: Queue, now: datetime, nodes: dict[str, str]) -> Gang:
    """Not admitted by Kueue (queued, or evicted: preempted, deactivated): no pods, Pending
    with Kueue's reason. A gang of this attempt that had pods ends here (SIGTERM: the
    trainer saves a final checkpoint) and the next admission starts the next attempt,
    which resumes from that checkpoint; an eviction of a gang that was not already
    restarting is a disruption (it does not use spec.failurePolicy.maxRestarts). Pods that
    will not go are handled as when a gang restarts (`terminating`)."""
    current = [x for x in pods if x.attempt == g.attempt]
    if current:
        if g.phase != names.RESTARTING and any(x.active for x in current):
            disruptions = g.status["disruptions"] + 1
            g = replace(g, status={**g.status, "disruptions": disruptions},
                        events=g.events + (Event("Warning", names.REASON_EVICTED,
                                                 f"attempt {g.attempt} stopped: {queue.message}; "
                                                 f"disruption {disruptions}"),))
        g = replace(g, status={**g.status, "attempt": g.attempt + 1})
    going = [x for x in pods if x.active or x.deleting]
    g = _force_stuck(_delete(g, [x for x in pods if x.active]), going, now, nodes, ref.namespace)
    return _set_phase(g, names.PENDING, queue.message, names.REASON_QUEUED)


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


def _force_stuck(g: Gang, pods: list[PodView], now: datetime, nodes: dict[str, str], namespace: str) -> Gang:
    """Apply the force-delete rule to old pods the next gang waits for
    (`terminating.compute_stuck`): force-delete those nothing runs, say why the gang waits
    for the others (`stuck`), come back when the first would be due."""
    s = terminating.compute_stuck(pods, now, nodes, namespace)
    if s.requeue_after is not None:
        g = _requeue(g, s.requeue_after)
    if s.held:
        g = replace(g, stuck=s.held)
    return replace(g, force_delete=g.force_delete + s.force_delete, events=g.events + s.events)


def _report_stuck(g: Gang, old_message: str | None) -> Gang:
    """While waiting for pods that may not be forced, the status message says so; the
    Warning event goes out once, in the pass that first writes the message."""
    if not g.stuck:
        return g
    stuck = Event("Warning", names.REASON_STUCK_TERMINATING, g.stuck)
    events = g.events if old_message == g.stuck else g.events + (stuck,)
    return replace(g, status={**g.status, "message": g.stuck}, events=events)


def _next_attempt(g: Gang, verb: str, reason: str) -> Gang:
    attempt = g.attempt + 1
    g = replace(g, status={**g.status, "attempt": attempt})
    return _set_phase(g, names.PENDING, f"{verb}: starting attempt {attempt}", reason)


def _restart_when_due(g: Gang, ref: JobRef, spec: RFTJobSpec, pods: list[PodView], now: datetime,
                      nodes: dict[str, str]) -> Gang:
    """In Restarting: tear the old gang down, then wait out the backoff. Still Restarting
    on return while waiting, Pending with the next attempt once due.

    Terminated pods are kept (they hold no resources, and their logs explain the
    failure); the garbage collector removes them with the job."""
    active = [x for x in pods if x.active or x.deleting]
    g = _force_stuck(_delete(g, active), active, now, nodes, ref.namespace)
    g = _report_stuck(g, g.status.get("message"))
    failed_at = parse_time((g.status.get("lastFailure") or {}).get("time"))
    wait = failure_policy.backoff_remaining(failed_at, spec.failure_policy.backoff_seconds, now)
    if wait > 0:
        return _requeue(g, wait)
    if active:  # old pods still terminating; their deletion events (or the force deadline) wake us
        return g
    return _next_attempt(g, "restarted", names.REASON_RESTARTED)


def _run(g: Gang, ref: JobRef, spec: RFTJobSpec, old: Obj, pods: list[PodView], now: datetime,
         progress: Progress, node_states: dict[str, str]) -> Gang:
    """Pending/Running: create the gang, watch it, apply the failure policy."""
    nodes, attempt = spec.trainer.nodes, g.attempt
    # Pods of earlier attempts: stop the live ones; keep terminated ones for their logs.
    stale = [x for x in pods if x.attempt != attempt and (x.active or x.deleting)]
    gang = {x.rank: x for x in pods if x.attempt == attempt}
    g = _force_stuck(_delete(g, stale), stale, now, node_states, ref.namespace)

    failure = failure_policy.compute_failure(ref.name, old, attempt, gang, nodes, spec.failure_policy)
    if failure:
        return _handle_failure(g, spec, failure, list(gang.values()), pods, now)
    if len(gang) == nodes and all(x.phase == "Succeeded" for x in gang.values()):
        g = _set_phase(g, names.SUCCEEDED, f"all {nodes} trainer pods succeeded", names.REASON_SUCCEEDED)
        return replace(g, status={**g.status, "completionTime": format_time(now)})
    if len(gang) == nodes and all(x.phase in ("Running", "Succeeded") for x in gang.values()):
        g = _set_phase(g, names.RUNNING, f"all {nodes} trainer pods running", names.REASON_ALL_RUNNING)
        g = replace(g, status={**g.status, "startTime": g.status.get("startTime") or format_time(now)})
        return _check_progress(g, spec, progress, list(gang.values()), pods, now)
    if not stale:  # a new gang starts only once the previous one is gone
        missing = [build_trainer_pod(ref, spec, attempt, r) for r in range(nodes) if r not in gang]
        g = replace(g, create=g.create + tuple(missing))
    # No event: waiting for pods to schedule is not news. No count of the running ones
    # either: it would cost a status write per pod that starts (`kubectl get pods` has it).
    g = replace(g, status={**g.status, "phase": names.PENDING,
                           "message": f"attempt {attempt}: waiting for all {nodes} trainer pods to run"})
    return _report_stuck(g, old.get("message"))


def _check_progress(g: Gang, spec: RFTJobSpec, progress: Progress, gang: list[PodView],
                    pods: list[PodView], now: datetime) -> Gang:
    """Running: record when the step last moved (`progress_deadline.compute_progress_check`);
    past the deadline, end the attempt like a failed pod. Otherwise come back when the
    deadline would pass."""
    check = progress_deadline.compute_progress_check(g.status.get("progress"), g.attempt, spec, progress, now)
    g = replace(g, status={**g.status, "progress": check.record})
    if not check.stalled:
        return g if check.requeue_after is None else replace(g, requeue_after=check.requeue_after)
    failure = Failure(None, None, names.REASON_PROGRESS_DEADLINE, check.stalled)
    g = replace(g, events=g.events + (Event("Warning", names.REASON_PROGRESS_DEADLINE, check.stalled),))
    return _handle_failure(g, spec, failure, gang, pods, now, exhausted=names.REASON_PROGRESS_DEADLINE)


def _handle_failure(g: Gang, spec: RFTJobSpec, failure: Failure, gang: list[PodView],
                    pods: list[PodView], now: datetime, exhausted: str = names.REASON_BACKOFF_LIMIT) -> Gang:
    """Record the failure, then act on its verdict through the action's handler (`ACTIONS`,
    one per entry of rft_contract.failures). `exhausted` is the Failed reason when the
    budget is spent."""
    g = replace(g, status={**g.status, "lastFailure": failure.record(g.attempt, now)})
    action = FAILURE_ACTIONS[failure.verdict]
    return ACTIONS[action.name](g, spec, failure, action, gang, pods, now, exhausted)


def _say(action: FailureAction, failure: Failure, template: str, spec: RFTJobSpec, g: Gang) -> str:
    return f"{failure.message}; " + template.format(
        exit_code=failure.exit_code, restarts=g.status["restarts"], disruptions=g.status["disruptions"],
        max_restarts=spec.failure_policy.max_restarts)


def _fail_now(g, spec, failure, action, gang, pods, now, exhausted) -> Gang:
    """The job fails, whatever the budget (a fatal exit code)."""
    return _fail(g, pods, now, action.reason, _say(action, failure, action.message, spec, g))


def _restart_within_budget(g, spec, failure, action, gang, pods, now, exhausted) -> Gang:
    """Restart, counted against spec.failurePolicy.maxRestarts; fail once it is spent."""
    if not failure_policy.should_restart(g.status["restarts"], spec.failure_policy):
        return _fail(g, pods, now, exhausted, _say(action, failure, action.exhausted, spec, g))
    g = replace(g, status={**g.status, "restarts": g.status["restarts"] + 1})
    return _restart(g, spec, gang, _say(action, failure, action.message, spec, g), action.reason)


def _restart_free(g, spec, failure, action, gang, pods, now, exhausted) -> Gang:
    """Restart without using the budget (a disruption), counted in status.disruptions."""
    g = replace(g, status={**g.status, "disruptions": g.status["disruptions"] + 1})
    return _restart(g, spec, gang, _say(action, failure, action.message, spec, g), action.reason)


# The failure-action catalogue's names -> their handlers (JobSet's actionFunctionMap).
ACTIONS = {FATAL: _fail_now, RETRYABLE: _restart_within_budget, DISRUPTED: _restart_free}


def _restart(g: Gang, spec: RFTJobSpec, gang: list[PodView], message: str, reason: str) -> Gang:
    """Delete the gang and wait out the backoff in Restarting (a Warning event says why)."""
    backoff = spec.failure_policy.backoff_seconds
    g = _delete(g, [x for x in gang if x.active])
    g = _set_phase(g, names.RESTARTING, f"{message} in {backoff}s", reason, warn=True)
    return _requeue(g, float(backoff))


def _fail(g: Gang, pods: list[PodView], now: datetime, reason: str, message: str) -> Gang:
    """Terminal: stop every live trainer pod; keep the first completion time."""
    g = _set_phase(_delete(g, [x for x in pods if x.active]), names.FAILED, message, reason, warn=True)
    done = g.status.get("completionTime") or format_time(now)
    return replace(g, status={**g.status, "completionTime": done}, failed_reason=reason)
