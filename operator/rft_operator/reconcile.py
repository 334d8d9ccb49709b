"""The reconcile checklist: (RFTJob, observed children, now) -> Plan. Pure, no I/O.

Level-triggered: every pass recomputes everything from the job's stored status and the
children that exist right now, so a missed event, a crash between two writes, or an
operator restart converges to the same result. The status is the record of intent and is
written first (with a resourceVersion precondition); the side effects in the plan are
derived from it and idempotent (create-by-name, delete-if-present).

One module per concern, each a pure function of explicit inputs: `gang` (the trainer
gang's lifecycle, which applies `failure_policy`, `progress_deadline` and `terminating`),
`weightsync` (serving target, replica counts), `rollout` (inference and explorer pods),
`conditions`, `attempts`; `drift` compares live children with their render. This module
only composes them into a Plan (docs/design.md), and keeps the static children as
rendered (`render`, or the controller's `RenderCache`): every one carries a
spec hash, and one whose hash or live fields drifted is patched back, labels and
annotations it no longer renders removed (or, when a field that cannot change did, deleted
and created again); one the spec no longer renders (spec.explorer or spec.inference
removed) is deleted.

Ownership: only children whose controller ownerReference is this job (by uid) are observed
as ours (the controller filters the indexes); a name taken by anything else makes the
create fail with 409, and the controller turns that into a `Refusal` (ChildConflict), as it
does a child the API server refuses as invalid (422, InvalidSpec). The gang fails the job
on it: never adopt, never retry what cannot succeed.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from datetime import datetime
from typing import NamedTuple

from rft_contract import names
from rft_contract.spec import RFTJobSpec, parse_spec

from . import attempts, conditions, drift, gang, progress_deadline, queueing, rollout, terminating, weightsync
from .children import build_static_children
from .model import ChildView, Event, Obj, PodView, Refusal, managed_fields
from .objects import JobRef, spec_hash

__all__ = ["OPERATOR_STATUS_KEYS", "ChildView", "Event", "Observed", "Plan", "PodView", "Refusal", "Rendered",
           "RenderCache", "reconcile", "render"]

OPERATOR_STATUS_KEYS = (
    "phase", "message", "observedGeneration", "attempt", "restarts", "disruptions", "startTime",
    "completionTime", "lastFailure", "conditions", "progress", "attempts", "queue",
)

# Fields the API server never lets change: a child whose rendered value differs is
# deleted and created again rather than patched.
IMMUTABLE_FIELDS = {"RoleBinding": ("roleRef",)}


@dataclass
class Observed:
    pods: list[PodView] = field(default_factory=list)
    # Static children of this job: (kind, name) -> spec hash annotation (or "").
    children: dict[tuple[str, str], str] = field(default_factory=dict)
    # Their live managed fields (`model.managed_fields`), for drift by hand edits; a child
    # missing here is judged by its hash alone.
    live: dict[tuple[str, str], Obj] = field(default_factory=dict)
    # A child the API server refused for this job's current generation.
    refusal: Refusal | None = None
    # What the controller read of the nodes of trainer pods stuck terminating
    # (`nodes_to_read`): node name -> terminating.NODE_*. A node missing here is unknown.
    nodes: dict[str, str] = field(default_factory=dict)
    # Kueue (`queueing.py`), for a job labelled kueue.x-k8s.io/queue-name: whether its API is
    # installed, the job's Workload (None: not created yet), the ResourceFlavors its
    # admission names, the WorkloadPriorityClass the job names as (name, value) or None
    # when it does not exist.
    kueue: bool = False
    workload: Obj | None = None
    flavors: dict[str, Obj] = field(default_factory=dict)
    priority: tuple[str, int] | None = None
    kueue_error: str = ""  # what the operator may not read of Kueue's (a 403), in words

    @classmethod
    def from_views(cls, pods: list[PodView], children: list[ChildView], refusal: Refusal | None = None
                   ) -> "Observed":
        return cls(pods, {(x.kind, x.name): x.spec_hash for x in children},
                   {(x.kind, x.name): x.live for x in children}, refusal)


@dataclass
class Plan:
    status: Obj  # operator-owned status fields, complete
    status_changed: bool
    create: list[Obj] = field(default_factory=list)
    patch: list[Obj] = field(default_factory=list)  # merge patches back to the rendered form
    recreate: list[Obj] = field(default_factory=list)  # delete, then create (an immutable field drifted)
    # The Kueue Workload's status as this job's controller owes it (`queueing.compute_workload_status`).
    workload_status: Obj | None = None
    delete: list[Obj] = field(default_factory=list)  # static children the spec no longer renders
    delete_pods: list[str] = field(default_factory=list)
    force_delete_pods: list[str] = field(default_factory=list)  # stuck terminating: grace period 0
    events: list[Event] = field(default_factory=list)
    requeue_after: float | None = None


def reconcile(body: Obj, observed: Observed, now: datetime, renders: RenderCache | None = None) -> Plan:
    """One pass of the checklist. See module docstring. `renders` spares a pass the
    rendering of a spec it has seen (the controller keeps one); without it, every pass
    renders afresh."""
    ref, old_status = JobRef.from_body(body), body.get("status") or {}
    old = {k: old_status.get(k) for k in OPERATOR_STATUS_KEYS}
    trainer, old_sync = old_status.get("trainer") or {}, old_status.get("weightSync") or {}
    trainer_pods = [x for x in observed.pods if x.role == names.ROLE_TRAINER]
    rollout_pods = [x for x in observed.pods if x.role != names.ROLE_TRAINER]
    generation = body["metadata"].get("generation")

    # The order follows the data. Weight sync reads only the stored status, so it comes
    # first: its lag is one of the hints the gang's progress deadline reports. The gang
    # decides the phase. Rollouts need both the gang's phase and completion time (what to
    # keep) and the WeightsSynced condition (whether a succeeded job's inference pods may
    # go yet). Conditions summarise all of it. Static children come first in the plan:
    # pods mount the ConfigMap and resolve the Services; a job that ends in this pass
    # needs none.
    rendered = (renders.render if renders is not None else render)(ref, body.get("spec") or {})
    spec, spec_error = rendered.spec, rendered.error
    ws = weightsync.compute_weight_sync(ref.name, spec, trainer, old_sync)
    progress = progress_deadline.Progress(trainer, (ws.lag, rollout.describe_explorers(spec, rollout_pods)))
    queue = queueing.compute_queue(body, spec, observed)
    g = gang.compute_gang(ref, spec, spec_error, old, trainer_pods, now, progress, observed.refusal, observed.nodes,
                          queue)
    static = compute_static_children(ref, spec, g.phase, observed.children, observed.live, rendered.static)
    ro = rollout.compute_rollouts(ref, spec, g.status, ws.condition, rollout_pods, now,
                                  hold=queue is not None and not queue.admitted)
    kueue = queueing.compute_kueue(ref, spec, g.phase, queue, observed, now,
                                   bool((old["queue"] or {}).get("suspended")))
    deadline = spec.failure_policy.progress_deadline_seconds if spec is not None else 0
    conds = conditions.compute_job_conditions(old["conditions"], g.status, g.failed_reason, trainer,
                                              ws.condition, generation, now, deadline,
                                              queue.condition() if queue is not None else None)
    history = attempts.compute_attempts(old["attempts"], g.status, trainer, now, g.failed_reason)

    status = old | g.status | {"observedGeneration": generation, "conditions": conds,
                               "queue": queueing.queue_status(queue, kueue.suspended)}
    if spec is not None and not trainer.get("progress"):
        # Seeded once for kubectl; the trainer's rank 0 owns the subtree from then on.
        status["trainer"] = {"totalSteps": spec.trainer.total_steps, "progress": f"0/{spec.trainer.total_steps}"}
    if ws.status is not None:
        status["weightSync"] = ws.status
    if history.records is not None:
        status["attempts"] = history.records
    changed = any(status.get(k) != old.get(k) for k in OPERATOR_STATUS_KEYS)
    return Plan(
        status=status,
        status_changed=changed or "trainer" in status or "weightSync" in status,
        create=[*static.create, *kueue.create, *queueing.place_pods(queue, [*g.create, *ro.create])],
        patch=[*static.patch, *kueue.patch],
        workload_status=kueue.status,
        recreate=static.recreate,
        delete=[*static.delete, *kueue.delete],
        delete_pods=[*g.delete, *(n for n in ro.delete if n not in g.delete)],
        force_delete_pods=list(g.force_delete),
        events=[*g.events, *ws.events, *history.events],
        # The earliest time-based wake-up: backoff, progress deadline, final sync grace.
        requeue_after=min((x for x in (g.requeue_after, ro.requeue_after) if x is not None), default=None),
    )


def nodes_to_read(body: Obj, observed: Observed, now: datetime) -> set[str]:
    """The nodes whose state the gang needs before it may force-delete a trainer pod stuck
    terminating (`terminating.stuck_nodes`); none for a finished job, which waits for nothing."""
    if (body.get("status") or {}).get("phase") in names.TERMINAL_PHASES:
        return set()
    return terminating.stuck_nodes([x for x in observed.pods if x.role == names.ROLE_TRAINER], now)


class Rendered(NamedTuple):
    """What a job's stored spec alone decides: the parsed spec (None and why when it is
    invalid) and its static children as rendered, each with its managed fields."""

    spec: RFTJobSpec | None
    error: str
    static: tuple[tuple[Obj, Obj], ...]


def render(ref: JobRef, spec: Obj) -> Rendered:
    """What this job's stored spec decides, rendered afresh."""
    parsed, error = _parse(spec)
    static: tuple[tuple[Obj, Obj], ...] = ()
    if parsed is not None:
        children = (with_spec_hash(with_managed_keys(x)) for x in build_static_children(ref, parsed))
        static = tuple((x, managed_fields(x)) for x in children)
    return Rendered(parsed, error, static)


