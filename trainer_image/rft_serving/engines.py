"""Engine adapters of the sync agent: how to hot-reload one kind of inference engine and
ask it which weights version it serves. `SyncError` is any failed step of one sync
attempt; its message goes into the replica's status entry.
"""

from __future__ import annotations

import requests


class SyncError(RuntimeError):
    """A failed step of one sync attempt; the message goes into the replica entry."""


class Engine:
    """How to reload one kind of inference engine and ask what it serves."""

    def __init__(self, url: str, timeout: float = 600.0):
        self.url, self.timeout = url.rstrip("/"), timeout

    def served(self) -> int | None:
        raise NotImplementedError

    def load(self, path: str, version: int) -> None:
        raise NotImplementedError

    def _post(self, path: str, body: dict | None = None, params: dict | None = None) -> dict:
        try:
            r = requests.post(self.url + path, json=body, params=params, timeout=self.timeout)
        except requests.RequestException as e:
            raise SyncError(f"engine {path}: {type(e).__name__}") from None
        if r.status_code >= 400:
            raise SyncError(f"engine {path}: HTTP {r.status_code} {r.text[:300]}")
        return r.json() if r.content else {}


class ReferenceEngine(Engine):
    """rft_serving.serve: GET /weights, POST /weights/load {path, version}."""

    def served(self) -> int | None:
        try:
            r = requests.get(self.url + "/weights", timeout=10)
            r.raise_for_status()
        except requests.RequestException as e:
            raise SyncError(f"engine not reachable at {self.url}: {type(e).__name__}") from None
        return r.json().get("version")

    def load(self, path: str, version: int) -> None:
        self._post("/weights/load", {"path": path, "version": version})


class SGLangEngine(Engine):
    """SGLang's `/update_weights_from_disk` (documented; not exercised in CI here)."""

    def __init__(self, url: str, **kw):
        super().__init__(url, **kw)
        self._loaded: int | None = None

    def served(self) -> int | None:
        return self._loaded

    def load(self, path: str, version: int) -> None:
        out = self._post("/update_weights_from_disk", {"model_path": path, "weight_version": str(version)})
        if out.get("success") is False:
            raise SyncError(f"engine refused the weights: {out.get('message', '')[:300]}")
        self._loaded = version


class VLLMEngine(SGLangEngine):
    """vLLM's weight-update endpoints (dev mode), bracketed by pause/resume so no request
    mixes versions. Not exercised in CI here (no vLLM on CPU)."""

    def load(self, path: str, version: int) -> None:
        self._post("/pause", params={"mode": "wait"})
        try:
            self._post("/update_weights", {"weights_path": path, "weight_version": str(version)})
        finally:
            self._post("/resume")
        self._loaded = version


ENGINES = {"reference": ReferenceEngine, "sglang": SGLangEngine, "vllm": VLLMEngine}


