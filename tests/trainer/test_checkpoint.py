"""Checkpoints against a real S3-compatible server (moto over HTTP), with torchrun workers.

One 2-rank PPO run (actor + critic, async saves every step, keep=2) is shared by the
module; tests copy its prefix before damaging it. Resharding is exact (DCP copies
shards), so resumed states are compared for equality; a resumed run continued on the
same world size replays the uninterrupted one exactly.
"""

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rft_contract.manifest import MANIFEST, read_manifest
from rft_trainer.checkpoint import (CheckpointError, CheckpointManager, apply_retention, latest_verified,
                                    list_steps, step_uri)
from rft_trainer.parallelize import Runtime
from rft_contract.s3 import S3Storage
from rft_contract.storage import LocalStorage, join
from tests.fixtures.models import save_tiny_model

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def s3_bucket(s3_server):
    """A module-wide bucket (the conftest `bucket` is per test)."""
    import uuid

    import boto3

    env = {"AWS_ENDPOINT_URL": s3_server, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test-secret",
           "AWS_REGION": "us-east-1", "AWS_DEFAULT_REGION": "us-east-1"}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        name = f"ckpt-{uuid.uuid4().hex[:10]}"
        boto3.client("s3").create_bucket(Bucket=name)
        yield name


@pytest.fixture(scope="module")
def storage(s3_bucket):
    return S3Storage()


def run_worker(tmp: Path, uri: str, nproc: int, steps: int, *flags: str) -> dict:
    out = tmp / f"out-{nproc}-{time.monotonic_ns()}.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0", str(HERE / "ckpt_worker.py"),
           str(tmp / "model"), uri, str(out), "--steps", str(steps), *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parents[1]),
           "RFT_CKPT_STAGING": str(tmp / "staging")}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-4000:]
    result = torch.load(out, weights_only=False)
    result["stderr"] = res.stderr
    return result


@pytest.fixture(scope="module")
def saved(tmp_path_factory, s3_bucket):
    """2 ranks train 4 steps, saving every step in the background, keeping 2."""
    tmp = tmp_path_factory.mktemp("ckpt")
    save_tiny_model(tmp / "model")
    uri = f"s3://{s3_bucket}/run-a"
    return {"tmp": tmp, "uri": uri, "result": run_worker(tmp, uri, 2, 4, "--keep", "2")}


def copy_prefix(storage, src: str, dst: str) -> None:
    for obj in storage.list(src + "/"):
        storage.write_bytes(dst + obj[len(src):], storage.read_bytes(obj))


def assert_same(x, y, path="state"):
    """Exact equality of nested dicts/lists of tensors and plain values."""
    if isinstance(x, torch.Tensor):
        assert torch.equal(x, y), f"{path}: max diff {(x.float() - y.float()).abs().max().item()}"
    elif isinstance(x, dict):
        assert x.keys() == y.keys(), f"{path}: keys differ {set(x) ^ set(y)}"
        for k in x:
            assert_same(x[k], y[k], f"{path}.{k}")
    elif isinstance(x, (list, tuple)):
        assert len(x) == len(y), path
        for i, (u, v) in enumerate(zip(x, y)):
            assert_same(u, v, f"{path}[{i}]")
    else:
        assert x == y, f"{path}: {x!r} != {y!r}"


def kill_mid_upload(storage, uri: str, step: int) -> None:
    """What a crash between the shard uploads and the manifest leaves behind."""
    prefix = step_uri(uri, step)
    storage.delete(join(prefix, MANIFEST))
    storage.delete(join(prefix, "__1_0.distcp"))


def test_save_commits_a_manifest_per_step_and_keeps_the_newest(saved, storage):
    steps = list_steps(storage, saved["uri"])
    assert sorted(steps) == [3, 4], "keep=2 of steps 1..4"
    for step, (prefix, names) in steps.items():
        manifest = read_manifest(storage, prefix)
        assert manifest["step"] == step and manifest["world_size"] == 2
        assert set(manifest["files"]) == {".metadata", "__0_0.distcp", "__1_0.distcp"}
        assert names == set(manifest["files"]) | {MANIFEST}
        for name, meta in manifest["files"].items():
            assert len(storage.read_bytes(join(prefix, name))) == meta["size"]
    assert latest_verified(storage, saved["uri"]) == 4
    assert saved["result"]["resumed"] is None


def test_resume_on_three_ranks_restores_what_two_saved(saved):
    r3 = run_worker(saved["tmp"], saved["uri"], 3, 4)
    assert r3["resumed"] == 4 and r3["world_size"] == 3
    assert r3["extra"] == {"buffer": {"shard": "shard-000004", "offset": 12, "stats": {"batches": 4}}}
    assert_same(saved["result"]["snapshots"][4], r3["snapshots"]["resumed"])


