"""Rollout correction: the engine that sampled a response is not the trainer's policy (a
version behind, another kernel, bf16 against fp32), so its log-probs differ from the
trainer's. Truncated importance sampling (IS) reweights each token's policy-gradient loss by
pi_old / pi_rollout; rejection sampling (RS) drops tokens or whole sequences whose divergence
leaves a band. verl's formulas (verl/trainer/ppo/rollout_corr_helper.py at b178a3c,
compute_rollout_correction_and_rejection_mask, and core_algos.compute_policy_loss_vanilla,
where the weights multiply the clipped per-token loss), with its metric names under
`rollout_corr/`:

* log_ratio = old_logprob - rollout_logprob on response tokens (the trainer's log-probs
  before the update against the engine's);
* IS "token": w_t = exp(clamp(log_ratio_t, +-20)); "sequence": every token of a sequence
  gets exp(clamp(sum of its log_ratio, +-20)). Truncated above at `is_threshold` (no lower
  bound), detached, 0 off the response; optionally divided by their batch mean
  (`is_batch_normalize`; sequence level: the mean of per-sequence means);
* RS: per option a statistic of the log-ratio, kept inside its bounds: k1 = -log_ratio
  (= log pi_rollout / pi_old, as verl: the band bounds that ratio, so bounds that are not
  reciprocal are read that way round), kept when log(lower) <= k1 <= log(upper), lower
  1/upper unless given; k2 = log_ratio^2 / 2 and k3 = exp(log_ratio) - 1 - log_ratio (log_ratio
  clamped to +-20 first), kept when <= upper. "token_*" per token; "seq_sum_*",
  "seq_mean_*", "seq_max_*" over the sequence's response tokens, the decision for every
  token of it. A token stays only if every option keeps it; the rejected tokens leave the
  response mask, which advantages, the loss, entropy and KL then use;
* a response with a log-prob the engine did not report (NaN) is left out of all of it.

The off-policy metrics (kl, k3_kl, perplexities, chi2) compare pi_old with pi_rollout; verl's
logs overwrite the same keys with the actor's pi_theta against pi_rollout, so they differ from
verl's dashboards by one update; their exponentials are bounded at e^20 (k3_kl's log-ratio
clamped at +-20 as the rest, where verl's is not), so a floor log-prob gives a large number,
not inf. Log-probs are the raw model's (temperature 1), as the reference server and vLLM (by
default) return them.

Pure torch on a whole (global) batch; (B, T) tensors aligned with the tokens.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from rft_contract import staleness
from rft_contract.algorithms import ROLLOUT_IS_LEVELS as IS_LEVELS
from rft_contract.algorithms import ROLLOUT_RS_OPTIONS as RS_OPTIONS
from rft_trainer.algorithms.advantages import masked_mean

SAFETY_BOUND = 20.0
PREFIX = "rollout_corr/"


@dataclass(frozen=True)
class RejectOption:
    """One RS option: verl's name, its upper bound and (k1 only) its lower bound, default
    1/upper."""

    name: str
    upper: float
    lower: float | None = None

    def __post_init__(self) -> None:
        if self.name not in RS_OPTIONS:
            raise ValueError(f"rollout rejection: unknown option {self.name!r} (one of {', '.join(RS_OPTIONS)})")
        if not self.upper > 0:
            raise ValueError(f"rollout rejection {self.name}: the threshold must be > 0, got {self.upper}")
        if self.lower is not None and not self.name.endswith("_k1"):
            raise ValueError(f"rollout rejection {self.name}: only k1 options take a lower threshold")
        if self.lower is not None and not 0 < self.lower < self.upper:
            raise ValueError(f"rollout rejection {self.name}: the lower threshold must lie in (0, "
                             f"{self.upper}), got {self.lower}")
        if self.name.endswith("_k1") and self.lower is None and not self.upper > 1:
            raise ValueError(f"rollout rejection {self.name}: a threshold of {self.upper} needs a lower one "
                             "(the default, 1 / threshold, would reject every token)")

    @property
    def bounds(self) -> tuple[float | None, float]:
        """The bounds the statistic is compared with: logs for k1, the value for k2/k3."""
        if self.name.endswith("_k1"):
            return math.log(self.lower if self.lower is not None else 1.0 / self.upper), math.log(self.upper)
        return None, self.upper


@dataclass(frozen=True)
class Correction:
    weights: torch.Tensor | None  # (B, T) IS weights, detached, 0 off the response; None without IS
    mask: torch.Tensor  # (B, T) the response mask less the rejected tokens (the input's dtype)
    metrics: dict[str, float] = field(default_factory=dict)


def _seq_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, x, torch.zeros_like(x)).sum(-1)


def _seq_max(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    top = torch.where(mask, x, torch.full_like(x, -math.inf)).amax(-1)
    return torch.where(torch.isinf(top), torch.zeros_like(top), top)  # an empty response: 0


def importance_weights(log_ratio: torch.Tensor, mask: torch.Tensor, level: str, threshold: float,
                       batch_normalize: bool = False) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated IS weights (B, T) and their metrics (of the weights before truncation)."""
    if level not in IS_LEVELS:
        raise ValueError(f"rollout IS level must be one of {IS_LEVELS}, got {level!r}")
    if not threshold > 0:
        raise ValueError(f"rollout IS threshold must be > 0, got {threshold}")
    valid = mask.any(-1)
    if level == "token":
        stat = log_ratio
        w = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    else:
        stat = _seq_sum(log_ratio, mask)
        w = torch.exp(stat.clamp(-SAFETY_BOUND, SAFETY_BOUND))[:, None].expand_as(log_ratio)
    w = torch.where(mask, w, torch.zeros_like(w))  # not w * mask: a NaN in the padding stays out
    log_hi, log_lo = math.log(threshold), math.log(1.0 / threshold)
    if level == "token":
        high, low = masked_mean((w > threshold).float(), mask), masked_mean((w < 1.0 / threshold).float(), mask)
        w_max = torch.where(mask, w, torch.zeros_like(w)).max() if mask.any() else w.new_zeros(())
        w_min = torch.where(mask, w, torch.full_like(w, math.inf)).min() if mask.any() else w.new_zeros(())
    else:
        seq = stat[valid]
        high = (seq > log_hi).float().mean() if len(seq) else w.new_zeros(())
        low = (seq < log_lo).float().mean() if len(seq) else w.new_zeros(())
        w_max = torch.exp(seq.max().clamp(max=SAFETY_BOUND)) if len(seq) else w.new_zeros(())
        w_min = torch.exp(seq.min()) if len(seq) else w.new_zeros(())
    clipped = w.clamp(1.0 / threshold, threshold)
    normed = clipped / (masked_mean(clipped, mask) + 1e-8)
    metrics = {
        "rollout_is_mean": float(masked_mean(w, mask)),
        "rollout_is_max": float(w_max), "rollout_is_min": float(w_min),
        "rollout_is_ratio_fraction_high": float(high), "rollout_is_ratio_fraction_low": float(low),
        "rollout_is_eff_sample_size": float(1.0 / masked_mean(normed * normed, mask)) if mask.any() else 0.0,
    }
    w = w.clamp(max=threshold)
    if batch_normalize:
        if level == "token":
            mean = masked_mean(w, mask)
        else:
            per_seq = masked_mean(w, mask, dim=-1)[valid]
            mean = per_seq.mean() if len(per_seq) else w.new_zeros(())
        if float(mean) > 1e-8:
            w = w / mean
            metrics["rollout_is_batch_norm_factor"] = float(mean)
    return w.detach(), metrics


