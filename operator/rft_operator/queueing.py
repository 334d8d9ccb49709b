"""Queueing by Kueue: a job labelled `kueue.x-k8s.io/queue-name` runs only while Kueue
admits its Workload. Pure, no I/O.

Kueue's built-in integrations are Go code inside Kueue; an operator outside it integrates
by owning a `Workload` itself (Apache Spark's Kubernetes operator does the same). The
operator:

- creates one Workload per job (`build_workload`, controller reference to the job): its
  podSets are the job's pods as the builders render them (`trainer`: count = nodes;
  `inference`; `explorer`), its queue the label's, its priority the WorkloadPriorityClass
  the job names in `kueue.x-k8s.io/priority-class` (the controller reads the value);
- starts pods only once the Workload is admitted, placed where the admission says
  (`place`: each assigned flavor's node labels and tolerations, the admission checks'
  podSetUpdates, the `kueue.x-k8s.io/podset` label), as Kueue's own `podset.FromAssignment`;
- on `Evicted=True` (preempted, deactivated) stops the pods (SIGTERM: the trainer saves a
  final checkpoint), then itself clears the admission (`compute_workload_status`): Kueue
  does not, and the preemptor would wait forever;
- reports `PodsReady` when the gang runs and `Finished` when the job ends (quota freed);
- maps the user's `spec.suspend` to the Workload's `spec.active` (`compute_workload_patch`),
  without undoing a deactivation that is Kueue's own; keeps `queueName` on the job's label
  and makes the Workload again when the job's pods changed while it holds no quota.
  The operator never writes the job's spec: GitOps sees no drift.

A job without the label is untouched by all of this (no Kueue needed). The state lives in
the Workload and the job's status, so an operator restarted mid-admission or mid-eviction
picks up where it was. The reconcile's Kueue policy lives here too (`compute_queue`,
`compute_kueue`, `queue_status`, `place_pods`); reconcile.py only composes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import NamedTuple, Protocol

from rft_contract import names
from rft_contract.spec import RFTJobSpec
from rft_contract.times import format_time

from .conditions import Cond
from .model import Obj, PodView
from .objects import JobRef, build_meta, labels, spec_hash
from .rollout_pods import build_rollout_pods
from .terminating import FORCE_DELETE_MARGIN_SECONDS
from .trainer_pods import build_trainer_pod

GROUP, VERSION = "kueue.x-k8s.io", "v1beta2"
API_VERSION = f"{GROUP}/{VERSION}"
LABEL_QUEUE_NAME = "kueue.x-k8s.io/queue-name"
LABEL_PRIORITY_CLASS = "kueue.x-k8s.io/priority-class"
LABEL_PODSET = "kueue.x-k8s.io/podset"
# Workload conditions (Kueue's apis/kueue/v1beta2/workload_types.go).
QUOTA_RESERVED, ADMITTED, EVICTED, FINISHED, PODS_READY, REQUEUED = (
    "QuotaReserved", "Admitted", "Evicted", "Finished", "PodsReady", "Requeued")
# Eviction reasons after which Kueue's own job integrations set Requeued=True.
REQUEUED_REASONS = ("Preempted", "NodeFailures")

# status.queue.state
QUEUED, STATE_ADMITTED, STATE_EVICTED = "Queued", "Admitted", "Evicted"


def queue_name(body: Obj) -> str | None:
    """The LocalQueue the job names, or None: the job is not queued by Kueue."""
    return ((body.get("metadata") or {}).get("labels") or {}).get(LABEL_QUEUE_NAME) or None


def priority_class(body: Obj) -> str | None:
    return ((body.get("metadata") or {}).get("labels") or {}).get(LABEL_PRIORITY_CLASS) or None


def workload_name(job: str) -> str:
    return f"rftjob-{job}"


@dataclass(frozen=True)
class Placement:
    """Where the admission puts one pod set's pods."""

    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: tuple[Obj, ...] = ()
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Queue:
    """What Kueue decided for a job that names a queue. `admitted` with `placement` by pod
    set; otherwise `reason` and `message` (Kueue's words) say why it waits."""

    local_queue: str
    workload: Obj | None
    admitted: bool = False
    evicted: bool = False
    reason: str = "Queued"
    message: str = ""
    cluster_queue: str = ""
    placement: dict[str, Placement] = field(default_factory=dict)
    # Admitted, but the admission's node labels contradict the job's own nodeSelector: the
    # job fails (Kueue's own integrations fail such a job too, FailedToStart).
    conflict: str = ""

    @property
    def state(self) -> str:
        return STATE_EVICTED if self.evicted else STATE_ADMITTED if self.admitted else QUEUED

    def status(self) -> Obj:
        """`status.queue` of the job."""
        out = {"name": self.local_queue, "state": self.state,
               "workload": (self.workload or {}).get("metadata", {}).get("name") or ""}
        if self.cluster_queue:
            out["clusterQueue"] = self.cluster_queue
        return out

    def condition(self) -> Cond:
        """The job's `Admitted` condition."""
        if self.admitted:
            return Cond(names.COND_ADMITTED, True, STATE_ADMITTED,
                        f"admitted by Kueue to ClusterQueue {self.cluster_queue}")
        return Cond(names.COND_ADMITTED, False, self.reason, self.message)


