"""Lease leader election (`rft_operator.leader`), step by step on an injected clock against
an in-memory Lease store that behaves as the API server does for one object (create is 409
when it exists, a replace with a stale resourceVersion is 409). The real API server and two
real operator processes: tests/integration/test_leader.py."""

from __future__ import annotations

import copy
import threading
import time
from datetime import datetime, timedelta, timezone

import pytest

from rft_operator import leader
from rft_operator.leader import Elector, LeaderElectionError, Timing
from tests.conftest import wait_for

T0 = datetime(2026, 12, 4, 12, 0, tzinfo=timezone.utc)


class Store:
    """One Lease, with resourceVersions; `down` makes every call fail like a partition."""

    def __init__(self):
        self.lease: dict | None = None
        self.rv = 0
        self.down = False
        self.writes: list[str] = []  # holder of each successful write

    def client(self) -> "Client":
        return Client(self)


class Client:
    namespace, name = "rftjob-system", "rftjob-operator"

    def __init__(self, store: Store):
        self.store = store

    def _check(self):
        if self.store.down:
            raise ConnectionError("the API server is unreachable")

    def get(self):
        self._check()
        return copy.deepcopy(self.store.lease)

    def create(self, spec):
        self._check()
        if self.store.lease is not None:
            return None
        return self._write({"metadata": {"name": self.name}, "spec": spec})

    def replace(self, lease):
        self._check()
        if self.store.lease is None or lease["metadata"].get("resourceVersion") != str(self.store.rv):
            return None
        return self._write(lease)

    def _write(self, lease):
        self.store.rv += 1
        lease = copy.deepcopy(lease)
        lease["metadata"]["resourceVersion"] = str(self.store.rv)
        self.store.lease = lease
        self.store.writes.append(lease["spec"]["holderIdentity"])
        return copy.deepcopy(lease)


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def now(self) -> datetime:
        return T0 + timedelta(seconds=self.t - 1000.0)


def candidate(store: Store, name: str, clock: Clock, timing: Timing = Timing()) -> Elector:
    return Elector(store.client(), name, timing, clock=clock, now=clock.now)


def holder(store: Store) -> str:
    return store.lease["spec"]["holderIdentity"]


def test_the_first_candidate_creates_the_lease_the_second_waits():
    store, clock = Store(), Clock()
    a, b = candidate(store, "a", clock), candidate(store, "b", clock)
    assert a.try_acquire_or_renew()
    assert not b.try_acquire_or_renew()
    spec = store.lease["spec"]
    assert (spec["holderIdentity"], spec["leaseDurationSeconds"], spec["leaseTransitions"]) == ("a", 15, 0)
    assert spec["renewTime"] == "2026-12-04T12:00:00.000000Z"


def test_renewals_keep_a_waiting_candidate_waiting():
    store, clock = Store(), Clock()
    a, b = candidate(store, "a", clock), candidate(store, "b", clock)
    a.try_acquire_or_renew()
    for _ in range(20):  # 40 s, far past one lease duration, renewed every 2 s
        clock.t += 2
        assert a.try_acquire_or_renew()
        assert not b.try_acquire_or_renew()
    assert holder(store) == "a" and store.lease["spec"]["acquireTime"] == "2026-12-04T12:00:00.000000Z"


def test_a_silent_leader_is_replaced_after_the_lease_duration_by_the_waiters_clock():
    store, clock = Store(), Clock()
    a, b = candidate(store, "a", clock), candidate(store, "b", clock)
    a.try_acquire_or_renew()
    assert not b.try_acquire_or_renew()  # b sees the record now: its 15 s start here
    clock.t += 14.9
    assert not b.try_acquire_or_renew()
    clock.t += 0.2
    assert b.try_acquire_or_renew()
    spec = store.lease["spec"]
    assert (spec["holderIdentity"], spec["leaseTransitions"]) == ("b", 1)
    # The old leader, back, finds it taken and does not write.
    writes = len(store.writes)
    a.leading.set()
    assert not a.try_acquire_or_renew() and len(store.writes) == writes


