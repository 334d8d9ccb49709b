"""The reconcile checklist: (RFTJob, observed children, now) -> Plan. Pure, no I/O.

Level-triggered: every pass recomputes everything from the job's stored status and the
children that exist right now, so a missed event, a crash between two writes, or an
operator restart converges to the same result. The status is the record of intent and is
written first (with a resourceVersion precondition); the side effects in the plan are
derived from it and idempotent (create-by-name, delete-if-present).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from . import builders, constants as c, policy, sync
from .api import RFTJobSpec, parse_spec
from .policy import Cond

Obj = dict[str, Any]
OPERATOR_STATUS_KEYS = (
    "phase", "message", "observedGeneration", "attempt", "restarts", "startTime",
    "completionTime", "lastFailure", "conditions",
)


@dataclass(frozen=True)
class PodView:
    """What the operator needs to know about one child pod."""

    name: str
    attempt: int
    rank: int
    phase: str
    deleting: bool = False
    exit_code: int | None = None
    reason: str | None = None
    role: str = c.ROLE_TRAINER
    spec_hash: str = ""

    @classmethod
    def from_pod(cls, pod: Obj) -> "PodView":
        meta, status = pod["metadata"], pod.get("status") or {}
        lbls = meta.get("labels") or {}
        exit_code, reason = None, status.get("reason")
        for cs in status.get("containerStatuses") or []:
            term = (cs.get("state") or {}).get("terminated")
            if term and (cs.get("name") == "trainer" or exit_code is None):
                exit_code, reason = term.get("exitCode"), term.get("reason") or reason
        return cls(
            name=meta["name"],
            attempt=int(lbls.get(c.LABEL_ATTEMPT, -1)),
            rank=int(lbls.get(c.LABEL_RANK, -1)),
            phase=status.get("phase") or "Pending",
            deleting=bool(meta.get("deletionTimestamp")),
            exit_code=exit_code,
            reason=reason,
            role=lbls.get(c.LABEL_ROLE, c.ROLE_TRAINER),
            spec_hash=(meta.get("annotations") or {}).get(c.ANNOTATION_SPEC_HASH, ""),
        )

    @property
    def active(self) -> bool:
        return self.phase in ("Pending", "Running") and not self.deleting


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass
class Observed:
    pods: list[PodView] = field(default_factory=list)
    # Static children present: (kind, name) -> spec hash annotation (or "").
    children: dict[tuple[str, str], str] = field(default_factory=dict)


@dataclass
class Plan:
    status: Obj  # operator-owned status fields, complete
    status_changed: bool
    create: list[Obj] = field(default_factory=list)
    replace: list[Obj] = field(default_factory=list)
    delete_pods: list[str] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    requeue_after: float | None = None


class _Pass:
    """Mutable scratchpad of one reconcile pass."""

    def __init__(self, body: Obj, observed: Observed, now: datetime):
        self.body, self.observed, self.now = body, observed, now
        self.ref = builders.JobRef.from_body(body)
        self.generation = body["metadata"].get("generation")
        old = body.get("status") or {}
        self.old = {k: old.get(k) for k in OPERATOR_STATUS_KEYS}
        self.st: Obj = dict(self.old)
        self.st.setdefault("attempt", 0)
        self.st["attempt"] = self.st["attempt"] or 0
        self.st["restarts"] = self.st.get("restarts") or 0
        self.plan = Plan(status=self.st, status_changed=False)
        self.old_trainer = old.get("trainer") or {}
        self.old_sync = old.get("weightSync") or {}
        self.sync: Obj = {}  # operator-owned weightSync fields (+ prunes as None)
        self.sync_cond: Cond | None = None
        self.trainer_pods = [x for x in observed.pods if x.role == c.ROLE_TRAINER]
        self.rollout_pods = [x for x in observed.pods if x.role != c.ROLE_TRAINER]
        self.failed_reason = next(
            (x.get("reason") for x in self.old["conditions"] or []
             if x.get("type") == c.COND_FAILED and x.get("status") == "True"),
            c.FAILED,
        )

    # --- helpers
    def event(self, type_: str, reason: str, message: str) -> None:
        self.plan.events.append(Event(type_, reason, message))

    def set_phase(self, phase: str, message: str, reason: str = "", warn: bool = False) -> None:
        if self.st.get("phase") != phase:
            self.event("Warning" if warn else "Normal", reason or phase, message)
        self.st["phase"], self.st["message"] = phase, message

    def delete(self, pods: list[PodView]) -> None:
        for p in pods:
            if not p.deleting and p.name not in self.plan.delete_pods:
                self.plan.delete_pods.append(p.name)

    @property
    def attempt(self) -> int:
        return self.st["attempt"]


def reconcile(body: Obj, observed: Observed, now: datetime) -> Plan:
    """One pass of the checklist. See module docstring."""
    p = _Pass(body, observed, now)
    try:
        spec = parse_spec(body.get("spec") or {})
    except ValueError as e:
        _fail(p, c.REASON_INVALID_SPEC, f"invalid spec: {e}")
        return _finish(p, None)

    if p.st.get("phase") in c.TERMINAL_PHASES:
        p.delete([x for x in p.trainer_pods if x.active])
        return _finish(p, spec)

    _ensure_static_children(p, spec)
    if spec.suspend:
        _suspend(p)
        return _finish(p, spec)
    if p.st.get("phase") == c.SUSPENDED:
        p.st["attempt"] += 1
        p.set_phase(c.PENDING, f"resumed: starting attempt {p.attempt}", c.REASON_RESUMED)
    if p.attempt == 0:
        p.st["attempt"] = 1
        p.set_phase(c.PENDING, "starting attempt 1", c.REASON_CREATED)
    if p.st.get("phase") == c.RESTARTING and not _restart_due(p, spec):
        return _finish(p, spec)
    _run_gang(p, spec)
    return _finish(p, spec)


def _ensure_static_children(p: _Pass, spec: RFTJobSpec) -> None:
    for obj in builders.build_static_children(p.ref, spec):
        key = (obj["kind"], obj["metadata"]["name"])
        want = (obj["metadata"].get("annotations") or {}).get(c.ANNOTATION_SPEC_HASH, "")
        if key not in p.observed.children:
            p.plan.create.append(obj)
        elif want and p.observed.children[key] != want:
            p.plan.replace.append(obj)


def _suspend(p: _Pass) -> None:
    p.delete([x for x in p.trainer_pods if x.active])
    p.set_phase(c.SUSPENDED, "suspended: pods removed, checkpoints kept", c.REASON_SUSPENDED)


def _restart_due(p: _Pass, spec: RFTJobSpec) -> bool:
    """In Restarting: tear the old gang down, then wait out the backoff.

    Terminated pods are kept (they hold no resources, and their logs explain the
    failure); the garbage collector removes them with the job."""
    active = [x for x in p.trainer_pods if x.active or x.deleting]
    p.delete(active)
    failed_at = policy.parse_time((p.st.get("lastFailure") or {}).get("time"))
    wait = policy.backoff_remaining(failed_at, spec.failure_policy.backoff_seconds, p.now)
    if wait > 0:
        p.plan.requeue_after = wait
        return False
    if active:  # old pods still terminating; their deletion events wake us
        return False
    p.st["attempt"] += 1
    p.set_phase(c.PENDING, f"restarted: starting attempt {p.attempt}", c.REASON_RESTARTED)
    return True


def _run_gang(p: _Pass, spec: RFTJobSpec) -> None:
    """Pending/Running: create the gang, watch it, apply the failure policy."""
    nodes = spec.trainer.nodes
    # Pods of earlier attempts: stop the live ones; keep terminated ones for their logs.
    stale = [x for x in p.trainer_pods if x.attempt != p.attempt and (x.active or x.deleting)]
    gang = {x.rank: x for x in p.trainer_pods if x.attempt == p.attempt}
    p.delete(stale)

    failure = _first_failure(p, gang, nodes)
    if failure:
        _handle_failure(p, spec, failure, list(gang.values()))
        return
    if len(gang) == nodes and all(x.phase == "Succeeded" for x in gang.values()):
        p.set_phase(c.SUCCEEDED, f"all {nodes} trainer pods succeeded", c.REASON_SUCCEEDED)
        p.st["completionTime"] = policy.format_time(p.now)
        return
    if len(gang) == nodes and all(x.phase in ("Running", "Succeeded") for x in gang.values()):
        p.set_phase(c.RUNNING, f"all {nodes} trainer pods running", c.REASON_ALL_RUNNING)
        p.st["startTime"] = p.st.get("startTime") or policy.format_time(p.now)
        return
    if not stale:  # a new gang starts only once the previous one is gone
        for rank in range(nodes):
            if rank not in gang:
                p.plan.create.append(builders.build_trainer_pod(p.ref, spec, p.attempt, rank))
    ready = sum(1 for x in gang.values() if x.phase == "Running")
    p.st["phase"] = c.PENDING
    p.st["message"] = f"attempt {p.attempt}: {ready}/{nodes} trainer pods running"


def _first_failure(p: _Pass, gang: dict[int, PodView], nodes: int) -> Obj | None:
    for rank in sorted(gang):
        x = gang[rank]
        if x.phase == "Failed":
            return {"pod": x.name, "exitCode": x.exit_code, "reason": c.REASON_POD_FAILED,
                    "message": f"pod {x.name} failed" + (f" with exit code {x.exit_code}" if x.exit_code is not None else f" ({x.reason or 'no exit code'})")}
        if x.phase == "Unknown" or x.deleting:
            return {"pod": x.name, "exitCode": None, "reason": c.REASON_POD_DELETED,
                    "message": f"pod {x.name} was deleted or lost its node"}
    if p.old.get("phase") == c.RUNNING and p.old.get("attempt") == p.attempt:
        # The whole gang was running; a vanished pod breaks the rendezvous.
        for rank in range(nodes):
            if rank not in gang:
                name = builders.pod_name(p.ref.name, p.attempt, rank)
                return {"pod": name, "exitCode": None, "reason": c.REASON_POD_DELETED,
                        "message": f"pod {name} disappeared"}
    return None


def _handle_failure(p: _Pass, spec: RFTJobSpec, failure: Obj, gang: list[PodView]) -> None:
    fp = spec.failure_policy
    record = {"attempt": p.attempt, **failure, "time": policy.format_time(p.now)}
    p.st["lastFailure"] = record
    if policy.classify_exit_code(failure["exitCode"], fp) == policy.FATAL:
        _fail(p, c.REASON_FATAL_EXIT,
              f"{failure['message']}; exit code {failure['exitCode']} is fatal under "
              "spec.failurePolicy (fatalExitCodes/retryableExitCodes); fix the cause and "
              "create the job again")
        return
    if not policy.should_restart(p.st["restarts"], fp):
        _fail(p, c.REASON_BACKOFF_LIMIT,
              f"{failure['message']}; restart budget exhausted after {p.st['restarts']} "
              f"restarts (spec.failurePolicy.maxRestarts={fp.max_restarts})")
        return
    p.st["restarts"] += 1
    p.delete([x for x in gang if x.active])
    p.set_phase(c.RESTARTING,
                f"{failure['message']}; restart {p.st['restarts']}/{fp.max_restarts} "
                f"in {fp.backoff_seconds}s", c.REASON_RESTARTING, warn=True)
    p.plan.requeue_after = float(fp.backoff_seconds)


def _fail(p: _Pass, reason: str, message: str) -> None:
    p.delete([x for x in p.trainer_pods if x.active])
    p.set_phase(c.FAILED, message, reason, warn=True)
    p.st["completionTime"] = p.st.get("completionTime") or policy.format_time(p.now)
    p.failed_reason = reason


# ------------------------------------------------------------------ rollouts and weight sync


def _rollouts(p: _Pass, spec: RFTJobSpec | None) -> None:
    """Inference and explorer pods live across trainer attempts. They go with suspend and
    failure; after success explorers stop at once and inference pods once they serve the
    final weights (bounded by FINAL_SYNC_GRACE_SECONDS)."""
    phase = p.st.get("phase")
    if spec is None or phase in (c.SUSPENDED, c.FAILED):
        p.delete([x for x in p.rollout_pods if x.active])
        return
    if phase == c.SUCCEEDED:
        p.delete([x for x in p.rollout_pods if x.active and x.role == c.ROLE_EXPLORER])
        if _final_sync_done(p, spec):
            p.delete([x for x in p.rollout_pods if x.active])
        return
    desired = {obj["metadata"]["name"]: obj for obj in builders.build_rollout_pods(p.ref, spec)}
    seen = {x.name: x for x in p.rollout_pods}
    for x in p.rollout_pods:
        want = desired.get(x.name)
        drifted = want is not None and x.spec_hash != want["metadata"]["annotations"][c.ANNOTATION_SPEC_HASH]
        if want is None or drifted or x.phase in ("Failed", "Unknown"):
            p.delete([x] if not x.deleting else [])  # recreated by a later pass
    for name, obj in desired.items():
        if name not in seen:
            p.plan.create.append(obj)


def _final_sync_done(p: _Pass, spec: RFTJobSpec) -> bool:
    if p.sync_cond is None or p.sync_cond.status:
        return True
    done_at = policy.parse_time(p.st.get("completionTime"))
    left = policy.backoff_remaining(done_at, c.FINAL_SYNC_GRACE_SECONDS, p.now)
    if left > 0:
        p.plan.requeue_after = left
        return False
    return True


def _weight_sync(p: _Pass, spec: RFTJobSpec | None) -> None:
    """Promote the trainer's export (or the pin) to the target and count the replicas."""
    if spec is None or spec.inference is None:
        return
    t = sync.compute_target(spec, p.old_trainer, p.old_sync.get("target"))
    pods = [builders.inference_pod_name(p.ref.name, i) for i in range(spec.inference.replicas)]
    replicas = p.old_sync.get("replicas") or {}
    n = sync.count_synced(replicas, pods, t.target, p.old_trainer.get("step"))
    p.sync = {"target": t.target, "desiredReplicas": n.desired, "syncedReplicas": n.synced,
              "synced": f"{n.synced}/{n.desired}", "lagSteps": n.lag_steps}
    prune = sync.stale_replica_entries(replicas, pods)
    if prune:
        p.sync["replicas"] = {name: None for name in prune}  # merge patch: delete
    if not sync.same_target(t.target, p.old_sync.get("target")):
        p.event("Normal", "WeightsTarget", f"serving target is now version {t.target['version']}"
                + (f" ({t.target.get('uri')})" if t.target.get("uri") else ""))
    status, reason, message = sync.sync_condition(n, t.target, t.problem)
    p.sync_cond = Cond(c.COND_WEIGHTS_SYNCED, status, reason, message)


