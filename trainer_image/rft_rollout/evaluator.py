"""spec.evaluation on trainer rank 0 (the one module of rft_rollout that rft_trainer imports:
the scorer uses the explorer's client, prompts and rewards): score exported versions on a held-out taskset through
the inference pods, in a thread of its own, so that training never waits for a score.

Which version a score belongs to is what the engine says served it, not what was asked
for: every choice of an evaluation carries its weights version (the explorer's
`InferenceClient`; the sync agent's record for engines that report none). An evaluation
counts only when every choice came from one version; one that straddled a reload is run
again. The scorer asks replica 0 (one replica: the replicas of a rolling sync serve
different versions for a while).

When: the base model (or whatever is served when the trainer starts), then each export at
least `interval` steps after the last version scored, and the final version (the trainer
waits for it at the end, at most `FINAL_WAIT_CAP_SECONDS`). A version due while the
replica still serves an older one waits for the sync; with a newer one already served, the
newer one is scored instead. A version not scored within `timeoutSeconds` is skipped.

The trainer's step loop takes the outcomes (`take`) and reports them: status.trainer.
evaluation (last, best), the trackers (`eval/accuracy`, `eval/pass@k`, `eval/version`),
and /metrics (rft_trainer_eval_*).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from rft_contract.config import ConfigError, JobConfig
from rft_contract.jobapi import get_job
from rft_contract.names import SERVED_MODEL_NAME, agent_port
from rft_contract.times import now_text
from .evaluation import EvalResult, score
from .explorer import KubeProgress, replica_versions
from .rewards import get_reward
from .rollouts import ClientError, InferenceClient, Stopped, VersionOf, load_tokenizer
from .tasksets import load_taskset

log = logging.getLogger("rft_rollout.evaluator")

# The trainer waits this long at most for the final version's score: its other ranks wait
# in a barrier meanwhile, well inside the process group's timeout (NCCL's 10 minutes).
FINAL_WAIT_CAP_SECONDS = 300.0
# Between looks at the version the replica serves, and after a failed evaluation.
POLL_SECONDS = 2.0
# Between reads of the job's spec.sync.pinnedVersion while a version is awaited.
PIN_CHECK_SECONDS = 10.0


@dataclass(frozen=True)
class Outcome:
    """One evaluation's end: `result` for `version`, or why there is none (`error`), and
    whether the version was given up (`skipped`)."""

    version: int | None
    seconds: float
    result: EvalResult | None = None
    error: str | None = None
    skipped: bool = False


class Evaluator:
    """`published(version)` after each export; `take()` the outcomes; `finish(version,
    timeout)` at the end; `stop()`."""

    def __init__(self, config: JobConfig, endpoint: str, tokenizer: Any = None,
                 tasks: list[dict[str, str]] | None = None, version_of: VersionOf | None = None,
                 last_version: int | None = None, poll_seconds: float = POLL_SECONDS,
                 pinned: Callable[[], Any] | None = None):
        if config.evaluation is None or config.explorer is None:
            raise ValueError("Evaluator needs spec.evaluation and spec.explorer")
        self.section, self.explorer = config.evaluation, config.explorer
        self.endpoint, self.version_of, self.poll_seconds = endpoint, version_of, poll_seconds
        # The job's spec.sync.pinnedVersion now (it may be set while the job runs): while it
        # is set the replicas serve that version, and a due version is skipped at once.
        self.pinned, self.pin_check_seconds = pinned, PIN_CHECK_SECONDS
        try:
            self.tasks = tasks if tasks is not None else load_taskset(self.section.taskset_uri, config.env)
        except ValueError as e:
            raise ConfigError(f"evaluation.tasksetUri: {e}") from e
        if not self.tasks:
            raise ConfigError(f"evaluation.tasksetUri: {self.section.taskset_uri} holds no tasks")
        self.reward_fn = get_reward(self.section.reward or self.explorer.reward)
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(
            config.model.tokenizer_path or config.model.path, config.env)
        self.total_steps = config.trainer.total_steps
        self.outcomes: queue.Queue[Outcome] = queue.Queue()
        self._cond = threading.Condition()
        self._stop = threading.Event()
        # The newest version due (None: none), the last one scored or skipped.
        self._wanted: int | None = None if last_version is not None else 0
        self._last: int | None = last_version
        self._ends: threading.Event | None = None  # the running evaluation's end
        self._final: int | None = None  # the version finish() waits for
        # The version being scored, or last scored: its export is kept until the trainer has
        # taken the score (it may be the new best).
        self.scoring: int | None = None
        self._thread = threading.Thread(target=self._run, name="evaluator", daemon=True)

    def start(self) -> "Evaluator":
        self._thread.start()
        return self

    def due(self, version: int) -> bool:
        return (self._last is None or version == self.total_steps
                or version - self._last >= self.section.interval)

    def published(self, version: int) -> None:
        """Version `version` was exported: score it if it is due."""
        with self._cond:
            if self.due(version) and (self._wanted is None or version > self._wanted):
                self._wanted = version
                self._cond.notify_all()

    def take(self) -> list[Outcome]:
        out = []
        while True:
            try:
                out.append(self.outcomes.get_nowait())
            except queue.Empty:
                return out

    def finish(self, version: int, timeout: float) -> bool:
        """Wait until `version` (the final one) is scored or given up, at most `timeout`
        seconds; whether it was."""
        with self._cond:
            self._final = version
            if (self._last is None or version > self._last) and (self._wanted is None or version > self._wanted):
                self._wanted = version
                self._cond.notify_all()
            return self._cond.wait_for(lambda: self._last is not None and self._last >= version
                                       or self._stop.is_set(), timeout)

    def stop(self) -> None:
        self._stop.set()
        with self._cond:
            if self._ends is not None:
                self._ends.set()
            self._cond.notify_all()

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stop.is_set() or self._wanted is not None)
                if self._stop.is_set():
                    return
                wanted = self._wanted
            outcome = self._evaluate(wanted)
            if outcome is None:  # stopped
                return
            self.outcomes.put(outcome)
            with self._cond:
                if outcome.version is not None and (self._last is None or outcome.version > self._last):
                    self._last = outcome.version
                        # A version published while the last score ran was judged against the
                # score before it: judge it again (the final one asked for by finish stays).
                if self._wanted is not None and self._last is not None and (
                        self._wanted <= self._last or not (self._wanted == self._final or self.due(self._wanted))):
                    self._wanted = None
                self._cond.notify_all()

    def _evaluate(self, wanted: int) -> Outcome | None:
        """Score `wanted` or the newer version the replica serves; None once stopped."""
        started = time.monotonic()
        ends = threading.Event()  # set at the deadline or by stop(): the client's requests end
        timer = threading.Timer(self.section.timeout_seconds, ends.set)
        timer.daemon = True
        with self._cond:
            self._ends = ends
        if self._stop.is_set():
            return None
        timer.start()
        try:
            client = InferenceClient([self.endpoint], self.explorer.request_timeout, ends, version_of=self.version_of)
            return self._attempts(client, wanted, started, ends)
        finally:
            timer.cancel()

    def _attempts(self, client: InferenceClient, wanted: int, started: float,
                  ends: threading.Event) -> Outcome | None:
        error, asked = None, float("-inf")
        while not ends.is_set():
            try:
                served = self._served(client)
                if served is None or served < wanted:  # not synced yet
                    error = None if served is not None else "the replica reports no weights version"
                    if self.pinned is not None and time.monotonic() - asked >= self.pin_check_seconds:
                        asked = time.monotonic()
                        if (pin := self.pinned()) is not None:
                            error = f"spec.sync.pinnedVersion is {pin}: the replicas serve version {served}"
                            break
                    ends.wait(self.poll_seconds)
                    continue
                self.scoring = served
                result = self._score(client)
            except Stopped:
                break
            except (ClientError, ValueError) as e:  # refused requests, a bad reward: no retry mends them
                error = f"{type(e).__name__}: {str(e)[:300]}"
                break
            except Exception as e:  # noqa: BLE001 - an evaluation never stops training
                error = f"{type(e).__name__}: {str(e)[:300]}"
                log.warning("evaluation of version %d failed (%s); trying again", wanted, error)
                ends.wait(self.poll_seconds)
                continue
            versions = {v for v in result.versions if isinstance(v, int)}
            if len(versions) == 1 and result.versions == versions:
                (version,) = versions
                log.info("evaluation: version %d accuracy %.4f %s in %.1fs", version, result.mean_reward,
                         {f"pass@{k}": round(v, 4) for k, v in result.pass_at_k.items()},
                         time.monotonic() - started)
                return Outcome(version, time.monotonic() - started, result=result)
            error = f"its choices came from versions {sorted(map(str, result.versions))} (a reload mid-way)"
        if self._stop.is_set():
            return None
        log.warning("evaluation of version %d skipped (%s)", wanted,
                    error or "the replica did not serve it within evaluation.timeoutSeconds")
        return Outcome(wanted, time.monotonic() - started, error=error, skipped=True)

    def _served(self, client: InferenceClient) -> int | None:
        """The version the replica serves now: a one-token completion's."""
        completion = client.complete({"model": SERVED_MODEL_NAME, "prompt": "0", "max_tokens": 1,
                                      "temperature": 0.0})
        versions = completion.versions or []
        return versions[0] if versions and isinstance(versions[0], int) else None

    def _score(self, client: InferenceClient) -> EvalResult:
        s = self.section

        def complete(body: dict[str, Any]) -> tuple[dict[str, Any], list | None]:
            c = client.complete(body)
            return c.response, c.versions

        return score(complete, self.tasks, self.tokenizer, self.reward_fn,
                     max_tokens=s.max_tokens or self.explorer.sampling.max_tokens, n=s.samples_per_task,
                     temperature=s.temperature, top_p=s.top_p, seed=s.seed,
                     prompt_format=self.explorer.prompt_format, ks=s.pass_at_k)


