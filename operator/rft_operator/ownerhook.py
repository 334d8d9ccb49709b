"""The owner webhook: what the operator's identity writes must belong to an RFTJob that exists.

On in every install (manifests/base/owner-webhook*.yaml, the chart's templates of the same
names). For each CREATE or UPDATE (a PATCH arrives as one) by the operator's ServiceAccount
of an object labelled as the operator's, it looks up the RFTJob the object's job label
names (from a watch of that namespace's RFTJobs, `WatchedJobs`; read through to etcd before
it refuses) and refuses unless:

* that RFTJob exists (a made-up job `ghost` beside a real `demo` gets nothing: no pod that
  reads the namespace's Secrets);
* the object has exactly one owner reference, the controller reference to that RFTJob with
  its uid (an Event: its object is that RFTJob);
* a pod being created is one that job's spec renders (`check_pod`): only the Secrets the
  spec names, a claim or a host path only as the spec's model cache (the very path, on
  trainer pods), only the capabilities and seccomp profile the spec sets. In a namespace
  labelled rft.dev/pod-security=privileged, where the admission policy lets host paths
  and capabilities through, this is what holds a forged pod to its job's own spec.

One lookup per write, whatever the number of jobs, and no API request for it once the
namespace is watched: a ValidatingAdmissionPolicy could only
compare an object with every RFTJob of the namespace, one evaluation each per request
(`paramRef.selector`), which made each wave of jobs quadratic (issue 38).

The configuration matches only that identity and those labels (a matchCondition and an
objectSelector), so nothing else in the cluster waits on it; it fails closed (an operator
that cannot answer creates nothing, and its own writes are retried). Every replica serves
it (`--webhook-port`, `--webhook-cert-dir` holding tls.crt and tls.key, re-read when they
change, so a new pair needs no restart).

The serving pair: the install's Job runs `python -m rft_operator.ownerhook certs` as its own
ServiceAccount: it keeps the Secret's pair while current, else writes a new self-signed CA
and pair, then sets the configuration's caBundle. The operator's identity can neither read
that Secret nor change the configuration.
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import json
import logging
import math
import os
import socket
import ssl
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml

from rft_contract import names
from rft_contract.trackers import SECRET_PATHS, TRACKERS

log = logging.getLogger("rft_operator.ownerhook")

WEBHOOK_NAME = "rftjob-operator-owner"
SERVICE_NAME = "rftjob-operator-webhook"
TLS_SECRET = "rftjob-operator-webhook-tls"
OPERATOR_NAMESPACE = "rftjob-system"
PATH = "/validate-owner"
DEFAULT_PORT = 9443
# An AdmissionReview of the biggest pod the operator renders is a few KiB; anything this
# large is not one (the port is reachable from the pod network, unauthenticated).
MAX_BODY = 2 << 20
# Connections served at once, each on a thread of its own; past this a new one is closed.
# The API server opens one per request in flight (a wave of jobs: dozens) and keeps them
# alive between requests, so each is one TLS handshake for many reviews; one left idle
# is closed after IDLE_SECONDS.
MAX_CONNECTIONS = 128
IDLE_SECONDS = 30
# Reviews worked on at once (the others wait, without taking the GIL): a wave's hundred
# runnable threads starved the operator's own (its lease renewal among them) in one process.
MAX_REVIEWS = 4
CERT_DIR = "/etc/rftjob-operator/webhook"
# The install's Job makes a new pair when the one in the Secret ends within this.
RENEW_BEFORE = dt.timedelta(days=90)
# Kinds the operator creates for a job (plural resource -> API group).
RESOURCES = {"pods": "", "services": "", "configmaps": "", "serviceaccounts": "", "events": "",
             "roles": "rbac.authorization.k8s.io", "rolebindings": "rbac.authorization.k8s.io"}
EVENTS_V1 = "events.k8s.io"
MODEL_CACHE_VOLUME = "model-cache"

# Every write that can set what an object claims (a PATCH arrives as an UPDATE).
OPERATIONS = ["CREATE", "UPDATE"]
# (namespace, name) -> the RFTJob as a dict, or None when there is none.
GetJob = Callable[[str, str], "dict[str, Any] | None"]


def claims(obj: dict[str, Any], resource: str) -> tuple[str, list[dict[str, Any]]]:
    """The job an object claims to belong to (its job label) and what it says refers to
    that job: its owner references, or an Event's object (core `involvedObject`,
    events.k8s.io `regarding`)."""
    meta = obj.get("metadata") or {}
    job = (meta.get("labels") or {}).get(names.LABEL_JOB, "")
    if resource == "events":
        return job, [obj.get("involvedObject") or obj.get("regarding") or {}]
    return job, list(meta.get("ownerReferences") or [])


def _is_controller_ref(ref: dict[str, Any], name: str, uid: str) -> bool:
    return (ref.get("kind") == names.KIND and str(ref.get("apiVersion") or "").startswith(names.GROUP + "/")
            and ref.get("name") == name and ref.get("uid") == uid and ref.get("controller") is True)


def spec_secrets(spec: dict[str, Any]) -> set[str]:
    """The Secrets a job's spec names: what its pods may read, key by key."""
    named = {(spec.get("checkpoint") or {}).get("credentialsSecret"),
             *(t.secret_in(spec.get("tracking")) for t in TRACKERS.values())}
    for part in ("trainer", "inference"):
        for e in (spec.get(part) or {}).get("env") or []:
            named.add((((e.get("valueFrom") or {}).get("secretKeyRef")) or {}).get("name"))
    return {n for n in named if n}


