"""The explorer's pieces that talk to inference and shape its answers into `Experiences`.

- `InferenceClient`: POST /v1/completions, round-robin over the inference endpoints. A
  failed endpoint (connection error, timeout, 408/429/5xx, invalid JSON) is skipped for an
  exponentially growing time (0.5 s doubling, capped at 30 s) and the request moves to the
  next one; when every endpoint is down the client waits for the first to come back.
  Transient errors never escape; other 4xx are `ClientError` (retrying cannot help).
- `choice_versions`: which weights version sampled each choice of a response (below).
- `build_samples`: one server response -> `Sample`s (prompt ids + response ids, logprobs,
  reward, version). Token ids come from the server when it returns them (exact: the prompt
  the engine ran and the tokens the policy actually sampled), else from the tokenizer.
  Every request asks `"return_token_ids": true`: vLLM (0.32.0) then returns each choice's
  `prompt_token_ids` and `token_ids` in its /v1/completions answer, and so does SGLang
  (0.5.23, its OpenAI-compatible completions route); the reference server always
  returns top-level `prompt_token_ids` (one list per prompt) and each choice's `token_ids`
  and lists the field as ignored. The fallback tokenizes the prompt with the same
  `add_special_tokens` the request sent (false for chat prompts: the template already
  wrote the special tokens). A stop token the policy sampled is kept, so the policy learns
  to stop: vLLM's `token_ids` already end with it (a choice with `stop_reason`: nothing is
  appended), the reference server reports it as `stop_token_id`, and otherwise the
  tokenizer's EOS is appended to a "stop" choice that does not end with it.
- `build_experiences`: `Sample`s -> one right-padded `Experiences` batch.

Versions. Every request asks `"return_weight_versions": true` (vLLM's opt-in; SGLang's
pydantic models ignore unknown keys, the reference server lists it as ignored). Each
choice's version is what the engine reports when it reports one:

- reference server (rft_serving.serve): `weights_version` in the body, or the
  `X-RFT-Weights-Version` header; a request runs on one weights snapshot;
- vLLM 0.32.0: `choices[i].weight_versions`, spans `[{version, start, end}]` of the
  output tokens in the /v1/completions answer; a choice with more than one distinct
  version straddled a reload and is dropped;
- SGLang 0.5.23: top-level `metadata` `{weight_version, weight_versions}` in the
  completions answer, built from the FIRST choice only: its version holds for every choice only when
  `weight_versions` has a single version, else every choice is dropped. (The sync agent
  reloads SGLang under its writer lock, which waits for running requests, so a request's
  choices cannot straddle its reloads; the check guards against other reloads.)

A label that is not one of our integer versions (vLLM's and SGLang's start-up label
"default": an engine container that restarted and was not reloaded yet) drops the choice.
When the engine reports nothing, the version is the sync agent's record of what that
replica loaded, through the explorer's `version_of(endpoint index)`, read before the
request and after it: equal records with an integer version give the version; a change
(STRADDLED) or a missing/null value (UNVERSIONED) drops the choices. The record is a
`Record` read from the agent itself (explorer.ReplicaRecords: no API server read), or for
an older agent the bare version in `status.weightSync.replicas[<pod>].version`. The agent
sets its record to null before it starts a reload and to the new version only once the
engine reports it (rft_serving.sync_agent), so a request that ran while the weights changed
reads null at least once, or two different records: it is dropped, never mislabelled.
A `Record`'s generation changes with each of those steps, so a request that straddled two
reloads, the second back to the first version number, is dropped too (the bare version
of the status cannot tell). A request that ends after the load but before the new version
is recorded is dropped too (it reads null), not attributed to the old version.
Dropped choices are counted in `InferenceClient.dropped`.
"""

from __future__ import annotations

import logging
import re
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Sequence
from urllib.parse import urlsplit

import requests
import torch

from rft_contract.names import inference_pod_name
from rft_contract.podenv import PodEnv
from rft_contract.storage import get_storage
from rft_contract.versions import parse_version
from rft_trainer.experience import Experiences

log = logging.getLogger("rft_rollout.rollouts")

VERSION_HEADER = "X-RFT-Weights-Version"
# Why a choice has no version (it is dropped): it straddled a reload, or nothing says.
STRADDLED, UNVERSIONED = "straddled", "unversioned"


