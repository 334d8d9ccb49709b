"""The reference inference server: OpenAI-compatible completions on transformers, with hot
weight reload. Inference pods run `python -m rft_serving.serve`; the sync agent beside it
downloads each exported version and POSTs `/weights/load`.

Atomicity is the point: the served (model, tokenizer, version) is one immutable `Weights`
object behind one attribute. A request reads that attribute once, at its start, and uses
only that snapshot, so a request in flight during a reload finishes on the old weights and
reports the old version; the old model is freed by refcounting once no request holds it.
Loads build a new model off the event loop and are serialized by a lock.

LoRA adapters (a version that is PEFT's saved adapter: `adapter_config.json`, as a LoRA
job's trainer exports them) load onto the base model the server serves, with PEFT: the
first adapter's layers are injected into the base's model in place, later adapters are
added beside it, and each snapshot names its adapter. A model that holds adapters serves
one per forward (the selection is the model's state), so its forwards take it alone
(`Gate`), each selecting its snapshot's adapter first: requests on the old and the new
version interleave forward by forward, never mixing. Injecting, adding and deleting take
it alone too. An adapter no snapshot holds any more is deleted at the next load. One copy
of the base, whatever the number of versions.

Sampling is our own loop (not `model.generate`) for two reasons the RL trainer depends on:
a per-request `torch.Generator` makes `seed` reproducible even with concurrent requests,
and the returned logprobs are log_softmax of the raw logits (before temperature/top-p).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import inspect
import itertools
import json
import logging
import math
import os
import secrets
import signal
import threading
import time
import uuid
import weakref
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Iterator

import torch
from aiohttp import web

from rft_contract.fingerprint import FingerprintVerdict, model_stats, read_fingerprint
from rft_contract.fingerprint import compare as compare_fingerprint
from rft_contract.layout import ADAPTER_KEY_PREFIX, is_adapter_dir
from rft_contract.podenv import PodEnv
from rft_contract.probe import FORMAT as PROBE_FORMAT
from rft_contract.probe import Probe, Verdict, compare, parse_probe

log = logging.getLogger(__name__)

MAX_N = 64
# Fields OpenAI clients commonly send that change nothing here; any other unknown field is
# a 400, so a typo such as "max_token" is not silently ignored.
# Explorers send vLLM's opt-ins; this server always returns versions and token ids.
IGNORED_FIELDS = {"user", "stream", "return_weight_versions", "return_token_ids"}
# add_special_tokens (vLLM's field): whether tokenizing the prompt adds the tokenizer's
# special tokens (a BOS); default true for /v1/completions, and for /v1/chat/completions
# false when the chat template rendered the prompt (it wrote them), as vLLM does.
COMPLETION_FIELDS = {"prompt", "max_tokens", "temperature", "top_p", "n", "seed", "stop",
                     "logprobs", "model", "add_special_tokens"} | IGNORED_FIELDS
CHAT_FIELDS = (COMPLETION_FIELDS - {"prompt", "logprobs"}) | {"messages"}


class RequestError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.type = status, message, param, type_

    def response(self) -> web.Response:
        err = {"message": self.message, "type": self.type, "param": self.param}
        return web.json_response({"error": err}, status=self.status)


class Gate:
    """Who may run a model now. Forwards of a model without LoRA adapters share it; a
    model with adapters serves one adapter per forward (the selection is the model's own
    state), so each of its forwards has it alone, as has every change of its adapters
    (injecting, adding, deleting). Writers first: a waiting one holds off new readers."""

    def __init__(self):
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False
        self._waiting = 0

    @contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            while self._writer or self._waiting:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if not self._readers:
                    self._cond.notify_all()

    @contextmanager
    def alone(self) -> Iterator[None]:
        with self._cond:
            self._waiting += 1
            while self._writer or self._readers:
                self._cond.wait()
            self._waiting -= 1
            self._writer = True
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()


LORA_LAYERS = "_rft_lora_layers"  # a model's attribute: its PEFT LoRA layers, once adapters are in it
SELECTED = "_rft_selected"  # a model's attribute: the adapter its LoRA layers serve now (None: none)


@dataclass(frozen=True)
class Weights:
    model: torch.nn.Module  # a transformers model; LoRA adapters are injected into it in place (PEFT)
    tokenizer: object
    version: int
    path: str
    loaded_at: str
    load_seconds: float
    adapter: str | None = None  # the LoRA adapter this snapshot serves; None: the model without one
    gate: Gate = field(default_factory=Gate, compare=False, repr=False)  # the model's (shared by its snapshots)

    def __call__(self, **kwargs):
        """The model's forward as this snapshot serves it: alone, with its adapter selected,
        once the model holds adapters; else beside the other requests' forwards."""
        with self.gate.shared():
            if getattr(self.model, LORA_LAYERS, None) is None:
                return self.model(**kwargs)
        with self.gate.alone():
            _select(self.model, self.adapter)
            return self.model(**kwargs)

    def parameters_served(self):
        """(name, tensor) of the weights this snapshot serves, named as its export names
        them: the adapter's as PEFT saves them (`base_model.model....lora_A.weight`), else
        the model's own (without the adapters PEFT put into it)."""
        if self.adapter is None:
            return ((n.replace(".base_layer.", "."), t) for n, t in self.model.named_parameters()
                    if ".lora_" not in n)
        a, b = f".lora_A.{self.adapter}.", f".lora_B.{self.adapter}."
        return (((ADAPTER_KEY_PREFIX + n).replace(a, ".lora_A.").replace(b, ".lora_B."), t)
                for n, t in self.model.named_parameters() if a in n or b in n)


