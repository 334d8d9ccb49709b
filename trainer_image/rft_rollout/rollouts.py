"""The explorer's pieces that talk to inference and shape its answers into `Experiences`.

- `InferenceClient`: POST /v1/completions, round-robin over the inference endpoints. A
  failed endpoint (connection error, timeout, 408/429/5xx, invalid JSON) is skipped for an
  exponentially growing time (0.5 s doubling, capped at 30 s) and the request moves to the
  next one; when every endpoint is down the client waits for the first to come back.
  Transient errors never escape; other 4xx are `ClientError` (retrying cannot help).
- `build_samples`: one server response -> `Sample`s (prompt ids + response ids, logprobs,
  reward, version). Token ids come from the server when it returns them (exact: what the
  policy actually sampled), else from the tokenizer. An EOS id is appended to responses
  that finished with "stop" when the server left it out, so the policy learns to stop.
- `build_experiences`: `Sample`s -> one right-padded `Experiences` batch.
"""

from __future__ import annotations

import logging
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import requests
import torch

from rft_contract.storage import get_storage
from rft_trainer.experience import Experiences

log = logging.getLogger("rft_rollout.explorer")

VERSION_HEADER = "X-RFT-Weights-Version"
# Files AutoTokenizer may read; weights are never downloaded for the tokenizer.
_TOKENIZER_FILES = {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model",
                    "added_tokens.json", "chat_template.jinja", "chat_template.json",
                    "config.json", "generation_config.json"}


class Stopped(Exception):
    """The explorer was asked to stop while waiting."""


class ClientError(RuntimeError):
    """The server rejected the request (4xx other than 408/429): retrying cannot help."""


class InferenceClient:
    def __init__(self, endpoints: Sequence[str], timeout: float = 300.0,
                 stop: threading.Event | None = None, base_backoff: float = 0.5,
                 max_backoff: float = 30.0):
        if not endpoints:
            raise ValueError("no inference endpoints")
        self.endpoints = [e.rstrip("/") for e in endpoints]
        self.timeout, self.base_backoff, self.max_backoff = timeout, base_backoff, max_backoff
        self.stop = stop or threading.Event()
        self.failures = 0  # total failed attempts, for tests and metrics
        self._lock = threading.Lock()
        self._next = 0  # round-robin pointer
        self._fails = [0] * len(self.endpoints)  # consecutive failures per endpoint
        self._down_until = [0.0] * len(self.endpoints)  # monotonic time
        self._local = threading.local()  # one requests.Session per thread

    def complete(self, body: dict[str, Any]) -> tuple[dict[str, Any], int | None]:
        """(response JSON, version from the X-RFT-Weights-Version header or None)."""
        while True:
            i, wait = self._pick()
            if wait > 0 and self.stop.wait(wait):
                raise Stopped()
            if self.stop.is_set():
                raise Stopped()
            url = f"{self.endpoints[i]}/v1/completions"
            try:
                r = self._session().post(url, json=body, timeout=(min(10.0, self.timeout), self.timeout))
                if r.status_code == 200:
                    data = r.json()
                    if not isinstance(data, dict):
                        raise ValueError("response is not a JSON object")
                    self._succeeded(i)
                    return data, _int_or_none(r.headers.get(VERSION_HEADER))
                if r.status_code not in (408, 429) and r.status_code < 500:
                    raise ClientError(f"POST {url}: HTTP {r.status_code}: {r.text[:500]}")
                reason = f"HTTP {r.status_code}: {r.text[:200]}"
            except (requests.RequestException, ValueError) as e:
                reason = f"{type(e).__name__}: {str(e)[:200]}"
            delay = self._failed(i)
            log.warning("POST %s failed (%s); trying the next endpoint, this one rests %.1fs",
                        url, reason, delay)

    def _pick(self) -> tuple[int, float]:
        """The next endpoint in round-robin order that is up (else the first back up),
        and how long to wait for it."""
        with self._lock:
            now, n = time.monotonic(), len(self.endpoints)
            order = [(self._next + k) % n for k in range(n)]
            self._next = (self._next + 1) % n
            i = min(order, key=lambda j: max(self._down_until[j], now))  # ties keep the order
            return i, self._down_until[i] - now

    def _failed(self, i: int) -> float:
        with self._lock:
            self.failures += 1
            self._fails[i] += 1
            delay = min(self.max_backoff, self.base_backoff * 2 ** (self._fails[i] - 1))
            self._down_until[i] = time.monotonic() + delay
            return delay

    def _succeeded(self, i: int) -> None:
        with self._lock:
            self._fails[i], self._down_until[i] = 0, 0.0

    def _session(self) -> requests.Session:
        if not hasattr(self._local, "session"):
            self._local.session = requests.Session()
        return self._local.session