# A log-prob the engine did not report: NaN, so that rollout correction leaves the response out
# rather than read it as a probability of 1 (rft_trainer.algorithms.rollout_correction).
UNKNOWN_LOGPROB = float("nan")


class Record(NamedTuple):
    """What a replica's sync agent says it serves, read from the agent itself
    (`GET <agent>/record`): `generation` changes whenever the record goes to no version
    (before every reload), so two reads that return the same Record bracket no reload,
    even one back to the same version number."""
    version: int | None
    generation: str


# The agent's record of what endpoint i serves: a Record from the agent, a bare version
# from the job's status (older agents), or None when unknown.
VersionOf = Callable[[int], "Record | int | None"]
# Files AutoTokenizer may read; weights are never downloaded for the tokenizer.
_TOKENIZER_FILES = {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model",
                    "added_tokens.json", "chat_template.jinja", "chat_template.json",
                    "config.json", "generation_config.json"}


class Stopped(Exception):
    """The explorer was asked to stop while waiting."""


class ClientError(RuntimeError):
    """The server rejected the request (4xx other than 408/429): retrying cannot help."""


class Completion(NamedTuple):
    """One /v1/completions answer: the response and, per choice in index order, its weights
    version or why it has none (STRADDLED, UNVERSIONED: dropped). `versions` is None when
    nothing at all says (the engine reports no version and there is no `version_of`)."""
    response: dict[str, Any]
    versions: list[int | str] | None


def _no_model_yet(r: requests.Response) -> bool:
    """A 404 naming the model: a replica that serves the policy as a LoRA adapter (vLLM)
    before its adapter loaded (a fresh or restarted engine): not ready yet, like a 503."""
    return r.status_code == 404 and "does not exist" in r.text


class InferenceClient:
    """`version_of(i)`: the sync agent's record of the version endpoint i serves (None when
    unknown); read around requests to endpoints whose engine reports no versions."""

    def __init__(self, endpoints: Sequence[str], timeout: float = 300.0,
                 stop: threading.Event | None = None, base_backoff: float = 0.5,
                 max_backoff: float = 30.0, version_of: VersionOf | None = None):
        if not endpoints:
            raise ValueError("no inference endpoints")
        self.endpoints = [e.rstrip("/") for e in endpoints]
        self.timeout, self.base_backoff, self.max_backoff = timeout, base_backoff, max_backoff
        self.stop = stop or threading.Event()
        self.version_of = version_of
        self.failures = 0  # total failed attempts, for tests and metrics
        self.dropped: Counter[str] = Counter()  # dropped choices by reason, since the start
        self._lock = threading.Lock()
        self._next = 0  # round-robin pointer
        self._fails = [0] * len(self.endpoints)  # consecutive failures per endpoint
        self._down_until = [0.0] * len(self.endpoints)  # monotonic time
        # Whether an endpoint's engine reported versions last time: then no record reads.
        self._reports = [False] * len(self.endpoints)
        self._taken: Counter[str] = Counter()  # `dropped` at the last take_dropped()
        self._drop_logged = 0.0
        self._local = threading.local()  # one requests.Session per thread

    def complete(self, body: dict[str, Any]) -> Completion:
        """The response and each choice's weights version (see the module doc)."""
        body = {**body, "return_weight_versions": True, "return_token_ids": True}
        while True:
            i, wait = self._pick()
            if wait > 0 and self.stop.wait(wait):
                raise Stopped()
            if self.stop.is_set():
                raise Stopped()
            url = f"{self.endpoints[i]}/v1/completions"
            read_record = self.version_of is not None and not self._reports[i]
            before = self._record(i) if read_record else None
            try:
                r = self._session().post(url, json=body, timeout=(min(10.0, self.timeout), self.timeout))
                if r.status_code == 200:
                    data = r.json()
                    if not isinstance(data, dict):
                        raise ValueError("response is not a JSON object")
                    self._succeeded(i)
                    header = _int_or_none(r.headers.get(VERSION_HEADER))
                    break
                if r.status_code not in (408, 429) and r.status_code < 500 and not _no_model_yet(r):
                    raise ClientError(f"POST {url}: HTTP {r.status_code}: {r.text[:500]}")
                reason = f"HTTP {r.status_code}: {r.text[:200]}"
            except (requests.RequestException, ValueError) as e:
                reason = f"{type(e).__name__}: {str(e)[:200]}"
            delay = self._failed(i)
            log.warning("POST %s failed (%s); trying the next endpoint, this one rests %.1fs",
                        url, reason, delay)
        versions = engine_versions(data, header)
        if versions is not None:
            self._reports[i] = True
        elif self.version_of is not None:
            n = len(data.get("choices") or [])
            if read_record:
                versions = record_versions(n, before, self._record(i))
            else:  # it reported versions before and stopped: ask the record from now on
                self._reports[i] = False
                versions = [UNVERSIONED] * n
        self._count_dropped(self.endpoints[i], versions)
        return Completion(data, versions)

    def take_dropped(self) -> dict[str, int]:
        """Choices dropped since the last call, by reason (for the shard log)."""
        with self._lock:
            now = self.dropped.copy()
            delta = {k: now[k] - self._taken[k] for k in (STRADDLED, UNVERSIONED)}
            self._taken = now
            return delta

    def _record(self, i: int) -> int | None:
        try:
            return self.version_of(i)
        except Exception as e:  # noqa: BLE001 - unknown: the choices are dropped
            log.warning("reading the sync agent's record for %s failed: %s", self.endpoints[i], e)
            return None

    def _count_dropped(self, endpoint: str, versions: list[int | str] | None) -> None:
        drops = Counter(v for v in versions or [] if isinstance(v, str))
        if not drops:
            return
        with self._lock:
            self.dropped.update(drops)
            total, now = dict(self.dropped), time.monotonic()
            quiet = now - self._drop_logged < 30.0
            if not quiet:
                self._drop_logged = now
        if not quiet:  # at most every 30 s
            log.warning("dropped %s choice(s) from %s (straddled a weights reload, or no version: "
                        "an engine not yet reloaded after a restart); dropped so far: %s",
                        sum(drops.values()), endpoint, total)

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


