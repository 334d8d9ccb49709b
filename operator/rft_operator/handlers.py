"""kopf wiring: the RFTJobs' watch-fed index and the event handler that only enqueues,
the children's informers (`informer.py`), startup and cleanup. What they share lives in
kopf's operator memo (`Memo`), none of it at module level.

Nothing here decides anything: `reconcile.py` does, `controller.py` schedules it.
No change handlers, daemons or timers, so kopf adds no finalizers or annotations to
RFTJobs: deleting a job never waits for the operator.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import kopf
from kubernetes.client.rest import ApiException

from rft_contract import names
from .controller import Controller, Key, write_threads
from .workqueue import is_new
from .informer import Informer, Store, wait_synced
from .kube import Kube, load_config
from .model import ChildView, PodView
from . import queueing

log = logging.getLogger("rft_operator")

CHILD_KINDS = {  # plural -> (group/version, kind)
    "configmaps": ("v1", "ConfigMap"),
    "services": ("v1", "Service"),
    "serviceaccounts": ("v1", "ServiceAccount"),
    "roles": ("rbac.authorization.k8s.io/v1", "Role"),
    "rolebindings": ("rbac.authorization.k8s.io/v1", "RoleBinding"),
}
JOB = (names.GROUP, names.VERSION, names.PLURAL)
# Server-side filtering: only our children travel over the watch streams.
CHILD_SELECTOR = f"{names.LABEL_JOB},{names.LABEL_MANAGED_BY}={names.MANAGED_BY}"
RESYNC_SECONDS = float(os.environ.get("RFT_RESYNC_SECONDS", "60"))
SYNC_WAIT_LOG_SECONDS = 10.0  # how often startup says it still waits for a first listing


@dataclass
class Memo:
    """kopf's operator memo (`kopf.operator(memo=...)`): what the handlers share. kopf hands
    each object's handlers a shallow copy, so what startup sets is seen by all of them."""

    namespaces: list[str] = field(default_factory=list)  # served (empty: all), set by __main__
    controller: Controller | None = None
    stores: dict[str, Store] = field(default_factory=dict)  # the children's, by kind
    informers: list[Informer] = field(default_factory=list)
    resync: asyncio.Task | None = None
    kueue_discovery: asyncio.Task | None = None  # while Kueue's API is not served


def _one(index: kopf.Index, key: Key) -> Any:
    store = index.get(key)
    return next(iter(store), None) if store else None


# ---------------------------------------------------------------- the jobs


# An `async def` indexer although it does no I/O: kopf runs plain functions in the default
# thread pool, where each event would queue behind our API writes.
@kopf.index(*JOB)
async def rftjobs_by_key(namespace: str, name: str, body: kopf.Body, **_: Any) -> dict:
    return {(namespace, name): copy.deepcopy(dict(body))}


@kopf.on.event(*JOB)
async def on_rftjob_event(namespace: str, name: str, body: kopf.Body, memo: Memo, **_: Any) -> None:
    # A job the operator has not written a status for yet waits behind the jobs in flight.
    memo.controller.queue.add((namespace, name), later=is_new(body))


# ---------------------------------------------------------------- the children


def on_child_event(ctl: Controller, is_pod: bool):
    def on_change(key: Key, type_: str | None) -> None:
        # Every pod event counts (its phase is the gang's state); a static child's ADDED is
        # our own create coming back (news only to a pass waiting for it), MODIFIED or
        # DELETED one to repair.
        if is_pod or type_ != "ADDED" or ctl.awaits_children(key):
            ctl.queue.add(key)
    return on_change


def kueue_installed(kube: Kube) -> bool:
    """Whether the API server serves Kueue's Workloads (discovery, which every
    authenticated client may read)."""
    found = kube.read_path(f"/apis/{queueing.API_VERSION}")
    return any(x.get("name") == "workloads" for x in (found or {}).get("resources") or [])


