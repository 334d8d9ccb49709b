"""The controller loop: RFTJob keys fed by watch events into the work queue (`workqueue.py`),
drained by a few workers that run the pure reconcile and apply its plan.

Why not kopf's on.create/on.update/daemon handlers: change handlers chain logic through
events (a missed one leaves a job stuck), and daemons/timers require a finalizer on every
RFTJob (deletion would hang while the operator is down). Watch events only *enqueue*; the
reconcile always reads the current level: the RFTJob from kopf's index, its children from
the informers' stores (`informer.py`).

Errors: what a retry may fix (5xx, 429, timeouts, a 403 from a webhook that may be down)
is retried with backoff. What it cannot, a child the API server refuses as invalid (422)
or beyond the namespace's Pod Security level (403 "violates PodSecurity"), or a child's
name taken by an object this job does not control (409 on create, and the object's
controller is not this job), is remembered for the job's generation and handed
to the pure reconcile (`Observed.refusal`), which fails the job.

Nodes: only for trainer pods stuck terminating past their deadline (rare) does a pass GET
their Nodes (no node watch), so the gang can tell whether a force delete is safe
(`Observed.nodes`); a Node it may not read (403: the namespaced install) is unknown.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from datetime import datetime, timezone
from typing import Any, Callable, Iterable
from urllib.parse import quote

import urllib3
from kubernetes.client.rest import ApiException

from rft_contract import names

from . import drift, queueing, terminating
from . import reconcile as rc
from .kube import Conflict, Kube, api_message
from .metrics import OperatorMetrics
from .model import ChildView, PodView, Refusal, controller_uid, managed_fields
from .workqueue import WorkQueue, is_new, kept_workers

log = logging.getLogger("rft_operator")
# Consecutive failed passes of one job before its log line is an error (about 1.5 minutes of backoff).
RETRIES_BEFORE_ERROR = 8
Key = tuple[str, str]  # (namespace, name)


def write_threads(workers: int) -> int:
    """Threads of the write pool (and API connections) for `workers` workers."""
    return min(MAX_WRITES_IN_FLIGHT, WRITES_PER_WORKER * workers)


class Refused(Exception):
    """A write the API server will never accept for this job as it stands."""

    def __init__(self, refusal: Refusal):
        super().__init__(refusal.message)
        self.refusal = refusal


class Retry(Exception):
    """Not now: come back after `delay` seconds (without counting as an error)."""

    def __init__(self, message: str, delay: float):
        super().__init__(message)
        self.delay = delay


# The steps of a pass's writes by kind (any other kind: 0). A pod waits for its
# ServiceAccount (admission refuses a pod whose account does not exist), the ConfigMap it
# mounts and the Service that names it, not for its Role: creating a Role or RoleBinding is
# the API server's slowest write (its escalation check; 0.5 s under load on 2 cores), and the
# pod's programs retry their first status writes. A RoleBinding waits for its Role: the API
# server reads the Role to check that the operator holds what it grants.
WRITE_STEPS = {"Pod": 1, "Role": 1, "RoleBinding": 2}
# How long a pass waits for children it created to show in the informers before it
# trusts what they show (`Controller._awaiting`).
EXPECT_SECONDS = 30.0
# Writes in flight per worker (`Controller._apply`: a step's writes side by side), and at
# most in all: what the API server is asked to do at once.
WRITES_PER_WORKER = 4
MAX_WRITES_IN_FLIGHT = 96
# A child still held by a deleted job of the same name: the garbage collector removes it soon.
PREVIOUS_OWNER_RETRY_SECONDS = 2.0
FLAVOR_TTL_SECONDS = 30.0  # how long a pass trusts a ResourceFlavor it read
STOP_WAIT_SECONDS = 10.0  # for writes in flight when the operator stops
WRITE_FAILED = {"creating": "CreateFailed", "patching": "PatchFailed"}  # event reasons


class Controller:
    """Reads jobs and children from index lookups, writes through `Kube`."""

    def __init__(
        self,
        kube: Kube,
        get_job: Callable[[Key], dict[str, Any] | None],
        get_pods: Callable[[Key], Iterable[PodView]],
        get_children: Callable[[Key], Iterable[ChildView]],
        workers: int = 4,
        clock: Callable[[], datetime] = lambda: datetime.now(timezone.utc),
        metrics: OperatorMetrics | None = None,
        get_workloads: Callable[[Key], Iterable[dict[str, Any]]] | None = None,
    ):
        self.kube, self.clock = kube, clock
        # Kueue's Workloads by job, where Kueue is installed (None: it is not); `queueing.py`.
        self.get_workloads = get_workloads
        # Kueue is served but its Workloads may not be listed (RBAC): jobs that name a queue
        # are left alone, with this said in the log, rather than run or stopped on a guess.
        self.kueue_blocked = ""
        self._flavors: dict[str, tuple[float, dict[str, Any] | None]] = {}  # name -> (read at, object)
        self.metrics = metrics or OperatorMetrics()
        self.metrics.track_writes(kube)
        self.get_job, self.get_pods, self.get_children = get_job, get_pods, get_children
        self.queue = WorkQueue()
        self.renders = rc.RenderCache()  # the last render of each job's spec
        self.num_workers = workers
        self._tasks: list[asyncio.Task] = []
        # API writes get threads of their own, apart from kopf's default executor: a few
        # per worker, since a pass writes a step's children side by side.
        self._pool = ThreadPoolExecutor(max_workers=write_threads(workers), thread_name_prefix="rft-apply")
        # Status writes not yet seen by our watch: key -> resourceVersion we wrote over.
        # A reconcile that still sees that version would act on stale state, so it waits.
        self._stale_rv: dict[Key, str] = {}
        self._failures: dict[Key, int] = {}
        # Refusals by job: (uid, generation, refusal); a new generation or job forgets it.
        self._refusals: dict[Key, tuple[str, Any, Refusal]] = {}
        # Children created and not shown by the informers yet: key -> (until, {(kind, name)}).
        self._expected: dict[Key, tuple[float, set[tuple[str, str]]]] = {}
        self._expected_lock = threading.Lock()  # creates run on the write pool
        self.reconciles = 0
        self.errors = 0

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._worker(i)) for i in range(self.num_workers)]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        # Writes already on their way finish before this returns (bounded): a replica that
        # hands the leader Lease over afterwards must have stopped writing first.
        try:
            await asyncio.wait_for(asyncio.to_thread(self._pool.shutdown, wait=True, cancel_futures=True),
                                   STOP_WAIT_SECONDS)
        except asyncio.TimeoutError:
            log.warning("stopping with API writes still in flight after %ss", STOP_WAIT_SECONDS)

    async def _worker(self, n: int) -> None:
        kept = n < kept_workers(self.num_workers)  # for jobs in flight (`WorkQueue`)
        while True:
            key = await self.queue.get(now_only=kept)
            try:
                await self.sync(key)
                self._failures.pop(key, None)
            except Exception as e:  # keep the worker alive; retry with backoff
                self.errors += 1
                self.metrics.reconcile_errors.inc()
                tries = self._failures[key] = self._failures.get(key, 0) + 1
                delay = min(60.0, 0.5 * 2 ** min(tries, 7)) * (0.5 + random.random() / 2)
                level = retry_level(tries, e)
                log.log(level, "reconcile %s/%s failed (%s, %d in a row); retry in %.1fs", *key,
                        describe_error(e), tries, delay, exc_info=not is_transient(e))
                self.queue.add_after(key, delay, later=is_new(self.get_job(key)))
            finally:
                self.queue.done(key)

    async def sync(self, key: Key) -> None:
        body = self.get_job(key)
        self.metrics.observe_job(key, body)
        if body is None:  # deleted: children go with the garbage collector
            self._stale_rv.pop(key, None)
            self._refusals.pop(key, None)
            self._expected.pop(key, None)
            self.renders.forget(*key)
            return
        rv = body["metadata"].get("resourceVersion")
        if self._stale_rv.get(key) == rv:
            log.debug("%s/%s: waiting for our status write to reach the watch", *key)
            return  # our last status write has not reached the watch yet; its event requeues
        self._stale_rv.pop(key, None)
        with self.metrics.reconcile_seconds.time():
            await self._reconcile(key, body)

    async def _reconcile(self, key: Key, body: dict[str, Any]) -> None:
        observed, now = self.observe(key, body), self.clock()
        if self._awaiting(key, observed):
            return
        if queueing.queue_name(body) and self.kueue_blocked:
            raise Retry(f"not reconciled: {self.kueue_blocked}", 60.0)  # never act on a guess of Kueue's decision
        if queueing.queue_name(body) and observed.kueue and (
                observed.workload is None or queueing.is_true(observed.workload, queueing.ADMITTED)):
            await asyncio.get_running_loop().run_in_executor(self._pool, self.read_kueue, body, observed)
        nodes = rc.nodes_to_read(body, observed, now)
        if nodes:
            observed.nodes = await asyncio.get_running_loop().run_in_executor(self._pool, self.read_nodes, nodes)
        plan = rc.reconcile(body, observed, now, self.renders)
        self.reconciles += 1
        self.metrics.reconciles.inc()
        log.debug("%s/%s: %d pods seen, phase %s -> %s, %d creates, %d deletes", *key,
                  len(observed.pods), (body.get("status") or {}).get("phase"),
                  plan.status.get("phase"), len(plan.create), len(plan.delete_pods))
        try:
            await self._apply(key, body, plan)
        except Refused as e:  # the next pass fails the job with it
            log.warning("%s/%s: %s", *key, e.refusal.message)
            meta = body["metadata"]
            self._refusals[key] = (meta.get("uid", ""), meta.get("generation"), e.refusal)
            self.queue.add(key)
            return
        except Retry as e:
            log.info("%s/%s: %s; again in %.0fs", *key, e, e.delay)
            self.queue.add_after(key, e.delay, later=is_new(body))
            return
        if plan.requeue_after is not None:
            self.queue.add_after(key, plan.requeue_after + 0.1)

    def observe(self, key: Key, body: dict[str, Any]) -> rc.Observed:
        """This job's children from the indexes: only those it controls (by uid; a child
        of a deleted job of the same name, or anyone else's, is not ours), and the refusal
        remembered for this job and generation."""
        uid, generation = body["metadata"].get("uid", ""), body["metadata"].get("generation")
        refusal = None
        if key in self._refusals:
            r_uid, r_generation, refusal = self._refusals[key]
            if (r_uid, r_generation) != (uid, generation):
                del self._refusals[key]
                refusal = None
        observed = rc.Observed.from_views([x for x in self.get_pods(key) if x.owner_uid == uid],
                                          [x for x in self.get_children(key) if x.owner_uid == uid], refusal)
        if self.get_workloads is not None:  # a job's Workload is seen even once its label is gone
            observed.kueue = True
            observed.workload = next((x for x in self.get_workloads(key) if controller_uid(x["metadata"]) == uid), None)
        return observed

    def read_kueue(self, body: dict[str, Any], observed: rc.Observed) -> None:
        """What a pass needs of Kueue's cluster-scoped objects: the value of the
        WorkloadPriorityClass the job names (before its Workload exists), and the
        ResourceFlavors its admission assigns (read at most every FLAVOR_TTL_SECONDS). What it
        may not read (403: the namespaced install cannot read cluster-scoped objects) holds
        the job with that message (`Observed.kueue_error`)."""
        try:
            self._read_kueue(body, observed)
        except ApiException as e:
            if e.status != 403:
                raise
            observed.kueue_error = (f"the operator may not read Kueue's cluster-scoped objects ({describe_error(e)}); "
                                    "Kueue needs the cluster-wide install's RBAC")

    def _read_kueue(self, body: dict[str, Any], observed: rc.Observed) -> None:
        if observed.workload is None:
            wanted = queueing.priority_class(body)
            if wanted:
                found = self.kube.read_path(f"/apis/{queueing.API_VERSION}/workloadpriorityclasses/{quote(wanted)}")
                observed.priority = (wanted, int(found.get("value") or 0)) if found else None
            return
        admission = (observed.workload.get("status") or {}).get("admission") or {}
        wanted_flavors = {f for x in admission.get("podSetAssignments") or [] for f in (x.get("flavors") or {}).values()}
        for name in sorted(wanted_flavors):
            at, obj = self._flavors.get(name, (0.0, None))
            if obj is None or time.monotonic() - at > FLAVOR_TTL_SECONDS:
                obj = self.kube.read_path(f"/apis/{queueing.API_VERSION}/resourceflavors/{quote(name)}")
                self._flavors[name] = (time.monotonic(), obj)
            if obj is not None:
                observed.flavors[name] = obj

    def read_nodes(self, node_names: Iterable[str]) -> dict[str, str]:
        """What each Node says about the pods on it (`terminating.classify_node`). A Node that
        cannot be read is unknown (`NODE_UNREADABLE`): its pods are not force-deleted, and
        the next pass asks again."""
        out = {}
        for name in sorted(node_names):
            try:
                out[name] = terminating.classify_node(self.kube.read_node(name))
            except ApiException as e:
                out[name] = terminating.NODE_UNREADABLE
                log.log(logging.INFO if e.status == 403 else logging.WARNING,
                        "node %s: %s; its stuck pods are not force-deleted", name, describe_error(e))
        return out

    async def _apply(self, key: Key, body: dict[str, Any], plan: rc.Plan) -> None:
        """The status first (its precondition is the state the pass read); then, step by
        step (`WRITE_STEPS`), each step's writes side by side on the write pool: events with
        the ServiceAccounts, ConfigMap and Services (create, patch, recreate); the pods with
        the Roles; the RoleBindings; then deletions. A step that fails ends the pass; what
        it wrote stays (every write is idempotent) and the retry finds the rest missing."""
        ns, name = key
        if plan.status_changed and not await self._together(partial(self._write_status, key, body, plan)):
            return  # the watch event of the competing change requeues the key
        for step in range(max(WRITE_STEPS.values()) + 1):
            def now(obj: dict[str, Any]) -> bool:
                return WRITE_STEPS.get(obj["kind"], 0) == step
            await self._together(
                *(partial(self.kube.post_event, body, ev.type, ev.reason, ev.message)
                  for ev in (plan.events if step == 0 else ())),
                *((partial(self._write_workload_status, key, plan.workload_status),)
                  if step == 0 and plan.workload_status is not None else ()),
                *(partial(self._create_expected, key, body, obj) for obj in plan.create if now(obj)),
                *(partial(self._write, body, obj, "patching", self.kube.merge_patch) for obj in plan.patch if now(obj)),
                *(partial(self._recreate, body, obj) for obj in plan.recreate if now(obj)))
        await self._together(
            *(partial(self.kube.delete_pod, ns, pod) for pod in plan.delete_pods),
            *(partial(self.kube.delete_pod, ns, pod, grace_period_seconds=0) for pod in plan.force_delete_pods),
            *(partial(self._delete_leftover, key, obj) for obj in plan.delete))

    async def _together(self, *writes: Callable[[], Any]) -> Any:
        """Run the writes on the pool at once and wait for all; raise the first refusal,
        else the first retry, else the first error. The result of a single write."""
        loop = asyncio.get_running_loop()
        if not writes:
            return None
        if len(writes) == 1:
            return await loop.run_in_executor(self._pool, writes[0])
        results = await asyncio.gather(*(loop.run_in_executor(self._pool, w) for w in writes),
                                       return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        for kind in (Refused, Retry, BaseException):
            for e in errors:
                if isinstance(e, kind):
                    raise e
        return None

    def _write_status(self, key: Key, body: dict[str, Any], plan: rc.Plan) -> bool:
        """The status patch; False when the job changed since the pass read it."""
        ns, name = key
        old_rv = body["metadata"]["resourceVersion"]
        try:
            new_rv = self.kube.patch_status(ns, name, plan.status, old_rv)
        except Conflict:
            log.info("status of %s/%s changed meanwhile; will reconcile again", ns, name)
            return False
        if new_rv != old_rv:  # a no-op patch makes no watch event: nothing to wait for
            self._stale_rv[key] = old_rv
        if plan.status.get("phase") != (body.get("status") or {}).get("phase"):
            log.info("%s/%s: %s (%s)", ns, name, plan.status.get("phase"), plan.status.get("message"))
        return True

    def _write_workload_status(self, key: Key, obj: dict[str, Any]) -> None:
        """Kueue's Workload status as the job's controller owes it; a Workload that changed
        since the pass read it is left alone (its watch event brings the next pass)."""
        try:
            self.kube.patch_child_status(obj)
        except Conflict:
            log.info("%s/%s: Workload changed meanwhile; will reconcile again", *key)
            return
        if obj["status"].get("admission", ...) is None:
            log.info("%s/%s: admission of evicted Workload %s cleared", *key, obj["metadata"]["name"])

    def _awaiting(self, key: Key, observed: rc.Observed) -> bool:
        """Whether children this controller created are still missing from the informers'
        caches (their watch events lag behind the create's answer): a pass now would create
        them again, a 409 and a read each. It comes back when their events requeue the key,
        or after `EXPECT_SECONDS` (an object deleted before it was ever seen sends none).
        A refusal is acted on at once."""
        with self._expected_lock:
            entry = self._expected.get(key)
            if entry is None:
                return False
            until, expected = entry
            expected.difference_update({("Pod", p.name) for p in observed.pods}, observed.children)
            if observed.workload is not None:
                expected.discard(("Workload", observed.workload["metadata"]["name"]))
            left = until - time.monotonic()
            if not expected or left <= 0 or observed.refusal is not None:
                del self._expected[key]
                return False
        log.debug("%s/%s: waiting for %d created children to reach the informers", *key, len(expected))
        self.queue.add_after(key, left)
        return True

    def awaits_children(self, key: Key) -> bool:
        """Whether a pass of this job waits for children it created to reach the informers."""
        return key in self._expected

    def _create_expected(self, key: Key, body: dict[str, Any], obj: dict[str, Any]) -> None:
        if self._create(body, obj):
            with self._expected_lock:
                entry = self._expected.setdefault(key, (time.monotonic() + EXPECT_SECONDS, set()))
                entry[1].add((obj["kind"], obj["metadata"]["name"]))

    def _recreate(self, body: dict[str, Any], obj: dict[str, Any]) -> None:
        self.kube.delete(obj)
        self._create(body, obj)

    def _delete_leftover(self, key: Key, obj: dict[str, Any]) -> None:
        log.info("%s/%s: deleting %s, which the spec no longer renders", *key, _what(obj))
        self.kube.delete(obj)

    def _create(self, body: dict[str, Any], obj: dict[str, Any]) -> bool:
        """Create by name (True: created now); a name already taken is fine only when this
        job controls the object that holds it. Never adopt: anyone else's object is a
        ChildConflict."""
        if self._write(body, obj, "creating", self.kube.create):
            return True
        meta, what = body["metadata"], _what(obj)
        live = self.kube.read(obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"])
        owner = drift.classify_owner(live.get("metadata") or {}, meta["name"], meta.get("uid", ""), names.KIND)
        if owner == drift.OURS:
            # Ours, yet not in the index: someone took our labels off. Put them back.
            if obj["kind"] != "Pod" and not drift.covers(managed_fields(live), managed_fields(obj)):
                self._write(body, drift.compute_patch(obj, live), "patching", self.kube.merge_patch)
            return False
        if owner == drift.PREVIOUS:
            raise Retry(f"{what} still belongs to a deleted {names.KIND} of the same name; waiting for the "
                        "garbage collector", PREVIOUS_OWNER_RETRY_SECONDS)
        holder = next((r for r in live["metadata"].get("ownerReferences") or [] if r.get("controller")), None)
        by = f" (its controller is {holder.get('kind')} {holder.get('name')})" if holder else ""
        raise Refused(Refusal(names.REASON_CHILD_CONFLICT,
                              f"{what} exists and is not owned by this {names.KIND}{by}; delete or rename it"))

    def _write(self, body: dict[str, Any], obj: dict[str, Any], verb: str, write: Callable[[dict], Any]) -> Any:
        """One child write; a refusal says which object and, for a 422, which field."""
        try:
            return write(obj)
        except ApiException as e:
            what = _what(obj)
            self.kube.post_event(body, "Warning", WRITE_FAILED[verb], f"{verb} {what}: {describe_error(e)}")
            if e.status == 422 or (e.status == 403 and POD_SECURITY_REFUSAL in (api_message(e) or "")):
                message = f"{verb} {what}: {api_message(e) or e.reason}"
                raise Refused(Refusal(names.REASON_INVALID_SPEC, message)) from None
            raise


# The API server's PodSecurity admission refuses a pod beyond the namespace's enforced
# level with a 403 saying this: as permanent for the spec as a 422 (no retry fixes it).
POD_SECURITY_REFUSAL = "violates PodSecurity"


def is_transient(e: BaseException) -> bool:
    """What the API server or the network said (a retry may fix it), not a bug of ours."""
    return isinstance(e, (ApiException, urllib3.exceptions.HTTPError, OSError, asyncio.TimeoutError))


def retry_level(tries: int, e: BaseException) -> int:
    """A failed pass that will be retried is a warning; an error once retrying has not
    helped for a while, or at once for anything but the API server's or the network's
    answer (a bug: its trace is logged). An error line should mean a person is needed."""
    if not is_transient(e):
        return logging.ERROR
    return logging.ERROR if tries >= RETRIES_BEFORE_ERROR else logging.WARNING


def _what(obj: dict[str, Any]) -> str:
    return f"{obj['kind']} {obj['metadata']['namespace']}/{obj['metadata']['name']}"


def describe_error(e: Exception) -> str:
    """An error in words for logs and events: the status and the API server's message
    (which names the field), never a request body."""
    if isinstance(e, ApiException):
        message = api_message(e)
        return f"HTTP {e.status} {e.reason}" + (f": {message}" if message else "")
    return f"{type(e).__name__}: {e}"

