"""The one module that talks to the Kubernetes API server: writes, and the few reads kopf's
watch-fed indexes cannot answer (the object holding a child's name on 409, the Node of a
pod stuck terminating). Everything else takes and returns plain dicts."""

from __future__ import annotations

import json
import logging
import time
import uuid
from datetime import datetime, timezone
from typing import Any

import kubernetes
from kubernetes.client.rest import ApiException

from rft_contract import names as c

log = logging.getLogger(__name__)
Obj = dict[str, Any]


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


class Kube:
    """Writes go out as plain dicts with `_preload_content=False`: decoding every response
    into the client's typed models cost more CPU than the rest of the operator together."""

    def __init__(self, api_client: kubernetes.client.ApiClient | None = None, connections: int = 32):
        if api_client is None:
            # One kept-alive connection per concurrent writer. The client's default pool
            # holds 5 per CPU; past that urllib3 opens a connection per request and throws
            # it away after: a TLS handshake per write on both ends.
            config = kubernetes.client.Configuration.get_default_copy()
            config.connection_pool_maxsize = max(config.connection_pool_maxsize or 0, connections)
            api_client = kubernetes.client.ApiClient(config)
        self.client = api_client
        self.core = kubernetes.client.CoreV1Api(self.client)
        self.rbac = kubernetes.client.RbacAuthorizationV1Api(self.client)
        self.custom = kubernetes.client.CustomObjectsApi(self.client)
        self.requests = 0  # API calls made, for the benchmark
        self.seconds = 0.0  # time spent waiting on them

    # ---------------------------------------------------------------- children

    def _call(self, verb: str, kind: str):
        """The client method for `verb` (create, read, patch, delete) on a child kind. Every
        kind the operator creates is listed here once; handlers.CHILD_KINDS watches them."""
        api, noun = {
            "Pod": (self.core, "pod"),
            "Service": (self.core, "service"),
            "ConfigMap": (self.core, "config_map"),
            "ServiceAccount": (self.core, "service_account"),
            "Role": (self.rbac, "role"),
            "RoleBinding": (self.rbac, "role_binding"),
        }[kind]
        return getattr(api, f"{verb}_namespaced_{noun}")

    @_timed
    def create(self, obj: Obj) -> bool:
        """Create by name. False when the name is taken (409): whether that is success
        depends on whose object holds it (`read` it and check its controller)."""
        meta = obj["metadata"]
        try:
            self._call("create", obj["kind"])(meta["namespace"], obj, _preload_content=False)
            return True
        except ApiException as e:
            if e.status == 409:
                return False
            raise

    @_timed
    def read(self, kind: str, namespace: str, name: str) -> Obj:
        resp = self._call("read", kind)(name, namespace, _preload_content=False)
        return json.loads(resp.data)

    @_timed
    def replace(self, obj: Obj) -> None:
        """Bring a drifted child back to its rendered form. A merge patch: rendered keys win,
        lists (ports, subjects, rules) are replaced whole, keys set to null go (labels and
        annotations we no longer render: `policy.compute_patch`), what the server added is kept."""
        meta = obj["metadata"]
        # Not the client's default strategic merge: it merges a Service's ports by port
        # number, so a hand-edited port would stay beside ours (and clash on the name).
        self._call("patch", obj["kind"])(meta["name"], meta["namespace"], obj, _preload_content=False,
                                         _content_type="application/merge-patch+json")

    @_timed
    def delete(self, obj: Obj) -> None:
        """Delete a child (404 = already gone): one the spec no longer renders, or one to
        create again with a field the API server does not let change (a RoleBinding's roleRef)."""
        meta = obj["metadata"]
        try:
            self._call("delete", obj["kind"])(meta["name"], meta["namespace"], _preload_content=False)
        except ApiException as e:
            if e.status != 404:
                raise

    @_timed
    def delete_pod(self, namespace: str, name: str, grace_period_seconds: int | None = None) -> None:
        """Delete a pod (404 = gone); `grace_period_seconds=0` force-deletes one whose node
        will never confirm (the object goes at once, whatever its kubelet still runs)."""
        kwargs = {} if grace_period_seconds is None else {"grace_period_seconds": grace_period_seconds}
        try:
            self.core.delete_namespaced_pod(name, namespace, _preload_content=False, **kwargs)
        except ApiException as e:
            if e.status != 404:
                raise

    @_timed
    def read_node(self, name: str) -> Obj | None:
        """The Node object; None when it does not exist (404). Other errors, e.g. 403 where
        the operator may not read nodes, are raised."""
        try:
            return json.loads(self.core.read_node(name, _preload_content=False).data)
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    # ---------------------------------------------------------------- status

    @_timed
    def patch_status(self, namespace: str, name: str, status: Obj, resource_version: str) -> str:
        """Merge-patch the operator's status fields, only if the job is still at
        `resource_version` (else Conflict). Returns the new resourceVersion."""
        body = {"metadata": {"resourceVersion": resource_version}, "status": status}
        try:
            resp = self.custom.patch_namespaced_custom_object_status(
                c.GROUP, c.VERSION, namespace, c.PLURAL, name, body,
                _content_type="application/merge-patch+json", _preload_content=False,
            )
            out = json.loads(resp.data)
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
            },
            "involvedObject": {
                "apiVersion": c.API_VERSION,
                "kind": c.KIND,
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
            "source": {"component": c.MANAGED_BY},
            "reportingComponent": c.MANAGED_BY,
            "reportingInstance": c.MANAGED_BY,
        }
        try:
            self.core.create_namespaced_event(meta["namespace"], event, _preload_content=False)
        except ApiException as e:  # events are best effort; never fail a reconcile
            log.warning("could not post event %s on %s: %s", reason, meta["name"], e.reason)
