"""Engine adapters of the sync agent: how to hot-reload one kind of inference engine and
ask it which weights version it serves. `SyncError` is any failed step of one sync
attempt; its message goes into the replica's status entry.

`served()` always asks the engine, never the agent's memory: an engine container that
restarted on its initial weights reports its start-up label, which is not one of our
integer versions, so `served()` is None and the agent reloads it.

The vLLM and SGLang adapters send exactly the routes and bodies of vLLM 0.33.0 and
SGLang 0.5.23 (source paths in their docstrings; the contract tests in
tests/trainer/test_engines.py run them against fakes of those routes).
"""

from __future__ import annotations

import logging
from typing import Any

import requests

from rft_contract.versions import parse_version

log = logging.getLogger("rft_serving.engines")


class SyncError(RuntimeError):
    """A failed step of one sync attempt; the message goes into the replica entry."""


class Engine:
    """How to reload one kind of inference engine and ask what it serves."""

    def __init__(self, url: str, timeout: float = 600.0):
        self.url, self.timeout = url.rstrip("/"), timeout

    def served(self) -> int | None:
        """The version the engine itself reports now; None when it serves none of ours."""
        raise NotImplementedError

    def load(self, path: str, version: int) -> None:
        raise NotImplementedError

    def _get(self, path: str) -> Any:
        try:
            r = requests.get(self.url + path, timeout=10)
        except requests.RequestException as e:
            raise SyncError(f"engine not reachable at {self.url}: {type(e).__name__}") from None
        if r.status_code >= 400:
            raise SyncError(f"engine GET {path}: HTTP {r.status_code} {r.text[:300]}")
        try:
            return r.json()
        except ValueError:
            raise SyncError(f"engine GET {path}: not JSON: {r.text[:300]}") from None

    def _post(self, path: str, body: dict | None = None, params: dict | None = None) -> Any:
        try:
            r = requests.post(self.url + path, json=body, params=params, timeout=self.timeout)
        except requests.RequestException as e:
            raise SyncError(f"engine {path}: {type(e).__name__}") from None
        if r.status_code >= 400:
            raise SyncError(f"engine {path}: HTTP {r.status_code} {r.text[:300]}")
        try:
            return r.json() if r.content else {}
        except ValueError:
            raise SyncError(f"engine {path}: not JSON: {r.text[:300]}") from None


class ReferenceEngine(Engine):
    """rft_serving.serve: GET /weights -> {"version": int|null, ...};
    POST /weights/load {path, version}."""

    def served(self) -> int | None:
        return parse_version(self._get("/weights").get("version"))

    def load(self, path: str, version: int) -> None:
        self._post("/weights/load", {"path": path, "version": version})


class SGLangEngine(Engine):
    """SGLang 0.5.23 (`python -m sglang.launch_server`; no flag or env var gates these routes).

    load: POST /update_weights_from_disk
          {"model_path": path, "weight_version": str(version), "abort_all_requests": false}
          (srt/entrypoints/http_server.py:1300-1326; body UpdateWeightFromDiskReqInput,
          srt/managers/io_struct.py:1970-1992: model_path required, unknown keys ignored,
          srt/utils/msgspec_utils.py:98). 200 {"success": true, ...}; 400 {"success": false,
          "message": ...} on failure; `success` is checked either way.

    No pause and no abort, on purpose. Unpaused, the update takes the tokenizer manager's
    writer lock (managers/tokenizer_manager.py:2288-2322); every generate request holds
    the reader lock for its whole life (:941) and the lock prefers writers
    (srt/utils/aio_rwlock.py), so the update waits for in-flight requests to finish on the
    old weights and holds new ones (they wait; nothing is rejected) until it is done.
    The scheduler is then idle, so the cache flush that follows the load
    (managers/scheduler_components/weight_updater.py:118-160) succeeds; it fails (400,
    "cache was not flushed because requests are still running or queued") only when
    requests are still in the scheduler, and then the tokenizer-side version label is not
    updated, so `served()` keeps the old version and the agent retries. The alternatives
    are worse for RL: `pause_generation(mode="retract")` + `continue_generation` puts the
    running requests back in the queue to finish on the new weights (every one of them
    straddles the reload, and explorers drop it), and `abort_all_requests` throws them
    away. A failed load rolls back to the old weights (model_runner_components/
    weight_updater.py:174-256), so the old label stays true.

    After a successful load SGLang renames the served model to `model_path`
    (tokenizer_manager.py:2365-2370). Explorers keep sending model "policy": the OpenAI
    routes do not check the name (serving_completions.py echoes `request.model`); only a
    ':' in it would be read as `base:lora-adapter` (entrypoints/openai/serving_base.py:40-60).

    served: GET /model_info -> "weight_version" (http_server.py:812-850); the start-up
    label is --weight-version, default "default" (srt/arg_groups/fields/serving.py:172-175).
    """

    def served(self) -> int | None:
        return parse_version(self._get("/model_info").get("weight_version"))

    def load(self, path: str, version: int) -> None:
        out = self._post("/update_weights_from_disk", {
            "model_path": path, "weight_version": str(version), "abort_all_requests": False})
        if not isinstance(out, dict) or out.get("success") is not True:
            message = out.get("message", "") if isinstance(out, dict) else str(out)
            raise SyncError(f"engine refused the weights: {str(message)[:300]}")


