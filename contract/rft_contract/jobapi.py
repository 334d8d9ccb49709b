"""The one client pods use to read and patch their RFTJob: the trainer's status reporter,
the sync agents and the explorers. Credentials are the pod's ServiceAccount token (the
per-job Role the operator creates), or $KUBECONFIG outside a cluster.
"""

from __future__ import annotations

import os
from typing import Any

from .names import GROUP, PLURAL, VERSION
from .times import now_text

SA_TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount/token"
MERGE_PATCH = "application/merge-patch+json"


def now() -> str:
    return now_text()


def merge(into: dict, patch: dict) -> dict:
    """Deep-merge `patch` into `into` (JSON merge-patch semantics without deletes)."""
    for k, v in patch.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            merge(into[k], v)
        else:
            into[k] = v
    return into


def describe(e: Exception) -> str:
    """An API error as `HTTP <status> <reason>`; never the body, which may echo the request."""
    status = getattr(e, "status", None)
    return f"HTTP {status} {getattr(e, 'reason', '')}".strip() if status else type(e).__name__


def job_api():
    """CustomObjectsApi with the pod's ServiceAccount (or $KUBECONFIG outside a cluster);
    RuntimeError when there are no credentials at all."""
    import kubernetes

    if os.path.exists(SA_TOKEN):
        kubernetes.config.load_incluster_config()
    elif os.environ.get("KUBECONFIG"):
        kubernetes.config.load_kube_config()
    else:
        raise RuntimeError("no in-cluster ServiceAccount token and no KUBECONFIG")
    return kubernetes.client.CustomObjectsApi()


def get_job(api: Any, namespace: str, name: str) -> dict:
    """The job, status included: a GET of the resource, what every pod identity's Role
    allows (`get` on its one RFTJob). The explorer's Role has no `rftjobs/status`: reading
    through the subresource was refused (403) for it."""
    return api.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name,
                                            _request_timeout=REQUEST_TIMEOUT)


# A connection the network dropped silently would hang a request for good; retries cover it.
REQUEST_TIMEOUT = (10, 30)  # connect, read seconds


def patch_status(api: Any, namespace: str, name: str, status: dict) -> None:
    """Merge-patch `status` into the job's status subresource."""
    api.patch_namespaced_custom_object_status(
        GROUP, VERSION, namespace, PLURAL, name, {"status": status},
        _content_type=MERGE_PATCH, _preload_content=False, _request_timeout=REQUEST_TIMEOUT)


def watch_job(api: Any, namespace: str, name: str, stop: Any, timeout_seconds: int = 60):
    """The job now, then each version of it as it changes, until the watch times out or
    `stop` (a threading.Event) is set. Callers loop to reconnect."""
    from kubernetes import watch

    obj = get_job(api, namespace, name)
    yield obj
    w = watch.Watch()
    for ev in w.stream(api.list_namespaced_custom_object, GROUP, VERSION, namespace, PLURAL,
                       field_selector=f"metadata.name={name}",
                       resource_version=obj["metadata"]["resourceVersion"],
                       timeout_seconds=timeout_seconds,
                       # The server ends the watch after timeout_seconds; a connection that
                       # died silently meanwhile would block the reader for good without
                       # a read timeout of our own (then the caller reconnects).
                       _request_timeout=(REQUEST_TIMEOUT[0], timeout_seconds + 15)):
        if stop.is_set():
            w.stop()
            return
        if ev["type"] in ("ADDED", "MODIFIED"):
            yield ev["object"]
