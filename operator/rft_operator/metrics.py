"""Prometheus metrics of the operator.

Counters and the reconcile histogram are updated by the controller as it works. Job-level
gauges are not: they are computed at scrape time from the last body the controller saw of
each job (`observe_job`), so every job is counted in exactly one phase, and a deleted job's
series vanish with it instead of lingering at their last value.

Each `OperatorMetrics` has its own registry (tests stay hermetic); `serve` exposes the
running controller's over HTTP, with the process collectors (memory, CPU, open files).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client import GCCollector, PlatformCollector, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from rft_contract import names
from rft_contract.spec import CheckpointSpec, FailurePolicy, SyncSpec
from rft_contract.times import parse_time

log = logging.getLogger("rft_operator")
Key = tuple[str, str]  # (namespace, name)

# A reconcile is CPU work plus a few API writes: milliseconds, seconds when the server is slow.
DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class WriteCounts(Protocol):
    """What `kube.Kube` counts about its API calls (all of them are writes)."""

    requests: int
    seconds: float


@dataclass(frozen=True)
class JobSample:
    """What the gauges report about one RFTJob, taken from its status (and the few spec
    fields an alert compares the status with: the restart budget, the checkpoint interval)."""

    phase: str
    restarts: int
    step: int | None = None
    lag_steps: int | None = None
    synced_replicas: int | None = None
    desired_replicas: int | None = None
    max_restarts: int | None = None
    checkpoint_interval: int | None = None
    last_checkpoint_step: int | None = None
    last_checkpoint_time: float | None = None  # Unix seconds
    progress_since: float | None = None  # Unix seconds
    sync_interval: int | None = None
    conditions: tuple[tuple[str, str, str], ...] = ()  # (type, status, reason)


def compute_job_sample(body: dict[str, Any]) -> JobSample:
    """A job the operator has not written a status for yet counts as Pending. Spec fields
    left out take the contract's defaults (what the operator applies)."""
    spec, st = body.get("spec") or {}, body.get("status") or {}
    ws, trainer = st.get("weightSync") or {}, st.get("trainer") or {}
    ckpt = trainer.get("lastCheckpoint") or {}
    ckpt_time = parse_time(ckpt.get("time"))
    since = parse_time((st.get("progress") or {}).get("since"))
    return JobSample(
        phase=st.get("phase") or names.PENDING,
        restarts=int(st.get("restarts") or 0),
        step=trainer.get("step"),
        lag_steps=ws.get("lagSteps"),
        synced_replicas=ws.get("syncedReplicas"),
        desired_replicas=ws.get("desiredReplicas"),
        max_restarts=_spec_int(spec, "failurePolicy", "maxRestarts", FailurePolicy, "max_restarts"),
        checkpoint_interval=_spec_int(spec, "checkpoint", "interval", CheckpointSpec, "interval"),
        last_checkpoint_step=ckpt.get("step"),
        last_checkpoint_time=ckpt_time.timestamp() if ckpt_time else None,
        progress_since=since.timestamp() if since else None,
        sync_interval=_spec_int(spec, "sync", "interval", SyncSpec, "interval"),
        conditions=tuple((c.get("type") or "", c.get("status") or "", c.get("reason") or "")
                         for c in st.get("conditions") or () if c.get("type")),
    )


def _spec_int(spec: dict[str, Any], section: str, field: str, model: type, attr: str) -> int | None:
    value = (spec.get(section) or {}).get(field)
    if value is None:
        value = model.model_fields[attr].default
    try:
        return int(value)
    except (TypeError, ValueError):
        return None  # the admission rules refuse this; a gauge is not the place to say so


class OperatorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.reconciles = Counter("rftjob_reconciles", "Reconcile passes (reconcile + apply).", registry=r)
        self.reconcile_errors = Counter(
            "rftjob_reconcile_errors", "Reconcile passes that raised (the key is retried with backoff).",
            registry=r)
        self.reconcile_seconds = Histogram(
            "rftjob_reconcile_duration_seconds", "Time of one reconcile pass, API writes included.",
            buckets=DURATION_BUCKETS, registry=r)
        self._jobs: dict[Key, JobSample] = {}
        self._lock = threading.Lock()  # scrapes run in the HTTP server's thread
        self._writes: WriteCounts | None = None
        r.register(self)

    def track_writes(self, kube: WriteCounts) -> None:
        """Export the API client's own call counters (read at scrape time)."""
        self._writes = kube

    def observe_job(self, key: Key, body: dict[str, Any] | None) -> None:
        """Record the job's current status; `None` (deleted) forgets it."""
        with self._lock:
            if body is None:
                self._jobs.pop(key, None)
            else:
                self._jobs[key] = compute_job_sample(body)

    # ------------------------------------------------------------ scrape time

    def describe(self) -> list[Metric]:
        return []  # names vary with what is observed; nothing to check for clashes

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            jobs = sorted(self._jobs.items())
        yield from _job_metrics(jobs)
        if self._writes is not None:
            yield CounterMetricFamily("rftjob_api_writes", "Kubernetes API write calls made.",
                                      value=self._writes.requests)
            yield CounterMetricFamily("rftjob_api_write_seconds", "Seconds spent waiting on API writes.",
                                      value=self._writes.seconds)


