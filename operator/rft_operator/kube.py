"""The one module that writes to the Kubernetes API server, plus the few reads the watches
cannot answer (the object holding a child's name on 409, the Node of a pod stuck
terminating) and the informers' list/watch calls. Everything else takes and returns plain
dicts."""

from __future__ import annotations

import collections
import functools
import json
import logging
import time
import uuid
from datetime import datetime, timezone
from typing import Any
from urllib.parse import quote, urlencode

import kubernetes
from kubernetes.client.rest import ApiException

from rft_contract import names

from .model import Obj

log = logging.getLogger(__name__)


class Conflict(Exception):
    """The object changed since we read it; reconcile again from fresh state."""


def api_message(e: ApiException, limit: int = 600) -> str:
    """The API server's own explanation from an error response (its Status `message`,
    which names the field for a 422), shortened; "" when there is none. Only the response
    is read, never the request: a request body may carry what no event should show."""
    body = e.body.decode(errors="replace") if isinstance(e.body, bytes) else e.body
    try:
        message = str(json.loads(body or "")["message"])
    except (ValueError, TypeError, KeyError):
        return ""
    return message if len(message) <= limit else message[:limit - 3] + "..."


def load_config() -> None:
    """In a pod: the mounted ServiceAccount; elsewhere: $KUBECONFIG / ~/.kube/config."""
    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()


def _timed(fn):
    """Counts calls and seconds spent in the API server, for the benchmark."""

    def wrapper(self, *args, **kwargs):
        start = time.monotonic()
        try:
            return fn(self, *args, **kwargs)
        finally:
            self.requests += 1
            self.seconds += time.monotonic() - start

    wrapper.__name__, wrapper.__doc__ = fn.__name__, fn.__doc__
    return wrapper


def _resource(path: str, method: str) -> str:
    """The resource a request path names: `pods` of .../pods (a create) and of .../pods/<name>,
    `status` of .../<name>/status."""
    parts = path.strip("/").split("/")
    return parts[-1] if method == "POST" or parts[-1] == "status" else parts[-2]


