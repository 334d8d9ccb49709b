"""The children's informers: the cache follows list and watch events, a job is named for
every event that concerns it, a watch resumes where it stopped, and a 410 lists again.
A fake list/watch function stands in for the API server."""

from __future__ import annotations

import asyncio
import json
import queue

from rft_contract import names
from rft_operator.informer import Informer, Store

SELECTOR = f"{names.LABEL_JOB},{names.LABEL_MANAGED_BY}={names.MANAGED_BY}"


def obj(name: str, job: str, rv: str = "1", ns: str = "team-a") -> dict:
    return {"metadata": {"name": name, "namespace": ns, "resourceVersion": rv, "labels": {names.LABEL_JOB: job}}}


def names_of(view: list) -> list[str]:
    return sorted(x["metadata"]["name"] for x in view)


def store() -> Store:
    return Store(names.LABEL_JOB, lambda o: o)


# ---------------------------------------------------------------- Store


def test_events_update_the_jobs_buckets():
    s = store()
    assert s.apply("ADDED", obj("a-0", "a")) == {("team-a", "a")}
    s.apply("ADDED", obj("a-1", "a"))
    s.apply("MODIFIED", obj("a-1", "a", rv="2"))
    assert names_of(s.get(("team-a", "a"))) == ["a-0", "a-1"]
    assert s.get(("team-a", "a"))[1]["metadata"]["resourceVersion"] == "2"
    assert s.apply("DELETED", obj("a-0", "a")) == {("team-a", "a")}
    assert names_of(s.get(("team-a", "a"))) == ["a-1"]
    assert s.get(("team-b", "a")) == []  # namespaces apart


def test_an_object_relabelled_to_another_job_leaves_the_old_one():
    s = store()
    s.apply("ADDED", obj("x", "a"))
    assert s.apply("MODIFIED", obj("x", "b")) == {("team-a", "a"), ("team-a", "b")}
    assert s.get(("team-a", "a")) == [] and names_of(s.get(("team-a", "b"))) == ["x"]


def test_a_listing_replaces_everything_and_names_jobs_before_and_after():
    s = store()
    s.apply("ADDED", obj("a-0", "a"))
    s.apply("ADDED", obj("b-0", "b"))
    assert s.replace([obj("b-0", "b"), obj("c-0", "c")]) == {("team-a", k) for k in "abc"}
    assert s.get(("team-a", "a")) == []  # deleted while nobody watched
    assert names_of(s.get(("team-a", "c"))) == ["c-0"]


# ---------------------------------------------------------------- Informer


class FakeResponse:
    """A watch response: lines fed by the test through a queue; None ends the stream."""

    def __init__(self, lines: queue.Queue):
        self.lines = lines

    def stream(self, amt=None, decode_content=False):
        while (line := self.lines.get()) is not None:
            yield (json.dumps(line) + "\n").encode()

    def close(self):
        pass


class FakeList:
    """Answers lists from `listings` (one per call) and watches with a FakeResponse."""

    def __init__(self, listings: list[dict]):
        self.listings = listings
        self.calls: list[dict] = []
        self.streams: queue.Queue = queue.Queue()  # one line queue per watch, in order

    def __call__(self, **kw):
        self.calls.append(kw)
        assert kw["label_selector"] == SELECTOR and kw["_preload_content"] is False
        if kw.get("watch"):
            return FakeResponse(self.streams.get())

        class Listing:
            data = json.dumps(self.listings.pop(0)).encode()
        return Listing()


def listing(rv: str, *items: dict) -> dict:
    return {"metadata": {"resourceVersion": rv}, "items": list(items)}


def watch_calls(fake: FakeList) -> list[dict]:
    return [x for x in fake.calls if x.get("watch")]


async def watches_until(fake: FakeList, n: int) -> list[dict]:
    """The first `n` watch calls, once made (the informer watches after it reports a listing)."""
    async def made() -> None:
        while len(watch_calls(fake)) < n:
            await asyncio.sleep(0.01)
    await asyncio.wait_for(made(), timeout=5)
    return watch_calls(fake)[:n]


