"""kopf wiring: the RFTJobs' watch-fed index and the event handler that only enqueues,
the children's informers (`informer.py`), startup and cleanup. Kueue's discovery and the
diagnosis of a Workloads 403 are kueuewatch.py's. What they share lives in
kopf's operator memo (`Memo`), none of it at module level.

Nothing here decides anything: `reconcile.py` does, `controller.py` schedules it.
No change handlers, daemons or timers, so kopf adds no finalizers or annotations to
RFTJobs: deleting a job never waits for the operator.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import kopf

from rft_contract import names
from .controller import Controller, Key, write_threads
from .workqueue import is_new
from .informer import CHILD_SELECTOR, Informer, Store, wait_synced
from .kube import Kube, load_config
from .model import ChildView, PodView
from . import kueuewatch

log = logging.getLogger("rft_operator")

CHILD_KINDS = {  # plural -> (group/version, kind)
    "configmaps": ("v1", "ConfigMap"),
    "services": ("v1", "Service"),
    "serviceaccounts": ("v1", "ServiceAccount"),
    "roles": ("rbac.authorization.k8s.io/v1", "Role"),
    "rolebindings": ("rbac.authorization.k8s.io/v1", "RoleBinding"),
}
JOB = (names.GROUP, names.VERSION, names.PLURAL)
SYNC_WAIT_LOG_SECONDS = 10.0  # how often startup says it still waits for a first listing


# Memo field <- (variable, parse, what it must be, the test of it).
_ENV_SETTINGS = {
    "resync_seconds": ("RFT_RESYNC_SECONDS", float, "a number of seconds", "a finite number above 0",
                       lambda v: math.isfinite(v) and v > 0),
    "workers": ("RFT_WORKERS", int, "an integer", "at least 1", lambda v: v >= 1),
}


def settings_from_env(env: Mapping[str, str]) -> dict[str, Any]:
    """Memo's knobs from the environment, read once at start; a bad value names its variable."""
    out: dict[str, Any] = {}
    for key, (var, parse, kind, bound, ok) in _ENV_SETTINGS.items():
        if not (value := env.get(var)):
            continue
        try:
            parsed = parse(value)
        except ValueError:
            raise ValueError(f"{var}={value!r}: expected {kind}") from None
        if not ok(parsed):
            raise ValueError(f"{var}={value!r}: must be {bound}")
        out[key] = parsed
    return out


@dataclass
class Memo:
    """kopf's operator memo (`kopf.operator(memo=...)`): what the handlers share. kopf hands
    each object's handlers a shallow copy, so what startup sets is seen by all of them."""

    namespaces: list[str] = field(default_factory=list)  # served (empty: all), set by __main__
    # Set by __main__ from RFT_RESYNC_SECONDS and RFT_WORKERS, read once (`settings_from_env`).
    resync_seconds: float = 60.0  # every job is revisited this often; Kueue looked for again
    workers: int = 48  # reconcile passes at once (controller.py)
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


def build_informers(kube: Kube, ctl: Controller, namespaces: list[str],
                    stores: dict[str, Store], kueue: bool = False) -> list[Informer]:
    """One informer per child kind and namespace (one for all namespaces when none), each
    kind's into its store in `stores`; Kueue's Workloads too where it is installed."""
    out = kueuewatch.build_workload_informers(kube, ctl, namespaces, stores) if kueue else []
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
    kube = Kube(connections=write_threads(memo.workers))
    stores = memo.stores

    def get_job(key: Key) -> dict | None:  # the index is a live view kopf keeps filled
        return _one(rftjobs_by_key, key)

    def get_children(key: Key) -> list[ChildView]:
        return [x for kind, store in stores.items() if kind not in ("Pod", "Workload") for x in store.get(key)]

    ctl = memo.controller = Controller(kube, get_job, lambda key: stores["Pod"].get(key), get_children,
                                       workers=memo.workers)
    # Kueue is optional (kueuewatch.py): where its API is served and readable, its Workloads
    # are watched from the start; else it is looked for again every resync.
    kueue = await kueuewatch.discover(kube, ctl, memo.namespaces)
    informers = memo.informers = build_informers(kube, ctl, memo.namespaces, stores, kueue)
    if kueue:
        kueuewatch.use_workloads(ctl, stores)
    elif not ctl.kueue_blocked:
        memo.kueue_discovery = asyncio.create_task(kueuewatch.watch_for(kube, ctl, memo, rftjobs_by_key))
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
    memo.resync = asyncio.create_task(_resync(ctl, rftjobs_by_key, memo.resync_seconds))
    log.info("rftjob-operator started")


async def _resync(ctl: Controller, jobs: kopf.Index, seconds: float) -> None:
    """Level-triggered safety net: revisit every job periodically even without events."""
    while True:
        await asyncio.sleep(seconds)
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
