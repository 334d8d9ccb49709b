"""Rank 0 reports progress into its RFTJob's status (`status.trainer`), with the per-job
identity the operator created (a Role allowing `get`/`patch` on this job's status only).

Reporting must never slow or crash training, and must never lose the newest status:
the operator promotes `latestWeights` to the inference pods, so a dropped final write
leaves them serving old weights. So:

* `report_*` only merge into one pending status under a lock and return; a daemon
  thread sends it. Step and buffer updates are coalesced (at most one patch per
  `min_interval`); checkpoints, weights, waiting and the last step go out at once.
* A failed patch is merged back under whatever was reported since (newer values win)
  and retried with capped exponential backoff until it lands. Nothing is dropped.
* `close()` flushes within the pod's termination grace period, and names in an error
  log what it could not deliver.

Outside a cluster (no RFT_JOB_NAME/RFT_JOB_NAMESPACE, or no credentials) the reporter
is a no-op.
"""

from __future__ import annotations

import copy
import logging
import os
import random
import threading
import time
from typing import Any, Callable

from rft_contract import names
from rft_contract.jobapi import describe, job_api, merge, now, patch_status

log = logging.getLogger("rft_trainer.reporting")

# A handful of metrics is enough for `kubectl describe`; the full set goes to the logs.
SUMMARY_KEYS = ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "critic/rewards/mean",
                "critic/vf_loss", "response_length/mean", "perf/throughput")

BACKOFF_CAP_SECONDS = 10.0
FAILING_LOG_EVERY_SECONDS = 60.0
DEFAULT_GRACE_SECONDS = 30.0  # Kubernetes' default terminationGracePeriodSeconds


def backoff_delay(failures: int, base: float = 0.5, cap: float = BACKOFF_CAP_SECONDS) -> float:
    """Seconds before retry number `failures` (1, 2, ...): 0.5, 1, 2, 4, 8, 10, 10, ...,
    each scaled by a random factor in [0.5, 1] so restarted pods do not retry in step."""
    return min(cap, base * 2 ** min(failures - 1, 16)) * random.uniform(0.5, 1.0)


def compute_flush_timeout(env: dict[str, str] | None = None) -> float:
    """How long `close()` retries the last status: half the pod's termination grace
    period (at most grace - 10 s, so the process still exits in time), at least 10 s."""
    env = os.environ if env is None else env
    try:
        grace = float(env.get(names.ENV_GRACE_SECONDS) or DEFAULT_GRACE_SECONDS)
    except ValueError:
        grace = DEFAULT_GRACE_SECONDS
    return max(10.0, min(grace * 0.5, grace - 10.0))


def describe_status(trainer: dict) -> str:
    """What a `status.trainer` patch carries, for logs: its keys and the numbers that
    matter (step, weights version, checkpoint step); never URIs' credentials or bodies."""
    parts = [f"keys {','.join(sorted(trainer))}"]
    if "step" in trainer:
        parts.append(f"step {trainer['step']}/{trainer.get('totalSteps', '?')}")
    if isinstance(trainer.get("latestWeights"), dict):
        parts.append(f"latestWeights version {trainer['latestWeights'].get('version')}")
    if "weightVersions" in trainer:
        parts.append(f"weightVersions {trainer['weightVersions']}")
    if isinstance(trainer.get("lastCheckpoint"), dict):
        parts.append(f"lastCheckpoint step {trainer['lastCheckpoint'].get('step')}")
    if isinstance(trainer.get("buffer"), dict) and "samples" in trainer["buffer"]:
        parts.append(f"buffer samples {trainer['buffer']['samples']}")
    if "waiting" in trainer:
        waiting = trainer["waiting"]
        parts.append(f"waiting {waiting.get('reason')}" if isinstance(waiting, dict) else "waiting cleared")
    return "; ".join(parts)