def check_pod(pod: dict[str, Any], spec: dict[str, Any]) -> str | None:
    """Why a pod is not one the job's spec renders (None: it may be): it reads only the
    Secrets the spec names, mounts a claim or a host path only as the model cache the spec
    names (the host path on trainer pods), adds only the capabilities and asks only for the
    seccomp profile `spec.trainer.securityContext` sets. The rest of the pod is the
    admission policy's (rftjob-operator-scope) and Pod Security's; this narrows what they
    let through, in a namespace labelled rft.dev/pod-security=privileged too, to this very
    job's spec."""
    pod_spec = pod.get("spec") or {}
    role = ((pod.get("metadata") or {}).get("labels") or {}).get(names.LABEL_ROLE, "")
    containers = list(pod_spec.get("containers") or []) + list(pod_spec.get("initContainers") or [])
    secrets = spec_secrets(spec)
    for c in containers:
        for e in c.get("env") or []:
            ref = (e.get("valueFrom") or {}).get("secretKeyRef")
            if ref is not None and ref.get("name") not in secrets:
                return ("the rftjob-operator's pods read only the Secrets their RFTJob's spec names "
                        f"(checkpoint.credentialsSecret, {', '.join(SECRET_PATHS)}, "
                        f"trainer.env and inference.env secretKeyRefs): not {ref.get('name')!r}")
    cache = (spec.get("model") or {}).get("cache") or {}
    for v in pod_spec.get("volumes") or []:
        if "persistentVolumeClaim" in v and not (
                v.get("name") == MODEL_CACHE_VOLUME and cache.get("persistentVolumeClaim")
                and (v["persistentVolumeClaim"] or {}).get("claimName") == cache["persistentVolumeClaim"]):
            return ("the rftjob-operator mounts only what the job's spec renders: a PersistentVolumeClaim only as "
                    "the model cache spec.model.cache.persistentVolumeClaim names")
        if "hostPath" in v and not (
                v.get("name") == MODEL_CACHE_VOLUME and role == names.ROLE_TRAINER and cache.get("hostPath")
                and (v["hostPath"] or {}).get("path") == cache["hostPath"]):
            return ("the rftjob-operator mounts only what the job's spec renders: a host path only as a trainer "
                    "pod's model cache, at the path spec.model.cache.hostPath names")
    security = (spec.get("trainer") or {}).get("securityContext") or {}
    capabilities = set(security.get("addCapabilities") or [])
    seccomp = {"RuntimeDefault", security.get("seccompProfile") or "RuntimeDefault"}
    contexts = [pod_spec.get("securityContext") or {}] + [c.get("securityContext") or {} for c in containers]
    for sc in contexts:
        added = set((sc.get("capabilities") or {}).get("add") or [])
        if not added <= capabilities:
            return ("the rftjob-operator adds only the capabilities spec.trainer.securityContext.addCapabilities "
                    f"names: not {', '.join(sorted(added - capabilities))}")
        profile = (sc.get("seccompProfile") or {}).get("type")
        if profile is not None and profile not in seccomp:
            return ("the rftjob-operator asks only for the seccomp profile spec.trainer.securityContext."
                    f"seccompProfile sets (RuntimeDefault by default): not {profile}")
        if sc.get("procMount", "Default") != "Default":
            return "the rftjob-operator's containers see a masked /proc (procMount Default)"
    return None


