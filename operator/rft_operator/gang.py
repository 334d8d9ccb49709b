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
is the root cause (a deleted pod ended when its delete was requested), except that a code
in `fatalExitCodes` on any rank fails the job. A pod the cluster disrupted (condition
DisruptionTarget: evicted, preempted, tainted away, garbage-collected) restarts the gang
without using `maxRestarts`, counted in `status.disruptions`, if it is the root cause; a
node-pressure eviction by the kubelet uses the budget like a crash. Old pods that outlive
their grace period by `policy.FORCE_DELETE_MARGIN_SECONDS` are force-deleted only when
their node is known to run nothing (Node deleted or tainted out-of-service); otherwise
the gang keeps waiting and says, once, what an admin can do.

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

import re
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone

from rft_contract import names as c
from rft_contract.spec import FailurePolicy, RFTJobSpec
from rft_contract.times import format_time, parse_time

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
    log: str = ""  # the failed container's last lines (`log_tail`)

    def record(self, attempt: int, now: datetime) -> Obj:
        """`status.lastFailure`."""
        out = {"attempt": attempt, "pod": self.pod, "exitCode": self.exit_code, "reason": self.reason,
               "message": self.message, "time": format_time(now)}
        if self.log:
            out["log"] = self.log
        return out


LOG_TAIL_CHARS = 1024
LAST_LINE_CHARS = 200


# A failed container's log reaches status and Events, which outlive the pod and which more
# people may read than the pod's logs: credentials a program printed are cut out first.
_HIDDEN = "[redacted]"
_SECRETS = (
    # Presigned URLs and signed requests: the signature, credential and session token.
    (re.compile(r"(?i)\b(x-amz-(?:signature|credential|security-token)|signature|awsaccesskeyid"
                r"|access_token|id_token|refresh_token|token|sig)=[^&\s'\"]+"), rf"\1={_HIDDEN}"),
    # key = value, key: value, "key": "value" for names that hold credentials.
    (re.compile(r"(?i)\b([\w.-]*?(?:password|passwd|secret|secret[_-]?key|api[_-]?key|access[_-]?key(?:[_-]?id)?"
                r"|token|authorization))\b"
                r"(['\"]?\s*[:=]\s*['\"]?)(?:(?:bearer|basic|aws4-hmac-sha256)\s+)?[^\s'\",&]+"), rf"\1\2{_HIDDEN}"),
    (re.compile(r"\b(?:AKIA|ASIA)[A-Z0-9]{16}\b"), _HIDDEN),  # AWS access key ids
    (re.compile(r"(\b[a-z][a-z0-9+.-]*://)[^/\s:@]+:[^/\s@]+@"), rf"\1{_HIDDEN}@"),  # user:password@ in URLs
)
_TERMINAL = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")  # colours, controls


def redact(text: str) -> str:
    """`text` without terminal escapes, control characters and what looks like a credential."""
    text = _TERMINAL.sub("", text)
    for pattern, hidden in _SECRETS:
        text = pattern.sub(hidden, text)
    return text


def log_tail(text: str, limit: int = LOG_TAIL_CHARS) -> str:
    """The last whole lines of `text` that fit in `limit` characters (the last line cut to
    its end when it alone is longer), trailing blank lines dropped."""
    lines = text.rstrip().splitlines()
    out: list[str] = []
    size = 0
    for line in reversed(lines):
        if out and size + len(line) + 1 > limit:
            break
        out.append(line[-limit:])
        size += len(line) + 1
    return "\n".join(reversed(out))


def last_line(text: str) -> str:
    """The last non-blank line, cut to LAST_LINE_CHARS: what a failure's message quotes."""
    line = next((x.strip() for x in reversed(text.splitlines()) if x.strip()), "")
    return line if len(line) <= LAST_LINE_CHARS else line[:LAST_LINE_CHARS - 3] + "..."


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
                 refusal: Refusal | None = None, nodes: dict[str, str] | None = None) -> Gang:
    """One pass over the trainer pods. `old` is the stored operator status, `pods` the
    trainer pods of every attempt, `spec` None when the stored spec is invalid, `refusal`
    a child the API server would not take for this job (it fails the job), `nodes` what is
    known of the nodes of pods stuck terminating (`stuck_nodes`; `policy.NODE_*`)."""
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
        g = _restart_when_due(g, ref, spec, pods, now, nodes or {})
        if g.phase == c.RESTARTING:
            return g
    return _run(g, ref, spec, old, pods, now, progress, nodes or {})


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