def _select(model: torch.nn.Module, adapter: str | None) -> None:
    """Make the model's LoRA layers serve `adapter` (None: none), under its gate, alone.
    Only the flags PEFT's forward reads are set (`set_adapter` with inference_mode leaves
    requires_grad alone; `_disable_adapters` as the trainer's `lora.adapters_off` sets it)."""
    if getattr(model, SELECTED, ()) == adapter:
        return
    for layer in getattr(model, LORA_LAYERS):
        if adapter is not None:
            layer.set_adapter(adapter, inference_mode=True)
        layer._disable_adapters = adapter is None
    setattr(model, SELECTED, adapter)


@dataclass(frozen=True)
class Sampling:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    add_special_tokens: bool | None = None  # None: the endpoint's default


def _is_int(v, kinds=(int,)) -> bool:
    return isinstance(v, kinds) and not isinstance(v, bool)  # JSON true is not 1


def _is_num(v) -> bool:
    return _is_int(v, (int, float))


def parse_sampling(body: dict, allowed: set[str]) -> Sampling:
    """OpenAI sampling fields -> `Sampling`; RequestError(400) names the bad field."""
    for key in body:
        if key not in allowed:
            raise RequestError(400, f"unsupported field {key!r}", key)
    if body.get("stream"):
        raise RequestError(400, "streaming is not supported", "stream")

    def get(key, default, ok, why):
        v = body.get(key)
        if v is None:
            return default
        if not ok(v):
            raise RequestError(400, f"{key} must be {why}", key)
        return v
    stop = get("stop", (), lambda v: isinstance(v, str) and v or isinstance(v, list) and all(
        isinstance(s, str) and s for s in v), "a non-empty string or a list of them")
    return Sampling(
        max_tokens=get("max_tokens", 16, lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
        temperature=float(get("temperature", 1.0, lambda v: _is_num(v) and v >= 0, "a number >= 0")),
        top_p=float(get("top_p", 1.0, lambda v: _is_num(v) and 0 < v <= 1, "a number in (0, 1]")),
        n=get("n", 1, lambda v: _is_int(v) and 1 <= v <= MAX_N, f"an integer in [1, {MAX_N}]"),
        seed=get("seed", None, _is_int, "an integer"),
        stop=(stop,) if isinstance(stop, str) else tuple(stop),
        logprobs=get("logprobs", None, lambda v: _is_int(v) and v >= 0, "an integer >= 0") is not None,
        add_special_tokens=get("add_special_tokens", None, lambda v: isinstance(v, bool), "true or false"),
    )


def choose_tokens(logits: torch.Tensor, s: Sampling, gen: torch.Generator) -> torch.Tensor:
    """(R, V) raw logits -> (R,) next tokens: greedy at temperature 0, else nucleus sampling."""
    if s.temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits / s.temperature, -1)
    if s.top_p < 1:
        sorted_p, idx = probs.sort(-1, descending=True)
        # Drop a token once the mass before it already reaches top_p; the top one always stays.
        sorted_p[(sorted_p.cumsum(-1) - sorted_p) >= s.top_p] = 0
        probs = torch.zeros_like(probs).scatter(-1, idx, sorted_p)
    return torch.multinomial(probs, 1, generator=gen)[:, 0]