def check(namespace: str, obj: dict[str, Any], resource: str, get_job: GetJob, operation: str = "CREATE") -> str | None:
    """Why the object may not be written (None: it may). It must belong to an RFTJob that
    exists: exactly one owner reference, the controller reference to the RFTJob its job label
    names, with that RFTJob's uid (an Event: its object, that RFTJob). A pod being created
    must be one that RFTJob's spec renders (`check_pod`; a pod's spec cannot change after).
    A `get_job` that reads from a cache has `fresh`, a read through to etcd: a refusal on a
    cached read (a job just created or re-created, a spec just changed) is checked again on
    a fresh one, so a stale cache never refuses. `get_job` raising is not an answer: the
    caller refuses with what it raised."""
    job, refs = claims(obj, resource)
    if not job:
        return f"the rftjob-operator's objects carry the label {names.LABEL_JOB}"
    reason = _check_against(namespace, job, refs, obj, resource, operation, get_job(namespace, job))
    fresh = getattr(get_job, "fresh", None)
    if reason is not None and fresh is not None:
        reason = _check_against(namespace, job, refs, obj, resource, operation, fresh(namespace, job))
    return reason


def _check_against(namespace: str, job: str, refs: list[dict[str, Any]], obj: dict[str, Any], resource: str,
                   operation: str, found: dict[str, Any] | None) -> str | None:
    """`check` with the RFTJob as read (None: there is none)."""
    if found is None:
        return (f"the rftjob-operator's objects belong to an RFTJob that exists: there is no RFTJob "
                f"{namespace}/{job}")
    uid = (found.get("metadata") or {}).get("uid") or ""
    # (Never the uid itself in a message: anyone on the pod network can ask this server.)
    if resource == "events":
        about = refs[0] if refs else {}
        if about.get("uid") != uid or about.get("name") != job or about.get("kind") != names.KIND:
            return (f"the rftjob-operator's objects belong to an RFTJob that exists: the object the Event is "
                    f"about is not RFTJob {namespace}/{job} (by kind, name and uid)")
        return None
    if len(refs) != 1 or not _is_controller_ref(refs[0], job, uid):
        return (f"the rftjob-operator's objects belong to an RFTJob that exists: exactly one owner reference, "
                f"the controller reference to RFTJob {namespace}/{job} with its uid (this object has "
                f"{len(refs)}{', none of them that' if refs else ''})")
    if resource == "pods" and operation == "CREATE":
        return check_pod(obj, found.get("spec") or {})
    return None


def review(body: dict[str, Any], get_job: GetJob) -> dict[str, Any]:
    """An AdmissionReview answered: allowed, or refused with a message that says why."""
    request = body.get("request") or {}
    response: dict[str, Any] = {"uid": request.get("uid", ""), "allowed": True}
    operation = request.get("operation")
    if operation in ("CREATE", "UPDATE"):
        resource = (request.get("resource") or {}).get("resource", "")
        try:
            reason = check(request.get("namespace") or "", request.get("object") or {}, resource, get_job, operation)
        except Exception as e:  # noqa: BLE001 - fail closed, and say why
            reason = f"cannot look the RFTJob up: {type(e).__name__}: {e}"
            log.warning("owner webhook: %s", reason)
        if reason is not None:
            response = {"uid": response["uid"], "allowed": False,
                        "status": {"code": 403, "reason": "Forbidden", "message": reason}}
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response}