class StatusReporter:
    """`backoff(failures) -> seconds` and `clock` are injectable so tests run fast."""

    def __init__(self, name: str | None, namespace: str | None, api=None,
                 min_interval: float = 10.0,
                 backoff: Callable[[int], float] = backoff_delay,
                 clock: Callable[[], float] = time.monotonic):
        self.name, self.namespace, self.api = name, namespace, api
        self.min_interval, self.backoff, self.clock = min_interval, backoff, clock
        self._cond = threading.Condition()
        self._pending: dict[str, Any] = {}  # everything reported and not yet acknowledged
        self._inflight: dict[str, Any] | None = None
        self._urgent = False
        self._closed = False  # close() called: send what is pending, then stop
        self._kick = False  # close() cuts a backoff wait short once
        self._abandoned = False  # close() timed out: the thread stops
        # A `waiting` may be in the status since the last clear; True at start, so the first
        # step of a new attempt clears one an earlier attempt left.
        self._waiting_reported = True
        self._last_sent = float("-inf")
        # Outage bookkeeping, for the logs.
        self._down_since: float | None = None
        self._down_failures = 0
        self._num_unsent = 0  # reports merged into `_pending`
        self._last_error = ""
        self._last_failure_log = 0.0
        self.sent = 0
        self.failures = 0
        self._thread = None
        # Which gang attempt is reporting: a resumed attempt's steps are told apart.
        self.attempt = int(os.environ.get(names.ENV_ATTEMPT, "0") or 0) or None
        if self.enabled:
            self._thread = threading.Thread(target=self._run, name="rft-status", daemon=True)
            self._thread.start()

    @classmethod
    def from_env(cls, **kw) -> "StatusReporter":
        name, ns = os.environ.get(names.ENV_JOB_NAME), os.environ.get(names.ENV_JOB_NAMESPACE)
        if not (name and ns):
            return cls(None, None)
        try:
            api = job_api()
        except Exception as e:  # noqa: BLE001 - no credentials: reporting is off
            log.warning("status reporting off: %s", e)
            return cls(None, None)
        return cls(name, ns, api, **kw)

    @property
    def enabled(self) -> bool:
        return bool(self.name and self.namespace and self.api is not None)

    # ------------------------------------------------------------ what is reported

    def report_step(self, step: int, total: int, metrics: dict[str, float] | None = None) -> None:
        """A finished step; also clears `waiting` (the trainer is stepping again)."""
        summary = {k.replace("/", "_"): round(float(v), 6) for k, v in (metrics or {}).items()
                   if k in SUMMARY_KEYS}
        patch: dict[str, Any] = {"step": step, "totalSteps": total, "progress": f"{step}/{total}",
                                 "metrics": summary, "updated": now()}
        if self.attempt is not None:
            patch["attempt"] = self.attempt
        self._submit(patch, urgent=step >= total or not metrics, clear_waiting=True)

    def report_resumed(self, step: int, checkpoint: str | None) -> None:
        """Where this attempt starts: the committed checkpoint it resumed from, or step 0
        without one. The operator keeps it in the job's attempt history."""
        self._submit({"resumedFrom": {"attempt": self.attempt, "step": step, "checkpoint": checkpoint,
                                      "time": now()}}, urgent=True)

    def report_checkpoint(self, step: int, uri: str, nbytes: int, save_seconds: float) -> None:
        self._submit({"lastCheckpoint": {"step": step, "uri": uri, "time": now(), "bytes": nbytes,
                                         "saveSeconds": round(save_seconds, 3)}}, urgent=True)

    def report_weights(self, version: int, uri: str, export_id: str | None = None,
                       versions: list[int] | None = None, peer: str | None = None,
                       manifest: str | None = None) -> None:
        """A weights export: committed, or on the fast path (`peer`, `manifest`: the
        trainer's weights server and the manifest's digest) announced before its upload
        ends, then reported again once committed. `versions` are all retained committed
        versions (the operator checks a pinned version against them)."""
        patch: dict[str, Any] = {"latestWeights": {"version": version, "uri": uri, "time": now(),
                                                   "id": export_id, "peer": peer, "manifest": manifest}}
        if versions is not None:
            patch["weightVersions"] = sorted(versions)
        self._submit(patch, urgent=True)

    def report_merged(self, step: int, uri: str, export_id: str | None) -> None:
        """The final policy with its adapters merged (a LoRA job's last export)."""
        self._submit({"mergedWeights": {"version": step, "uri": uri, "time": now(), "id": export_id}}, urgent=True)

    def report_evaluation(self, evaluation: dict) -> None:
        """status.trainer.evaluation (spec.evaluation): last, best, summary, counts."""
        self._submit({"evaluation": evaluation}, urgent=True)

    def report_buffer(self, consumed: dict[str, int], dropped_stale: int, samples: int) -> None:
        """What the trainer took from the buffer (explorers throttle on it); coalesced."""
        self._submit({"buffer": {"consumed": dict(consumed), "droppedStale": dropped_stale,
                                 "samples": samples}}, urgent=False)

    def report_waiting(self, reason: str, message: str, since: str, seconds: float) -> None:
        """Why the trainer is not stepping (names.WAIT_*); the next report_step clears it."""
        waiting: dict[str, Any] = {"reason": reason, "message": message, "since": since,
                                   "seconds": round(float(seconds), 1)}
        if self.attempt is not None:  # `attempt` beside `step` names the step's reporter
            waiting["attempt"] = self.attempt
        self._submit({"waiting": waiting}, urgent=True)

    def report_tracking(self, tracking: dict) -> None:
        """How each experiment tracker fares (`{backend: state}`, from the tracker's threads);
        coalesced like steps."""
        self._submit({"tracking": tracking}, urgent=False)

    # ------------------------------------------------------------ delivery

    def _submit(self, trainer_patch: dict, urgent: bool, clear_waiting: bool = False) -> None:
        if not self.enabled:
            return
        # A copy: the sender merges into it while the caller may change its own dicts.
        trainer_patch = copy.deepcopy(trainer_patch)
        with self._cond:
            if self._closed:
                return
            if "waiting" in trainer_patch:
                self._waiting_reported = True
            elif clear_waiting and self._waiting_reported:
                trainer_patch["waiting"] = None  # a merge-patch null deletes the key
                self._waiting_reported = False
            merge(self._pending, trainer_patch)
            self._urgent = self._urgent or urgent
            self._num_unsent += 1
            self._cond.notify_all()

    def close(self, timeout: float | None = None) -> None:
        """Flush what is pending, retrying until it lands or `timeout` passes (default:
        `compute_flush_timeout()`, within the pod's grace period); then stop the thread.
        Whatever could not be delivered is named in an error log."""
        if not self._thread or self._abandoned:
            return
        timeout = compute_flush_timeout() if timeout is None else timeout
        with self._cond:
            self._closed = self._kick = True
            self._cond.notify_all()
        self._thread.join(timeout)
        with self._cond:
            self._abandoned = True
            self._cond.notify_all()
            hung = self._inflight is not None
            lost = merge(copy.deepcopy(self._inflight or {}), self._pending)
        if lost:
            down = self.clock() - self._down_since if self._down_since is not None else 0.0
            log.error("status NOT delivered: gave up after %.0fs at exit (%d failed attempts over "
                      "%.0fs, last error %s%s); the operator will not see status.trainer %s",
                      timeout, self._down_failures, down, self._last_error or "none",
                      ", a request still unanswered" if hung else "", describe_status(lost))

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._wait_until_due():
                    return
                patch, self._pending, self._urgent = self._pending, {}, False
                num_reports, self._num_unsent = self._num_unsent, 0
                self._inflight = patch
            error = self._send(patch)
            with self._cond:
                self._inflight = None
                if error is None:
                    self._on_delivered(patch, num_reports)
                    continue
                # Retry the failed content under anything reported since: newer wins.
                self._pending = merge(patch, self._pending)
                self._num_unsent += num_reports
                self._on_failed(error)
                self._cond.wait_for(lambda: self._kick or self._abandoned,
                                    self.backoff(self._down_failures))
                self._kick = False

    def _wait_until_due(self) -> bool:
        """Under the lock: wait until something is pending and due; False to stop."""
        while not self._abandoned:
            if not self._pending:
                if self._closed:
                    return False
                self._cond.wait()
                continue
            if self._urgent or self._closed or self._down_since is not None:
                return True
            wait = self.min_interval - (self.clock() - self._last_sent)
            if wait <= 0:
                return True
            self._cond.wait(wait)  # coalesce step updates; urgent ones wake us
        return False

    def _send(self, trainer_patch: dict) -> Exception | None:
        try:
            patch_status(self.api, self.namespace, self.name, {"trainer": trainer_patch})
            return None
        except Exception as e:  # noqa: BLE001 - never let reporting crash training
            return e

    def _on_delivered(self, patch: dict, num_reports: int) -> None:
        self.sent += 1
        self._last_sent = self.clock()
        if self._down_since is not None:
            log.info("status delivered again after %.0fs of failures (%d failed attempts; "
                     "%d reports merged into it)", self._last_sent - self._down_since,
                     self._down_failures, num_reports)
            self._down_since = None
            self._down_failures = 0
        if self._abandoned:
            log.info("status delivered after close() gave up on it: %s", describe_status(patch))

    def _on_failed(self, e: Exception) -> None:
        self.failures += 1
        self._down_failures += 1
        self._last_error = describe(e)
        t = self.clock()
        if self._down_since is None:
            self._down_since = self._last_failure_log = t
            log.warning("status patch failed (%s); retrying with backoff (at most %.0fs apart) "
                        "until it lands", self._last_error, BACKOFF_CAP_SECONDS)
        elif t - self._last_failure_log >= FAILING_LOG_EVERY_SECONDS:
            self._last_failure_log = t
            log.warning("status patches still failing after %.0fs (%d attempts, last error %s); "
                        "pending: %s", t - self._down_since, self._down_failures,
                        self._last_error, describe_status(self._pending))
