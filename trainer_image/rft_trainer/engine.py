"""The training engine behind the Trainer: `TrainEngineWrapper` (the seed's interface) and
`FSDPTrainEngine`, the actor (+ reference for KL, + critic for PPO) sharded with FSDP2.
The roles themselves (log-probs, policy and value updates) are in roles.py.
"""

from __future__ import annotations

import abc
import hashlib
import json
import time

import torch

from rft_contract.config import JobConfig
from rft_contract.layout import weights_uri
from rft_contract.probe import PROBE_FILE
from rft_contract.storage import get_storage

from . import models, probe, roles
from .algorithms import advantages as advs
from .algorithms import losses
from .checkpoint import CheckpointManager
from .experience import Experiences
from .export import export_hf
from .parallelize import Runtime, build_model, fetch_model, init_distributed


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

    def __init__(self, config: JobConfig, rt: Runtime | None = None):
        self.config = config
        self.rt = rt
        self.step = 0
        self.actor: roles.Actor | None = None
        self.ref: roles.Reference | None = None
        self.critic: roles.Critic | None = None
        self.checkpointer: CheckpointManager | None = None
        self._storage = None
        self.probe_tokens: list[int] | None = None  # from the last batch: the next export's probe

    @property
    def storage(self):
        """The checkpoint URI's storage, built once (an S3 client is not free per step)."""
        if self._storage is None:
            self._storage = get_storage(self.config.checkpoint.uri)
        return self._storage

    # ------------------------------------------------------------ setup

    def prepare(self) -> None:
        self.rt = self.rt or init_distributed(cpu_offload=self.config.fsdp.cpu_offload)
        check_batch_layout(self.config, self.rt.world_size)
        a = self.config.algorithm
        # Before any build: a PPO job whose model has no backbone for the critic fails now.
        models.check_supported(models.load_config(fetch_model(self.config.model.path, self.rt)),
                               critic=a.name == "ppo")
        torch.manual_seed(self.config.trainer.seed)
        self.actor = self._build_actor()
        if a.kl_coef > 0:
            self.ref = roles.Reference(self._build("causal_lm", trains=False), self.rt, a.micro_batch_size)
        if a.name == "ppo":
            self.critic = self._build_critic()

    def _build(self, kind: str, trains: bool = True):
        f = self.config.fsdp
        return build_model(self.config.model.path, self.rt, kind=kind, fsdp_mode=f.mixed_precision,
                           reshard_after_forward=f.reshard_after_forward, cpu_offload=f.cpu_offload,
                           activation_checkpointing=f.activation_checkpointing and trains,
                           param_dtype=self.config.model.dtype)

    def _optim(self, model, lr: float):
        o, t = self.config.optimizer, self.config.trainer
        opt = roles.make_optimizer(model, lr, o.betas, o.weight_decay, decay_all=o.weight_decay_all)
        return opt, roles.make_scheduler(opt, o.warmup_steps, t.total_steps, o.lr_schedule, o.min_lr_ratio)

    def _build_actor(self) -> roles.Actor:
        model = self._build("causal_lm")
        return roles.Actor(model, self.rt, self.config.algorithm, *self._optim(model, self.config.algorithm.learning_rate))

    def _build_critic(self) -> roles.Critic:
        model = self._build("critic")
        return roles.Critic(model, self.rt, self.config.algorithm,
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
        self.probe_tokens = probe.probe_tokens(batch.tokens, batch.attention_mask)  # the next export's probe
        local = self.local_slice(batch)
        with roles.timed(m, "time/old_log_prob"):
            old_lp, _ = self.actor.compute_log_prob(local)
        ref_lp = None
        if self.ref is not None:
            with roles.timed(m, "time/ref_log_prob"):
                ref_lp = self.ref.compute_ref_log_prob(local)
        with roles.timed(m, "time/advantages"):
            adv, ret, values = self._advantages(batch, local, old_lp, ref_lp)
        if self.critic is not None:
            with roles.timed(m, "time/update_critic"):
                m.update(self.critic.update_critic(local, values, ret))
        with roles.timed(m, "time/update_actor"):
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
        # Without a KL loss term, KL goes into the reward (verl's apply_kl_penalty with a
        # fixed coefficient): token reward -= kl_coef * KL(old policy || ref), response tokens only.
        kl_reward = None
        if ref_lp is not None and not getattr(a, "use_kl_loss", True):
            kl = losses.kl_penalty(old_lp, ref_lp, a.kl_estimator)
            kl_reward = a.kl_coef * torch.where(local.action_mask.bool(), kl, torch.zeros_like(kl))
        if a.name == "grpo":
            rewards = batch.rewards
            if kl_reward is not None:
                # verl's GRPO scores a sequence by the sum of its token rewards.
                rewards = rewards - gather(kl_reward.sum(-1), self.rt)
            adv, ret = advs.grpo_advantages(rewards, batch.group_ids, batch.action_mask.float(),
                                            norm_by_std=a.norm_adv_by_std)
            idx = self.local_indices(len(batch))
            return adv[idx], ret[idx], None
        values = self.critic.compute_values(local)
        token_rewards = advs.outcome_to_token_rewards(local.rewards, mask)
        if kl_reward is not None:
            token_rewards = token_rewards - kl_reward
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

    def save_state_dict(self, dtype: str | None = None) -> dict | None:
        """Export the policy in `dtype` (default `sync.dtype`) with its probe
        (rft_trainer.probe): what the sync agents check each engine against."""
        dtype = dtype or self.config.sync.dtype
        model, uri = self.actor.model, self.config.checkpoint.uri
        tokens = self.probe_tokens or probe.fallback_tokens(
            model.config.get_text_config().vocab_size)
        check = probe.build_probe(model, self.rt.device, tokens, dtype, self.step)
        return export_hf(model, self.rt, self.storage, weights_uri(uri, self.step),
                         fetch_model(self.config.model.path, self.rt), self.step, dtype=dtype,
                         extra_files={PROBE_FILE: check.to_json().encode()})


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


def check_batch_layout(config: JobConfig, world_size: int) -> None:
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


def get_trainer_wrapper(config: JobConfig) -> TrainEngineWrapper:
    return FSDPTrainEngine(config)