class ApiJobs:
    """`GetJob` over the API server with the operator's own credentials: read from the API
    server's watch cache (`resourceVersion=0`: no etcd round trip, which at hundreds of
    writes a second is most of a lookup's cost); `fresh` reads through to etcd. A job the
    operator writes children for is one it has seen through that same cache, so the cached
    read finds it; `check` asks `fresh` before it refuses, so a stale cache never refuses a
    real job (a cached job that was just deleted may admit a child, which the garbage
    collector then removes)."""

    def __init__(self, api_client: Any):
        self.api_client = api_client

    def _get(self, namespace: str, name: str, query: list[tuple[str, str]]) -> dict[str, Any] | None:
        import kubernetes

        path = f"/apis/{names.GROUP}/{names.VERSION}/namespaces/{namespace}/{names.PLURAL}/{name}"
        headers = {"Accept": "application/json"}
        client = self.api_client
        try:
            if hasattr(client, "param_serialize"):  # kubernetes >= 35 (the newer generator)
                method, url, headers, _, _ = client.param_serialize("GET", path, query_params=query,
                                                                    header_params=headers, auth_settings=["BearerToken"])
                r = client.call_api(method, url, header_params=headers, _request_timeout=(3, 5))
                r.read()
            else:
                r = client.call_api(path, "GET", query_params=query, header_params=headers, auth_settings=["BearerToken"],
                                    _preload_content=False, _request_timeout=(3, 5))
        except kubernetes.client.ApiException as e:
            if e.status == 404:
                return None
            raise
        if r.status == 404:
            return None
        if not 200 <= r.status < 300:
            raise kubernetes.client.ApiException(status=r.status, reason=r.reason)
        return json.loads(r.data)

    def __call__(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self._get(namespace, name, [("resourceVersion", "0")])

    def fresh(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self._get(namespace, name, [])


class WatchedJobs:
    """`GetJob` from a watch of each namespace's RFTJobs: a lookup is a dict read, no request
    to the API server. A namespace is watched once a lookup there has found an RFTJob on the
    API server (so what a request names starts nothing by itself: this port answers anyone
    on the pod network), at most MAX_NAMESPACES at once, and no longer once it holds no
    RFTJob. Lookups go to the API server as `ApiJobs` does until the watch has listed the
    namespace, and again whenever it has heard nothing for STALE_SECONDS (each watch ends
    after WATCH_SECONDS and is resumed, so a live one is heard from) or has failed until it
    lists again.

    `fresh` always reads through to etcd, and `check` asks it before refusing, so a watch
    that is behind (a job just created or re-created, a spec just changed) never refuses a
    real job's child. One that is behind may admit what a fresh read would refuse, for as
    long as it is behind (normally well under a second; at most STALE_SECONDS): a child of a
    job just deleted, which the garbage collector removes, or a new pod reading a Secret
    that an edit of the spec has just dropped, which the spec named a moment before.

    Why: each lookup held one of the server's few review slots for an API round trip, and at
    a wave's hundred writes a second the reviews queued (448 ms a call at 100 jobs, on a path
    of about nine writes per job; issue 38). Only what `check` reads is kept (uid, spec)."""

    MAX_NAMESPACES = 512
    WATCH_SECONDS = 60
    STALE_SECONDS = 150.0
    RETRY_MAX = 30.0

    def __init__(self, api_client: Any, clock: Callable[[], float] = time.monotonic):
        self.api = ApiJobs(api_client)
        self.api_client = api_client
        self.clock = clock
        self._jobs: dict[tuple[str, str], dict[str, Any]] = {}
        self._heard: dict[str, float] = {}  # namespace -> when its watch last listed or heard
        self._watched: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def __call__(self, namespace: str, name: str) -> dict[str, Any] | None:
        with self._lock:
            if self.clock() - self._heard.get(namespace, -math.inf) < self.STALE_SECONDS:
                return self._jobs.get((namespace, name))
        found = self.api(namespace, name)
        if found is not None:
            self._start(namespace)
        return found

    def fresh(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.api.fresh(namespace, name)

    def watching(self, namespace: str) -> bool:
        """Whether lookups in the namespace come from its watch."""
        with self._lock:
            return self.clock() - self._heard.get(namespace, -math.inf) < self.STALE_SECONDS

    def close(self) -> None:
        """Ends the watches (at their next event, or within WATCH_SECONDS)."""
        self._stop.set()

    def _start(self, namespace: str) -> None:
        with self._lock:
            if namespace in self._watched or len(self._watched) >= self.MAX_NAMESPACES or self._stop.is_set():
                return
            self._watched.add(namespace)
        try:
            threading.Thread(target=self._watch, args=(namespace,), name=f"owner-webhook-jobs-{namespace}",
                             daemon=True).start()
        except BaseException:
            with self._lock:
                self._watched.discard(namespace)
            raise

    @staticmethod
    def _kept(job: dict[str, Any]) -> dict[str, Any]:
        meta = job.get("metadata") or {}
        return {"metadata": {"name": meta.get("name"), "namespace": meta.get("namespace"), "uid": meta.get("uid")},
                "spec": job.get("spec") or {}}

    def _watch(self, namespace: str) -> None:
        """List, then watch from the list's version, resumed every WATCH_SECONDS; list again
        after a failure (at once on 410 Gone, else after a back-off); stop once the
        namespace holds no RFTJob."""
        import kubernetes

        delay, warned = 1.0, False
        try:
            while not self._stop.is_set():
                try:
                    listed = self._list(namespace)
                    version = (listed.get("metadata") or {}).get("resourceVersion")
                    with self._lock:
                        for key in [k for k in self._jobs if k[0] == namespace]:
                            del self._jobs[key]
                        for job in listed.get("items") or []:
                            self._jobs[(namespace, job["metadata"]["name"])] = self._kept(job)
                        self._heard[namespace] = self.clock()
                    delay, warned = 1.0, False
                    while version and not self._stop.is_set():
                        version = self._follow(namespace, version)
                        with self._lock:
                            if not any(k[0] == namespace for k in self._jobs):
                                return  # no RFTJob left here: a lookup that finds one starts a new watch
                except kubernetes.client.ApiException as e:
                    self._forget(namespace)
                    if e.status == 410:
                        continue  # too old a version: list again at once
                    warned = self._failed(namespace, e, warned)
                    self._stop.wait(delay)
                    delay = min(delay * 2, self.RETRY_MAX)
                except Exception as e:  # noqa: BLE001 - lookups go to the API server meanwhile; retried
                    self._forget(namespace)
                    warned = self._failed(namespace, e, warned)
                    self._stop.wait(delay)
                    delay = min(delay * 2, self.RETRY_MAX)
        finally:
            self._forget(namespace, watched=False)

    def _forget(self, namespace: str, watched: bool = True) -> None:
        """Lookups in the namespace go to the API server again (and, with `watched` False,
        its watch has ended)."""
        with self._lock:
            self._heard.pop(namespace, None)
            for key in [k for k in self._jobs if k[0] == namespace]:
                del self._jobs[key]
            if not watched:
                self._watched.discard(namespace)

    @staticmethod
    def _failed(namespace: str, e: Exception, warned: bool) -> bool:
        (log.debug if warned else log.warning)(
            "owner webhook: the watch of RFTJobs in %s failed (%s: %s); looking them up on the API server "
            "until it lists again", namespace, type(e).__name__, e)
        return True

    def _list(self, namespace: str) -> dict[str, Any]:
        import kubernetes

        return kubernetes.client.CustomObjectsApi(self.api_client).list_namespaced_custom_object(
            names.GROUP, names.VERSION, namespace, names.PLURAL, _request_timeout=(5, 30))

    def _events(self, namespace: str, version: str) -> Iterator[dict[str, Any]]:
        """The watch's events from `version` until the API server ends it (the client
        raises ApiException for an ERROR event: 410 when `version` is too old)."""
        import kubernetes

        watch = kubernetes.watch.Watch()
        custom = kubernetes.client.CustomObjectsApi(self.api_client)
        try:
            yield from watch.stream(custom.list_namespaced_custom_object, names.GROUP, names.VERSION, namespace,
                                    names.PLURAL, resource_version=version, allow_watch_bookmarks=True,
                                    timeout_seconds=self.WATCH_SECONDS, _request_timeout=(5, self.WATCH_SECONDS + 30))
        finally:
            watch.stop()

    def _follow(self, namespace: str, version: str) -> str:
        """One watch from `version`, applied to the cache: the version to resume from."""
        for event in self._events(namespace, version):
            if self._stop.is_set():
                break
            kind, job = event.get("type"), event.get("object") or {}
            meta = job.get("metadata") or {}
            version = meta.get("resourceVersion") or version
            with self._lock:
                self._heard[namespace] = self.clock()
                if kind == "DELETED":
                    self._jobs.pop((namespace, meta.get("name")), None)
                elif kind in ("ADDED", "MODIFIED"):
                    self._jobs[(namespace, meta.get("name"))] = self._kept(job)
        with self._lock:  # ended by the API server after WATCH_SECONDS: it was live until now
            if namespace in self._heard:
                self._heard[namespace] = self.clock()
        return version


def api_get_job(api_client: Any) -> GetJob:
    """`GetJob` over the API server: from per-namespace watches (`WatchedJobs`)."""
    return WatchedJobs(api_client)


class _Certificates:
    """The serving certificate, loaded again when its files change (a rotated Secret)."""

    def __init__(self, cert_dir: Path):
        self.cert, self.key = cert_dir / "tls.crt", cert_dir / "tls.key"
        self._lock = threading.Lock()
        self._stamp: tuple[float, float] | None = None
        self.context = self._load()

    def _stamp_now(self) -> tuple[float, float]:
        return self.cert.stat().st_mtime, self.key.stat().st_mtime

    def _load(self) -> ssl.SSLContext:
        stamp = self._stamp_now()  # before reading: a change while loading is seen next time
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self.cert, self.key)
        context.sni_callback = self._fresh
        self._stamp = stamp
        return context

    def stamp(self) -> tuple[float, float] | None:
        """The loaded pair's files' stamp."""
        return self._stamp

    def changed_since(self, stamp: tuple[float, float] | None) -> bool:
        """Whether the files are no longer those of `stamp` (a new pair to present)."""
        try:
            return self._stamp_now() != stamp
        except OSError:
            return False

    def _fresh(self, sock: ssl.SSLSocket, _server_name: str | None, _context: ssl.SSLContext) -> None:
        try:
            stamp = self._stamp_now()
            with self._lock:
                if stamp != self._stamp:
                    self.context = self._load()
                    log.info("owner webhook: loaded the rotated certificate from %s", self.cert.parent)
            sock.context = self.context
        except (OSError, ssl.SSLError) as e:  # half-written files: keep the old pair
            log.warning("owner webhook: keeping the loaded certificate (%s)", e)


class OwnerWebhook:
    """The HTTPS server, on daemon threads; `stop()` ends it."""

    def __init__(self, port: int, cert_dir: str | Path, get_job: GetJob, addr: str = "0.0.0.0"):
        certificates = _Certificates(Path(cert_dir))

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive: every answer carries its Content-Length
            timeout = IDLE_SECONDS
            # The head and the body of an answer are two writes: with Nagle's algorithm the
            # body waited for the client's delayed ACK of the head, 40 ms a review.
            disable_nagle_algorithm = True

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                if self.path.split("?", 1)[0] != PATH:
                    self.send_error(404)
                    return
                try:
                    length = int(self.headers.get("Content-Length") or 0)
                except ValueError:
                    length = -1
                if not 0 < length <= MAX_BODY:
                    self.send_error(413 if length > MAX_BODY else 400, "not an AdmissionReview")
                    return
                try:
                    body = json.loads(self.rfile.read(length))
                except ValueError:
                    self.send_error(400, "not an AdmissionReview")
                    return
                if not isinstance(body, dict):
                    self.send_error(400, "not an AdmissionReview")
                    return
                with reviewing:  # a few at once: the operator's own threads keep their share of the GIL
                    out = json.dumps(review(body, get_job)).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                if certificates.changed_since(getattr(self.connection, "rft_stamp", None)):
                    # A new pair on disk: the client's next request comes on a new
                    # connection, whose handshake presents it.
                    self.close_connection = True
                    self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, fmt: str, *args: Any) -> None:
                log.debug("owner webhook: " + fmt, *args)

        slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        reviewing = threading.BoundedSemaphore(MAX_REVIEWS)
        # Open connections (kept alive between requests), closed by stop().
        live: set[Any] = set()
        live_lock = threading.Lock()
        self._live, self._live_lock = live, live_lock

        class Server(ThreadingHTTPServer):
            daemon_threads = True
            request_queue_size = MAX_CONNECTIONS  # the listen backlog (socketserver's default is 5)

            def get_request(self):
                sock, address = super().get_request()
                return certificates.context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False), address

            def process_request(self, request, client_address) -> None:
                if not slots.acquire(blocking=False):  # busy: close rather than queue threads
                    self.shutdown_request(request)
                    return
                with live_lock:
                    live.add(request)
                try:
                    super().process_request(request, client_address)
                except BaseException:
                    slots.release()
                    raise

            def process_request_thread(self, request, client_address) -> None:
                try:
                    super().process_request_thread(request, client_address)
                finally:
                    with live_lock:
                        live.discard(request)
                    slots.release()

            def finish_request(self, request, client_address) -> None:
                try:
                    request.settimeout(10)
                    request.do_handshake()
                    request.rft_stamp = certificates.stamp()  # the pair this connection presents
                except (OSError, ssl.SSLError) as e:
                    log.debug("owner webhook: handshake with %s failed: %s", client_address, e)
                    return
                super().finish_request(request, client_address)

        self._get_job = get_job
        self.server = Server((addr, port), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, name="owner-webhook", daemon=True).start()
        log.info("serving the owner webhook on %s:%d%s", addr, self.port, PATH)

    def stop(self) -> None:
        """No new connections, and the open ones closed: nothing is answered after this."""
        self.server.shutdown()
        self.server.server_close()
        if (close := getattr(self._get_job, "close", None)) is not None:
            close()  # the lookups' watches
        with self._live_lock:
            for sock in list(self._live):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


