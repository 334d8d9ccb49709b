"""Owns the model state of training: `TrainEngineWrapper` (the seed's interface, all the
Trainer may reach) and `FSDPTrainEngine`, the actor (+ reference, + critic) on FSDP2.
The roles themselves (log-probs, policy and value updates) are in roles.py; the runtime,
storage and checkpoint manager belong to the Trainer (trainer.py), which hands the engine
its `Runtime` and its manager, and saves and resumes what `checkpoint_roles()` returns.
"""

from __future__ import annotations

import abc
import dataclasses
import time
from typing import TYPE_CHECKING, Any

import torch

from rft_contract.algorithms import profile as algorithm_profile
from rft_contract.config import JobConfig
from rft_contract.engines import ENGINES
from rft_contract.probe import PROBE_FILE
from rft_contract.spec import LoraSpec
from rft_contract.storage import Storage

from . import models, probe, roles
from .algorithms import advantages as advs
from .algorithms import losses
from .algorithms.rollout_correction import RejectOption, rollout_correction, sample_outcomes
from .experience import Experiences
from .export import Stage, export_adapter, export_hf
from .modelcache import fetch_model
from .parallelize import Runtime, build_model, init_distributed

if TYPE_CHECKING:
    from .checkpoint import CheckpointManager


class TrainEngineWrapper(abc.ABC):
    """A training engine behind the Trainer (the seed's interface): everything the Trainer
    reaches, so a second engine is written against this class alone.

    The Trainer owns the runtime, the storage and the checkpoint manager (as torchtitan's
    does) and hands the engine the manager once built (`attach`); the manager holds the
    Trainer's weight exporter. An engine trains, exposes what a checkpoint holds
    (`checkpoint_roles`) and writes its policy (`export_policy`). The seed's save and sync
    methods keep the seed's signatures and go through the manager, so an engine need not
    write them and a caller written for Trinity-RFT's Trainer finds them:

    - `save_checkpoint(block_until_saved=False)`: the current step, with the Trainer's
      buffer position (`CheckpointManager.save_checkpoint`);
    - `save_state_dict()`, `upload_state_dict()`, `sync_weight()`: Trinity's three sync
      methods (checkpoint, memory, NCCL). Weights reach the inference pods through storage
      only, so all three export the current step to `weights/step-N/` and report it, once
      per step (`CheckpointManager.upload_state_dict` -> `WeightExporter.publish`).
    """

    checkpointer: CheckpointManager | None = None
    # The last train_step's samples by (version lag label, outcome), rft_contract.staleness;
    # an engine that does not count them leaves it empty.
    sample_outcomes: dict[tuple[str, str], int] = {}

    @abc.abstractmethod
    def prepare(self) -> None:
        """Build the models, optimizers and schedulers (before the Trainer resumes)."""

    @property
    @abc.abstractmethod
    def train_step_num(self) -> int:
        """Steps trained so far (a resume sets it with `set_train_step_num`)."""

    @abc.abstractmethod
    def set_train_step_num(self, step: int) -> None:
        """After the Trainer resumed `checkpoint_roles()` from step `step`: count on from it."""

    @abc.abstractmethod
    def train_step(self, batch: Experiences) -> tuple[bool, dict]:
        """One step on the global batch (the same on every rank): (continue, metrics)."""

    @abc.abstractmethod
    def checkpoint_roles(self) -> dict[str, Any]:
        """name -> role with `.model`, `.optimizer` and `.scheduler`: what a checkpoint holds
        besides the step, the Trainer's `extra` and the RNG (checkpoint.AppState), saved
        and loaded in place through DCP; None values are skipped. The names are the keys
        in the checkpoint (`app.<name>.*`): keep them stable across versions."""

    @abc.abstractmethod
    def export_policy(self, storage: Storage, dest: str, dtype: str, stage: Stage | None = None) -> dict | None:
        """Write the policy as an HF model directory in `dtype` under `dest` (export.py's
        layout, `manifest.json` last, with the probe the sync agents check each engine
        against). Collective: every rank calls it. Returns the manifest on rank 0, None on
        the other ranks. The weight exporter calls it; callers use the seed's methods.
        `stage` (rank 0, the fast path; passed only when on): hand it to `export_hf`, which
        writes the files there and announces the version before its upload ends."""

    # ------------------------------------------------------------ the seed's, through the owners

    def attach(self, checkpointer: CheckpointManager) -> None:
        """The Trainer hands over its checkpoint manager (after `prepare`, which the
        manager's roles need); the seed's methods below go through it."""
        self.checkpointer = checkpointer

    def save_checkpoint(self, block_until_saved: bool = False) -> None:
        """Save the checkpoint (the current step; a step saved already is kept as it is)."""
        self._manager("save_checkpoint").save_checkpoint(self.train_step_num, block_until_saved=block_until_saved)

    def sync_weight(self) -> None:
        """Sync the model weight: no NCCL group reaches the inference pods, so through storage."""
        self.upload_state_dict()

    def upload_state_dict(self) -> None:
        """Upload the state dict to the synchronizer (storage, then the report the sync agents follow)."""
        self._manager("upload_state_dict").upload_state_dict(self.train_step_num)

    def save_state_dict(self) -> None:
        """Only save the model state dict, for the synchronizer."""
        self._manager("save_state_dict").save_checkpoint(self.train_step_num, model_state_dict_only=True)

    def _manager(self, method: str) -> CheckpointManager:
        if self.checkpointer is None:
            raise RuntimeError(f"{type(self).__name__}.{method}(): no checkpoint manager attached; "
                               "Trainer.prepare() attaches its own (engine.attach(checkpointer))")
        return self.checkpointer