def test_the_lease_duration_counts_from_when_the_waiter_saw_the_record_not_its_timestamp():
    # A renewTime far in the past (another machine's clock) changes nothing: the waiter
    # measures only its own time since the record last changed.
    store, clock = Store(), Clock()
    a, b = candidate(store, "a", clock), candidate(store, "b", clock)
    a.try_acquire_or_renew()
    store.lease["spec"]["renewTime"] = "2000-01-01T00:00:00.000000Z"
    assert not b.try_acquire_or_renew()
    clock.t += 10
    assert not b.try_acquire_or_renew()


def test_of_two_waiters_taking_over_at_once_only_one_wins():
    store, clock = Store(), Clock()
    a, b, c = (candidate(store, n, clock) for n in "abc")
    a.try_acquire_or_renew()
    b.try_acquire_or_renew(), c.try_acquire_or_renew()
    clock.t += 16
    # Both read the expired record, then both write with its resourceVersion.
    lease = store.client().get()
    b.client.get = c.client.get = lambda: copy.deepcopy(lease)
    results = [b.try_acquire_or_renew(), c.try_acquire_or_renew()]
    assert results == [True, False] and holder(store) == "b"


def test_a_released_lease_is_taken_at_once():
    store, clock = Store(), Clock()
    a, b = candidate(store, "a", clock), candidate(store, "b", clock)
    a.try_acquire_or_renew()
    a.leading.set()
    assert not b.try_acquire_or_renew()
    a.release()
    assert holder(store) == ""
    assert b.try_acquire_or_renew() and holder(store) == "b"


def test_release_leaves_a_lease_someone_else_holds():
    store, clock = Store(), Clock()
    a, b = candidate(store, "a", clock), candidate(store, "b", clock)
    a.try_acquire_or_renew()
    clock.t += 16
    b.try_acquire_or_renew()
    clock.t += 16
    b.try_acquire_or_renew()
    a.leading.set()
    a.release()
    assert holder(store) == "b"


@pytest.mark.parametrize("timing", [(10, 10, 2), (15, 20, 2), (15, 10, 10), (15, 10, 0), (15, 14.5, 2)])
def test_timings_that_could_let_two_lead_are_refused(timing):
    with pytest.raises(LeaderElectionError, match="renew deadline"):
        Timing(*timing)


def test_a_partitioned_leader_gives_up_before_a_waiter_may_take_over():
    """The safety margin, step by step: the leader's last successful renewal starts at t;
    every later one fails; the watchdog ends it by t + renew deadline (+ its period); the
    waiter, which read that renewal no earlier than t, takes over no earlier than t + the
    lease duration."""
    timing = Timing()
    store, clock = Store(), Clock()
    a, b = candidate(store, "a", clock, timing), candidate(store, "b", clock, timing)
    a.try_acquire_or_renew()
    clock.t += 2
    assert a.try_acquire_or_renew()
    last_renewal = a.renewed_at
    assert not b.try_acquire_or_renew()
    given_up = None
    while given_up is None:  # the watchdog's checks, every watchdog period
        clock.t += timing.watchdog_period
        if clock() - a.renewed_at > timing.renew_deadline:
            given_up = clock()
    taken = None
    while taken is None:
        clock.t += 0.1
        if b.try_acquire_or_renew():
            taken = clock()
    assert given_up <= last_renewal + timing.renew_deadline + timing.watchdog_period
    assert taken >= last_renewal + timing.lease_duration
    assert taken - given_up >= timing.lease_duration - timing.renew_deadline - timing.watchdog_period


def test_keep_calls_on_lost_within_the_renew_deadline_when_the_api_server_is_gone():
    """The real threads, on short timings: renewals start failing, and the watchdog ends
    leadership once the renew deadline has passed (not before)."""
    timing = Timing(lease_duration=2.0, renew_deadline=0.8, retry_period=0.1, watchdog_period=0.02)
    store = Store()
    a = Elector(store.client(), "a", timing)
    a.acquire()
    lost = threading.Event()
    why: list[str] = []
    a.keep(on_lost=lambda w: (why.append(w), lost.set()))
    # Renewing: no loss while the API server answers.
    assert not lost.wait(1.0), why
    assert store.writes.count("a") >= 5
    cut = a.renewed_at
    store.down = True
    assert lost.wait(5), "leadership never ended"
    assert time.monotonic() - cut >= timing.renew_deadline
    assert "renew deadline" in why[0] and not a.leading.is_set()
    a.release()


