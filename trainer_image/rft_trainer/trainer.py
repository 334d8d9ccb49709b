"""Owns the training loop and what it runs on: the runtime, the checkpoint storage and the
checkpointer, the buffer and the status reports (Trinity-RFT's `Trainer`, on torchrun).

The engine (engine.py, reached only through `TrainEngineWrapper`) decides what a step is,
the buffer what data comes next, the checkpointer when a save is due. The loop reads on
one screen.

Every rank takes the same decisions at the same step, or the collectives hang:
- The batch: rank 0 reads the buffer (its position is the job's) and broadcasts the
  batch with the position, so every rank trains on the same samples and checkpoints the
  same position, and S3 is read once, not once per rank.
- The stop: SIGTERM reaches the pods at different moments and only sets a flag; at each
  step boundary the ranks reduce it (MAX, with the age of the first SIGTERM), so all
  leave after the same step, and rank 0 decides for all whether the final save fits the
  time the launcher leaves before it kills the workers (`stop_budget_seconds`).
"""

from __future__ import annotations

import json
import logging
import os
import random
import sys
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from rft_contract import names, staleness
from rft_contract.config import JobConfig
from rft_contract.jobapi import describe, get_job, now
from rft_contract.layout import merged_uri, weights_uri
from rft_contract.podmetrics import TrainerMetrics
from rft_contract.storage import Storage, get_storage
from rft_contract.trackers import DEFAULT_ROLLOUT_SAMPLES
from rft_rollout.evaluator import FINAL_WAIT_CAP_SECONDS, EvaluationState, Evaluator, build_evaluator, metrics_of

from .checkpoint import CheckpointManager, build_checkpointer, should_save_on_stop, step_uri
from .engine import TrainEngineWrapper, get_trainer_wrapper
from .experience import BufferReader, Experiences
from .export import FastPath, WeightExporter
from .metrics import MetricsLog
from .nccl_sender import NcclSender
from .parallelize import Runtime, init_distributed
from .reporting import StatusReporter
from .tracking import Tracker, build_tracker, describe_error

log = logging.getLogger("rft_trainer")

WAIT_REPORT_EVERY = 30.0  # seconds between status.trainer.waiting updates
WAIT_LOG_EVERY = 60.0
TRACKING_CLOSE_SECONDS = 15.0  # for the trackers' last reports at exit (a down one loses them)


def stop_budget_seconds() -> float | None:
    """Seconds a worker has after SIGTERM before it is killed: the launcher's worker-kill
    timeout (launch.py derives it from the pod's grace period) or the grace period,
    whichever is shorter (an explicit kill timeout may exceed the grace period)."""
    values = []
    for key in ("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", names.ENV_GRACE_SECONDS):
        try:
            value = float(os.environ.get(key, "") or 0)
        except ValueError:
            continue
        if value > 0:
            values.append(value)
    return min(values) if values else None


def _portable(error: Exception | None) -> Exception | None:
    """An error rank 0 met, as one every rank can raise: a ValueError (bad data) stays
    one, anything else becomes a RuntimeError naming its type (not every exception
    pickles)."""
    if error is None or isinstance(error, ValueError) and type(error) is ValueError:
        return error
    if isinstance(error, ValueError):
        return ValueError(str(error))
    return RuntimeError(f"rank 0 reading the buffer: {type(error).__name__}: {error}")