def rejection_mask(log_ratio: torch.Tensor, mask: torch.Tensor, options: Sequence[RejectOption]
                   ) -> tuple[torch.Tensor, dict[str, float]]:
    """(B, T) bool: the response tokens every option keeps; and the metrics."""
    safe = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    per_token = {"k1": -safe, "k2": 0.5 * safe * safe, "k3": torch.exp(safe) - 1.0 - safe}
    keep_all = torch.ones_like(mask)
    metrics: dict[str, float] = {}
    for opt in options:
        lower, upper = opt.bounds
        kind, stat = opt.name.rsplit("_", 1)[0], per_token[opt.name[-2:]]
        if kind != "token":
            reduce = {"seq_sum": _seq_sum, "seq_mean": functools.partial(masked_mean, dim=-1), "seq_max": _seq_max}
            stat = reduce[kind](stat, mask)
        keep = stat <= upper
        if lower is not None:
            keep &= stat >= lower
        if kind != "token":
            keep = keep[:, None].expand_as(mask)
        keep_all = keep_all & keep
        metrics[f"rollout_rs_{opt.name}_mean"] = float(masked_mean(
            stat if kind == "token" else stat[:, None].expand_as(log_ratio), mask))
        metrics[f"rollout_rs_{opt.name}_masked_fraction"] = float(masked_mean((~keep).float(), mask))
    dropped = mask & ~keep_all
    metrics["rollout_rs_masked_fraction"] = float(masked_mean(dropped.float(), mask))
    metrics["rollout_rs_seq_masked_fraction"] = float(dropped.any(-1).float().mean())
    return mask & keep_all, metrics


