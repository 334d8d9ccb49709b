"""Owns each role's model, optimizer and scheduler and how it computes and updates: the actor,
reference and critic of verl's workers, without Ray (the FSDP engine's parts).

Each role wraps one FSDP2-sharded model. Every rank holds 1/world of the global batch
(a contiguous slice), runs it in micro-batches, and accumulates gradients; FSDP averages
gradients across ranks. Losses are normalised by the *global* count of tokens (or
sequences) in the mini-batch, so one step on W ranks equals one step on 1 process on the
same global batch (tested), whatever the micro-batch size. The metrics reported are the
whole mini-batch's in the same way (`MiniBatchMetrics`).
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from . import lora
from .algorithms import losses
from .experience import Experiences
from .models import no_weight_decay
from .parallelize import Runtime

Metrics = dict[str, float]


# ---------------------------------------------------------------- tensor helpers


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, with_entropy: bool = False):
    """Log-prob of each token given its prefix, aligned to `tokens`.

    logits (B,T,V) predict the *next* token, so position t of the output holds
    log p(tokens[t] | tokens[:t]) computed from logits[:, t-1]; position 0 is 0.
    Returns (logprob (B,T), entropy (B,T) or None).
    """
    shifted = logits[:, :-1].float()
    logp = torch.log_softmax(shifted, dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    lp = F.pad(logp, (1, 0))
    ent = F.pad(losses.entropy_from_logits(shifted), (1, 0)) if with_entropy else None
    return lp, ent


# Metrics that are token means whatever the loss aggregation (masked_mean over response
# tokens); the others (pg_loss, kl_loss, vf_loss) are aggregated as the loss is.
TOKEN_MEANS = frozenset(("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower", "actor/entropy",
                         "critic/vf_clipfrac"))


class MiniBatchMetrics:
    """The metrics of one mini-batch, as the whole mini-batch's values: each micro-batch's
    metric weighted by its share of the global count, the share its gradient gets
    (`losses.aggregate_count` for the loss terms, response tokens for the token means),
    summed over micro-batches and ranks. A mean of per-micro-batch means would not be the
    loss optimised: with micro-batch 1, GRPO's pg_loss at ratio 1 averages each
    sequence's -A and reads 0 as the group's advantages cancel."""

    def __init__(self, mask: torch.Tensor, mode: str, rt: Runtime):
        self.mode, self.rt = mode, rt
        t = torch.tensor([losses.aggregate_count(mask, mode), float(mask.sum())], dtype=torch.float64,
                         device=rt.device)
        if rt.world_size > 1:
            dist.all_reduce(t)
        self.loss_count, self.token_count = float(t[0]), float(t[1])
        self.sums: dict[str, float] = {}

    def loss_share(self, m: torch.Tensor) -> float:
        """This micro-batch's (response mask `m`) share of the mini-batch's loss."""
        return losses.aggregate_count(m, self.mode) / max(self.loss_count, 1.0)

    def add(self, metrics: dict, m: torch.Tensor) -> None:
        token_share = float(m.sum()) / max(self.token_count, 1.0)
        loss_share = self.loss_share(m)
        for k, v in metrics.items():
            self.sums[k] = self.sums.get(k, 0.0) + float(v) * (token_share if k in TOKEN_MEANS else loss_share)

    def result(self) -> Metrics:
        """Collective: the sums over every rank."""
        if self.rt.world_size == 1 or not self.sums:
            return dict(self.sums)
        keys = sorted(self.sums)
        t = torch.tensor([self.sums[k] for k in keys], dtype=torch.float64, device=self.rt.device)
        dist.all_reduce(t)
        return dict(zip(keys, t.tolist()))


def _avg(acc: dict[str, list[float]]) -> Metrics:
    return {k: sum(v) / len(v) for k, v in acc.items() if v}


def _grad_sync(model: nn.Module, enabled: bool) -> None:
    if hasattr(model, "set_requires_gradient_sync"):  # an FSDP2 module
        model.set_requires_gradient_sync(enabled)


def clip_and_step(model: nn.Module, optimizer, max_norm: float) -> float:
    """Clip the global gradient norm and step; a non-finite norm skips the step (one bad
    batch must not poison the weights). Returns the pre-clip norm."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # DTensor under FSDP2
    if torch.isfinite(norm):
        optimizer.step()
    return float(norm)