@torch.inference_mode()
def sample_prompt(w: Weights, prompt_ids: list[int], s: Sampling, gen: torch.Generator) -> list[dict]:
    """n samples of one prompt, batched as n identical rows sharing one KV cache."""
    model, tok = w.model, w.tokenizer
    config_eos = model.generation_config.eos_token_id  # None, an id, or a list of ids
    eos = {tok.eos_token_id, *(config_eos if isinstance(config_eos, list) else [config_eos])} - {None}
    # transformers 5 renamed `past_key_values` to `cache`; the old name still works but warns.
    cache = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    ids = torch.tensor([prompt_ids] * s.n, device=model.device)
    out = w(input_ids=ids, use_cache=True)
    rows = [{"token_ids": [], "logprobs": [], "finish_reason": None, "stop_token": None} for _ in range(s.n)]
    for _ in range(s.max_tokens):
        logits = out.logits[:, -1, :].float()
        nxt = choose_tokens(logits, s, gen)
        chosen_lp = torch.log_softmax(logits, -1).gather(1, nxt[:, None])[:, 0].tolist()
        for row, t, lp in zip(rows, nxt.tolist(), chosen_lp):
            if row["finish_reason"]:
                continue
            if t in eos:  # eos ends the sample and is not part of it...
                row["finish_reason"] = "stop"
                # ...but the policy chose it: RL trainers score that choice too.
                row["stop_token"] = {"id": t, "logprob": lp}
                continue
            row["token_ids"].append(t)
            row["logprobs"].append(lp)
            if s.stop and any(x in tok.decode(row["token_ids"], skip_special_tokens=True) for x in s.stop):
                row["finish_reason"] = "stop"
        if all(r["finish_reason"] for r in rows):
            break
        out = w(input_ids=nxt[:, None], use_cache=True, **{cache: out[cache]})
    for row in rows:
        text = tok.decode(row["token_ids"], skip_special_tokens=True)
        cuts = [text.find(x) for x in s.stop if x in text]
        # token_ids keep the token that completed a stop string; the text ends before it.
        row["text"] = text[:min(cuts)] if cuts else text
        row["finish_reason"] = row["finish_reason"] or "length"
        row["tokens"] = tok.convert_ids_to_tokens(row["token_ids"])
    return rows


