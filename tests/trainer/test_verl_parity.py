"""verl parity: configs ported from verl (github.com/volcengine/verl) train the same way here.

Reference: verl/trainer/ppo/core_algos.py (kl_penalty / kl_penalty_forward, agg_loss,
compute_policy_loss_vanilla) and verl/trainer/ppo/ray_trainer.py (apply_kl_penalty).
Expected numbers are written out by hand or derived with plain Python floats, never by
calling the code under test.
"""

from __future__ import annotations

import math
import statistics
from types import SimpleNamespace
from typing import get_args

import pytest
import torch
from torch import nn

from rft_contract.config import load_config
from rft_contract.spec import AlgorithmSpec
from rft_trainer import roles
from rft_trainer.algorithms import (
    AGG_MODES,
    KL_ESTIMATORS,
    aggregate,
    aggregate_count,
    grpo_advantages,
    kl_penalty,
    policy_loss,
    reinforce_plus_plus_advantages,
)
from rft_trainer.engine import FSDPTrainEngine
from rft_trainer.experience import Experiences
from rft_trainer.parallelize import Runtime

NAN = float("nan")
LOG = math.log
CPU = Runtime(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def t(rows):
    return torch.tensor(rows, dtype=torch.float32)


def close(actual, expected, atol=1e-5):
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual, expected, atol=atol, rtol=1e-5)


def config(**algorithm):
    """A minimal job config through the same loader the trainer uses."""
    return load_config({
        "model": {"path": "s3://models/tiny"},
        "algorithm": {"name": "grpo", **algorithm},
        "trainer": {"total_steps": 10, "batch_size": 4},
        "checkpoint": {"uri": "s3://ckpts/x"},
    }, env={})


# ---------------------------------------------------------------- KL estimators

# log-ratio d = logprob - ref = [0.5, -1.0, 0.0, -25.0]
KL_LOGPROB = [[-1.0, -2.0, -0.3, -30.0]]
KL_REF = [[-1.5, -1.0, -0.3, -5.0]]
K1 = [0.5, -1.0, 0.0, -25.0]
ABS = [0.5, 1.0, 0.0, 25.0]  # |d|: no clamp in verl, so 25 stays 25
K2 = [0.125, 0.5, 0.0, 312.5]  # 0.5 * d^2, no clamp
# x = -d = [-0.5, 1, 0, 25]: exp(-0.5) + 0.5 - 1, e - 2, 0, and x -> 20 then value -> 10
K3 = [0.1065307, 0.7182818, 0.0, 10.0]


@pytest.mark.parametrize(
    ("estimator", "expected"),
    [("kl", K1), ("k1", K1), ("abs", ABS), ("mse", K2), ("k2", K2), ("low_var_kl", K3), ("k3", K3)],
)
def test_every_verl_kl_estimator_name(estimator, expected):
    close(kl_penalty(t(KL_LOGPROB), t(KL_REF), estimator), [expected])


@pytest.mark.parametrize(("alias", "name"), [("kl", "k1"), ("mse", "k2"), ("low_var_kl", "k3")])
def test_kl_aliases_are_the_same_estimator(alias, name):
    g = torch.Generator().manual_seed(0)
    logprob, ref = -5 * torch.rand(4, 7, generator=g), -5 * torch.rand(4, 7, generator=g)
    assert torch.equal(kl_penalty(logprob, ref, alias), kl_penalty(logprob, ref, name))


def test_abs_is_the_magnitude_of_k1():
    close(kl_penalty(t([[0.0, -3.0]]), t([[-2.0, 0.0]]), "abs"), [[2.0, 3.0]])


def test_kl_estimators_match_the_spec():
    assert set(KL_ESTIMATORS) == set(get_args(AlgorithmSpec.model_fields["kl_estimator"].annotation))
    for name in KL_ESTIMATORS:  # every name the spec accepts is computed
        assert kl_penalty(t(KL_LOGPROB), t(KL_REF), name).shape == (1, 4)


# ---------------------------------------------------------------- aggregation

LOSS_MAT = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [NAN, NAN, NAN]]
EMPTY_ROW_MASK = [[1, 1, 1], [1, 0, 0], [0, 0, 0]]  # the last response is empty