def test_killed_upload_is_ignored_and_one_rank_resumes_the_previous_step(saved, storage, caplog):
    uri = saved["uri"] + "-killed"
    copy_prefix(storage, saved["uri"], uri)
    kill_mid_upload(storage, uri, 4)
    with caplog.at_level(logging.WARNING, logger="rft_trainer.checkpoint"):
        assert latest_verified(storage, uri) == 3
    assert "checkpoint step 4 skipped" in caplog.text and "no manifest.json" in caplog.text
    r1 = run_worker(saved["tmp"], uri, 1, 3)
    assert r1["resumed"] == 3 and r1["extra"]["buffer"]["offset"] == 9
    assert "checkpoint step 4 skipped" in r1["stderr"]
    assert_same(saved["result"]["snapshots"][3], r1["snapshots"]["resumed"])


def test_resume_then_continue_matches_the_uninterrupted_run(saved, storage):
    uri = saved["uri"] + "-continue"
    copy_prefix(storage, saved["uri"], uri)
    kill_mid_upload(storage, uri, 4)
    c2 = run_worker(saved["tmp"], uri, 2, 4, "--keep", "2", "--block")
    assert c2["resumed"] == 3
    a = saved["result"]
    drop = ("time/", "perf/")
    assert {k: v for k, v in c2["metrics"][4].items() if not k.startswith(drop)} == \
           {k: v for k, v in a["metrics"][4].items() if not k.startswith(drop)}
    assert_same(a["snapshots"][4], c2["snapshots"][4])
    # The re-saved step 4 replaced the orphan, and is complete again.
    assert latest_verified(storage, uri) == 4


def test_corrupted_object_is_skipped_with_a_log_line_naming_it(saved, storage, caplog):
    uri = saved["uri"] + "-corrupt"
    copy_prefix(storage, saved["uri"], uri)
    target = join(step_uri(uri, 4), "__0_0.distcp")
    data = bytearray(storage.read_bytes(target))
    data[len(data) // 2] ^= 0xFF  # same size, different bytes
    storage.write_bytes(target, bytes(data))
    with caplog.at_level(logging.WARNING, logger="rft_trainer.checkpoint"):
        assert latest_verified(storage, uri) == 3
    line = next(r.getMessage() for r in caplog.records if "step 4" in r.getMessage())
    assert "__0_0.distcp" in line and "sha256" in line
    storage.delete(join(step_uri(uri, 3), ".metadata"))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rft_trainer.checkpoint"):
        assert latest_verified(storage, uri) is None
    assert ".metadata: listed in manifest.json but missing" in caplog.text


def test_retention_keeps_newest_committed_and_drops_older_orphans(storage, s3_bucket):
    uri = f"s3://{s3_bucket}/retention"
    for step in (1, 2, 3, 4, 5, 6):
        storage.write_bytes(join(step_uri(uri, step), "__0_0.distcp"), b"x")
        if step not in (4, 6):  # 4: crashed upload; 6: upload in flight
            storage.write_bytes(join(step_uri(uri, step), MANIFEST), b"{}")
    assert apply_retention(storage, uri, keep=2) == [1, 2, 4]
    steps = list_steps(storage, uri)
    assert sorted(steps) == [3, 5, 6]
    assert MANIFEST not in steps[6][1]
    assert apply_retention(storage, uri, keep=2) == []


# ---------------------------------------------------------------- in-process, one rank, no torchrun


class TinyRole:
    """The shape of the engine's Actor/Critic: .model, .optimizer, .scheduler."""

    def __init__(self, seed: int = 0):
        torch.manual_seed(seed)
        self.model = torch.nn.Linear(4, 3)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.1)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: 1.0 / (s + 1))

    def train(self) -> None:
        self.model(torch.ones(2, 4)).square().sum().backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.scheduler.step()


class FailingStorage(LocalStorage):
    def write_bytes(self, uri: str, data: bytes) -> None:
        if uri.endswith(".distcp"):
            raise OSError("disk quota exceeded")
        super().write_bytes(uri, data)


