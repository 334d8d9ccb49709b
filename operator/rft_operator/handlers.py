"""kopf wiring: watch-fed indexes (the read cache) and event handlers that only enqueue.

Nothing here decides anything: `reconcile.py` does, `controller.py` schedules it.
No change handlers, daemons or timers, so kopf adds no finalizers or annotations to
RFTJobs: deleting a job never waits for the operator.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import os
from typing import Any

import kopf

from rft_contract import names as c
from .controller import Controller, Key
from .kube import Kube, load_config
from .model import ChildView, PodView

log = logging.getLogger("rft_operator")

CHILD_KINDS = {  # plural -> (group/version, kind)
    "configmaps": ("v1", "ConfigMap"),
    "services": ("v1", "Service"),
    "serviceaccounts": ("v1", "ServiceAccount"),
    "roles": ("rbac.authorization.k8s.io/v1", "Role"),
    "rolebindings": ("rbac.authorization.k8s.io/v1", "RoleBinding"),
}
JOB = (c.GROUP, c.VERSION, c.PLURAL)
OURS = {c.LABEL_JOB: kopf.PRESENT, c.LABEL_MANAGED_BY: c.MANAGED_BY}
RESYNC_SECONDS = float(os.environ.get("RFT_RESYNC_SECONDS", "60"))

_state: dict[str, Any] = {}  # the controller and the index views, set once at startup


def _one(index: kopf.Index, key: Key) -> Any:
    store = index.get(key)
    return next(iter(store), None) if store else None


# ---------------------------------------------------------------- indexes


# Indexers are `async def` although they do no I/O: kopf runs plain functions in the
# default thread pool, where each pod event would queue behind our API writes.
@kopf.index(*JOB)
async def rftjobs_by_key(namespace: str, name: str, body: kopf.Body, **_: Any) -> dict:
    return {(namespace, name): copy.deepcopy(dict(body))}


@kopf.index("pods", labels=OURS)
async def pods_by_job(namespace: str, labels: kopf.Labels, body: kopf.Body, **_: Any) -> dict:
    return {(namespace, labels[c.LABEL_JOB]): PodView.from_pod(dict(body))}


def _child_indexer(plural: str):
    kind = CHILD_KINDS[plural][1]

    # The view carries the controller's uid (the label alone does not make a child ours)
    # and the live fields the operator manages (to see hand edits).
    async def index(namespace: str, labels: kopf.Labels, body: kopf.Body, **_: Any) -> dict:
        return {(namespace, labels[c.LABEL_JOB]): ChildView.from_object(kind, dict(body))}

    index.__name__ = f"{plural}_by_job"
    return index


for _plural in CHILD_KINDS:
    _group_version = CHILD_KINDS[_plural][0]
    _group = _group_version.split("/")[0] if "/" in _group_version else ""
    _version = _group_version.split("/")[-1]
    kopf.index(_group, _version, _plural, labels=OURS, id=f"{_plural}_by_job")(_child_indexer(_plural))


# ---------------------------------------------------------------- events -> queue


def _remember_indexes(kwargs: dict[str, Any]) -> None:
    """Index views arrive as handler kwargs; keep live references for the workers."""
    if "indexes" not in _state:
        _state["indexes"] = {k: v for k, v in kwargs.items() if k.endswith("_by_job") or k == "rftjobs_by_key"}


@kopf.on.event(*JOB)
async def on_rftjob_event(namespace: str, name: str, body: kopf.Body, **kwargs: Any) -> None:
    _remember_indexes(kwargs)
    # A job the operator has not written a status for yet waits behind the jobs in flight
    # (`WorkQueue`): creating its children must not delay their status passes.
    _state["controller"].queue.add((namespace, name), later=not (body.get("status") or {}).get("phase"))


@kopf.on.event("pods", labels=OURS)
async def on_pod_event(namespace: str, labels: kopf.Labels, **kwargs: Any) -> None:
    _remember_indexes(kwargs)
    _state["controller"].queue.add((namespace, labels[c.LABEL_JOB]))


def _child_event(plural: str):
    async def handler(namespace: str, labels: kopf.Labels, type: str | None, **kwargs: Any) -> None:
        _remember_indexes(kwargs)
        if type == "DELETED" or type == "MODIFIED":  # repair deleted or edited children
            _state["controller"].queue.add((namespace, labels[c.LABEL_JOB]))

    handler.__name__ = f"on_{plural}_event"
    return handler


for _plural, (_gv, _kind) in CHILD_KINDS.items():
    _group = _gv.split("/")[0] if "/" in _gv else ""
    kopf.on.event(_group, _gv.split("/")[-1], _plural, labels=OURS, id=f"on_{_plural}_event")(_child_event(_plural))


# ---------------------------------------------------------------- lifecycle


def _get_job(key: Key) -> dict | None:
    idx = _state.get("indexes", {})
    return _one(idx["rftjobs_by_key"], key) if idx else None


def _get_pods(key: Key) -> list[PodView]:
    idx = _state.get("indexes", {})
    return list(idx["pods_by_job"].get(key, [])) if idx else []


def _get_children(key: Key) -> list[ChildView]:
    idx = _state.get("indexes", {})
    out: list[ChildView] = []
    for plural in CHILD_KINDS:
        out += list(idx.get(f"{plural}_by_job", {}).get(key, []))
    return out


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
async def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.peering.standalone = True  # one replica; the Deployment uses Recreate
    settings.persistence.diffbase_storage = NoDiffBase()
    settings.posting.enabled = False  # we post our own, fewer, events
    # No runtime discovery of CRDs and namespaces: the operator's RBAC grants neither (kopf
    # logged "customresourcedefinitions ... forbidden" errors on every start), and the
    # resources it serves exist before it starts (the CRD is installed first).
    settings.scanning.disabled = True
    settings.watching.server_timeout = 300
    # Server-side filtering: only our children travel over the watch streams.
    for plural in ["pods", *CHILD_KINDS]:
        settings.watching.label_selectors[plural] = f"{c.LABEL_JOB},{c.LABEL_MANAGED_BY}={c.MANAGED_BY}"
    load_config()
    workers = int(os.environ.get("RFT_WORKERS", "16"))
    ctl = Controller(Kube(connections=workers), _get_job, _get_pods, _get_children, workers=workers)
    _state["controller"] = ctl
    ctl.start()
    _state["resync"] = asyncio.create_task(_resync(ctl))
    log.info("rftjob-operator started")


async def _resync(ctl: Controller) -> None:
    """Level-triggered safety net: revisit every job periodically even without events."""
    while True:
        await asyncio.sleep(RESYNC_SECONDS)
        jobs = _state.get("indexes", {}).get("rftjobs_by_key")
        for key in list(jobs or []):
            ctl.queue.add(key, later=True)


@kopf.on.cleanup()
async def cleanup(**_: Any) -> None:
    if "resync" in _state:
        _state["resync"].cancel()
    ctl = _state.get("controller")
    if ctl:
        await ctl.stop()
        log.info("rftjob-operator stopped: reconciles=%d api_writes=%d errors=%d write_seconds=%.1f",
                 ctl.reconciles, ctl.kube.requests, ctl.errors, ctl.kube.seconds)


@kopf.on.probe(id="queue")
def queue_depth(**_: Any) -> int:
    ctl = _state.get("controller")
    return len(ctl.queue) if ctl else 0


def controller() -> Controller | None:
    return _state.get("controller")
