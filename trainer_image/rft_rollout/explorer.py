"""The explorer: rolls out tasks against the inference pods, scores them, and commits
experience shards to the buffer the trainer reads.

    python -m rft_rollout.explorer --config /etc/rft/config.json

Environment (set by the operator; flags win): RFT_EXPLORER_INDEX (default 0),
RFT_EXPLORER_REPLICAS (default explorer.replicas), RFT_INFERENCE_ENDPOINTS
(comma-separated base URLs), RFT_JOB_NAME / RFT_JOB_NAMESPACE (trainer progress is read
from the RFTJob status to throttle).

Work split. Epoch e shuffles all task indices with `random.Random(e)`, so every explorer
computes the same order; explorer i takes positions i, i+R, i+2R, ... of it. A sample's
group id is `epoch * num_tasks + task_index`: unique per (epoch, task) across explorers.

Shards and resume. Every `tasks_per_shard` tasks become one shard named
`<seq:010d>-e<index:03d>`, then `<buffer>/_explorer/e<index:03d>.json` records the next
seq and task position. Delivery is at-least-once and idempotent: after a crash between
the shard and the state write, the restarted explorer finds the shard already committed
and skips those tasks instead of writing them again. A partial shard is dropped on
SIGTERM (its tasks are redone after the restart). Only the current shard is in memory.

Throttle. Before generating a shard the explorer waits while the samples it has written
and the trainer is not done with reach its share of `max_staleness + 1` batches,
`ceil((max_staleness + 1) * batch_size / replicas)`, so rollouts are generated with
weights at most `max_staleness` versions old when the trainer reads them (generating only
after the wait, rather than waiting with a finished shard, keeps them fresh). "Done with"
is what the trainer reports in `status.trainer.buffer.consumed[e<index>]`: samples it
trained or dropped as stale, stale ones it passed over included. So stale samples
release budget, and an explorer whose samples went stale (weight sync lagging) writes
fresh ones instead of waiting for a trainer that waits for it. A trainer that does not
report it counts as having consumed its share of each step (`step * batch_size /
replicas`). While the trainer reports it waits for experiences (not stale ones), each
explorer may hold a whole `max_staleness + 1` batches: the others may be down, and the
live ones must be able to fill a batch alone. The explorer stops (exit 0) once
trainer_step >= total_steps.

Prompts. `explorer.prompt_format` "chat" sends a task's text as one user message through
the tokenizer's chat template (with the assistant's generation prompt), "raw" sends the
text as is; unset means chat when the tokenizer has a chat template, else raw. The
rendered text is the `prompt` of /v1/completions, so the prompt tokens the trainer learns
from are the templated ones; rewards still get the task's own text as their `prompt`.
A chat prompt is sent with `"add_special_tokens": false`: the template already wrote the
special tokens (a Llama-3-style `{{ bos_token }}`), and a tokenizer that adds a BOS would
add a second one. vLLM (CompletionRequest.add_special_tokens) and the reference server
honour it, and the samples' fallback tokenization uses it too; SGLang 0.5.23's
CompletionRequest has no such field (ignored) and its tokenizer manager always adds the
tokenizer's special tokens to a text prompt, so there such a template still gets two BOS
(the samples then hold the ids SGLang returns: what it ran).

Exit codes: 0 when done, after --max-shards, or on SIGTERM; 78 for a bad config (a restart
cannot fix it); 1 otherwise (retryable).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import requests

from rft_contract.config import ConfigError, JobConfig, load_explorer_config
from rft_contract.jobapi import get_job, job_api
from rft_contract.names import SERVED_MODEL_NAME, WAIT_DATA, agent_port
from rft_contract.podmetrics import ExplorerMetrics
from rft_contract.storage import Storage, get_storage, join
from rft_contract.trackers import PROMPT_INFO_CHARS
from rft_trainer.experience import read_shard_meta, write_shard
from rft_trainer.tracking import Tracker, build_tracker, explorer_role

from .rewards import get_reward
from .rollouts import (STRADDLED, UNVERSIONED, ClientError, Completion, InferenceClient, Record, Sample,
                       Stopped, VersionOf, build_experiences, build_samples, load_tokenizer, replica_pod)
from .tasksets import load_taskset

log = logging.getLogger("rft_rollout.explorer")

EX_CONFIG = 78
# The trackers' last sends on exit, well inside the pod's 30 s termination grace period.
TRACKER_CLOSE_SECONDS = 10.0
# Consecutive tasks the server may reject (4xx) before the explorer gives up: a bad task
# is skipped, but a bad config (say max_tokens beyond the context) rejects every task.
MAX_REJECTED_IN_ROW = 8
class TrainerProgress(NamedTuple):
    step: int
    total: int
    consumed: dict[str, int] | None = None  # status.trainer.buffer.consumed
    waiting: str | None = None  # status.trainer.waiting.reason


Progress = Callable[[], "TrainerProgress | tuple[int, int] | None"]


def shard_name(seq: int, index: int) -> str:
    return f"{seq:010d}-e{index:03d}"


# ------------------------------------------------------------------ prompts


def _reward_on_text(reward_fn: Callable[[str, str, str], float], text: str
                    ) -> Callable[[str, str, str], float]:
    """`reward_fn` called with `text` (the task's own) as its prompt, whatever it is given."""
    return lambda prompt, response, answer: reward_fn(text, response, answer)


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def resolve_prompt_format(setting: str | None, tokenizer: Any) -> str:
    """`explorer.prompt_format` with None resolved: "chat" when the tokenizer has a chat
    template, else "raw". ConfigError for "chat" without a template."""
    if setting is None:
        return "chat" if has_chat_template(tokenizer) else "raw"
    if setting not in ("chat", "raw"):
        raise ConfigError(f"explorer.prompt_format: must be 'chat' or 'raw', got {setting!r}")
    if setting == "chat" and not has_chat_template(tokenizer):
        raise ConfigError("explorer.prompt_format: 'chat' needs a tokenizer with a chat template, and "
                          "this one (model.tokenizer_path, else model.path) has none; use 'raw' or a "
                          "chat model's tokenizer")
    return setting


def render_prompt(text: str, prompt_format: str, tokenizer: Any) -> str:
    """What the explorer sends as the completion prompt for a task's `text`."""
    if prompt_format == "raw":
        return text
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    if not isinstance(rendered, str):
        raise TypeError(f"apply_chat_template(tokenize=False) returned {type(rendered).__name__}, not str")
    return rendered


@dataclass(frozen=True)
class ExplorerState:
    seq: int = 0  # next shard number
    epoch: int = 0
    position: int = 0  # next position in this explorer's share of the epoch
    samples: int = 0  # samples committed so far


class Explorer:
    def __init__(self, config: JobConfig, endpoints: Sequence[str], index: int = 0,
                 replicas: int = 1, storage: Storage | None = None, progress: Progress | None = None,
                 tokenizer: Any = None, tasks: list[dict[str, str]] | None = None,
                 version_of: VersionOf | None = None):
        if replicas < 1 or not 0 <= index < replicas:
            raise ValueError(f"explorer index {index} must lie in [0, replicas={replicas})")
        self.config, self.section = config, config.explorer
        self.index, self.replicas, self.progress = index, replicas, progress
        self.buffer_uri = config.buffer.uri
        self.storage = storage or get_storage(self.buffer_uri, config.env)
        self.stream = f"e{index:03d}"  # the trainer's name for our shards (experience.stream_of)
        self.state_uri = join(self.buffer_uri, "_explorer", f"{self.stream}.json")
        self.tasks = tasks if tasks is not None else load_taskset(self.section.taskset_uri, config.env)
        if len(self.tasks) <= index:
            raise ValueError(f"taskset has {len(self.tasks)} tasks: explorer {index} of "
                             f"{replicas} would have none; use fewer explorer replicas")
        self.reward_fn = get_reward(self.section.reward)
        if tokenizer is None:
            tokenizer = load_tokenizer(config.model.tokenizer_path or config.model.path, config.env)
        self.tokenizer = tokenizer
        self.prompt_format = resolve_prompt_format(self.section.prompt_format, tokenizer)
        # Whether the prompt's text still needs the tokenizer's special tokens (not for chat).
        self.add_special_tokens = self.prompt_format != "chat"
        try:  # a template that cannot render a user message fails here, not mid-run
            example = self.prompt_text(self.tasks[0])
        except Exception as e:  # noqa: BLE001 - any template error is a config error
            raise ConfigError(f"explorer.prompt_format: the tokenizer's chat template fails on task "
                              f"{self.tasks[0]['id']!r}: {type(e).__name__}: {e}") from e
        log.info(json.dumps({"event": "prompt_format", "prompt_format": self.prompt_format,
                             "setting": self.section.prompt_format,
                             "chat_template": has_chat_template(tokenizer), "example": example[:500]}))
        self.tasks_per_shard = self.section.tasks_per_shard or max(
            1, config.trainer.batch_size // self.section.rollouts_per_task)
        self.concurrency = self.section.concurrency or len(endpoints)
        self._stop = threading.Event()
        self.waiting = threading.Event()  # set while throttled (for tests and metrics)
        # version_of: the sync agents' records, for engines that report no weights version.
        if version_of is None:
            port = agent_port(config.inference.port) if config.inference is not None else None
            version_of = replica_versions(progress, endpoints, port, job=config.job.name)
        self.client = InferenceClient(endpoints, self.section.request_timeout, self._stop, version_of=version_of)
        self.finished = False  # the trainer reached total_steps
        self.rejected_in_row = 0
        self.state = ExplorerState()
        self._order: tuple[int, list[int]] = (-1, [])
        self.metrics = ExplorerMetrics()  # main() serves it (/metrics, port `metrics`)
        self.tracker: Tracker | None = None  # spec.tracking's runs of this explorer (main() builds it)

    def stop(self) -> None:
        """Ask run() to return soon (signal-safe: only sets an event)."""
        self._stop.set()

    def prompt_text(self, task: Mapping[str, str]) -> str:
        """The completion prompt for `task` (see "Prompts" in the module doc)."""
        return render_prompt(task["prompt"], self.prompt_format, self.tokenizer)

    # ------------------------------------------------------------ the loop

    def run(self, max_shards: int | None = None) -> int:
        """Commit shards until the trainer is done, `max_shards` are written or stop();
        returns the number written by this call."""
        state = self.state = self.load_state()
        log.info(json.dumps({"event": "explorer_start", "index": self.index, "replicas": self.replicas,
                             "buffer": self.buffer_uri, "tasks": len(self.tasks),
                             "tasks_per_shard": self.tasks_per_shard, **dataclasses.asdict(state)}))
        written = 0
        while (max_shards is None or written < max_shards) and self._wait_for_trainer(state.samples):
            name = shard_name(state.seq, self.index)
            jobs, (epoch, position) = self._next_tasks(state.epoch, state.position)
            if self.storage.exists(join(self.buffer_uri, f"{name}.json")):
                log.warning("shard %s is already committed (restart after a crash): skipping its tasks", name)
                num = self._committed_samples(name)
                state = ExplorerState(state.seq + 1, epoch, position, state.samples + num)
            else:
                start = time.monotonic()
                try:
                    samples = self._rollouts(jobs)
                except Stopped:
                    log.info("stopping: dropping the partial shard %s (its tasks are redone on restart)", name)
                    break
                if samples:
                    write_shard(self.buffer_uri, name, build_experiences(samples), self.storage)
                    written += 1
                    self._log_shard(name, state.seq, samples, start)
                state = ExplorerState(state.seq + bool(samples), epoch, position, state.samples + len(samples))
            self.save_state(state)
            self.state = state
        return written

    def _next_tasks(self, epoch: int, position: int) -> tuple[list[tuple[int, int]], tuple[int, int]]:
        """The next `tasks_per_shard` (epoch, task index) pairs and the position after them."""
        jobs = []
        for _ in range(self.tasks_per_shard):
            mine = self._my_tasks(epoch)
            if position >= len(mine):
                epoch, position = epoch + 1, 0
                mine = self._my_tasks(epoch)
            jobs.append((epoch, mine[position]))
            position += 1
        if position >= len(self._my_tasks(epoch)):
            epoch, position = epoch + 1, 0
        return jobs, (epoch, position)

    def _my_tasks(self, epoch: int) -> list[int]:
        """This explorer's task indices in epoch `epoch` (same permutation on every explorer)."""
        if self._order[0] != epoch:
            order = list(range(len(self.tasks)))
            random.Random(epoch).shuffle(order)
            self._order = (epoch, order[self.index::self.replicas])
        return self._order[1]

    def _rollouts(self, jobs: list[tuple[int, int]]) -> list[Sample]:
        """Samples for `jobs` in order. Requests run in `concurrency` threads; tokenizing and
        scoring stay on this thread (fast tokenizers and user rewards need not be
        thread-safe). Raises Stopped."""
        responses: list[list[tuple[dict, int | None]] | None] = [None] * len(jobs)
        errors: list[BaseException] = []
        claimed = iter(range(len(jobs)))
        lock = threading.Lock()
        prompts = [self.prompt_text(self.tasks[t]) for _, t in jobs]  # templates run on this thread

        def worker() -> None:
            while not self._stop.is_set() and not errors:
                with lock:
                    i = next(claimed, None)
                if i is None:
                    return
                try:
                    responses[i] = self._generate(self.tasks[jobs[i][1]], prompts[i])
                except Stopped:
                    return
                except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
                    errors.append(e)

        threads = [threading.Thread(target=worker, daemon=True, name=f"rft-rollout-{k}")
                   for k in range(min(self.concurrency, len(jobs)))]
        for t in threads:
            t.start()
        for t in threads:
            while t.is_alive() and not self._stop.is_set():
                t.join(0.2)  # a timed join keeps the main thread responsive to signals
        if errors:
            raise errors[0]
        if self._stop.is_set():
            raise Stopped()
        samples = []
        for (epoch, task_index), answers, prompt in zip(jobs, responses, prompts):
            self.rejected_in_row = 0 if answers else self.rejected_in_row + 1
            if self.rejected_in_row >= max(MAX_REJECTED_IN_ROW, self.tasks_per_shard):
                raise RuntimeError(f"inference rejected {self.rejected_in_row} tasks in a row (see the "
                                   "errors above): check explorer.sampling and the taskset")
            task = self.tasks[task_index]
            # Samples hold the tokens of the prompt sent; the reward gets the task's own text.
            sent, reward_fn = {**task, "prompt": prompt}, _reward_on_text(self.reward_fn, task["prompt"])
            # The task's text (its start) goes with each sample: the trainer's trackers show it.
            info = {"task_id": task["id"], "explorer": self.index, "epoch": epoch,
                    "prompt": task["prompt"][:PROMPT_INFO_CHARS]}
            for response, versions in answers:  # choices without a version are dropped
                samples += build_samples(response, sent, self.tokenizer, reward_fn,
                                         epoch * len(self.tasks) + task_index, info, versions,
                                         add_special_tokens=self.add_special_tokens)
        return samples

    def _generate(self, task: dict[str, str], prompt: str | None = None) -> list[Completion]:
        """The server's responses for all rollouts of one task (up to max_n per request) to
        `prompt` (default: `prompt_text(task)`); [] when the server rejects the task (logged,
        the task is skipped)."""
        section, out = self.section, []
        prompt = self.prompt_text(task) if prompt is None else prompt
        for start in range(0, section.rollouts_per_task, section.max_n):
            body = {"model": SERVED_MODEL_NAME, "prompt": prompt,
                    "n": min(section.max_n, section.rollouts_per_task - start),
                    "max_tokens": section.sampling.max_tokens,
                    "temperature": section.sampling.temperature,
                    "top_p": section.sampling.top_p, "logprobs": 0}
            if not self.add_special_tokens:  # the chat template wrote them (module doc)
                body["add_special_tokens"] = False
            try:
                out.append(self.client.complete(body))
            except ClientError as e:
                log.error("task %s skipped: %s", task["id"], e)
                self.metrics.rejected.inc()
                return []
        return out

    # ------------------------------------------------------------ throttle

    def trainer_done(self) -> bool:
        """Whether the trainer has reached total_steps, read once now (False if unknown)."""
        try:
            progress = self.progress() if self.progress else None
        except Exception as e:  # noqa: BLE001 - only a run's final status hangs on it
            log.warning("trainer progress unreadable: %s", e)
            return False
        if progress is None:
            return False
        step, total, *_ = TrainerProgress(*progress)
        return step >= total

    def _wait_for_trainer(self, samples_written: int) -> bool:
        """Wait while we are ahead of the trainer; False once it finished or on stop()."""
        waited_since = None
        while not self._stop.is_set():
            progress = self.progress() if self.progress else None
            if progress is None:
                break
            step, total, consumed_by, waiting = TrainerProgress(*progress)
            self.metrics.observe_trainer(step)
            self.metrics.observe_request_failures(self.client.failures)
            if step >= total:
                log.info("trainer finished (step %d of %d): explorer done", step, total)
                self.finished = True
                return False
            batch = self.config.trainer.batch_size
            if consumed_by is None:  # a trainer that does not report it: its share per step
                consumed = step * batch // self.replicas
            else:
                consumed = int(consumed_by.get(self.stream, 0))
            allowed = -(-(self.config.buffer.max_staleness + 1) * batch // self.replicas)
            if waiting == WAIT_DATA:  # short of a batch (an explorer down?): fill it
                allowed = (self.config.buffer.max_staleness + 1) * batch
            if samples_written - consumed < allowed:
                break
            now = time.monotonic()
            if waited_since is None or now - waited_since >= 60:
                log.info("ahead of the trainer (step %d of %d; %d samples written, %d consumed or dropped "
                         "by the trainer, %d unconsumed allowed): waiting",
                         step, total, samples_written, consumed, allowed)
                waited_since = now
            self.waiting.set()
            self.metrics.waiting.set(1)
            self._stop.wait(self.section.poll_interval)
        self.waiting.clear()
        self.metrics.waiting.set(0)
        return not self._stop.is_set()

    # ------------------------------------------------------------ state

    def load_state(self) -> ExplorerState:
        try:
            raw = self.storage.read_bytes(self.state_uri)
        except FileNotFoundError:
            return ExplorerState()
        try:
            data = json.loads(raw)
            return ExplorerState(**{f.name: int(data[f.name]) for f in dataclasses.fields(ExplorerState)})
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{self.state_uri}: invalid explorer state: {e}") from None

    def save_state(self, state: ExplorerState) -> None:
        body = {**dataclasses.asdict(state), "updated": datetime.now(timezone.utc).isoformat()}
        self.storage.write_bytes(self.state_uri, json.dumps(body).encode())

    def _committed_samples(self, name: str) -> int:
        try:
            return read_shard_meta(join(self.buffer_uri, f"{name}.json"), self.storage)["num_samples"]
        except ValueError as e:  # unreadable: count it as a full shard, for the throttle only
            log.error("%s", e)
            return self.tasks_per_shard * self.section.rollouts_per_task

    def _log_shard(self, name: str, seq: int, samples: list[Sample], start: float) -> None:
        versions = [s.weights_version for s in samples]
        dropped = self.client.take_dropped()  # choices left out since the last shard log
        reward_mean, seconds = sum(s.reward for s in samples) / len(samples), time.monotonic() - start
        log.info(json.dumps({
            "event": "shard", "name": name, "seq": seq, "samples": len(samples),
            "reward_mean": round(reward_mean, 6),
            "version_min": min(versions), "version_max": max(versions),
            "seconds": round(seconds, 3), "retries": self.client.failures,
            "dropped_straddling": dropped[STRADDLED], "dropped_unversioned": dropped[UNVERSIONED]}))
        self.metrics.observe_shard(len(samples), versions, reward_mean, seconds, dropped)
        self.metrics.observe_request_failures(self.client.failures)
        if self.tracker is not None:  # queued: a tracker that is down never holds the explorer
            trainer_step = self.metrics.last_trainer_step
            self.tracker.log_metrics(seq + 1, {
                "rollout/rewards/mean": reward_mean, "rollout/samples": len(samples),
                "rollout/response_length/mean": sum(len(s.response_ids) for s in samples) / len(samples),
                "rollout/policy_version/min": min(versions), "rollout/policy_version/max": max(versions),
                **({} if trainer_step is None else {"rollout/staleness": trainer_step - min(versions)}),
                "rollout/dropped/straddled": dropped[STRADDLED], "rollout/dropped/unversioned": dropped[UNVERSIONED],
                "rollout/request_retries": self.client.failures, "timing_s/shard": seconds})


# ------------------------------------------------------------------ trainer progress


class KubeProgress:
    """(trainer step, total steps, samples consumed per explorer) from the RFTJob's
    `status.trainer`; the last known value on API errors. A missing step is 0; a missing
    totalSteps is the config's; a missing buffer report is None."""

    def __init__(self, api: Any, name: str, namespace: str, total_steps: int):
        self.api, self.name, self.namespace, self.total_steps = api, name, namespace, total_steps
        self.last: TrainerProgress | None = None
        self.record_reads = 0  # API reads for replica versions (older agents only)

    def __call__(self) -> TrainerProgress | None:
        try:
            obj = get_job(self.api, self.namespace, self.name)
        except Exception as e:  # noqa: BLE001 - keep exploring on the last known progress
            log.warning("reading RFTJob %s/%s status failed: %s", self.namespace, self.name, e)
            return self.last
        trainer = (obj.get("status") or {}).get("trainer") or {}
        consumed = (trainer.get("buffer") or {}).get("consumed")
        waiting = (trainer.get("waiting") or {}).get("reason")
        self.last = TrainerProgress(int(trainer.get("step") or 0), int(trainer.get("totalSteps") or self.total_steps),
                                    consumed if isinstance(consumed, dict) else None, waiting)
        return self.last

    def replica_version(self, pod: str) -> int | None:
        """The version the sync agent of inference pod `pod` last recorded as loaded
        (`status.weightSync.replicas[pod].version`), read now; None when unknown (no
        entry, or the API failed: never a stale value, the read brackets a request).
        Only for agents too old to answer `/record` (ReplicaRecords)."""
        self.record_reads += 1
        try:
            obj = get_job(self.api, self.namespace, self.name)
        except Exception as e:  # noqa: BLE001 - unknown: that request's samples are dropped
            log.warning("reading RFTJob %s/%s status failed: %s", self.namespace, self.name, e)
            return None
        entry = (((obj.get("status") or {}).get("weightSync") or {}).get("replicas") or {}).get(pod) or {}
        version = entry.get("version")
        return version if isinstance(version, int) and not isinstance(version, bool) else None


def replica_versions(progress: Progress | None, endpoints: Sequence[str], agent_port: int | None = None,
                     job: str = "") -> VersionOf | None:
    """`version_of(endpoint index)` for the InferenceClient, for endpoints that name the
    job's inference pods (`http://<job>-inference-<i>.<svc>...`): with `agent_port`, each
    replica's sync agent's record read from the agent (ReplicaRecords); without it, from
    the job's status through a KubeProgress. None when neither can say. Only read for
    engines whose responses carry no weights version."""
    job = job or (progress.name if isinstance(progress, KubeProgress) else "")
    pods = [replica_pod(e, job) for e in endpoints] if job else []
    if not any(pods):
        return None
    kube = progress if isinstance(progress, KubeProgress) else None
    if agent_port is not None:
        return ReplicaRecords(endpoints, pods, agent_port, kube)
    if kube is None:
        return None
    return lambda i: kube.replica_version(pods[i]) if pods[i] else None


class ReplicaRecords:
    """Each replica's sync agent's record of what its engine serves, read from the agent
    (`GET http://<pod>:<agent port>/record`, rft_serving.sync_agent.SyncAgent.record) around
    every request: no API server read, so a throttled or unreachable API server drops no
    sample whose version the agent knows. Where the agent cannot say, the job's status says
    (`progress`, two API reads per request): an agent that answers 404 (an image from before
    the route) for the next `RECHECK_OLD` seconds, and one that did not answer
    `UNREACHABLE_AFTER` times in a row (a NetworkPolicy that lets only inference pods reach
    port 8471, say) for the next `RECHECK_UNREACHABLE`; then the agent is asked again. A
    single failed read gives no version (those choices are dropped)."""

    LOG_EVERY = 30.0
    RECHECK_OLD = 300.0
    RECHECK_UNREACHABLE = 60.0
    UNREACHABLE_AFTER = 3

    def __init__(self, endpoints: Sequence[str], pods: Sequence[str | None], port: int,
                 progress: KubeProgress | None = None, timeout: float = 2.0):
        from urllib.parse import urlsplit

        self.pods, self.progress, self.timeout = list(pods), progress, timeout
        self.urls = [f"http://{urlsplit(e).hostname}:{port}/record" if pod else None
                     for e, pod in zip(endpoints, pods)]
        self.status_until = [0.0] * len(self.urls)  # monotonic time: read the job's status until then
        self.reads = 0  # reads of agents
        self._unanswered = [0] * len(self.urls)
        self._local = threading.local()
        self._logged = 0.0

    def on_status(self, i: int) -> bool:
        """Whether endpoint i's record is read from the job's status now."""
        return time.monotonic() < self.status_until[i]

    def __call__(self, i: int) -> Record | int | None:
        if self.urls[i] is None:
            return None
        if self.on_status(i):
            return self.progress.replica_version(self.pods[i]) if self.progress is not None else None
        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = requests.Session()
        self.reads += 1
        try:
            r = session.get(self.urls[i], timeout=self.timeout)
            if r.status_code == 404:
                return self._to_status(i, self.RECHECK_OLD, "has no /record (an older image)")
            r.raise_for_status()
            doc = r.json()
            version, generation = doc["version"], doc["generation"]
        except (requests.ConnectionError, requests.Timeout) as e:
            self._unanswered[i] += 1
            if self._unanswered[i] >= self.UNREACHABLE_AFTER:
                return self._to_status(i, self.RECHECK_UNREACHABLE, f"did not answer {self._unanswered[i]} "
                                       f"times ({type(e).__name__}; a NetworkPolicy on the agent's port?)")
            self._warn(f"reading the sync agent's record at {self.urls[i]} failed: {type(e).__name__}: {e}")
            return None
        except (requests.RequestException, ValueError, KeyError, TypeError) as e:
            self._warn(f"reading the sync agent's record at {self.urls[i]} failed: {type(e).__name__}: {e}")
            return None
        self._unanswered[i] = 0
        ok = isinstance(version, int) and not isinstance(version, bool)
        return Record(version if ok else None, str(generation))

    def _to_status(self, i: int, seconds: float, why: str) -> int | None:
        log.warning("the sync agent at %s %s: reading its record from the job's status for %.0fs",
                    self.urls[i], why, seconds)
        self.status_until[i], self._unanswered[i] = time.monotonic() + seconds, 0
        return self(i)

    def _warn(self, message: str) -> None:
        now = time.monotonic()
        if now - self._logged >= self.LOG_EVERY:  # per request otherwise
            self._logged = now
            log.warning("%s (those requests' samples are dropped)", message)


def progress_from_env(name: str, namespace: str, total_steps: int) -> Progress | None:
    """KubeProgress with in-cluster or KUBECONFIG credentials; None (no throttle) without."""

    if not (name and namespace):
        return None
    try:
        api = job_api()
    except RuntimeError as e:
        log.warning("%s: not throttling to the trainer", e)
        return None
    return KubeProgress(api, name, namespace, total_steps)


# ------------------------------------------------------------------ CLI


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rft_rollout.explorer")
    ap.add_argument("--config", default=os.environ.get("RFT_CONFIG", "/etc/rft/config.json"))
    ap.add_argument("--endpoints", help="comma-separated inference base URLs (default $RFT_INFERENCE_ENDPOINTS)")
    ap.add_argument("--index", type=int, help="this explorer's index (default $RFT_EXPLORER_INDEX or 0)")
    ap.add_argument("--max-shards", type=int, help="stop after writing this many shards")
    ap.add_argument("--tokenizer", help="tokenizer directory (default model.tokenizer_path or model.path)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    env = os.environ
    try:
        config = load_explorer_config(args.config)
        index = args.index if args.index is not None else int(env.get("RFT_EXPLORER_INDEX") or 0)
        replicas = int(env.get("RFT_EXPLORER_REPLICAS") or config.explorer.replicas)
        endpoints = [e.strip() for e in (args.endpoints or env.get("RFT_INFERENCE_ENDPOINTS", "")).split(",")
                     if e.strip()]
        if not endpoints:
            raise ValueError("no inference endpoints: set RFT_INFERENCE_ENDPOINTS or --endpoints")
        tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None
        progress = progress_from_env(env.get("RFT_JOB_NAME") or config.job.name,
                                     env.get("RFT_JOB_NAMESPACE") or config.job.namespace,
                                     config.trainer.total_steps)
        explorer = Explorer(config, endpoints, index, replicas, progress=progress, tokenizer=tokenizer)
    except ValueError as e:  # ConfigError included: a restart cannot fix these
        log.error("%s", e)
        return EX_CONFIG

    def on_signal(signum: int, frame: Any) -> None:
        log.info("signal %d: stopping after the current step", signum)
        explorer.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    explorer.metrics.serve()
    explorer.tracker = build_tracker(config, role=explorer_role(index, replicas))
    try:
        written = explorer.run(max_shards=args.max_shards)
    finally:
        if explorer.tracker is not None:
            # The operator stops the explorers once the job succeeds, maybe before they saw
            # the trainer's last step: their runs end FINISHED all the same.
            explorer.tracker.close(finished=explorer.finished or explorer.trainer_done(),
                                   timeout=TRACKER_CLOSE_SECONDS)
    log.info(json.dumps({"event": "explorer_exit", "shards_written": written,
                         "trainer_finished": explorer.finished, **dataclasses.asdict(explorer.state)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
