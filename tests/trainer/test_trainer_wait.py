"""The trainer says why it waits, with true counts and times, and a stop ends the wait."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from rft_contract import names
from rft_contract.config import load_config
from rft_trainer.experience import write_shard
from rft_trainer.trainer import Trainer
from tests.fixtures.batches import synthetic_batch
from tests.fixtures.models import save_tiny_model


class Recorder:
    """Stands in for the status reporter (the API side is tests/integration/test_reporting.py)."""

    def __init__(self):
        self.waiting, self.buffer = [], []
        self.reported = threading.Condition()

    def report_waiting(self, reason, message, since, seconds):
        with self.reported:
            self.waiting.append((reason, message, seconds))
            self.reported.notify_all()

    def report_buffer(self, consumed, dropped_stale, samples):
        self.buffer.append((consumed, dropped_stale, samples))

    def __getattr__(self, name):  # report_step, report_checkpoint, close, ...
        return lambda *a, **kw: None


def stale_trainer(tmp_path, buffer_spec: dict | None = None, **algorithm) -> Trainer:
    """A trainer at step 5 whose buffer holds one shard of 8 samples from version 0, with
    the engine's log-probs (as an explorer writes them)."""
    save_tiny_model(tmp_path / "model")
    buffer = tmp_path / "buffer"
    buffer.mkdir()
    write_shard(str(buffer), "0000000000-e000", shard(version=0))
    config = load_config({
        "model": {"path": str(tmp_path / "model")},
        "algorithm": {"name": "grpo", "learning_rate": 1e-4, "micro_batch_size": 2, **algorithm},
        "trainer": {"total_steps": 10, "batch_size": 8, "gpus_per_node": 0, "fsdp": {"mixed_precision": "fp32"}},
        "checkpoint": {"uri": str(tmp_path / "ckpt")},
        "buffer": {"uri": str(buffer), "wait": True, "poll_seconds": 0.05, "max_staleness": 1, **(buffer_spec or {})},
    }, env={})
    t = Trainer(config)
    t.prepare()
    t.engine.set_train_step_num(5)  # the policy moved on: version-0 samples are stale (5 - 1 > 0)
    t.reporter = Recorder()
    return t


def shard(version: int):
    exp = synthetic_batch(8, 4, 6, vocab=24, seed=version)
    exp.weights_version = exp.group_ids * 0 + version
    exp.rollout_logprobs = torch.full(exp.tokens.shape, -3.0) * exp.action_mask
    return exp


def samples(t: Trainer, lag: str, outcome: str) -> float | None:
    return t.pod_metrics.registry.get_sample_value("rft_trainer_samples_total", {"lag": lag, "outcome": outcome})


@pytest.fixture
def trainer(tmp_path, world_of_one):
    t = stale_trainer(tmp_path)
    yield t
    t.checkpointer.wait_on_save_thread()


def test_stale_samples_kept_are_trained_under_the_correction_and_counted_by_lag(tmp_path, world_of_one):
    """spec.buffer.staleSamples keep: the version-0 shard is trained at step 5 (drop would
    wait for fresh samples, as the test below), its samples counted as corrected at lag 5."""
    t = stale_trainer(tmp_path, {"stale_samples": "keep", "wait": False}, rollout_correction={"rollout_is": "token"})
    try:
        assert asyncio.run(t.train_step()) and t.train_step_num == 6
        assert t.last_metrics["staleness/corrected_lag_5"] == 8 and t.last_metrics["staleness/lag_mean"] == 5
        assert samples(t, "5", "corrected") == 8 and samples(t, "5", "dropped") is None
        assert t.reporter.buffer[-1] == ({"e000": 8}, 0, 8)
    finally:
        t.checkpointer.wait_on_save_thread()


def test_stale_samples_dropped_are_counted_by_lag_with_the_batch_that_passed_them(tmp_path, world_of_one):
    t = stale_trainer(tmp_path)
    try:
        write_shard(t.config.buffer.uri, "0000000001-e000", shard(version=5))
        assert asyncio.run(t.train_step()) and t.train_step_num == 6
        assert samples(t, "5", "dropped") == 8 and samples(t, "0", "trained") == 8
        assert t.last_metrics["staleness/dropped_lag_5"] == 8 and t.last_metrics["staleness/lag_max"] == 0
    finally:
        t.checkpointer.wait_on_save_thread()


def test_waiting_on_stale_experiences_is_reported_with_true_counts_and_a_stop_ends_it(trainer, monkeypatch):
    monkeypatch.setattr("rft_trainer.trainer.WAIT_REPORT_EVERY", 0.2)
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("batch", trainer.next_batch()), daemon=True)
    thread.start()
    rec = trainer.reporter
    with rec.reported:
        assert rec.reported.wait_for(lambda: len(rec.waiting) >= 3, timeout=30)
    reason, message, seconds = rec.waiting[-1]
    assert reason == names.WAIT_STALE
    assert "8 samples dropped as stale while waiting" in message and "{'e000': 8}" in message
    # The seconds are measured, not counted per poll: polls of 0.05 s, reports 0.2 s apart.
    assert rec.waiting[-1][2] - rec.waiting[0][2] >= 0.3
    assert rec.buffer[-1] == ({"e000": 8}, 8, 0)  # the stale samples release the explorer's budget
    trainer.request_stop()
    thread.join(timeout=30)
    assert not thread.is_alive() and result["batch"] is None and trainer.stopping


def test_a_stop_right_after_a_resume_does_not_upload_the_resumed_step_again(tmp_path, world_of_one, monkeypatch):
    """The resumed step is committed: saving it again would first overwrite its files
    under the old manifest (a SIGKILL then leaves the newest checkpoint corrupt). Each
    attempt reports where it started (the operator's attempt history)."""
    import asyncio

    import rft_trainer.trainer as trainer_module

    resumed = []
    recorder = Recorder()
    recorder.report_resumed = lambda step, checkpoint: resumed.append((step, checkpoint))
    monkeypatch.setattr(trainer_module.StatusReporter, "from_env", classmethod(lambda cls, **kw: recorder))

    save_tiny_model(tmp_path / "model")
    buffer = tmp_path / "buffer"
    buffer.mkdir()
    for i in range(2):
        write_shard(str(buffer), f"shard-{i:04d}", synthetic_batch(8, 4, 6, vocab=24, seed=i))
    config = load_config({
        "model": {"path": str(tmp_path / "model")},
        "algorithm": {"name": "grpo", "learning_rate": 1e-4, "micro_batch_size": 2},
        "trainer": {"total_steps": 10, "batch_size": 8, "gpus_per_node": 0, "fsdp": {"mixed_precision": "fp32"}},
        "checkpoint": {"uri": str(tmp_path / "ckpt"), "interval": 100},
        "buffer": {"uri": str(buffer)},
    }, env={})
    first = Trainer(config)
    first.prepare()
    assert asyncio.run(first.train()) == "finished" and first.train_step_num == 2  # the buffer ran dry
    first.checkpointer.wait_on_save_thread()
    step_dir = tmp_path / "ckpt" / "ckpt" / "step-00000002"
    before = {p.name: p.stat().st_mtime_ns for p in step_dir.iterdir()}

    again = Trainer(config)
    again.prepare()
    assert again.train_step_num == 2
    assert resumed == [(0, None), (2, str(step_dir))]
    again.request_stop()
    assert asyncio.run(again.train()) == "stopped"
    again.checkpointer.wait_on_save_thread()
    assert {p.name: p.stat().st_mtime_ns for p in step_dir.iterdir()} == before