class Trainer:
    """Consume the experience and train the model.

    `build_engine(config, rt)` makes the engine once the runtime exists (default: the FSDP
    engine); the Trainer reaches it only through `TrainEngineWrapper`."""

    def __init__(self, config: JobConfig,
                 build_engine: Callable[[JobConfig, Runtime], TrainEngineWrapper] = get_trainer_wrapper):
        self.config = config
        self.build_engine = build_engine
        self.rt: Runtime | None = None  # set by prepare(), as are the three below
        self.engine: TrainEngineWrapper | None = None
        self.storage: Storage | None = None  # the checkpoint URI's: checkpoints, weights, metrics
        self.checkpointer: CheckpointManager | None = None
        self.buffer: BufferReader | None = None
        self._alive = True
        self.stop_requested = False  # this rank got SIGTERM
        self.stopping = False  # every rank agreed to stop at this step boundary
        self._stop_at = 0.0
        self._wait_marks: tuple[float | None, float | None] = (None, None)  # last wait log, report
        self.last_metrics: dict[str, Any] = {}
        self.reporter = StatusReporter(None, None)
        self.metrics_log: MetricsLog | None = None  # rank 0: per-step metrics to storage
        self.tracker: Tracker | None = None  # rank 0: spec.tracking's experiment trackers
        self.evaluator: Evaluator | None = None  # rank 0: spec.evaluation's scorer
        self.evaluation = EvaluationState()  # rank 0: status.trainer.evaluation
        self._rollouts_failed = False  # a rollouts table failed to build: logged once
        self.pod_metrics = TrainerMetrics()  # served on rank 0 only (prepare)
        self.last_synced: int | None = None
        self.fast_path: FastPath | None = None  # rank 0's weights server (export.FastPath)
        self._announced: tuple[int, dict] | None = None  # the last fast-path announcement
        self._last_weights: tuple | None = None  # the last committed version's report
        self.finished = False  # train() ended at totalSteps or a dry buffer, not by a stop
        self.ended_together = False  # train() returned (finished or an agreed stop) on every rank

    def prepare(self) -> None:
        if os.environ.get("RANK", "0") == "0":  # one writer per job: rank 0
            self.reporter = StatusReporter.from_env()
            # The model download and the resume can take long: the operator's progress
            # deadline allows for it while this says so (the first step report clears it).
            self.reporter.report_waiting(names.WAIT_PREPARING, "loading the model and resuming from the "
                                         "last checkpoint", now(), 0.0)
        self.rt = init_distributed(cpu_offload=self.config.fsdp.cpu_offload, env=self.config.env)
        self.engine = self.build_engine(self.config, self.rt)
        self.engine.prepare()
        self.storage = get_storage(self.config.checkpoint.uri, self.config.env)  # built once: an S3 client is not free
        if self.rt.is_main:
            self.metrics_log = MetricsLog(self.config.checkpoint.uri, attempt=self.config.job.attempt,
                                          storage=self.storage)
            self.tracker = build_tracker(self.config, report=self._report_tracking)
            self.pod_metrics.observe_job(self.config.job.attempt, self.config.trainer.total_steps)
            self.pod_metrics.serve()
        self.checkpointer = build_checkpointer(self.config, self.storage, self.rt, self.engine.checkpoint_roles())
        self.checkpointer.on_commit = self._report_commit
        self.checkpointer.extra_state = self.checkpoint_extra
        sync = self.config.sync
        if self.rt.is_main:  # the exporting rank serves each version while it uploads (the fast path)
            self.fast_path = FastPath.start(self.config.env)
            if self.fast_path is not None and self.config.env.weights_transport == "nccl":
                NcclSender.attach(self.fast_path, self.rt.device)  # and sends it to vLLM over NCCL
        # pinnedVersion best: the evaluator's best is kept (keep_also), whatever it is.
        pinned = sync.pinned_version if isinstance(sync.pinned_version, int) else None
        self.checkpointer.weights = WeightExporter(self.storage, self.config.checkpoint.uri, sync.dtype, sync.keep,
                                                   pinned, write=self.engine.export_policy,
                                                   on_publish=self._report_weights, fast=self.fast_path,
                                                   on_announce=self._announce_weights)
        self.engine.attach(self.checkpointer)  # the seed's save and sync methods go through it
        b = self.config.buffer
        # staleSamples keep: nothing is dropped, rollout correction weighs the stale samples.
        self.buffer = BufferReader(b.uri, self.config.trainer.batch_size,
                                   max_staleness=None if b.stale_samples == staleness.KEEP else b.max_staleness,
                                   storage=get_storage(b.uri, self.config.env))
        extra = self.load_checkpoint()
        if extra and "buffer" in extra:
            self.buffer.load_state_dict(extra["buffer"])
        if self.rt.is_main and self.config.evaluation is not None:  # once the step it resumes at is known
            self._start_evaluator()
        # Where this attempt starts, for the job's attempt history (and its Resumed event).
        step, resumed = self.train_step_num, self.checkpointer.last_committed  # None: a fresh start
        self.reporter.report_resumed(step, None if resumed is None else step_uri(self.config.checkpoint.uri, resumed))
        if step:  # resumed: the status shows where this attempt starts
            self.reporter.report_step(step, self.config.trainer.total_steps)
            self.pod_metrics.observe_step(step, {})

    def _start_evaluator(self) -> None:
        """spec.evaluation's scorer, through the inference pods ($RFT_INFERENCE_ENDPOINTS);
        it starts from the job's status.trainer.evaluation (a resumed attempt keeps its best)."""
        endpoints = [e for e in os.environ.get(names.ENV_INFERENCE_ENDPOINTS, "").split(",") if e]
        api = self.reporter.api if self.reporter.enabled else None
        if api is not None:
            try:
                job = get_job(api, self.reporter.namespace, self.reporter.name)
                record = ((job.get("status") or {}).get("trainer") or {}).get("evaluation")
                # Versions past the step this attempt resumed at are exported again, with other weights.
                self.evaluation = EvaluationState(record, up_to=self.train_step_num)
            except Exception as e:  # noqa: BLE001 - a fresh record then
                log.warning("evaluation: the job's earlier scores were not read (%s): starting afresh", describe(e))
        self.evaluation.uri_of = self._weights_uri
        last = self.evaluation.last["version"] if self.evaluation.last else None
        self.evaluator = build_evaluator(self.config, endpoints, api, last_version=last)
        self.checkpointer.weights.keep_also = lambda: {self.evaluation.best_version, self.evaluator.scoring}
        self.checkpointer.keep_also = lambda: {self.evaluation.best_version}  # its checkpoint, if one was taken
        if self.config.sync.pinned_version is not None:
            log.warning("evaluation: spec.sync.pinnedVersion %s is served: only that version is scored",
                        self.config.sync.pinned_version)

    def _weights_uri(self, version: int) -> str:
        return weights_uri(self.config.checkpoint.uri, version) if version else self.config.model.path

    def _take_evaluations(self, metrics: dict | None = None) -> None:
        """Rank 0: the evaluations that ended since the last step, into the status, /metrics
        and (with the step's metrics, `metrics`) the trackers."""
        if self.evaluator is None:
            return
        for outcome in self.evaluator.take():
            status = self.evaluation.update(outcome, self.train_step_num)
            self.reporter.report_evaluation(status)
            self.pod_metrics.observe_evaluation(outcome.version, outcome.result, self.evaluation.best,
                                                skipped=outcome.skipped, seconds=outcome.seconds)
            if outcome.result is None:
                continue
            if metrics is not None:
                metrics.update(metrics_of(outcome))
            elif self.tracker is not None:
                self.tracker.log_metrics(self.train_step_num, metrics_of(outcome))

    def _final_evaluation(self) -> None:
        """Rank 0 at the end: wait for the final version's score (bounded), then report it."""
        if self.evaluator is None or not self.train_step_num or self.config.sync.pinned_version is not None:
            return
        wait = min(self.config.evaluation.timeout_seconds, FINAL_WAIT_CAP_SECONDS)
        try:
            if not self.evaluator.finish(self.train_step_num, wait):
                log.warning("evaluation: the final version %d was not scored within %.0fs", self.train_step_num, wait)
            self._take_evaluations()
        except Exception as e:  # noqa: BLE001 - the job is done: a score is not worth failing it
            log.error("evaluation: the final version's score was not reported: %s", describe_error(e))

    def load_checkpoint(self) -> dict | None:
        """Resume the engine's `checkpoint_roles()` and step from the newest complete
        checkpoint: returns its `extra` (the buffer position), or None (a fresh start)."""
        step = self.checkpointer.resume()
        if step is None:
            return None
        self.engine.set_train_step_num(step)
        return self.checkpointer.app.extra

    def _report_commit(self, step: int, prefix: str) -> None:
        """Rank 0, once a checkpoint's manifest is written (maybe in the upload thread)."""
        ckpt = self.checkpointer
        self.reporter.report_checkpoint(step, prefix, ckpt.last_commit_bytes, ckpt.last_commit_seconds)
        self.pod_metrics.observe_checkpoint(step, ckpt.last_commit_bytes, ckpt.last_commit_seconds)

    async def train(self) -> str:
        # An attempt that resumed at totalSteps (the gang restarted after its final
        # checkpoint) trains no further: only the end's work is left.
        while self.train_step_num < self.config.trainer.total_steps and await self.train_step():
            pass
        if not self.stopping and self.last_synced != self.train_step_num and self.train_step_num:
            self.sync_weight()  # the inference pods end on the final policy
        self.save_final_checkpoint()
        if not self.stopping and self.train_step_num and getattr(self.engine, "adapter_versions", False):
            self.export_merged()  # the versions were adapters: the fine-tuned model, whole
        self.finished = not self.stopping
        self.ended_together = True  # every rank is here, at the same step
        return "stopped" if self.stopping else "finished"

    async def train_step(self) -> bool:
        batch = self.next_batch()
        if batch is None:
            return False
        cont, metrics = self.engine.train_step(batch)
        metrics["buffer/dropped_stale"] = float(self.buffer.stats["dropped_stale"])
        self._count_samples(metrics)
        if self.tracker is not None:
            self._log_rollouts(batch)
        self.last_metrics = metrics
        self._report_buffer()
        self.checkpointer.maybe_save(self.train_step_num, self.checkpoint_extra())
        if self.need_sync():
            self.sync_weight()
        self._take_evaluations(metrics)
        self._report(metrics)
        return cont and self.train_step_num < self.config.trainer.total_steps

    def _log_rollouts(self, batch: Experiences) -> None:
        """The step's rollouts table (spec.tracking.rolloutSamples) to the trackers; a
        failure here is logged once and never stops training, as a tracker's never does."""
        n = self.config.tracking.rollout_samples if self.config.tracking is not None else None
        try:
            self.tracker.log_samples(self.train_step_num, rollout_rows(
                batch, self.train_step_num, DEFAULT_ROLLOUT_SAMPLES if n is None else n))
        except Exception as e:  # noqa: BLE001 - a table is never worth a step
            if not self._rollouts_failed:
                log.error("tracking: rollouts table of step %d left out (and any after that fail the same "
                          "way): %s", self.train_step_num, describe_error(e))
            self._rollouts_failed = True

    def _count_samples(self, metrics: dict) -> None:
        """The step's samples by version lag and outcome (rft_contract.staleness): the
        engine's trained/corrected/masked, and those the buffer dropped as stale on the way
        to this batch (rank 0 reads the buffer), into the tracker metrics and
        rft_trainer_samples_total."""
        dropped = staleness.tally(self.buffer.take_dropped(), staleness.DROPPED)
        metrics.update(staleness.metric_names(dropped))
        if self.rt is None or self.rt.is_main:
            self.pod_metrics.observe_samples(staleness.merge(self.engine.sample_outcomes, dropped))

    def next_batch(self) -> Experiences | None:
        """The next batch no staler than buffer.max_staleness versions, the same on every
        rank; None once the ranks agreed to stop, or when a train-only buffer (no
        explorers, `buffer.wait` false) runs dry. With explorers the trainer waits for
        them, polling every buffer.pollSeconds (one collective per poll keeps the other
        ranks inside the process group's timeout), and says why it waits."""
        b, step = self.config.buffer, self.train_step_num
        waiting_since = None
        while not self.agree_stop():
            batch, error = None, None
            if self.rt is None or self.rt.is_main:
                try:
                    batch = self.buffer.next_batch(current_version=step, wait=b.wait,
                                                   timeout=b.poll_seconds if b.wait else None)
                except Exception as e:  # noqa: BLE001 - every rank fails with it, none waits
                    error = e
            batch, state, error = self._share((batch, self.buffer.state_dict(), _portable(error)))
            if error is not None:
                raise error
            if self.rt is not None and not self.rt.is_main:
                self.buffer.load_state_dict(state)  # the same position on every rank
            if batch is not None:
                self._wait_marks = (None, None)
                if waiting_since is not None:
                    log.info("step %d: experiences arrived after %.0fs", step, time.monotonic() - waiting_since[0])
                return batch
            if not b.wait:
                log.info("buffer exhausted at step %d", step)
                return None
            if waiting_since is None:
                waiting_since = (time.monotonic(), now(), self.buffer.stats["dropped_stale"])
            self._tell_waiting(step, *waiting_since)
        return None

    def _tell_waiting(self, step: int, started: float, since: str, dropped_before: int) -> None:
        """Rank 0: why no batch yet, with true counts and times, in the log (every
        minute) and in status.trainer.waiting (every WAIT_REPORT_EVERY seconds)."""
        if self.rt is not None and not self.rt.is_main:
            return
        waited = time.monotonic() - started
        pending = sum(self.buffer.pending_stale.values())
        dropped = self.buffer.stats["dropped_stale"] - dropped_before + pending
        reason = names.WAIT_STALE if dropped else names.WAIT_DATA
        message = (f"step {step}: waiting for experiences in {self.config.buffer.uri} for {waited:.0f}s "
                   f"({dropped} samples dropped as stale while waiting, max staleness "
                   f"{self.config.buffer.max_staleness}; consumed per explorer "
                   f"{self.buffer.consumed_counts() or {}})")
        last_log, last_report = self._wait_marks
        t = time.monotonic()
        if last_log is None or t - last_log >= WAIT_LOG_EVERY:
            log.info("%s", message)
            last_log = t
        if last_report is None or t - last_report >= WAIT_REPORT_EVERY:
            self.reporter.report_waiting(reason, message, since, round(waited, 1))
            self._report_buffer()
            last_report = t
        self._wait_marks = (last_log, last_report)

    def _report_buffer(self) -> None:
        if self.rt is None or self.rt.is_main:
            stale = self.buffer.stats["dropped_stale"] + sum(self.buffer.pending_stale.values())
            consumed, samples = self.buffer.consumed_counts(), int(self.buffer.stats["samples"])
            self.reporter.report_buffer(consumed, int(stale), samples)
            self.pod_metrics.observe_buffer(consumed, int(stale), samples)

    def agree_stop(self) -> bool:
        """At a step boundary: stop when any rank was asked to (MAX over ranks of the age
        of its SIGTERM, -1 for none). Every rank calls this once per poll at the same
        point, so all leave the loop after the same step and save together."""
        age = time.monotonic() - self._stop_at if self.stop_requested else -1.0
        if self._distributed():
            t = torch.tensor([age], dtype=torch.float64, device=self.rt.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            age = float(t.item())
        if age >= 0 and not self.stopping:
            self.stopping = True
            self._stop_at = time.monotonic() - age
            log.info("stop agreed after step %d: first SIGTERM %.1fs ago%s", self.train_step_num, age,
                     "" if self.stop_requested else " (on another rank)")
        return self.stopping

    def _distributed(self) -> bool:
        return self.rt is not None and self.rt.world_size > 1 and dist.is_initialized()

    def _share(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        if not self._distributed():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, device=self.rt.device)
        return box[0]

    def checkpoint_extra(self) -> dict:
        return {"buffer": self.buffer.state_dict()}

    def request_stop(self) -> None:
        """SIGTERM (signal-safe: only flags): finish the current step, maybe checkpoint,
        then leave, together with the other ranks (`agree_stop`)."""
        if not self.stop_requested:
            self.stop_requested = True
            self._stop_at = time.monotonic()

    def save_final_checkpoint(self) -> None:
        """On finish: commit the current step unless it is already saved. On a stop: the
        same, unless a checkpoint is recent or the save would not fit the time left before
        the workers are killed (`should_save_on_stop`, `stop_budget_seconds`); rank 0
        decides for every rank (a save is collective)."""
        ckpt = self.checkpointer
        ckpt.wait_on_save_thread()  # an upload in flight commits first (it is usually the recent one)
        if ckpt.last_saved == self.train_step_num or self.train_step_num == 0:
            if self.stopping:
                log.info("stopping at step %d: nothing new to save", self.train_step_num)
            return
        if self.stopping:
            save, why = self._share(should_save_on_stop(
                time.monotonic(), self._stop_at, ckpt.last_commit_at, ckpt.last_commit_seconds, stop_budget_seconds()))
            log.info("stopping at step %d: %s", self.train_step_num, why)
            if not save:
                return
        self.save_checkpoint(block_until_saved=True)

    def save_checkpoint(self, block_until_saved: bool = False) -> None:
        """Save the current step now (through the engine's seed method, to our checkpointer)."""
        self.engine.save_checkpoint(block_until_saved=block_until_saved)

    def need_sync(self) -> bool:
        step = self.train_step_num
        return step % self.config.sync.interval == 0 or step >= self.config.trainer.total_steps

    def sync_weight(self) -> None:
        """Hand the current policy to the inference pods: the engine's `sync_weight` exports
        it through the checkpoint manager's weight exporter (all ranks); rank 0 then reports
        `status.trainer.latestWeights`, which the operator promotes to the sync target."""
        self.engine.sync_weight()
        self.last_synced = self.train_step_num

    def export_merged(self) -> None:
        """All ranks: the final policy with its adapters merged, under `<root>/merged/`, and
        (rank 0) `status.trainer.mergedWeights`. A failure ends the attempt like a failed
        export; the next one resumes at the last step and writes it again."""
        step, uri = self.train_step_num, merged_uri(self.config.checkpoint.uri, self.train_step_num)
        manifest = self.engine.export_merged(self.storage, uri, self.config.sync.dtype)
        if manifest is not None:
            self.reporter.report_merged(step, uri, manifest.get("id"))

    def _report_weights(self, step: int, uri: str, manifest: dict, versions: list[int] | None,
                        seconds: float) -> None:
        """Rank 0, once the weight exporter wrote version `step` and applied sync.keep."""
        self.pod_metrics.observe_weights(step, manifest.get("bytes"), seconds)
        announced = self._announced if self._announced and self._announced[0] == step else (step, {})
        self.reporter.report_weights(step, uri, manifest.get("id"), versions, **announced[1])
        self._last_weights = (step, uri, manifest.get("id"), versions)
        if self.evaluator is not None and self.config.sync.pinned_version is None:
            self.evaluator.published(step)
        if self.tracker is not None:
            self.tracker.log_tags({"rft.weights.uri": uri, "rft.weights.step": step}, step)

    def _announce_weights(self, step: int, uri: str, manifest: dict, announced: dict) -> None:
        """Rank 0 on the fast path: version `step` is served from this pod and uploading;
        the replicas may load it now (the commit's report follows as `_report_weights`)."""
        self._announced = (step, dict(announced))
        self.reporter.report_weights(step, uri, manifest.get("id"), None, **announced)

    def _report(self, metrics: dict) -> None:
        self.reporter.report_step(self.train_step_num, self.config.trainer.total_steps, metrics)
        self.pod_metrics.observe_step(self.train_step_num, metrics)
        if self.metrics_log is not None:
            self.metrics_log.append(self.train_step_num, metrics)
        if self.tracker is not None:
            self.tracker.log_metrics(self.train_step_num, metrics)
        if self.rt is not None and self.rt.is_main:
            every = self.config.reporting.log_every
            if self.train_step_num % every == 0 or self.train_step_num == 1:
                line = {"step": self.train_step_num, **{k: round(v, 6) for k, v in metrics.items()}}
                print(json.dumps(line), file=sys.stdout, flush=True)

    def _report_tracking(self, tracking: dict) -> None:
        """Rank 0, from a tracker's thread: `status.trainer.tracking`, coalesced like steps."""
        self.reporter.report_tracking(tracking)

    async def shutdown(self) -> None:
        self._alive = False
        try:
            if self.checkpointer is not None:
                self.checkpointer.wait_on_save_thread()
            if self.finished:
                self._final_evaluation()
        finally:
            if self.evaluator is not None:
                self.evaluator.stop()
            if self.tracker is not None:  # before the reporter: its last state goes out with it
                self.tracker.close(finished=self.finished, timeout=TRACKING_CLOSE_SECONDS)
            if self.fast_path is not None and self._last_weights is not None:
                # This pod's weights server goes: replicas that start later read S3 at once.
                self.reporter.report_weights(*self._last_weights)
            self.reporter.close()
            self.pod_metrics.close()
            if self.fast_path is not None:  # the final version is committed: replicas read S3
                self.fast_path.stop()
            if self.metrics_log is not None:
                self.metrics_log.close()
            if torch.distributed.is_initialized():
                if self.ended_together:
                    # Every rank ran the same steps: wait for all before tearing the group
                    # down, or a rank whose last sends are still in flight aborts (gloo:
                    # SIGABRT). After a stop it also keeps the other local ranks alive
                    # until rank 0 has flushed its status: torchrun kills a node's
                    # remaining workers soon after the first one exits.
                    torch.distributed.barrier()
                torch.distributed.destroy_process_group()

    @property
    def train_step_num(self) -> int:
        return self.engine.train_step_num if self.engine is not None else 0

    def is_alive(self) -> bool:
        return self._alive


def rollout_rows(batch: Experiences, step: int, k: int) -> list[dict]:
    """`k` samples of the batch trained as step `step` (the same ones on every run: drawn
    with the step as seed) as rows for the trackers' rollouts table: the task's text and
    the response as the explorer recorded them (`info`), reward, weights version and lag."""
    n = len(batch)
    picked = sorted(random.Random(step).sample(range(n), min(k, n)))
    versions = batch.weights_version.tolist() if batch.weights_version is not None else [None] * n
    rows = []
    for i in picked:
        info, v = batch.info[i] if batch.info else {}, versions[i]
        rows.append({"step": step, "version": v, "lag": None if v is None else max(0, step - 1 - v),
                     "reward": float(batch.rewards[i]), "task_id": info.get("task_id"),
                     "finish_reason": info.get("finish_reason"), "prompt": info.get("prompt"),
                     "response": info.get("response")})
    return rows