def find_condition(obj: Obj | None, type_: str) -> Obj | None:
    return next((x for x in ((obj or {}).get("status") or {}).get("conditions") or [] if x.get("type") == type_), None)


def is_true(obj: Obj | None, type_: str) -> bool:
    return (find_condition(obj, type_) or {}).get("status") == "True"


def read_queue(local_queue: str, workload: Obj | None, flavors: dict[str, Obj]) -> Queue:
    """The job's queue state from its Workload (None: not created yet) and the
    ResourceFlavors its admission names (name -> object; a missing one places nothing)."""
    if workload is None:
        return Queue(local_queue, None, message=f"creating Workload for LocalQueue {local_queue}")
    status = workload.get("status") or {}
    admission = status.get("admission") or {}
    cq = admission.get("clusterQueue") or ""
    if is_true(workload, EVICTED) and admission:  # evicted, its pods still stopping
        ev = find_condition(workload, EVICTED) or {}
        return Queue(local_queue, workload, admitted=False, evicted=True, reason=ev.get("reason") or EVICTED,
                     message=f"evicted by Kueue: {ev.get('message') or ev.get('reason')}", cluster_queue=cq)
    if is_true(workload, ADMITTED) and admission:
        missing = sorted({f for x in admission.get("podSetAssignments") or [] for f in (x.get("flavors") or {}).values()}
                         - set(flavors))
        if missing:
            return Queue(local_queue, workload, reason="FlavorNotFound", cluster_queue=cq,
                         message=f"admitted to ClusterQueue {cq}, waiting to read ResourceFlavor {', '.join(missing)}")
        placement = compute_placement(admission, status.get("admissionChecks") or [], flavors)
        return Queue(local_queue, workload, admitted=True, reason=STATE_ADMITTED, cluster_queue=cq,
                     placement=placement, conflict=find_conflict(workload, placement))
    if not (workload.get("spec") or {}).get("active", True):
        ev = find_condition(workload, EVICTED) or {}
        return Queue(local_queue, workload, reason="Deactivated",
                     message=f"Workload {workload['metadata']['name']} is deactivated (spec.active: false)"
                             + (f": {ev['message']}" if ev.get("message") else ""))
    why = find_condition(workload, QUOTA_RESERVED) or find_condition(workload, ADMITTED) or {}
    if is_true(workload, QUOTA_RESERVED):  # quota held, admission checks pending
        why = find_condition(workload, ADMITTED) or why
    message = why.get("message") or f"waiting for Kueue to admit Workload {workload['metadata']['name']}"
    return Queue(local_queue, workload, reason=why.get("reason") or "Pending",
                 message=f"queued in LocalQueue {local_queue}: {message}", cluster_queue=cq)


def compute_placement(admission: Obj, checks: list[Obj], flavors: dict[str, Obj]) -> dict[str, Placement]:
    """Pod set name -> Placement: the node labels and tolerations of every flavor assigned
    to it, then each admission check's podSetUpdates, then the podset label."""
    out = {}
    for assignment in admission.get("podSetAssignments") or []:
        ps = assignment.get("name") or ""
        selector: dict[str, str] = {}
        tolerations: list[Obj] = []
        for flavor in sorted(set((assignment.get("flavors") or {}).values())):
            fspec = (flavors.get(flavor) or {}).get("spec") or {}
            selector.update(fspec.get("nodeLabels") or {})
            tolerations += [x for x in fspec.get("tolerations") or [] if x not in tolerations]
        lbls, annotations = {LABEL_PODSET: ps}, {}
        for check in checks:
            for update in check.get("podSetUpdates") or []:
                if update.get("name") != ps:
                    continue
                selector.update(update.get("nodeSelector") or {})
                tolerations += [x for x in update.get("tolerations") or [] if x not in tolerations]
                lbls.update(update.get("labels") or {})
                annotations.update(update.get("annotations") or {})
        out[ps] = Placement(selector, tuple(tolerations), lbls, annotations)
    return out


