"""Rollout correction against verl's formulas (verl/trainer/ppo/rollout_corr_helper.py and
core_algos.compute_policy_loss_vanilla at b178a3c): truncated IS at token and sequence
level, the rejection options and their masking edges (NaN-safe padding), the metrics, the
policy loss's weighting, and the engine's wiring (`algorithm.rolloutCorrection`). Expected
numbers are written out by hand or with plain Python floats, never by the code under test."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from rft_trainer import roles
from rft_trainer.algorithms import policy_loss
from rft_trainer.algorithms.rollout_correction import RejectOption, rollout_correction, sample_outcomes
from tests.trainer.test_verl_parity import CPU, TinyLM, close, config, engine, t, tiny_batch

E = math.exp
NAN, INF = float("nan"), float("inf")
# Row 0: log_ratio = old - rollout = [0.5, -1.0, 0.0] then padding (NaN / -inf there must
# not leak); row 1: [0.3, 0.4] then padding.
OLD = [[-1.0, -2.0, -0.5, 0.0], [-0.2, -0.1, 0.0, 0.0]]
ROLLOUT = [[-1.5, -1.0, -0.5, NAN], [-0.5, -0.5, -INF, 0.0]]
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)


def correct(**kw):
    return rollout_correction(t(OLD), t(ROLLOUT), MASK, **kw)


def finite(c):
    assert all(math.isfinite(v) for v in c.metrics.values()), c.metrics
    if c.weights is not None:
        assert torch.isfinite(c.weights).all()


def test_token_is_truncates_above_only_and_reports_the_weights_before_truncation():
    c = correct(rollout_is="token", is_threshold=1.5)
    finite(c)
    close(c.weights, [[1.5, E(-1.0), 1.0, 0.0], [E(0.3), E(0.4), 0.0, 0.0]])  # e^0.5 > 1.5
    assert c.mask.tolist() == MASK.tolist() and not c.weights.requires_grad
    raw = [E(0.5), E(-1.0), 1.0, E(0.3), E(0.4)]
    m = c.metrics
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx(sum(raw) / 5, rel=1e-5)
    assert m["rollout_corr/rollout_is_max"] == pytest.approx(E(0.5), rel=1e-5)
    assert m["rollout_corr/rollout_is_min"] == pytest.approx(E(-1.0), rel=1e-5)
    assert m["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(1 / 5)  # > 1.5
    assert m["rollout_corr/rollout_is_ratio_fraction_low"] == pytest.approx(1 / 5)  # < 1/1.5


def test_sequence_is_gives_every_token_its_response_s_summed_ratio():
    c = correct(rollout_is="sequence", is_threshold=2.0)
    finite(c)
    close(c.weights, [[E(-0.5)] * 3 + [0.0], [2.0, 2.0, 0.0, 0.0]])  # e^0.7 = 2.01 truncated
    m = c.metrics
    assert m["rollout_corr/rollout_is_ratio_fraction_high"] == 0.5  # 0.7 > log 2, per sequence
    assert m["rollout_corr/rollout_is_max"] == pytest.approx(E(0.7), rel=1e-5)
    assert m["rollout_corr/rollout_is_min"] == pytest.approx(E(-0.5), rel=1e-5)


def test_is_batch_normalize_divides_by_the_mean_of_the_truncated_weights():
    c = correct(rollout_is="token", is_threshold=1.5, is_batch_normalize=True)
    truncated = [1.5, E(-1.0), 1.0, E(0.3), E(0.4)]
    mean = sum(truncated) / 5
    close(c.weights[MASK], [w / mean for w in truncated])
    assert c.metrics["rollout_corr/rollout_is_batch_norm_factor"] == pytest.approx(mean, rel=1e-5)
    seq = correct(rollout_is="sequence", is_threshold=2.0, is_batch_normalize=True)
    seq_mean = (E(-0.5) + 2.0) / 2  # the mean of per-sequence means
    close(seq.weights[MASK], [E(-0.5) / seq_mean] * 3 + [2.0 / seq_mean] * 2)


def test_a_huge_log_ratio_is_bounded_at_20():
    c = rollout_correction(t([[30.0, 0.0]]), t([[0.0, 0.0]]), torch.tensor([[True, True]]),
                           rollout_is="token", is_threshold=2.0)
    finite(c)
    close(c.weights, [[2.0, 1.0]])
    assert c.metrics["rollout_corr/rollout_is_max"] == pytest.approx(E(20.0), rel=1e-5)


def test_token_k1_keeps_the_log_ratio_band_and_a_lower_bound_defaults_to_the_reciprocal():
    # k1 = -log_ratio = [-0.5, 1.0, 0.0 | -0.3, -0.4]; band [log 0.5, log 2] = [-0.693, 0.693]
    c = correct(rollout_rs=[RejectOption("token_k1", 2.0)])
    finite(c)
    assert c.mask.tolist() == [[True, False, True, False], [True, True, False, False]]
    m = c.metrics
    assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(1 / 5)
    assert m["rollout_corr/rollout_rs_seq_masked_fraction"] == 0.5
    assert m["rollout_corr/rollout_rs_token_k1_mean"] == pytest.approx((-0.5 + 1.0 + 0.0 - 0.3 - 0.4) / 5, rel=1e-5)
    # an explicit lower bound: [log 0.75, log 2] = [-0.288, 0.693] also drops -0.5, -0.3, -0.4
    c = correct(rollout_rs=[RejectOption("token_k1", 2.0, 0.75)])
    assert c.mask.tolist() == [[False, False, True, False], [False, False, False, False]]


def test_sequence_options_decide_for_the_whole_response():
    k3 = [E(r) - 1 - r for r in (0.5, -1.0, 0.0)]  # row 0: mean 0.172
    k3_row1 = [E(r) - 1 - r for r in (0.3, 0.4)]  # mean 0.0701
    c = correct(rollout_rs=[RejectOption("seq_mean_k3", 0.1)])
    assert c.mask.tolist() == [[False] * 4, [True, True, False, False]]
    assert c.metrics["rollout_corr/rollout_rs_seq_mean_k3_mean"] == pytest.approx(
        (3 * sum(k3) / 3 + 2 * sum(k3_row1) / 2) / 5, rel=1e-5)  # the sequence's value on each token
    # seq_sum_k1: sums -0.5 and -0.7, band [log 0.5, log 2] keeps only row 0
    assert correct(rollout_rs=[RejectOption("seq_sum_k1", 2.0)]).mask.tolist() == [
        [True, True, True, False], [False] * 4]
    # seq_max_k2: max of r^2/2 is 0.5 (row 0) and 0.08 (row 1)
    assert correct(rollout_rs=[RejectOption("seq_max_k2", 0.1)]).mask.tolist() == [
        [False] * 4, [True, True, False, False]]


def test_options_combine_a_token_stays_only_if_every_option_keeps_it():
    c = correct(rollout_rs=[RejectOption("seq_max_k2", 0.1), RejectOption("token_k1", 2.0)])
    assert c.mask.tolist() == [[False] * 4, [True, True, False, False]]
    assert c.metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(3 / 5)
    assert c.metrics["rollout_corr/rollout_rs_token_k1_masked_fraction"] == pytest.approx(1 / 5)
    # IS weights are 0 where a token was rejected
    c = correct(rollout_is="token", rollout_rs=[RejectOption("token_k1", 2.0)])
    assert c.weights[0, 1] == 0 and c.weights[0, 0] > 0


def test_an_empty_response_and_an_all_padding_batch_give_no_nan():
    mask = torch.tensor([[False, False], [True, False]])
    c = rollout_correction(t([[0.0, 0.0], [-1.0, 0.0]]), t([[NAN, NAN], [-1.2, NAN]]), mask,
                           rollout_is="sequence", rollout_rs=[RejectOption("seq_max_k3", 1.0)])
    finite(c)
    none = rollout_correction(t([[0.0]]), t([[NAN]]), torch.tensor([[False]]), rollout_is="token",
                              rollout_rs=[RejectOption("token_k2", 1.0)])
    finite(none)
    assert none.weights.tolist() == [[0.0]] and none.mask.tolist() == [[False]]


def test_a_response_with_an_unreported_log_prob_is_left_out_not_read_as_probability_one():
    rollout = [row[:] for row in ROLLOUT]
    rollout[1][1] = NAN  # rft_rollout.rollouts writes NaN where the engine reported nothing
    c = rollout_correction(t(OLD), t(rollout), MASK, rollout_is="token", is_threshold=1.5,
                           rollout_rs=[RejectOption("token_k1", 1.2)])
    finite(c)
    close(c.weights[1], [1.0, 1.0, 0.0, 0.0])  # neutral weights, every token kept
    assert c.mask[1].tolist() == [True, True, False, False]
    assert c.mask[0].tolist() == [False, False, True, False]  # row 0 is corrected as before
    assert c.metrics["rollout_corr/unknown_logprob_fraction"] == 0.5
    assert c.metrics["rollout_corr/rollout_is_mean"] == pytest.approx((E(0.5) + E(-1.0) + 1.0) / 3, rel=1e-5)
    assert c.metrics["rollout_corr/kl"] == pytest.approx(-(0.5 - 1.0 + 0.0) / 3, rel=1e-5)


def test_a_floor_log_prob_gives_finite_metrics():
    # vLLM reports -9999 for a token it would never sample: large numbers, never inf
    c = rollout_correction(t([[-1.0, -2.0]]), t([[-9999.0, -2.0]]), torch.tensor([[True, True]]), rollout_is="token")
    finite(c)
    assert c.metrics["rollout_corr/k3_kl"] == pytest.approx((E(20.0) - 20.0 - 1) / 2, rel=1e-5)
    assert c.metrics["rollout_corr/rollout_ppl"] == pytest.approx(E(20.0), rel=1e-5)


def test_off_policy_metrics_are_verl_s():
    m = correct().metrics
    lr = [0.5, -1.0, 0.0, 0.3, 0.4]
    assert m["rollout_corr/kl"] == pytest.approx(-sum(lr) / 5, rel=1e-5)
    assert m["rollout_corr/k3_kl"] == pytest.approx(sum(E(x) - x - 1 for x in lr) / 5, rel=1e-5)
    train = [(-1.0 - 2.0 - 0.5) / 3, (-0.2 - 0.1) / 2]
    roll = [(-1.5 - 1.0 - 0.5) / 3, (-0.5 - 0.5) / 2]
    assert m["rollout_corr/training_ppl"] == pytest.approx(sum(E(-x) for x in train) / 2, rel=1e-5)
    assert m["rollout_corr/rollout_ppl"] == pytest.approx(sum(E(-x) for x in roll) / 2, rel=1e-5)
    assert m["rollout_corr/log_ppl_diff"] == pytest.approx(sum(r - x for r, x in zip(roll, train)) / 2, rel=1e-5)
    assert m["rollout_corr/chi2_token"] == pytest.approx(sum(E(x) ** 2 for x in lr) / 5 - 1, rel=1e-5)
    assert m["rollout_corr/chi2_seq"] == pytest.approx((E(2 * -0.5) + E(2 * 0.7)) / 2 - 1, rel=1e-5)


@pytest.mark.parametrize("bad, match", [
    (dict(name="token_k4", upper=2.0), "unknown option"),
    (dict(name="token_k2", upper=2.0, lower=0.5), "only k1"),
    (dict(name="token_k1", upper=2.0, lower=3.0), "lower threshold"),
    (dict(name="seq_sum_k1", upper=0.0), "must be > 0"),
    (dict(name="token_k1", upper=1.0), "would reject every token"),  # default lower 1/1 = upper
])
def test_bad_options_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        RejectOption(**bad)


def test_the_policy_loss_weights_each_clipped_token_loss():
    """compute_policy_loss_vanilla: pg_losses * rollout_is_weights, then agg_loss; the clip
    fraction is the unweighted one."""
    old = t([[-1.0, -1.0, -1.0]])
    new = old + t([[0.0, math.log(1.5), 0.0]])  # ratio 1, 1.5 (clipped at 1.2 for A > 0), 1
    adv, mask = t([[1.0, 1.0, -1.0]]), torch.ones(1, 3, dtype=torch.bool)
    w = t([[0.5, 2.0, 1.0]])
    loss, m = policy_loss(old, new, adv, mask, 0.2, 0.2, 3.0, "token-mean", weights=w)
    close(loss, (-1.0 * 0.5 + -1.2 * 2.0 + 1.0 * 1.0) / 3)  # max(-A r, -A clip(r)): -1.2 for token 2
    _, plain = policy_loss(old, new, adv, mask, 0.2, 0.2, 3.0, "token-mean")
    assert m["actor/pg_clipfrac"] == plain["actor/pg_clipfrac"]


def test_the_actor_takes_the_weights_zero_weights_move_nothing():
    algo = config().algorithm
    batch = tiny_batch()
    for weights, moves in ((torch.zeros_like(batch.action_mask, dtype=torch.float32), False), (None, True)):
        model = TinyLM()
        before = [p.detach().clone() for p in model.parameters()]
        actor = roles.Actor(model, CPU, algo, torch.optim.SGD(model.parameters(), lr=0.1), None)
        lp, _ = actor.compute_log_prob(batch)
        adv = torch.ones_like(lp) * batch.action_mask
        m = actor._update_mini(batch, torch.arange(len(batch)), lp, adv, None, weights)
        moved = max((p.detach() - b).abs().max().item() for p, b in zip(model.parameters(), before))
        assert (moved > 0) == moves, (weights, moved, m)


def test_the_engine_corrects_only_when_the_spec_asks_and_always_reports():
    batch = tiny_batch()
    old = torch.full(batch.tokens.shape, -1.0)
    rollout = old - math.log(4.0) * batch.action_mask  # pi_old / pi_rollout = 4 on every response token
    batch = dataclasses.replace(batch, rollout_logprobs=rollout)
    m: dict = {}
    same_batch, same_local, w = engine("grpo")._rollout_correction(batch, batch, old, m)
    assert same_batch is batch and same_local is batch and w is None
    assert m["rollout_corr/kl"] == pytest.approx(-math.log(4.0), rel=1e-5)
    eng = engine("grpo", rollout_correction={"rollout_is": "sequence", "rollout_is_threshold": 3.0,
                                             "rollout_rs": [{"name": "token_k1", "threshold": 8.0}]})
    m = {}
    b, local, w = eng._rollout_correction(batch, batch, old, m)
    assert torch.equal(b.action_mask, batch.action_mask) and torch.equal(local.action_mask, batch.action_mask)
    close(w, 3.0 * batch.action_mask.float())  # 4^len truncated at 3
    eng = engine("grpo", rollout_correction={"rollout_rs": [{"name": "token_k1", "threshold": 2.0}]})
    b, local, w = eng._rollout_correction(batch, batch, old, {})
    assert not b.action_mask.any() and not local.action_mask.any() and w is None  # log 4 is outside [log 1/2, log 2]


# ------------------------------------------------------------------ samples by version lag


def with_actor(eng):
    """A TinyLM actor with plain SGD, so the engine's whole train_step runs."""
    model = TinyLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    eng.actor = roles.Actor(model, CPU, eng.config.algorithm, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0))
    return eng


