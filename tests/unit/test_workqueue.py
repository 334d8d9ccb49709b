"""The controller's work queue: deduplication and one-worker-per-key, like client-go's."""

import asyncio

import pytest

from rft_operator.workqueue import WorkQueue


def run(coro):
    return asyncio.run(coro)


def test_duplicate_adds_collapse():
    async def go():
        q = WorkQueue()
        for _ in range(5):
            q.add("a")
        q.add("b")
        assert len(q) == 2
        assert await q.get() == "a"
        assert await q.get() == "b"
    run(go())


def test_key_added_while_processing_is_requeued_after_done():
    async def go():
        q = WorkQueue()
        q.add("a")
        key = await q.get()
        q.add("a")  # an event arrives while a worker holds "a"
        assert len(q) == 0  # not handed to a second worker
        q.done(key)
        assert len(q) == 1 and await q.get() == "a"
    run(go())


def test_add_after_keeps_the_earliest_schedule():
    async def go():
        q = WorkQueue()
        q.add_after("a", 0.05)
        q.add_after("a", 10)  # later schedule does not postpone the earlier one
        got = await asyncio.wait_for(q.get(), timeout=2)
        assert got == "a"
    run(go())


def test_later_keys_wait_behind_plain_adds():
    async def go():
        q = WorkQueue()
        q.add("new-1", later=True)
        q.add("new-2", later=True)
        q.add("running")  # e.g. a pod of a job in flight changed
        assert [await q.get() for _ in range(3)] == ["running", "new-1", "new-2"]
    run(go())


def test_a_plain_add_moves_a_waiting_key_up_once():
    async def go():
        q = WorkQueue()
        q.add("a", later=True)
        q.add("b", later=True)
        q.add("b")
        q.add("b", later=True)  # does not move it back down
        assert len(q) == 2
        assert await q.get() == "b"
        assert await q.get() == "a"
        assert len(q) == 0
        with pytest.raises(asyncio.TimeoutError):  # no stale copy of "b" is handed out
            await asyncio.wait_for(q.get(), timeout=0.05)
    run(go())


def test_a_key_added_later_while_processing_keeps_its_lane():
    async def go():
        q = WorkQueue()
        q.add("a")
        key = await q.get()
        q.add("a", later=True)
        q.add("b")
        q.done(key)
        assert [await q.get() for _ in range(2)] == ["b", "a"]
    run(go())


async def idle_worker(q: WorkQueue, now_only: bool = False) -> asyncio.Task:
    """A worker blocked on `q` (its task has run up to its wait)."""
    worker = asyncio.create_task(q.get(now_only=now_only))
    await asyncio.sleep(0)
    return worker


def test_a_waiting_worker_is_woken_by_an_add():
    async def go():
        q = WorkQueue()
        worker = asyncio.create_task(q.get())
        await asyncio.sleep(0)  # let the worker block on the empty queue
        assert not worker.done()
        q.add("a", later=True)
        assert await asyncio.wait_for(worker, timeout=2) == "a"
    run(go())


def test_a_kept_worker_takes_only_plain_adds():
    async def go():
        q = WorkQueue()
        kept = await idle_worker(q, now_only=True)
        q.add("new-job", later=True)
        await asyncio.sleep(0)
        assert not kept.done()  # a new job is not for it
        assert await asyncio.wait_for(q.get(), timeout=2) == "new-job"  # any other worker's
        q.add("in-flight")
        assert await asyncio.wait_for(kept, timeout=2) == "in-flight"
    run(go())


def test_a_plain_add_wakes_a_kept_worker_before_another():
    async def go():
        q = WorkQueue()
        other = await idle_worker(q)
        kept = await idle_worker(q, now_only=True)
        q.add("in-flight")
        assert await asyncio.wait_for(kept, timeout=2) == "in-flight"
        assert not other.done()  # still free for the next new job
        q.add("new-job", later=True)
        assert await asyncio.wait_for(other, timeout=2) == "new-job"
    run(go())


def test_no_key_waits_while_a_worker_that_takes_it_is_idle():
    # A later add wakes a worker, a plain add in the same tick the kept one; the first worker
    # runs first and takes the plain key (its lane comes first), the kept one finds nothing:
    # the later key must still reach the other idle worker.
    async def go():
        q = WorkQueue()
        first, second = await idle_worker(q), await idle_worker(q)
        kept = await idle_worker(q, now_only=True)
        q.add("new-job", later=True)
        q.add("in-flight")
        assert await asyncio.wait_for(second, timeout=2) == "new-job"
        assert first.result() == "in-flight" and not kept.done()
        kept.cancel()
    run(go())


def test_a_retry_of_a_new_job_stays_out_of_the_kept_workers_lane():
    async def go():
        q = WorkQueue()
        kept = await idle_worker(q, now_only=True)
        q.add_after("new-job", 0.01, later=True)  # its first pass failed: back behind the jobs in flight
        assert await asyncio.wait_for(q.get(), timeout=2) == "new-job"
        assert not kept.done()
        kept.cancel()
    run(go())


def test_a_job_is_new_until_the_operator_writes_its_phase():
    from rft_operator.workqueue import is_new

    assert is_new(None) and is_new({"metadata": {}}) and is_new({"status": {"progress": {}}})
    assert not is_new({"status": {"phase": "Pending"}})


def test_a_quarter_of_the_workers_are_kept_for_jobs_in_flight():
    from rft_operator.workqueue import kept_workers

    assert [kept_workers(n) for n in (1, 3, 4, 48)] == [0, 0, 1, 12]