def generate(w: Weights, prompts: list[str], s: Sampling) -> tuple[list[list[int]], list[dict]]:
    """Runs in a worker thread. Returns per-prompt ids and the choices, prompt-major."""
    gen = torch.Generator(device=w.model.device)
    gen.manual_seed(s.seed % 2**63 if s.seed is not None else secrets.randbits(63))
    limit = getattr(w.model.config, "max_position_embeddings", None)
    prompt_ids, choices = [], []
    for p in prompts:
        ids = w.tokenizer(p, add_special_tokens=s.add_special_tokens is not False)["input_ids"]
        if not ids:
            raise RequestError(400, "prompt is empty after tokenization", "prompt")
        if limit and len(ids) + s.max_tokens > limit:
            raise RequestError(400, f"prompt ({len(ids)} tokens) + max_tokens exceeds the "
                               f"model's context of {limit}", "max_tokens")
        prompt_ids.append(ids)
        choices += sample_prompt(w, ids, s, gen)
    return prompt_ids, choices


@torch.inference_mode()
def score_tokens(w: Weights, token_ids: list[int]) -> list[float]:
    """log p(token_ids[i+1] | token_ids[:i+1]) for every i (the weight-sync probe)."""
    ids = torch.tensor([token_ids], device=w.model.device)
    logits = w(input_ids=ids, use_cache=False).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0].tolist()


def parse_probe_request(body: dict) -> tuple[Probe | None, float | None]:
    """The optional `probe` and `tolerance` of a load request; RequestError(400) names the field."""
    if body.get("probe") is None:
        return None, None
    try:
        probe = parse_probe({"format": PROBE_FORMAT, **body["probe"]}) if isinstance(body["probe"], dict) \
            else parse_probe(None)
    except ValueError as e:
        raise RequestError(400, f"probe: {e}", "probe") from None
    tolerance = body.get("tolerance")
    if tolerance is not None and not (_is_num(tolerance) and tolerance >= 0):
        raise RequestError(400, "tolerance must be a number >= 0", "tolerance")
    return probe, tolerance


def load_weights(path: str, version: int, device: str) -> Weights:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.monotonic()
    # CPU runs fp32 (bf16 matmuls there are slow and lossy); accelerators keep the config dtype.
    dtype = torch.float32 if device == "cpu" else "auto"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    return Weights(model, tokenizer, version, path, datetime.now(timezone.utc).isoformat(),
                   time.monotonic() - t0)