def test_sample_outcomes_by_lag():
    """Trained at version 10: masked when every response token was rejected; corrected
    under IS weights with known log-probs; trained otherwise (no IS, or a log-prob the
    engine did not report, which IS leaves at weight 1); lags of 8 and more share 8plus."""
    versions = torch.tensor([10, 9, 9, 1, 8, 8])
    sampled = torch.tensor([[1, 1], [1, 1], [1, 0], [1, 1], [1, 1], [0, 0]], dtype=torch.bool)
    kept = sampled.clone()
    kept[1] = False  # rejected whole
    kept[2, 0] = False  # its only token rejected
    kept[3, 1] = False  # partly rejected: still trained
    lp = torch.full((6, 2), -1.0)
    lp[4, 0] = NAN
    counts, metrics = sample_outcomes(versions, 10, sampled, kept, lp, corrected=True)
    assert counts == {("0", "corrected"): 1, ("1", "masked"): 2, ("8plus", "corrected"): 1,
                      ("2", "trained"): 1, ("2", "corrected"): 1}
    assert metrics["staleness/masked_lag_1"] == 2.0 and metrics["staleness/lag_max"] == 9.0
    assert metrics["staleness/lag_mean"] == pytest.approx((0 + 1 + 1 + 9 + 2 + 2) / 6)
    counts, _ = sample_outcomes(versions, 10, sampled, sampled, lp, corrected=False)
    assert counts == {("0", "trained"): 1, ("1", "trained"): 2, ("8plus", "trained"): 1, ("2", "trained"): 2}
    counts, _ = sample_outcomes(versions, 10, sampled, sampled, None, corrected=True)  # no log-probs: nothing weighted
    assert set(outcome for _, outcome in counts) == {"trained"}


