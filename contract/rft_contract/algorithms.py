"""The algorithm catalogue: one `AlgorithmProfile` per `spec.algorithm.name`, the single place
its facts live (torch-free, so the operator, the CRD and the trainer all read it).

Everything else is derived from it or checked against it:
- the spec's `algorithm.name` and `algorithm.lossAggregation` enums (spec.py), and so the CRD;
- the spec's rule that a group-relative algorithm gets groups (`rolloutsPerTask >= 2`);
- the trainer's build (a critic only where `needs_critic`) and its advantage step, which
  looks up `advantage` in the trainer's estimator registry
  (`rft_trainer.algorithms.advantages.register_adv_est`, as verl's `register_adv_est`);
- the loss aggregation modes (`rft_trainer.algorithms.losses.AGG_MODES` is checked equal).

Adding an algorithm is one line here plus, for a new estimator, one registered function
in the trainer (docs/design.md, "How to add").
"""

from __future__ import annotations

from dataclasses import dataclass

# verl's agg_loss modes (core_algos.agg_loss), the loss's reduction over tokens.
LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
# verl's rollout correction (rollout_corr_helper.py): the IS levels and the rejection options
# (SUPPORTED_ROLLOUT_RS_OPTIONS); rft_trainer.algorithms.rollout_correction implements them.
ROLLOUT_IS_LEVELS = ("token", "sequence")
ROLLOUT_RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
                      "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")


@dataclass(frozen=True)
class AlgorithmProfile:
    name: str  # spec.algorithm.name
    advantage: str  # the trainer's advantage estimator, registered under this name
    needs_critic: bool  # a value model is built, trained and checkpointed beside the actor
    needs_groups: bool  # advantages relative to the other rollouts of the same task
    summary: str  # one line for the docs


ALGORITHMS: dict[str, AlgorithmProfile] = {p.name: p for p in (
    AlgorithmProfile("grpo", advantage="grpo", needs_critic=False, needs_groups=True,
                     summary="group-relative outcome advantage (reward minus the group's mean, "
                             "over its std unless normAdvByStd is false: Dr.GRPO)"),
    AlgorithmProfile("ppo", advantage="gae", needs_critic=True, needs_groups=False,
                     summary="GAE over a learned critic's values (gamma, lam)"),
    AlgorithmProfile("reinforce_plus_plus", advantage="reinforce_plus_plus", needs_critic=False,
                     needs_groups=False,
                     summary="REINFORCE++: discounted token returns (gamma), whitened over the batch; no critic"),
)}

ALGORITHM_NAMES: tuple[str, ...] = tuple(ALGORITHMS)
GROUP_ALGORITHMS: tuple[str, ...] = tuple(n for n, p in ALGORITHMS.items() if p.needs_groups)


def profile(name: str) -> AlgorithmProfile:
    """The profile of `spec.algorithm.name`; a ValueError naming the known ones otherwise."""
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ValueError(f"algorithm.name {name!r} is not one of {', '.join(ALGORITHM_NAMES)}") from None
