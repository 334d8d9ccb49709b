"""Policy, value and KL losses for the RL trainer, matching verl's core_algos.

The choices, and why:
- Importance ratio exp(logp - old_logp), with the log-ratio clamped to [-20, 20] as in
  verl, so one stale token cannot overflow exp and poison the step.
- PPO clipping with separate low/high ranges, 1 - clip_ratio_low .. 1 + clip_ratio_high
  (clip_ratio_high > clip_ratio_low is DAPO's "clip-higher", which keeps low-probability
  tokens explorable). Dual clip (arXiv:1912.09729, verl's clip_ratio_c, 3.0 by default in
  the spec as in verl): for negative advantages the loss is capped at -A * c, so a huge
  ratio on a bad token cannot dominate the batch; `dual_clip_ratio=None` turns it off
  (verl cannot). Metrics as verl's compute_policy_loss_vanilla: pg_clipfrac counts tokens
  where the clipped term won, pg_clipfrac_lower those capped by the dual clip.
- Aggregation is chosen once, in `aggregate`, with verl's agg_loss semantics:
  "token-mean" (every token weighs the same; DAPO's default, no length bias per
  sequence), "seq-mean-token-mean" (original GRPO: every sequence weighs the same) or
  "seq-mean-token-sum" (Dr.GRPO style: no division by length). Like verl, the seq-mean
  modes average over the sequences that have at least one response token (verl's
  `seq_mask`): an empty response has no gradient to give, and counting it as a 0 would
  shrink every other sequence's weight by however many empties the batch happened to
  hold. Where verl would divide 0/0 (every sequence empty) this returns 0, never NaN;
  per-sequence token means divide by the exact count (verl adds 1e-8).
  `aggregate_count` gives the matching denominator, so micro-batches and ranks can be
  weighted to reproduce the whole-batch value.
- KL to the reference policy, `kl_penalty`, takes verl's names (kl_penalty_forward):
  "kl"/"k1" = log-ratio logprob - ref (unbiased, high variance, can be negative);
  "abs" = |log-ratio|; "mse"/"k2" = half squared log-ratio; "low_var_kl"/"k3" =
  r - log r - 1 with r = ref/policy (Schulman, http://joschu.net/blog/kl-approx.html),
  non-negative and low variance, with the log-ratio clamped to [-20, 20] before exp and
  the value to [-10, 10] after, as in verl. Only k3 is clamped, again as in verl.
- Value loss is PPO's clipped value loss, 0.5 * max(unclipped, clipped) squared error.
- Losses are pure: no config objects, no distributed calls. Metrics are detached 0-dim
  tensors so the engine can all-reduce them before calling `.item()` once.

Shapes: B sequences, T response tokens, V vocabulary. Masks are bool or 0/1, (B, T).
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

from rft_contract.algorithms import LOSS_AGGREGATIONS
from rft_trainer.algorithms.advantages import masked_mean

AggMode = Literal[LOSS_AGGREGATIONS]  # the contract's list (rft_contract.algorithms), the spec's enum
AGG_MODES: tuple[str, ...] = get_args(AggMode)

# verl's names, in the order of the spec's AlgorithmSpec.kl_estimator; aliases share a formula.
KLEstimator = Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"]
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
    """Reduce a per-token loss (B, T) to a scalar over masked-in tokens, as verl's agg_loss.

    token-mean:          sum over all kept tokens / number of kept tokens.
    seq-mean-token-sum:  mean, over the sequences with >= 1 kept token, of each one's token sum.
    seq-mean-token-mean: mean, over the sequences with >= 1 kept token, of each one's token mean.
    Empty sequences are left out of the seq-mean denominators (verl's seq_mask); a batch
    with nothing kept gives 0, not NaN. The denominator is `aggregate_count(mask, mode)`.
    """
    _check_same_shape(loss_mat=loss_mat, mask=mask)
    if mode == "token-mean":
        return masked_mean(loss_mat, mask)
    if mode not in AGG_MODES:
        raise ValueError(f"unknown aggregation mode {mode!r}; expected one of {AGG_MODES}")
    keep = mask.bool()
    seq_sums = torch.where(keep, loss_mat, torch.zeros_like(loss_mat)).sum(dim=-1)  # (B,)
    num_tokens = keep.sum(dim=-1)
    per_seq = seq_sums
    if mode == "seq-mean-token-mean":
        # An empty row has seq_sum 0, so it adds nothing to the sum below either way.
        per_seq = seq_sums / num_tokens.to(seq_sums.dtype).clamp(min=1)
    num_seqs = (num_tokens > 0).sum().to(seq_sums.dtype)
    return per_seq.sum() / num_seqs.clamp(min=1)


def aggregate_count(mask: torch.Tensor, mode: AggMode = "token-mean") -> float:
    """What `aggregate` divides by for `mask` (B, T): kept tokens for token-mean, sequences
    with at least one kept token for the seq-mean modes. Weighting each micro-batch's
    aggregate by its count over the global count reproduces the whole-batch aggregate."""
    if mode not in AGG_MODES:
        raise ValueError(f"unknown aggregation mode {mode!r}; expected one of {AGG_MODES}")
    keep = mask.bool()
    if mode == "token-mean":
        return float(keep.sum())
    return float(keep.any(dim=-1).sum())


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, estimator: KLEstimator) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference), verl's kl_penalty_forward:
    logprob (B, T), ref_logprob (B, T) -> (B, T).

    kl/k1: logprob - ref. abs: |logprob - ref|. mse/k2: 0.5 * (logprob - ref)^2.
    low_var_kl/k3: exp(x) - x - 1 with x = ref - logprob clamped to [-20, 20], the result
    clamped to [-10, 10].
    """
    _check_same_shape(logprob=logprob, ref_logprob=ref_logprob)
    if estimator in ("kl", "k1"):
        return logprob - ref_logprob
    if estimator == "abs":
        return (logprob - ref_logprob).abs()
    if estimator in ("mse", "k2"):
        return 0.5 * (logprob - ref_logprob).square()
    if estimator in ("low_var_kl", "k3"):
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
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate loss. All inputs (B, T); returns (scalar loss, metrics).

    Per token: max(-A * r, -A * clip(r, 1 - low, 1 + high)); with dual clip, tokens with
    A < 0 take min(that, -A * c), as verl's compute_policy_loss_vanilla with clip_ratio_c = c.
    Metrics: actor/pg_loss, actor/pg_clipfrac (share of tokens where the clipped term won),
    actor/ppo_kl (mean old - new log-prob), actor/pg_clipfrac_lower (share of tokens with
    A < 0 capped by the dual clip). `weights` (rollout correction's IS weights, detached)
    multiply each token's clipped loss before aggregation, as in verl; the clip fractions
    and ppo_kl do not see them.
    """
    _check_same_shape(old_logprob=old_logprob, logprob=logprob, advantages=advantages, response_mask=response_mask,
                      **({} if weights is None else {"weights": weights}))
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

    if weights is not None:
        losses = losses * weights
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