def test_every_staleness_metric_name_is_one_mlflow_accepts():
    """MLflow refuses a batch with one bad name (HTTP 400): "8+" would cost every metric of the flush."""
    from mlflow.utils.validation import _validate_metric_name

    versions = torch.arange(0, 12)
    mask = torch.ones(12, 2, dtype=torch.bool)
    _, metrics = sample_outcomes(versions, 11, mask, mask, torch.zeros(12, 2), corrected=True)
    assert "staleness/corrected_lag_8plus" in metrics
    for name in metrics:
        _validate_metric_name(name)


def test_the_engine_reports_the_batch_by_version_lag():
    batch = tiny_batch()
    n = len(batch)
    versions = torch.tensor([3 - (i % 3) for i in range(n)])
    old = torch.full(batch.tokens.shape, -1.0)
    batch = dataclasses.replace(batch, weights_version=versions, rollout_logprobs=old.clone())
    eng = engine("grpo", rollout_correction={"rollout_is": "token"})
    with_actor(eng)
    eng.step = 3
    _, m = eng.train_step(batch)
    lags = [i % 3 for i in range(n)]
    assert eng.sample_outcomes == {(str(k), "corrected"): lags.count(k) for k in set(lags)}
    assert m["staleness/lag_max"] == 2.0 and m["staleness/corrected_lag_0"] == lags.count(0)


def test_the_correction_set_without_rollout_log_probs_is_an_error_naming_the_field():
    """A job that asks for rollout correction trains nothing uncorrected: experiences
    without the engine's log-probs (a buffer written by hand) stop it with the field's name."""
    eng = engine("grpo", rollout_correction={"rollout_is": "token"})
    with_actor(eng)
    with pytest.raises(ValueError, match=r"algorithm.rollout_correction: the experiences carry no rollout log-probs"):
        eng.train_step(tiny_batch())
