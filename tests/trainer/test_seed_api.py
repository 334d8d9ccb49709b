"""The seed's interface, whole: an engine driven the way Trinity-RFT's Trainer drives one,
through the seed's names only (`train_step`, `train_step_num`, `save_state_dict`,
`upload_state_dict`, `sync_weight`, `save_checkpoint(block_until_saved=...)`, and the
checkpoint manager's `wait_on_save_thread`). The owners behind those names are the ones our
Trainer hands the engine in `prepare()`: its checkpoint manager and weight exporter."""

from __future__ import annotations

import inspect

import pytest
import torch
from safetensors.torch import load_file

from rft_contract.config import load_config
from rft_contract.layout import weights_uri
from rft_contract.storage import get_storage, join
from rft_trainer.checkpoint import CheckpointManager, latest_verified, step_uri
from rft_trainer.engine import FSDPTrainEngine, TrainEngineWrapper
from rft_trainer.export import verify
from rft_trainer.trainer import Trainer
from tests.fixtures.batches import synthetic_batch
from tests.fixtures.reporting import Recorder
from tests.fixtures.models import save_tiny_model

NONE = inspect.Parameter.empty
SEED_ENGINE = {  # the seed's TrainEngineWrapper (../shared/seed-trinity-trainer.txt): name -> (parameter, default)
    "prepare": [], "train_step": [("batch", NONE)], "save_checkpoint": [("block_until_saved", False)],
    "sync_weight": [], "upload_state_dict": [], "save_state_dict": [],
}


def config_for(tmp_path):
    return load_config({
        "model": {"path": str(tmp_path / "model")},
        "algorithm": {"name": "grpo", "learning_rate": 1e-3, "micro_batch_size": 2},
        "trainer": {"total_steps": 10, "batch_size": 8, "gpus_per_node": 0, "fsdp": {"mixed_precision": "fp32"}},
        "checkpoint": {"uri": str(tmp_path / "ckpt"), "interval": 100},
        "sync": {"keep": 2, "dtype": "fp32"},
        "buffer": {"uri": str(tmp_path / "buffer")},
    }, env={})


def prepared(config, monkeypatch) -> tuple[Trainer, Recorder]:
    recorder = Recorder()
    monkeypatch.setattr("rft_trainer.trainer.StatusReporter.from_env", classmethod(lambda cls, **kw: recorder))
    trainer = Trainer(config)
    trainer.prepare()  # builds the runtime, the engine, the checkpoint manager and the exporter
    return trainer, recorder


def actor_weights(engine: FSDPTrainEngine) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in engine.actor.model.state_dict().items()}


def test_the_engine_and_the_checkpoint_manager_have_the_seed_s_methods_with_its_signatures():
    for name, parameters in SEED_ENGINE.items():
        got = list(inspect.signature(getattr(TrainEngineWrapper, name)).parameters.values())[1:]  # after self
        assert [(p.name, p.default) for p in got] == parameters, name
    assert isinstance(inspect.getattr_static(TrainEngineWrapper, "train_step_num"), property)
    for name in ("save_checkpoint", "upload_state_dict", "wait_on_save_thread"):
        assert callable(getattr(CheckpointManager, name)), name


def test_an_engine_driven_as_trinity_s_trainer_drives_it_saves_syncs_and_resumes(tmp_path, world_of_one, monkeypatch):
    save_tiny_model(tmp_path / "model")
    config = config_for(tmp_path)
    root, storage = config.checkpoint.uri, get_storage(config.checkpoint.uri)
    trainer, recorder = prepared(config, monkeypatch)
    engine = trainer.engine

    # Trinity's Trainer: train_step, then sync by its configured method (checkpoint ->
    # save_state_dict, memory -> upload_state_dict, NCCL -> sync_weight), then save.
    ids = []
    for step, sync in enumerate(("save_state_dict", "upload_state_dict", "sync_weight"), start=1):
        cont, metrics = engine.train_step(synthetic_batch(8, 4, 6, vocab=24, seed=step))
        assert cont and engine.train_step_num == step and metrics["training/global_step"] == step
        getattr(engine, sync)()
        version, uri, export_id, _ = recorder.weights[-1]
        assert (version, uri) == (step, weights_uri(root, step))  # reported: the operator promotes it
        assert verify(storage, uri)["step"] == step  # every file there, with its size and sha256
        ids.append(export_id)
    assert [v for v, *_ in recorder.weights] == [1, 2, 3]
    assert recorder.weights[-1][3] == [2, 3]  # sync.keep applied
    exported = load_file(str(tmp_path / "ckpt" / "weights" / "step-00000003" / "model-00001.safetensors"))
    live = actor_weights(engine)
    assert exported and all(torch.equal(exported[k], live[k]) for k in exported)  # the current policy, not an older one

    # The three names at one step publish it once (the same export id, nothing rewritten).
    engine.save_state_dict()
    engine.upload_state_dict()
    engine.sync_weight()
    assert len(recorder.weights) == 3 and recorder.weights[-1][2] == ids[-1]

    engine.save_checkpoint(block_until_saved=False)  # returns once the state is copied
    engine.checkpointer.wait_on_save_thread()  # the seed's name: the upload is committed
    assert recorder.checkpoints == [3] and latest_verified(storage, root) == 3
    step_dir = tmp_path / "ckpt" / "ckpt" / "step-00000003"
    before = {p.name: p.stat().st_mtime_ns for p in step_dir.iterdir()}
    engine.save_checkpoint(block_until_saved=True)  # saved already: kept as it is
    assert {p.name: p.stat().st_mtime_ns for p in step_dir.iterdir()} == before

    # A new attempt resumes that checkpoint: the same step and the same policy.
    trainer.checkpointer.close()
    again, reported = prepared(config, monkeypatch)
    assert again.engine.train_step_num == 3 and reported.resumed == [(3, step_uri(root, 3))]
    resumed = actor_weights(again.engine)
    assert all(torch.equal(resumed[k], live[k]) for k in live)


def test_the_seed_s_methods_name_what_is_missing_on_an_engine_no_trainer_prepared(tmp_path):
    engine = FSDPTrainEngine(config_for(tmp_path))
    for name in ("save_checkpoint", "save_state_dict", "upload_state_dict", "sync_weight"):
        with pytest.raises(RuntimeError, match=r"FSDPTrainEngine\.\w+\(\): no checkpoint manager attached"):
            getattr(engine, name)()
    assert not (tmp_path / "ckpt").exists() and not get_storage(str(tmp_path)).exists(join(str(tmp_path), "ckpt"))