def _sync_changed(p: _Pass) -> bool:
    return any(not sync.same_target(p.old_sync.get(k), v) if k == "target" else p.old_sync.get(k) != v
               for k, v in p.sync.items())


def _conditions(p: _Pass) -> list[Cond]:
    phase, msg = p.st.get("phase"), p.st.get("message") or ""
    failed_reason = p.failed_reason
    ckpt = p.old_trainer.get("lastCheckpoint") or {}
    return [
        Cond(c.COND_CHECKPOINTED, ckpt.get("step") is not None,
             c.REASON_CHECKPOINT_SAVED if ckpt.get("step") is not None else c.REASON_NO_CHECKPOINT,
             f"step {ckpt['step']} at {ckpt.get('uri')}" if ckpt.get("step") is not None else
             "no checkpoint committed yet"),
        Cond(c.COND_RUNNING, phase == c.RUNNING, phase or c.PENDING, msg),
        Cond(c.COND_SUSPENDED, phase == c.SUSPENDED,
             c.REASON_SUSPENDED if phase == c.SUSPENDED else c.REASON_NOT_SUSPENDED,
             msg if phase == c.SUSPENDED else ""),
        Cond(c.COND_SUCCEEDED, phase == c.SUCCEEDED, phase or c.PENDING,
             msg if phase == c.SUCCEEDED else ""),
        Cond(c.COND_FAILED, phase == c.FAILED, failed_reason if phase == c.FAILED else phase or c.PENDING,
             msg if phase == c.FAILED else ""),
    ] + ([p.sync_cond] if p.sync_cond is not None else [])


def _finish(p: _Pass, spec: RFTJobSpec | None) -> Plan:
    _weight_sync(p, spec)
    _rollouts(p, spec)
    p.st["observedGeneration"] = p.generation
    p.st["conditions"] = policy.compute_conditions(
        p.old.get("conditions"), _conditions(p), p.generation, p.now
    )
    p.plan.status = p.st
    if spec is not None and not p.old_trainer.get("progress"):
        total = spec.trainer.total_steps
        p.plan.status["trainer"] = {"totalSteps": total, "progress": f"0/{total}"}
    if p.sync and _sync_changed(p):
        p.plan.status["weightSync"] = p.sync
    p.plan.status_changed = any(p.st.get(k) != p.old.get(k) for k in OPERATOR_STATUS_KEYS) or (
        "trainer" in p.plan.status or "weightSync" in p.plan.status
    )
    return p.plan