@pytest.mark.parametrize(
    ("mode", "expected", "count"),
    [
        ("token-mean", (1 + 2 + 3 + 4) / 4, 4),  # unchanged: the empty row has no tokens
        ("seq-mean-token-sum", (6 + 4) / 2, 2),  # 5.0, not (6 + 4 + 0) / 3
        ("seq-mean-token-mean", (2 + 4) / 2, 2),  # 3.0, not (2 + 4 + 0) / 3
    ],
)
def test_seq_mean_leaves_empty_responses_out_of_the_denominator(mode, expected, count):
    close(aggregate(t(LOSS_MAT), t(EMPTY_ROW_MASK), mode), expected)
    assert aggregate_count(t(EMPTY_ROW_MASK), mode) == count


@pytest.mark.parametrize("mode", AGG_MODES)
def test_all_empty_responses_aggregate_to_zero_not_nan(mode):
    loss = aggregate(t(LOSS_MAT), torch.zeros(3, 3), mode)
    assert loss.item() == 0.0
    assert aggregate_count(torch.zeros(3, 3), mode) == 0


@pytest.mark.parametrize("mode", AGG_MODES)
def test_micro_batches_weighted_by_count_reproduce_the_whole_batch(mode):
    mask = t(EMPTY_ROW_MASK)
    whole = aggregate(t(LOSS_MAT), mask, mode)
    total = aggregate_count(mask, mode)
    parts = sum(aggregate(t(LOSS_MAT)[i:i + 1], mask[i:i + 1], mode) * aggregate_count(mask[i:i + 1], mode) / total
                for i in range(3))
    close(parts, whole.item())


# ---------------------------------------------------------------- clip-higher and dual clip


def test_clip_higher_leaves_a_ratio_between_the_two_bounds_unclipped():
    old, logprob, adv, mask = torch.zeros(1, 1), t([[LOG(1.25)]]).requires_grad_(), t([[1.0]]), torch.ones(1, 1)
    # 1 + 0.2 < 1.25 < 1 + 0.28: clip-higher keeps the ratio and its gradient
    loss, m = policy_loss(old, logprob, adv, mask, 0.2, 0.28)
    close(loss, -1.25)
    close(m["actor/pg_clipfrac"], 0.0)
    loss.backward()
    close(logprob.grad, [[-1.25]])
    # symmetric 0.2 clips it to 1.2, with no gradient
    loss, m = policy_loss(old, logprob.detach(), adv, mask, 0.2, 0.2)
    close(loss, -1.2)
    close(m["actor/pg_clipfrac"], 1.0)


def test_dual_clip_is_on_by_default_and_none_disables_it():
    assert config().algorithm.dual_clip_ratio == 3.0
    assert config(dual_clip_ratio=None).algorithm.dual_clip_ratio is None
    assert config().algorithm.clip_ratio_low is None and config().algorithm.clip_ratio_high is None


# ---------------------------------------------------------------- the actor's update


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 8, dim: int = 4):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = nn.Embedding(vocab, dim), nn.Linear(dim, vocab)

    def forward(self, input_ids, attention_mask=None, use_cache=False):
        return SimpleNamespace(logits=self.head(self.emb(input_ids)))


def tiny_batch(empty_row: int | None = None) -> Experiences:
    """4 sequences: prompt of 2 tokens, responses of 3, 1, 2 and 3 tokens."""
    tokens = torch.tensor([[1, 2, 3, 4, 5], [2, 3, 4, 0, 0], [3, 4, 5, 6, 0], [4, 5, 6, 7, 1]])
    lengths = torch.tensor([3, 1, 2, 3])
    if empty_row is not None:
        lengths[empty_row] = 0
    pos = torch.arange(5)[None, :]
    attention = pos < (2 + lengths)[:, None]
    return Experiences(tokens=tokens, attention_mask=attention, action_mask=attention & (pos >= 2),
                       prompt_lengths=torch.full((4,), 2), rewards=torch.zeros(4),
                       group_ids=torch.zeros(4, dtype=torch.long)).validate()


