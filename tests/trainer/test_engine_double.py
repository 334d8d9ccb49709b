"""A second engine, written against `TrainEngineWrapper` alone (no FSDP, no model files),
trains under the real `Trainer` loop: the Trainer's own checkpointer saves and resumes
it, on local disk and on S3, and a resumed run ends where an uninterrupted one does."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from rft_contract.config import load_config
from rft_contract.layout import weights_uri
from rft_contract.manifest import file_entry, write_manifest
from rft_contract.storage import get_storage, join
from rft_trainer.checkpoint import latest_verified, list_steps, step_uri
from rft_trainer.engine import TrainEngineWrapper
from rft_trainer.experience import write_shard
from rft_trainer.trainer import Trainer
from tests.fixtures.batches import synthetic_batch
from tests.fixtures.reporting import Recorder

FEATURES = 4  # the first prompt tokens, as the linear model's input
VOCAB = 24


class LinearEngine(TrainEngineWrapper):
    """A linear reward regressor trained with AdamW: the smallest engine with a model, an
    optimizer and a scheduler, which is all a checkpoint holds of an engine."""

    def __init__(self, config, rt):
        self.config, self.step, self.policy = config, 0, None

    def prepare(self) -> None:
        torch.manual_seed(self.config.trainer.seed)
        model = nn.Linear(FEATURES, 1)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
        self.policy = SimpleNamespace(model=model, optimizer=optimizer, scheduler=scheduler)

    @property
    def train_step_num(self) -> int:
        return self.step

    def set_train_step_num(self, step: int) -> None:
        self.step = step

    def train_step(self, batch):
        p = self.policy
        x = batch.tokens[:, :FEATURES].float() / VOCAB  # (B, FEATURES)
        loss = (p.model(x).squeeze(-1) - batch.rewards.float()).square().mean()
        p.optimizer.zero_grad()
        loss.backward()
        p.optimizer.step()
        p.scheduler.step()
        self.step += 1
        return self.step < self.config.trainer.total_steps, {"loss": float(loss.detach())}

    def checkpoint_roles(self) -> dict:
        return {"policy": self.policy}

    def export_policy(self, storage, dest: str, dtype: str) -> dict:
        blob = json.dumps({k: v.tolist() for k, v in self.policy.model.state_dict().items()}).encode()
        storage.write_bytes(join(dest, "weights.json"), blob)
        manifest = {"step": self.step, "id": f"linear-{self.step}", "dtype": dtype,
                    "files": {"weights.json": file_entry(blob)}}
        write_manifest(storage, dest, manifest)
        return manifest


def write_shards(buffer, steps) -> None:
    for i in steps:  # the batch of step i, written at weights version i (never stale)
        batch = synthetic_batch(8, 4, 6, vocab=VOCAB, seed=i)
        batch.weights_version = batch.group_ids * 0 + i
        write_shard(str(buffer), f"shard-{i:04d}", batch)


def job(root: str, buffer) -> object:
    return load_config({
        "model": {"path": "unused"},  # the double builds its own model
        "algorithm": {"name": "grpo", "micro_batch_size": 2},
        "trainer": {"total_steps": 10, "batch_size": 8, "gpus_per_node": 0},
        "checkpoint": {"uri": root, "interval": 3},
        "sync": {"keep": 2},
        "buffer": {"uri": str(buffer)},
    }, env={})


def run(config, monkeypatch) -> tuple[Trainer, Recorder, str]:
    """prepare + train (until the buffer runs dry) + shutdown, through the Trainer only."""
    recorder = Recorder()
    monkeypatch.setattr("rft_trainer.trainer.StatusReporter.from_env", classmethod(lambda cls, **kw: recorder))
    trainer = Trainer(config, build_engine=LinearEngine)
    trainer.prepare()
    recorder.prepared = (trainer.train_step_num, state(trainer.engine))
    outcome = asyncio.run(trainer.train())
    trainer.checkpointer.wait_on_save_thread()
    return trainer, recorder, outcome


def state(engine: LinearEngine) -> dict:
    p = engine.policy
    return {"model": {k: v.clone() for k, v in p.model.state_dict().items()},
            "adam": [{k: v.clone() for k, v in s.items()} for s in p.optimizer.state.values()],
            "lr": p.scheduler.get_last_lr()}


def assert_same(a: dict, b: dict) -> None:
    assert a["lr"] == b["lr"]
    assert a["model"].keys() == b["model"].keys()
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert len(a["adam"]) == len(b["adam"])
    for x, y in zip(a["adam"], b["adam"]):
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


@pytest.mark.parametrize("where", ["local", "s3"])
def test_an_engine_written_against_the_abc_alone_saves_and_resumes_through_the_trainer(
        where, tmp_path, world_of_one, monkeypatch, request):
    root = str(tmp_path / "job") if where == "local" else f"s3://{request.getfixturevalue('bucket')}/job"
    storage = get_storage(root)

    # Uninterrupted: four batches, four steps (the interval's save at 3, the final one at 4).
    write_shards(tmp_path / "straight-buffer", range(4))
    straight, _, outcome = run(job(root + "-straight", tmp_path / "straight-buffer"), monkeypatch)
    assert outcome == "finished" and straight.train_step_num == 4

    # Interrupted: two batches (no interval save: the final save commits step 2) ...
    buffer = tmp_path / "buffer"
    write_shards(buffer, range(2))
    first, reported, outcome = run(job(root, buffer), monkeypatch)
    assert outcome == "finished" and first.train_step_num == 2
    assert reported.resumed == [(0, None)] and reported.checkpoints == [2]
    assert [(v, i) for v, _, i, _ in reported.weights] == [(1, "linear-1"), (2, "linear-2")]
    assert latest_verified(storage, root) == 2
    saved = state(first.engine)

    # ... then two more: the resume restores the model, AdamW, the schedule, the step and
    # the buffer position, so it trains on batches 2 and 3 and ends as the straight run.
    write_shards(buffer, range(2, 4))
    again, reported, outcome = run(job(root, buffer), monkeypatch)
    step, resumed = reported.prepared
    assert step == 2 and reported.resumed == [(2, step_uri(root, 2))]
    assert_same(resumed, saved)
    assert outcome == "finished" and again.train_step_num == 4
    assert reported.checkpoints == [3, 4] and sorted(list_steps(storage, root)) == [2, 3, 4]
    assert_same(state(again.engine), state(straight.engine))
    # Exported through the double's export_policy; the exporter applied sync.keep.
    assert reported.weights[-1] == (4, weights_uri(root, 4), "linear-4", [3, 4])
    assert storage.exists(join(weights_uri(root, 4), "weights.json"))


def test_an_attempt_that_resumes_at_the_last_step_trains_no_further(tmp_path, world_of_one, monkeypatch):
    """A gang that restarts after its final checkpoint (a later step of the end failed, or
    the pod died on the way out) resumes at totalSteps and finishes without a step more."""
    write_shards(tmp_path / "buffer", range(6))
    config = job(str(tmp_path / "job"), tmp_path / "buffer")
    config = config.model_copy(update={"trainer": config.trainer.model_copy(update={"total_steps": 3})})
    first, _, outcome = run(config, monkeypatch)
    assert outcome == "finished" and first.train_step_num == 3
    again, reported, outcome = run(config, monkeypatch)
    assert reported.prepared[0] == 3
    assert outcome == "finished" and again.train_step_num == 3, again.train_step_num
