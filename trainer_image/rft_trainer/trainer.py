"""The Trainer API of Trinity-RFT's `trinity.trainer`, on torchrun + FSDP2 (no Ray).

`Trainer` consumes experiences from the buffer and trains; `TrainEngineWrapper` is the
engine interface; `get_trainer_wrapper(config)` the factory. The loop reads on one screen:
the engine decides what a step is, the buffer what data comes next.
"""

from __future__ import annotations

import abc
import hashlib
import json
import logging
import os
import sys
import time
from typing import Any

import torch

from . import engine as eng
from .algorithms import advantages as advs
from .algorithms import losses
from .checkpoint import CheckpointManager, should_save_on_stop
from .config import Config
from .experience import BufferReader, Experiences
from .export import apply_weights_retention, export_hf, weights_uri
from .metrics import MetricsLog
from .parallelize import Runtime, build_model, fetch_model, init_distributed
from .storage import get_storage
from .reporting import StatusReporter

log = logging.getLogger("rft_trainer")


class TrainEngineWrapper(abc.ABC):
    """A training engine behind the Trainer (the seed's interface)."""

    @abc.abstractmethod
    def prepare(self) -> None: ...

    @property
    @abc.abstractmethod
    def train_step_num(self) -> int: ...

    @abc.abstractmethod
    def train_step(self, batch: Experiences) -> tuple[bool, dict]: ...

    @abc.abstractmethod
    def save_checkpoint(self, block_until_saved: bool = False) -> None: ...

    @abc.abstractmethod
    def sync_weight(self) -> None: ...

    @abc.abstractmethod
    def upload_state_dict(self) -> None: ...

    @abc.abstractmethod
    def save_state_dict(self) -> None: ...


class FSDPTrainEngine(TrainEngineWrapper):
    """Actor (+ reference for KL, + critic for PPO) sharded with FSDP2."""

    def __init__(self, config: Config, rt: Runtime | None = None):
        self.config = config
        self.rt = rt
        self.step = 0
        self.actor: eng.Actor | None = None
        self.ref: eng.Reference | None = None
        self.critic: eng.Critic | None = None
        self.checkpointer: CheckpointManager | None = None
        self._storage = None

    @property
    def storage(self):
        """The checkpoint URI's storage, built once (an S3 client is not free per step)."""
        if self._storage is None:
            self._storage = get_storage(self.config.checkpoint.uri)
        return self._storage

    # ------------------------------------------------------------ setup

    def prepare(self) -> None:
        self.rt = self.rt or init_distributed()
        check_batch_layout(self.config, self.rt.world_size)
        torch.manual_seed(self.config.trainer.seed)
        self.actor = self._build_actor()
        a = self.config.algorithm
        if a.kl_coef > 0:
            self.ref = eng.Reference(self._build("causal_lm", trains=False), self.rt, a.micro_batch_size)
        if a.name == "ppo":
            self.critic = self._build_critic()

    def _build(self, kind: str, trains: bool = True):
        f = self.config.fsdp
        return build_model(self.config.model.path, self.rt, kind=kind, fsdp_mode=f.mixed_precision,
                           reshard_after_forward=f.reshard_after_forward, cpu_offload=f.cpu_offload,
                           activation_checkpointing=f.activation_checkpointing and trains)

    def _optim(self, model, lr: float):
        o, t = self.config.optimizer, self.config.trainer
        opt = eng.make_optimizer(model, lr, o.betas, o.weight_decay)
        return opt, eng.make_scheduler(opt, o.warmup_steps, t.total_steps, o.lr_schedule)

    def _build_actor(self) -> eng.Actor:
        model = self._build("causal_lm")
        return eng.Actor(model, self.rt, self.config.algorithm, *self._optim(model, self.config.algorithm.learning_rate))

    def _build_critic(self) -> eng.Critic:
        model = self._build("critic")
        return eng.Critic(model, self.rt, self.config.algorithm,
                          *self._optim(model, self.config.algorithm.critic_learning_rate))

    @property
    def train_step_num(self) -> int:
        return self.step

    # ------------------------------------------------------------ one step

    def train_step(self, batch: Experiences) -> tuple[bool, dict]:
        """One RL step on the *global* batch (identical on every rank): advantages over
        whole groups, then each rank trains on its contiguous slice."""
        m: dict[str, float] = {}
        start = time.perf_counter()
        batch = batch.to(self.rt.device)
        local = self.local_slice(batch)
        with eng.timed(m, "time/old_log_prob"):
            old_lp, _ = self.actor.compute_log_prob(local)
        ref_lp = None
        if self.ref is not None:
            with eng.timed(m, "time/ref_log_prob"):
                ref_lp = self.ref.compute_ref_log_prob(local)
        with eng.timed(m, "time/advantages"):
            adv, ret, values = self._advantages(batch, local, old_lp, ref_lp)
        if self.critic is not None:
            with eng.timed(m, "time/update_critic"):
                m.update(self.critic.update_critic(local, values, ret))
        with eng.timed(m, "time/update_actor"):
            m.update(self.actor.update_policy(local, old_lp, adv, ref_lp))
        self.step += 1
        m.update(batch_metrics(batch, adv_local=adv, mask_local=local.action_mask))
        elapsed = time.perf_counter() - start
        m["time/step"] = elapsed
        m["perf/throughput"] = float(batch.attention_mask.sum()) / elapsed / self.rt.world_size
        m["training/global_step"] = self.step
        return self.step < self.config.trainer.total_steps, m

    def local_slice(self, batch: Experiences) -> Experiences:
        n = len(batch) // self.rt.world_size
        return batch.select(torch.arange(self.rt.rank * n, (self.rt.rank + 1) * n, device=batch.tokens.device))

    def _advantages(self, batch, local, old_lp, ref_lp):
        a = self.config.algorithm
        mask = local.action_mask.float()
        if local.advantages is not None and local.returns is not None:
            return local.advantages, local.returns, None
        if a.name == "grpo":
            adv, ret = advs.grpo_advantages(batch.rewards, batch.group_ids, batch.action_mask.float(),
                                            norm_by_std=a.norm_adv_by_std)
            idx = self.local_indices(len(batch))
            return adv[idx], ret[idx], None
        values = self.critic.compute_values(local)
        token_rewards = advs.outcome_to_token_rewards(local.rewards, mask)
        if ref_lp is not None and not getattr(a, "use_kl_loss", True):
            token_rewards = token_rewards - a.kl_coef * losses.kl_penalty(old_lp, ref_lp, a.kl_estimator) * mask
        # GAE whitening uses batch statistics: gather so every rank sees the global batch.
        g_rewards, g_values, g_mask = (gather(t, self.rt) for t in (token_rewards, values, mask))
        adv, ret = advs.gae_advantages(g_rewards, g_values, g_mask, a.gamma, a.lam)
        idx = self.local_indices(len(batch))
        return adv[idx], ret[idx], values

    def local_indices(self, n_global: int) -> torch.Tensor:
        n = n_global // self.rt.world_size
        return torch.arange(self.rt.rank * n, (self.rt.rank + 1) * n, device=self.rt.device)

    # ------------------------------------------------------------ checkpoints (checkpoint.py)

    def build_checkpointer(self) -> CheckpointManager:
        if self.checkpointer is None:
            c = self.config.checkpoint
            # The manifest records which config produced the state, to explain odd resumes.
            config_hash = hashlib.sha256(json.dumps(self.config.to_dict(), sort_keys=True, default=str)
                                         .encode()).hexdigest()[:16]
            self.checkpointer = CheckpointManager(self.storage, c.uri, self.rt, c.keep, c.interval,
                                                  {"actor": self.actor, "critic": self.critic},
                                                  config_hash=config_hash)
        return self.checkpointer

    def load_checkpoint(self) -> dict | None:
        """Resume from the newest verified checkpoint: returns its `extra` (e.g. the buffer
        position) and sets the step, or None when there is none (a fresh start)."""
        ckpt = self.build_checkpointer()
        if ckpt.resume() is None:
            return None
        self.step = ckpt.app.step
        return ckpt.app.extra

    def save_checkpoint(self, block_until_saved: bool = False, extra: dict | None = None) -> None:
        self.build_checkpointer().save(self.step, extra, block=block_until_saved)

    def wait_on_save_thread(self) -> None:
        if self.checkpointer is not None:
            self.checkpointer.wait()

    # ------------------------------------------------------------ weights for inference

    def sync_weight(self) -> dict | None:
        """Publish the current policy for the inference pods: export it (collective) to
        `<checkpoint.uri>/weights/step-N/`. The sync agents pick it up once the trainer
        reports it in the job status (Trainer.sync_weight). Returns the manifest on rank 0."""
        return self.upload_state_dict()

    def upload_state_dict(self) -> dict | None:
        """Export the policy for inference to `<checkpoint.uri>/weights/step-N/` (collective;
        returns the manifest on rank 0)."""
        return self.save_state_dict()

    def save_state_dict(self, dtype: str = "bf16") -> dict | None:
        uri = self.config.checkpoint.uri
        return export_hf(self.actor.model, self.rt, self.storage, weights_uri(uri, self.step),
                         fetch_model(self.config.model.path, self.rt), self.step, dtype=dtype)


