"""The one module that talks to the Kubernetes API server (writes only; reads come from
kopf's watch-fed indexes). Everything else takes and returns plain dicts."""

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

    def __init__(self, api_client: kubernetes.client.ApiClient | None = None):
        self.client = api_client or kubernetes.client.ApiClient()
        self.core = kubernetes.client.CoreV1Api(self.client)
        self.rbac = kubernetes.client.RbacAuthorizationV1Api(self.client)
        self.custom = kubernetes.client.CustomObjectsApi(self.client)
        self.requests = 0  # API calls made, for the benchmark
        self.seconds = 0.0  # time spent waiting on them

    # ---------------------------------------------------------------- children

    def _creator(self, kind: str):
        return {
            "Pod": self.core.create_namespaced_pod,
            "Service": self.core.create_namespaced_service,
            "ConfigMap": self.core.create_namespaced_config_map,
            "ServiceAccount": self.core.create_namespaced_service_account,
            "Role": self.rbac.create_namespaced_role,
            "RoleBinding": self.rbac.create_namespaced_role_binding,
        }[kind]

    @_timed
    def create(self, obj: Obj) -> bool:
        """Create by name. Returns False when it already exists (409 is success)."""
        ns = obj["metadata"]["namespace"]
        try:
            self._creator(obj["kind"])(ns, obj, _preload_content=False)
            return True
        except ApiException as e:
            if e.status == 409:
                return False
            raise

    @_timed
    def replace(self, obj: Obj) -> None:
        """Bring a drifted child back to its rendered form (merge patch keeps it simple)."""
        meta = obj["metadata"]
        patchers = {
            "ConfigMap": self.core.patch_namespaced_config_map,
            "RoleBinding": self.rbac.patch_namespaced_role_binding,
            "Service": self.core.patch_namespaced_service,
        }
        patchers[obj["kind"]](meta["name"], meta["namespace"], obj, _preload_content=False)

    @_timed
    def delete_pod(self, namespace: str, name: str) -> None:
        try:
            self.core.delete_namespaced_pod(name, namespace, _preload_content=False)
        except ApiException as e:
            if e.status != 404:
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
