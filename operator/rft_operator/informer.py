"""Watch-fed caches of the children (pods and the static kinds), like client-go's
informers: list, then watch from the list's resourceVersion, list again when the watch
says it is too old (410 Gone); every event updates the cache and names the job to
reconcile.

Why not kopf's indexes for these: every child event went through kopf's per-object
machinery twice (the indexer and the `on.event` handler that enqueued the job: causes,
kwargs, handler state, per-object workers and timers), about 0.5 ms of CPU an event on
this 2-core machine, several events per pod; here an event costs its JSON decoding and a
dict update. kopf still serves the RFTJobs themselves, the startup and the probes.

Each `Informer` runs its list/watch loop in a daemon thread (the kubernetes client
streams blocking) and hands decoded events to the event loop, which alone touches the
cache, so readers on the loop (the controller's passes) never see it half-updated. The
controller starts once every informer has listed once (`wait_synced`): before that a
pass would take a missing pod of a running gang for a lost one.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from typing import Any, Callable, Hashable, Iterable

from kubernetes.client.rest import ApiException
from kubernetes.watch.watch import iter_resp_lines

from rft_contract import names

from .model import Obj

log = logging.getLogger("rft_operator")
Key = tuple[str, str]  # (namespace, job name)

# Server-side filtering: only our jobs' children (and Workloads) travel over the watch streams.
CHILD_SELECTOR = f"{names.LABEL_JOB},{names.LABEL_MANAGED_BY}={names.MANAGED_BY}"
WATCH_TIMEOUT_SECONDS = 300  # the server ends a watch after this; the loop resumes it
RETRY_SECONDS = 1.0  # after a failed list or watch (the API server restarting, say)


class Store:
    """The cache of one kind: views of the objects by the job they carry in `label`.
    Only the event loop calls its methods."""

    def __init__(self, label: str, view: Callable[[Obj], Any]):
        self.label, self.view = label, view
        self.by_job: dict[Key, dict[str, Any]] = {}
        self._job_of: dict[tuple[str, str], Key] = {}  # (namespace, name) -> its job

    def get(self, key: Key) -> list[Any]:
        return list((self.by_job.get(key) or {}).values())

    def apply(self, type_: str, obj: Obj) -> set[Key]:
        """One watch event (ADDED, MODIFIED, DELETED); the jobs it concerns (the old one
        too when the object changed jobs)."""
        meta = obj["metadata"]
        ref = (meta["namespace"], meta["name"])
        old = self._remove(ref)
        touched = {old} if old else set()
        if type_ != "DELETED":
            touched.add(self._put(ref, obj))
        return touched

    def replace(self, objs: Iterable[Obj]) -> set[Key]:
        """A full listing: the cache becomes exactly it; every job before or after."""
        touched = set(self.by_job)
        self.by_job, self._job_of = {}, {}
        for obj in objs:
            meta = obj["metadata"]
            touched.add(self._put((meta["namespace"], meta["name"]), obj))
        return touched

    def _put(self, ref: tuple[str, str], obj: Obj) -> Key:
        key = (ref[0], (obj["metadata"].get("labels") or {}).get(self.label, ""))
        self.by_job.setdefault(key, {})[ref[1]] = self.view(obj)
        self._job_of[ref] = key
        return key

    def _remove(self, ref: tuple[str, str]) -> Key | None:
        key = self._job_of.pop(ref, None)
        if key is not None:
            bucket = self.by_job.get(key) or {}
            bucket.pop(ref[1], None)
            if not bucket:
                self.by_job.pop(key, None)
        return key


class Informer:
    """List and watch one kind (label-filtered, one namespace or all) into a `Store`,
    calling `on_change(key, type)` on the event loop for every job an event concerns
    (type: ADDED, MODIFIED, DELETED, or None for a full listing).

    `list_fn(**kwargs)` is a kubernetes client list method bound to its namespace (or the
    all-namespaces one); it is called with `_preload_content=False` and, for the watch,
    `watch=True`, `resource_version`, `allow_watch_bookmarks`, `timeout_seconds`."""

    def __init__(self, name: str, list_fn: Callable[..., Any], label_selector: str, store: Store,
                 on_change: Callable[[Hashable, str | None], None]):
        self.name, self.list_fn, self.selector = name, list_fn, label_selector
        self.store, self.on_change = store, on_change
        self.synced = asyncio.Event()
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name=f"informer-{self.name}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    # ---------------------------------------------------------------- the loop's side

    def _replace(self, items: list[Obj]) -> None:
        for key in self.store.replace(items):
            self.on_change(key, None)
        self.synced.set()

    def _apply(self, events: list[tuple[str, Obj]]) -> None:
        for type_, obj in events:
            for key in self.store.apply(type_, obj):
                self.on_change(key, type_)

    # ---------------------------------------------------------------- the thread's side

    def _run(self) -> None:
        rv: str | None = None
        while not self._stop.is_set():
            try:
                if rv is None:
                    rv = self._list()
                rv = self._watch(rv)
            except ApiException as e:
                log.warning("%s: list/watch failed (HTTP %s %s); again in %.0fs", self.name, e.status, e.reason,
                            RETRY_SECONDS)
                rv = None if e.status == 410 else rv
                self._stop.wait(RETRY_SECONDS)
            except Exception as e:  # connection reset, a timeout: resume from rv
                log.warning("%s: watch interrupted (%s: %s); resuming", self.name, type(e).__name__, e)
                self._stop.wait(RETRY_SECONDS)

    def _list(self) -> str:
        listing = json.loads(self.list_fn(label_selector=self.selector, _preload_content=False).data)
        self._call(self._replace, listing.get("items") or [])
        return listing["metadata"]["resourceVersion"]

    def _watch(self, rv: str) -> str | None:
        """Stream events from `rv` until the server ends the watch; the resourceVersion to
        resume from, or None when it is too old (list again)."""
        resp = self.list_fn(label_selector=self.selector, watch=True, resource_version=rv,
                            allow_watch_bookmarks=True, timeout_seconds=WATCH_TIMEOUT_SECONDS,
                            _preload_content=False)
        try:
            for line in iter_resp_lines(resp):
                if self._stop.is_set():
                    break
                if not line.strip():
                    continue
                event = json.loads(line)
                type_, obj = event.get("type"), event.get("object") or {}
                if type_ == "ERROR":
                    if obj.get("code") == 410:  # compacted: what we missed is gone, list again
                        return None
                    raise RuntimeError(f"watch error {obj.get('code')}: {obj.get('message')}")
                rv = obj["metadata"]["resourceVersion"]
                if type_ in ("ADDED", "MODIFIED", "DELETED"):
                    self._call(self._apply, [(type_, obj)])
        finally:
            resp.close()  # a watch ended early has unread bytes: no reuse of its connection
        return rv

    def _call(self, fn: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(fn, *args)


async def wait_synced(informers: Iterable[Informer]) -> None:
    await asyncio.gather(*(i.synced.wait() for i in informers))
