"""The reconcile checklist: (RFTJob, observed children, now) -> Plan. Pure, no I/O.

Level-triggered: every pass recomputes everything from the job's stored status and the
children that exist right now, so a missed event, a crash between two writes, or an
operator restart converges to the same result. The status is the record of intent and is
written first (with a resourceVersion precondition); the side effects in the plan are
derived from it and idempotent (create-by-name, delete-if-present).

One module per concern, each a pure function of explicit inputs: `gang` (trainer pods,
failure policy, progress deadline), `weightsync` (serving target, replica counts),
`rollout` (inference and explorer pods), `conditions`. This module only composes them into
a Plan (docs/design.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from rft_contract import names as c
from rft_contract.spec import RFTJobSpec, parse_spec

from . import conditions, gang, rollout, weightsync
from .children import build_static_children
from .model import Event, Obj, PodView
from .objects import JobRef

__all__ = ["OPERATOR_STATUS_KEYS", "Event", "Observed", "Plan", "PodView", "reconcile"]

OPERATOR_STATUS_KEYS = (
    "phase", "message", "observedGeneration", "attempt", "restarts", "startTime",
    "completionTime", "lastFailure", "conditions", "progress",
)


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


def reconcile(body: Obj, observed: Observed, now: datetime) -> Plan:
    """One pass of the checklist. See module docstring."""
    ref, old_status = JobRef.from_body(body), body.get("status") or {}
    old = {k: old_status.get(k) for k in OPERATOR_STATUS_KEYS}
    trainer, old_sync = old_status.get("trainer") or {}, old_status.get("weightSync") or {}
    trainer_pods = [x for x in observed.pods if x.role == c.ROLE_TRAINER]
    rollout_pods = [x for x in observed.pods if x.role != c.ROLE_TRAINER]
    generation = body["metadata"].get("generation")

    # The order follows the data. Weight sync reads only the stored status, so it comes
    # first: its lag is one of the hints the gang's progress deadline reports. The gang
    # decides the phase. Rollouts need both the gang's phase and completion time (what to
    # keep) and the WeightsSynced condition (whether a succeeded job's inference pods may
    # go yet). Conditions summarise all of it. Static children come first in the plan:
    # pods mount the ConfigMap and resolve the Services.
    spec, spec_error = _parse(body)
    create, replace = compute_static_children(ref, spec, old.get("phase"), observed.children)
    ws = weightsync.compute_weight_sync(ref.name, spec, trainer, old_sync)
    progress = gang.Progress(trainer, (ws.lag, rollout.describe_explorers(spec, rollout_pods)))
    g = gang.compute_gang(ref, spec, spec_error, old, trainer_pods, now, progress)
    ro = rollout.compute_rollouts(ref, spec, g.status, ws.condition, rollout_pods, now)
    deadline = spec.failure_policy.progress_deadline_seconds if spec is not None else 0
    conds = conditions.compute_job_conditions(old["conditions"], g.status, g.failed_reason, trainer,
                                              ws.condition, generation, now, deadline)

    status = old | g.status | {"observedGeneration": generation, "conditions": conds}
    if spec is not None and not trainer.get("progress"):
        # Seeded once for kubectl; the trainer's rank 0 owns the subtree from then on.
        status["trainer"] = {"totalSteps": spec.trainer.total_steps, "progress": f"0/{spec.trainer.total_steps}"}
    if ws.status is not None:
        status["weightSync"] = ws.status
    changed = any(status.get(k) != old.get(k) for k in OPERATOR_STATUS_KEYS)
    return Plan(
        status=status,
        status_changed=changed or "trainer" in status or "weightSync" in status,
        create=[*create, *g.create, *ro.create],
        replace=replace,
        delete_pods=[*g.delete, *(n for n in ro.delete if n not in g.delete)],
        events=[*g.events, *ws.events],
        # The earliest time-based wake-up: backoff, progress deadline, final sync grace.
        requeue_after=min((x for x in (g.requeue_after, ro.requeue_after) if x is not None), default=None),
    )


def _parse(body: Obj) -> tuple[RFTJobSpec | None, str]:
    """The spec, or None and why not (a stored spec the CRD schema let through)."""
    try:
        return parse_spec(body.get("spec") or {}), ""
    except ValueError as e:
        return None, f"invalid spec: {e}"


def compute_static_children(ref: JobRef, spec: RFTJobSpec | None, phase: str | None,
                            present: dict[tuple[str, str], str]) -> tuple[list[Obj], list[Obj]]:
    """(to create, to replace): missing children, and ones whose spec hash drifted.
    Nothing for an invalid spec or a finished job: it needs none of them any more."""
    create: list[Obj] = []
    replace: list[Obj] = []
    if spec is None or phase in c.TERMINAL_PHASES:
        return create, replace
    for obj in build_static_children(ref, spec):
        key = (obj["kind"], obj["metadata"]["name"])
        want = (obj["metadata"].get("annotations") or {}).get(c.ANNOTATION_SPEC_HASH, "")
        if key not in present:
            create.append(obj)
        elif want and present[key] != want:
            replace.append(obj)
    return create, replace
