"""The pod runner's API client: JSON over the `kubernetes` package, plain dicts."""

from __future__ import annotations

import json
import os
import threading
from typing import Any, Iterator

from .common import PodRunnerError


class _Api:
    """JSON over the `kubernetes` package's ApiClient (plain dicts, API field names).

    A private Configuration: the global default client configuration is left alone.
    """

    def __init__(self, kubeconfig: str | os.PathLike):
        from kubernetes import client, config

        cfg = client.Configuration()
        try:
            config.load_kube_config(config_file=str(kubeconfig), client_configuration=cfg,
                                    persist_config=False)
        except Exception as e:  # noqa: BLE001
            raise PodRunnerError(f"cannot load kubeconfig {kubeconfig}: {e}") from e
        cfg.connection_pool_maxsize = 32
        self.server = cfg.host
        self.ca_file = cfg.ssl_ca_cert
        self._client = client.ApiClient(cfg)
        self._lock = threading.Lock()
        self._open: set[Any] = set()

    def request(self, method: str, path: str, body: Any = None, query: list | None = None,
                content_type: str | None = None, timeout: float = 30, stream: bool = False) -> Any:
        from kubernetes.client.exceptions import ApiException

        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type or "application/json"
        req = self._client.param_serialize(method, path, query_params=list(query or []),
                                           header_params=headers, body=body,
                                           auth_settings=["BearerToken"])
        resp = self._client.call_api(*req, _request_timeout=timeout)
        if stream and 200 <= resp.status < 300:
            return resp.response
        data = resp.read()
        if not 200 <= resp.status < 300:
            text = data.decode(errors="replace") if data else ""
            ApiException.from_response(http_resp=resp, body=text, data=None)
            raise ApiException(status=resp.status, reason=resp.reason, body=text)
        return json.loads(data) if data else None

    def get(self, path: str, **kw: Any) -> Any:
        return self.request("GET", path, **kw)

    def post(self, path: str, body: Any) -> Any:
        return self.request("POST", path, body)

    def merge_patch(self, path: str, body: Any) -> Any:
        return self.request("PATCH", path, body, content_type="application/merge-patch+json")

    def delete(self, path: str, body: Any = None) -> Any:
        return self.request("DELETE", path, body)

    def watch(self, path: str, query: list, timeout_s: int) -> Iterator[dict]:
        """Watch events (dicts with type/object) until the server ends the stream."""
        from kubernetes.watch.watch import iter_resp_lines

        resp = self.request("GET", path, query=query + [("watch", "true"),
                                                        ("timeoutSeconds", str(timeout_s))],
                            timeout=(10, timeout_s + 15), stream=True)
        with self._lock:
            self._open.add(resp)
        try:
            for line in iter_resp_lines(resp):
                if line:
                    yield json.loads(line)
        finally:
            with self._lock:
                self._open.discard(resp)
            resp.release_conn()

    def close_watches(self) -> None:
        """Unblocks every running watch (used on stop)."""
        with self._lock:
            responses = list(self._open)
        for resp in responses:
            try:
                if hasattr(resp, "shutdown"):
                    resp.shutdown()
                resp.close()
            except Exception:  # noqa: BLE001
                pass

    def close(self) -> None:
        self.close_watches()
        try:
            self._client.close()
        except Exception:  # noqa: BLE001
            pass


def _status_code(e: Exception) -> int | None:
    return getattr(e, "status", None)
