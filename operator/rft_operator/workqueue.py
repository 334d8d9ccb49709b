"""The controller's work queue: RFTJob keys, each queued at most once and never processed
by two workers at a time, in two lanes (jobs in flight before new ones and resyncs)."""

from __future__ import annotations

import asyncio
import collections
from typing import Any, Hashable


class WorkQueue:
    """client-go semantics: a key is queued at most once, and never processed by two
    workers at the same time; a key added while being processed is re-queued after.

    Two lanes, like controller-runtime's priority queue: `add(key, later=True)` (a job seen
    for the first time, a periodic resync) waits behind every plain `add` (a change to a
    job or its children). A burst of new jobs then no longer holds up the jobs already in
    flight: a gang whose last pod runs gets its status pass before the next new job gets its
    first. A key added plainly while it waits in the later lane moves up. Order within a
    lane is first come, first served.

    Workers that call `get(now_only=True)` take only plain adds: kept for jobs in flight,
    they are free when a gang's last pod starts even while every other worker waits on a
    burst of new jobs' slowest writes (Roles and RoleBindings)."""

    NOW, LATER = 0, 1

    def __init__(self) -> None:
        self._lanes: tuple[collections.deque, collections.deque] = (collections.deque(), collections.deque())
        self._dirty: dict[Hashable, int] = {}  # key -> the lane it waits in
        self._processing: set[Hashable] = set()
        self._timers: dict[Hashable, asyncio.TimerHandle] = {}
        # Idle workers by what they take: [NOW] plain adds only, [LATER] any key.
        self._waiters: tuple[collections.deque[asyncio.Future], ...] = (collections.deque(), collections.deque())

    def add(self, key: Hashable, later: bool = False) -> None:
        lane = self.LATER if later else self.NOW
        queued = self._dirty.get(key)
        if queued is not None and queued <= lane:
            return
        self._dirty[key] = lane  # new, or moving up from the later lane
        if key not in self._processing:
            self._put(key, lane)

    def _put(self, key: Hashable, lane: int) -> None:
        self._lanes[lane].append(key)
        self._wake_for(lane)

    def add_after(self, key: Hashable, delay: float, later: bool = False) -> None:
        """Schedule `key` (into the later lane with `later`); an earlier pending schedule
        for the same key wins."""
        loop = asyncio.get_running_loop()
        due = loop.time() + delay
        old = self._timers.get(key)
        if old is not None and not old.cancelled() and old.when() <= due:
            return
        if old is not None:
            old.cancel()
        self._timers[key] = loop.call_at(due, self._fire, key, later)

    def _fire(self, key: Hashable, later: bool) -> None:
        self._timers.pop(key, None)
        self.add(key, later=later)

    def _pop(self, lanes: int) -> Hashable | None:
        for lane, queue in enumerate(self._lanes[:lanes]):
            while queue:
                key = queue.popleft()
                # Skip what moved up to the other lane, or went to a worker from there.
                if self._dirty.get(key) == lane and key not in self._processing:
                    return key
        return None

    async def get(self, now_only: bool = False) -> Hashable:
        lane = self.NOW if now_only else self.LATER
        while (key := self._pop(lane + 1)) is None:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters[lane].append(waiter)
            await waiter
        del self._dirty[key]
        self._processing.add(key)
        self._wake()
        return key

    def _wake(self) -> None:
        """Hand what is still queued to idle workers: the wake-up meant for it may have gone
        to a worker that took another key (from the lane it checks first) or none."""
        for lane, queue in enumerate(self._lanes):
            if queue:
                self._wake_for(lane)

    def _wake_for(self, lane: int) -> None:
        """Wake one idle worker that takes `lane`'s keys: for a plain add a kept worker
        first, leaving the others to later keys."""
        for waiters in self._waiters[lane:]:
            while waiters:
                waiter = waiters.popleft()
                if not waiter.done():
                    waiter.set_result(None)
                    return

    def done(self, key: Hashable) -> None:
        self._processing.discard(key)
        if key in self._dirty:
            self._put(key, self._dirty[key])

    def __len__(self) -> int:
        return sum(1 for k in self._dirty if k not in self._processing)


def is_new(body: dict[str, Any] | None) -> bool:
    """A job the operator has not written a status for yet: its passes, retries included,
    wait in the later lane (`WorkQueue`), so creating its children never delays a status
    pass of a job in flight."""
    return not ((body or {}).get("status") or {}).get("phase")


def kept_workers(workers: int) -> int:
    """How many of `workers` take only jobs in flight: a quarter; none of fewer than 4."""
    return workers // 4
