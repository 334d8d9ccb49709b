"""The Trainer API of Trinity-RFT's `trinity.trainer`, on torchrun + FSDP2 (no Ray).

`Trainer` consumes experiences from the buffer and trains; the engine (engine.py) decides
what a step is, the buffer what data comes next. The loop reads on one screen.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any

import torch

from rft_contract.config import JobConfig
from rft_contract.layout import weights_uri

from .checkpoint import should_save_on_stop
from .engine import TrainEngineWrapper, get_trainer_wrapper
from .experience import BufferReader, Experiences
from .export import apply_weights_retention
from .metrics import MetricsLog
from .reporting import StatusReporter

log = logging.getLogger("rft_trainer")


class Trainer:
    """Consume the experience and train the model."""

    def __init__(self, config: JobConfig):
        self.config = config
        self.engine = get_trainer_wrapper(config)
        self.buffer: BufferReader | None = None
        self._alive = True
        self.stop_requested = False
        self._stop_at = 0.0
        self.last_metrics: dict[str, Any] = {}
        self.reporter = StatusReporter(None, None)
        self.metrics_log: MetricsLog | None = None  # rank 0: per-step metrics to storage
        self.last_synced: int | None = None
        self.finished = False  # train() ended at totalSteps or a dry buffer, not by a stop

    def prepare(self) -> None:
        self.engine.prepare()
        if self.engine.rt.is_main:  # one writer per job: rank 0
            self.reporter = StatusReporter.from_env()
            self.metrics_log = MetricsLog(self.config.checkpoint.uri, attempt=self.config.job.attempt)
        ckpt = self.engine.build_checkpointer()
        ckpt.on_commit = lambda step, prefix: self.reporter.report_checkpoint(
            step, prefix, ckpt.last_commit_bytes, ckpt.last_commit_seconds)
        b = self.config.buffer
        self.buffer = BufferReader(b.uri, self.config.trainer.batch_size, max_staleness=b.max_staleness)
        extra = self.engine.load_checkpoint()
        if extra and "buffer" in extra:
            self.buffer.load_state_dict(extra["buffer"])
        if self.train_step_num:  # resumed: the status shows where this attempt starts
            self.reporter.report_step(self.train_step_num, self.config.trainer.total_steps)

    async def train(self) -> str:
        while not self.stop_requested and await self.train_step():
            pass
        if not self.stop_requested and self.last_synced != self.train_step_num and self.train_step_num:
            self.sync_weight()  # the inference pods end on the final policy
        self.save_final_checkpoint()
        self.finished = not self.stop_requested
        return "stopped" if self.stop_requested else "finished"

    async def train_step(self) -> bool:
        batch = self.next_batch()
        if batch is None:
            return False
        cont, metrics = self.engine.train_step(batch)
        metrics["buffer/dropped_stale"] = float(self.buffer.stats["dropped_stale"])
        self.last_metrics = metrics
        self.engine.checkpointer.maybe_save(self.train_step_num, self.checkpoint_extra())
        if self.need_sync():
            self.sync_weight()
        self._report(metrics)
        return cont and self.train_step_num < self.config.trainer.total_steps

    def next_batch(self) -> Experiences | None:
        """The next batch no staler than buffer.max_staleness versions. Train-only jobs
        end when the buffer runs dry; with explorers the trainer waits for them."""
        b, step = self.config.buffer, self.train_step_num
        if not b.wait:
            batch = self.buffer.next_batch(current_version=step)
            if batch is None:
                log.info("buffer exhausted at step %d", step)
            return batch
        waited = 0.0
        while not self.stop_requested:
            batch = self.buffer.next_batch(current_version=step, wait=True, timeout=b.poll_seconds)
            if batch is not None:
                return batch
            waited += b.poll_seconds
            if waited % 60 < b.poll_seconds:
                log.info("step %d: waiting for experiences in %s (%.0fs so far, %d stale dropped)",
                         step, b.uri, waited, self.buffer.stats["dropped_stale"])
        return None

    def checkpoint_extra(self) -> dict:
        return {"buffer": self.buffer.state_dict()}

    def request_stop(self) -> None:
        """SIGTERM: finish the current step, maybe checkpoint, then leave."""
        self.stop_requested = True
        self._stop_at = time.monotonic()

    def save_final_checkpoint(self) -> None:
        """On finish: commit the current step unless it is already saved. On SIGTERM: the
        same, unless a checkpoint is recent or the save would not fit the grace period
        (`should_save_on_stop`; the operator passes RFT_TERMINATION_GRACE_SECONDS)."""
        ckpt = self.engine.checkpointer
        ckpt.wait()  # an upload in flight commits first (it is usually the recent one)
        if ckpt.last_saved == self.train_step_num or self.train_step_num == 0:
            if self.stop_requested:
                log.info("stopping at step %d: nothing new to save", self.train_step_num)
            return
        if self.stop_requested:
            grace = float(os.environ.get("RFT_TERMINATION_GRACE_SECONDS", "0")) or None
            save, why = should_save_on_stop(time.monotonic(), self._stop_at,
                                            getattr(ckpt, "last_commit_at", None),
                                            getattr(ckpt, "last_commit_seconds", None), grace)
            log.info("stopping at step %d: %s", self.train_step_num, why)
            if not save:
                return
        ckpt.save(self.train_step_num, self.checkpoint_extra(), block=True)

    def need_sync(self) -> bool:
        step = self.train_step_num
        return step % self.config.sync.interval == 0 or step >= self.config.trainer.total_steps

    def sync_weight(self) -> None:
        """Export the policy (all ranks), then on rank 0: drop old versions and report
        `status.trainer.latestWeights`, which the operator promotes to the sync target."""
        step = self.train_step_num
        manifest = self.engine.sync_weight()
        self.last_synced = step
        if manifest is None:  # not rank 0
            return
        root, sync = self.config.checkpoint.uri, self.config.sync
        storage = self.engine.storage
        protect = {sync.pinned_version} if sync.pinned_version is not None else set()
        try:
            versions = apply_weights_retention(storage, root, sync.keep, protect)
        except Exception as e:  # noqa: BLE001 - a failed cleanup must not stop training
            log.warning("weights retention failed: %s", e)
            versions = None
        self.reporter.report_weights(step, weights_uri(root, step), manifest.get("id"), versions)

    def _report(self, metrics: dict) -> None:
        self.reporter.report_step(self.train_step_num, self.config.trainer.total_steps, metrics)
        if self.metrics_log is not None:
            self.metrics_log.append(self.train_step_num, metrics)
        if self.engine.rt is not None and self.engine.rt.is_main:
            every = max(1, getattr(self.config.reporting, "log_every", 1))
            if self.train_step_num % every == 0 or self.train_step_num == 1:
                line = {"step": self.train_step_num, **{k: round(v, 6) for k, v in metrics.items()}}
                print(json.dumps(line), file=sys.stdout, flush=True)

    async def shutdown(self) -> None:
        self._alive = False
        if getattr(self.engine, "checkpointer", None) is not None:
            self.engine.wait_on_save_thread()
        self.reporter.close()
        if self.metrics_log is not None:
            self.metrics_log.close()
        if torch.distributed.is_initialized():
            if self.finished:
                # Every rank ran the same steps: wait for all before tearing the group down,
                # or a rank whose last sends are still in flight aborts (gloo: SIGABRT).
                torch.distributed.barrier()
            torch.distributed.destroy_process_group()

    @property
    def train_step_num(self) -> int:
        return self.engine.train_step_num

    def is_alive(self) -> bool:
        return self._alive