async def changes_until(changes: asyncio.Queue, n: int) -> list:
    return [await asyncio.wait_for(changes.get(), timeout=5) for _ in range(n)]


def started(fake: FakeList) -> tuple[Informer, queue.Queue, asyncio.Queue, object]:
    """A running informer over `fake`, with its first watch stream ready: (informer,
    stream, changes it reports as (key, type), store)."""
    stream = queue.Queue()
    fake.streams.put(stream)
    changes: asyncio.Queue = asyncio.Queue()
    s = store()
    inf = Informer("pods", fake, SELECTOR, s, lambda key, type_: changes.put_nowait((key, type_)))
    inf.start()
    return inf, stream, changes, s


def test_list_then_watch_from_its_resource_version():
    async def go():
        fake = FakeList([listing("10", obj("a-0", "a", "9"))])
        inf, first, changes, s = started(fake)
        await asyncio.wait_for(inf.synced.wait(), timeout=5)
        assert await changes_until(changes, 1) == [(("team-a", "a"), None)]
        first.put({"type": "ADDED", "object": obj("a-1", "a", "11")})
        first.put({"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "12"}}})
        first.put({"type": "DELETED", "object": obj("a-0", "a", "13")})
        assert await changes_until(changes, 2) == [(("team-a", "a"), "ADDED"), (("team-a", "a"), "DELETED")]
        assert names_of(s.get(("team-a", "a"))) == ["a-1"]
        second = queue.Queue()
        fake.streams.put(second)
        first.put(None)  # the server ends the watch: it resumes from the last version seen
        second.put({"type": "MODIFIED", "object": obj("a-1", "a", "14")})
        await changes_until(changes, 1)
        assert [x["resource_version"] for x in watch_calls(fake)] == ["10", "13"]
        inf.stop()
        second.put(None)
    asyncio.run(go())


def test_a_too_old_watch_lists_again():
    async def go():
        fake = FakeList([listing("10", obj("a-0", "a"), obj("b-0", "b")), listing("20", obj("b-0", "b"))])
        inf, first, changes, s = started(fake)
        await changes_until(changes, 2)
        second = queue.Queue()
        fake.streams.put(second)
        first.put({"type": "ERROR", "object": {"kind": "Status", "code": 410, "message": "too old"}})
        # a-0 was deleted while the watch was gone: the new listing drops it and names its job
        got = await changes_until(changes, 2)
        assert sorted(got) == [(("team-a", "a"), None), (("team-a", "b"), None)]
        assert s.get(("team-a", "a")) == [] and names_of(s.get(("team-a", "b"))) == ["b-0"]
        assert [x["resource_version"] for x in await watches_until(fake, 2)] == ["10", "20"]
        assert len(watch_calls(fake)) == 2
        inf.stop()
        second.put(None)
    asyncio.run(go())


def test_every_pod_event_enqueues_its_job_a_static_childs_own_create_does_not():
    from rft_operator.workqueue import WorkQueue
    from rft_operator.handlers import on_child_event

    class Ctl:
        queue = WorkQueue()

        def awaits_children(self, key):
            return key == ("ns", "f")

    ctl = Ctl()
    pods, children = on_child_event(ctl, is_pod=True), on_child_event(ctl, is_pod=False)
    pods(("ns", "a"), "ADDED")
    children(("ns", "b"), "ADDED")  # our create coming back
    children(("ns", "c"), "MODIFIED")  # a hand edit to repair
    children(("ns", "d"), "DELETED")
    children(("ns", "e"), None)  # a listing
    children(("ns", "f"), "ADDED")  # a create a pass waits to see
    assert set(ctl.queue._dirty) == {("ns", "a"), ("ns", "c"), ("ns", "d"), ("ns", "e"), ("ns", "f")}