def stuck_nodes(pods: list[PodView], now: datetime) -> set[str]:
    """The nodes of pods stuck terminating (past their deadline and margin, not forced
    yet), whose state `_force_stuck` needs: the controller reads only these Nodes."""
    return {x.node_name for x in pods if x.node_name and (left := _stuck_for(x, now)) is not None and left <= 0}


def _stuck_for(x: PodView, now: datetime) -> float | None:
    """Seconds until `x` counts as stuck terminating (<= 0: it does); None: it never will."""
    return None if x.force_deleted else policy.force_delete_remaining(x.deletion_deadline, now)


def _force_stuck(g: Gang, pods: list[PodView], now: datetime, nodes: dict[str, str], namespace: str) -> Gang:
    """Old pods the next gang waits for, still terminating `FORCE_DELETE_MARGIN_SECONDS`
    after their grace period ended. A pod whose node is gone or out of service (or that
    never had one) is force-deleted (grace period 0) with one Warning event: nothing runs
    it. Any other may still run on a node cut off from the API server (holding its GPUs,
    writing the same checkpoints), so it is not forced: `stuck` says why the gang waits
    and what an admin can do. Until the first is due, come back then: no event will."""
    due, waits = [], []
    for x in pods:
        left = _stuck_for(x, now)
        if left is not None and left <= 0:
            due.append(x)
        elif left is not None:
            waits.append(left)
    if waits:
        g = _requeue(g, min(waits))
    forced = [x for x in due if policy.may_force_delete(x.node_name, nodes)]
    held = [x for x in due if x not in forced]
    if held:
        g = replace(g, stuck=build_stuck_message(held, nodes, namespace))
    if not forced:
        return g
    margin = int(policy.FORCE_DELETE_MARGIN_SECONDS)
    message = (f"{_pods_on_nodes(forced, nodes)} still terminating {margin}s after the grace period ended, "
               "and nothing runs them any more: force-deleting (grace period 0) so the next gang can start")
    return replace(g, force_delete=g.force_delete + tuple(x.name for x in forced),
                   events=g.events + (Event("Warning", c.REASON_STUCK_TERMINATING, message),))


_NODE_WORDS = {policy.NODE_GONE: "deleted", policy.NODE_OUT_OF_SERVICE: "out of service",
               policy.NODE_UNREADABLE: "the operator may not read it", policy.NODE_UP: ""}


def _pods_on_nodes(pods: list[PodView], nodes: dict[str, str]) -> str:
    """"pod a (node n1, deleted), b (node n2)": each pod with its node and what is known of it."""
    def one(x: PodView) -> str:
        if not x.node_name:
            return f"{x.name} (never scheduled)"
        words = _NODE_WORDS.get(nodes.get(x.node_name, ""), "")
        return f"{x.name} (node {x.node_name}{', ' + words if words else ''})"
    return f"pod{'s' if len(pods) > 1 else ''} " + ", ".join(one(x) for x in pods)


def build_stuck_message(pods: list[PodView], nodes: dict[str, str], namespace: str) -> str:
    """Why the gang waits for pods stuck terminating on nodes that may still run them, and
    what an admin can do. Steady (no clock in it): it is the status message while waiting,
    and the Warning event goes out when the message first says it."""
    node_names = sorted({x.node_name for x in pods})
    node = node_names[0] if len(node_names) == 1 else "<node>"
    pod = pods[0].name if len(pods) == 1 else "<pod>"
    return (f"waiting for {_pods_on_nodes(pods, nodes)}, still terminating "
            f"{int(policy.FORCE_DELETE_MARGIN_SECONDS)}s after the grace period ended: the node has not "
            "confirmed that the containers stopped, and a node cut off from the cluster may still run them, "
            "so the operator does not force-delete them. If the node is down: kubectl delete node "
            f"{' '.join(node_names)}, or kubectl taint node {node} "
            f"{policy.OUT_OF_SERVICE_TAINT}=nodeshutdown:NoExecute; if you know the pods no longer run: "
            f"kubectl delete pod -n {namespace} {pod} --force --grace-period=0. The job goes on by itself "
            "once they are gone")