# ------------------------------------------------------------------ versions


def _from_spans(spans: Any) -> int | str:
    """The version of one output from its spans [{version, start, end}]."""
    if not isinstance(spans, list) or not spans:
        return UNVERSIONED
    labels = {str(s.get("version")) if isinstance(s, dict) else None for s in spans}
    if len(labels) > 1:
        return STRADDLED
    version = parse_version(labels.pop())
    return UNVERSIONED if version is None else version


def _sorted_choices(response: dict[str, Any]) -> list[dict[str, Any]]:
    return sorted(response.get("choices") or [], key=lambda c: c.get("index", 0))


def engine_versions(response: dict[str, Any], header_version: int | None = None) -> list[int | str] | None:
    """Per choice (in index order) the version the engine reports, or STRADDLED /
    UNVERSIONED; None when the engine reports none at all (see the module doc)."""
    choices = _sorted_choices(response)
    body = response.get("weights_version")  # the reference server
    if isinstance(body, int) and not isinstance(body, bool):
        return [body] * len(choices)
    if header_version is not None:
        return [header_version] * len(choices)
    if any(isinstance(c.get("weight_versions"), list) for c in choices):  # vLLM
        return [_from_spans(c.get("weight_versions")) for c in choices]
    metadata = response.get("metadata")  # SGLang: the first choice's spans
    if isinstance(metadata, dict) and isinstance(metadata.get("weight_versions"), list):
        return [_from_spans(metadata["weight_versions"])] * len(choices)
    return None


def record_versions(n: int, before: Record | int | None, after: Record | int | None) -> list[int | str]:
    """n choices' version from the agent's record read before and after the request."""
    versions = [r.version if isinstance(r, Record) else r for r in (before, after)]
    if None in versions or type(before) is not type(after):  # unknown, or two sources
        return [UNVERSIONED] * n
    return [versions[0] if before == after else STRADDLED] * n


def choice_versions(response: dict[str, Any], header_version: int | None = None,
                    record: tuple[int | None, int | None] | None = None) -> list[int | str] | None:
    """Each choice's version (in index order): the engine's report, else the agent's
    record (before, after) when one was read; None when nothing says."""
    versions = engine_versions(response, header_version)
    if versions is None and record is not None:
        versions = record_versions(len(response.get("choices") or []), *record)
    return versions


