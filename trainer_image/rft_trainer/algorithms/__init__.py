"""RL numerics for the trainer: advantage estimators (registered by name) and losses, as pure
torch functions."""

from rft_trainer.algorithms.advantages import (
    ADV_ESTIMATORS,
    AdvantageBatch,
    gae_advantages,
    get_adv_estimator,
    grpo_advantages,
    masked_mean,
    masked_var,
    masked_whiten,
    outcome_to_token_rewards,
    register_adv_est,
    reinforce_plus_plus_advantages,
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
    "ADV_ESTIMATORS",
    "AGG_MODES",
    "AdvantageBatch",
    "KL_ESTIMATORS",
    "AggMode",
    "KLEstimator",
    "aggregate",
    "aggregate_count",
    "check_finite",
    "entropy_from_logits",
    "gae_advantages",
    "get_adv_estimator",
    "grpo_advantages",
    "kl_penalty",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "outcome_to_token_rewards",
    "policy_loss",
    "register_adv_est",
    "reinforce_plus_plus_advantages",
    "value_loss",
]