def actor_step(algo, batch: Experiences, ratio: float, advantage: float):
    """One `_update_mini` on the whole batch with every token's ratio new/old = `ratio`.
    Returns (metrics, parameter change)."""
    model = TinyLM()
    before = [p.detach().clone() for p in model.parameters()]
    actor = roles.Actor(model, CPU, algo, torch.optim.SGD(model.parameters(), lr=0.1), None)
    lp, _ = actor.compute_log_prob(batch)
    old_lp = lp - LOG(ratio)
    adv = torch.full_like(lp, advantage) * batch.action_mask
    metrics = actor._update_mini(batch, torch.arange(len(batch)), old_lp, adv, None)
    moved = max((p.detach() - b).abs().max().item() for p, b in zip(model.parameters(), before))
    return metrics, moved


def test_actor_uses_clip_ratio_low_and_high():
    # ratio 1.25 with A > 0: clip-higher (high 0.28) keeps it, clip_ratio 0.2 alone clips it
    m, moved = actor_step(config(clip_ratio_high=0.28).algorithm, tiny_batch(), 1.25, 1.0)
    assert m["actor/pg_clipfrac"] == 0.0 and moved > 0
    m, moved = actor_step(config().algorithm, tiny_batch(), 1.25, 1.0)
    assert m["actor/pg_clipfrac"] == 1.0 and moved == 0.0
    # ratio 0.75 with A < 0: clip_ratio_low 0.3 keeps it (0.7 < 0.75), clip_ratio 0.2 clips it
    m, moved = actor_step(config(clip_ratio_low=0.3).algorithm, tiny_batch(), 0.75, -1.0)
    assert m["actor/pg_clipfrac"] == 0.0 and moved > 0
    m, moved = actor_step(config().algorithm, tiny_batch(), 0.75, -1.0)
    assert m["actor/pg_clipfrac"] == 1.0 and moved == 0.0


def test_actor_dual_clips_by_default():
    # ratio 5 with A = -1: max(5, 1.2) = 5 is capped at c = 3 (no gradient) unless disabled
    m, moved = actor_step(config().algorithm, tiny_batch(), 5.0, -1.0)
    close(torch.tensor(m["actor/pg_loss"]), 3.0)
    assert m["actor/pg_clipfrac_lower"] == 1.0 and moved == 0.0
    m, moved = actor_step(config(dual_clip_ratio=None).algorithm, tiny_batch(), 5.0, -1.0)
    close(torch.tensor(m["actor/pg_loss"]), 5.0)
    assert m["actor/pg_clipfrac_lower"] == 0.0 and moved > 0


