"""Contract tests of the sync agent's engine adapters and of the explorers' weights-version
attribution, against fakes of vLLM 0.32.0 and SGLang 0.5.23. The fakes make failures easy
to inject (a refused label, a failing /resume); tests/trainer/test_vllm.py runs the same
adapter against a real vLLM (PyPI's CPU build), and SGLang, which does not run on CPU, is
faked from its source. Each fake implements exactly the routes the adapters and explorers
use, with the request bodies those routes accept (unknown keys ignored or kept the way the
real pydantic/msgspec models do, missing or mistyped fields refused) and the response
shapes they return, and nothing else (any other route is a 404):

vLLM 0.32.0, as its CPU build behaves here (routes and behaviours, seen on the real one):
  VLLM_SERVER_DEV_MODE=1 registers the dev/RL routes (without it they are 404s)
  POST /pause?mode=&clear_cache=, POST /resume: requests that arrive while paused are HELD
      and run after /resume (not refused)
  POST /update_weight_version {"new_version"} (FastAPI Body(embed=True)), GET /weight_info;
      the label starts "default"
  POST /collective_rpc {"method", "args", "kwargs"}: a worker method by name; an unknown one
      is a 500 "... object has no attribute '<method>' ..." that changes nothing;
      `reload_weights(weights_iterator, weights_path, is_checkpoint_format)` in place, and
      our extension's `rft_reload_weights(weights_path)` when the engine runs it
  a reload that fails part-way leaves layers on the meta device: every later reload fails
      too, and the next completion answers 500 (then the real server exits)
  POST /reset_prefix_cache -> {"success": bool}
  POST /v1/completions: OpenAI fields plus add_special_tokens, return_token_ids (then
      choices[].prompt_token_ids/token_ids), echo with max_tokens 0 and logprobs 0 for the
      prompt's log-probs (choices[0].logprobs.token_logprobs, None first);
      `return_weight_versions` is accepted and ignored (extra="allow"). `honours_opt_in=True`
      plays a later vLLM that returns choices[].weight_versions spans
  errors: {"error": {message, type, param, code}}; validation errors -> 400
SGLang 0.5.23 (sglang/srt/...), the behaviour and where it lives:
  POST /update_weights_from_disk (200/400, success)  (entrypoints/http_server.py)
  GET /model_info (weight_version, model_path, ...)  (entrypoints/http_server.py)
  validation errors -> 400 ErrorResponse  (entrypoints/http_server.py)
  UpdateWeightFromDiskReqInput / ReqOutput  (managers/io_struct.py)
  msgspec bodies: extra keys ignored, no default = required  (utils/msgspec_utils.py)
  version label only on success; model renamed to model_path  (managers/tokenizer_manager.py)
  flush refused while requests run -> success false  (managers/scheduler_components/weight_updater.py)
  CompletionRequest (extra ignored), metadata  (entrypoints/openai/protocol.py)
  metadata from the FIRST choice only  (entrypoints/openai/serving_completions.py)
  only a ':' in `model` means a LoRA adapter  (entrypoints/openai/serving_base.py)
  {"weight_version", "weight_versions": [{version, start, end}]}  (utils/weight_versions.py)
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Optional

import pytest
from aiohttp import web
from pydantic import BaseModel, ConfigDict, ValidationError

from rft_contract.config import load_explorer_config
from rft_rollout.explorer import Explorer, KubeProgress, replica_versions
from rft_rollout.rollouts import (STRADDLED, UNVERSIONED, ClientError, InferenceClient, build_samples,
                                  choice_versions, replica_pod)
from rft_rollout.tasksets import arithmetic
from rft_contract.probe import Probe
from rft_contract.fingerprint import FingerprintVerdict
from rft_serving.engines import (ENGINE_DOWN, EngineBroken, Previous, ProbeMismatch, SGLangEngine, SyncError,
                                VLLMEngine)
from rft_serving.serve import COMPLETION_FIELDS, parse_sampling
from rft_serving.sync_agent import ENGINE_START_ATTEMPTS, INITIAL_LINK, SyncAgent
from tests.conftest import wait_for
from tests.fixtures.models import save_tiny_tokenizer

SERVED = "policy"
BODY_KEY = web.RequestKey("json", object) if hasattr(web, "RequestKey") else "json"


# ------------------------------------------------------------------ fakes


class Fake:
    """An aiohttp app on loopback in a background thread; `calls` records every request as
    (method, path, query, JSON body or None)."""

    def __init__(self):
        self.calls: list[tuple[str, str, dict, Any]] = []
        self.label = "default"  # the weight-version label the engine starts with
        self.path = "/weights/initial"  # the weights it serves
        self.reloads = 0
        self.label_spans: list | None = None  # test hook: completion spans to return instead
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def routes(self, app: web.Application) -> None:
        raise NotImplementedError

    def restart(self) -> None:
        """The engine container restarted: back to its start-up weights and label."""
        self.label, self.path = "default", "/weights/initial"

    @web.middleware
    async def _record(self, request: web.Request, handler):
        body = None
        if request.can_read_body:
            raw = await request.read()
            try:
                body = json.loads(raw)
            except ValueError:
                body = raw
        self.calls.append((request.method, request.path, dict(request.query), body))
        request[BODY_KEY] = body
        return await handler(request)

    def start(self) -> "Fake":
        app = web.Application(middlewares=[self._record])
        self.routes(app)
        self._thread.start()

        async def bind():
            self._runner = web.AppRunner(app, access_log=None)
            await self._runner.setup()
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            await site.start()
            return self._runner.addresses[0][1]

        self.port = asyncio.run_coroutine_threadsafe(bind(), self._loop).result(30)
        self.url = f"http://127.0.0.1:{self.port}"
        return self

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def posted(self) -> list[tuple[str, dict, Any]]:
        return [(p, q, b) for m, p, q, b in self.calls if m == "POST" and p != "/v1/completions"]


def _validate(model: type[BaseModel], body: Any) -> BaseModel:
    """What FastAPI does with a pydantic-typed body (lax mode, as FastAPI validates)."""
    if not isinstance(body, dict):
        raise ValidationError.from_exception_data(model.__name__, [
            {"type": "model_type", "loc": ("body",), "input": body,
             "ctx": {"class_name": model.__name__}}])
    return model.model_validate(body)


def _completion_text(i: int) -> str:
    return ["12", "3"][i % 2]


# vLLM 0.32.0 ------------------------------------------------------------------------


class VLLMCompletionRequest(BaseModel):
    """entrypoints/openai/completion/protocol.py (the fields explorers send);
    OpenAIBaseModel has extra="allow" (serve/engine/protocol.py)."""
    model_config = ConfigDict(extra="allow")
    model: Optional[str] = None
    prompt: str | list[str] | list[int]
    n: int = 1
    max_tokens: Optional[int] = 16
    echo: bool = False
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    logprobs: Optional[int] = None
    add_special_tokens: bool = True
    return_token_ids: Optional[bool] = None
    return_weight_versions: bool = False


# The fake vLLM's own tokenizer: ids no explorer-side tokenizer produces, so a test can tell
# the engine's ids from a re-tokenization.
ENGINE_BOS = 990


def engine_ids(text: str) -> list[int]:
    """Characters as 1000 + ord; the text "<bos>" (a template's `{{ bos_token }}`) is ENGINE_BOS."""
    parts = text.split("<bos>")
    return [i for k, part in enumerate(parts)
            for i in ([ENGINE_BOS] if k else []) + [1000 + ord(c) for c in part]]


class UpdateWeightVersionBody(BaseModel):
    """`new_version: Annotated[str, Body(embed=True)]`: FastAPI reads that key only."""
    new_version: str


def fake_logprobs(ids: list[int], offset: float = 0.0) -> list[float]:
    """What the fakes score each token after the first with (the probe's "served" side)."""
    return [-0.5 - (t % 7) / 10 + offset for t in ids[1:]]


class FakeVLLM(Fake):
    """vLLM 0.32.0's API server with VLLM_SERVER_DEV_MODE=1 (dev_mode=False: the routes it
    gates are absent); `extension`: started with our worker extension. `honours_opt_in=True`
    plays a later vLLM that returns weight_versions spans (0.32.0 ignores the opt-in)."""

    def __init__(self, dev_mode: bool = True, honours_opt_in: bool = False, extension: bool = True):
        super().__init__()
        self.dev_mode, self.honours_opt_in, self.extension = dev_mode, honours_opt_in, extension
        self.paused: str | None = None  # the pause mode, while paused
        self.broken = False  # a reload failed part-way
        self.reloaded_while_paused: list[bool] = []
        # Test hooks: route -> predicate on the JSON body; True answers 500 as vLLM's
        # generic handler does. `stop_with` (token id, stop_reason): every choice ends by
        # sampling that stop token. `gate`: completions wait until it is set.
        # `score_offset`: added to every prompt log-prob (weights that differ from the trainer's).
        self.refuse: dict[str, Any] = {}
        self.stop_with: tuple[int, int | None] | None = None
        self.gate: threading.Event | None = None
        self.score_offset = 0.0
        self.corrupt: set[str] = set()  # test hook: weights whose reload fails part-way (bad shapes)

    def restart(self) -> None:
        super().restart()
        self.broken, self.paused = False, None

    def routes(self, app: web.Application) -> None:
        app.router.add_get("/health", self.health)
        app.router.add_post("/v1/completions", self.completions)
        if self.dev_mode:
            app.router.add_post("/pause", self.pause)
            app.router.add_post("/resume", self.resume)
            app.router.add_post("/collective_rpc", self.collective_rpc)
            app.router.add_post("/update_weight_version", self.update_weight_version)
            app.router.add_get("/weight_info", self.weight_info)
            app.router.add_post("/reset_prefix_cache", self.reset_prefix_cache)

    async def health(self, request: web.Request) -> web.Response:
        return web.Response()

    @staticmethod
    def error(status: int, message: str, type_: str = "BadRequestError") -> web.Response:
        return web.json_response({"error": {"message": message, "type": type_, "param": None,
                                            "code": status}}, status=status)

    async def pause(self, request: web.Request) -> web.Response:
        mode = request.query.get("mode", "abort")
        if mode not in ("abort", "wait", "keep") or \
                request.query.get("clear_cache", "true").lower() not in ("true", "false", "1", "0"):
            return self.error(400, "1 validation error: query.mode")
        if (refused := self.refused(request)) is not None:
            return refused
        self.paused = mode
        return web.json_response({"status": "paused"})

    def refused(self, request: web.Request) -> web.Response | None:
        check = self.refuse.get(request.path)
        if check is not None and check(request[BODY_KEY]):
            return self.error(500, f"RuntimeError: {request.path} failed", "InternalServerError")
        return None

    async def resume(self, request: web.Request) -> web.Response:
        if (refused := self.refused(request)) is not None:
            return refused
        self.paused = None
        return web.json_response({"status": "resumed"})

    def rpc_error(self, message: str) -> web.Response:
        return self.error(500, f"Call to collective_rpc method failed: Worker failed with error '{message}', "
                               "please check the stack trace above for the root cause", "InternalServerError")

    async def collective_rpc(self, request: web.Request) -> web.Response:
        body = request[BODY_KEY]
        if not isinstance(body, dict):
            return self.error(400, "Request body must be a JSON object", "Bad Request")
        method = body.get("method")
        if method is None:
            return self.error(400, "Missing 'method' in request body", "Bad Request")
        kwargs = body.get("kwargs", {})
        known = {"reload_weights": {"weights_iterator", "weights_path", "is_checkpoint_format"}}
        if self.extension:
            known["rft_reload_weights"] = {"weights_path"}
        if method not in known:  # the worker has no such method: nothing runs
            return self.rpc_error(f"'CPUWorker' object has no attribute '{method}'")
        unknown = set(kwargs) - known[method]
        if body.get("args") or unknown:
            return self.rpc_error(f"{method}() got an unexpected keyword argument {sorted(unknown)}")
        path = kwargs.get("weights_path") or self.path  # none: reload from the original path
        if self.broken or not os.path.isdir(path) or path in self.corrupt:
            # In place, layer by layer: a failure leaves layers on the meta device, and every
            # later reload fails the same way.
            self.path, self.broken = f"half-loaded:{path}", True
            return self.rpc_error("start (0) + length (1536) exceeds dimension size (288).")
        self.reloaded_while_paused.append(self.paused in ("wait", "abort"))
        self.path, self.reloads = path, self.reloads + 1  # the label does not change
        return web.json_response({"results": [{"retied": []} if method == "rft_reload_weights" else None]})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        try:
            body = _validate(UpdateWeightVersionBody, request[BODY_KEY])
        except ValidationError as e:
            return self.error(400, f"{e.error_count()} validation error: body.new_version")
        if (refused := self.refused(request)) is not None:
            return refused
        self.label = body.new_version
        return web.json_response({"success": True, "new_version": body.new_version})

    async def weight_info(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.label})

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        return web.json_response({"success": True})

    async def completions(self, request: web.Request) -> web.Response:
        try:
            req = _validate(VLLMCompletionRequest, request[BODY_KEY])
        except ValidationError as e:
            return self.error(400, f"{e.error_count()} validation error")
        while self.paused in ("abort", "wait"):  # held, not refused; they run after /resume
            await asyncio.sleep(0.005)
        if self.broken:
            return self.error(500, "EngineCore encountered an issue. See stack trace (above) for the root cause.",
                              "InternalServerError")
        if req.model is not None and req.model != SERVED:
            return self.error(404, f"The model `{req.model}` does not exist. Valid aliases: {SERVED}.",
                              "NotFoundError")
        if req.echo and req.max_tokens == 0:  # prompt log-probs (the probe)
            ids = list(req.prompt)
            lps = [None] + fake_logprobs(ids, self.score_offset)
            return web.json_response({"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                                      "model": SERVED, "choices": [{"index": 0, "text": "", "finish_reason": "length",
                                      "logprobs": {"token_logprobs": lps, "tokens": [f"t{t}" for t in ids]}}]})
        while self.gate is not None and not self.gate.is_set():
            await asyncio.sleep(0.005)
        choices, num_prompt, num_out = [], 0, 0
        for prompt in [req.prompt] if isinstance(req.prompt, str) else req.prompt:
            # vLLM's serving.py: the engine's own prompt ids (BOS only if add_special_tokens)
            prompt_ids = [ENGINE_BOS] * req.add_special_tokens + engine_ids(prompt)
            num_prompt += len(prompt_ids)
            for i in range(req.n):
                text = _completion_text(i)  # the text never holds a special token
                out_ids, finish, stop_reason = engine_ids(text), "length", None
                if self.stop_with is not None:  # the sampled stop token is the last id
                    out_ids, finish, stop_reason = out_ids + [self.stop_with[0]], "stop", self.stop_with[1]
                num_out += len(out_ids)
                spans = [{"version": self.label, "start": 0, "end": len(out_ids)}]
                if self.label_spans is not None:
                    spans = self.label_spans[i]
                choices.append({
                    "index": len(choices), "text": text,
                    "logprobs": {"text_offset": list(range(len(out_ids))),
                                 "token_logprobs": [-0.5] * len(out_ids),
                                 "tokens": [f"t{t}" for t in out_ids], "top_logprobs": [None] * len(out_ids)}
                    if req.logprobs is not None else None,
                    "finish_reason": finish, "stop_reason": stop_reason,
                    "token_ids": out_ids if req.return_token_ids else None,
                    "prompt_logprobs": None,
                    "prompt_token_ids": prompt_ids if req.return_token_ids else None,
                    "routed_experts": None,
                    "weight_versions": spans if req.return_weight_versions and self.honours_opt_in else None})
        return web.json_response({
            "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": req.model or SERVED, "choices": choices, "service_tier": None,
            "system_fingerprint": None, "usage": {"prompt_tokens": num_prompt, "total_tokens": num_prompt + num_out,
                                                  "completion_tokens": num_out, "prompt_tokens_details": None},
            "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None})


# SGLang 0.5.23 ------------------------------------------------------------------------


class UpdateWeightFromDiskReqInput(BaseModel):
    """managers/io_struct.py (+ BaseReq's rid, http_worker_ipc); msgspec_utils.py
    builds a typed dict with extra_behavior="ignore"."""
    model_config = ConfigDict(extra="ignore")
    rid: Optional[str] = None
    http_worker_ipc: Optional[str] = None
    model_path: str
    load_format: Optional[str] = None
    abort_all_requests: bool = False
    weight_version: Optional[str] = None
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0
    flush_cache: bool = True
    manifest: Optional[dict[str, Any]] = None


class SGLangCompletionRequest(BaseModel):
    """entrypoints/openai/protocol.py (the fields explorers send); plain pydantic
    BaseModel: unknown keys such as return_weight_versions are ignored."""
    model: str = "default"
    prompt: str | list[str]
    n: int = 1
    max_tokens: Optional[int] = 16
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    logprobs: Optional[int] = None


class FakeSGLang(Fake):
    """`python -m sglang.launch_server --model-path <initial> --served-model-name policy`."""

    def __init__(self):
        super().__init__()
        self.served_name = SERVED
        self.scheduler_label = self.label  # the scheduler's label: what spans report
        self.running = 0  # requests still in the scheduler: the cache flush is refused
        self.aborted = 0
        self.score_offset = 0.0  # test hook: added to every prompt log-prob

    def restart(self) -> None:
        super().restart()
        self.scheduler_label, self.served_name = self.label, SERVED

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/update_weights_from_disk", self.update_weights_from_disk)
        app.router.add_post("/update_weight_version", self.update_weight_version)
        app.router.add_post("/generate", self.generate)
        app.router.add_get("/model_info", self.model_info)
        app.router.add_post("/v1/completions", self.completions)

    async def update_weight_version(self, request: web.Request) -> web.Response:
        """http_server.py /update_weight_version: UpdateWeightVersionReqInput
        {new_version, abort_all_requests=True}; aborts everything unless told not to."""
        body = request[BODY_KEY]
        if not isinstance(body, dict) or not isinstance(body.get("new_version"), str):
            return self.error(400, "new_version is required")
        if body.get("abort_all_requests", True):
            self.aborted += self.running
            self.running = 0
        self.label = self.scheduler_label = body["new_version"]
        return web.json_response({"success": True, "message": f"Weight version updated to {self.label}",
                                  "new_version": self.label})

    async def generate(self, request: web.Request) -> web.Response:
        """/generate with input_ids, max_new_tokens 0, return_logprob, logprob_start_len 0:
        meta_info.input_token_logprobs [[logprob, id, None], ...], None for the first."""
        body = request[BODY_KEY]
        ids = body.get("input_ids") if isinstance(body, dict) else None
        if not isinstance(ids, list):
            return self.error(400, "input_ids is required here")
        lps = [None] + fake_logprobs(ids, self.score_offset)
        return web.json_response({"text": "", "output_ids": [], "meta_info": {
            "id": uuid.uuid4().hex, "prompt_tokens": len(ids), "completion_tokens": 0,
            "weight_version": self.label,
            "input_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids)]}})

    @staticmethod
    def error(status: int, message: str) -> web.Response:
        return web.json_response({"object": "error", "message": message, "type": "Bad Request",
                                  "param": None, "code": status}, status=status)

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        try:
            req = _validate(UpdateWeightFromDiskReqInput, request[BODY_KEY])
        except ValidationError as e:
            return self.error(400, str(e))
        if req.abort_all_requests:
            self.aborted += self.running
            self.running = 0
        if not os.path.isdir(req.model_path):  # rolled back: old weights, old label
            return web.json_response({"success": False, "num_paused_requests": 0, "message":
                                      f"Failed to update weights: {req.model_path} not found.\n"
                                      "Rolling back to original weights."}, status=400)
        self.path, self.reloads = req.model_path, self.reloads + 1
        if req.weight_version is not None:
            self.scheduler_label = req.weight_version
        if req.flush_cache and self.running:
            return web.json_response({"success": False, "num_paused_requests": 0, "message":
                                      "Weights were updated, but the cache was not flushed because "
                                      "requests are still running or queued. Retract or finish them, "
                                      "then call /flush_cache."}, status=400)
        message = "Succeeded to update model weights."
        if req.weight_version is not None:
            self.label = req.weight_version
            message += f" Weight version updated to {req.weight_version}."
        self.served_name = req.model_path  # _update_model_path_info
        return web.json_response({"success": True, "message": message, "num_paused_requests": 0})

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({
            "model_path": self.path, "served_model_name": self.served_name, "tokenizer_path": self.path,
            "is_generation": True, "preferred_sampling_params": None, "weight_version": self.label,
            "load_format": "auto", "reasoning_parser": None, "tool_call_parser": None,
            "disaggregation_mode": "null", "has_image_understanding": False,
            "has_audio_understanding": False, "model_type": "qwen2",
            "architectures": ["Qwen2ForCausalLM"]})

    async def completions(self, request: web.Request) -> web.Response:
        if request.content_type != "application/json":
            return self.error(400, "Unsupported Media Type: Only 'application/json' is allowed")
        try:
            req = _validate(SGLangCompletionRequest, request[BODY_KEY])
        except ValidationError as e:
            return self.error(400, str(e))
        if ":" in req.model and req.model != self.served_name:  # base:adapter, no such adapter
            return self.error(400, f"LoRA adapter {req.model.split(':', 1)[1]!r} is not loaded")
        choices = [{"index": i, "text": _completion_text(i),
                    "logprobs": {"text_offset": [], "token_logprobs": [-0.5] * len(_completion_text(i)),
                                 "tokens": list(_completion_text(i)), "top_logprobs": []}
                    if req.logprobs is not None else None,
                    "finish_reason": "length", "matched_stop": None} for i in range(req.n)]
        first = len(choices[0]["text"])
        spans = self.label_spans if self.label_spans is not None else \
            [{"version": self.scheduler_label, "start": 0, "end": first}]
        tokens = sum(len(c["text"]) for c in choices)
        return web.json_response({
            "id": uuid.uuid4().hex, "object": "text_completion", "created": int(time.time()),
            "model": req.model, "choices": choices,
            "usage": {"prompt_tokens": 4, "total_tokens": 4 + tokens, "completion_tokens": tokens,
                      "prompt_tokens_details": None, "reasoning_tokens": 0},
            "metadata": {"weight_version": spans[-1]["version"], "weight_versions": spans}})


@pytest.fixture
def vllm(request):
    """vLLM 0.32.0; parametrize indirectly with {"honours_opt_in": True} for a later vLLM
    that reports weight_versions spans."""
    fake = FakeVLLM(**getattr(request, "param", {})).start()
    yield fake
    fake.stop()


@pytest.fixture
def sglang():
    fake = FakeSGLang().start()
    yield fake
    fake.stop()


@pytest.fixture
def weights(tmp_path) -> Path:
    d = tmp_path / "export-v3"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return d


BODY = {"model": SERVED, "prompt": "2+3=", "n": 2, "max_tokens": 4, "temperature": 1.0,
        "top_p": 1.0, "logprobs": 0}


# ------------------------------------------------------------------ vLLM adapter


def probe_for(ids=(5, 9, 2, 7, 3), offset: float = 0.0, dtype: str = "fp32") -> Probe:
    """The probe the trainer would write for weights the fakes serve (offset 0)."""
    return Probe(list(ids), fake_logprobs(list(ids), offset), dtype, 3)


def test_vllm_load_pauses_reloads_resumes_checks_the_probe_then_labels(vllm, weights):
    engine = VLLMEngine(vllm.url)
    assert engine.served() is None  # "default": not one of ours
    verdict = engine.load(str(weights), 3, probe_for())
    assert verdict.ok and verdict.tokens == 4 and verdict.mean_diff == 0
    assert vllm.posted() == [
        ("/pause", {"mode": "wait"}, None),
        ("/update_weight_version", {}, {"new_version": "reloading-3"}),  # before the weights change
        ("/collective_rpc", {}, {"method": "rft_reload_weights", "kwargs": {"weights_path": str(weights)}}),
        ("/reset_prefix_cache", {}, None),
        ("/resume", {}, None),
        ("/update_weight_version", {}, {"new_version": "3"}),  # only once the probe passed
    ]
    probe_call = [b for m, p, q, b in vllm.calls if p == "/v1/completions"]
    assert probe_call == [{"model": SERVED, "prompt": [5, 9, 2, 7, 3], "max_tokens": 0, "echo": True,
                           "logprobs": 0, "temperature": 0}]
    assert vllm.reloaded_while_paused == [True] and vllm.paused is None
    assert vllm.path == str(weights) and vllm.label == "3" and engine.served() == 3


def test_vllm_without_our_extension_falls_back_to_plain_reload_weights(weights, caplog):
    fake = FakeVLLM(extension=False).start()
    try:
        engine = VLLMEngine(fake.url)
        with caplog.at_level(logging.WARNING, logger="rft_serving.engines"):
            engine.load(str(weights), 3, None)
            engine.load(str(weights), 4, None)
        rpcs = [b["method"] for p, _, b in fake.posted() if p == "/collective_rpc"]
        assert rpcs == ["rft_reload_weights", "reload_weights", "reload_weights"]  # asked once
        assert "without rft_serving.vllm_worker.RFTWorkerExtension" in caplog.text
        assert engine.served() == 4 and fake.reloads == 2
    finally:
        fake.stop()


def test_vllm_weights_that_fail_the_probe_are_never_labelled(vllm, weights):
    vllm.label = "2"
    vllm.score_offset = 0.3  # e.g. a stale tied lm_head: every log-prob off
    engine = VLLMEngine(vllm.url)
    with pytest.raises(ProbeMismatch, match=r"version 3 after a reload: .*mean \|served - trained\| log-prob 0.3"):
        engine.load(str(weights), 3, probe_for())
    assert vllm.path == str(weights) and vllm.paused is None  # serving, under no version of ours
    assert vllm.label == "reloading-3" and engine.served() is None
    assert engine.load(str(weights), 3, probe_for(offset=0.3)).ok  # a matching probe passes


@pytest.mark.parametrize("label, served", [("default", None), ("3", 3), ("0", 0),
                                           ("reloading-4", None), ("resume-failed-4", None),
                                           ("failed-reload-4", None), ("v3", None), ("", None)])
def test_vllm_served_reads_the_engines_label(vllm, label, served):
    vllm.label = label
    assert VLLMEngine(vllm.url).served() == served
    assert vllm.calls[-1][:2] == ("GET", "/weight_info")


def test_vllm_a_failed_reload_leaves_the_engine_paused_and_broken(vllm, tmp_path, weights):
    """What real vLLM does: layers left on the meta device, every later reload fails, and the
    next request would kill it. So the adapter does not resume: only a restart cures it."""
    vllm.label = "2"
    engine = VLLMEngine(vllm.url)
    with pytest.raises(EngineBroken, match="version 3: the reload failed part-way .*needs a fresh start"):
        engine.load(str(tmp_path / "missing"), 3, None)
    assert [p for p, _, _ in vllm.posted()] == ["/pause", "/update_weight_version", "/collective_rpc"]
    assert vllm.label == "reloading-3" and engine.served() is None and vllm.paused == "wait"
    with pytest.raises(EngineBroken):  # good weights cannot repair it either
        engine.load(str(weights), 3, None)
    vllm.restart()  # a fresh start from disk does
    assert engine.load(str(weights), 3, None) is None and engine.served() == 3


def adapter_dir(root: Path, version: int) -> Path:
    d = root / f"adapter-v{version}"
    d.mkdir()
    (d / "adapter_config.json").write_text("{}")  # what marks a LoRA version (rft_contract.layout)
    return d


class AdapterSlots:
    """What the engine's LoRA routes would do, for the control flow around them: every
    adapter loads, and the exact check of the slots passes (`checked` False: the check could
    not run, as in an engine without our worker extension)."""

    def __init__(self, engine: VLLMEngine, monkeypatch, checked: bool = True):
        self.loaded: list[str] = []
        monkeypatch.setattr(engine, "_reload", self.loaded.append)
        monkeypatch.setattr(engine, "check_fingerprint",
                            lambda path, version: FingerprintVerdict(True, 4) if checked else None)


def test_vllm_an_adapter_that_fails_its_probe_after_the_exact_check_goes_back_in_place(vllm, tmp_path, monkeypatch):
    """The slots hold the adapter as exported, yet it scores the probe unlike the trainer: a
    restart would load the same bytes, so the engine pauses again, the previous adapter goes
    back in place, checked, and serves under its label."""
    vllm.label = "2"
    engine = VLLMEngine(vllm.url)
    slots = AdapterSlots(engine, monkeypatch)
    v2, v3 = adapter_dir(tmp_path, 2), adapter_dir(tmp_path, 3)
    with pytest.raises(ProbeMismatch, match=r"version 3 after a reload: the engine does not serve the trained "
                                            r"weights: .*; serving version 2 again") as refused:
        engine.load(str(v3), 3, probe_for(offset=0.3), previous=Previous(str(v2), 2, probe_for()))
    assert refused.value.serving == 2 and slots.loaded == [str(v3), str(v2)]
    assert [p for m, p, _, _ in vllm.calls if m == "POST"] == [
        "/pause", "/update_weight_version", "/reset_prefix_cache", "/resume", "/v1/completions",  # v3, probed
        "/pause", "/reset_prefix_cache", "/resume", "/v1/completions", "/update_weight_version"]  # v2 again
    assert vllm.label == "2" and vllm.paused is None and engine.served() == 2


def test_vllm_an_adapter_probe_failure_keeps_the_restart_where_going_back_cannot_be_trusted(
        vllm, tmp_path, monkeypatch):
    """Left to the agent's restart (ProbeMismatch without `serving`, the engine under no
    version of ours): when the exact check could not run, when the engine cannot be paused
    again, and with no version before it. Previous weights that fail their own probe when
    they go back break the engine (EngineBroken: a restart on the last good version)."""
    v2, v3 = adapter_dir(tmp_path, 2), adapter_dir(tmp_path, 3)
    previous = Previous(str(v2), 2, probe_for())

    def refused_for_restart(engine: VLLMEngine, **kw) -> None:
        with pytest.raises(ProbeMismatch, match="version 3 after a reload") as e:
            engine.load(str(v3), 3, probe_for(offset=0.3), **kw)
        assert e.value.serving is None and vllm.label == "reloading-3" and engine.served() is None

    engine = VLLMEngine(vllm.url)
    AdapterSlots(engine, monkeypatch, checked=False)  # e.g. a worker extension of the user's own
    refused_for_restart(engine, previous=previous)

    engine = VLLMEngine(vllm.url)
    AdapterSlots(engine, monkeypatch)
    refused_for_restart(engine)  # version 0 had failed: nothing to go back to

    pauses = iter([False, True])  # the second pause, after the probe failed, answers 500
    vllm.refuse["/pause"] = lambda body: next(pauses)
    refused_for_restart(engine, previous=previous)
    assert vllm.paused is None  # serving, unlabelled, until the agent restarts it
    vllm.refuse.clear()

    with pytest.raises(EngineBroken, match="version 3 after a reload.*going back to version 2 failed too"):
        engine.load(str(v3), 3, probe_for(offset=0.3), previous=Previous(str(v2), 2, probe_for(offset=0.1)))


def test_vllm_requests_sent_while_paused_are_held_and_run_after_resume(vllm, weights):
    engine = VLLMEngine(vllm.url)
    engine.load(str(weights), 2, None)
    vllm.paused = "wait"
    done = threading.Event()
    threading.Thread(target=lambda: (InferenceClient([vllm.url]).complete(BODY), done.set()), daemon=True).start()
    assert not done.wait(0.3)  # held, not refused
    vllm.paused = None
    assert done.wait(10)


def test_vllm_new_weights_never_serve_under_the_old_label(vllm, weights):
    """The reload succeeds, setting the new label fails: the engine serves the new weights
    labelled "reloading-3", never "2"; the agent retries."""
    vllm.label = "2"
    vllm.refuse["/update_weight_version"] = lambda body: body["new_version"] == "3"
    engine = VLLMEngine(vllm.url)
    with pytest.raises(SyncError, match="update_weight_version: HTTP 500"):
        engine.load(str(weights), 3, probe_for())
    assert vllm.path == str(weights) and vllm.reloads == 1  # the new weights are in
    assert vllm.label == "reloading-3" and engine.served() is None and vllm.paused is None
    vllm.refuse.clear()
    engine.load(str(weights), 3, probe_for())
    assert engine.served() == 3


def test_vllm_a_failing_resume_is_a_sync_error_and_the_agent_reloads(vllm, tmp_path, weights):
    """Weights in, /resume fails: a SyncError with the label still `reloading-3`, so the
    agent's next pass reloads (and resumes) instead of counting a paused replica synced,
    even for a target without an id (a pinned version, or the base model)."""
    vllm.refuse["/resume"] = lambda body: True
    engine = VLLMEngine(vllm.url)
    with pytest.raises(SyncError, match="resume: HTTP 500"):
        engine.load(str(weights), 3, None)
    assert vllm.label == "reloading-3" and engine.served() is None and vllm.paused == "wait"

    vllm.label, vllm.paused = "2", None
    target = {"version": 3, "id": None, "uri": str(weights)}
    agent, api = make_agent(engine, tmp_path, target)
    with pytest.raises(SyncError, match="resume: HTTP 500"):
        agent.converge(target)
    agent.attempts += 1  # what run() does with the error
    agent.report_error("could not resume")
    assert vllm.paused == "wait"
    vllm.refuse.clear()
    assert agent.converge(target)  # reloaded: paused, resumed
    assert vllm.paused is None and vllm.reloads == 3 and engine.served() == 3
    assert api.status["weightSync"]["replicas"]["job-inference-0"]["version"] == 3


def test_vllm_without_dev_mode_says_so(weights):
    fake = FakeVLLM(dev_mode=False).start()
    try:
        with pytest.raises(SyncError, match="VLLM_SERVER_DEV_MODE=1"):
            VLLMEngine(fake.url).load(str(weights), 3, None)
        with pytest.raises(SyncError, match="HTTP 404"):
            VLLMEngine(fake.url).served()
    finally:
        fake.stop()


# ------------------------------------------------------------------ SGLang adapter


def test_sglang_load_reloads_under_a_provisional_label_checks_the_probe_then_labels(sglang, weights):
    engine = SGLangEngine(sglang.url)
    assert engine.served() is None  # --weight-version default "default"
    assert engine.load(str(weights), 3, probe_for()).ok
    assert sglang.posted() == [
        ("/update_weights_from_disk", {}, {"model_path": str(weights), "weight_version": "reloading-3",
                                           "abort_all_requests": False}),
        ("/generate", {}, {"input_ids": [5, 9, 2, 7, 3], "sampling_params": {"max_new_tokens": 0},
                           "return_logprob": True, "logprob_start_len": 0}),
        ("/update_weight_version", {}, {"new_version": "3", "abort_all_requests": False}),
    ]
    assert engine.served() == 3 and sglang.path == str(weights) and sglang.aborted == 0


def test_sglang_weights_that_fail_the_probe_keep_the_provisional_label(sglang, weights):
    sglang.score_offset = 1.0
    engine = SGLangEngine(sglang.url)
    with pytest.raises(ProbeMismatch):
        engine.load(str(weights), 3, probe_for())
    assert sglang.label == "reloading-3" and engine.served() is None


def test_sglang_refusals_are_sync_errors(sglang, weights, tmp_path):
    engine = SGLangEngine(sglang.url)
    engine.load(str(weights), 3, None)
    with pytest.raises(SyncError, match="HTTP 400.*Rolling back"):
        engine.load(str(tmp_path / "missing"), 4, None)
    assert engine.served() == 3
    sglang.running = 1  # requests left in the scheduler: the flush is refused (success false)
    with pytest.raises(SyncError, match="cache was not flushed"):
        engine.load(str(weights), 5, None)
    # The weights changed but the old label stayed on: taken off (no version served) until
    # the agent's retry loads them again.
    assert engine.served() is None and sglang.aborted == 0


def test_sglang_keeps_answering_policy_after_it_renames_the_model(sglang, weights):
    SGLangEngine(sglang.url).load(str(weights), 3, None)
    assert sglang.served_name == str(weights)  # what /v1/models now lists
    client = InferenceClient([sglang.url])
    response, versions = client.complete(BODY)
    assert response["model"] == SERVED and versions == [3, 3]
    with pytest.raises(Exception, match="LoRA"):  # a ':' would mean base:adapter
        client.complete({**BODY, "model": "policy:v3"})


# ------------------------------------------------------------------ the agent


class FakeJobApi:
    """patch_status's API call; every patch is fed back to the agent as its watch would."""

    def __init__(self):
        self.status: dict = {}
        self.patches: list[dict] = []
        self.agent: SyncAgent | None = None

    def patch_namespaced_custom_object_status(self, group, version, ns, plural, name, body, **kw):
        from rft_contract.jobapi import merge

        entry = body["status"]["weightSync"]["replicas"]["job-inference-0"]
        self.patches.append(dict(entry))
        merge(self.status, json.loads(json.dumps(body["status"])))
        self.agent._update({"status": self.status})


def make_agent(engine, tmp_path: Path, target: dict) -> tuple[SyncAgent, FakeJobApi]:
    api = FakeJobApi()
    agent = SyncAgent("job", "ns", "job-inference-0", engine, tmp_path / "dest", api=api)
    api.agent = agent
    api.status = {"weightSync": {"target": target}}
    agent._update({"status": api.status})
    return agent, api


class MemoryEngine:
    """An engine whose container can restart (back to its start-up weights, no version)."""

    def __init__(self):
        self.version: int | None = None
        self.loads: list[tuple[str, int]] = []

    def served(self) -> int | None:
        return self.version

    def load(self, path: str, version: int, probe=None, tolerance=None, previous=None) -> None:
        self.loads.append((path, version))
        self.version = version

    def restarts(self) -> int | None:
        return None  # no supervisor


def test_an_engine_that_restarts_is_reloaded_although_the_agent_loaded_it(tmp_path, weights):
    target = {"version": 3, "id": "abc", "uri": str(weights)}
    engine = MemoryEngine()
    agent, api = make_agent(engine, tmp_path, target)
    assert agent.converge(target) and engine.loads == [(str(weights), 3)]
    assert api.patches[-1]["version"] == 3 and agent.served["version"] == 3
    assert not agent.converge(target)  # in sync: nothing to do
    engine.version = None  # the engine container restarted; the agent still believes v3
    assert agent.converge(target) and engine.loads[-1] == (str(weights), 3)
    # Each load is preceded by "no version" (None); the restart is said first, then reported again.
    assert [p["version"] for p in api.patches] == [None, 3, None, None, 3]
    assert api.patches[-1]["id"] == "abc" and api.patches[-1]["error"] is None
    engine.version = 0  # restarted on other weights that carry a version of ours
    assert agent.converge(target) and len(engine.loads) == 3
    assert api.status["weightSync"]["replicas"]["job-inference-0"]["version"] == 3


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_a_restarted_engine_container_is_reloaded_over_http(kind, tmp_path, weights):
    fake = (FakeVLLM() if kind == "vllm" else FakeSGLang()).start()
    try:
        engine = VLLMEngine(fake.url) if kind == "vllm" else SGLangEngine(fake.url)
        target = {"version": 3, "id": "abc", "uri": str(weights)}
        agent, api = make_agent(engine, tmp_path, target)
        assert agent.converge(target) and fake.reloads == 1 and engine.served() == 3
        assert not agent.converge(target) and fake.reloads == 1
        fake.restart()
        assert agent.converge(target) and fake.reloads == 2 and engine.served() == 3
        assert [p["version"] for p in api.patches] == [None, 3, None, None, 3]
    finally:
        fake.stop()


class RecordingEngine(MemoryEngine):
    """Records this pod's status entry as it is when each load starts; `fail` refuses loads
    (the old weights keep serving), `hook` runs inside the load after the weights changed."""

    def __init__(self):
        super().__init__()
        self.api: FakeJobApi | None = None  # set once the agent has one
        self.entries_at_load, self.fail, self.hook = [], False, None

    def load(self, path: str, version: int, probe=None, tolerance=None, previous=None) -> None:
        self.entries_at_load.append(dict(self.api.status["weightSync"]["replicas"]["job-inference-0"]))
        if self.fail:
            raise SyncError("engine refused the weights")
        super().load(path, version)
        if self.hook:
            self.hook()


def test_the_record_says_no_version_while_the_engine_reloads(tmp_path, weights):
    from rft_operator.weightsync import count_synced, is_synced

    engine = RecordingEngine()
    target = {"version": 3, "id": "abc", "uri": str(weights)}
    agent, api = make_agent(engine, tmp_path, target)
    engine.api = api
    assert agent.converge(target)
    during = engine.entries_at_load[0]
    assert during["version"] is None and during["id"] is None  # written before the load began
    assert not is_synced(during, target)  # the operator counts it unsynced
    assert count_synced({"job-inference-0": during}, ["job-inference-0"], target, 5).lag_steps is None
    assert api.patches[-1]["version"] == 3 and api.patches[-1]["id"] == "abc"

    # A failed load: None while it ran, then the version the engine itself still reports.
    engine.fail = True
    target4 = {"version": 4, "id": "def", "uri": str(weights)}
    with pytest.raises(SyncError, match="refused"):
        agent.converge(target4)
    assert engine.entries_at_load[1]["version"] is None
    agent.attempts += 1
    agent.report_error("engine refused the weights")
    entry = api.status["weightSync"]["replicas"]["job-inference-0"]
    assert entry["version"] == 3 and entry["error"] == "engine refused the weights"


def test_an_engine_that_cannot_be_asked_after_a_load_is_reported_as_unknown(tmp_path, weights):
    """Not the version from before the load: the load may have changed it."""
    engine = MemoryEngine()
    engine.version = 2
    target = {"version": 3, "id": "abc", "uri": str(weights)}
    agent, api = make_agent(engine, tmp_path, target)
    asked = []

    def served():
        asked.append(1)
        if len(asked) > 1:  # the first answer; then the engine stops answering
            raise SyncError("engine not reachable")
        return engine.version

    engine.served = served
    with pytest.raises(SyncError, match="not reachable"):
        agent.converge(target)
    agent.report_error("engine not reachable")
    assert api.patches[-1]["version"] is None


def test_an_engine_still_starting_is_one_info_line_and_a_lost_one_a_warning(tmp_path, weights, caplog):
    """Expected start-up is not a warning: one info line while the engine has not answered
    yet, one when it does; once it has, losing it is a warning each time."""
    engine = MemoryEngine()
    target = {"version": 0, "id": "abc", "uri": str(weights)}
    agent, _ = make_agent(engine, tmp_path, target)
    down = SyncError(f"{ENGINE_DOWN} at http://127.0.0.1:8000: ConnectionError")
    with caplog.at_level(logging.INFO, logger="rft_serving.sync_agent"):
        for attempt in (1, 2, 3):
            agent.attempts = attempt
            agent._log_failure(target, down, str(down))
        agent.converge(target)  # it answers
        agent.attempts = 1
        agent._log_failure(target, down, str(down))
    lines = [(r.levelname, r.getMessage().split(" (")[0]) for r in caplog.records if r.name == "rft_serving.sync_agent"]
    assert lines[0] == ("INFO", "waiting for the engine to answer")
    assert ("INFO", "the engine answers") in lines
    assert [level for level, _ in lines].count("WARNING") == 1 and lines[-1][0] == "WARNING"
    assert [m for _, m in lines].count("waiting for the engine to answer") == 1
    # One that never comes up is worth a warning again, after a while.
    caplog.clear()
    never, _ = make_agent(MemoryEngine(), tmp_path / "never", target)
    with caplog.at_level(logging.INFO, logger="rft_serving.sync_agent"):
        for attempt in range(1, ENGINE_START_ATTEMPTS + 1):
            never.attempts = attempt
            never._log_failure(target, down, str(down))
    assert [r.levelname for r in caplog.records] == ["INFO", "WARNING"]


def test_no_reload_without_the_no_version_entry(tmp_path, weights):
    class Refusing(FakeJobApi):
        def patch_namespaced_custom_object_status(self, *args, **kw):
            raise RuntimeError("forbidden")

    api = Refusing()
    engine = MemoryEngine()
    agent = SyncAgent("job", "ns", "job-inference-0", engine, tmp_path / "dest", api=api)
    target = {"version": 3, "id": "abc", "uri": str(weights)}
    agent._update({"status": {"weightSync": {"target": target}}})
    agent._stop.set()  # no waits between the patch retries
    with pytest.raises(SyncError, match="could not mark the replica's status entry unsynced"):
        agent.converge(target)
    assert engine.loads == []


def test_requests_around_the_end_of_a_load_are_dropped_not_labelled_old(tmp_path, weights):
    """An engine that reports no versions (the record decides): a request that started on
    the old weights and ended after the load, before the new version was recorded, and a
    request that ran entirely in that window, are both dropped; before the fix the record
    still said 3 then, and both were labelled 3."""
    fake = FakeVLLM(honours_opt_in=False).start()
    try:
        engine = RecordingEngine()
        engine.version = 3
        target3 = {"version": 3, "id": "a", "uri": str(weights)}
        agent, api = make_agent(engine, tmp_path, target3)
        engine.api = api
        agent.report_ok(target3, None)

        def version_of(i: int) -> int | None:  # what KubeProgress.replica_version reads
            v = api.status["weightSync"]["replicas"]["job-inference-0"].get("version")
            return v if isinstance(v, int) else None

        client = InferenceClient([fake.url], version_of=version_of)
        assert client.complete(BODY).versions == [3, 3]
        fake.gate = threading.Event()
        straddler: list = []
        started = len(fake.calls)
        thread = threading.Thread(target=lambda: straddler.append(client.complete(BODY)))
        thread.start()  # reads 3, then waits in the engine
        deadline = time.monotonic() + 10
        while len(fake.calls) == started:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        inside: list = []

        def after_the_weights_changed():  # the load is done; the agent has not recorded it
            fake.gate.set()
            thread.join(10)
            inside.append(client.complete(BODY))

        engine.hook = after_the_weights_changed
        target4 = {"version": 4, "id": "b", "uri": str(weights)}
        assert agent.converge(target4)
        assert straddler[0].versions == [UNVERSIONED, UNVERSIONED]
        assert inside[0].versions == [UNVERSIONED, UNVERSIONED]
        assert client.complete(BODY).versions == [4, 4]  # once recorded
    finally:
        if fake.gate is not None:
            fake.gate.set()  # never leave the request waiting (a failing test)
        fake.stop()


class ThrottledApiServer:
    """An API server that answers every request 429 (API Priority and Fairness refusing),
    for a real kubernetes client: `requests` counts what reached it."""

    def __init__(self):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        outer, self.requests = self, 0

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                outer.requests += 1
                body = json.dumps({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                   "reason": "TooManyRequests", "code": 429}).encode()
                self.send_response(429)
                self.send_header("Retry-After", "1")
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_PATCH = do_POST = do_GET

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def client(self):
        import kubernetes

        config = kubernetes.client.Configuration()
        config.host = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        return kubernetes.client.CustomObjectsApi(kubernetes.client.ApiClient(config))

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_versions_come_from_the_agent_so_a_throttled_api_server_drops_no_sample(tmp_path, weights):
    """An engine that reports no versions (vLLM 0.32.0): each request's version is the sync
    agent's record read from the agent itself (`GET /record` on its peer server), never
    from the API server. With the API server answering every request 429, every sample
    keeps its version; a request that straddles a reload back to the SAME version number
    (a new export of it) is dropped, which the status entry cannot tell; and the API
    server is not read at all. An agent too old for `/record` (404) is read from the job's
    status instead, where the throttled API drops its samples: what every sample suffered
    before."""
    from rft_rollout.explorer import ReplicaRecords
    from rft_contract.relay import PeerServer

    fake = FakeVLLM(honours_opt_in=False).start()
    throttled = ThrottledApiServer()
    peer = PeerServer(tmp_path / "peer").start()
    try:
        engine = RecordingEngine()
        engine.version = 3
        target = {"version": 3, "id": "a", "uri": str(weights)}
        agent, api = make_agent(engine, tmp_path, target)
        engine.api = api
        peer.record = agent.record
        agent.report_ok(target, None)
        progress = KubeProgress(throttled.client(), "job", "ns", total_steps=10)
        records = ReplicaRecords([fake.url], ["job-inference-0"], peer.port, progress)
        client = InferenceClient([fake.url], version_of=records)
        assert [client.complete(BODY).versions for _ in range(5)] == [[3, 3]] * 5

        fake.gate = threading.Event()
        straddler: list = []
        started = len(fake.calls)
        thread = threading.Thread(target=lambda: straddler.append(client.complete(BODY)))
        thread.start()  # reads the record, then waits in the engine
        wait_for(lambda: len(fake.calls) > started, 10, "the request to reach the engine")
        again = {"version": 3, "id": "b", "uri": str(weights)}  # version 3 exported anew
        assert agent.converge(again)
        fake.gate.set()  # the request ends after the weights changed and were recorded
        thread.join(10)
        assert straddler[0].versions == [STRADDLED, STRADDLED]
        assert client.complete(BODY).versions == [3, 3]
        assert throttled.requests == 0 and progress.record_reads == 0
        assert records.reads == 2 * 7

        peer.record = None  # an agent from before the route: 404
        assert client.complete(BODY).versions == [UNVERSIONED, UNVERSIONED]
        assert records.on_status(0) and progress.record_reads == 2 and throttled.requests >= 2
    finally:
        if fake.gate is not None:
            fake.gate.set()
        fake.stop()
        throttled.stop()
        peer.stop()


def test_an_agent_the_explorer_cannot_reach_is_read_from_the_job_status_after_three_tries(tmp_path, weights):
    """A NetworkPolicy that lets only inference pods reach the agent's port (the advice before
    explorers read it): after three unanswered reads the job's status says, and the agent is
    asked again a minute later."""
    import socket

    from rft_rollout.explorer import ReplicaRecords

    class StatusApi(FakeJobApi):
        def get_namespaced_custom_object(self, group, version, ns, plural, name, **kw):
            return {"status": json.loads(json.dumps(self.status))}

    engine = MemoryEngine()
    target = {"version": 3, "id": "a", "uri": str(weights)}
    agent = SyncAgent("job", "ns", "job-inference-0", engine, tmp_path / "dest", api=StatusApi())
    agent.api.agent, agent.api.status = agent, {"weightSync": {"target": target}}
    agent._update({"status": agent.api.status})
    agent.converge(target)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    records = ReplicaRecords(["http://127.0.0.1:8000"], ["job-inference-0"], closed,
                             KubeProgress(agent.api, "job", "ns", total_steps=10))
    assert [records(0) for _ in range(4)] == [None, None, 3, 3]
    assert records.on_status(0) and records.reads == 3
    records.status_until[0] = 0.0  # a minute later: the agent is asked again
    assert records(0) is None and records.reads == 4


def test_the_agents_record_changes_generation_with_every_change_of_version(tmp_path, weights):
    engine = MemoryEngine()
    target = {"version": 3, "id": "a", "uri": str(weights)}
    agent, _ = make_agent(engine, tmp_path, target)
    first = agent.record()
    assert first["version"] is None  # nothing known yet: no request is labelled
    agent.converge(target)
    loaded = agent.record()
    assert loaded["version"] == 3 and loaded["generation"] != first["generation"]
    agent.report_ok(target, None)  # the same version written again: no change
    assert agent.record() == loaded
    agent.converge({"version": 3, "id": "b", "uri": str(weights)})
    assert agent.record()["version"] == 3 and agent.record()["generation"] != loaded["generation"]
    restarted, _ = make_agent(engine, tmp_path, target)  # another process: another boot id
    assert restarted.record()["generation"].split(":")[0] != loaded["generation"].split(":")[0]


def test_the_start_up_link_follows_the_loaded_weights(tmp_path, weights):
    """vLLM/SGLang start from <dest>/initial: after a load it names the loaded weights, and
    the directory it names is never cleaned up."""
    dest = tmp_path / "dest"
    first = dest / "v00000000-base"
    first.mkdir(parents=True)
    (dest / INITIAL_LINK).symlink_to(first)
    target = {"version": 3, "id": "abc", "uri": str(weights)}
    agent, _ = make_agent(MemoryEngine(), tmp_path, target)
    agent.converge(target)
    assert (dest / INITIAL_LINK).resolve() == weights.resolve() and not first.exists()
    kept = dest / "v00000003-abc"  # an s3 version's local copy, named by the link
    kept.mkdir()
    (dest / INITIAL_LINK).unlink()
    (dest / INITIAL_LINK).symlink_to(kept)
    agent._cleanup({"version": 4, "id": "x"})
    assert kept.exists()


class FakeSupervisor:
    """rft_serving.supervise's control routes for a fake engine: a restart starts the
    engine afresh from what `<dest>/initial` names (its label "default")."""

    def __init__(self, fake: Fake, initial: Path):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.restarts, self.reasons = 0, []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                self._reply({"pid": 1, "restarts": outer.restarts, "started": 0})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                outer.restarts += 1
                outer.reasons.append(body.get("reason"))
                fake.restart()
                fake.path = str(initial.resolve())
                self._reply({"restarts": outer.restarts})

            def _reply(self, body):
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self):
        self.server.shutdown()


def export_dir(tmp_path: Path, version: int, offset: float = 0.0) -> Path:
    """A local export with its probe (what the fakes score, shifted by `offset`)."""
    d = tmp_path / f"export-v{version}"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "probe.json").write_text(probe_for(offset=offset).to_json())
    return d


class StaleAfterReload(FakeVLLM):
    """vLLM's CPU build with a tied lm_head and no extension: after an in-place reload the
    output layer keeps its old weights (every log-prob off); a fresh start is right."""

    async def collective_rpc(self, request):
        response = await super().collective_rpc(request)
        if response.status == 200:
            self.score_offset = 0.7
        return response

    def restart(self):
        super().restart()
        self.score_offset = 0.0


def supervised_agent(fake: Fake, tmp_path: Path, target: dict):
    dest = tmp_path / "dest"
    dest.mkdir(exist_ok=True)
    (dest / INITIAL_LINK).symlink_to(tmp_path)  # what the init container fetched
    supervisor = FakeSupervisor(fake, dest / INITIAL_LINK)
    engine = VLLMEngine(fake.url, supervisor=supervisor.url)
    agent, api = make_agent(engine, tmp_path, target)
    agent.engine_start_timeout = 10
    return agent, api, supervisor


def test_a_reload_that_fails_the_probe_is_restarted_from_disk_then_reported(tmp_path):
    """The workaround-free path on vLLM: a plain reload leaves the tied head stale, the
    probe catches it, nothing is reported for it, a fresh start from the same files
    passes, and only then the replica reports the version (with what happened)."""
    fake = StaleAfterReload(extension=False).start()
    v3 = export_dir(tmp_path, 3)
    target = {"version": 3, "id": "abc", "uri": str(v3)}
    agent, api, supervisor = supervised_agent(fake, tmp_path, target)
    try:
        assert agent.converge(target)
        assert supervisor.restarts == 1 and "does not serve the trained weights" in supervisor.reasons[0]
        entry = api.status["weightSync"]["replicas"]["job-inference-0"]
        assert entry["version"] == 3 and entry["probe"]["meanDiff"] == 0 and entry["engineRestarts"] == 1
        assert "mean |served - trained| log-prob 0.7" in entry["lastRestart"] and entry["error"] is None
        # Never an integer version while the wrong weights served: null, then 3.
        assert [p["version"] for p in api.patches if "version" in p] == [None, 3]
        assert fake.label == "3" and (tmp_path / "dest" / INITIAL_LINK).resolve() == v3.resolve()
    finally:
        supervisor.stop()
        fake.stop()


def test_a_reload_that_breaks_the_engine_brings_back_the_last_good_version(tmp_path):
    fake = FakeVLLM().start()
    v3, v5 = export_dir(tmp_path, 3), export_dir(tmp_path, 5)
    target = {"version": 3, "id": "abc", "uri": str(v3)}
    agent, api, supervisor = supervised_agent(fake, tmp_path, target)
    try:
        assert agent.converge(target) and supervisor.restarts == 0
        assert api.status["weightSync"]["replicas"]["job-inference-0"]["engineRestarts"] == 0
        v4 = export_dir(tmp_path, 4)
        fake.corrupt.add(str(v4))  # a wrong-shaped tensor: the reload fails part-way
        corrupt = {"version": 4, "id": "bad", "uri": str(v4)}
        api.status["weightSync"]["target"] = corrupt
        with pytest.raises(EngineBroken):
            agent.converge(corrupt)
        # Restarted from disk on version 3, checked, labelled: the replica serves 3 again.
        assert supervisor.restarts == 1 and not fake.broken and fake.label == "3"
        assert fake.path == str(v3.resolve()) and agent.engine_version == 3
        entry = api.status["weightSync"]["replicas"]["job-inference-0"]
        assert "version 4: the reload failed part-way" in entry["lastRestart"]
        with pytest.raises(SyncError, match="version 4 broke the engine .* retrying it in"):
            agent.converge(corrupt)  # not again at once
        assert supervisor.restarts == 1
        newer = {"version": 5, "id": "new", "uri": str(v5)}
        assert agent.converge(newer) and fake.label == "5"  # a newer version is tried at once
    finally:
        supervisor.stop()
        fake.stop()


def test_an_export_whose_probe_fails_even_after_a_fresh_start_is_not_served(tmp_path):
    """Wrong twice: the export itself disagrees with the trainer's probe. Back to the last
    good version; the error names both checks."""
    fake = FakeVLLM().start()
    v3, v4 = export_dir(tmp_path, 3), export_dir(tmp_path, 4, offset=2.0)
    target = {"version": 3, "id": "abc", "uri": str(v3)}
    agent, api, supervisor = supervised_agent(fake, tmp_path, target)
    try:
        agent.converge(target)
        bad = {"version": 4, "id": "x", "uri": str(v4)}
        with pytest.raises(SyncError, match="after a fresh start from disk.*the reload's result was"):
            agent.converge(bad)
        assert supervisor.restarts == 2 and fake.label == "3" and agent.engine_version == 3
        assert (tmp_path / "dest" / INITIAL_LINK).resolve() == v3.resolve()
    finally:
        supervisor.stop()
        fake.stop()


def test_wrong_twice_before_any_good_version_goes_back_to_the_start_up_weights(tmp_path):
    """No version has passed in this agent's life: the fall-back restarts the engine on
    what it started with (not on the failing export), unlabelled, and the entry says so."""
    fake = FakeVLLM().start()
    v4 = export_dir(tmp_path, 4, offset=2.0)
    bad = {"version": 4, "id": "x", "uri": str(v4)}
    agent, api, supervisor = supervised_agent(fake, tmp_path, bad)
    try:
        with pytest.raises(SyncError, match="after a fresh start from disk"):
            agent.converge(bad)
        assert supervisor.restarts == 2 and fake.path == str(tmp_path.resolve())
        assert (tmp_path / "dest" / INITIAL_LINK).resolve() == tmp_path.resolve()
        assert agent.engine_version is None and fake.label == "default"  # no version of ours
    finally:
        supervisor.stop()
        fake.stop()


def test_weights_an_engine_refused_for_its_probe_are_not_loaded_again_at_once(tmp_path, weights):
    """The reference server refuses weights that fail the probe and keeps serving the old
    ones (no restart cures that): the export waits broken_retry_seconds, a newer one not."""
    from rft_contract.probe import Verdict

    class Refusing(MemoryEngine):
        restartable = False

        def load(self, path, version, probe=None, tolerance=None, previous=None):
            self.loads.append((path, version))
            if version == 3:
                raise ProbeMismatch("version 3 refused", Verdict(False, 1.0, 1.0, 4, 0.002))
            self.version = version

    engine = Refusing()
    bad = {"version": 3, "id": "abc", "uri": str(weights)}
    agent, _ = make_agent(engine, tmp_path, bad)
    with pytest.raises(ProbeMismatch):
        agent.converge(bad)
    with pytest.raises(SyncError, match="version 3 broke the engine or failed its probe; retrying it in"):
        agent.converge(bad)
    assert len(engine.loads) == 1  # not loaded a second time
    newer = {"version": 4, "id": "def", "uri": str(weights)}
    assert agent.converge(newer) and engine.version == 4


def test_any_failure_of_a_pass_is_reported_and_the_agent_keeps_going(tmp_path, weights):
    """Not only SyncErrors: an answer the adapter did not expect is reported in the entry
    (type and text) and retried; the agent does not die with its status frozen."""

    class Odd(MemoryEngine):
        calls = 0

        def served(self):
            Odd.calls += 1
            raise KeyError("token_logprobs")

    target = {"version": 3, "id": "abc", "uri": str(weights)}
    agent, api = make_agent(Odd(), tmp_path, target)
    agent.resync_seconds = agent.max_backoff = 0.05
    thread = threading.Thread(target=agent.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: Odd.calls >= 3, 10, "retries")
        entry = api.status["weightSync"]["replicas"]["job-inference-0"]
        assert entry["error"] == "KeyError: 'token_logprobs'" and entry["attempts"] >= 2
    finally:
        agent.stop()
        thread.join(10)
    assert not thread.is_alive()


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_the_pod_starts_the_engine_from_the_agents_link(engine):
    from rft_contract.spec import parse_spec
    from rft_operator.builders import JobRef, build_inference_pod
    from tests.unit.conftest import SPEC

    spec = parse_spec({**SPEC, "inference": {"replicas": 1, "engine": engine, "image": "e:1"}})
    pod = build_inference_pod(JobRef("demo", "ns", "uid"), spec, 0)
    engine_c, agent = pod["spec"]["containers"]
    args = pod["spec"]["initContainers"][0]["args"]
    dest = agent["args"][agent["args"].index("--dest") + 1]
    assert args[args.index("--fetch-only") + 1] == f"{dest}/{INITIAL_LINK}" in engine_c["args"]


# ------------------------------------------------------------------ versions of rollouts


def test_reference_server_accepts_the_opt_in():
    parse_sampling({"prompt": "1", "return_weight_versions": True}, COMPLETION_FIELDS)


@pytest.mark.parametrize("vllm", [{"honours_opt_in": True}], indirect=True)  # a vLLM that reports spans
def test_vllm_versions_per_choice_and_straddles_dropped(vllm, weights):
    VLLMEngine(vllm.url).load(str(weights), 3, None)
    client = InferenceClient([vllm.url])
    response, versions = client.complete(BODY)
    assert vllm.calls[-1][3]["return_weight_versions"] is True  # the opt-in
    assert versions == [3, 3]
    vllm.label_spans = [[{"version": "3", "start": 0, "end": 2}],
                        [{"version": "3", "start": 0, "end": 1}, {"version": "4", "start": 1, "end": 2}]]
    response, versions = client.complete(BODY)
    assert versions == [3, STRADDLED] and client.dropped == {STRADDLED: 1}
    samples = build_samples(response, {"prompt": "2+3=", "answer": "5"}, Tok(), lambda *a: 0.0, 0,
                            None, versions)
    # The engine's ids, not the explorer-side tokenizer's ([1, 2] for "12").
    assert [(s.response_ids, s.weights_version) for s in samples] == [(engine_ids("12"), 3)]
    vllm.label_spans = None
    vllm.restart()  # restarted, not reloaded yet: "default" says nothing of ours
    assert client.complete(BODY).versions == [UNVERSIONED, UNVERSIONED]


def test_sglang_versions_from_the_first_choices_metadata(sglang, weights):
    SGLangEngine(sglang.url).load(str(weights), 3, None)
    client = InferenceClient([sglang.url])
    assert client.complete(BODY).versions == [3, 3]
    assert client.complete({**BODY, "n": 1}).versions == [3]
    sglang.label_spans = [{"version": "3", "start": 0, "end": 1}, {"version": "4", "start": 1, "end": 2}]
    assert client.complete(BODY).versions == [STRADDLED, STRADDLED]  # the others are unknown
    assert client.complete({**BODY, "n": 1}).versions == [STRADDLED]
    sglang.label_spans = None
    sglang.restart()
    assert client.complete(BODY).versions == [UNVERSIONED, UNVERSIONED]
    assert client.dropped == {STRADDLED: 3, UNVERSIONED: 2}


def test_choice_versions_of_each_engines_shape():
    two = [{"index": 1, "text": "b"}, {"index": 0, "text": "a"}]
    assert choice_versions({"weights_version": 7, "choices": two}) == [7, 7]  # reference body
    assert choice_versions({"choices": two}, header_version=6) == [6, 6]  # reference header
    vllm = {"choices": [{"index": 1, "weight_versions": [{"version": "5", "start": 0, "end": 1},
                                                          {"version": "5", "start": 1, "end": 3}]},
                        {"index": 0, "weight_versions": [{"version": "4", "start": 0, "end": 1},
                                                          {"version": "5", "start": 1, "end": 3}]}]}
    assert choice_versions(vllm) == [STRADDLED, 5]  # in index order
    nulls = {"choices": [{"index": 0, "weight_versions": None}]}  # vLLM without the opt-in
    assert choice_versions(nulls) is None
    assert choice_versions(nulls, record=(4, 4)) == [4]
    assert choice_versions(nulls, record=(4, 5)) == [STRADDLED]
    assert choice_versions(nulls, record=(None, 5)) == [UNVERSIONED]
    sgl = {"choices": two, "metadata": {"weight_version": "8", "weight_versions": [
        {"version": "8", "start": 0, "end": 2}]}}
    assert choice_versions(sgl, record=(2, 3)) == [8, 8]  # the engine's word wins
    # Only a label (no spans: the version when it finished, not when it started): not enough.
    assert choice_versions({"choices": two, "metadata": {"weight_version": "8"}}) is None
    with pytest.raises(ValueError, match="no weights version"):
        build_samples(nulls, {"prompt": "1", "answer": "1"}, Tok(), lambda *a: 0.0, 0)


class Tok:
    """Characters as ids: enough for build_samples."""
    eos_token_id = 99

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": [int(c) if c.isdigit() else 0 for c in text]}


def test_fallback_to_the_agents_record_drops_requests_that_straddle_a_reload(weights):
    """An engine that reports nothing (a vLLM that ignores the opt-in): each request is
    attributed to the sync agent's record of its replica, read before and after it."""
    fake = FakeVLLM(honours_opt_in=False).start()
    try:
        VLLMEngine(fake.url).load(str(weights), 3, None)
        record = {"value": 3, "reads": 0, "bump_after": None}

        def version_of(i: int) -> int | None:
            assert i == 0
            record["reads"] += 1
            if record["bump_after"] is not None and record["reads"] > record["bump_after"]:
                record["value"] = 4  # the agent recorded a reload while the request ran
            return record["value"]

        client = InferenceClient([fake.url], version_of=version_of)
        assert client.complete(BODY).versions == [3, 3] and record["reads"] == 2
        record["bump_after"] = record["reads"] + 1  # changes between this request's reads
        response, versions = client.complete(BODY)
        assert versions == [STRADDLED, STRADDLED] and client.dropped == {STRADDLED: 2}
        assert build_samples(response, {"prompt": "1", "answer": "1"}, Tok(), lambda *a: 0.0, 0,
                             None, versions) == []
        record["bump_after"] = None
        assert client.complete(BODY).versions == [4, 4]
        record["value"] = None  # no entry (or the API failed): unknown
        assert client.complete(BODY).versions == [UNVERSIONED, UNVERSIONED]
    finally:
        fake.stop()


@pytest.mark.parametrize("vllm", [{"honours_opt_in": True}], indirect=True)  # a vLLM that reports spans
def test_no_record_reads_once_the_engine_reports_versions(vllm, weights):
    VLLMEngine(vllm.url).load(str(weights), 3, None)
    reads = []
    client = InferenceClient([vllm.url], version_of=lambda i: reads.append(i) or 3)
    assert client.complete(BODY).versions == [3, 3]
    assert client.complete(BODY).versions == [3, 3] and len(reads) == 1  # the first request only


def test_the_explorer_reads_each_replicas_record_from_the_job_status():
    class Api:
        def get_namespaced_custom_object(self, group, version, ns, plural, name, **kwargs):
            return {"status": {"weightSync": {"replicas": {"demo-inference-1": {"version": 5},
                                                           "demo-inference-0": {"version": 4},
                                                           "demo-inference-2": {"version": None}}}}}

    endpoints = ["http://demo-inference-0.demo-inference.ns.svc:8000",
                 "http://demo-inference-1.demo-inference.ns.svc:8000/", "http://10.0.0.7:8000",
                 "http://demo-inference-2.demo-inference.ns.svc:8000"]
    assert [replica_pod(e, "demo") for e in endpoints] == [
        "demo-inference-0", "demo-inference-1", None, "demo-inference-2"]
    assert replica_pod("http://demo2-inference-0.x:1", "demo") is None
    version_of = replica_versions(KubeProgress(Api(), "demo", "ns", 10), endpoints)
    assert [version_of(i) for i in range(4)] == [4, 5, None, None]  # no version: unknown
    assert replica_versions(lambda: (0, 10), endpoints) is None  # no job status to read


def test_the_explorer_reads_each_replicas_record_from_its_agent_on_the_agents_port():
    from rft_contract.names import agent_port

    endpoints = ["http://demo-inference-0.demo-inference.ns.svc:8000", "http://elsewhere:8000",
                 "http://demo-inference-1.demo-inference.ns.svc:8471"]
    records = replica_versions(None, endpoints, agent_port(8000), job="demo")  # no API credentials needed
    assert records.urls == ["http://demo-inference-0.demo-inference.ns.svc:8471/record", None,
                            "http://demo-inference-1.demo-inference.ns.svc:8471/record"]
    assert records(1) is None and records.reads == 0  # not one of the job's pods: nothing says
    assert agent_port(8471) == 8472  # the engine took the agent's usual port (rollout_pods does the same)
    assert replica_versions(None, ["http://elsewhere:8000"], 8471, job="demo") is None


@pytest.mark.parametrize("vllm", [{"honours_opt_in": True}], indirect=True)  # a vLLM that reports spans
def test_the_explorer_drops_straddling_choices_and_logs_them(vllm, weights, tmp_path, caplog):
    from tests.trainer.test_explorer import job_config

    save_tiny_tokenizer(tmp_path / "tok")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    VLLMEngine(vllm.url).load(str(weights), 3, None)
    vllm.label_spans = [[{"version": "3", "start": 0, "end": 2}],
                        [{"version": "3", "start": 0, "end": 1}, {"version": "4", "start": 1, "end": 2}]] * 2
    config = load_explorer_config(job_config(tmp_path, str(tmp_path / "buffer"), "unused.jsonl",
                                             max_n=2))
    explorer = Explorer(config, [vllm.url], tokenizer=tokenizer, tasks=arithmetic(4, seed=1))
    with caplog.at_level(logging.INFO, logger="rft_rollout.explorer"):
        assert explorer.run(max_shards=1) == 1
    shard = [json.loads(r.getMessage()) for r in caplog.records if '"event": "shard"' in r.getMessage()]
    # 2 tasks x 4 rollouts, as 2 requests of n=2 each: one choice of every request straddled.
    assert shard[0]["samples"] == 4 and shard[0]["dropped_straddling"] == 4
    assert shard[0]["version_min"] == shard[0]["version_max"] == 3


# ------------------------------------------------------------------ token ids of rollouts


@pytest.mark.parametrize("vllm", [{"honours_opt_in": True}], indirect=True)  # a vLLM that reports spans
def test_samples_hold_vllms_token_ids_and_the_stop_token_it_sampled(vllm, weights):
    VLLMEngine(vllm.url).load(str(weights), 3, None)
    client = InferenceClient([vllm.url])
    task = {"prompt": "2+3=", "answer": "5"}
    response, versions = client.complete(BODY)
    assert vllm.calls[-1][3]["return_token_ids"] is True
    first = min(response["choices"], key=lambda c: c["index"])
    assert first["prompt_token_ids"] == [ENGINE_BOS] + engine_ids("2+3=")  # vLLM's shape: per choice
    samples = build_samples(response, task, Tok(), lambda *a: 0.0, 0, None, versions)
    assert [s.prompt_ids for s in samples] == [[ENGINE_BOS] + engine_ids("2+3=")] * 2
    assert [s.response_ids for s in samples] == [engine_ids("12"), engine_ids("3")]
    assert [s.response_logprobs for s in samples] == [[-0.5] * 2, [-0.5]]
    # Stopped by the EOS, or by another stop token (generation_config's eos list): vLLM's
    # token_ids end with it, and nothing is appended (Tok's EOS is 99).
    for stop, reason in [(99, None), (77, 77)]:
        vllm.stop_with = (stop, reason)
        response, versions = client.complete(BODY)
        samples = build_samples(response, task, Tok(), lambda *a: 0.0, 0, None, versions)
        assert [s.response_ids for s in samples] == [engine_ids("12") + [stop], engine_ids("3") + [stop]]
        assert [len(s.response_logprobs) for s in samples] == [3, 2]


@pytest.mark.parametrize("prompt_format", ["chat", "raw"])
@pytest.mark.parametrize("vllm", [{"honours_opt_in": True}], indirect=True)  # a vLLM that reports spans
def test_the_explorer_trains_on_the_ids_vllm_ran(vllm, weights, tmp_path, prompt_format):
    """Chat prompts go out with add_special_tokens false: the template's BOS is the only one;
    the samples hold vLLM's own ids (ENGINE_BOS, 1000 + ord), not a re-tokenization."""
    from tests.trainer.test_explorer import job_config
    from transformers import AutoTokenizer

    save_tiny_tokenizer(tmp_path / "tok")
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    tokenizer.chat_template = ("{{ bos_token }}{% for m in messages %}?{{ m['content'] }}{% endfor %}"
                               "{% if add_generation_prompt %}={% endif %}")
    VLLMEngine(vllm.url).load(str(weights), 3, None)
    config = load_explorer_config(job_config(tmp_path, str(tmp_path / "buffer"), "unused.jsonl",
                                             prompt_format=prompt_format))
    explorer = Explorer(config, [vllm.url], tokenizer=tokenizer,
                        tasks=[{"id": "t0", "prompt": "3+4", "answer": "7"}])
    samples = explorer._rollouts([(0, 0)])
    body = vllm.calls[-1][3]
    assert body["return_token_ids"] is True and body["return_weight_versions"] is True
    if prompt_format == "chat":
        assert body["prompt"] == "<bos>?3+4=" and body["add_special_tokens"] is False
        want = [ENGINE_BOS] + engine_ids("?3+4=")
    else:
        assert body["prompt"] == "3+4" and "add_special_tokens" not in body  # vLLM's default: true
        want = [ENGINE_BOS] + engine_ids("3+4")
    assert len(samples) == 4
    assert all(s.prompt_ids == want and s.prompt_ids.count(ENGINE_BOS) == 1 for s in samples)
    assert sorted(s.response_ids for s in samples) == sorted([engine_ids("12"), engine_ids("3")] * 2)


def test_a_load_the_engine_refused_and_rolled_back_is_not_restarted_and_the_entry_says_so(tmp_path, weights):
    """An engine that refuses weights before serving them and goes back in place to the
    last good version (vLLM's fingerprint check, `previous`): the agent passes it the last
    good version, does not restart the engine, reports the refusal with the version it
    serves, and holds the export off; a newer one loads at once."""
    from rft_serving.engines import Previous

    class RollingBack(MemoryEngine):
        def load(self, path, version, probe=None, tolerance=None, previous=None):
            self.loads.append((path, version, previous))
            if version == 3:
                self.version = previous.version
                raise ProbeMismatch("version 3: lm_head.weight differs; serving version 2 again",
                                    serving=previous.version)
            self.version = version

        def restart(self, *a, **kw):
            raise AssertionError("no restart after a roll-back")

    engine = RollingBack()
    good = {"version": 2, "id": "aaa", "uri": str(weights)}
    agent, api = make_agent(engine, tmp_path, good)
    assert agent.converge(good) and engine.loads[0][2] is None  # nothing to go back to yet
    bad = {"version": 3, "id": "bbb", "uri": str(weights)}
    with pytest.raises(ProbeMismatch):
        agent.converge(bad)
    assert engine.loads[-1][2] == Previous(engine.loads[0][0], 2, None)
    assert agent.engine_version == 2 and agent.served == good
    agent.report_error("version 3: lm_head.weight differs; serving version 2 again")
    entry = api.patches[-1]
    assert entry["version"] == 2 and "lm_head.weight" in entry["error"]
    with pytest.raises(SyncError, match="retrying it in"):
        agent.converge(bad)
    assert agent.converge({"version": 4, "id": "ccc", "uri": str(weights)}) and engine.version == 4


def test_a_replica_whose_policy_adapter_is_not_loaded_yet_rests_instead_of_failing_the_explorer():
    """vLLM serving a LoRA job's policy as the adapter "policy" answers 404 "The model
    `policy` does not exist." until the agent loaded it (a fresh or restarted engine): the
    client rests that endpoint and tries again, as for a 503; another 404 still fails."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    calls = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            calls.append(self.path)
            if self.path != "/v1/completions":
                body, code = b'{"detail": "Not Found"}', 404
            elif len(calls) <= 2:
                body, code = b'{"error": {"message": "The model `policy` does not exist.", "code": 404}}', 404
            else:
                body, code = b'{"choices": []}', 200
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        client = InferenceClient([url], base_backoff=0.01, max_backoff=0.02)
        assert client.complete(BODY).response == {"choices": []} and client.failures == 2
        other = InferenceClient([url + "/other"], base_backoff=0.01)
        with pytest.raises(ClientError, match="HTTP 404"):
            other.complete(BODY)
    finally:
        server.shutdown()
