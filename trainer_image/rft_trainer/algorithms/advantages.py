"""Advantage estimators (GRPO, GAE, REINFORCE++), their registry, and the masked statistics
they share.

Semantics follow verl's `core_algos.compute_grpo_outcome_advantage`,
`compute_gae_advantage_return` and `compute_reinforce_plus_plus_outcome_advantage`.
Each is registered by name (`register_adv_est`, as verl's), the name an
`AlgorithmProfile.advantage` in the contract's catalogue (rft_contract.algorithms) gives;
the engine looks the estimator up there and calls it with an `AdvantageBatch`.
Shapes: B sequences, T response tokens.
Masks are bool or 0/1 tensors of shape (B, T); a position with mask 0 is
padding (or a non-policy token) and never influences any output.

Masked statistics select with `torch.where` rather than multiplying by the mask,
because padding may hold NaN/inf (e.g. log-probs past EOS) and NaN * 0 is NaN.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

# verl's masked_whiten adds this inside the rsqrt so a constant batch does not divide by 0.
WHITEN_EPS = 1e-8


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `values` over positions where `mask` is set; 0 where nothing is set.

    verl divides by `mask.sum() + 1e-8`; dividing by `max(count, 1)` is exact for a
    non-empty mask and still returns 0 (not NaN) for an empty one.
    """
    keep = mask.bool()
    total = torch.where(keep, values, torch.zeros_like(values)).sum(dim=dim)
    num_kept = keep.sum(dim=dim).to(total.dtype)
    return total / num_kept.clamp(min=1)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over all masked-in positions (a scalar), Bessel-corrected when `unbiased`."""
    keep = mask.bool()
    num_kept = int(keep.sum())
    if unbiased and num_kept < 2:
        # Same refusal as verl: n / (n - 1) is undefined, and silently returning 0 would
        # make masked_whiten blow advantages up by 1/sqrt(1e-8).
        raise ValueError(f"unbiased masked variance needs at least 2 masked-in entries, got {num_kept}")
    centered = values - masked_mean(values, keep)
    variance = masked_mean(centered**2, keep)
    if unbiased:
        variance = variance * (num_kept / (num_kept - 1))
    return variance


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(values - mean) / std with masked statistics; adds the mean back when not `shift_mean`."""
    mean = masked_mean(values, mask)
    whitened = (values - mean) * torch.rsqrt(masked_var(values, mask) + WHITEN_EPS)
    return whitened if shift_mean else whitened + mean


def _check_response_mask(response_mask: torch.Tensor, num_seqs: int) -> None:
    if response_mask.ndim != 2 or response_mask.shape[0] != num_seqs:
        raise ValueError(f"response_mask must have shape (B={num_seqs}, T), got {tuple(response_mask.shape)}")


def _check_rewards(rewards: torch.Tensor) -> None:
    if rewards.ndim != 1:
        raise ValueError(f"rewards must have shape (B,), got {tuple(rewards.shape)}")
    if not torch.isfinite(rewards).all():
        bad = torch.nonzero(~torch.isfinite(rewards)).flatten().tolist()
        raise ValueError(f"rewards must be finite; non-finite at sequence indices {bad}")