def find_conflict(workload: Obj, placement: dict[str, Placement]) -> str:
    """A node label the admission sets to another value than the pod set's own nodeSelector
    (the job's spec), in words; "" when there is none. Kueue's `podset.Merge` refuses the same."""
    for ps in (workload.get("spec") or {}).get("podSets") or []:
        own = ((ps.get("template") or {}).get("spec") or {}).get("nodeSelector") or {}
        wanted = placement.get(ps.get("name") or "")
        for key, value in sorted((wanted.node_selector if wanted else {}).items()):
            if key in own and own[key] != value:
                return (f"Kueue admitted pod set {ps['name']} where node label {key}={value}, but the job's pods "
                        f"select {key}={own[key]}: change the job's nodeSelector or the queue's ResourceFlavor")
    return ""


def place(pod: Obj, placement: Placement | None) -> Obj:
    """The pod with the admission's placement merged in (the admission wins a nodeSelector
    key both name). The pod's spec hash annotation is untouched: placement is not drift."""
    if placement is None:
        return pod
    meta, spec = pod["metadata"], pod["spec"]
    out = {**pod, "metadata": {**meta, "labels": {**(meta.get("labels") or {}), **placement.labels}},
           "spec": {**spec}}
    if placement.annotations:
        out["metadata"]["annotations"] = {**(meta.get("annotations") or {}), **placement.annotations}
    if placement.node_selector:
        out["spec"]["nodeSelector"] = {**(spec.get("nodeSelector") or {}), **placement.node_selector}
    if placement.tolerations:
        have = list(spec.get("tolerations") or [])
        out["spec"]["tolerations"] = have + [x for x in placement.tolerations if x not in have]
    return out


def build_pod_sets(ref: JobRef, spec: RFTJobSpec) -> list[Obj]:
    """The Workload's pod sets: the job's pods as the builders render them, one set per role."""
    sets = [(names.ROLE_TRAINER, build_trainer_pod(ref, spec, 1, 0), spec.trainer.nodes)]
    rollout = build_rollout_pods(ref, spec)
    for role in (names.ROLE_INFERENCE, names.ROLE_EXPLORER):
        pods = [x for x in rollout if x["metadata"]["labels"].get(names.LABEL_ROLE) == role]
        if pods:
            sets.append((role, pods[0], len(pods)))
    return [{"name": role, "count": count,
             "template": {"metadata": {"labels": labels(ref.name, role)}, "spec": pod["spec"]}}
            for role, pod, count in sets]


def build_workload(ref: JobRef, spec: RFTJobSpec, local_queue: str, priority: tuple[str, int] | None) -> Obj:
    """The job's Workload. `priority`: (WorkloadPriorityClass name, value) when the job names one."""
    pod_sets = build_pod_sets(ref, spec)
    body: Obj = {"queueName": local_queue, "podSets": pod_sets, "active": not spec.suspend}
    if priority is not None:
        body["priorityClassRef"] = {"group": GROUP, "kind": "WorkloadPriorityClass", "name": priority[0]}
        body["priority"] = priority[1]
    annotations = {names.ANNOTATION_SPEC_HASH: spec_hash(pod_sets)}
    return {"apiVersion": API_VERSION, "kind": "Workload",
            "metadata": build_meta(ref, workload_name(ref.name), labels(ref.name) | {LABEL_QUEUE_NAME: local_queue},
                                   annotations),
            "spec": body}


def compute_workload_patch(workload: Obj, spec: RFTJobSpec, local_queue: str, suspended: bool
                           ) -> tuple[Obj | None, bool]:
    """A merge patch of the Workload's spec, or None, and whether the operator holds the
    Workload deactivated for the user's suspend (`Queue.suspended`, kept in status.queue):

    - `spec.suspend: true` deactivates it (Kueue evicts it and gives the quota back);
    - after a suspend, `false` activates it again, once. A Workload Kueue deactivated by
      itself (an admission check rejected it, its requeue limit or maximum execution time
      was reached) stays inactive: the operator does not fight Kueue over it;
    - while it holds no quota, `queueName` follows the job's label."""
    body = workload.get("spec") or {}
    active = body.get("active", True)
    change: Obj = {}
    if spec.suspend:
        if active:
            change["active"] = False
        suspended = True
    elif suspended:
        if active:
            suspended = False  # seen active again: done
        else:
            change["active"] = True
    if not (workload.get("status") or {}).get("admission") and body.get("queueName") != local_queue:
        change["queueName"] = local_queue
    if not change:
        return None, suspended
    meta = workload["metadata"]
    return {"apiVersion": API_VERSION, "kind": "Workload",
            "metadata": {"name": meta["name"], "namespace": meta["namespace"]}, "spec": change}, suspended