# ---------------------------------------------------------------- what an installer applies


def webhook_configuration(ca_bundle: bytes | None, *, service: tuple[str, str] | None = (OPERATOR_NAMESPACE, SERVICE_NAME),
                          url: str | None = None, namespace_selector: dict | None = None) -> dict[str, Any]:
    """The ValidatingWebhookConfiguration: CREATE of the operator's labelled objects, by its
    identity only, answered by the operator (`service`) or at `url` (tests), failing closed."""
    from .policygen import OPERATOR_IDENTITY
    from .queueing import GROUP as KUEUE_GROUP, VERSION as KUEUE_VERSION

    client: dict[str, Any] = {} if ca_bundle is None else {"caBundle": base64.b64encode(ca_bundle).decode()}
    if url is not None:
        client["url"] = url + PATH
    else:
        client["service"] = {"namespace": service[0], "name": service[1], "path": PATH, "port": 443}
    rules = [{"apiGroups": [group], "apiVersions": ["v1"], "operations": list(OPERATIONS), "resources": [plural],
              "scope": "Namespaced"} for plural, group in RESOURCES.items()]
    rules.append({"apiGroups": [EVENTS_V1], "apiVersions": ["v1"], "operations": list(OPERATIONS),
                  "resources": ["events"], "scope": "Namespaced"})
    rules.append({"apiGroups": [KUEUE_GROUP], "apiVersions": [KUEUE_VERSION], "operations": list(OPERATIONS),
                  "resources": ["workloads"], "scope": "Namespaced"})  # a queued job's (queueing.py)
    hook: dict[str, Any] = {
        "name": f"{WEBHOOK_NAME}.{names.GROUP}",
        "clientConfig": client,
        "rules": rules,
        "objectSelector": {"matchLabels": {names.LABEL_MANAGED_BY: names.MANAGED_BY}},
        "matchConditions": [OPERATOR_IDENTITY],
        "failurePolicy": "Fail",
        "sideEffects": "None",
        "timeoutSeconds": 10,
        "admissionReviewVersions": ["v1"],
    }
    if namespace_selector is not None:
        hook["namespaceSelector"] = namespace_selector
    return {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
            "metadata": {"name": WEBHOOK_NAME}, "webhooks": [hook]}