class RenderCache:
    """The last render of each job, owned by the controller. A pass reuses it while the
    stored spec is equal (a dict comparison) and the uid is the same, so validating the spec
    and rendering and hashing the children, which were most of a pass's CPU, happen once
    per spec rather than once per pod event. The result is the same function of (job
    identity, spec) as `render`: reconcile stays pure."""

    def __init__(self, limit: int = 20000) -> None:
        self.limit = limit  # a bound for memory; the controller forgets deleted jobs
        self._by_job: dict[tuple[str, str], tuple[str, Obj, Rendered]] = {}

    def render(self, ref: JobRef, spec: Obj) -> Rendered:
        key = (ref.namespace, ref.name)
        hit = self._by_job.get(key)
        if hit is not None and hit[0] == ref.uid and hit[1] == spec:
            return hit[2]
        out = render(ref, spec)
        if key not in self._by_job and len(self._by_job) >= self.limit:
            del self._by_job[next(iter(self._by_job))]
        self._by_job[key] = (ref.uid, copy.deepcopy(spec), out)
        return out

    def forget(self, namespace: str, name: str) -> None:
        """Drop the render of a job that is gone."""
        self._by_job.pop((namespace, name), None)

    def __len__(self) -> int:
        return len(self._by_job)


def _parse(spec: Obj) -> tuple[RFTJobSpec | None, str]:
    """The spec, or None and why not (a stored spec the CRD schema let through)."""
    try:
        return parse_spec(spec), ""
    except ValueError as e:
        return None, f"invalid spec: {e}"