def _job_metrics(jobs: list[tuple[Key, JobSample]]) -> Iterator[Metric]:
    per_phase = dict.fromkeys(names.PHASES, 0)  # every phase, so a job leaving one shows a 0
    for _, s in jobs:
        per_phase[s.phase] = per_phase.get(s.phase, 0) + 1
    phases = GaugeMetricFamily("rftjob_jobs", "RFTJobs by status.phase.", labels=["phase"])
    for phase, n in per_phase.items():
        phases.add_metric([phase], n)
    yield phases

    job = ["namespace", "job"]
    gauge = {name: GaugeMetricFamily(name, doc, labels=job) for name, doc in JOB_GAUGES.items()}
    phase = GaugeMetricFamily("rftjob_job_phase", "1 for the status.phase of each RFTJob, 0 for the others.",
                              labels=[*job, "phase"])
    replicas = GaugeMetricFamily("rftjob_weight_sync_replicas",
                                 "Inference replicas serving the target weights (synced) and in total (desired).",
                                 labels=[*job, "state"])
    condition = GaugeMetricFamily("rftjob_job_condition",
                                  "1 for each of the RFTJob's status.conditions, with its status and reason.",
                                  labels=[*job, "type", "status", "reason"])
    for (ns, name), s in jobs:
        for p in per_phase:
            phase.add_metric([ns, name, p], 1 if p == s.phase else 0)
        for metric, value in _job_values(s).items():
            if value is not None:
                gauge[metric].add_metric([ns, name], value)
        if s.synced_replicas is not None:
            replicas.add_metric([ns, name, "synced"], s.synced_replicas)
        if s.desired_replicas is not None:
            replicas.add_metric([ns, name, "desired"], s.desired_replicas)
        for ctype, cstatus, reason in s.conditions:
            condition.add_metric([ns, name, ctype, cstatus, reason], 1)
    yield from (phase, *gauge.values(), replicas, condition)


# One series per job each (none while the value is unknown); the alert rules in
# manifests/monitoring/prometheusrule.yaml compare them.
JOB_GAUGES = {
    "rftjob_job_restarts": "status.restarts of each RFTJob.",
    "rftjob_job_max_restarts": "spec.failurePolicy.maxRestarts of each RFTJob (the restart budget).",
    "rftjob_trainer_step": "status.trainer.step of each RFTJob.",
    "rftjob_weight_sync_lag_steps":
        "Trainer step minus the oldest weights version served (status.weightSync.lagSteps).",
    "rftjob_progress_timestamp_seconds":
        "status.progress.since of each RFTJob (Unix seconds): when the trainer's step or the gang attempt "
        "last changed, the clock of the progress deadline (set while the gang runs).",
    "rftjob_weight_sync_interval_steps": "spec.sync.interval of each RFTJob: steps between weight exports.",
    "rftjob_checkpoint_interval_steps": "spec.checkpoint.interval of each RFTJob: steps between checkpoints.",
    "rftjob_last_checkpoint_step": "status.trainer.lastCheckpoint.step of each RFTJob.",
    "rftjob_last_checkpoint_timestamp_seconds": "status.trainer.lastCheckpoint.time of each RFTJob (Unix seconds).",
}


def _job_values(s: JobSample) -> dict[str, float | None]:
    return {
        "rftjob_job_restarts": s.restarts,
        "rftjob_job_max_restarts": s.max_restarts,
        "rftjob_trainer_step": s.step,
        "rftjob_weight_sync_lag_steps": s.lag_steps,
        "rftjob_progress_timestamp_seconds": s.progress_since,
        "rftjob_weight_sync_interval_steps": s.sync_interval,
        "rftjob_checkpoint_interval_steps": s.checkpoint_interval,
        "rftjob_last_checkpoint_step": s.last_checkpoint_step,
        "rftjob_last_checkpoint_timestamp_seconds": s.last_checkpoint_time,
    }


class _Current:
    """Delegates a scrape to whichever controller is running (none before startup)."""

    def __init__(self, get_metrics: Callable[[], OperatorMetrics | None]):
        self.get_metrics = get_metrics

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        m = self.get_metrics()
        if m is not None:
            yield from m.registry.collect()


def serve(port: int, get_metrics: Callable[[], OperatorMetrics | None], addr: str = "0.0.0.0") -> bool:
    """Serve /metrics on `port` from a daemon thread. A port in use is logged, not fatal:
    metrics are not worth stopping reconciliation for (and local test runs may overlap)."""
    registry = CollectorRegistry()
    for collector in (ProcessCollector, PlatformCollector, GCCollector):
        collector(registry=registry)
    registry.register(_Current(get_metrics))
    try:
        start_http_server(port, addr=addr, registry=registry)
    except OSError as e:
        log.error("metrics disabled: cannot listen on %s:%d (%s)", addr, port, e)
        return False
    log.info("serving metrics on %s:%d/metrics", addr, port)
    return True
