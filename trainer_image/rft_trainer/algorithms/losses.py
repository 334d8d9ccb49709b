"""Policy, value and KL losses for the RL trainer, matching verl's core_algos.

The choices, and why:
- Importance ratio exp(logp - old_logp), with the log-ratio clamped to [-20, 20] as in
  verl, so one stale token cannot overflow exp and poison the step.
- PPO clipping with separate low/high ranges (clip_ratio_high > clip_ratio_low is DAPO's
  "clip-higher", which keeps low-probability tokens explorable). Optional dual clip
  (arXiv:1912.09729): for negative advantages the loss is capped at -A * c, so a huge
  ratio on a bad token cannot dominate the batch. Off unless `dual_clip_ratio` is given.
- Aggregation is chosen once, in `aggregate`: "token-mean" (every token weighs the same;
  DAPO's default, no length bias per sequence), "seq-mean-token-mean" (original GRPO:
  every sequence weighs the same) or "seq-mean-token-sum" (Dr.GRPO style: no division
  by length). Empty sequences contribute 0 and never produce NaN.
- KL to the reference policy uses Schulman's estimators (http://joschu.net/blog/kl-approx.html):
  k1 = log-ratio (unbiased, high variance), k2 = half squared log-ratio, k3 ("low_var_kl")
  = r - log r - 1 with r = ref/policy, non-negative and low variance; clamped to
  [-10, 10] as in verl.
- Value loss is PPO's clipped value loss, 0.5 * max(unclipped, clipped) squared error.
- Losses are pure: no config objects, no distributed calls. Metrics are detached 0-dim
  tensors so the engine can all-reduce them before calling `.item()` once.

Shapes: B sequences, T response tokens, V vocabulary. Masks are bool or 0/1, (B, T).
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

from rft_trainer.algorithms.advantages import masked_mean

AggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]
AGG_MODES: tuple[str, ...] = get_args(AggMode)

KLEstimator = Literal["k1", "k2", "k3", "low_var_kl"]
KL_ESTIMATORS: tuple[str, ...] = get_args(KLEstimator)

# verl clamps the log-ratio before exp and the k3 value after it; same bounds here.
LOG_RATIO_CLAMP = 20.0
K3_CLAMP = 10.0


def _check_same_shape(**tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) != 1:
        raise ValueError(f"expected one shared (B, T) shape, got {shapes}")


def check_finite(name: str, tensor: torch.Tensor, mask: torch.Tensor | None = None) -> None:
    """Raise ValueError naming `tensor` if any masked-in entry is NaN or inf.

    tensor (B, T) (any shape), mask broadcastable to it or None for "every entry".
    Padding outside the mask may legitimately hold garbage, so it is not checked.
    """
    bad = ~torch.isfinite(tensor)
    if mask is not None:
        bad = bad & mask.bool()
    num_bad = int(bad.sum())
    if num_bad:
        first = tuple(torch.nonzero(bad)[0].tolist())
        raise ValueError(
            f"{name} has {num_bad} non-finite (NaN/inf) entries inside the mask; first at index {first}"
        )


def aggregate(loss_mat: torch.Tensor, mask: torch.Tensor, mode: AggMode = "token-mean") -> torch.Tensor:
    """Reduce a per-token loss (B, T) to a scalar over masked-in tokens.

    token-mean:          sum over all kept tokens / number of kept tokens (0 if none).
    seq-mean-token-sum:  mean over B of each sequence's token sum.
    seq-mean-token-mean: mean over B of each sequence's token mean; verl divides 0/0 for an
                         empty sequence, here it contributes 0 and still counts in B.
    """
    _check_same_shape(loss_mat=loss_mat, mask=mask)
    if mode == "token-mean":
        return masked_mean(loss_mat, mask)
    keep = mask.bool()
    seq_sums = torch.where(keep, loss_mat, torch.zeros_like(loss_mat)).sum(dim=-1)  # (B,)
    if mode == "seq-mean-token-sum":
        return seq_sums.mean()
    if mode == "seq-mean-token-mean":
        num_tokens = keep.sum(dim=-1).to(seq_sums.dtype).clamp(min=1)
        return (seq_sums / num_tokens).mean()
    raise ValueError(f"unknown aggregation mode {mode!r}; expected one of {AGG_MODES}")


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, estimator: KLEstimator) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference): logprob (B, T), ref_logprob (B, T) -> (B, T)."""
    _check_same_shape(logprob=logprob, ref_logprob=ref_logprob)
    if estimator == "k1":
        return logprob - ref_logprob
    if estimator == "k2":
        return 0.5 * (logprob - ref_logprob).square()
    if estimator in ("k3", "low_var_kl"):
        log_ratio = (ref_logprob - logprob).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        return (torch.exp(log_ratio) - log_ratio - 1).clamp(-K3_CLAMP, K3_CLAMP)
    raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {KL_ESTIMATORS}")


