"""RL numerics for the trainer: advantage estimators and losses, as pure torch functions."""

from rft_trainer.algorithms.advantages import (
    gae_advantages,
    grpo_advantages,
    masked_mean,
    masked_var,
    masked_whiten,
    outcome_to_token_rewards,
)
from rft_trainer.algorithms.losses import (
    AGG_MODES,
    KL_ESTIMATORS,
    AggMode,
    KLEstimator,
    aggregate,
    aggregate_count,
    check_finite,
    entropy_from_logits,
    kl_penalty,
    policy_loss,
    value_loss,
)

__all__ = [
    "AGG_MODES",
    "KL_ESTIMATORS",
    "AggMode",
    "KLEstimator",
    "aggregate",
    "aggregate_count",
    "check_finite",
    "entropy_from_logits",
    "gae_advantages",
    "grpo_advantages",
    "kl_penalty",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "outcome_to_token_rewards",
    "policy_loss",
    "value_loss",
]