class VLLMEngine(Engine):
    """vLLM 0.33.0 (`vllm serve`, with VLLM_SERVER_DEV_MODE=1 in the engine's env: without
    it none of these routes exist, entrypoints/launchers/api_server/routers.py:46-53).
    vLLM has no reload-from-disk route; the disk path is the worker method
    `reload_weights(weights_path=...)` through the dev-mode RPC.

    load: POST /pause?mode=wait  (entrypoints/rl/online/api_router.py:31-75; query params,
              no body; returns once in-flight requests finished on the old weights, new
              ones get 503 until /resume; caches are cleared when it completes)
          POST /update_weight_version {"new_version": "reloading-<version>"}
              (rl/online/api_router.py:217-223; FastAPI Body(embed=True), a str): a label
              that is not one of our versions, set BEFORE the weights change
          POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": path}}
              (entrypoints/serve/dev/rpc/api_router.py:23-59; raw JSON;
              v1/worker/gpu_model_runner.py:5226-5243 ->
              model_executor/model_loader/reload/inplace.py: in-place layerwise reload)
          POST /update_weight_version {"new_version": str(version)}, only once the reload
              succeeded
          POST /reset_prefix_cache  (entrypoints/serve/dev/cache/api_router.py:20-44;
              {"success": bool}; a belt-and-braces flush, pause already cleared it)
          POST /resume  (rl/online/api_router.py:78-94), always, however the steps before
              ended.
    So the engine never serves weights under a label they do not have: from the first byte
    of new weights until the version label is set, and after a failed reload or label
    update (the weights may be half-replaced) until a later load succeeds, the label is
    "reloading-<version>";
    `served()` is then None (the agent retries) and explorers drop what the engine samples
    meanwhile instead of mislabelling it. A failed /resume after a failed step is logged and
    the first error is raised; a failed /resume alone is a SyncError too, and the label is
    then set to "resume-failed-<version>" (best effort) so that `served()` is None and the
    agent's retry reloads, which pauses and resumes again, instead of counting a replica
    that may still be paused (new requests 503) as synced.

    served: GET /weight_info -> {"weight_version": str} (rl/online/api_router.py:226-229);
    it starts as "default" (v1/engine/core.py:147) and no CLI flag sets it.
    """

    def served(self) -> int | None:
        return parse_version(self._get("/weight_info").get("weight_version"))

    def load(self, path: str, version: int) -> None:
        try:
            self._post("/pause", params={"mode": "wait"})
        except SyncError as e:
            if "HTTP 404" in str(e):
                raise SyncError(f"{e} (is VLLM_SERVER_DEV_MODE=1 set in the engine's env?)") from None
            raise
        try:
            self._reload(path, version)
        except BaseException:
            try:
                self._post("/resume")
            except SyncError as e:  # the first error says more; raise that one
                log.warning("could not resume vLLM after a failed load of version %s: %s", version, e)
            raise
        try:
            self._post("/resume")
        except SyncError as e:
            self._label(f"resume-failed-{version}")  # served() None: the agent reloads, resumes
            raise SyncError(f"loaded version {version} but could not resume: {e}") from None

    def _reload(self, path: str, version: int) -> None:
        """The steps between /pause and /resume."""
        # Before any weight changes: whatever happens next, no integer label until it worked.
        self._post("/update_weight_version", {"new_version": f"reloading-{version}"})
        self._post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": path}})
        self._post("/update_weight_version", {"new_version": str(version)})
        out = self._post("/reset_prefix_cache")
        if isinstance(out, dict) and out.get("success") is False:
            log.warning("vLLM did not reset its prefix cache after loading version %s "
                        "(the pause already cleared it)", version)

    def _label(self, label: str) -> None:
        try:
            self._post("/update_weight_version", {"new_version": label})
        except SyncError as e:
            log.warning("could not set vLLM's weight version label to %r: %s", label, e)


ENGINES = {"reference": ReferenceEngine, "sglang": SGLangEngine, "vllm": VLLMEngine}
