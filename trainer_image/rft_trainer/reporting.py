"""Rank 0 reports progress into its RFTJob's status (`status.trainer`), with the per-job
identity the operator created (a Role allowing `get`/`patch` on this job's status only).

Reporting must never slow or crash training: patches go out from a background thread,
step updates are coalesced and rate-limited, failures are retried with backoff and then
logged. Outside a cluster (no RFT_JOB_NAME/RFT_JOB_NAMESPACE, or no credentials) the
reporter is a no-op.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from rft_contract.jobapi import describe, job_api, merge, now, patch_status

log = logging.getLogger("rft_trainer.reporting")

# A handful of metrics is enough for `kubectl describe`; the full set goes to the logs.
SUMMARY_KEYS = ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "critic/rewards/mean",
                "critic/vf_loss", "response_length/mean", "perf/throughput")


class StatusReporter:
    def __init__(self, name: str | None, namespace: str | None, api=None,
                 min_interval: float = 10.0, retries: int = 5):
        self.name, self.namespace, self.api = name, namespace, api
        self.min_interval, self.retries = min_interval, retries
        self._pending: dict[str, Any] = {}
        self._urgent = False
        self._cond = threading.Condition()
        self._closed = False
        self._last_sent = 0.0
        self.sent = 0
        self.failures = 0
        self._thread = None
        # Which gang attempt is reporting: a resumed attempt's steps are told apart.
        self.attempt = int(os.environ.get("RFT_ATTEMPT", "0") or 0) or None
        if self.enabled:
            self._thread = threading.Thread(target=self._run, name="rft-status", daemon=True)
            self._thread.start()

    @classmethod
    def from_env(cls, **kw) -> "StatusReporter":
        name, ns = os.environ.get("RFT_JOB_NAME"), os.environ.get("RFT_JOB_NAMESPACE")
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
        summary = {k.replace("/", "_"): round(float(v), 6) for k, v in (metrics or {}).items()
                   if k in SUMMARY_KEYS}
        patch = {"step": step, "totalSteps": total, "progress": f"{step}/{total}",
                 "metrics": summary, "updated": now()}
        if self.attempt is not None:
            patch["attempt"] = self.attempt
        self._submit(patch, urgent=step >= total or not metrics)

    def report_checkpoint(self, step: int, uri: str, nbytes: int, save_seconds: float) -> None:
        self._submit({"lastCheckpoint": {"step": step, "uri": uri, "time": now(), "bytes": nbytes,
                                         "saveSeconds": round(save_seconds, 3)}}, urgent=True)

    def report_weights(self, version: int, uri: str, export_id: str | None = None,
                       versions: list[int] | None = None) -> None:
        """A committed weights export; `versions` are all retained committed versions
        (the operator checks a pinned version against them)."""
        patch: dict[str, Any] = {"latestWeights": {"version": version, "uri": uri, "time": now(),
                                                   "id": export_id}}
        if versions is not None:
            patch["weightVersions"] = sorted(versions)
        self._submit(patch, urgent=True)

    # ------------------------------------------------------------ delivery

    def _submit(self, trainer_patch: dict, urgent: bool) -> None:
        if not self.enabled:
            return
        with self._cond:
            merge(self._pending, trainer_patch)
            self._urgent = self._urgent or urgent
            self._cond.notify()

    def close(self, timeout: float = 10.0) -> None:
        """Flush what is pending (bounded by `timeout`) and stop the thread."""
        if not self._thread:
            return
        with self._cond:
            self._closed = True
            self._urgent = True
            self._cond.notify()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if not self._pending and self._closed:
                    return
                wait = self.min_interval - (time.monotonic() - self._last_sent)
                if not self._urgent and wait > 0:
                    self._cond.wait(wait)  # coalesce step updates; urgent ones wake us
                    if not self._urgent and self.min_interval - (time.monotonic() - self._last_sent) > 0:
                        continue
                patch, self._pending, self._urgent = self._pending, {}, False
            self._send(patch)

    def _send(self, trainer_patch: dict) -> None:
        for attempt in range(self.retries):
            try:
                patch_status(self.api, self.namespace, self.name, {"trainer": trainer_patch})
                self.sent += 1
                self._last_sent = time.monotonic()
                return
            except Exception as e:  # noqa: BLE001 - never let reporting crash training
                self.failures += 1
                delay = min(30.0, 0.5 * 2 ** attempt)
                log.warning("status patch failed (%s); retry %d/%d in %.1fs",
                            describe(e), attempt + 1, self.retries, delay)
                time.sleep(delay)
        log.error("giving up on a status update after %d attempts", self.retries)