def replica_pod(endpoint: str, job: str) -> str | None:
    """The inference pod an endpoint URL names (`http://<job>-inference-<i>.<svc>...`,
    rft_operator.rollout_pods.inference_endpoints), or None for any other URL."""
    label = (urlsplit(endpoint).hostname or "").split(".")[0]
    m = re.fullmatch(re.escape(job) + r"-inference-([0-9]+)", label)
    return inference_pod_name(job, int(m[1])) if m else None


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
                  info: dict[str, Any] | None = None, versions: Sequence[int | str] | None = None,
                  *, header_version: int | None = None, add_special_tokens: bool = True) -> list[Sample]:
    """The samples of one /v1/completions response for a single prompt (`task["prompt"]`).
    `versions`: each choice's version in index order (`Completion.versions`; default: what
    the engine reports, with `header_version`); choices without one are left out.
    `add_special_tokens`: what the request sent (the fallback tokenizes the prompt so)."""
    if versions is None:
        versions = engine_versions(response, header_version)
    if versions is None:
        raise ValueError(f"inference response has no weights version (body weights_version, "
                         f"{VERSION_HEADER} header, vLLM choices[].weight_versions or SGLang "
                         "metadata.weight_versions) and no sync-agent record was read; explorers "
                         "need it for staleness")
    choices = _sorted_choices(response)
    if not choices:
        raise ValueError("inference response has no choices")
    if len(versions) != len(choices):
        raise ValueError(f"{len(versions)} versions for {len(choices)} choices")
    prompt, answer = task["prompt"], task["answer"]
    top = response.get("prompt_token_ids")  # the reference server: one list per prompt
    tokenized: list[int] | None = None
    eos = getattr(tokenizer, "eos_token_id", None)
    samples = []
    for choice, version in zip(choices, versions):
        if isinstance(version, str) or isinstance(version, bool) or not isinstance(version, int):
            continue  # straddled a reload or unversioned: dropped, never mislabelled
        prompt_ids = choice.get("prompt_token_ids") or (top[0] if top else None)  # vLLM, SGLang: per choice
        if prompt_ids is None:
            if tokenized is None:
                tokenized = tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"]
            prompt_ids = tokenized
        text = choice.get("text") or ""
        engine_ids = choice.get("token_ids")
        ids = list(engine_ids) if engine_ids is not None else \
            tokenizer(text, add_special_tokens=False)["input_ids"]
        logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
        if logprobs is None or len(logprobs) != len(ids):
            logprobs = [UNKNOWN_LOGPROB] * len(ids)  # unknown: keep the field's shape
        logprobs = [UNKNOWN_LOGPROB if lp is None else float(lp) for lp in logprobs]
        if "stop_token_id" in choice:  # the reference server: the stop token is not in token_ids
            stop_id = choice["stop_token_id"]
        elif engine_ids is not None and "stop_reason" in choice:
            stop_id = None  # vLLM: token_ids end with the stop token that ended the sample
        else:
            stop_id = eos
        if choice.get("finish_reason") == "stop" and stop_id is not None and (not ids or ids[-1] != stop_id):
            ids.append(stop_id)  # the policy chose to stop: train on that choice too
            lp = choice.get("stop_token_logprob")
            logprobs.append(UNKNOWN_LOGPROB if lp is None else float(lp))  # the engine did not report it
        reward = reward_fn(prompt, text, answer)
        samples.append(Sample(list(prompt_ids), ids, logprobs, reward, group_id, version, {
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


def load_tokenizer(uri: str, env: PodEnv | None = None) -> Any:
    """AutoTokenizer from a local directory or an s3:// prefix (tokenizer files only);
    `env`: the pod's S3 knobs (`JobConfig.env`)."""
    from transformers import AutoTokenizer

    if not uri.startswith("s3://"):
        return AutoTokenizer.from_pretrained(uri)
    storage = get_storage(uri, env)
    base = uri.rstrip("/") + "/"
    wanted = [u for u in storage.list(base) if u[len(base):] in _TOKENIZER_FILES]
    if not wanted:
        raise ValueError(f"{uri}: no tokenizer files ({', '.join(sorted(_TOKENIZER_FILES))})")
    with tempfile.TemporaryDirectory(prefix="rft-tokenizer-") as tmp:
        for u in wanted:
            with open(f"{tmp}/{u[len(base):]}", "wb") as f:
                f.write(storage.read_bytes(u))
        return AutoTokenizer.from_pretrained(tmp)