def gather(t: torch.Tensor, rt: Runtime) -> torch.Tensor:
    if rt.world_size == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(rt.world_size)]
    torch.distributed.all_gather(parts, t.contiguous())
    return torch.cat(parts)


def batch_metrics(batch: Experiences, adv_local: torch.Tensor, mask_local: torch.Tensor) -> dict:
    resp_len = batch.action_mask.float().sum(-1)
    m = mask_local.float()
    return {
        "response_length/mean": float(resp_len.mean()),
        "response_length/max": float(resp_len.max()),
        "critic/rewards/mean": float(batch.rewards.float().mean()),
        "critic/advantages/mean": float((adv_local * m).sum() / m.sum().clamp(min=1)),
    }


def check_batch_layout(config: Config, world_size: int) -> None:
    """Fail at start, naming the key, when the batch cannot be split evenly."""
    b, a = config.trainer.batch_size, config.algorithm
    if b % world_size:
        raise ValueError(f"trainer.batch_size={b} must be divisible by the number of ranks ({world_size})")
    mini = a.mini_batch_size or b
    if b % mini or mini % world_size:
        raise ValueError(f"algorithm.mini_batch_size={mini} must divide trainer.batch_size={b} "
                         f"and be divisible by the number of ranks ({world_size})")
    if (mini // world_size) % a.micro_batch_size:
        raise ValueError(f"algorithm.micro_batch_size={a.micro_batch_size} must divide the per-rank "
                         f"mini-batch ({mini // world_size})")


def get_trainer_wrapper(config: Config) -> TrainEngineWrapper:
    return FSDPTrainEngine(config)


class Trainer:
    """Consume the experience and train the model."""

    def __init__(self, config: Config):
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
            torch.distributed.destroy_process_group()

    @property
    def train_step_num(self) -> int:
        return self.engine.train_step_num

    def is_alive(self) -> bool:
        return self._alive