def off_policy_metrics(old_logprob: torch.Tensor, rollout_logprob: torch.Tensor, mask: torch.Tensor
                       ) -> dict[str, float]:
    """How far the engine's log-probs are from the trainer's (verl's compute_offpolicy_metrics)."""
    log_ratio = old_logprob - rollout_logprob
    valid = mask.any(-1)
    train_mlp, roll_mlp = (masked_mean(x, mask, dim=-1)[valid] for x in (old_logprob, rollout_logprob))
    if not len(train_mlp):
        return {}
    diff = roll_mlp - train_mlp
    safe = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)

    def exp(x: torch.Tensor) -> torch.Tensor:  # finite for the trackers: a floor log-prob (vLLM's -9999) is not inf
        return torch.exp(x.clamp(max=SAFETY_BOUND))

    return {
        "kl": float(masked_mean(rollout_logprob - old_logprob, mask)),
        "k3_kl": float(masked_mean(torch.exp(safe) - safe - 1, mask)),
        "training_ppl": float(exp(-train_mlp).mean()), "training_log_ppl": float((-train_mlp).mean()),
        "rollout_ppl": float(exp(-roll_mlp).mean()), "rollout_log_ppl": float((-roll_mlp).mean()),
        "log_ppl_diff": float(diff.mean()), "log_ppl_abs_diff": float(diff.abs().mean()),
        "ppl_ratio": float(exp(diff).mean()),
        "chi2_token": float(masked_mean(torch.exp(safe) ** 2, mask) - 1),
        "chi2_seq": float(torch.exp(2 * _seq_sum(safe, mask).clamp(-SAFETY_BOUND, SAFETY_BOUND))[valid].mean() - 1),
    }


def rollout_correction(old_logprob: torch.Tensor, rollout_logprob: torch.Tensor, response_mask: torch.Tensor, *,
                       rollout_is: str | None = None, is_threshold: float = 2.0, is_batch_normalize: bool = False,
                       rollout_rs: Sequence[RejectOption] = ()) -> Correction:
    """IS weights (with `rollout_is`), the response mask less what RS rejects, and the
    metrics (`rollout_corr/...`): the weights are computed on the mask before rejection, as
    verl does, and are 0 wherever a token was rejected."""
    if old_logprob.shape != rollout_logprob.shape or old_logprob.shape != response_mask.shape:
        raise ValueError(f"rollout correction: shapes differ: old {tuple(old_logprob.shape)}, rollout "
                         f"{tuple(rollout_logprob.shape)}, mask {tuple(response_mask.shape)}")
    sampled = response_mask.bool()
    # A response with a log-prob the engine did not report (NaN, rft_rollout.rollouts) or an
    # infinite one is left out: weight 1, kept, in no metric but `unknown_logprob_fraction`.
    unknown = (sampled & ~torch.isfinite(rollout_logprob)).any(-1)
    mask = sampled & ~unknown[:, None]
    log_ratio = (old_logprob - rollout_logprob).float()
    metrics: dict[str, float] = {"unknown_logprob_fraction": float(unknown[sampled.any(-1)].float().mean())
                                 if sampled.any() else 0.0}
    weights = None
    if rollout_is is not None:
        weights, m = importance_weights(log_ratio, mask, rollout_is, is_threshold, is_batch_normalize)
        weights = torch.where(unknown[:, None] & sampled, torch.ones_like(weights), weights)
        metrics.update(m)
    kept = mask
    if rollout_rs:
        kept, m = rejection_mask(log_ratio, mask, rollout_rs)
        metrics.update(m)
    kept = kept | (sampled & unknown[:, None])
    if weights is not None:
        weights = torch.where(kept, weights, torch.zeros_like(weights))
    metrics.update(off_policy_metrics(old_logprob.float(), rollout_logprob.float(), mask))
    return Correction(weights=weights, mask=kept.to(response_mask.dtype),
                      metrics={PREFIX + k: v for k, v in metrics.items()})


def sample_outcomes(versions: torch.Tensor, current: int, sampled_mask: torch.Tensor, kept_mask: torch.Tensor,
                    rollout_logprob: torch.Tensor | None, corrected: bool) -> tuple[dict[tuple[str, str], int],
                                                                                      dict[str, float]]:
    """What became of each sample of a batch trained at policy version `current`, by its
    version lag (`rft_contract.staleness`): masked when rollout correction rejected every
    response token it had; corrected when it trained under IS weights (`corrected`) with
    log-probs the engine reported; trained otherwise. Returns the counts and the
    `staleness/` tracker metrics (the counts, lag_mean and lag_max)."""
    lags = (current - versions.long()).clamp(min=0)
    had = sampled_mask.bool().any(-1)
    masked = had & ~kept_mask.bool().any(-1)
    if rollout_logprob is None or not corrected:
        weighted = torch.zeros_like(had)
    else:  # IS leaves a response with a log-prob the engine did not report at weight 1
        weighted = ~masked & ~(sampled_mask.bool() & ~torch.isfinite(rollout_logprob)).any(-1)
    outcome = [staleness.MASKED if m else staleness.CORRECTED if w else staleness.TRAINED
               for m, w in zip(masked.tolist(), weighted.tolist())]
    counts = staleness.count(zip(lags.tolist(), outcome))
    metrics = staleness.metric_names(counts)
    metrics[staleness.METRIC_PREFIX + "lag_mean"] = float(lags.float().mean()) if len(lags) else 0.0
    metrics[staleness.METRIC_PREFIX + "lag_max"] = float(lags.max()) if len(lags) else 0.0
    return counts, metrics
