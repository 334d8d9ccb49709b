"""The values the reconcile concerns exchange: what they observe and what they report.

`PodView` is the little the operator reads from a child pod, `ChildView` the same for a
static child (ConfigMap, Service, ServiceAccount, Role, RoleBinding); `Event` is a
Kubernetes event to emit; `Refusal` a child the API server would not take for this job.
They live here, not in `reconcile.py`, so the concern modules (`gang`, `rollout`,
`weightsync`) can use them without importing the composition that imports them.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Iterable

from rft_contract import names
from rft_contract.times import parse_time

Obj = dict[str, Any]

# The pod condition the API server (eviction, preemption, taint manager) or the kubelet
# (node-pressure eviction) sets on a pod it is about to stop for reasons of its own.
DISRUPTION_TARGET = "DisruptionTarget"
TRAINER_CONTAINER = "trainer"


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
    role: str = names.ROLE_TRAINER
    spec_hash: str = ""
    # When the trainer container terminated (state.terminated.finishedAt).
    finished_at: datetime | None = None
    # Its state.terminated.message: the program's termination message, or with
    # FallbackToLogsOnError the last lines of its log when it failed; "" when none.
    termination_message: str = ""
    # The DisruptionTarget condition: the cluster, not the program, stopped the pod.
    disruption: str | None = None  # its reason, e.g. EvictionByEvictionAPI; None: not disrupted
    disrupted_at: datetime | None = None  # its lastTransitionTime
    disruption_message: str = ""  # its message, e.g. "The node was low on resource: memory. ..."
    status_reason: str | None = None  # status.reason: "Evicted" (node pressure), "Terminated" (node shutdown)
    # metadata.deletionTimestamp: the API server sets it to the delete request's time plus
    # the grace period, so it is when the kubelet should have finished, not when deletion began.
    deletion_deadline: datetime | None = None
    deletion_grace_seconds: int | None = None  # metadata.deletionGracePeriodSeconds; 0: forced
    owner_uid: str = ""  # uid of the controller ownerReference
    node_name: str = ""  # spec.nodeName; "" while unscheduled

    @classmethod
    def from_pod(cls, pod: Obj) -> "PodView":
        meta, status = pod["metadata"], pod.get("status") or {}
        lbls = meta.get("labels") or {}
        exit_code, reason, finished, said = None, status.get("reason"), None, ""
        for cs in status.get("containerStatuses") or []:
            term = (cs.get("state") or {}).get("terminated")
            if term and (cs.get("name") == TRAINER_CONTAINER or exit_code is None):
                exit_code, reason = term.get("exitCode"), term.get("reason") or reason
                finished, said = parse_time(term.get("finishedAt")), term.get("message") or ""
        disruption = next((x for x in status.get("conditions") or []
                           if x.get("type") == DISRUPTION_TARGET and x.get("status") == "True"), None)
        return cls(
            name=meta["name"],
            attempt=int(lbls.get(names.LABEL_ATTEMPT, -1)),
            rank=int(lbls.get(names.LABEL_RANK, -1)),
            phase=status.get("phase") or "Pending",
            deleting=bool(meta.get("deletionTimestamp")),
            exit_code=exit_code,
            reason=reason,
            role=lbls.get(names.LABEL_ROLE, names.ROLE_TRAINER),
            spec_hash=(meta.get("annotations") or {}).get(names.ANNOTATION_SPEC_HASH, ""),
            finished_at=finished,
            termination_message=said,
            disruption=(disruption.get("reason") or DISRUPTION_TARGET) if disruption else None,
            disrupted_at=parse_time(disruption.get("lastTransitionTime")) if disruption else None,
            disruption_message=(disruption.get("message") or "") if disruption else "",
            status_reason=status.get("reason"),
            deletion_deadline=parse_time(meta.get("deletionTimestamp")),
            deletion_grace_seconds=meta.get("deletionGracePeriodSeconds"),
            owner_uid=controller_uid(meta),
            node_name=(pod.get("spec") or {}).get("nodeName") or "",
        )

    @property
    def active(self) -> bool:
        return self.phase in ("Pending", "Running") and not self.deleting

    @property
    def deletion_requested_at(self) -> datetime | None:
        """When the delete request came: deletionTimestamp less the grace period."""
        if self.deletion_deadline is None:
            return None
        return self.deletion_deadline - timedelta(seconds=self.deletion_grace_seconds or 0)

    @property
    def stopped_by_deletion(self) -> bool:
        """Deleted while its trainer still ran: whatever it exits with answers the SIGTERM
        and says nothing about the program."""
        requested = self.deletion_requested_at
        return requested is not None and (self.finished_at is None or requested <= self.finished_at)

    @property
    def ended_at(self) -> datetime | None:
        """When the pod stopped being part of the gang: when it was disrupted or its delete
        was requested (the decision to stop it precedes its exit, and a pod lost with its
        node never reports one), else when its trainer container exited."""
        if self.disrupted_at:
            return self.disrupted_at
        requested = self.deletion_requested_at
        if requested and (self.finished_at is None or requested < self.finished_at):
            return requested
        return self.finished_at

    @property
    def force_deleted(self) -> bool:
        return self.deleting and self.deletion_grace_seconds == 0


@dataclass(frozen=True)
class ChildView:
    """What the operator needs to know about one static child: its spec hash annotation,
    its controller owner, and the live fields it manages (`managed_fields`), so a hand edit
    is seen even though the annotation still carries the rendered hash."""

    kind: str
    name: str
    spec_hash: str = ""
    owner_uid: str = ""
    live: Obj = field(default_factory=dict)

    @classmethod
    def from_object(cls, kind: str, obj: Obj) -> "ChildView":
        meta = obj["metadata"]
        return cls(kind, meta["name"], (meta.get("annotations") or {}).get(names.ANNOTATION_SPEC_HASH, ""),
                   controller_uid(meta), managed_fields(obj))


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass(frozen=True)
class Refusal:
    """A child the API server would not take for this job, which no retry can fix: it is
    invalid (HTTP 422, reason InvalidSpec) or its name is taken by an object this job does
    not control (reason ChildConflict). `message` names the object and, for 422, the field."""

    reason: str
    message: str


def compute_deletions(already: tuple[str, ...], pods: Iterable[PodView]) -> tuple[str, ...]:
    """`already` plus the pods to delete, in order, each once. A pod already being deleted
    is skipped: deleting it again would only cost an API call."""
    out = list(already)
    for p in pods:
        if not p.deleting and p.name not in out:
            out.append(p.name)
    return tuple(out)


def controller_uid(meta: Obj) -> str:
    """The uid of the object's controller ownerReference ("" when it has none)."""
    return next((r.get("uid", "") for r in meta.get("ownerReferences") or [] if r.get("controller")), "")


def managed_fields(obj: Obj) -> Obj:
    """The parts of a child the operator renders and restores: its labels and annotations
    and every top-level field but identity and status (data, spec, rules, roleRef, ...)."""
    out = {k: copy.deepcopy(v) for k, v in obj.items() if k not in ("apiVersion", "kind", "metadata", "status")}
    meta = obj.get("metadata") or {}
    out["metadata"] = {"labels": dict(meta.get("labels") or {}), "annotations": dict(meta.get("annotations") or {})}
    return out