def _report_stuck(g: Gang, old_message: str | None) -> Gang:
    """While waiting for pods that may not be forced, the status message says so; the
    Warning event goes out once, in the pass that first writes the message."""
    if not g.stuck:
        return g
    events = g.events if old_message == g.stuck else g.events + (Event("Warning", c.REASON_STUCK_TERMINATING, g.stuck),)
    return replace(g, status={**g.status, "message": g.stuck}, events=events)


def _next_attempt(g: Gang, verb: str, reason: str) -> Gang:
    attempt = g.attempt + 1
    g = replace(g, status={**g.status, "attempt": attempt})
    return _set_phase(g, c.PENDING, f"{verb}: starting attempt {attempt}", reason)


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
    wait = policy.backoff_remaining(failed_at, spec.failure_policy.backoff_seconds, now)
    if wait > 0:
        return _requeue(g, wait)
    if active:  # old pods still terminating; their deletion events (or the force deadline) wake us
        return g
    return _next_attempt(g, "restarted", c.REASON_RESTARTED)


def _run(g: Gang, ref: JobRef, spec: RFTJobSpec, old: Obj, pods: list[PodView], now: datetime,
         progress: Progress, node_states: dict[str, str]) -> Gang:
    """Pending/Running: create the gang, watch it, apply the failure policy."""
    nodes, attempt = spec.trainer.nodes, g.attempt
    # Pods of earlier attempts: stop the live ones; keep terminated ones for their logs.
    stale = [x for x in pods if x.attempt != attempt and (x.active or x.deleting)]
    gang = {x.rank: x for x in pods if x.attempt == attempt}
    g = _force_stuck(_delete(g, stale), stale, now, node_states, ref.namespace)

    failure = compute_failure(ref.name, old, attempt, gang, nodes, spec.failure_policy)
    if failure:
        return _handle_failure(g, spec, failure, list(gang.values()), pods, now)
    if len(gang) == nodes and all(x.phase == "Succeeded" for x in gang.values()):
        g = _set_phase(g, c.SUCCEEDED, f"all {nodes} trainer pods succeeded", c.REASON_SUCCEEDED)
        return replace(g, status={**g.status, "completionTime": format_time(now)})
    if len(gang) == nodes and all(x.phase in ("Running", "Succeeded") for x in gang.values()):
        g = _set_phase(g, c.RUNNING, f"all {nodes} trainer pods running", c.REASON_ALL_RUNNING)
        g = replace(g, status={**g.status, "startTime": g.status.get("startTime") or format_time(now)})
        return _check_progress(g, spec, progress, list(gang.values()), pods, now)
    if not stale:  # a new gang starts only once the previous one is gone
        missing = [build_trainer_pod(ref, spec, attempt, r) for r in range(nodes) if r not in gang]
        g = replace(g, create=g.create + tuple(missing))
    # No event: waiting for pods to schedule is not news. No count of the running ones
    # either: it would cost a status write per pod that starts (`kubectl get pods` has it).
    g = replace(g, status={**g.status, "phase": c.PENDING,
                           "message": f"attempt {attempt}: waiting for all {nodes} trainer pods to run"})
    return _report_stuck(g, old.get("message"))