def workload_outdated(workload: Obj, ref: JobRef, spec: RFTJobSpec) -> bool:
    """Whether the Workload's pod sets are not the job's any more (the spec changed its pods)
    while it holds no quota: it is made again (its pod sets cannot change in place once
    Kueue has looked at them)."""
    if (workload.get("status") or {}).get("admission"):
        return False
    have = ((workload.get("metadata") or {}).get("annotations") or {}).get(names.ANNOTATION_SPEC_HASH)
    return have != spec_hash(build_pod_sets(ref, spec))


def workload_priority(workload: Obj) -> tuple[str, int] | None:
    """The (WorkloadPriorityClass, value) a Workload was made with, for making it again."""
    body = workload.get("spec") or {}
    name = (body.get("priorityClassRef") or {}).get("name")
    return (name, int(body.get("priority") or 0)) if name else None


def holds_quota(pods: list[PodView], now: datetime) -> bool:
    """Whether any of the job's pods may still run: Pending or Running, counting one being
    deleted (its SIGTERM is the trainer's final checkpoint) until it is
    FORCE_DELETE_MARGIN_SECONDS past its grace period: a pod on a node that no longer
    answers is not waited for (Kueue's own Job integration does not count terminating pods)."""
    margin = timedelta(seconds=FORCE_DELETE_MARGIN_SECONDS)
    return any(x.phase in ("Pending", "Running")
               and not (x.deletion_deadline is not None and now > x.deletion_deadline + margin) for x in pods)


def compute_workload_status(workload: Obj, phase: str | None, pods_active: bool, now: datetime) -> Obj | None:
    """The Workload status this operator owes Kueue, as a merge patch of its status (the
    whole condition list, with the resourceVersion it was computed from), or None:

    - evicted with its admission still set and none of the job's pods left: clear the
      admission (`admission: null`, QuotaReserved=False Pending, Admitted=False, Requeued),
      as Kueue's own job integrations do (`jobframework` reconciler, "handle eviction");
    - the job ended: Finished (Succeeded or Failed), which returns the quota;
    - the gang runs: PodsReady=True (what `waitForPodsReady` waits for).
    """
    status = workload.get("status") or {}
    conds = {x["type"]: dict(x) for x in status.get("conditions") or []}
    generation = workload["metadata"].get("generation")
    out: Obj = {}

    def put(type_: str, value: bool, reason: str, message: str) -> None:
        prev = conds.get(type_)
        flag = "True" if value else "False"
        if prev and (prev.get("status"), prev.get("reason"), prev.get("message")) == (flag, reason, message):
            return
        conds[type_] = {"type": type_, "status": flag, "reason": reason, "message": message[:32768],
                        "observedGeneration": generation,
                        "lastTransitionTime": (prev or {}).get("lastTransitionTime")
                        if prev and prev.get("status") == flag else format_time(now)}
        out["conditions"] = True

    if phase in names.TERMINAL_PHASES:
        # Only once its pods are gone: a succeeded job's inference pods serve the final
        # weights for a while, and they hold what Kueue counted.
        if not is_true(workload, FINISHED) and not pods_active:
            put(FINISHED, True, phase, f"the RFTJob {phase.lower()}")
    elif is_true(workload, EVICTED) and status.get("admission") and not pods_active:
        ev = conds[EVICTED]
        message = ev.get("message") or ev.get("reason") or EVICTED
        put(REQUEUED, ev.get("reason") in REQUEUED_REASONS, ev.get("reason") or EVICTED, message)
        put(QUOTA_RESERVED, False, "Pending", message)
        put(ADMITTED, False, "NoReservation", "The workload has no reservation")
        if PODS_READY in conds:
            put(PODS_READY, False, "PodsReady", "the job's pods were stopped")
        out["admission"] = None
    elif phase == names.RUNNING and is_true(workload, ADMITTED) and not is_true(workload, PODS_READY):
        put(PODS_READY, True, "PodsReady", "all trainer pods are running")
    elif phase == names.RESTARTING and is_true(workload, PODS_READY):
        put(PODS_READY, False, "WaitForRecovery", "the trainer gang is restarting")
    if not out:
        return None
    patch: Obj = {"conditions": sorted(conds.values(), key=lambda x: x["type"])}
    if "admission" in out:
        patch["admission"] = None
    meta = workload["metadata"]
    return {"apiVersion": API_VERSION, "kind": "Workload",
            "metadata": {"name": meta["name"], "namespace": meta["namespace"],
                         "resourceVersion": meta.get("resourceVersion")},
            "status": patch}