def _int_or_none(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


# ------------------------------------------------------------------ samples


@dataclass
class Sample:
    prompt_ids: list[int]
    response_ids: list[int]
    response_logprobs: list[float]  # one per response id
    reward: float
    group_id: int
    weights_version: int
    info: dict[str, Any] = field(default_factory=dict)


def build_samples(response: dict[str, Any], task: dict[str, str], tokenizer: Any,
                  reward_fn: Callable[[str, str, str], float], group_id: int,
                  info: dict[str, Any] | None = None, header_version: int | None = None) -> list[Sample]:
    """The samples of one /v1/completions response for a single prompt (`task["prompt"]`)."""
    version = response.get("weights_version", header_version)
    if not isinstance(version, int) or isinstance(version, bool):
        raise ValueError(f"inference response has no integer weights_version (body or "
                         f"{VERSION_HEADER} header), got {version!r}; explorers need it for staleness")
    choices = sorted(response.get("choices") or [], key=lambda c: c.get("index", 0))
    if not choices:
        raise ValueError("inference response has no choices")
    prompt, answer = task["prompt"], task["answer"]
    prompt_token_ids = response.get("prompt_token_ids")
    prompt_ids = list(prompt_token_ids[0]) if prompt_token_ids else tokenizer(prompt)["input_ids"]
    eos = getattr(tokenizer, "eos_token_id", None)
    samples = []
    for choice in choices:
        text = choice.get("text") or ""
        ids = choice.get("token_ids")
        ids = list(ids) if ids is not None else tokenizer(text, add_special_tokens=False)["input_ids"]
        logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
        if logprobs is None or len(logprobs) != len(ids):
            logprobs = [0.0] * len(ids)  # unknown: keep the field's shape (see module doc)
        logprobs = [0.0 if lp is None else float(lp) for lp in logprobs]
        stop_id = choice.get("stop_token_id", eos)
        if choice.get("finish_reason") == "stop" and stop_id is not None and (not ids or ids[-1] != stop_id):
            ids.append(stop_id)  # the policy chose to stop: train on that choice too
            lp = choice.get("stop_token_logprob")
            logprobs.append(0.0 if lp is None else float(lp))  # 0.0: engine did not report it
        reward = reward_fn(prompt, text, answer)
        samples.append(Sample(prompt_ids, ids, logprobs, reward, group_id, version, {
            **(info or {}), "reward": reward, "response": text,
            "finish_reason": choice.get("finish_reason")}))
    return samples


def build_experiences(samples: Sequence[Sample]) -> Experiences:
    """(B, T) tensors, right-padded with 0 to the longest prompt + response; the action mask
    covers the response tokens; rollout_logprobs are 0 on the prompt and the padding."""
    if not samples:
        raise ValueError("build_experiences: no samples")
    B = len(samples)
    T = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    tokens = torch.zeros(B, T, dtype=torch.int64)
    attention = torch.zeros(B, T, dtype=torch.bool)
    action = torch.zeros(B, T, dtype=torch.bool)
    logprobs = torch.zeros(B, T, dtype=torch.float32)
    for i, s in enumerate(samples):
        p, n = len(s.prompt_ids), len(s.prompt_ids) + len(s.response_ids)
        tokens[i, :n] = torch.tensor(s.prompt_ids + s.response_ids, dtype=torch.int64)
        attention[i, :n] = True
        action[i, p:n] = True
        logprobs[i, p:n] = torch.tensor(s.response_logprobs, dtype=torch.float32)
    return Experiences(
        tokens=tokens, attention_mask=attention, action_mask=action,
        prompt_lengths=torch.tensor([len(s.prompt_ids) for s in samples], dtype=torch.int64),
        rewards=torch.tensor([s.reward for s in samples], dtype=torch.float32),
        group_ids=torch.tensor([s.group_id for s in samples], dtype=torch.int64),
        rollout_logprobs=logprobs,
        weights_version=torch.tensor([s.weights_version for s in samples], dtype=torch.int64),
        info=[s.info for s in samples],
    ).validate()


def load_tokenizer(uri: str) -> Any:
    """AutoTokenizer from a local directory or an s3:// prefix (tokenizer files only)."""
    from transformers import AutoTokenizer

    if not uri.startswith("s3://"):
        return AutoTokenizer.from_pretrained(uri)
    storage = get_storage(uri)
    base = uri.rstrip("/") + "/"
    wanted = [u for u in storage.list(base) if u[len(base):] in _TOKENIZER_FILES]
    if not wanted:
        raise ValueError(f"{uri}: no tokenizer files ({', '.join(sorted(_TOKENIZER_FILES))})")
    with tempfile.TemporaryDirectory(prefix="rft-tokenizer-") as tmp:
        for u in wanted:
            with open(f"{tmp}/{u[len(base):]}", "wb") as f:
                f.write(storage.read_bytes(u))
        return AutoTokenizer.from_pretrained(tmp)