def policy_loss(
    old_logprob: torch.Tensor,
    logprob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    dual_clip_ratio: float | None = None,
    agg: AggMode = "token-mean",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate loss. All inputs (B, T); returns (scalar loss, metrics).

    Per token: max(-A * r, -A * clip(r, 1 - low, 1 + high)); with dual clip, tokens with
    A < 0 take min(that, -A * c). Metrics: actor/pg_loss, actor/pg_clipfrac (share of
    tokens where the clipped term won), actor/ppo_kl (mean old - new log-prob),
    actor/pg_clipfrac_lower (share of tokens capped by the dual clip).
    """
    _check_same_shape(old_logprob=old_logprob, logprob=logprob, advantages=advantages, response_mask=response_mask)
    if clip_ratio_low < 0 or clip_ratio_high < 0:
        raise ValueError(f"clip ratios must be >= 0, got low={clip_ratio_low}, high={clip_ratio_high}")
    if dual_clip_ratio is not None and dual_clip_ratio <= 1.0:
        raise ValueError(f"dual_clip_ratio must be > 1 (it caps -A * ratio), got {dual_clip_ratio}")

    log_ratio = (logprob - old_logprob).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)
    losses = torch.maximum(unclipped, clipped)
    clipfrac = masked_mean((clipped > unclipped).float(), response_mask)

    if dual_clip_ratio is None:
        clipfrac_lower = clipfrac.new_zeros(())
    else:
        cap = -advantages * dual_clip_ratio
        capped = (advantages < 0) & (losses > cap)
        clipfrac_lower = masked_mean(capped.float(), response_mask)
        losses = torch.where(advantages < 0, torch.minimum(losses, cap), losses)

    loss = aggregate(losses, response_mask, agg)
    metrics = {
        "actor/pg_loss": loss.detach(),
        "actor/pg_clipfrac": clipfrac.detach(),
        "actor/ppo_kl": masked_mean(-log_ratio, response_mask).detach(),
        "actor/pg_clipfrac_lower": clipfrac_lower.detach(),
    }
    return loss, metrics


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    agg: AggMode = "token-mean",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss 0.5 * max((V - R)^2, (V_clip - R)^2), V_clip within old_values +- cliprange.

    All inputs (B, T); returns (scalar loss, {critic/vf_loss, critic/vf_clipfrac}).
    Taking the max makes the clip pessimistic: moving the value far from its old estimate
    never lowers the loss.
    """
    _check_same_shape(values=values, old_values=old_values, returns=returns, response_mask=response_mask)
    if cliprange_value < 0:
        raise ValueError(f"cliprange_value must be >= 0, got {cliprange_value}")
    values_clipped = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
    unclipped = (values - returns).square()
    clipped = (values_clipped - returns).square()
    loss = 0.5 * aggregate(torch.maximum(unclipped, clipped), response_mask, agg)
    metrics = {
        "critic/vf_loss": loss.detach(),
        "critic/vf_clipfrac": masked_mean((clipped > unclipped).float(), response_mask).detach(),
    }
    return loss, metrics


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) per position: logits (B, T, V) -> (B, T).

    H = logsumexp(z) - sum(softmax(z) * z), as verl, but on z - max(z): the two terms are
    then O(log V) instead of O(max z), so their difference keeps float32 precision for
    large logits (verl's unshifted form loses ~3e-5 at z ~ 1000).
    """
    shifted = logits - logits.amax(dim=-1, keepdim=True)
    probs = torch.softmax(shifted, dim=-1)
    return torch.logsumexp(shifted, dim=-1) - (probs * shifted).sum(dim=-1)