def test_keep_calls_on_lost_at_once_when_another_holder_took_the_lease():
    timing = Timing(lease_duration=2.0, renew_deadline=1.0, retry_period=0.05, watchdog_period=0.02)
    store = Store()
    a = Elector(store.client(), "a", timing)
    a.acquire()
    lost = threading.Event()
    why: list[str] = []
    a.keep(on_lost=lambda w: (why.append(w), lost.set()))
    def intrude() -> bool:  # retried: a renewal may land between our read and write
        lease = store.client().get()
        lease["spec"]["holderIdentity"] = "intruder"
        return store.client().replace(lease) is not None

    wait_for(intrude, 5, "the intruder's write", interval=0.01)
    assert lost.wait(0.9), "a lease taken by another went unnoticed until the deadline"
    assert why == [why[0]] and "taken by intruder" in why[0]  # once
    a.release()
    assert holder(store) == "intruder"  # release never hands back what we no longer hold


def test_identity_is_the_pod_name_and_a_fresh_suffix(monkeypatch):
    monkeypatch.setattr(leader.socket, "gethostname", lambda: "rftjob-operator-7d9-abcde")
    one, two = leader.identity(), leader.identity()
    assert one.startswith("rftjob-operator-7d9-abcde_") and one != two


def test_the_lease_namespace_comes_from_the_flag_or_the_pod(monkeypatch, tmp_path):
    monkeypatch.delenv("POD_NAMESPACE", raising=False)
    monkeypatch.setattr(leader, "SA_NAMESPACE_FILE", str(tmp_path / "none"))
    with pytest.raises(LeaderElectionError, match="--leader-elect-namespace"):
        leader.own_namespace()
    assert leader.own_namespace("ops") == "ops"
    monkeypatch.setenv("POD_NAMESPACE", "rftjob-system")
    assert leader.own_namespace() == "rftjob-system"


def test_a_waiting_replica_answers_its_liveness_probe():
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    health = leader.FollowerHealth(f"http://127.0.0.1:{port}/healthz")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
            assert r.status == 200 and b'"leader": false' in r.read()
    finally:
        health.close()
    # Closed: the port is free for kopf's own endpoint.
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))


def test_a_waiter_dates_a_record_by_when_its_read_came_back():
    """A slow read (here 6 s) may return a renewal that landed while it was on its way:
    the waiter counts the lease duration from the answer, so it cannot take over before
    the leader, cut off right after that renewal, has given up."""
    timing = Timing()
    store, clock = Store(), Clock()
    a, b = candidate(store, "a", clock, timing), candidate(store, "b", clock, timing)
    a.try_acquire_or_renew()
    b.try_acquire_or_renew()
    clock.t += 5
    real_get = b.client.get

    def slow_get():
        clock.t += 3
        assert a.try_acquire_or_renew()  # a's last renewal, in the middle of b's read
        clock.t += 3
        return real_get()

    b.client.get = slow_get
    b.try_acquire_or_renew()
    b.client.get = real_get
    gives_up = a.renewed_at + timing.renew_deadline + timing.watchdog_period
    while not b.try_acquire_or_renew():
        clock.t += 0.1
    assert clock() >= a.renewed_at + timing.lease_duration and clock() > gives_up, (clock(), gives_up)


def test_the_lease_says_whole_seconds_rounded_up():
    store, clock = Store(), Clock()
    candidate(store, "a", clock, Timing(lease_duration=10.2, renew_deadline=8)).try_acquire_or_renew()
    assert store.lease["spec"]["leaseDurationSeconds"] == 11


def test_a_waiter_that_cannot_reach_the_api_server_turns_unhealthy():
    store, clock = Store(), Clock()
    a, b = candidate(store, "a", clock), candidate(store, "b", clock)
    a.try_acquire_or_renew()
    b.try_acquire_or_renew()
    store.down = True
    clock.t += 29
    assert b.waiting_healthy()
    clock.t += 2
    assert not b.waiting_healthy()
    store.down = False
    b.try_acquire_or_renew()
    assert b.waiting_healthy()