class FSDPTrainEngine(TrainEngineWrapper):
    """Actor (+ reference for KL, + critic for PPO) sharded with FSDP2."""

    def __init__(self, config: JobConfig, rt: Runtime | None = None):
        self.config = config
        self.algorithm = algorithm_profile(config.algorithm.name)  # the catalogue's facts
        self.rt = rt  # the Trainer's; None: `prepare` joins (or forms) the group itself
        self.step = 0
        self.actor: roles.Actor | None = None
        self.ref: roles.Reference | None = None
        self.critic: roles.Critic | None = None
        self.probe_tokens: list[int] | None = None  # from the last batch: the next export's probe
        # A LoRA job whose engine loads adapters syncs each version as the adapter alone
        # (export_adapter); else as the base with the adapter merged (export_hf).
        inference = config.inference
        self.adapter_versions = config.model.lora is not None and inference is not None \
            and ENGINES[inference.engine].lora_adapters

    # ------------------------------------------------------------ setup

    def prepare(self) -> None:
        self.rt = self.rt or init_distributed(cpu_offload=self.config.fsdp.cpu_offload, env=self.config.env)
        check_batch_layout(self.config, self.rt.world_size)
        a, needs_critic = self.config.algorithm, self.algorithm.needs_critic
        # Before any build: a job with a critic whose model has no backbone for it fails now.
        models.check_supported(models.load_config(fetch_model(self.config.model.path, self.rt)),
                               critic=needs_critic)
        torch.manual_seed(self.config.trainer.seed)
        self.actor = self._build_actor()
        if a.kl_coef > 0 and self.config.model.lora is not None:
            # The base model is the reference: the actor's own weights, adapters off.
            self.ref = roles.Reference(self.actor.model, self.rt, a.micro_batch_size, adapters_off=True)
        elif a.kl_coef > 0:
            self.ref = roles.Reference(self._build("causal_lm", trains=False), self.rt, a.micro_batch_size)
        if needs_critic:
            self.critic = self._build_critic()

    def _build(self, kind: str, trains: bool = True, lora: LoraSpec | None = None):
        f = self.config.fsdp
        return build_model(self.config.model.path, self.rt, kind=kind, fsdp_mode=f.mixed_precision,
                           reshard_after_forward=f.reshard_after_forward, cpu_offload=f.cpu_offload,
                           activation_checkpointing=f.activation_checkpointing and trains,
                           param_dtype=self.config.model.dtype, lora=lora, seed=self.config.trainer.seed)

    def _optim(self, model, lr: float):
        o, t = self.config.optimizer, self.config.trainer
        opt = roles.make_optimizer(model, lr, o.betas, o.weight_decay, decay_all=o.weight_decay_all)
        return opt, roles.make_scheduler(opt, o.warmup_steps, t.total_steps, o.lr_schedule, o.min_lr_ratio)

    def _build_actor(self) -> roles.Actor:
        model = self._build("causal_lm", lora=self.config.model.lora)
        return roles.Actor(model, self.rt, self.config.algorithm, *self._optim(model, self.config.algorithm.learning_rate))

    def _build_critic(self) -> roles.Critic:
        model = self._build("critic")
        return roles.Critic(model, self.rt, self.config.algorithm,
                          *self._optim(model, self.config.algorithm.critic_learning_rate))

    @property
    def train_step_num(self) -> int:
        return self.step

    def set_train_step_num(self, step: int) -> None:
        self.step = step

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
        losses.check_finite("old_logprob", old_lp, local.action_mask)  # before any token is rejected
        sampled, is_weights = batch, None
        if batch.rollout_logprobs is not None:
            with roles.timed(m, "time/rollout_correction"):
                batch, local, is_weights = self._rollout_correction(batch, local, old_lp, m)
        elif self.config.algorithm.rollout_correction is not None:
            raise ValueError("algorithm.rollout_correction: the experiences carry no rollout log-probs "
                             "(the engine's, `rollout_logprobs` in each shard) to correct against")
        self.sample_outcomes = {}
        if batch.weights_version is not None:  # by version lag: staleness/ metrics, rft_trainer_samples_total
            self.sample_outcomes, lag_metrics = sample_outcomes(
                batch.weights_version, self.step, sampled.action_mask, batch.action_mask, batch.rollout_logprobs,
                corrected=is_weights is not None)
            m.update(lag_metrics)
        ref_lp = None
        if self.ref is not None:
            with roles.timed(m, "time/ref_log_prob"):
                ref_lp = self.ref.compute_ref_log_prob(local)
        with roles.timed(m, "time/advantages"):
            adv, ret, values = self._advantages(batch, local, old_lp, ref_lp, sampled.action_mask)
        if self.critic is not None:
            with roles.timed(m, "time/update_critic"):
                m.update(self.critic.update_critic(local, values, ret))
        with roles.timed(m, "time/update_actor"):
            m.update(self.actor.update_policy(local, old_lp, adv, ref_lp, weights=is_weights))
        self.step += 1
        m.update(batch_metrics(sampled, adv_local=adv, mask_local=local.action_mask))
        elapsed = time.perf_counter() - start
        m["time/step"] = elapsed
        m["perf/throughput"] = float(batch.attention_mask.sum()) / elapsed / self.rt.world_size
        m["training/global_step"] = self.step
        return self.step < self.config.trainer.total_steps, m

    def _rollout_correction(self, batch: Experiences, local: Experiences, old_lp: torch.Tensor,
                            m: dict) -> tuple[Experiences, Experiences, torch.Tensor | None]:
        """verl's rollout correction (`algorithm.rollout_correction`) on the global batch: the
        trainer's log-probs before the update against the engine's. Its `rollout_corr/`
        metrics always go into `m`; with the correction set, returns the batch and this
        rank's slice with the rejected tokens out of their action masks (so out of the
        advantages, the losses and the entropy), and this rank's IS weights (None without
        IS). Without it, the inputs as they are."""
        rc = self.config.algorithm.rollout_correction
        options = [RejectOption(o.name, o.threshold, o.threshold_lower) for o in rc.rollout_rs] if rc else []
        c = rollout_correction(gather(old_lp, self.rt), batch.rollout_logprobs, batch.action_mask,
                               rollout_is=rc.rollout_is if rc else None,
                               is_threshold=rc.rollout_is_threshold if rc else 2.0,
                               is_batch_normalize=rc.rollout_is_batch_normalize if rc else False,
                               rollout_rs=options)
        m.update(c.metrics)
        if rc is None:
            return batch, local, None
        idx = self.local_indices(len(batch))
        return (dataclasses.replace(batch, action_mask=c.mask), dataclasses.replace(local, action_mask=c.mask[idx]),
                None if c.weights is None else c.weights[idx])

    def local_slice(self, batch: Experiences) -> Experiences:
        n = len(batch) // self.rt.world_size
        return batch.select(torch.arange(self.rt.rank * n, (self.rt.rank + 1) * n, device=batch.tokens.device))

    def _advantages(self, batch, local, old_lp, ref_lp, sampled_mask=None):
        """The algorithm's advantage estimator (its profile's `advantage`, looked up in the
        registry) over the global batch; this rank's slice of (advantages, returns), and
        the critic's values of the local slice (None without a critic). The batch is the
        same on every rank: only what each rank computed on its slice (the KL penalty, the
        values) is gathered. `sampled_mask`: the action mask before rollout correction
        rejected tokens (default: the batch's), which places the outcome reward and the KL
        penalty as verl does (before its correction); the estimator gets the batch's."""
        a = self.config.algorithm
        if local.advantages is not None and local.returns is not None:
            return local.advantages, local.returns, None
        mask = batch.action_mask.float()
        sampled = batch.action_mask if sampled_mask is None else sampled_mask
        idx = self.local_indices(len(batch))
        local_sampled = sampled[idx]
        token_rewards = advs.outcome_to_token_rewards(batch.rewards, sampled.float())
        scores = batch.rewards
        # Without a KL loss term, KL goes into the reward (verl's apply_kl_penalty with a
        # fixed coefficient): token reward -= kl_coef * KL(old policy || ref), response
        # tokens only; a sequence's score (GRPO's) by the sum of its token penalties.
        if ref_lp is not None and not a.use_kl_loss:
            kl = losses.kl_penalty(old_lp, ref_lp, a.kl_estimator)
            kl_reward = gather(a.kl_coef * torch.where(local_sampled.bool(), kl, torch.zeros_like(kl)), self.rt)
            token_rewards = token_rewards - kl_reward
            scores = scores - kl_reward.sum(-1)
        values = self.critic.compute_values(local) if self.critic is not None else None
        inputs = advs.AdvantageBatch(scores=scores, token_rewards=token_rewards, response_mask=mask,
                                     group_ids=batch.group_ids, values=None if values is None else gather(values, self.rt))
        adv, ret = advs.get_adv_estimator(self.algorithm.advantage)(inputs, a)
        return adv[idx], ret[idx], values

    def local_indices(self, n_global: int) -> torch.Tensor:
        n = n_global // self.rt.world_size
        return torch.arange(self.rt.rank * n, (self.rt.rank + 1) * n, device=self.rt.device)

    # ------------------------------------------------------------ state the Trainer saves and exports

    def checkpoint_roles(self) -> dict[str, Any]:
        # The frozen reference is not saved: it is the initial policy, reloaded from model.path.
        return {"actor": self.actor, "critic": self.critic}

    def export_policy(self, storage: Storage, dest: str, dtype: str, stage: Stage | None = None) -> dict | None:
        model = self.actor.model
        tokens = self.probe_tokens or probe.fallback_tokens(model.config.get_text_config().vocab_size)
        check = probe.build_probe(model, self.rt.device, tokens, dtype, self.step)
        if self.adapter_versions:
            return export_adapter(model, self.rt, storage, dest, self.config.model.lora, self.config.model.path,
                                  self.step, dtype=dtype, extra_files={PROBE_FILE: check.to_json().encode()},
                                  stage=stage)
        return self.export_merged(storage, dest, dtype, extra_files={PROBE_FILE: check.to_json().encode()},
                                  stage=stage)

    def export_merged(self, storage: Storage, dest: str, dtype: str, **kw) -> dict | None:
        """The policy as a plain HF model (with LoRA, the base with the adapters merged): each
        version when the engines load whole models, and what a LoRA job whose versions are
        adapters leaves at its end, for serving elsewhere. Collective."""
        return export_hf(self.actor.model, self.rt, storage, dest, fetch_model(self.config.model.path, self.rt),
                         self.step, dtype=dtype, **kw)


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


def get_trainer_wrapper(config: JobConfig, rt: Runtime | None = None) -> TrainEngineWrapper:
    """The engine for `config` on the runtime `rt` (the Trainer's)."""
    return FSDPTrainEngine(config, rt)