def outcome_to_token_rewards(rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Place each sequence's scalar reward on its last response token, for PPO/GAE.

    rewards (B,), response_mask (B, T) -> token_rewards (B, T). Uses the last masked-in
    position rather than `length - 1` so left padding or holes in the mask are handled.
    A sequence with an empty mask has nowhere to put its reward and gets a zero row.
    """
    _check_rewards(rewards)
    _check_response_mask(response_mask, rewards.shape[0])
    keep = response_mask.bool()
    num_tokens = response_mask.shape[1]
    positions = torch.arange(num_tokens, device=keep.device).expand_as(keep)
    last = torch.where(keep, positions, torch.full_like(positions, -1)).amax(dim=1)  # (B,)
    dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    token_rewards = torch.zeros(keep.shape, dtype=dtype, device=rewards.device)
    has_tokens = last >= 0
    rows = torch.nonzero(has_tokens).flatten()
    token_rewards[rows, last[rows]] = rewards[rows].to(dtype)
    return token_rewards


def grpo_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    response_mask: torch.Tensor,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-relative outcome advantages, broadcast over each response.

    rewards (B,) float, group_ids (B,) int (same id = same prompt), response_mask (B, T)
    -> (advantages (B, T), returns (B, T)); returns equal advantages, as in verl.

    A_i = (r_i - mean_g) / (std_g + eps), std unbiased like verl's torch.std.
    norm_by_std=False gives Dr.GRPO (arXiv:2503.20783): no std division, which removes
    the bias towards prompts whose rewards barely vary.
    A group whose rewards are all equal (including a group of one) carries no relative
    signal and gets advantage exactly 0, rather than float residue divided by eps.
    """
    _check_rewards(rewards)
    group_ids = torch.as_tensor(group_ids, device=rewards.device)
    if group_ids.shape != rewards.shape:
        raise ValueError(f"group_ids must have shape {tuple(rewards.shape)}, got {tuple(group_ids.shape)}")
    if group_ids.is_floating_point() or group_ids.is_complex():
        raise ValueError(f"group_ids must be an integer tensor, got {group_ids.dtype}")
    _check_response_mask(response_mask, rewards.shape[0])

    # float64 so that mean/std of small groups are not the noise the eps guards against.
    scores = rewards.to(torch.float64)
    _, group_of, num_in_group = torch.unique(group_ids, return_inverse=True, return_counts=True)
    num_groups = num_in_group.numel()
    zeros = scores.new_zeros(num_groups)
    mean = zeros.index_add(0, group_of, scores) / num_in_group
    centered = scores - mean[group_of]
    sum_sq = zeros.index_add(0, group_of, centered**2)
    std = torch.sqrt(sum_sq / (num_in_group - 1).clamp(min=1))
    group_max = zeros.scatter_reduce(0, group_of, scores, reduce="amax", include_self=False)
    group_min = zeros.scatter_reduce(0, group_of, scores, reduce="amin", include_self=False)
    no_signal = (group_max == group_min)[group_of]  # also true for every group of size 1

    advantage = centered / (std[group_of] + eps) if norm_by_std else centered
    advantage = torch.where(no_signal, torch.zeros_like(advantage), advantage)
    advantage = advantage.to(rewards.dtype if rewards.is_floating_point() else torch.float32)
    keep = response_mask.bool()
    advantages = torch.where(keep, advantage[:, None], advantage.new_zeros(()))
    return advantages, advantages.clone()


@torch.no_grad()
def gae_advantages(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation (arXiv:1506.02438) over response tokens.

    token_rewards (B, T), values (B, T), response_mask (B, T)
    -> (advantages (B, T) whitened over the masked batch, returns (B, T) = raw advantages + values).

    Reverse scan as in verl: delta_t = r_t + gamma * V_next - V_t and
    A_t = delta_t + gamma * lam * A_next, where "next" is the next masked-in position, so
    masked positions (padding, tool-output tokens) are skipped entirely. Both outputs are 0
    outside the mask (verl leaves whitening residue there).
    """
    if token_rewards.shape != values.shape or token_rewards.shape != response_mask.shape or token_rewards.ndim != 2:
        raise ValueError(
            "token_rewards, values and response_mask must share one (B, T) shape, got "
            f"{tuple(token_rewards.shape)}, {tuple(values.shape)}, {tuple(response_mask.shape)}"
        )
    keep = response_mask.bool()
    for name, tensor in (("token_rewards", token_rewards), ("values", values)):
        if not torch.isfinite(tensor[keep]).all():
            raise ValueError(f"{name} must be finite at masked-in positions")

    num_seqs, num_tokens = token_rewards.shape
    next_value = values.new_zeros(num_seqs)
    next_advantage = values.new_zeros(num_seqs)
    advantages_reversed = []
    for t in reversed(range(num_tokens)):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        advantage_t = delta + gamma * lam * next_advantage
        # where, not multiply-by-mask: padding may hold NaN and must not leak backwards.
        next_value = torch.where(keep[:, t], values[:, t], next_value)
        next_advantage = torch.where(keep[:, t], advantage_t, next_advantage)
        advantages_reversed.append(next_advantage)
    raw = torch.stack(advantages_reversed[::-1], dim=1)

    zero = raw.new_zeros(())
    returns = torch.where(keep, raw + values, zero)
    advantages = torch.where(keep, masked_whiten(raw, keep), zero)
    return advantages, returns


@torch.no_grad()
def reinforce_plus_plus_advantages(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (arXiv:2501.03262): no critic, no groups.

    token_rewards (B, T), response_mask (B, T) -> (advantages (B, T), returns (B, T)).
    Reverse scan as in verl: G_t = r_t + gamma * G_next, and G_next is reset to 0 past a
    masked-out position (verl's "reset after EOS"); advantages are the returns whitened
    over the masked batch. Both outputs are 0 outside the mask.
    """
    if token_rewards.shape != response_mask.shape or token_rewards.ndim != 2:
        raise ValueError("token_rewards and response_mask must share one (B, T) shape, got "
                         f"{tuple(token_rewards.shape)}, {tuple(response_mask.shape)}")
    keep = response_mask.bool()
    if not torch.isfinite(token_rewards[keep]).all():
        raise ValueError("token_rewards must be finite at masked-in positions")
    running = token_rewards.new_zeros(token_rewards.shape[0])
    returns_reversed = []
    for t in reversed(range(token_rewards.shape[1])):
        running = token_rewards[:, t] + gamma * running
        returns_reversed.append(running)
        # verl multiplies by the mask; where, so NaN in padding cannot leak backwards.
        running = torch.where(keep[:, t], running, torch.zeros_like(running))
    zero = token_rewards.new_zeros(())
    returns = torch.where(keep, torch.stack(returns_reversed[::-1], dim=1), zero)
    return torch.where(keep, masked_whiten(returns, keep), zero), returns


# ---------------------------------------------------------------- the registry


@dataclass(frozen=True)
class AdvantageBatch:
    """What an estimator may read, over the global batch (the same on every rank)."""

    scores: torch.Tensor  # (B,) the outcome reward, less the sequence's KL penalty when KL is in the reward
    token_rewards: torch.Tensor  # (B, T) the outcome on the last response token, less each token's KL penalty
    response_mask: torch.Tensor  # (B, T) float
    group_ids: torch.Tensor  # (B,) one id per task
    values: torch.Tensor | None  # (B, T) the critic's, for an algorithm whose profile needs_critic


AdvantageEstimator = Callable[[AdvantageBatch, Any], tuple[torch.Tensor, torch.Tensor]]
ADV_ESTIMATORS: dict[str, AdvantageEstimator] = {}


def register_adv_est(name: str) -> Callable[[AdvantageEstimator], AdvantageEstimator]:
    """Register `fn(batch: AdvantageBatch, algorithm_config) -> (advantages, returns)` under
    `name`, the `advantage` of a profile in rft_contract.algorithms."""
    def register(fn: AdvantageEstimator) -> AdvantageEstimator:
        if ADV_ESTIMATORS.get(name, fn) is not fn:
            raise ValueError(f"advantage estimator {name!r} is registered already")
        ADV_ESTIMATORS[name] = fn
        return fn
    return register


def get_adv_estimator(name: str) -> AdvantageEstimator:
    try:
        return ADV_ESTIMATORS[name]
    except KeyError:
        raise ValueError(f"no advantage estimator {name!r}; registered: {', '.join(sorted(ADV_ESTIMATORS))}") from None


@register_adv_est("grpo")
def _grpo(b: AdvantageBatch, a: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return grpo_advantages(b.scores, b.group_ids, b.response_mask, norm_by_std=a.norm_adv_by_std)


@register_adv_est("gae")
def _gae(b: AdvantageBatch, a: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if b.values is None:
        raise ValueError("the gae advantage needs the critic's values (AlgorithmProfile.needs_critic)")
    return gae_advantages(b.token_rewards, b.values, b.response_mask, a.gamma, a.lam)


@register_adv_est("reinforce_plus_plus")
def _reinforce_plus_plus(b: AdvantageBatch, a: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return reinforce_plus_plus_advantages(b.token_rewards, b.response_mask, a.gamma)