def serving_pair(hosts: list[str], days: int = 3650) -> tuple[bytes, bytes, bytes]:
    """A new CA and a serving certificate for `hosts` (DNS names or IP addresses) it signs:
    (ca.crt, tls.crt, tls.key), PEM."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = dt.datetime.now(dt.timezone.utc)

    def build(subject: str, key, issuer: x509.Name, signer, ca: bool):
        usage = dict(digital_signature=not ca, content_commitment=False, key_encipherment=False,
                     data_encipherment=False, key_agreement=False, key_cert_sign=ca, crl_sign=ca,
                     encipher_only=False, decipher_only=False)
        b = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
             .issuer_name(issuer).public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
             .add_extension(x509.KeyUsage(**usage), critical=True)
             .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
             .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(signer.public_key()), critical=False))
        if not ca:
            alt_names: list[x509.GeneralName] = []
            for h in hosts:
                try:
                    alt_names.append(x509.IPAddress(ipaddress.ip_address(h)))
                except ValueError:
                    alt_names.append(x509.DNSName(h))
            b = (b.add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
                 .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False))
        return b.sign(signer, hashes.SHA256())

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = build(f"{WEBHOOK_NAME}-ca", ca_key, x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{WEBHOOK_NAME}-ca")]),
               ca_key, ca=True)
    cert = build(hosts[0], key, ca.subject, ca_key, ca=False)
    pem = serialization.Encoding.PEM
    return (ca.public_bytes(pem), cert.public_bytes(pem),
            key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))


def service_hosts(namespace: str) -> list[str]:
    """The names the API server calls the webhook by (the Service's)."""
    return [f"{SERVICE_NAME}.{namespace}.svc", f"{SERVICE_NAME}.{namespace}.svc.cluster.local"]


def is_pair_current(data: dict[str, bytes], hosts: list[str], now: dt.datetime | None = None,
                    renew_before: dt.timedelta = RENEW_BEFORE) -> bool:
    """Whether a serving Secret's ca.crt, tls.crt and tls.key can stay: all there, the
    certificate for `hosts`, signed by that CA, with its key, not near its end."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    try:
        ca = x509.load_pem_x509_certificate(data["ca.crt"])
        cert = x509.load_pem_x509_certificate(data["tls.crt"])
        key = serialization.load_pem_private_key(data["tls.key"], password=None)
        cert.verify_directly_issued_by(ca)
        names_ = set(cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
                     .get_values_for_type(x509.DNSName))
    except (KeyError, ValueError, TypeError, x509.ExtensionNotFound, Exception):  # noqa: BLE001 - any doubt: a new pair
        return False
    now = now or dt.datetime.now(dt.timezone.utc)
    same_key = key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo) \
        == cert.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return (same_key and set(hosts) <= names_
            and min(ca.not_valid_after_utc, cert.not_valid_after_utc) - renew_before > now)


def ensure_serving_secret(core: Any, namespace: str) -> bytes:
    """The serving Secret in `namespace` kept if current (`is_pair_current`), else a new
    self-signed CA and pair written over it; returns the CA bundle to trust (PEM): its CA,
    and while a replaced pair may still be served, the old CA too."""
    import kubernetes

    hosts = service_hosts(namespace)
    try:
        secret = core.read_namespaced_secret(TLS_SECRET, namespace)
    except kubernetes.client.ApiException as e:
        if e.status != 404:
            raise
        secret = None
    if secret is not None:
        data = {k: base64.b64decode(v) for k, v in (secret.data or {}).items()}
        if is_pair_current(data, hosts):
            log.info("owner webhook: the serving pair in %s/%s is current", namespace, TLS_SECRET)
            return data["ca.crt"]
    ca, cert, key = serving_pair(hosts)
    body = {"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
            "metadata": {"name": TLS_SECRET, "namespace": namespace,
                         "labels": {"app.kubernetes.io/name": "rftjob-operator"}},
            "data": {k: base64.b64encode(v).decode() for k, v in
                     (("ca.crt", ca), ("tls.crt", cert), ("tls.key", key))}}
    if secret is None:
        core.create_namespaced_secret(namespace, body)
        log.info("owner webhook: wrote a new serving pair (a new CA) to %s/%s", namespace, TLS_SECRET)
        return ca
    # With its resourceVersion: a concurrent writer makes this fail, and the Job retries.
    body["metadata"]["resourceVersion"] = secret.metadata.resource_version
    core.replace_namespaced_secret(TLS_SECRET, namespace, body)
    log.info("owner webhook: wrote a new serving pair (a new CA) over the old one in %s/%s", namespace, TLS_SECRET)
    # The replicas present the old pair until the kubelet updates their volume (a minute or
    # so): the configuration trusts both CAs until the next run, which finds this pair
    # current and trusts its CA alone.
    return ca + _valid_certificate(data.get("ca.crt", b""))


def _valid_certificate(pem: bytes) -> bytes:
    """`pem` if it is a certificate that has not ended, else nothing."""
    from cryptography import x509

    try:
        cert = x509.load_pem_x509_certificate(pem)
    except ValueError:
        return b""
    return pem if cert.not_valid_after_utc > dt.datetime.now(dt.timezone.utc) else b""


def ensure_ca_bundle(admission: Any, ca: bytes, timeout: float = 300, clock=None, sleep=None) -> None:
    """Every webhook of the configuration trusts `ca` (its caBundle: one or more PEM
    certificates), waiting up to
    `timeout` for the configuration to exist (applied with this Job, in any order)."""
    import time

    import kubernetes

    clock, sleep = clock or time.monotonic, sleep or time.sleep
    bundle = base64.b64encode(ca).decode()
    deadline = clock() + timeout
    while True:
        try:
            config = admission.read_validating_webhook_configuration(WEBHOOK_NAME)
            if all(h.client_config.ca_bundle == bundle for h in config.webhooks or []):
                log.info("owner webhook: %s trusts the CA", WEBHOOK_NAME)
                return
            for h in config.webhooks or []:
                h.client_config.ca_bundle = bundle
            admission.replace_validating_webhook_configuration(WEBHOOK_NAME, config)  # resourceVersion kept
            log.info("owner webhook: set the caBundle of %s", WEBHOOK_NAME)
            return
        except kubernetes.client.ApiException as e:
            if e.status not in (404, 409) or clock() > deadline:
                raise
            log.info("owner webhook: %s: %s, trying again", WEBHOOK_NAME, "not there yet" if e.status == 404 else
                     "changed meanwhile")
        sleep(2)


def ensure_certificates(namespace: str, timeout: float = 300) -> None:
    """What the install's Job runs (`certs`): the serving Secret, then the caBundle."""
    import kubernetes

    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()
    client = kubernetes.client.ApiClient()
    ca = ensure_serving_secret(kubernetes.client.CoreV1Api(client), namespace)
    ensure_ca_bundle(kubernetes.client.AdmissionregistrationV1Api(client), ca, timeout)


def render_configuration() -> str:
    """manifests/base/owner-webhook-configuration.yaml: the configuration without its
    caBundle (the install's Job sets it)."""
    header = ("# Generated by `python -m rft_operator.ownerhook configuration`. Do not edit.\n"
              "# The Job in owner-webhook.yaml sets the caBundle; see ownerhook.py's docstring.\n")
    return header + yaml.safe_dump(webhook_configuration(None), sort_keys=False, width=100)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m rft_operator.ownerhook", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    certs = sub.add_parser("certs", help="the install's Job: keep or make the serving Secret (a self-signed CA), "
                                         "then put its CA into the webhook configuration")
    certs.add_argument("--namespace", default=os.environ.get("POD_NAMESPACE") or OPERATOR_NAMESPACE,
                       help="the operator's namespace (default: $POD_NAMESPACE, else %(default)s)")
    certs.add_argument("--timeout", type=float, default=300,
                       help="seconds to wait for the webhook configuration to exist")
    sub.add_parser("configuration", help="print the ValidatingWebhookConfiguration without a caBundle "
                                         "(manifests/base/owner-webhook-configuration.yaml)")
    args = ap.parse_args(argv)
    if args.command == "certs":
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
        ensure_certificates(args.namespace, args.timeout)
    else:
        sys.stdout.write(render_configuration())


if __name__ == "__main__":
    main()
