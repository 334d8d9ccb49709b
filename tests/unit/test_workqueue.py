"""The controller's work queue: deduplication and one-worker-per-key, like client-go's."""

import asyncio

from rft_operator.controller import WorkQueue


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