def compute_failure(job: str, old: Obj, attempt: int, gang: dict[int, PodView], nodes: int,
                    fp: FailurePolicy) -> Failure | None:
    """The failure that ends this attempt; None while the gang is healthy.

    Every rank that ended is a candidate: a failed pod, a lost (`Unknown`) or deleted one,
    a disrupted one, and, once the whole gang had been running, a missing one (a pod
    missing before the gang ever ran is simply recreated). The root cause is
      1. the first candidate with a code in `fatalExitCodes`: it fails the job, whatever
         ended first (the program said a restart cannot help, and a peer's crash does not
         make a rank say that);
      2. else the first to end: `PodView.ended_at` (when it was disrupted or its delete
         requested, else when its trainer container exited), pods without a time after
         those with one, rank breaking ties, missing pods last. Its verdict decides: a
         code outside `retryableExitCodes` fails the job only here, as the root cause
         (ranks that die after a peer exit with whatever NCCL or torchrun make of it); a
         disrupted root cause restarts without using the budget; a crash that came first
         does use it, even if another rank was disrupted later.
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
    root = next((f for f in ended if f.verdict == policy.FATAL and f.exit_code in fp.fatal_exit_codes), ended[0])
    if len(ended) > 1:
        others = len(ended) - 1
        root = replace(root, message=f"{root.message} ({others} other rank{'s' if others > 1 else ''} "
                                     f"also ended)")
    return root


def _pod_failure(x: PodView, fp: FailurePolicy) -> Failure:
    verdict = policy.classify_failure(x.exit_code, x.disruption, fp, x.status_reason)
    if x.disruption:
        reason, message = c.REASON_POD_DISRUPTED, f"pod {x.name} was disrupted ({x.disruption})"
        if verdict != policy.DISRUPTED:  # node pressure: say which resource ran out
            message = (f"pod {x.name} was evicted by the kubelet for node pressure ({x.disruption}"
                       + (f": {x.disruption_message})" if x.disruption_message else ")"))
    elif x.stopped_by_deletion:  # its exit code answers the SIGTERM: not judged
        verdict = policy.RETRYABLE
        reason, message = c.REASON_POD_DELETED, f"pod {x.name} was deleted"
    elif x.phase == "Failed":
        log = redact(x.termination_message)
        if x.exit_code is None:
            how, said = f" ({x.reason or 'no exit code'})", last_line(log)
        elif x.reason and x.reason not in ("Error", "Completed"):  # OOMKilled, ContainerCannotRun, ...
            # The kernel, not the program, ended it: its last line says nothing about why.
            how, said = f" with exit code {x.exit_code} ({x.reason})", ""
        else:
            how, said = f" with exit code {x.exit_code}", last_line(log)
        reason, message = c.REASON_POD_FAILED, f"pod {x.name} failed" + how + (f": {said}" if said else "")
        return Failure(x.name, x.exit_code, reason, message, verdict, x.ended_at, x.rank, log_tail(log))
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
    resumed = trainer.get("resumedFrom") or {}
    if trainer.get("attempt") not in (None, g.attempt):
        waiting = trainer.get("waiting") or {}
        progress = replace(progress, trainer={"waiting": waiting} if waiting.get("attempt") == g.attempt else {})
    step = progress.trainer.get("step")
    record = compute_progress_record(g.status.get("progress"), g.attempt, step, now, resumed)
    g = replace(g, status={**g.status, "progress": record})
    if step is not None and step >= spec.trainer.total_steps:
        return g  # trained: the final export and save take what they take
    deadline = spec.failure_policy.progress_deadline_seconds
    if deadline and step is None and (progress.trainer.get("waiting") or {}).get("reason") == c.WAIT_PREPARING:
        # No step from this attempt yet and the trainer says it is still loading the model
        # (bounded by its own timeout) and resuming: the deadline counts from there.
        deadline += spec.model.cache.download_timeout_seconds
    left = policy.progress_deadline_remaining(parse_time(record["since"]), deadline, now)
    if left is None:
        return g
    if left >= 0:  # not past it yet: come back when it would be
        return replace(g, requeue_after=left)
    message = build_stall_message(record, progress, deadline, now)
    failure = Failure(None, None, c.REASON_PROGRESS_DEADLINE, message)
    g = replace(g, events=g.events + (Event("Warning", c.REASON_PROGRESS_DEADLINE, message),))
    return _handle_failure(g, spec, failure, gang, pods, now, exhausted=c.REASON_PROGRESS_DEADLINE)


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
    done = g.status.get("completionTime") or format_time(now)
    return replace(g, status={**g.status, "completionTime": done}, failed_reason=reason)
