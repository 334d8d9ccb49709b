"""Lease leader election (coordination.k8s.io/v1), so that the operator can run as more
than one replica: only the holder of the Lease runs kopf's handlers and the controller;
the others wait, answering their liveness probe, and take over when the holder stops
renewing.

The rules, as client-go's leaderelection has them:

* A candidate takes the Lease when it does not exist, when nobody holds it (a leader that
  shut down cleanly released it), or when the record it last saw has not changed for
  `lease_duration` seconds by the candidate's own clock (no clock is compared across
  machines: each side only measures durations).
* The leader renews every `retry_period`. Every write is a replace with the resourceVersion
  it read, so of two candidates only one wins (409 for the other).
* The leader counts from the start of its last successful renewal; once `renew_deadline`
  seconds pass without another, it has lost: the process exits at once (the kubelet
  restarts it as a candidate). A watchdog thread checks this, so a request hung on a
  partitioned network cannot hold the exit back. Since `renew_deadline < lease_duration`,
  a leader cut off from the API server is gone before anyone else may take over; the
  margin is `lease_duration - renew_deadline` minus the watchdog's period.

The defaults (15 s, 10 s, 2 s) are client-go's and kube-controller-manager's.
"""

from __future__ import annotations

import dataclasses
import http.server
import json
import logging
import math
import os
import socket
import threading
import time
import uuid
from datetime import datetime, timezone
from typing import Callable
from urllib.parse import quote, urlsplit

import kubernetes
from kubernetes.client.rest import ApiException

from .model import Obj

log = logging.getLogger(__name__)

LEASE_NAME = "rftjob-operator"
MARGIN = 1.0  # lease duration - renew deadline, at least: the watchdog's period and the exit fit in it
PATH = "/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"
SA_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


class LeaderElectionError(Exception):
    """A timing that cannot be safe, or no namespace to hold the Lease in."""


@dataclasses.dataclass(frozen=True)
class Timing:
    lease_duration: float = 15.0
    renew_deadline: float = 10.0
    retry_period: float = 2.0
    watchdog_period: float = 0.25

    def __post_init__(self) -> None:
        if not (0 < self.retry_period < self.renew_deadline
                and self.renew_deadline + MARGIN <= self.lease_duration):
            raise LeaderElectionError(
                f"leader election needs 0 < retry period ({self.retry_period:g}s) < renew deadline "
                f"({self.renew_deadline:g}s) <= lease duration ({self.lease_duration:g}s) - {MARGIN:g}s: a "
                f"leader cut off from the API server must stop before another replica may take over")

    @property
    def lease_seconds(self) -> int:
        """The Lease's leaseDurationSeconds (whole seconds: rounded up, never shorter)."""
        return math.ceil(self.lease_duration)

    @property
    def request_timeout(self) -> float:
        """Per request (one try, no retries): a renewal that hangs gives up in time for a
        retry before the deadline."""
        return max(0.5, min(self.retry_period * 2, self.renew_deadline / 3))


def identity() -> str:
    """This process among the candidates: the pod's name (its hostname) and a random part,
    so that a restarted container is a new candidate, not the old leader."""
    return f"{socket.gethostname()}_{uuid.uuid4().hex[:8]}"


def own_namespace(explicit: str | None = None) -> str:
    """Where the Lease lives: the flag, $POD_NAMESPACE, or the ServiceAccount's namespace."""
    ns = explicit or os.environ.get("POD_NAMESPACE")
    if not ns:
        try:
            with open(SA_NAMESPACE_FILE) as f:
                ns = f.read().strip()
        except OSError:
            pass
    if not ns:
        raise LeaderElectionError("--leader-elect needs a namespace for its Lease: pass "
                                  "--leader-elect-namespace or set POD_NAMESPACE")
    return ns