def workloads_forbidden(kube: Kube, namespaces: list[str]) -> str:
    """Why the operator may not list Workloads where it serves jobs ("" when it may): an
    informer that cannot list would hold up the start of every job's reconciling."""
    for ns in namespaces or [None]:
        path = f"/apis/{queueing.API_VERSION}" + (f"/namespaces/{ns}" if ns else "") + "/workloads"
        try:
            kube.request("GET", path, query={"limit": 1})
        except ApiException as e:
            if e.status == 403:
                return (f"Kueue is installed but the operator may not list its Workloads"
                        f"{' in ' + ns if ns else ''} (HTTP 403): grant it workloads get/list/watch/create/patch "
                        "and workloads/status patch (manifests/base/rbac.yaml)")
            raise
    return ""


def build_workload_informers(kube: Kube, ctl: Controller, namespaces: list[str],
                             stores: dict[str, Store]) -> list[Informer]:
    """Kueue's Workloads of our jobs (label-filtered like the children), into stores["Workload"]."""
    store = stores["Workload"] = Store(names.LABEL_JOB, lambda obj: obj)
    return [Informer("workloads" + (f"/{ns}" if ns else ""), kube.list_method("Workload", ns), CHILD_SELECTOR,
                     store, lambda key, _type: ctl.queue.add(key))
            for ns in namespaces or [None]]


def use_workloads(ctl: Controller, stores: dict[str, Store]) -> None:
    ctl.get_workloads = lambda key: stores["Workload"].get(key)
    log.info("Kueue %s found: jobs labelled %s are queued by it", queueing.API_VERSION, queueing.LABEL_QUEUE_NAME)


async def _discover_kueue(kube: Kube, ctl: Controller, memo: Memo, jobs: kopf.Index) -> None:
    """Kueue installed after the operator started: look again every resync; once its API is
    served, watch the Workloads and revisit every job."""
    while True:
        await asyncio.sleep(RESYNC_SECONDS)
        try:
            if not await asyncio.to_thread(kueue_installed, kube):
                continue
            blocked = await asyncio.to_thread(workloads_forbidden, kube, memo.namespaces)
        except Exception as e:  # the API server restarting, say: try again next time
            log.warning("looking for Kueue's API: %s", e)
            continue
        if blocked:
            ctl.kueue_blocked = blocked
            log.error("%s; jobs that name a queue are not reconciled until then (restart the operator)", blocked)
            return
        informers = build_workload_informers(kube, ctl, memo.namespaces, memo.stores)
        for informer in informers:
            informer.start()
        memo.informers.extend(informers)
        await wait_synced(informers)
        use_workloads(ctl, memo.stores)
        for key in list(jobs):
            ctl.queue.add(key)
        return


def build_informers(kube: Kube, ctl: Controller, namespaces: list[str],
                    stores: dict[str, Store], kueue: bool = False) -> list[Informer]:
    """One informer per child kind and namespace (one for all namespaces when none), each
    kind's into its store in `stores`; Kueue's Workloads too where it is installed."""
    out = build_workload_informers(kube, ctl, namespaces, stores) if kueue else []
    for kind in ["Pod", *(k for _, k in CHILD_KINDS.values())]:
        is_pod = kind == "Pod"
        view = PodView.from_pod if is_pod else (lambda obj, k=kind: ChildView.from_object(k, obj))
        store = stores[kind] = Store(names.LABEL_JOB, view)
        for ns in namespaces or [None]:
            out.append(Informer(f"{kind.lower()}s" + (f"/{ns}" if ns else ""), kube.list_method(kind, ns),
                                CHILD_SELECTOR, store, on_child_event(ctl, is_pod)))
    return out


# ---------------------------------------------------------------- lifecycle