# ------------------------------------------------------------------ the reconcile's Kueue policy


class KueueObserved(Protocol):
    """What the controller read of Kueue for a job (reconcile.Observed has it): whether its
    API is installed, the job's Workload (None: not created yet), the ResourceFlavors its
    admission names, the WorkloadPriorityClass the job names as (name, value), what the
    operator may not read (a 403, in words), and the job's pods."""

    kueue: bool
    workload: Obj | None
    flavors: dict[str, Obj]
    priority: tuple[str, int] | None
    kueue_error: str
    pods: list[PodView]


def compute_queue(body: Obj, spec: RFTJobSpec | None, observed: KueueObserved) -> Queue | None:
    """What Kueue decided for a job that names a LocalQueue; None for one that does not
    (or whose spec is invalid: it fails without queueing)."""
    local_queue = queue_name(body)
    if local_queue is None or spec is None:
        return None
    if not observed.kueue:
        return Queue(local_queue, None, reason="KueueNotInstalled",
                     message=f"the job names LocalQueue {local_queue} ({LABEL_QUEUE_NAME}) but "
                             f"Kueue's API ({API_VERSION} workloads) is not installed")
    if observed.kueue_error:
        return Queue(local_queue, observed.workload, reason="KueueForbidden", message=observed.kueue_error)
    wanted = priority_class(body)
    if observed.workload is None and wanted and observed.priority is None:
        return Queue(local_queue, None, reason="PriorityClassNotFound",
                     message=f"WorkloadPriorityClass {wanted} ({LABEL_PRIORITY_CLASS}) not found")
    return read_queue(local_queue, observed.workload, observed.flavors)


class KueueWrites(NamedTuple):
    create: list[Obj]
    patch: list[Obj]
    delete: list[Obj]
    status: Obj | None
    suspended: bool  # status.queue.suspended (`compute_workload_patch`)


def compute_kueue(ref: JobRef, spec: RFTJobSpec | None, phase: str | None, queue: Queue | None,
                  observed: KueueObserved, now: datetime, suspended: bool) -> KueueWrites:
    """The Workload to create (or delete, to make again), its spec patch (suspend, queue)
    and its status patch. Kueue is owed the status of a Workload the job owns whatever the
    job's spec or labels say now (an invalid spec, a removed label): Finished, or the
    admission cleared after an eviction, frees the quota."""
    workload = observed.workload
    status = (compute_workload_status(workload, phase, holds_quota(observed.pods, now), now)
              if workload is not None else None)
    if queue is None or spec is None or not observed.kueue or observed.kueue_error:
        return KueueWrites([], [], [], status, suspended)
    terminal = phase in names.TERMINAL_PHASES
    if workload is None:
        if terminal or queue.reason == "PriorityClassNotFound":
            return KueueWrites([], [], [], None, suspended)
        return KueueWrites([build_workload(ref, spec, queue.local_queue, observed.priority)], [], [], None,
                           spec.suspend)
    if terminal:
        return KueueWrites([], [], [], status, suspended)
    if workload_outdated(workload, ref, spec):
        meta = workload["metadata"]
        return KueueWrites([], [], [{"kind": "Workload", "metadata": {"name": meta["name"],
                                                                      "namespace": meta["namespace"]}}],
                           status, suspended)
    patch, suspended = compute_workload_patch(workload, spec, queue.local_queue, suspended)
    return KueueWrites([], [patch] if patch else [], [], status, suspended)


def queue_status(queue: Queue | None, suspended: bool) -> Obj | None:
    if queue is None:
        return None
    return queue.status() | ({"suspended": True} if suspended else {})


def place_pods(queue: Queue | None, pods: list[Obj]) -> list[Obj]:
    """Pods where Kueue's admission puts them (`place`), by their role's pod set."""
    if queue is None or not queue.admitted:
        return pods
    return [place(x, queue.placement.get(x["metadata"]["labels"].get(names.LABEL_ROLE, "")))
            if x["kind"] == "Pod" else x for x in pods]
