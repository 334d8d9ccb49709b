"""No-grad passes run without dropout, whatever the model's config says: old log-probs,
reference log-probs and values must not depend on an RNG stream (with 2 ranks each rank
draws different masks, and the PPO ratio would not start at 1)."""

from __future__ import annotations

import torch

from rft_contract.config import load_config
from rft_trainer.engine import FSDPTrainEngine
from tests.fixtures.batches import synthetic_batch
from tests.fixtures.models import save_tiny_model, tiny_vocab


def engine_for(model_dir, algo: str, rt) -> FSDPTrainEngine:
    config = load_config({
        "model": {"path": str(model_dir)},
        "algorithm": {"name": algo, "kl_coef": 0.01, "micro_batch_size": 2},
        "trainer": {"total_steps": 2, "batch_size": 4, "fsdp": {"mixed_precision": "fp32"}},
        "checkpoint": {"uri": "/unused"},
    }, env={})
    engine = FSDPTrainEngine(config, rt)
    engine.prepare()
    return engine


def test_no_grad_passes_ignore_dropout_and_leave_train_mode_on(tmp_path, world_of_one):
    model_dir = save_tiny_model(tmp_path / "m", attention_dropout=0.5)
    engine = engine_for(model_dir, "ppo", world_of_one)
    batch = synthetic_batch(4, 4, 6, vocab=len(tiny_vocab()), seed=2)
    first, _ = engine.actor.compute_log_prob(batch)
    again, _ = engine.actor.compute_log_prob(batch)
    assert torch.equal(first, again)
    assert torch.equal(first, engine.ref.compute_ref_log_prob(batch))  # same initial weights
    assert torch.equal(engine.critic.compute_values(batch), engine.critic.compute_values(batch))
    assert engine.actor.model.training and engine.critic.model.training  # updates still train


def test_the_config_really_has_dropout_on(tmp_path, world_of_one):
    """Guards the test above: in train mode the same forward pass is random."""
    model_dir = save_tiny_model(tmp_path / "m", attention_dropout=0.5)
    engine = engine_for(model_dir, "grpo", world_of_one)
    batch = synthetic_batch(4, 4, 6, vocab=len(tiny_vocab()), seed=2)
    mb = batch.split(2)[0]
    with torch.no_grad():
        assert not torch.equal(engine.actor._forward(mb), engine.actor._forward(mb))


def test_critic_head_has_no_dropout(tmp_path, world_of_one):
    """The value head (models.ValueModel) is one Linear on the backbone's last hidden state:
    no dropout between them, whatever the config's classifier_dropout."""
    engine = engine_for(save_tiny_model(tmp_path / "m"), "ppo", world_of_one)
    critic = engine.critic.model
    assert [name for name, _ in critic.named_children()] == ["model", "score"]
    assert type(critic.score) is torch.nn.Linear and critic.score.out_features == 1