def one_rank_manager(storage, uri, tmp_path, role, **kw) -> CheckpointManager:
    rt = Runtime(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    return CheckpointManager(storage, uri, rt, roles={"actor": role}, staging_dir=str(tmp_path / "staging"), **kw)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_async_save_then_resume_in_one_process(tmp_path):
    uri = str(tmp_path / "store")
    role = TinyRole()
    role.train()
    mgr = one_rank_manager(LocalStorage(), uri, tmp_path, role, interval=2, keep=1)
    commits = []
    mgr.on_commit = lambda step, prefix: commits.append((step, prefix))
    assert not mgr.maybe_save(1, {"buffer": {"offset": 1}})
    assert mgr.maybe_save(2, {"buffer": {"offset": 2}}, block=False)
    mgr.wait()
    assert mgr.last_committed == 2 and mgr.last_saved == 2
    assert mgr.last_commit_bytes > 0 and mgr.last_commit_seconds > 0  # what status reports
    role.train()  # diverge after the save
    mgr.save(4, {"buffer": {"offset": 4}}, block=False)
    mgr.save(6, {"buffer": {"offset": 6}}, block=False)  # waits for step 4 first
    mgr.wait()
    assert sorted(list_steps(LocalStorage(), uri)) == [6]  # keep=1
    assert commits == [(s, step_uri(uri, s)) for s in (2, 4, 6)]
    assert not list((tmp_path / "staging").iterdir()), "staging dirs are removed after upload"
    fresh = TinyRole(seed=1)
    mgr2 = one_rank_manager(LocalStorage(), uri, tmp_path, fresh)
    assert mgr2.resume() == 6 and mgr2.app.extra == {"buffer": {"offset": 6}} and mgr2.app.step == 6
    assert_same(role.model.state_dict(), fresh.model.state_dict())
    assert_same(role.optimizer.state_dict(), fresh.optimizer.state_dict())
    assert fresh.scheduler.state_dict() == role.scheduler.state_dict()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_failed_upload_commits_nothing_and_surfaces_on_wait(tmp_path):
    uri = str(tmp_path / "store")
    mgr = one_rank_manager(FailingStorage(), uri, tmp_path, TinyRole())
    mgr.save(1, block=False)  # the local write succeeded; the upload fails in the background
    with pytest.raises(CheckpointError, match="disk quota exceeded"):
        mgr.wait()
    assert latest_verified(LocalStorage(), uri) is None
    assert not LocalStorage().exists(join(step_uri(uri, 1), MANIFEST))
    mgr.wait()  # the error is reported once
    assert one_rank_manager(LocalStorage(), uri, tmp_path, TinyRole()).resume() is None


@pytest.mark.parametrize(
    "since_commit, save_s, grace, elapsed, expected",
    [
        (None, None, None, 0, True),      # never committed, grace unknown: save
        (10, 5, 300, 1, False),           # committed 10 s ago: recent enough
        (600, 5, 300, 1, True),           # old commit, 5 s save fits 299 s of grace
        (600, 100, 120, 1, False),        # 150 s with margin does not fit 119 s
        (600, 60, 300, 250, False),       # most of the grace already spent
        (600, 60, None, 250, True),       # grace unknown (outside Kubernetes): save
    ],
)
def test_should_save_on_stop(since_commit, save_s, grace, elapsed, expected):
    from rft_trainer.checkpoint import should_save_on_stop

    now = 10_000.0
    last = None if since_commit is None else now - since_commit
    save, why = should_save_on_stop(now, now - elapsed, last, save_s, grace)
    assert save is expected, why


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_save_during_an_s3_outage_commits_after_recovery_without_blocking_training(
        tmp_path, s3_server, s3_env, bucket, monkeypatch):
    """The whole save path (DCP stage -> background upload -> manifest) through a proxy
    that refuses every request for a while: the loop gets control back after staging,
    keeps training, and the step commits once S3 answers again."""
    from .faultproxy import FaultProxy

    proxy = FaultProxy(s3_server).start()
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        uri = f"s3://{bucket}/outage"
        role = TinyRole()
        mgr = one_rank_manager(S3Storage(), uri, tmp_path, role)
        role.train()
        outage = 4.0
        proxy.outage(outage)
        start = time.monotonic()
        mgr.save(1, {"buffer": {"offset": 1}}, block=False)
        returned_after = time.monotonic() - start
        steps_during_outage = 0
        while mgr._thread is not None and mgr._thread.is_alive() and time.monotonic() - start < outage:
            role.train()  # the training loop goes on while the upload retries
            steps_during_outage += 1
        assert returned_after < outage / 2, f"save blocked the loop for {returned_after:.1f}s"
        assert steps_during_outage > 0
        mgr.wait()  # commits after recovery; raises if the upload gave up
        assert time.monotonic() - start >= outage * 0.9, "the outage was not in the way"
        assert proxy.injected > 0
        assert latest_verified(S3Storage(), uri) == 1
        assert read_manifest(S3Storage(), step_uri(uri, 1))["step"] == 1
    finally:
        proxy.stop()
