"""Kueue's discovery, for the operator that serves jobs with or without it: whether its
Workloads are served (API discovery, which every authenticated client may read), whether
the operator may list them (a 403 said in words, naming the RBAC to grant), their
informers, and looking again every resync for a Kueue installed after the operator
started. What the reconcile does with a job's Workload is queueing.py's.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from kubernetes.client.rest import ApiException

from rft_contract import names

from . import queueing
from .controller import Controller
from .informer import CHILD_SELECTOR, Informer, Store, wait_synced
from .kube import Kube

log = logging.getLogger("rft_operator")


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


async def discover(kube: Kube, ctl: Controller, namespaces: list[str]) -> bool:
    """At start: whether Kueue's Workloads are served and the operator may list them. When
    it may not, `ctl.kueue_blocked` says why (jobs that name a queue say it too)."""
    if not await asyncio.to_thread(kueue_installed, kube):
        return False
    ctl.kueue_blocked = await asyncio.to_thread(workloads_forbidden, kube, namespaces)
    if ctl.kueue_blocked:
        log.error("%s; jobs that name a queue are not reconciled until then (restart the operator)", ctl.kueue_blocked)
        return False
    return True


async def watch_for(kube: Kube, ctl: Controller, memo: Any, jobs: Any) -> None:
    """Kueue installed after the operator started: look again every resync
    (`memo.resync_seconds`); once its API is served, watch the Workloads (into
    `memo.informers` and `memo.stores`) and revisit every job in `jobs`."""
    log.info("Kueue %s: not installed (looked for again every %.0fs); a job that names a queue waits "
             "in Pending and says so", queueing.API_VERSION, memo.resync_seconds)
    while True:
        await asyncio.sleep(memo.resync_seconds)
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
