"""RL numerics against hand-computed tensors.

Every expected number below is written out (or derived with plain Python floats from a
hand-unrolled formula), never by calling the code under test.
"""

import math
import statistics

import pytest

import torch  # noqa: E402

from rft_trainer.algorithms import (  # noqa: E402
    AGG_MODES,
    aggregate,
    check_finite,
    entropy_from_logits,
    gae_advantages,
    grpo_advantages,
    kl_penalty,
    masked_mean,
    masked_var,
    masked_whiten,
    outcome_to_token_rewards,
    policy_loss,
    value_loss,
)

NAN, INF = float("nan"), float("inf")


def t(rows, dtype=torch.float32):
    return torch.tensor(rows, dtype=dtype)


def close(actual, expected, atol=1e-5):
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual, expected, atol=atol, rtol=1e-5)


# ---------------------------------------------------------------- masked statistics


def test_masked_mean_ignores_padding_even_when_nan():
    values = t([[1.0, 2.0, NAN], [4.0, INF, 6.0]])
    mask = t([[1, 1, 0], [1, 0, 1]])
    close(masked_mean(values, mask), (1 + 2 + 4 + 6) / 4)
    close(masked_mean(values, mask, dim=-1), [1.5, 5.0])


def test_masked_mean_of_empty_mask_is_zero_not_nan():
    assert masked_mean(t([[NAN, 3.0]]), t([[0, 0]])).item() == 0.0


def test_masked_var_is_bessel_corrected_and_whiten_uses_it():
    values, mask = t([[1.0, 2.0, 3.0, 100.0]]), t([[1, 1, 1, 0]])
    # mean 2, squared deviations 1, 0, 1 -> 2/3 biased, 2/2 = 1 unbiased
    close(masked_var(values, mask), 1.0)
    close(masked_var(values, mask, unbiased=False), 2 / 3)
    whitened = masked_whiten(values, mask)
    close(whitened[0, :3], [-1.0, 0.0, 1.0], atol=1e-4)
    close(masked_whiten(values, mask, shift_mean=False)[0, :3], [1.0, 2.0, 3.0], atol=1e-4)


def test_masked_var_refuses_fewer_than_two_entries():
    with pytest.raises(ValueError, match="at least 2"):
        masked_var(t([[1.0, 2.0]]), t([[1, 0]]))


# ---------------------------------------------------------------- GRPO

# groups (ids out of order on purpose): 7 -> [1, 0]; 2 -> [3, 0, 0]; 9 -> [5] (singleton)
GRPO_REWARDS = [1.0, 0.0, 3.0, 0.0, 0.0, 5.0]
GRPO_GROUPS = [7, 7, 2, 2, 2, 9]


def test_grpo_normalised_by_unbiased_group_std():
    mask = torch.ones(6, 3)
    adv, ret = grpo_advantages(t(GRPO_REWARDS), torch.tensor(GRPO_GROUPS), mask)
    eps = 1e-6
    # group 7: mean 0.5, std sqrt(0.5); group 2: mean 1, std sqrt((4 + 1 + 1) / 2) = sqrt(3)
    per_seq = [
        0.5 / (math.sqrt(0.5) + eps),  # 0.7071058
        -0.5 / (math.sqrt(0.5) + eps),
        2.0 / (math.sqrt(3.0) + eps),  # 1.1546999 (a biased std would give 1.414)
        -1.0 / (math.sqrt(3.0) + eps),  # -0.5773500
        -1.0 / (math.sqrt(3.0) + eps),
        0.0,  # a group of one has no baseline
    ]
    expected = [[a] * 3 for a in per_seq]
    close(adv, expected)
    close(ret, expected)


def test_grpo_without_std_is_dr_grpo_mean_centering():
    adv, _ = grpo_advantages(t(GRPO_REWARDS), torch.tensor(GRPO_GROUPS), torch.ones(6, 2), norm_by_std=False)
    close(adv, [[0.5] * 2, [-0.5] * 2, [2.0] * 2, [-1.0] * 2, [-1.0] * 2, [0.0] * 2])