class StaticChildren(NamedTuple):
    create: list[Obj]  # missing
    patch: list[Obj]  # drifted: merge patches (`drift.compute_patch`)
    recreate: list[Obj]  # drifted in a field that cannot change: delete, then create
    delete: list[Obj]  # no longer rendered: {kind, metadata: {name, namespace}}


def compute_static_children(ref: JobRef, spec: RFTJobSpec | None, phase: str | None,
                            present: dict[tuple[str, str], str], live: dict[tuple[str, str], Obj] | None = None,
                            rendered: tuple[tuple[Obj, Obj], ...] | None = None) -> StaticChildren:
    """The missing children, the ones that drifted (patched back, or recreated when an
    immutable field changed) and the ones this spec no longer renders (an explorer's
    ServiceAccount and Role once spec.explorer is gone). Nothing for an invalid spec or a
    finished job: it creates none of them any more, and the garbage collector removes
    them with the job.

    A child drifted when its spec hash annotation is not the rendered one (the spec
    changed; a child without one predates the hashes and is judged by its fields), or when
    its live fields no longer hold the rendered ones (a hand edit: `drift.covers`).

    `rendered`: the children of `spec` with their managed fields (`render`), when the
    caller has them already; they are only read, and what goes into the result is a copy."""
    out = StaticChildren([], [], [], [])
    if spec is None or phase in names.TERMINAL_PHASES:
        return out
    if rendered is None:
        children = (with_spec_hash(with_managed_keys(x)) for x in build_static_children(ref, spec))
        rendered = tuple((x, managed_fields(x)) for x in children)
    seen = set()
    for obj, fields in rendered:
        key = (obj["kind"], obj["metadata"]["name"])
        seen.add(key)
        if key not in present:
            out.create.append(copy.deepcopy(obj))
            continue
        have = (live or {}).get(key)
        hash_drift = bool(present[key]) and present[key] != obj["metadata"]["annotations"][names.ANNOTATION_SPEC_HASH]
        if have is not None and any(f in have and have[f] != obj.get(f) for f in IMMUTABLE_FIELDS.get(obj["kind"], ())):
            out.recreate.append(copy.deepcopy(obj))
        elif hash_drift or (have is not None and not drift.covers(have, fields)):
            out.patch.append(drift.compute_patch(obj, have))
    out.delete.extend({"kind": kind, "metadata": {"name": name, "namespace": ref.namespace}}
                      for kind, name in sorted(present) if (kind, name) not in seen)
    return out


def with_managed_keys(obj: Obj) -> Obj:
    """The child with `rft.dev/managed-keys` listing its label and annotation keys outside
    our namespaces (`drift.build_managed_keys`), when it has any: a later render that drops
    one then removes it (`drift.compute_patch`)."""
    keys = drift.build_managed_keys(obj["metadata"])
    if not keys:
        return obj
    out = copy.deepcopy(obj)
    out["metadata"]["annotations"] = {**(obj["metadata"].get("annotations") or {}), names.ANNOTATION_MANAGED_KEYS: keys}
    return out


def with_spec_hash(obj: Obj) -> Obj:
    """The child with its `rft.dev/spec-hash` annotation: the one its builder set (the
    ConfigMap's covers the config it carries), else a digest of the whole rendered object."""
    annotations = obj["metadata"].get("annotations") or {}
    if annotations.get(names.ANNOTATION_SPEC_HASH):
        return obj
    out = copy.deepcopy(obj)
    out["metadata"]["annotations"] = {**annotations, names.ANNOTATION_SPEC_HASH: spec_hash(obj)}
    return out