def micro_time(now: datetime) -> str:
    """A Lease's MicroTime."""
    return now.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaseClient:
    """get / create / replace of one Lease, through the kubernetes client's REST layer with a
    timeout on every request. create and replace return None on 409 (another candidate
    wrote first)."""

    def __init__(self, namespace: str, name: str = LEASE_NAME, timeout: float = 4.0,
                 api_client: kubernetes.client.ApiClient | None = None):
        self.namespace, self.name, self.timeout = namespace, name, timeout
        if api_client is None:
            # One try per request: urllib3 retries a timed-out GET or PUT three times by
            # default, which would stretch one request to four timeouts.
            config = kubernetes.client.Configuration.get_default_copy()
            config.retries = False
            api_client = kubernetes.client.ApiClient(config)
        self.client = api_client

    def _send(self, method: str, path: str, body: Obj | None = None) -> Obj:
        headers = {**self.client.default_headers, "Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = "application/json"
        self.client.update_params_for_auth(headers, [], ["BearerToken"], path, method, body)
        resp = self.client.rest_client.request(method, self.client.configuration.host + path, headers=headers,
                                               body=body, _request_timeout=self.timeout)
        data = resp.read()
        if not 200 <= resp.status <= 299:
            raise ApiException.from_response(http_resp=resp, body=None, data=None)
        return json.loads(data)

    def _collection(self) -> str:
        return PATH.format(namespace=quote(self.namespace))

    def get(self) -> Obj | None:
        try:
            return self._send("GET", f"{self._collection()}/{quote(self.name)}")
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def create(self, spec: Obj) -> Obj | None:
        body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": self.name, "namespace": self.namespace}, "spec": spec}
        try:
            return self._send("POST", self._collection(), body)
        except ApiException as e:
            if e.status == 409:
                return None
            raise

    def replace(self, lease: Obj) -> Obj | None:
        try:
            return self._send("PUT", f"{self._collection()}/{quote(self.name)}", lease)
        except ApiException as e:
            if e.status == 409:
                return None
            raise


class Elector:
    """One candidate. `acquire()` blocks until it leads; `keep()` renews in the background
    and calls `on_lost` (default: exit the process) when leadership ends; `release()` hands
    the Lease back on a clean shutdown, so a waiting replica takes over at once."""

    def __init__(self, client: LeaseClient, candidate: str, timing: Timing = Timing(),
                 clock: Callable[[], float] = time.monotonic,
                 now: Callable[[], datetime] = lambda: datetime.now(timezone.utc),
                 sleep: Callable[[float], None] = time.sleep):
        self.client, self.identity, self.timing = client, candidate, timing
        self.clock, self.now, self.sleep = clock, now, sleep
        self._seen: tuple | None = None  # (holder, renewTime, resourceVersion) last read
        self._seen_at = 0.0  # when it last changed, by our clock
        self._told: str | None = None  # the holder we last logged
        self.renewed_at: float | None = None  # start of our last successful write
        self.answered_at = clock()  # when the API server last answered us (or we started)
        self.leading = threading.Event()
        self._stop = threading.Event()
        self._lost = threading.Lock()
        self._renewer: threading.Thread | None = None

    # ------------------------------------------------------------------ one step

    def try_acquire_or_renew(self) -> bool:
        """One round: True when we hold the Lease after it (taken or renewed)."""
        started, now = self.clock(), self.now()
        lease = self.client.get()
        # A waiter dates what it read by when the answer came, not when it asked: the
        # record may be a renewal that landed while the request was on its way.
        read_at = self.answered_at = self.clock()
        if lease is None:
            if self.client.create({**self._spec(now, None), "leaseTransitions": 0}) is None:
                return False
            return self._won(started, now)
        spec = lease.get("spec") or {}
        holder = spec.get("holderIdentity") or ""
        seen = (holder, spec.get("renewTime"), lease["metadata"].get("resourceVersion"))
        if seen != self._seen:
            self._seen, self._seen_at = seen, read_at
        if holder and holder != self.identity:
            if self.leading.is_set():
                return False  # someone took it from us: lost, whatever the clock says
            duration = spec.get("leaseDurationSeconds") or self.timing.lease_seconds
            if read_at < self._seen_at + duration:
                if holder != self._told:
                    log.info("leader election: %s leads; this replica (%s) waits", holder, self.identity)
                    self._told = holder
                return False
            log.info("leader election: %s has not renewed the lease for %gs; taking over", holder, duration)
        lease = {**lease, "spec": self._spec(now, spec if holder == self.identity else None)}
        if holder != self.identity:
            lease["spec"]["leaseTransitions"] = (spec.get("leaseTransitions") or 0) + 1
        if self.client.replace(lease) is None:
            return False
        return self._won(started, now)

    def _spec(self, now: datetime, held: Obj | None) -> Obj:
        """Our record: `held` is the spec we already hold (renewal), None for a take-over."""
        spec = {"holderIdentity": self.identity, "leaseDurationSeconds": self.timing.lease_seconds,
                "acquireTime": (held or {}).get("acquireTime") or micro_time(now), "renewTime": micro_time(now)}
        if held is not None:
            spec["leaseTransitions"] = held.get("leaseTransitions") or 0
        return spec

    def _won(self, started: float, now: datetime) -> bool:
        # The leader counts its deadline from before it asked: the earliest its write
        # could have been seen.
        self.renewed_at = started
        self._seen, self._seen_at = (self.identity, micro_time(now), None), started
        return True

    # ------------------------------------------------------------------ the loops

    def acquire(self) -> bool:
        """Blocks until this candidate holds the Lease (True), or `release()` stopped it."""
        log.info("leader election: candidate %s for lease %s/%s", self.identity, self.client.namespace,
                 self.client.name)
        failures = 0
        while not self._stop.is_set():
            try:
                if self.try_acquire_or_renew():
                    self.leading.set()
                    log.info("leader election: %s leads", self.identity)
                    return True
                failures = 0
            except Exception as e:  # noqa: BLE001 - the API server away: try again
                if failures % 30 == 0:  # once, then about once a minute
                    log.warning("leader election: cannot read or write the lease %s/%s: %s",
                                self.client.namespace, self.client.name, _short(e))
                failures += 1
            self.sleep(self.timing.retry_period)
        return False

    def waiting_healthy(self) -> bool:
        """A waiting replica is healthy while the API server answers it: one that has not
        heard back for two lease durations (403, 5xx, no route) fails its probe and is
        restarted, rather than standing Ready with no chance to lead."""
        return self.clock() - self.answered_at <= 2 * self.timing.lease_duration

    def keep(self, on_lost: Callable[[str], None] | None = None) -> None:
        """Renews in a thread; a watchdog thread calls `on_lost(why)` once leadership ends
        (another holder, or no renewal within the renew deadline)."""
        lost = on_lost or exit_now

        def fire(why: str) -> None:
            if self._stop.is_set() or not self._lost.acquire(blocking=False):
                return  # stopping on purpose, or already fired
            self.leading.clear()
            lost(why)

        def renew() -> None:
            while not self._stop.wait(self.timing.retry_period) and self.leading.is_set():
                try:
                    if not self.try_acquire_or_renew():
                        holder = (self._seen or ("",))[0]
                        if holder and holder != self.identity:
                            fire(f"lease taken by {holder}")
                            return
                except Exception as e:  # noqa: BLE001 - retried until the deadline
                    log.warning("leader election: renewing the lease failed: %s", _short(e))

        def watchdog() -> None:
            while not self._stop.is_set() and self.leading.is_set():
                assert self.renewed_at is not None
                late = self.clock() - self.renewed_at
                if late > self.timing.renew_deadline:
                    fire(f"no renewal of the lease for {late:.1f}s (renew deadline "
                         f"{self.timing.renew_deadline:g}s)")
                    return
                self._stop.wait(self.timing.watchdog_period)

        self._renewer = threading.Thread(target=renew, name="leader-renew", daemon=True)
        self._renewer.start()
        threading.Thread(target=watchdog, name="leader-watchdog", daemon=True).start()

    def release(self) -> None:
        """A clean shutdown: stop renewing and hand the Lease back (holder emptied), so a
        waiting replica need not wait out the lease duration. Best effort."""
        self._stop.set()
        if self._renewer is not None:  # a renewal in flight would race the release
            self._renewer.join(self.timing.request_timeout * 2 + 1)
        if not self.leading.is_set():
            return
        self.leading.clear()
        try:
            lease = self.client.get()
            if lease and (lease.get("spec") or {}).get("holderIdentity") == self.identity:
                spec = {**lease["spec"], "holderIdentity": "", "leaseDurationSeconds": 1,
                        "renewTime": micro_time(self.now())}
                if self.client.replace({**lease, "spec": spec}) is not None:
                    log.info("leader election: %s released the lease", self.identity)
                    return
            log.warning("leader election: could not release the lease (it changed); the next "
                        "leader waits out its duration")
        except Exception as e:  # noqa: BLE001 - the next leader waits out the lease instead
            log.warning("leader election: releasing the lease failed: %s", _short(e))


def exit_now(why: str) -> None:
    """Leadership lost: stop at once, mid-write or not (another replica may be about to
    take over, and two leaders must never write); the kubelet restarts the container. The
    log line gets a fifth of a second: a stuck log handler must not hold the exit back."""
    line = threading.Thread(target=log.error, daemon=True, args=(
        "leader election: leadership lost (%s); exiting so that only one replica acts", why))
    line.start()
    line.join(0.2)
    for handler in logging.getLogger().handlers:
        try:
            handler.flush()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass
    os._exit(1)


def _short(e: Exception) -> str:
    if isinstance(e, ApiException):
        return f"{e.status} {e.reason}"
    return f"{type(e).__name__}: {e}"[:300]


class FollowerHealth:
    """While this replica waits for the Lease, its liveness endpoint (the one kopf serves
    once it leads) answers 200 while `healthy()`, so the kubelet neither restarts nor
    unreadies a healthy standby, and 503 otherwise. Closed before kopf binds the same
    address."""

    def __init__(self, url: str, healthy: Callable[[], bool] = lambda: True):
        parts = urlsplit(url)
        path = parts.path or "/"

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - the stdlib's name
                ok = self.path.split("?")[0] == path
                well = ok and healthy()
                body = (b'{"leader": false}' if well else b'{"leader": false, "apiServer": "unreachable"}') \
                    if ok else b"not found"
                self.send_response(200 if well else 503 if ok else 404)
                self.send_header("Content-Type", "application/json" if ok else "text/plain")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        class Server(http.server.ThreadingHTTPServer):
            allow_reuse_address = True  # kopf binds the same address right after
            daemon_threads = True

        self.server = Server((parts.hostname or "0.0.0.0", parts.port or 80), Handler)
        threading.Thread(target=self.server.serve_forever, name="follower-health", daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