def test_grpo_all_singleton_groups_give_zero():
    adv, _ = grpo_advantages(t([1.0, -2.0, 0.5]), torch.tensor([0, 1, 2]), torch.ones(3, 3))
    assert torch.equal(adv, torch.zeros(3, 3))


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_all_equal_rewards_give_exact_zero_not_float_residue(norm_by_std):
    # In float64, (0.1 + 0.1 + 0.1) / 3 = 0.10000000000000002: the centred rewards are not
    # exactly 0, and dividing that residue by std + eps must not leak into the advantages.
    rewards = t([0.1, 0.1, 0.1, 0.7, 0.7], dtype=torch.float64)
    adv, _ = grpo_advantages(rewards, torch.tensor([4, 4, 4, 5, 5]), torch.ones(5, 4), norm_by_std=norm_by_std)
    assert torch.equal(adv, torch.zeros(5, 4, dtype=torch.float64))
    assert torch.isfinite(adv).all()


def test_grpo_masks_tokens_and_empty_responses():
    mask = t([[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    adv, ret = grpo_advantages(t([2.0, 0.0, 1.0]), torch.tensor([0, 0, 0]), mask, norm_by_std=False)
    # mean 1 over all three rewards: the empty row still belongs to the group
    close(adv, [[1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    assert torch.equal(adv, ret)


def test_grpo_rejects_bad_inputs():
    ones = torch.ones(2, 3)
    with pytest.raises(ValueError, match="finite"):
        grpo_advantages(t([1.0, NAN]), torch.tensor([0, 0]), ones)
    with pytest.raises(ValueError, match="finite"):
        grpo_advantages(t([1.0, INF]), torch.tensor([0, 0]), ones)
    with pytest.raises(ValueError, match="group_ids"):
        grpo_advantages(t([1.0, 0.0]), torch.tensor([0, 0, 1]), ones)
    with pytest.raises(ValueError, match="integer"):
        grpo_advantages(t([1.0, 0.0]), t([0.0, 0.0]), ones)
    with pytest.raises(ValueError, match="response_mask"):
        grpo_advantages(t([1.0, 0.0]), torch.tensor([0, 0]), torch.ones(3, 3))
    with pytest.raises(ValueError, match=r"shape \(B,\)"):
        grpo_advantages(t([[1.0, 0.0]]), torch.tensor([0, 0]), ones)


# ---------------------------------------------------------------- outcome rewards -> tokens


def test_outcome_reward_lands_on_last_response_token():
    mask = t([[1, 1, 0], [1, 1, 1], [0, 0, 0], [0, 1, 1]])
    out = outcome_to_token_rewards(t([1.0, 2.0, 3.0, 4.0]), mask)
    close(out, [[0, 1, 0], [0, 0, 2], [0, 0, 0], [0, 0, 4]])


def test_outcome_rewards_reject_nan_and_shape_mismatch():
    with pytest.raises(ValueError, match="finite"):
        outcome_to_token_rewards(t([NAN]), torch.ones(1, 2))
    with pytest.raises(ValueError, match="response_mask"):
        outcome_to_token_rewards(t([1.0, 2.0]), torch.ones(1, 2))


# ---------------------------------------------------------------- GAE

GAMMA, LAM = 0.9, 0.8


def test_gae_matches_hand_unrolled_recurrence():
    rewards, values = [0.0, 0.0, 1.0], [0.5, 0.4, 0.3]
    adv, ret = gae_advantages(t([rewards]), t([values]), torch.ones(1, 3), GAMMA, LAM)
    a2 = rewards[2] + GAMMA * 0.0 - values[2]  # 0.7
    a1 = rewards[1] + GAMMA * values[2] - values[1] + GAMMA * LAM * a2  # 0.374
    a0 = rewards[0] + GAMMA * values[1] - values[0] + GAMMA * LAM * a1  # 0.12928
    close(ret, [[0.62928, 0.774, 1.0]])  # returns = raw advantages + values
    assert math.isclose(a0 + values[0], 0.62928, abs_tol=1e-9)  # the hand numbers agree
    # whitened over the 3 tokens with unbiased variance
    close(adv, [[-0.9493240, -0.0946251, 1.0439491]])


def test_gae_whitens_over_the_batch_and_ignores_padding():
    nan = NAN
    token_rewards = t([[0.0, 0.0, 1.0], [0.0, 2.0, nan]])
    values = t([[0.5, 0.4, 0.3], [1.0, 0.5, nan]])
    mask = t([[1, 1, 1], [1, 1, 0]])
    adv, ret = gae_advantages(token_rewards, values, mask, GAMMA, LAM)
    row1 = [0.0 + GAMMA * 0.5 - 1.0 + GAMMA * LAM * 1.5, 2.0 - 0.5]  # [0.53, 1.5]
    raw = [0.12928, 0.374, 0.7] + row1
    close(ret, [[0.62928, 0.774, 1.0], [1.53, 2.0, 0.0]])
    mean, std = statistics.fmean(raw), math.sqrt(statistics.variance(raw) + 1e-8)
    white = [(a - mean) / std for a in raw]
    close(adv, [white[:3], white[3:] + [0.0]])


def test_gae_skips_masked_tokens_in_the_middle():
    # position 1 is e.g. a tool-output token: its reward and value must not matter
    token_rewards = t([[0.0, 5.0, 1.0]])
    values = t([[0.5, 9.0, 0.3]])
    adv, ret = gae_advantages(token_rewards, values, t([[1, 0, 1]]), GAMMA, LAM)
    a2 = 1.0 - 0.3  # 0.7
    a0 = 0.0 + GAMMA * 0.3 - 0.5 + GAMMA * LAM * a2  # bootstraps from V at position 2: 0.274
    close(ret, [[a0 + 0.5, 0.0, a2 + 0.3]])  # [0.774, 0, 1.0]
    s = 1 / math.sqrt(2)  # two whitened values are always -+1/sqrt(2) with Bessel's n-1
    close(adv, [[-s, 0.0, s]], atol=1e-4)


def test_gae_rejects_shape_mismatch_and_nan_inside_mask():
    with pytest.raises(ValueError, match="shape"):
        gae_advantages(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3), 1.0, 1.0)
    with pytest.raises(ValueError, match="values"):
        gae_advantages(torch.zeros(1, 3), t([[0.0, NAN, 0.0]]), torch.ones(1, 3), 1.0, 1.0)


# ---------------------------------------------------------------- PPO clip

LOG = math.log


def test_policy_loss_clips_both_signs_pessimistically():
    # old log-prob 0, so ratio = exp(logprob)
    ratios = [[1.1, 1.5, 0.5], [0.9, 0.5, 1.5]]
    logprob = t([[LOG(r) for r in row] for row in ratios]).requires_grad_()
    old = torch.zeros(2, 3)
    adv = t([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    loss, metrics = policy_loss(old, logprob, adv, torch.ones(2, 3), 0.2, 0.2)
    # per token: A>0: max(-1.1,-1.1)=-1.1, max(-1.5,-1.2)=-1.2 (clipped), max(-0.5,-0.8)=-0.5
    #            A<0: max(0.9,0.9)=0.9,   max(0.5,0.8)=0.8 (clipped),   max(1.5,1.2)=1.5
    close(loss, (-1.1 - 1.2 - 0.5 + 0.9 + 0.8 + 1.5) / 6)  # 0.0666667
    close(metrics["actor/pg_loss"], 0.4 / 6)
    close(metrics["actor/pg_clipfrac"], 2 / 6)
    close(metrics["actor/ppo_kl"], -sum(LOG(r) for row in ratios for r in row) / 6)  # 0.0975691
    close(metrics["actor/pg_clipfrac_lower"], 0.0)
    loss.backward()
    # d/dlogprob of -A * ratio is -A * ratio; clipped tokens have no gradient
    close(logprob.grad, [[-1.1 / 6, 0.0, -0.5 / 6], [0.9 / 6, 0.0, 1.5 / 6]])


def test_policy_loss_asymmetric_clip_higher():
    logprob = t([[LOG(1.25), LOG(0.75)]])
    adv = t([[1.0, -1.0]])
    loss, metrics = policy_loss(torch.zeros(1, 2), logprob, adv, torch.ones(1, 2), 0.2, 0.28)
    # 1.25 < 1 + 0.28: not clipped (-1.25); 0.75 < 1 - 0.2: clipped to 0.8 for A<0
    close(loss, (-1.25 + 0.8) / 2)
    close(metrics["actor/pg_clipfrac"], 0.5)


def test_policy_loss_dual_clip_caps_negative_advantages():
    logprob = t([[LOG(5.0), LOG(2.0), LOG(5.0), LOG(5.0)]])
    adv = t([[-1.0, -1.0, 1.0, -2.0]])
    old, mask = torch.zeros(1, 4), torch.ones(1, 4)
    loss, metrics = policy_loss(old, logprob, adv, mask, 0.2, 0.2, dual_clip_ratio=3.0)
    # A=-1,r=5: min(max(5,1.2), 3)=3 (capped); A=-1,r=2: 2; A=+1,r=5: max(-5,-1.2)=-1.2;
    # A=-2,r=5: min(max(10,2.4), 6)=6 (capped)
    close(loss, (3.0 + 2.0 - 1.2 + 6.0) / 4)
    close(metrics["actor/pg_clipfrac_lower"], 2 / 4)
    close(metrics["actor/pg_clipfrac"], 1 / 4)
    loss_plain, metrics_plain = policy_loss(old, logprob, adv, mask, 0.2, 0.2)
    close(loss_plain, (5.0 + 2.0 - 1.2 + 10.0) / 4)
    close(metrics_plain["actor/pg_clipfrac_lower"], 0.0)
    with pytest.raises(ValueError, match="dual_clip_ratio"):
        policy_loss(old, logprob, adv, mask, 0.2, 0.2, dual_clip_ratio=1.0)


def test_policy_loss_ignores_nan_padding_and_aggregates_per_mode():
    logprob = t([[LOG(1.1), NAN, NAN], [LOG(0.9), LOG(1.1), LOG(1.0)]])
    adv = t([[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]])
    mask = t([[1, 0, 0], [1, 1, 1]])
    old = torch.zeros(2, 3)
    # per token (all unclipped): row0 [-1.1], row1 [-1.8, -2.2, -2.0]
    token_mean, m = policy_loss(old, logprob, adv, mask, 0.2, 0.2)
    close(token_mean, (-1.1 - 1.8 - 2.2 - 2.0) / 4)
    assert all(torch.isfinite(v) for v in m.values())
    seq_mean, _ = policy_loss(old, logprob, adv, mask, 0.2, 0.2, agg="seq-mean-token-mean")
    close(seq_mean, (-1.1 + (-6.0 / 3)) / 2)
    seq_sum, _ = policy_loss(old, logprob, adv, mask, 0.2, 0.2, agg="seq-mean-token-sum")
    close(seq_sum, (-1.1 - 6.0) / 2)


def test_policy_loss_rejects_shape_mismatch():
    with pytest.raises(ValueError, match="shape"):
        policy_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3), 0.2, 0.2)


# ---------------------------------------------------------------- KL estimators


@pytest.mark.parametrize(
    ("estimator", "expected"),
    [
        # log-ratio d = logprob - ref = [0.5, -1.0, 0.0, -25.0]
        ("k1", [0.5, -1.0, 0.0, -25.0]),
        ("k2", [0.125, 0.5, 0.0, 312.5]),  # 0.5 * d^2
        # x = ref - logprob = -d; exp(x) - x - 1; the last clamps x to 20 then the value to 10
        ("k3", [0.1065307, 0.7182818, 0.0, 10.0]),
        ("low_var_kl", [0.1065307, 0.7182818, 0.0, 10.0]),
    ],
)
def test_kl_estimators(estimator, expected):
    logprob = t([[-1.0, -2.0, -0.3, -30.0]])
    ref = t([[-1.5, -1.0, -0.3, -5.0]])
    close(kl_penalty(logprob, ref, estimator), [expected])


def test_k3_lower_clamp_and_unknown_estimator():
    # x = ref - logprob = -30 is clamped to -20 first: exp(-20) + 20 - 1 ~ 19, then to 10
    close(kl_penalty(t([[0.0]]), t([[-30.0]]), "k3"), [[10.0]])
    with pytest.raises(ValueError, match="KL estimator"):
        kl_penalty(t([[0.0]]), t([[0.0]]), "full")  # verl's name, but not implemented there either


# ---------------------------------------------------------------- aggregation

LOSS_MAT = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]]
AGG_MASK = [[1, 1, 1], [1, 0, 0], [0, 0, 0]]  # last row fully masked


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", (1 + 2 + 3 + 4) / 4),  # 2.5
        # verl's agg_loss: the empty row is left out of the denominator (2 sequences, not 3)
        ("seq-mean-token-sum", (6 + 4) / 2),  # 5.0
        ("seq-mean-token-mean", (2 + 4) / 2),  # 3.0
    ],
)
def test_aggregate_modes_with_an_all_masked_row(mode, expected):
    loss_mat = t(LOSS_MAT)
    loss_mat[2] = NAN  # padding garbage in the masked row must not leak
    close(aggregate(loss_mat, t(AGG_MASK), mode), expected)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregate_of_fully_masked_batch_is_zero(mode):
    assert aggregate(t(LOSS_MAT), torch.zeros(3, 3), mode).item() == 0.0


def test_aggregate_rejects_unknown_mode_and_shape_mismatch():
    with pytest.raises(ValueError, match="aggregation mode"):
        aggregate(t(LOSS_MAT), t(AGG_MASK), "seq-sum")
    with pytest.raises(ValueError, match="shape"):
        aggregate(t(LOSS_MAT), torch.ones(3, 2), "token-mean")


# ---------------------------------------------------------------- value loss


def test_value_loss_clipping():
    old_values = t([[1.0, 1.0], [1.0, 1.0]])
    values = t([[1.1, 1.5], [1.5, 0.5]])
    returns = t([[2.0, 2.0], [1.0, 0.0]])
    loss, metrics = value_loss(values, old_values, returns, torch.ones(2, 2), cliprange_value=0.2)
    # 1.1 in range: 0.81 | 1.5->1.2: max(0.25, 0.64)=0.64 clipped
    # 1.5->1.2, R=1: max(0.25, 0.04)=0.25 | 0.5->0.8, R=0: max(0.25, 0.64)=0.64 clipped
    close(loss, 0.5 * (0.81 + 0.64 + 0.25 + 0.64) / 4)  # 0.2925
    close(metrics["critic/vf_loss"], 0.2925)
    close(metrics["critic/vf_clipfrac"], 0.5)


def test_value_loss_respects_mask_and_mode():
    values, old, returns = t([[2.0, 9.0]]), t([[2.0, 0.0]]), t([[0.0, NAN]])
    loss, _ = value_loss(values, old, returns, t([[1, 0]]), 0.5, agg="seq-mean-token-sum")
    close(loss, 0.5 * 4.0)


# ---------------------------------------------------------------- entropy


def test_entropy_of_uniform_is_log_vocab():
    close(entropy_from_logits(torch.full((2, 3, 5), 0.7)), torch.full((2, 3), math.log(5)))


def test_entropy_hand_case_and_large_logits():
    logits = t([[[0.0, LOG(3.0)], [1000.0, 1000.0], [1e4, 0.0]]])
    # probs [0.25, 0.75]: -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.5623351; [1000, 1000] -> ln 2
    close(entropy_from_logits(logits), [[0.5623351, math.log(2), 0.0]])


# ---------------------------------------------------------------- finiteness guard


@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_check_finite_names_the_tensor(bad):
    logprob = t([[0.0, -1.0], [-2.0, bad]])
    with pytest.raises(ValueError, match=r"old_logprob has 1 non-finite .* \(1, 1\)"):
        check_finite("old_logprob", logprob, torch.ones(2, 2))


def test_check_finite_ignores_padding():
    check_finite("logprob", t([[0.0, NAN], [-1.0, INF]]), t([[1, 0], [1, 0]]))
    with pytest.raises(ValueError, match="logprob"):
        check_finite("logprob", t([[0.0, NAN]]))
