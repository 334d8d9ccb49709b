"""The README's TensorBoard screenshot (issue 28) at the trainer's layer: a short GRPO run
on CPU (test_learning.py's toy task: a tiny random model learns to answer "7") sends each
step's metrics through the trainer's TensorBoard tracker; a real TensorBoard serves the
event files and headless Chromium captures the reward curve (e2e/screenshot.py). The PNG
must show the curve, rising.

The end-to-end demo test takes the same screenshot of the sample job's TensorBoard."""

from __future__ import annotations

import shutil
import time

import torch

from e2e.host import cache_dir
from e2e.screenshot import TensorBoardUI, curve_drawn, find_curve
from rft_contract.config import load_config
from rft_trainer.engine import FSDPTrainEngine
from rft_trainer.tracking import build_tracker
from tests.fixtures.models import save_tiny_model
from tests.trainer.test_learning import GROUP_SIZE, GROUPS, rollouts

STEPS = 20  # the sample job's totalSteps


def train_with_tensorboard(tmp_path) -> list[float]:
    """STEPS GRPO steps, each step's metrics to the TensorBoard tracker (event files under
    `<checkpoint.uri>/tensorboard/attempt-000/`); the rewards per step."""
    config = load_config({
        "model": {"path": str(save_tiny_model(tmp_path / "model", seed=3))},
        "algorithm": {"name": "grpo", "learning_rate": 3e-3, "kl_coef": 0.0, "micro_batch_size": 16,
                      "mini_batch_size": 32, "epochs": 1},
        "trainer": {"total_steps": STEPS, "batch_size": GROUPS * GROUP_SIZE, "seed": 0,
                    "fsdp": {"mixed_precision": "fp32"}},
        "checkpoint": {"uri": str(tmp_path / "job")},
        "tracking": {"tensorboard": {}},
        "job": {"name": "demo", "namespace": "default", "uid": "uid-1", "attempt": 0},
    }, env={})
    torch.manual_seed(0)
    engine = FSDPTrainEngine(config)
    engine.prepare()
    tracker = build_tracker(config, local_dir=str(tmp_path / "local"))
    gen, rewards = torch.Generator().manual_seed(0), []
    for step in range(1, STEPS + 1):
        _, metrics = engine.train_step(rollouts(engine.actor.model, gen, step - 1))
        tracker.log_metrics(step, metrics)
        rewards.append(metrics["critic/rewards/mean"])
    tracker.close(finished=True)
    return rewards


def test_tensorboard_shows_the_reward_curve_rising(tmp_path):
    rewards = train_with_tensorboard(tmp_path)
    assert sum(rewards[-3:]) > 2 * sum(rewards[:3]), rewards  # the toy task learns (test_learning.py)

    with TensorBoardUI(tmp_path / "job" / "tensorboard") as board:
        began = time.monotonic()
        png = board.screenshot(tmp_path / "tensorboard.png")
        took = time.monotonic() - began
    print(f"TensorBoard ready in {board.started_in:.1f}s, screenshot in {took:.1f}s")
    saved = cache_dir() / "screenshots" / "tensorboard-reward-trainer.png"
    saved.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(png, saved)  # to look at

    assert curve_drawn(png), f"no reward curve in {saved}"
    curve = find_curve(png)
    (_, y_first), (_, y_last) = curve[0], curve[-1]
    assert y_first - y_last > 100, f"the curve in {saved} does not rise (y {y_first} -> {y_last}, 0 at the top)"