def make_optimizer(model: nn.Module, lr: float, betas=(0.9, 0.999), weight_decay: float = 0.01,
                   decay_all: bool = False):
    """AdamW over two parameter groups: `weight_decay` for the weights, none for biases and
    normalisation weights (`models.no_weight_decay`), as HF Trainer and OpenRLHF do; with
    `decay_all` (`optimizer.weightDecayAll`) one group decays everything, as verl and
    torchtitan do."""
    params = [p for p in model.parameters() if p.requires_grad]
    if decay_all:
        groups = [{"params": params}]
    else:
        skip = no_weight_decay(model)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        groups = [{"params": [p for n, p in named if n not in skip]},
                  {"params": [p for n, p in named if n in skip], "weight_decay": 0.0}]
        groups = [g for g in groups if g["params"]]
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), weight_decay=weight_decay)


def make_scheduler(opt, warmup_steps: int, total_steps: int, schedule: str = "constant",
                   min_lr_ratio: float = 0.0):
    """Linear warmup, then constant or cosine decay to `min_lr_ratio` x the base rate."""
    def factor(step: int) -> float:
        if warmup_steps and step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "cosine":
            progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
            cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
            return min_lr_ratio + (1 - min_lr_ratio) * cosine
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(opt, factor)


# ---------------------------------------------------------------- roles


class _Role:
    def __init__(self, model: nn.Module, rt: Runtime, micro_batch_size: int):
        self.model, self.rt, self.micro_batch_size = model, rt, micro_batch_size

    def _micro(self, batch: Experiences) -> list[Experiences]:
        return batch.split(self.micro_batch_size)

    def _forward(self, mb: Experiences) -> torch.Tensor:
        out = self.model(input_ids=mb.tokens, attention_mask=mb.attention_mask.long(), use_cache=False)
        return out.logits


@contextmanager
def evaluating(model: nn.Module) -> Iterator[None]:
    """Dropout off for a no-grad pass (old/reference log-probs, values), whatever the
    model's config says: with dropout on, those passes would follow each rank's RNG
    stream, and the PPO ratio would not start at 1."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


class LogProbRole(_Role):
    @torch.no_grad()
    def compute_log_prob(self, batch: Experiences, with_entropy: bool = False):
        """(logprob (B,T), entropy (B,T) or None) under the current weights, in eval mode."""
        lps, ents = [], []
        with evaluating(self.model):
            for mb in self._micro(batch):
                lp, ent = token_logprobs(self._forward(mb), mb.tokens, with_entropy)
                lps.append(lp)
                ents.append(ent)
        return torch.cat(lps), (torch.cat(ents) if with_entropy else None)


class Reference(LogProbRole):
    """The frozen initial policy, for the KL term: a model of its own, or with LoRA the
    actor's model with its adapters off (`adapters_off`)."""

    def __init__(self, model: nn.Module, rt: Runtime, micro_batch_size: int, adapters_off: bool = False):
        super().__init__(model, rt, micro_batch_size)
        self.adapters_off = adapters_off

    def compute_ref_log_prob(self, batch: Experiences) -> torch.Tensor:
        if not self.adapters_off:
            return self.compute_log_prob(batch)[0]
        with lora.adapters_off(self.model):
            return self.compute_log_prob(batch)[0]