# ------------------------------------------------------------------ status


def record(outcome: Outcome, step: int, uri: str | None = None) -> dict[str, Any]:
    """A scored outcome as status.trainer.evaluation's last/best entry (camelCase); `uri`:
    where the version's weights are."""
    r = outcome.result
    assert r is not None and outcome.version is not None
    entry: dict[str, Any] = {"version": outcome.version, "uri": uri, "step": step, "accuracy": round(r.mean_reward, 6),
                             "tasks": len(r.rewards), "samples": sum(map(len, r.rewards)),
                             "seconds": round(outcome.seconds, 3), "time": now_text()}
    if r.pass_at_k:
        entry["passAtK"] = {str(k): round(v, 6) for k, v in sorted(r.pass_at_k.items())}
    return entry


def metrics_of(outcome: Outcome) -> dict[str, float]:
    """The trackers' eval/... metrics of a scored outcome (verl logs val-core/...)."""
    r = outcome.result
    assert r is not None and outcome.version is not None
    return {"eval/accuracy": r.mean_reward, "eval/version": float(outcome.version),
            **{f"eval/pass@{k}": v for k, v in sorted(r.pass_at_k.items())}}


def summary(last: Mapping[str, Any] | None, best: Mapping[str, Any] | None) -> str | None:
    """kubectl's Eval column: `0.625@v12 best 0.700@v8`."""
    if not last:
        return None
    text = f"{last['accuracy']:.3f}@v{last['version']}"
    if best and best.get("version") != last.get("version"):
        text += f" best {best['accuracy']:.3f}@v{best['version']}"
    return text