def hand_aggregated_pg_loss(lp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """The PPO loss at ratio 1 (old = current log-probs), -A * exp(lp - sg(lp)) per token,
    aggregated with plain Python loops as verl's agg_loss does (empty responses skipped)."""
    ratio = torch.exp(lp - lp.detach())
    rows = [[-adv[i, j] * ratio[i, j] for j in range(lp.shape[1]) if mask[i, j]] for i in range(lp.shape[0])]
    rows = [r for r in rows if r]
    if mode == "token-mean":
        return sum(sum(r) for r in rows) / sum(len(r) for r in rows)
    if mode == "seq-mean-token-sum":
        return sum(sum(r) for r in rows) / len(rows)
    return sum(sum(r) / len(r) for r in rows) / len(rows)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_actor_step_with_an_empty_response_is_the_whole_batch_step(mode):
    """Micro-batches are weighted by what `aggregate` divides by, so one micro-batch of 4,
    two of 2 and four of 1 (one response empty) all take the step of the whole-batch loss."""
    batch = tiny_batch(empty_row=1)
    mask = batch.action_mask
    adv = t([[1.0] * 5, [1.0] * 5, [-1.0] * 5, [0.5] * 5]) * mask
    reference = TinyLM()
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    lp = roles.token_logprobs(reference(input_ids=batch.tokens).logits, batch.tokens)[0]
    hand_aggregated_pg_loss(lp, adv, mask, mode).backward()
    opt.step()
    for micro in (4, 2, 1):
        model = TinyLM()
        algo = config(loss_aggregation=mode, micro_batch_size=micro, mini_batch_size=4, grad_clip=1e6).algorithm
        actor = roles.Actor(model, CPU, algo, torch.optim.SGD(model.parameters(), lr=0.1), None)
        old_lp, _ = actor.compute_log_prob(batch)
        actor._update_mini(batch, torch.arange(4), old_lp, adv, None)
        for got, want in zip(model.parameters(), reference.parameters()):
            close(got.detach(), want.detach(), atol=1e-6)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_pg_loss_reports_the_loss_optimised_whatever_the_micro_batch(mode):
    """GRPO at ratio 1: each response's tokens carry its advantage A_i, and the group's A_i
    cancel. A mean of per-micro-batch losses with micro-batch 1 would read
    -mean_i(A_i) = 0; the metric is the whole mini-batch's aggregated loss instead, the
    same for micro-batch 1 and micro-batch = the batch."""
    batch = tiny_batch()  # responses of 3, 1, 2 and 3 tokens, one group
    rewards = t([1.0, 0.0, 0.0, 1.0])
    adv, _ = grpo_advantages(rewards, batch.group_ids, batch.action_mask.float())
    a = adv[:, 2].tolist()  # each response starts at position 2
    assert abs(sum(a)) < 1e-6
    lengths = [3, 1, 2, 3]
    expected = {"token-mean": -sum(x * n for x, n in zip(a, lengths)) / sum(lengths),
                "seq-mean-token-sum": -sum(x * n for x, n in zip(a, lengths)) / 4,
                "seq-mean-token-mean": -sum(a) / 4}[mode]
    reported = []
    for micro in (1, 4):
        model = TinyLM()
        algo = config(loss_aggregation=mode, micro_batch_size=micro, mini_batch_size=4, kl_coef=0.0).algorithm
        actor = roles.Actor(model, CPU, algo, torch.optim.SGD(model.parameters(), lr=0.1), None)
        old_lp, _ = actor.compute_log_prob(batch)
        reported.append(actor._update_mini(batch, torch.arange(4), old_lp, adv, None)["actor/pg_loss"])
    close(torch.tensor(reported), [expected, expected])
    if mode != "seq-mean-token-mean":  # there the per-sequence means cancel too
        assert abs(expected) > 0.1


# ---------------------------------------------------------------- KL in the reward


def kl_batch() -> tuple[Experiences, torch.Tensor, torch.Tensor]:
    """3 responses in one group; old - ref log-prob per response token:
    row 0: [0.5, -1.0], row 1: [0.0] (its masked position differs by 9), row 2: [1.0, 0.5]."""
    action = torch.tensor([[0, 1, 1], [0, 1, 0], [0, 1, 1]], dtype=torch.bool)
    batch = Experiences(tokens=torch.ones(3, 3, dtype=torch.long), attention_mask=torch.ones(3, 3, dtype=torch.bool),
                        action_mask=action, prompt_lengths=torch.ones(3, dtype=torch.long),
                        rewards=t([1.0, 0.0, 0.0]), group_ids=torch.zeros(3, dtype=torch.long)).validate()
    old = t([[0.0, -1.0, -2.0], [0.0, -0.5, 9.0], [0.0, -1.0, -1.0]])
    ref = t([[0.0, -1.5, -1.0], [0.0, -0.5, 0.0], [0.0, -2.0, -1.5]])
    return batch, old, ref


def engine(name: str, **algorithm) -> FSDPTrainEngine:
    cfg = load_config({
        "model": {"path": "s3://models/tiny"},
        "algorithm": {"name": name, "kl_coef": 0.1, "gamma": 1.0, "lam": 1.0, **algorithm},
        "trainer": {"total_steps": 10, "batch_size": 3},
        "checkpoint": {"uri": "s3://ckpts/x"},
    }, env={})
    return FSDPTrainEngine(cfg, CPU)


def grpo_by_hand(scores):
    mean, std = statistics.mean(scores), statistics.stdev(scores)
    return [(s - mean) / (std + 1e-6) for s in scores]


def test_grpo_folds_kl_into_the_reward_when_not_a_loss():
    batch, old, ref = kl_batch()
    adv, _, _ = engine("grpo", use_kl_loss=False, kl_estimator="abs")._advantages(batch, batch, old, ref)
    # verl's apply_kl_penalty then GRPO on the token-reward sum: score -= 0.1 * sum |old - ref|
    scores = [1.0 - 0.1 * (0.5 + 1.0), 0.0 - 0.1 * 0.0, 0.0 - 0.1 * (1.0 + 0.5)]  # [0.85, 0, -0.15]
    expected = grpo_by_hand(scores)
    close(adv, [[0.0, expected[0], expected[0]], [0.0, expected[1], 0.0], [0.0, expected[2], expected[2]]])


def test_grpo_with_kl_loss_leaves_the_reward_alone():
    batch, old, ref = kl_batch()
    adv, _, _ = engine("grpo", use_kl_loss=True, kl_estimator="abs")._advantages(batch, batch, old, ref)
    plain, _ = grpo_advantages(batch.rewards, batch.group_ids, batch.action_mask.float())
    close(adv, plain)


def test_ppo_folds_kl_into_the_token_rewards():
    batch, old, ref = kl_batch()
    eng = engine("ppo", use_kl_loss=False, kl_estimator="kl")
    eng.critic = SimpleNamespace(compute_values=lambda b: torch.zeros(3, 3))
    _, returns, _ = eng._advantages(batch, batch, old, ref)
    # token reward = outcome on the last response token - 0.1 * (old - ref) on every response
    # token; values 0 and gamma = lam = 1, so a return is the sum of the rewards from there on.
    # row 0: [-0.05, 1 + 0.1] ; row 1: [0 - 0] ; row 2: [-0.1, -0.05]
    close(returns, [[0.0, 1.05, 1.1], [0.0, 0.0, 0.0], [0.0, -0.15, -0.05]])


# ---------------------------------------------------------------- REINFORCE++ (the catalogue's third algorithm)


def whiten_by_hand(xs):
    """verl's masked_whiten over the masked-in values: unbiased variance, 1e-8 inside the rsqrt."""
    mean, var = statistics.mean(xs), statistics.variance(xs)
    return [(x - mean) / math.sqrt(var + 1e-8) for x in xs]


def test_reinforce_plus_plus_is_verl_s_discounted_return_whitened():
    # verl's compute_reinforce_plus_plus_outcome_advantage with gamma 0.5: G_t = r_t + 0.5 G_next,
    # G_next reset to 0 after a masked-out position; advantages = masked_whiten(G) * mask.
    mask = t([[0, 1, 1], [1, 0, 1], [0, 1, 0]])
    rewards = t([[9.0, 0.2, 1.0], [0.4, 7.0, 0.6], [0.0, 0.5, NAN]])  # NaN in padding must not leak
    adv, ret = reinforce_plus_plus_advantages(rewards, mask, gamma=0.5)
    # row 0: G2 = 1.0, G1 = 0.2 + 0.5 * 1.0 = 0.7 ; row 1: G2 = 0.6, the hole at t=1 resets, G0 = 0.4
    # row 2: G1 = 0.5 (the return from the NaN position is reset before it reaches t=1)
    returns = [0.7, 1.0, 0.4, 0.6, 0.5]
    close(ret, [[0.0, 0.7, 1.0], [0.4, 0.0, 0.6], [0.0, 0.5, 0.0]])
    w = whiten_by_hand(returns)
    close(adv, [[0.0, w[0], w[1]], [w[2], 0.0, w[3]], [0.0, w[4], 0.0]])


def test_reinforce_plus_plus_folds_kl_into_the_token_rewards_and_builds_no_critic():
    batch, old, ref = kl_batch()
    eng = engine("reinforce_plus_plus", use_kl_loss=False, kl_estimator="kl")
    assert not eng.algorithm.needs_critic and eng.critic is None
    adv, returns, values = eng._advantages(batch, batch, old, ref)
    # the same token rewards as PPO's (below), gamma 1, and no values: returns are reward-to-go
    close(returns, [[0.0, 1.05, 1.1], [0.0, 0.0, 0.0], [0.0, -0.15, -0.05]])
    w = whiten_by_hand([1.05, 1.1, 0.0, -0.15, -0.05])
    close(adv, [[0.0, w[0], w[1]], [0.0, w[2], 0.0], [0.0, w[3], w[4]]])
    assert values is None