class NoDiffBase(kopf.DiffBaseStorage):
    """We register no change handlers, so kopf's per-event "essence" (a deep copy of the
    whole object, managedFields included) is never used; skipping it halved the
    operator's CPU per pod event in bench/reconcile.py."""

    def build(self, *, body: kopf.Body, extra_fields: Any = None) -> kopf.BodyEssence:
        return kopf.BodyEssence()

    def fetch(self, *, body: kopf.Body) -> None:
        return None

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: kopf.BodyEssence) -> None:
        return None


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: Memo, rftjobs_by_key: kopf.Index, **_: Any) -> None:
    settings.peering.standalone = True  # no kopf peering: one leader by Lease (leader.py)
    settings.persistence.diffbase_storage = NoDiffBase()
    settings.posting.enabled = False  # we post our own, fewer, events
    # No runtime discovery of CRDs and namespaces: the operator's RBAC grants neither (kopf
    # logged "customresourcedefinitions ... forbidden" errors on every start), and the
    # resources it serves exist before it starts (the CRD is installed first).
    settings.scanning.disabled = True
    settings.watching.server_timeout = 300
    load_config()
    # Passes mostly wait on the API server (a Role's create takes 0.3-0.5 s under load), so
    # more of them than cores: 16 left new jobs queued behind the RBAC writes of others.
    workers = int(os.environ.get("RFT_WORKERS", "48"))
    kube = Kube(connections=write_threads(workers))
    stores = memo.stores

    def get_job(key: Key) -> dict | None:  # the index is a live view kopf keeps filled
        return _one(rftjobs_by_key, key)

    def get_children(key: Key) -> list[ChildView]:
        return [x for kind, store in stores.items() if kind not in ("Pod", "Workload") for x in store.get(key)]

    # Kueue is optional: where its API is served, jobs that name a LocalQueue get a Workload
    # (`queueing.py`) and the operator watches them; installed later, it is found later.
    kueue = await asyncio.to_thread(kueue_installed, kube)
    ctl = memo.controller = Controller(kube, get_job, lambda key: stores["Pod"].get(key), get_children,
                                       workers=workers)
    if kueue:
        ctl.kueue_blocked = await asyncio.to_thread(workloads_forbidden, kube, memo.namespaces)
        if ctl.kueue_blocked:
            log.error("%s; jobs that name a queue are not reconciled until then (restart the operator)",
                      ctl.kueue_blocked)
            kueue = False
    informers = memo.informers = build_informers(kube, ctl, memo.namespaces, stores, kueue)
    if kueue:
        use_workloads(ctl, stores)
    elif not ctl.kueue_blocked:
        log.info("Kueue %s: not installed (looked for again every %.0fs); a job that names a queue waits "
                 "in Pending and says so", queueing.API_VERSION, RESYNC_SECONDS)
        memo.kueue_discovery = asyncio.create_task(_discover_kueue(kube, ctl, memo, rftjobs_by_key))
    for informer in informers:
        informer.start()
    # A pass before the children are listed would take a running gang's pods for lost ones.
    while True:
        try:
            await asyncio.wait_for(wait_synced(informers), SYNC_WAIT_LOG_SECONDS)
            break
        except asyncio.TimeoutError:
            log.warning("still waiting for the first listing of %s",
                        ", ".join(i.name for i in informers if not i.synced.is_set()))
    ctl.start()
    memo.resync = asyncio.create_task(_resync(ctl, rftjobs_by_key))
    log.info("rftjob-operator started")


async def _resync(ctl: Controller, jobs: kopf.Index) -> None:
    """Level-triggered safety net: revisit every job periodically even without events."""
    while True:
        await asyncio.sleep(RESYNC_SECONDS)
        for key in list(jobs):
            ctl.queue.add(key, later=True)


@kopf.on.cleanup()
async def cleanup(memo: Memo, **_: Any) -> None:
    for task in (memo.resync, memo.kueue_discovery):
        if task is not None:
            task.cancel()
    for informer in memo.informers:
        informer.stop()
    ctl = memo.controller
    if ctl:
        await ctl.stop()
        log.info("rftjob-operator stopped: reconciles=%d api_writes=%d errors=%d write_seconds=%.1f (%s)",
                 ctl.reconciles, ctl.kube.requests, ctl.errors, ctl.kube.seconds,
                 ", ".join(f"{k} {n}" for k, n in sorted(ctl.kube.counts.items())))


@kopf.on.probe(id="queue")
def queue_depth(memo: Memo, **_: Any) -> int:
    return len(memo.controller.queue) if memo.controller else 0
