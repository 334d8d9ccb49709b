"""The controller loop: a deduplicating work queue of RFTJob keys, fed by watch events,
drained by a few workers that run the pure reconcile and apply its plan.

Why not kopf's on.create/on.update/daemon handlers: change handlers chain logic through
events (a missed one leaves a job stuck), and daemons/timers require a finalizer on every
RFTJob (deletion would hang while the operator is down). Watch events only *enqueue*; the
reconcile always reads the current level from kopf's watch-fed indexes.
"""

from __future__ import annotations

import asyncio
import logging
import random
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from typing import Any, Callable, Hashable, Iterable

from kubernetes.client.rest import ApiException

from . import reconcile as rc
from .kube import Conflict, Kube
from .metrics import OperatorMetrics

log = logging.getLogger("rft_operator")
Key = tuple[str, str]  # (namespace, name)


class WorkQueue:
    """client-go semantics: a key is queued at most once, and never processed by two
    workers at the same time; a key added while being processed is re-queued after."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[Hashable] = asyncio.Queue()
        self._dirty: set[Hashable] = set()
        self._processing: set[Hashable] = set()
        self._timers: dict[Hashable, asyncio.TimerHandle] = {}

    def add(self, key: Hashable) -> None:
        if key in self._dirty:
            return
        self._dirty.add(key)
        if key not in self._processing:
            self._queue.put_nowait(key)

    def add_after(self, key: Hashable, delay: float) -> None:
        """Schedule `key`; an earlier pending schedule for the same key wins."""
        loop = asyncio.get_running_loop()
        due = loop.time() + delay
        old = self._timers.get(key)
        if old is not None and not old.cancelled() and old.when() <= due:
            return
        if old is not None:
            old.cancel()
        self._timers[key] = loop.call_at(due, self._fire, key)

    def _fire(self, key: Hashable) -> None:
        self._timers.pop(key, None)
        self.add(key)

    async def get(self) -> Hashable:
        key = await self._queue.get()
        self._dirty.discard(key)
        self._processing.add(key)
        return key

    def done(self, key: Hashable) -> None:
        self._processing.discard(key)
        if key in self._dirty:
            self._queue.put_nowait(key)

    def __len__(self) -> int:
        return self._queue.qsize()


class Controller:
    """Reads jobs and children from index lookups, writes through `Kube`."""

    def __init__(
        self,
        kube: Kube,
        get_job: Callable[[Key], dict[str, Any] | None],
        get_pods: Callable[[Key], Iterable[rc.PodView]],
        get_children: Callable[[Key], Iterable[tuple[str, str, str]]],
        workers: int = 4,
        clock: Callable[[], datetime] = lambda: datetime.now(timezone.utc),
        metrics: OperatorMetrics | None = None,
    ):
        self.kube, self.clock = kube, clock
        self.metrics = metrics or OperatorMetrics()
        self.metrics.track_writes(kube)
        self.get_job, self.get_pods, self.get_children = get_job, get_pods, get_children
        self.queue = WorkQueue()
        self.num_workers = workers
        self._tasks: list[asyncio.Task] = []
        # API writes get threads of their own, apart from kopf's default executor.
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rft-apply")
        # Status writes not yet seen by our watch: key -> resourceVersion we wrote over.
        # A reconcile that still sees that version would act on stale state, so it waits.
        self._stale_rv: dict[Key, str] = {}
        self._failures: dict[Key, int] = {}
        self.reconciles = 0
        self.errors = 0

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._worker(i)) for i in range(self.num_workers)]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _worker(self, n: int) -> None:
        while True:
            key = await self.queue.get()
            try:
                await self.sync(key)
                self._failures.pop(key, None)
            except Exception as e:  # keep the worker alive; retry with backoff
                self.errors += 1
                self.metrics.reconcile_errors.inc()
                tries = self._failures[key] = self._failures.get(key, 0) + 1
                delay = min(60.0, 0.5 * 2 ** min(tries, 7)) * (0.5 + random.random() / 2)
                log.error("reconcile %s/%s failed (%s); retry in %.1fs", *key, _describe(e), delay)
                self.queue.add_after(key, delay)
            finally:
                self.queue.done(key)

    async def sync(self, key: Key) -> None:
        body = self.get_job(key)
        self.metrics.observe_job(key, body)
        if body is None:  # deleted: children go with the garbage collector
            self._stale_rv.pop(key, None)
            return
        rv = body["metadata"].get("resourceVersion")
        if self._stale_rv.get(key) == rv:
            log.debug("%s/%s: waiting for our status write to reach the watch", *key)
            return  # our last status write has not reached the watch yet; its event requeues
        self._stale_rv.pop(key, None)
        with self.metrics.reconcile_seconds.time():
            await self._reconcile(key, body)

    async def _reconcile(self, key: Key, body: dict[str, Any]) -> None:
        observed = rc.Observed(
            pods=list(self.get_pods(key)),
            children={(kind, name): h for kind, name, h in self.get_children(key)},
        )
        plan = rc.reconcile(body, observed, self.clock())
        self.reconciles += 1
        self.metrics.reconciles.inc()
        log.debug("%s/%s: %d pods seen, phase %s -> %s, %d creates, %d deletes", *key,
                  len(observed.pods), (body.get("status") or {}).get("phase"),
                  plan.status.get("phase"), len(plan.create), len(plan.delete_pods))
        await asyncio.get_running_loop().run_in_executor(self._pool, self._apply, key, body, plan)
        if plan.requeue_after is not None:
            self.queue.add_after(key, plan.requeue_after + 0.1)

    def _apply(self, key: Key, body: dict[str, Any], plan: rc.Plan) -> None:
        ns, name = key
        if plan.status_changed:
            old_rv = body["metadata"]["resourceVersion"]
            try:
                new_rv = self.kube.patch_status(ns, name, plan.status, old_rv)
            except Conflict:
                log.info("status of %s/%s changed meanwhile; will reconcile again", ns, name)
                return  # the watch event of that change requeues the key
            if new_rv != old_rv:  # a no-op patch makes no watch event: nothing to wait for
                self._stale_rv[key] = old_rv
            if plan.status.get("phase") != (body.get("status") or {}).get("phase"):
                log.info("%s/%s: %s (%s)", ns, name, plan.status.get("phase"), plan.status.get("message"))
        for ev in plan.events:
            self.kube.post_event(body, ev.type, ev.reason, ev.message)
        for obj in plan.create:
            self._create(body, obj)
        for obj in plan.replace:
            self.kube.replace(obj)
        for pod in plan.delete_pods:
            self.kube.delete_pod(ns, pod)

    def _create(self, body: dict[str, Any], obj: dict[str, Any]) -> None:
        try:
            self.kube.create(obj)
        except ApiException as e:
            what = f"{obj['kind']} {obj['metadata']['name']}"
            self.kube.post_event(body, "Warning", "CreateFailed", f"creating {what}: {_describe(e)}")
            raise


def _describe(e: Exception) -> str:
    if isinstance(e, ApiException):
        return f"HTTP {e.status} {e.reason}"
    return f"{type(e).__name__}: {e}"