class Kube:
    """Requests go out through the client's REST layer (its connection pool, TLS and
    credentials, a refreshed token included) with plain JSON bodies, and come back as plain
    dicts. Not through the typed API methods: since kubernetes 32 they validate every body
    into the client's pydantic models and serialize it back, about 0.5 ms of CPU for a pod,
    and decoding responses into them cost more again."""

    def __init__(self, api_client: kubernetes.client.ApiClient | None = None, connections: int = 32):
        if api_client is None:
            # One kept-alive connection per concurrent writer. The client's default pool
            # holds 5 per CPU; past that urllib3 opens a connection per request and throws
            # it away after: a TLS handshake per write on both ends.
            config = kubernetes.client.Configuration.get_default_copy()
            config.connection_pool_maxsize = max(config.connection_pool_maxsize or 0, connections)
            api_client = kubernetes.client.ApiClient(config)
        self.client = api_client
        self._watch_client: kubernetes.client.ApiClient | None = None
        self.counts: collections.Counter[str] = collections.Counter()  # "<method> <resource>": calls
        self.requests = 0  # API calls made, for the benchmark
        self.seconds = 0.0  # time spent waiting on them

    def request(self, method: str, path: str, body: Any = None, content_type: str = "application/json",
              query: dict[str, Any] | None = None) -> bytes:
        """One request; the response body, or ApiException for any status but 2xx."""
        headers = {**self.client.default_headers, "Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type
        queries = list((query or {}).items())
        self.client.update_params_for_auth(headers, queries, ["BearerToken"], path, method, body)
        url = self.client.configuration.host + path + (f"?{urlencode(queries)}" if queries else "")
        self.counts[f"{method} {_resource(path, method)}"] += 1
        resp = self.client.rest_client.request(method, url, headers=headers, body=body)
        data = resp.read()
        if not 200 <= resp.status <= 299:
            raise ApiException.from_response(http_resp=resp, body=None, data=None)
        return data

    # ---------------------------------------------------------------- children

    _KINDS = {  # kind -> (API path prefix, resource, noun in the typed client's list methods)
        "Pod": ("/api/v1", "pods", "pod"),
        "Service": ("/api/v1", "services", "service"),
        "ConfigMap": ("/api/v1", "configmaps", "config_map"),
        "ServiceAccount": ("/api/v1", "serviceaccounts", "service_account"),
        "Role": ("/apis/rbac.authorization.k8s.io/v1", "roles", "role"),
        "RoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "rolebindings", "role_binding"),
        # Kueue's, for jobs it queues (`queueing.py`); watched only where Kueue is installed.
        "Workload": ("/apis/kueue.x-k8s.io/v1beta2", "workloads", ""),
    }

    def path(self, kind: str, namespace: str, name: str | None = None) -> str:
        """The REST path of a child kind in a namespace (of one object with `name`). Every
        kind the operator creates is listed here once; handlers.CHILD_KINDS watches them."""
        prefix, resource, _ = self._KINDS[kind]
        return f"{prefix}/namespaces/{quote(namespace)}/{resource}" + (f"/{quote(name)}" if name else "")

    def list_method(self, kind: str, namespace: str | None):
        """The list (and, with watch=True, watch) method of a child kind, in one namespace
        or all, for `informer.Informer`. On a client of its own: each watch holds a
        connection for minutes, which the writers' pool should not lend out."""
        if self._watch_client is None:
            self._watch_client = kubernetes.client.ApiClient(self.client.configuration)
        prefix, resource, noun = self._KINDS[kind]
        if not noun:  # a custom resource
            group, version = prefix.removeprefix("/apis/").split("/")
            api = kubernetes.client.CustomObjectsApi(self._watch_client)
            if namespace is None:
                return functools.partial(api.list_cluster_custom_object, group, version, resource)
            return functools.partial(api.list_namespaced_custom_object, group, version, namespace, resource)
        api = (kubernetes.client.CoreV1Api if prefix == "/api/v1" else kubernetes.client.RbacAuthorizationV1Api)(
            self._watch_client)
        if namespace is None:
            return getattr(api, f"list_{noun}_for_all_namespaces")
        return functools.partial(getattr(api, f"list_namespaced_{noun}"), namespace)

    @_timed
    def create(self, obj: Obj) -> bool:
        """Create by name. False when the name is taken (409): whether that is success
        depends on whose object holds it (`read` it and check its controller)."""
        try:
            self.request("POST", self.path(obj["kind"], obj["metadata"]["namespace"]), obj)
            return True
        except ApiException as e:
            if e.status == 409:
                return False
            raise

    @_timed
    def read(self, kind: str, namespace: str, name: str) -> Obj:
        return json.loads(self.request("GET", self.path(kind, namespace, name)))

    @_timed
    def merge_patch(self, obj: Obj) -> None:
        """Bring a drifted child back to its rendered form. A merge patch: rendered keys win,
        lists (ports, subjects, rules) are replaced whole, keys set to null go (labels and
        annotations we no longer render: `drift.compute_patch`), what the server added is kept."""
        meta = obj["metadata"]
        # Not a strategic merge: it merges a Service's ports by port number, so a
        # hand-edited port would stay beside ours (and clash on the name).
        self.request("PATCH", self.path(obj["kind"], meta["namespace"], meta["name"]), obj,
                   "application/merge-patch+json")

    @_timed
    def delete(self, obj: Obj) -> None:
        """Delete a child (404 = already gone): one the spec no longer renders, or one to
        create again with a field the API server does not let change (a RoleBinding's roleRef)."""
        meta = obj["metadata"]
        try:
            self.request("DELETE", self.path(obj["kind"], meta["namespace"], meta["name"]))
        except ApiException as e:
            if e.status != 404:
                raise

    @_timed
    def delete_pod(self, namespace: str, name: str, grace_period_seconds: int | None = None) -> None:
        """Delete a pod (404 = gone); `grace_period_seconds=0` force-deletes one whose node
        will never confirm (the object goes at once, whatever its kubelet still runs)."""
        query = {} if grace_period_seconds is None else {"gracePeriodSeconds": grace_period_seconds}
        try:
            self.request("DELETE", self.path("Pod", namespace, name), query=query)
        except ApiException as e:
            if e.status != 404:
                raise

    @_timed
    def read_node(self, name: str) -> Obj | None:
        """The Node object; None when it does not exist (404). Other errors, e.g. 403 where
        the operator may not read nodes, are raised."""
        try:
            return json.loads(self.request("GET", f"/api/v1/nodes/{quote(name)}"))
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    @_timed
    def read_path(self, path: str) -> Obj | None:
        """A GET of any object the operator may read (a Kueue ResourceFlavor, a
        WorkloadPriorityClass, an API group's discovery); None when it does not exist (404)."""
        try:
            return json.loads(self.request("GET", path))
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    # ---------------------------------------------------------------- status

    @_timed
    def patch_child_status(self, obj: Obj) -> None:
        """Merge-patch a child's status subresource (a Kueue Workload's, whose status the
        job's controller partly owns), only if it is still at the resourceVersion in the
        patch (else Conflict)."""
        meta = obj["metadata"]
        try:
            self.request("PATCH", self.path(obj["kind"], meta["namespace"], meta["name"]) + "/status",
                         {"metadata": {"resourceVersion": meta["resourceVersion"]}, "status": obj["status"]},
                         "application/merge-patch+json")
        except ApiException as e:
            if e.status in (404, 409):
                raise Conflict(f"{_what_child(obj)}: {e.reason}") from None
            raise

    @_timed
    def patch_status(self, namespace: str, name: str, status: Obj, resource_version: str) -> str:
        """Merge-patch the operator's status fields, only if the job is still at
        `resource_version` (else Conflict). Returns the new resourceVersion."""
        body = {"metadata": {"resourceVersion": resource_version}, "status": status}
        path = f"/apis/{names.GROUP}/{names.VERSION}/namespaces/{quote(namespace)}/{names.PLURAL}/{quote(name)}/status"
        try:
            out = json.loads(self.request("PATCH", path, body, "application/merge-patch+json"))
        except ApiException as e:
            if e.status in (404, 409):
                raise Conflict(f"{namespace}/{name}: {e.reason}") from None
            raise
        return out["metadata"]["resourceVersion"]

    # ---------------------------------------------------------------- events

    @_timed
    def post_event(self, job: Obj, type_: str, reason: str, message: str) -> None:
        """A core/v1 Event on the RFTJob (shown by `kubectl describe rftjob`)."""
        meta = job["metadata"]
        now = datetime.now(timezone.utc)
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {
                "name": f"{meta['name']}.{uuid.uuid4().hex[:12]}",
                "namespace": meta["namespace"],
                # Like the job's children: the admission policies check our Events by these.
                "labels": {names.LABEL_MANAGED_BY: names.MANAGED_BY, names.LABEL_JOB: meta["name"]},
            },
            "involvedObject": {
                "apiVersion": names.API_VERSION,
                "kind": names.KIND,
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta.get("uid"),
                "resourceVersion": meta.get("resourceVersion"),
            },
            "type": type_,
            "reason": reason,
            "message": message[:1024],
            "firstTimestamp": now.isoformat(),
            "lastTimestamp": now.isoformat(),
            "count": 1,
            "source": {"component": names.MANAGED_BY},
            "reportingComponent": names.MANAGED_BY,
            "reportingInstance": names.MANAGED_BY,
        }
        try:
            self.request("POST", f"/api/v1/namespaces/{quote(meta['namespace'])}/events", event)
        except ApiException as e:  # events are best effort; never fail a reconcile
            log.warning("could not post event %s on %s: %s", reason, meta["name"], e.reason)


def _what_child(obj: Obj) -> str:
    return f"{obj['kind']} {obj['metadata']['namespace']}/{obj['metadata']['name']}"