class ReferenceServer:
    def __init__(self, host: str = "127.0.0.1", port: int = 0, served_model_name: str = "policy",
                 device: str = "cpu", max_concurrency: int = 4):
        self.host, self.port, self.name, self.device = host, port, served_model_name, device
        self.max_concurrency = max_concurrency
        self.current: Weights | None = None  # the snapshot requests read, swapped whole
        self.loading = False
        self.fingerprint: FingerprintVerdict | None = None  # the current weights' check
        # What adapters load onto: the last full model loaded (served as version `base.version`).
        self.base: Weights | None = None
        self._peft = None  # the PeftModel around a copy of the base, once an adapter loaded
        self._adapter_names = itertools.count(1)
        self._retired: list[str] = []  # adapters no snapshot holds (weakref.finalize appends)
        self._load_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_concurrency, thread_name_prefix="rft-generate")
        # Set by start(): the semaphore must be created on the server's own loop.
        self._sem = self._loop = self._runner = self._thread = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # -- weights -------------------------------------------------------------------------
    def load(self, path: str, version: int, probe: Probe | None = None,
             tolerance: float | None = None, base: str | None = None) -> tuple[float, Verdict | None]:
        """Validate, load into a new model (or an adapter beside the others), check the
        fingerprint and probe on it, swap. Same path as POST /weights/load. A mismatch is a
        409 and the old weights keep serving. `base` (an adapter's): the base model's
        directory, loaded first (as version 0) unless it is the base served already."""
        if not isinstance(path, str) or not path:
            raise RequestError(400, "path is required (a local HF model directory)", "path")
        if not os.path.isdir(path):
            raise RequestError(400, f"path {path!r} is not a directory", "path")
        if not _is_int(version) or version < 0:
            raise RequestError(400, "version must be an integer >= 0", "version")
        if base is not None and not (isinstance(base, str) and os.path.isdir(base)):
            raise RequestError(400, f"base {base!r} is not a directory", "base")
        path, base = os.path.abspath(path), base and os.path.abspath(base)
        adapter = is_adapter_dir(path)
        with self._load_lock:
            cur = self.current
            if cur is not None and (cur.version, cur.path) == (version, path):
                return 0.0, _check(cur, probe, tolerance, version)
            self.loading = True
            try:
                if adapter and base is not None and (self.base is None or self.base.path != base):
                    self._set_base(load_weights(base, 0, self.device))
                new = self._load_adapter(path, version) if adapter else load_weights(path, version, self.device)
            except RequestError:
                raise
            except Exception as e:
                log.error(json.dumps({"event": "load_failed", "version": version, "path": path,
                                      "error": f"{type(e).__name__}: {e}"[:500]}))
                raise RequestError(500, f"loading version {version} failed: {type(e).__name__}: "
                                   f"{e}"[:1000], "path", "load_error") from e
            finally:
                self.loading = False
            checked = _check_fingerprint(new, path, version)  # exact, before anyone can read it
            verdict = _check(new, probe, tolerance, version)
            self.current, self.fingerprint = new, checked
            if not adapter:
                self._set_base(new)
        log.info(json.dumps({"event": "weights_loaded", "version": version, "path": path, "adapter": new.adapter,
                             "load_seconds": round(new.load_seconds, 3),
                             "probe": verdict.record() if verdict else None}))
        return new.load_seconds, verdict

    def _set_base(self, base: Weights) -> None:
        """Adapters load onto `base` from now on (into its model, at the next one)."""
        self.base, self._peft = base, None

    def _load_adapter(self, path: str, version: int) -> Weights:
        """The adapter at `path` in the base's model, beside the others (PEFT injects its
        layers into the model in place at the first one: one copy of the base), as a
        snapshot of its own; then the adapters no snapshot holds are deleted. Under the
        load lock; every change to the model with its gate held alone."""
        from peft import PeftModel
        from peft.tuners.lora import LoraLayer

        base = self.base
        if base is None:
            raise RequestError(409, "an adapter loads onto a base model, and none is loaded: load the base "
                               "first or name its directory in `base`", "base", "no_base")
        t0 = time.monotonic()
        name = f"v{version}-{next(self._adapter_names)}"
        with base.gate.alone():
            setattr(base.model, SELECTED, ())  # unknown after any change
            try:
                if self._peft is None:
                    self._peft = PeftModel.from_pretrained(base.model, path, adapter_name=name)
                else:
                    self._peft.load_adapter(path, adapter_name=name)
            except Exception:
                self._retired.append(name)  # whatever part of it loaded
                raise
            finally:
                if self._peft is not None:
                    self._peft.eval()
                while self._retired:
                    old = self._retired.pop()
                    if self._peft is not None and old in self._peft.peft_config and old != name:
                        self._peft.delete_adapter(old)
                layers = [m for m in base.model.modules() if isinstance(m, LoraLayer)]
                setattr(base.model, LORA_LAYERS, layers or None)
        new = Weights(base.model, base.tokenizer, version, path, datetime.now(timezone.utc).isoformat(),
                      time.monotonic() - t0, adapter=name, gate=base.gate)
        weakref.finalize(new, self._retired.append, name)  # once no request and no snapshot holds it
        return new

    # -- HTTP ----------------------------------------------------------------------------
    def build_app(self) -> web.Application:
        app = web.Application(middlewares=[_errors])
        app.router.add_get("/health", self.health)
        app.router.add_get("/weights", self.weights)
        app.router.add_post("/weights/load", self.load_endpoint)
        app.router.add_post("/weights/score", self.score_endpoint)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        return app

    async def health(self, request: web.Request) -> web.Response:
        w = self.current  # the readiness probe: ready once any weights are served
        return web.json_response({"status": "ok" if w else "loading", "version": w and w.version},
                                 status=200 if w else 503)

    async def weights(self, request: web.Request) -> web.Response:
        w = self.current
        return web.json_response({
            "version": w and w.version, "path": w and w.path, "loaded_at": w and w.loaded_at,
            "adapter": w is not None and w.adapter is not None, "base": self.base and self.base.path,
            "load_seconds": w and w.load_seconds, "loading": self.loading})

    async def load_endpoint(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        probe, tolerance = parse_probe_request(body)
        seconds, verdict = await asyncio.to_thread(self.load, body.get("path"), body.get("version"), probe, tolerance,
                                                   body.get("base"))
        fingerprint = self.fingerprint
        return web.json_response({"version": body["version"], "load_seconds": seconds,
                                  "probe": verdict.record() if verdict else None,
                                  "fingerprint": fingerprint.record() if fingerprint else None})

    async def score_endpoint(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        w = self.current
        if w is None:
            raise RequestError(503, "no weights loaded yet (POST /weights/load first)", None, "service_unavailable")
        ids = body.get("token_ids")
        vocab = w.model.config.get_text_config().vocab_size
        if not (isinstance(ids, list) and len(ids) >= 2 and all(_is_int(t) and 0 <= t < vocab for t in ids)):
            raise RequestError(400, f"token_ids must be a list of at least 2 token ids below {vocab}", "token_ids")
        logprobs = await asyncio.get_running_loop().run_in_executor(self._pool, score_tokens, w, ids)
        return web.json_response({"logprobs": logprobs, "version": w.version})

    async def models(self, request: web.Request) -> web.Response:
        w = self.current
        return web.json_response({"object": "list", "data": [{
            "id": self.name, "object": "model", "owned_by": "rft",
            "weights_version": w and w.version}]})

    async def _run(self, body: dict, allowed: set[str], build_prompts, special_tokens=None) -> tuple:
        """Snapshot the weights, validate, generate in a worker thread. `special_tokens(w)`:
        the default of add_special_tokens (else true)."""
        w = self.current  # the one snapshot this request uses, start to finish
        if w is None:
            raise RequestError(503, "no weights loaded yet (POST /weights/load first)", None,
                               "service_unavailable")
        if body.get("model") not in (None, self.name):
            raise RequestError(404, f"The model {body['model']!r} does not exist", "model",
                               "model_not_found")
        s = parse_sampling(body, allowed)
        prompts = build_prompts(w)
        if s.add_special_tokens is None:
            s = dataclasses.replace(s, add_special_tokens=special_tokens(w) if special_tokens else True)
        async with self._sem:
            prompt_ids, choices = await asyncio.get_running_loop().run_in_executor(
                self._pool, generate, w, prompts, s)
        return w, s, prompt_ids, choices

    def _respond(self, w: Weights, prefix: str, obj: str, choices: list[dict],
                 prompt_ids: list[list[int]]) -> web.Response:
        num_prompt = sum(map(len, prompt_ids))
        num_completion = sum(len(c["token_ids"]) for c in choices)
        out = {"id": f"{prefix}-{uuid.uuid4().hex}", "object": obj, "created": int(time.time()),
               "model": self.name, "weights_version": w.version, "choices": choices,
               "prompt_token_ids": prompt_ids,
               "usage": {"prompt_tokens": num_prompt, "completion_tokens": num_completion,
                         "total_tokens": num_prompt + num_completion}}
        return web.json_response(out, headers={"X-RFT-Weights-Version": str(w.version)})

    async def completions(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        w, s, prompt_ids, rows = await self._run(body, COMPLETION_FIELDS,
                                                 lambda w: _prompts(body.get("prompt")))
        choices = [{"index": i, "text": r["text"], "finish_reason": r["finish_reason"],
                    "token_ids": r["token_ids"],
                    # Non-standard: the eos token that ended the sample (not in token_ids).
                    "stop_token_id": (r["stop_token"] or {}).get("id"),
                    "stop_token_logprob": (r["stop_token"] or {}).get("logprob") if s.logprobs else None,
                    "logprobs": {"tokens": r["tokens"], "token_logprobs": r["logprobs"]}
                    if s.logprobs else None} for i, r in enumerate(rows)]
        return self._respond(w, "cmpl", "text_completion", choices, prompt_ids)

    async def chat(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        w, s, prompt_ids, rows = await self._run(
            body, CHAT_FIELDS, lambda w: [_chat_prompt(w.tokenizer, body.get("messages"))],
            lambda w: not getattr(w.tokenizer, "chat_template", None))  # the template wrote them
        choices = [{"index": i, "message": {"role": "assistant", "content": r["text"]},
                    "finish_reason": r["finish_reason"], "token_ids": r["token_ids"]}
                   for i, r in enumerate(rows)]
        return self._respond(w, "chatcmpl", "chat.completion", choices, prompt_ids)

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        """Serve from a background thread with its own loop; returns once the socket is bound."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rft-serve", daemon=True)
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self._bind(), self._loop).result(timeout=60)
        except BaseException:
            self.stop()
            raise
        log.info(json.dumps({"event": "listening", "url": self.url, "model": self.name,
                             "device": self.device, "max_concurrency": self.max_concurrency}))

    async def _bind(self) -> None:
        self._sem = asyncio.Semaphore(self.max_concurrency)
        self._runner = web.AppRunner(self.build_app(), shutdown_timeout=30, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()
        self.port = self._runner.addresses[0][1]  # the real one when asked for port 0

    def stop(self) -> None:
        """Stop accepting, let in-flight requests finish (up to 30 s), then stop the loop."""
        if self._loop is None:
            return
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=60)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=60)
        self._loop.close()
        self._pool.shutdown(wait=True)
        self._loop = self._runner = None


def _check(w: Weights, probe: Probe | None, tolerance: float | None, version: int) -> Verdict | None:
    if probe is None:
        return None
    verdict = compare(score_tokens(w, probe.token_ids), probe, tolerance)
    if not verdict.ok:
        log.error(json.dumps({"event": "probe_mismatch", "version": version, "probe": verdict.record()}))
        raise ProbeRefused(verdict)
    return verdict


def _check_fingerprint(w: Weights, path: str, version: int) -> FingerprintVerdict | None:
    """The loaded model's parameters against the export's `fingerprint.json` (exact: any
    tensor that is not the exported one is named); None for an export without one."""
    try:
        fingerprint = read_fingerprint(path)
    except (OSError, ValueError) as e:
        raise RequestError(400, f"version {version}: {e}", "path") from None
    if fingerprint is None:
        return None
    verdict = compare_fingerprint(model_stats(w.parameters_served()), fingerprint)
    if not verdict.ok:
        log.error(json.dumps({"event": "fingerprint_mismatch", "version": version, "fingerprint": verdict.record()}))
        raise FingerprintRefused(verdict)
    return verdict


class LoadRefused(RequestError):
    """409: loaded weights that fail a check; the old weights keep serving. The body is the
    usual error plus the verdict's record under `key` (clients tell the checks apart by it)."""

    key: str  # the body key of the verdict's record, e.g. "probe"
    what: str  # the message's prefix, before the verdict's description
    param: str
    type: str

    def __init__(self, verdict: Verdict | FingerprintVerdict):
        super().__init__(409, f"{self.what}: {verdict.describe()}", self.param, self.type)
        self.verdict = verdict

    def response(self) -> web.Response:
        err = {"message": self.message, "type": self.type, "param": self.param}
        return web.json_response({"error": err, self.key: self.verdict.record()}, status=self.status)


class FingerprintRefused(LoadRefused):
    """The loaded parameters are not the exported ones."""

    key, what = "fingerprint", "the loaded weights are not the export"
    param, type = "path", "fingerprint_mismatch"


class ProbeRefused(LoadRefused):
    """The loaded weights do not score the probe as the trainer did."""

    key, what = "probe", "the weights do not score the probe as the trainer did"
    param, type = "probe", "probe_mismatch"


@web.middleware
async def _errors(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except RequestError as e:
        return e.response()
    except web.HTTPException:
        raise
    except Exception as e:  # a bug, not the client's fault: say so in JSON, keep serving
        log.exception("request failed")
        return RequestError(500, f"{type(e).__name__}: {e}"[:1000], None, "server_error").response()


async def _json_body(request: web.Request) -> dict:
    try:
        body = await request.json()
    except ValueError:
        raise RequestError(400, "body is not valid JSON") from None
    if not isinstance(body, dict):
        raise RequestError(400, "body must be a JSON object")
    return body


def _prompts(prompt) -> list[str]:
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return prompt
    raise RequestError(400, "prompt is required: a string or a non-empty list of strings", "prompt")


def _chat_prompt(tokenizer, messages) -> str:
    if not (isinstance(messages, list) and messages and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages)):
        raise RequestError(400, "messages must be a non-empty list of {role, content} strings", "messages")
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return "\n".join(m["content"] for m in messages)


def _pod_ip() -> str | None:
    try:
        return PodEnv.read().pod_ip
    except ValueError as e:  # another knob is bad: the server needs only the IP
        log.warning("%s", e)
        return None


def cpu_limit(root: str = "/sys/fs/cgroup") -> float | None:
    """The container's CPU limit in cores (cgroup v2 `cpu.max`, or v1 `cpu.cfs_quota_us` /
    `cpu.cfs_period_us`); None without one."""
    try:
        quota, period = open(os.path.join(root, "cpu.max")).read().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int(open(os.path.join(root, "cpu", "cpu.cfs_quota_us")).read())
        period = int(open(os.path.join(root, "cpu", "cpu.cfs_period_us")).read())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


def compute_threads(requested: int, limit: float | None, default: int) -> int:
    """torch's intra-op threads: `requested` when set, else no more than the container's CPU
    limit (torch sizes its pool by the node's cores: in a pod limited to 2 CPUs of 64 its 64
    threads would spin against each other and be throttled), else torch's default."""
    if requested > 0:
        return requested
    if limit is not None:
        return max(1, min(default, math.ceil(limit)))
    return default


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="rft_serving.serve", description=__doc__.split("\n")[0])
    ap.add_argument("--host", default=_pod_ip() or "0.0.0.0")
    ap.add_argument("--port", type=int, default=int(os.environ.get("RFT_INFERENCE_PORT") or 8000))
    ap.add_argument("--model-dir", help="HF model directory to serve at start")
    ap.add_argument("--version", type=int, default=0, help="weights version of --model-dir")
    ap.add_argument("--served-model-name", default="policy")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--max-concurrency", type=int, default=4)
    ap.add_argument("--threads", type=int, default=0,
                    help="torch's intra-op threads (0: up to the container's CPU limit, else torch's default)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    threads = compute_threads(args.threads, cpu_limit(), torch.get_num_threads())
    if threads != torch.get_num_threads():
        log.info(json.dumps({"event": "threads", "threads": threads, "was": torch.get_num_threads()}))
        torch.set_num_threads(threads)

    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.set())
    server = ReferenceServer(args.host, args.port, args.served_model_name, args.device,
                             args.max_concurrency)
    server.start()  # bind first: /health answers 503 while the first weights load
    rc = 0
    if args.model_dir:
        try:
            server.load(args.model_dir, args.version)
        except RequestError as e:
            log.error(json.dumps({"event": "startup_load_failed", "error": e.message}))
            stopping.set()
            rc = 1
    while not stopping.wait(0.5):  # a timed wait lets the signal handler run promptly
        pass
    log.info(json.dumps({"event": "shutting_down"}))
    server.stop()
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