class EvaluationState:
    """status.trainer.evaluation as rank 0 keeps it: seeded from the job's status (a resumed
    attempt keeps its best), updated by each outcome."""

    def __init__(self, status: Mapping[str, Any] | None = None, up_to: int | None = None,
                 uri_of: Callable[[int], str] | None = None):
        """`up_to`: the step a resumed attempt starts at; records of later versions are
        dropped (the attempt exports those versions again, from other weights)."""
        status = dict(status or {})
        keep = lambda r: r if r and (up_to is None or r.get("version", 0) <= up_to) else None  # noqa: E731
        self.last: dict[str, Any] | None = keep(status.get("last"))
        self.best: dict[str, Any] | None = keep(status.get("best"))
        self.evaluated = int(status.get("evaluated") or 0)
        self.skipped = int(status.get("skipped") or 0)
        self.error: str | None = None
        self.uri_of = uri_of  # a version's weights URI

    @property
    def best_version(self) -> int | None:
        return self.best["version"] if self.best else None

    def update(self, outcome: Outcome, step: int) -> dict[str, Any]:
        """The status patch after `outcome`."""
        if outcome.result is not None:
            self.last = record(outcome, step, self.uri_of(outcome.version) if self.uri_of else None)
            self.evaluated += 1
            self.error = None
            if self.best is None or self.last["accuracy"] > self.best["accuracy"]:
                self.best = dict(self.last)
        else:
            self.skipped += int(outcome.skipped)
            self.error = f"version {outcome.version}: {outcome.error or 'not scored in time'}"
        return self.status()

    def status(self) -> dict[str, Any]:
        return {"last": self.last, "best": self.best, "summary": summary(self.last, self.best),
                "evaluated": self.evaluated, "skipped": self.skipped, "error": self.error}


def build_evaluator(config: JobConfig, endpoints: list[str], api: Any = None,
                    last_version: int | None = None) -> Evaluator | None:
    """The job's evaluator (None without spec.evaluation), started. `api`: the job's API
    client (rft_contract.jobapi), for the sync agents' records of engines that report no
    weights version."""
    if config.evaluation is None:
        return None
    if not endpoints:
        raise ConfigError("spec.evaluation: no inference endpoints (RFT_INFERENCE_ENDPOINTS is unset)")
    job = config.job
    progress = KubeProgress(api, job.name, job.namespace, config.trainer.total_steps) if api is not None else None
    port = agent_port(config.inference.port) if config.inference is not None else None
    version_of = replica_versions(progress, endpoints[:1], port, job=job.name)
    pinned = None
    if api is not None:
        def pinned() -> Any:
            return ((get_job(api, job.namespace, job.name).get("spec") or {}).get("sync") or {}).get("pinnedVersion")
    return Evaluator(config, endpoints[0], version_of=version_of, last_version=last_version,
                     pinned=pinned).start()
