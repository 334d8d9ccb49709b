"""Prometheus /metrics of the job's own pods: the trainer (rank 0), the sync agent of each
inference pod and each explorer.

Each program serves its own registry (`PodMetrics.serve`) on port 9400, named `metrics` in
the pod spec (`RFT_METRICS_PORT` overrides it, `0` turns it off). A port that is taken is
logged, never fatal: metrics are not worth a failed step or a dead replica. The operator
renders the port (rft_operator.objects.build_metrics_port) and the monitoring component's
PodMonitor scrapes it, adding the pod's namespace, name, `rftjob` and `role` as target
labels, so the series here carry no job or pod labels of their own.

The per-program sets below are the names dashboards and alerts may use; each has pure
`observe_*` methods that take plain numbers, so the programs stay one line per update and
the tests need no trainer, engine or server. Kept in the contract (no torch) because the
trainer, the sync agent and the explorer share code only through it.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable, Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, ProcessCollector, start_http_server

from . import staleness

log = logging.getLogger("rft_contract.podmetrics")

METRICS_PORT = 9400
METRICS_PORT_NAME = "metrics"  # the container port's name, which the PodMonitor selects
ENV_METRICS_PORT = "RFT_METRICS_PORT"
UNKNOWN_VERSION = -1  # a weights version gauge with nothing known (none loaded, a reload in flight)


def metrics_port(env: Mapping[str, str] | None = None) -> int:
    """`RFT_METRICS_PORT` if set (0: no server), else 9400. A value that is not a port is
    logged and the default used."""
    raw = (os.environ if env is None else env).get(ENV_METRICS_PORT, "").strip()
    if not raw:
        return METRICS_PORT
    try:
        port = int(raw)
        if not 0 <= port <= 65535:
            raise ValueError(raw)
        return port
    except ValueError:
        log.warning("%s=%r is not a port: serving metrics on %d", ENV_METRICS_PORT, raw, METRICS_PORT)
        return METRICS_PORT


class PodMetrics:
    """A registry of its own (process CPU, memory and open files included), and the server
    that exposes it."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        self.server = None

    def serve(self, port: int | None = None, addr: str = "0.0.0.0") -> int | None:
        """Serve /metrics from a daemon thread on `port` (None: `metrics_port()`). Returns
        the port, or None when turned off or the port is taken (logged)."""
        port = metrics_port() if port is None else port
        if port == 0:
            log.info("pod metrics off (%s=0)", ENV_METRICS_PORT)
            return None
        try:
            self.server, _ = start_http_server(port, addr=addr, registry=self.registry)
        except OSError as e:
            log.warning("pod metrics off: cannot listen on %s:%d (%s)", addr, port, e)
            return None
        log.info("serving metrics on %s:%d/metrics", addr, port)
        return port

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    def _gauge(self, name: str, doc: str, labels: Sequence[str] = ()) -> Gauge:
        return Gauge(name, doc, labels, registry=self.registry)

    def _counter(self, name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
        return Counter(name, doc, labels, registry=self.registry)


def _number(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


# ------------------------------------------------------------------ the trainer (rank 0)

# Trainer metrics with a gauge of their own besides rft_trainer_metric{name}.
THROUGHPUT_METRIC = "perf/throughput"  # tokens (prompt + response) per second per rank
STEP_SECONDS_METRIC = "time/step"


EVAL_METRIC_PREFIX = "eval/"  # spec.evaluation's tracker metrics (rft_rollout.evaluator.metrics_of)


class TrainerMetrics(PodMetrics):
    def __init__(self) -> None:
        super().__init__()
        g, c = self._gauge, self._counter
        self.step = g("rft_trainer_step", "Last finished training step.")
        self.total_steps = g("rft_trainer_total_steps", "trainer.totalSteps of the job.")
        self.attempt = g("rft_trainer_attempt", "Gang attempt this trainer belongs to.")
        self.last_step_time = g("rft_trainer_last_step_timestamp_seconds", "Unix time the last step finished.")
        self.metric = g("rft_trainer_metric", "Every numeric per-step metric of the last step, by its name "
                        "(actor/pg_loss, response_length/mean, time/step, ...: the JSON lines' names).", ["name"])
        self.tokens_per_second = g("rft_trainer_throughput_tokens_per_second",
                                   "Tokens per second per rank in the last step (perf/throughput).")
        self.step_seconds = g("rft_trainer_step_seconds", "Seconds the last step took (time/step).")
        self.buffer_samples = g("rft_trainer_buffer_samples", "Samples trained on so far (the job's, "
                                "restored from the checkpoint).")
        self.buffer_dropped_stale = g("rft_trainer_buffer_dropped_stale_samples",
                                      "Samples skipped as staler than buffer.maxStaleness so far "
                                      "(pending ones included).")
        self.buffer_consumed = g("rft_trainer_buffer_consumed_samples",
                                 "Samples trained or dropped per explorer stream.", ["stream"])
        self.samples = c("rft_trainer_samples", "Samples by version lag (the trainer's version minus the "
                         "one that generated them; 8plus for 8 and more) and outcome: trained, corrected (under "
                         "rollout IS weights), masked (every token rejected) or dropped (staler than "
                         "buffer.maxStaleness).", ["lag", "outcome"])
        self.checkpoint_step = g("rft_trainer_checkpoint_step", "Step of the last committed checkpoint.")
        self.checkpoint_seconds = g("rft_trainer_checkpoint_seconds",
                                    "Staging plus upload seconds of the last committed checkpoint.")
        self.checkpoint_bytes = g("rft_trainer_checkpoint_bytes", "Size of the last committed checkpoint.")
        self.checkpoint_time = g("rft_trainer_checkpoint_timestamp_seconds", "Unix time of the last commit.")
        self.weights_version = g("rft_trainer_weights_version", "Step of the last exported weights.")
        self.weights_seconds = g("rft_trainer_weights_export_seconds", "Seconds the last weights export took.")
        self.weights_bytes = g("rft_trainer_weights_bytes", "Size of the last weights export.")
        self.eval_accuracy = g("rft_trainer_eval_accuracy", "spec.evaluation: the last version scored's "
                               "accuracy (mean reward on the held-out taskset).")
        self.eval_pass_at_k = g("rft_trainer_eval_pass_at_k", "spec.evaluation: the last version scored's "
                                "pass@k, by k.", ["k"])
        self.eval_version = g("rft_trainer_eval_version", "spec.evaluation: the last version scored.")
        self.eval_best_accuracy = g("rft_trainer_eval_best_accuracy", "spec.evaluation: the best accuracy so far.")
        self.eval_best_version = g("rft_trainer_eval_best_version", "spec.evaluation: the version that scored it.")
        self.eval_seconds = g("rft_trainer_eval_seconds", "spec.evaluation: seconds the last evaluation took.")
        self.evaluations = c("rft_trainer_evaluations", "spec.evaluation: evaluations by result, scored or "
                             "skipped (not scored within timeoutSeconds).", ["result"])
        self.uploaded = c("rft_trainer_uploaded_bytes", "Bytes this trainer wrote to storage, by what: "
                          "checkpoint or weights.", ["kind"])

    def observe_job(self, attempt: int, total_steps: int) -> None:
        self.attempt.set(attempt)
        self.total_steps.set(total_steps)

    def observe_step(self, step: int, metrics: Mapping[str, object], now: Callable[[], float] = time.time) -> None:
        self.step.set(step)
        self.last_step_time.set(now())
        for name, value in metrics.items():
            # Per-lag counts have their counter; scores their rft_trainer_eval_* gauges.
            if (v := _number(value)) is not None and not staleness.is_count_metric(name) and \
                    not name.startswith(EVAL_METRIC_PREFIX):
                self.metric.labels(name).set(v)
        if (v := _number(metrics.get(THROUGHPUT_METRIC))) is not None:
            self.tokens_per_second.set(v)
        if (v := _number(metrics.get(STEP_SECONDS_METRIC))) is not None:
            self.step_seconds.set(v)

    def observe_buffer(self, consumed: Mapping[str, int] | None, dropped_stale: int, samples: int) -> None:
        self.buffer_dropped_stale.set(dropped_stale)
        self.buffer_samples.set(samples)
        for stream, count in (consumed or {}).items():
            self.buffer_consumed.labels(stream).set(count)

    def observe_samples(self, counts: Mapping[tuple[str, str], int]) -> None:
        """One step's samples, {(lag label, outcome): n} (rft_contract.staleness)."""
        for (lag, outcome), n in counts.items():
            self.samples.labels(lag, outcome).inc(n)

    def observe_evaluation(self, version: int | None, result: Any, best: Mapping[str, Any] | None,
                           skipped: bool = False, seconds: float | None = None) -> None:
        """One evaluation's end: `result` (rft_rollout.evaluation.EvalResult) or none."""
        if result is None:
            if skipped:
                self.evaluations.labels("skipped").inc()
            return
        self.evaluations.labels("scored").inc()
        self.eval_accuracy.set(result.mean_reward)
        self.eval_version.set(version)
        for k, v in result.pass_at_k.items():
            self.eval_pass_at_k.labels(str(k)).set(v)
        if seconds is not None:
            self.eval_seconds.set(seconds)
        if best:
            self.eval_best_accuracy.set(best["accuracy"])
            self.eval_best_version.set(best["version"])

    def observe_checkpoint(self, step: int, size: int | None, seconds: float | None,
                           now: Callable[[], float] = time.time) -> None:
        self.checkpoint_step.set(step)
        self.checkpoint_time.set(now())
        if seconds is not None:
            self.checkpoint_seconds.set(seconds)
        if size is not None:
            self.checkpoint_bytes.set(size)
            self.uploaded.labels("checkpoint").inc(size)

    def observe_weights(self, version: int, size: int | None, seconds: float) -> None:
        self.weights_version.set(version)
        self.weights_seconds.set(seconds)
        if size is not None:
            self.weights_bytes.set(size)
            self.uploaded.labels("weights").inc(size)


# ------------------------------------------------------------------ the sync agent

SYNC_PHASES = ("download", "verify", "reload")  # status.weightSync.replicas[pod].<phase>Seconds


class SyncAgentMetrics(PodMetrics):
    def __init__(self) -> None:
        super().__init__()
        g, c = self._gauge, self._counter
        self.served_version = g("rft_sync_agent_served_version", "Weights version the engine reports serving "
                                f"({UNKNOWN_VERSION}: none of ours, unknown, or a reload in flight).")
        self.target_version = g("rft_sync_agent_target_version", "status.weightSync.target.version "
                                f"({UNKNOWN_VERSION}: no target yet).")
        self.last_sync_seconds = g("rft_sync_agent_last_sync_seconds",
                                   "Seconds the last successful sync took, fetch to confirmed reload (loadSeconds).")
        self.last_sync_phase_seconds = g("rft_sync_agent_last_sync_phase_seconds",
                                         "Seconds of each phase of the last successful sync.", ["phase"])
        self.last_sync_time = g("rft_sync_agent_last_sync_timestamp_seconds", "Unix time of the last successful sync.")
        self.syncs = c("rft_sync_agent_syncs", "Versions loaded into the engine.")
        self.failures = c("rft_sync_agent_sync_failures", "Failed sync attempts (each retried with backoff).")
        self.fetched = c("rft_sync_agent_fetched_bytes", "Weight bytes fetched, by source: s3 or peer.", ["source"])
        for phase in SYNC_PHASES:
            self.last_sync_phase_seconds.labels(phase)
        for source in ("s3", "peer"):
            self.fetched.labels(source)
        self.observe_versions(None, None)

    def observe_versions(self, target: int | None, served: int | None) -> None:
        self.target_version.set(UNKNOWN_VERSION if target is None else target)
        self.served_version.set(UNKNOWN_VERSION if served is None else served)

    def observe_sync(self, times: Mapping[str, float], s3_bytes: int, peer_bytes: int,
                     now: Callable[[], float] = time.time) -> None:
        self.syncs.inc()
        self.last_sync_time.set(now())
        if "loadSeconds" in times:
            self.last_sync_seconds.set(times["loadSeconds"])
        for phase in SYNC_PHASES:
            if f"{phase}Seconds" in times:
                self.last_sync_phase_seconds.labels(phase).set(times[f"{phase}Seconds"])
        self.fetched.labels("s3").inc(s3_bytes)
        self.fetched.labels("peer").inc(peer_bytes)

    def observe_failure(self) -> None:
        self.failures.inc()


# ------------------------------------------------------------------ the explorer

DROP_REASONS = ("straddled", "unversioned")  # rft_rollout.rollouts' STRADDLED, UNVERSIONED


class ExplorerMetrics(PodMetrics):
    def __init__(self) -> None:
        super().__init__()
        g, c = self._gauge, self._counter
        self.shards = c("rft_explorer_shards_written", "Experience shards committed to the buffer.")
        self.samples = c("rft_explorer_samples_written", "Scored rollouts (experiences) committed to the buffer.")
        self.policy_version = g("rft_explorer_policy_version", "Weights versions the last shard's samples were "
                                "generated with (bound: min or max).", ["bound"])
        self.trainer_step = g("rft_explorer_trainer_step", "The trainer's step as last read from the job's "
                              "status: the newest policy version.")
        self.staleness = g("rft_explorer_staleness_versions", "Trainer step minus the oldest version in the "
                           "last shard, when it was written.")
        self.reward_mean = g("rft_explorer_reward_mean", "Mean reward of the last shard's samples.")
        self.shard_seconds = g("rft_explorer_last_shard_seconds", "Seconds the last shard took to generate.")
        self.shard_time = g("rft_explorer_last_shard_timestamp_seconds", "Unix time of the last shard.")
        self.waiting = g("rft_explorer_waiting", "1 while throttled: ahead of the trainer.")
        self.request_failures = c("rft_explorer_request_failures", "Failed inference requests (retried on "
                                  "another replica).")
        self.rejected = c("rft_explorer_tasks_rejected", "Tasks the inference server rejected (skipped).")
        self.dropped = c("rft_explorer_dropped_samples", "Samples left out, by reason: straddled (a reload "
                         "during the request) or unversioned (no weights version known).", ["reason"])
        for reason in DROP_REASONS:
            self.dropped.labels(reason)
        self._failures_seen = 0
        self.last_trainer_step: int | None = None  # unknown until the job's status is read

    def observe_trainer(self, step: int) -> None:
        self.last_trainer_step = step
        self.trainer_step.set(step)

    def observe_request_failures(self, total: int) -> None:
        """`total`: the client's running count (the counter follows it)."""
        if total > self._failures_seen:
            self.request_failures.inc(total - self._failures_seen)
        self._failures_seen = total

    def observe_shard(self, num_samples: int, versions: Sequence[int], reward_mean: float, seconds: float,
                      dropped: Mapping[str, int], now: Callable[[], float] = time.time) -> None:
        self.shards.inc()
        self.samples.inc(num_samples)
        if versions:
            low, high = min(versions), max(versions)
            self.policy_version.labels("min").set(low)
            self.policy_version.labels("max").set(high)
            if self.last_trainer_step is not None:
                self.staleness.set(self.last_trainer_step - low)
        self.reward_mean.set(reward_mean)
        self.shard_seconds.set(seconds)
        self.shard_time.set(now())
        for reason, count in dropped.items():
            if count:
                self.dropped.labels(reason).inc(count)