class Actor(LogProbRole):
    def __init__(self, model, rt, algo, optimizer, scheduler):
        super().__init__(model, rt, algo.micro_batch_size)
        self.algo, self.optimizer, self.scheduler = algo, optimizer, scheduler

    def set_algorithm(self, algo) -> None:
        self.algo, self.micro_batch_size = algo, algo.micro_batch_size

    def clear_optimizer_state(self) -> None:
        self.optimizer.state.clear()

    def update_policy(self, batch: Experiences, old_logprob, advantages, ref_logprob=None, weights=None) -> Metrics:
        """PPO-clip epochs over mini-batches of the local shard. All (B,T) tensors align
        with `batch.tokens`; `weights` are rollout correction's IS weights (None: none).
        Returns each mini-batch's metrics over every rank (`MiniBatchMetrics`), averaged
        over the mini-batches and epochs."""
        a = self.algo
        mask = batch.action_mask.float()
        losses.check_finite("old_logprob", old_logprob, mask)
        if ref_logprob is not None:
            losses.check_finite("ref_logprob", ref_logprob, mask)
        acc: dict[str, list[float]] = {}
        idx = torch.arange(len(batch), device=mask.device)
        # mini_batch_size is global (like verl's ppo_mini_batch_size); each rank takes 1/W.
        local_mini = (a.mini_batch_size // self.rt.world_size) if a.mini_batch_size else len(batch)
        for _ in range(a.epochs):
            for mini in idx.split(max(1, local_mini)):
                for k, v in self._update_mini(batch, mini, old_logprob, advantages, ref_logprob, weights).items():
                    acc.setdefault(k, []).append(v)
        self.scheduler.step()
        out = _avg(acc)  # each a whole mini-batch's value, the same on every rank
        out["actor/lr"] = self.scheduler.get_last_lr()[0]
        return out

    def _update_mini(self, batch, mini, old_lp, adv, ref_lp, weights=None) -> Metrics:
        a = self.algo
        mode = a.loss_aggregation
        mask = batch.action_mask.float()
        # Denominators as `losses.aggregate` counts them (seq-mean modes skip empty responses).
        metrics_of = MiniBatchMetrics(mask[mini], mode, self.rt)
        clip_low = a.clip_ratio_low if a.clip_ratio_low is not None else a.clip_ratio
        clip_high = a.clip_ratio_high if a.clip_ratio_high is not None else a.clip_ratio
        self.optimizer.zero_grad(set_to_none=True)
        micros = mini.split(self.micro_batch_size)
        for i, sel in enumerate(micros):
            # Accumulate unsharded gradients locally; reduce-scatter once, on the last one.
            _grad_sync(self.model, i == len(micros) - 1)
            mb = batch.select(sel)
            m = mask[sel]
            lp, ent = token_logprobs(self._forward(mb), mb.tokens, with_entropy=True)
            losses.check_finite("logprob", lp.detach(), m)
            pg_loss, metrics = losses.policy_loss(
                old_lp[sel], lp, adv[sel], m, clip_low, clip_high, a.dual_clip_ratio, mode,
                weights=None if weights is None else weights[sel])
            loss = pg_loss
            metrics["actor/entropy"] = float(losses.aggregate(ent.detach(), m, "token-mean"))
            if a.entropy_coef:
                loss = loss - a.entropy_coef * losses.aggregate(ent, m, mode)
            if ref_lp is not None and a.use_kl_loss and a.kl_coef:
                kl = losses.aggregate(losses.kl_penalty(lp, ref_lp[sel], a.kl_estimator), m, mode)
                loss = loss + a.kl_coef * kl
                metrics["actor/kl_loss"] = float(kl.detach())
            # Weight by this micro-batch's share of the global mini-batch; FSDP's gradient
            # averaging divides by world size, which the factor W undoes.
            (loss * metrics_of.loss_share(m) * self.rt.world_size).backward()
            metrics_of.add(metrics, m)
        out = metrics_of.result()
        out["actor/grad_norm"] = clip_and_step(self.model, self.optimizer, a.grad_clip)
        return out

    update_actor = update_policy


class Critic(_Role):
    def __init__(self, model, rt, algo, optimizer, scheduler):
        super().__init__(model, rt, algo.micro_batch_size)
        self.algo, self.optimizer, self.scheduler = algo, optimizer, scheduler

    def _values(self, mb: Experiences) -> torch.Tensor:
        values = self.model(input_ids=mb.tokens, attention_mask=mb.attention_mask.long())  # models.ValueModel
        # The value of the state *before* token t predicts the return of generating it,
        # so values align with log-probs: position t comes from the hidden state at t-1.
        return F.pad(values[:, :-1].float(), (1, 0))

    @torch.no_grad()
    def compute_values(self, batch: Experiences) -> torch.Tensor:
        with evaluating(self.model):
            return torch.cat([self._values(mb) for mb in self._micro(batch)])

    def clear_optimizer_state(self) -> None:
        self.optimizer.state.clear()

    def update_critic(self, batch: Experiences, old_values, returns) -> Metrics:
        a = self.algo
        mode = a.loss_aggregation
        mask = batch.action_mask.float()
        acc: dict[str, list[float]] = {}
        idx = torch.arange(len(batch), device=mask.device)
        for _ in range(a.epochs):
            metrics_of = MiniBatchMetrics(mask, mode, self.rt)
            self.optimizer.zero_grad(set_to_none=True)
            micros = idx.split(self.micro_batch_size)
            for i, sel in enumerate(micros):
                _grad_sync(self.model, i == len(micros) - 1)
                mb, m = batch.select(sel), mask[sel]
                loss, metrics = losses.value_loss(self._values(mb), old_values[sel], returns[sel], m,
                                                  a.cliprange_value, mode)
                (loss * metrics_of.loss_share(m) * self.rt.world_size).backward()
                metrics_of.add(metrics, m)
            epoch = {**metrics_of.result(), "critic/grad_norm": clip_and_step(self.model, self.optimizer, a.grad_clip)}
            for k, v in epoch.items():
                acc.setdefault(k, []).append(v)
        self.scheduler.step()
        return _avg(acc)


@contextmanager
def timed(metrics: Metrics, name: str) -> Iterator[None]:
    """Records the wall time of the block as metrics[name] (seconds)."""
    start = time.perf_counter()
    yield
    metrics[name] = time.perf_counter() - start
