"""Checkpoints against a real S3-compatible server (SeaweedFS over HTTP), with torchrun workers.

One 2-rank PPO run (actor + critic, async saves every step, keep=2) is shared by the
module; tests copy its prefix before damaging it. Resharding is exact (DCP copies
shards), so resumed states are compared for equality; a resumed run continued on the
same world size replays the uninterrupted one exactly.
"""

import copy
import hashlib
import logging
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from rft_contract.manifest import MANIFEST, IntegrityError, download_verified, read_manifest
from rft_trainer.checkpoint import (CheckpointError, CheckpointManager, CorruptCheckpoint, apply_retention,
                                    build_checkpointer, latest_verified, list_steps, step_uri)
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


def test_two_sharded_ranks_resume_what_one_unsharded_rank_saved(saved, s3_bucket):
    uri = f"s3://{s3_bucket}/run-one-rank"
    one = run_worker(saved["tmp"], uri, 1, 2, "--block")
    assert one["world_size"] == 1 and not one["sharded"]  # one rank in fp32 trains a plain module
    two = run_worker(saved["tmp"], uri, 2, 2)
    assert two["resumed"] == 2 and two["sharded"]
    assert_same(one["snapshots"][2], two["snapshots"]["resumed"])


def test_lora_checkpoints_hold_the_adapters_only_and_two_ranks_resume_on_one(saved, s3_bucket, storage):
    """spec.model.lora: a checkpoint holds the actor's adapters and their optimizer state,
    not the frozen base (it comes from model.path); 2 ranks save, 1 rank resumes exactly
    what they saved, and continues as the uninterrupted 2-rank run does (to float32's
    reduction order). The critic stays whole."""
    import pickle

    from rft_trainer import lora

    uri, whole_uri = f"s3://{s3_bucket}/lora", f"s3://{s3_bucket}/lora-whole"
    whole = run_worker(saved["tmp"], whole_uri, 2, 4, "--lora", "--block")
    first = run_worker(saved["tmp"], uri, 2, 2, "--lora", "--block")
    meta = pickle.loads(storage.read_bytes(join(step_uri(uri, 2), ".metadata")))
    actor = [k for k in meta.state_dict_metadata if k.startswith("app.actor.model.")]
    assert actor and all(lora.is_adapter_key(k) for k in actor), actor[:4]
    assert any(k.startswith("app.critic.model.") and "embed_tokens" in k for k in meta.state_dict_metadata)
    then = run_worker(saved["tmp"], uri, 1, 4, "--lora")
    assert then["resumed"] == 2 and then["world_size"] == 1
    assert_same(first["snapshots"][2], then["snapshots"]["resumed"])
    for step in (3, 4):
        a, b = whole["snapshots"][step]["actor"]["model"], then["snapshots"][step]["actor"]["model"]
        worst = max((a[k] - b[k]).abs().max().item() for k in a)
        assert worst < 1e-5, f"step {step}: largest parameter difference {worst}"
    moved = [k for k in a if lora.is_adapter_key(k) and not torch.equal(a[k], first["snapshots"][2]["actor"]["model"][k])]
    assert moved  # the adapters went on training after the resume


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


def test_retention_keeps_a_protected_step(storage, s3_bucket):
    """The checkpoint of spec.evaluation's best version stays past checkpoint.keep."""
    uri = f"s3://{s3_bucket}/retention-best"
    for step in (1, 2, 3, 4):
        storage.write_bytes(join(step_uri(uri, step), "__0_0.distcp"), b"x")
        storage.write_bytes(join(step_uri(uri, step), MANIFEST), b"{}")
    assert apply_retention(storage, uri, keep=2, protect={1}) == [2]
    assert sorted(list_steps(storage, uri)) == [1, 3, 4]


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

    def upload_file(self, path, uri: str):
        if uri.endswith(".distcp"):
            raise OSError("disk quota exceeded")
        return super().upload_file(path, uri)


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
    mgr.wait_on_save_thread()
    assert mgr.last_committed == 2 and mgr.last_saved == 2
    assert mgr.last_commit_bytes > 0 and mgr.last_commit_seconds > 0  # what status reports
    role.train()  # diverge after the save
    mgr.save(4, {"buffer": {"offset": 4}}, block=False)
    mgr.save(6, {"buffer": {"offset": 6}}, block=False)  # waits for step 4 first
    mgr.wait_on_save_thread()
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
def test_async_save_returns_before_the_write_and_saves_the_state_of_the_call(tmp_path, monkeypatch):
    """save(block=False) copies the state and returns; the local write happens after it (here
    held until the loop has trained on), and still holds the state of the save() call."""
    gate = threading.Event()
    write_data = dcp.FileSystemWriter.write_data

    def held(self, plan, planner):
        assert gate.wait(60), "save() waited for the write"
        return write_data(self, plan, planner)

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", held)
    uri = str(tmp_path / "store")
    role = TinyRole()
    role.train()
    saved = copy.deepcopy((role.model.state_dict(), role.optimizer.state_dict()))
    mgr = one_rank_manager(LocalStorage(), uri, tmp_path, role)
    mgr.save(1, {"buffer": {"offset": 1}}, block=False)
    role.train()  # the loop goes on while the save is in flight
    gate.set()
    mgr.wait_on_save_thread()
    fresh = TinyRole(seed=1)
    assert one_rank_manager(LocalStorage(), uri, tmp_path, fresh).resume() == 1
    assert_same(saved[0], fresh.model.state_dict())
    assert_same(saved[1], fresh.optimizer.state_dict())
    with pytest.raises(AssertionError):
        assert_same(role.model.state_dict(), fresh.model.state_dict())


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_failed_upload_commits_nothing_and_surfaces_on_wait(tmp_path):
    uri = str(tmp_path / "store")
    mgr = one_rank_manager(FailingStorage(), uri, tmp_path, TinyRole())
    mgr.save(1, block=False)  # the local write succeeded; the upload fails in the background
    with pytest.raises(CheckpointError, match="disk quota exceeded"):
        mgr.wait_on_save_thread()
    assert latest_verified(LocalStorage(), uri) is None
    assert not LocalStorage().exists(join(step_uri(uri, 1), MANIFEST))
    mgr.wait_on_save_thread()  # the error is reported once
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
        mgr.wait_on_save_thread()  # commits after recovery; raises if the upload gave up
        assert time.monotonic() - start >= outage * 0.9, "the outage was not in the way"
        assert proxy.injected > 0
        assert latest_verified(S3Storage(), uri) == 1
        assert read_manifest(S3Storage(), step_uri(uri, 1))["step"] == 1
    finally:
        proxy.stop()


# ---------------------------------------------------------------- resume: one streamed, verified download per node


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def upload_model(storage, local: Path, uri: str) -> list[str]:
    names = sorted(f.name for f in local.iterdir())
    for name in names:
        storage.write_bytes(f"{uri}/{name}", (local / name).read_bytes())
    return names


def run_nodes(tmp: Path, model: str, uri: str, steps: int, nodes: int, nproc: int, *flags: str,
              env: list[dict] | None = None, timeout: float = 300) -> list[subprocess.CompletedProcess]:
    """`nodes` torchrun launchers on this machine, one per simulated node, each with its
    own staging volume and model cache (as separate pods have): <tmp>/node-<i>/, and
    `env[i]` on top."""
    port, procs = _free_port(), []
    for node in range(nodes):
        home = tmp / f"node-{node}"
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}", f"--nproc-per-node={nproc}",
               f"--node-rank={node}", "--master-addr=127.0.0.1", f"--master-port={port}",
               str(HERE / "ckpt_worker.py"), model, uri, str(tmp / "out.pt"), "--steps", str(steps), *flags]
        node_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parents[1]),
                    "RFT_CKPT_STAGING": str(home / "save"), "RFT_STAGING_DIR": str(home / "staging"),
                    "RFT_MODEL_CACHE": str(home / "models"), **(env[node] if env else {})}
        procs.append(subprocess.Popen(cmd, env=node_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    out = []
    for proc in procs:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        out.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    return out


def read_requests(log: Path) -> list[tuple[str, int, str, str, str]]:
    """(node, rank, operation, path?query, range) per S3 request the workers sent."""
    out = []
    for line in log.read_text().splitlines():
        node, rank, op, target, rng = line.split(" ")
        out.append((node, int(rank), op, target, rng))
    return out


def test_two_nodes_of_two_ranks_download_each_file_once_per_node_and_resume_exactly(saved, storage, s3_bucket):
    """2 launchers x 2 ranks with separate staging volumes and model caches (two pods):
    local rank 0 of each node downloads the model and the checkpoint step once (no other
    rank sends a request for them), every rank loads from the node's copy, and the copy
    is gone afterwards."""
    tmp = saved["tmp"] / "two-nodes"
    tmp.mkdir()
    model = f"s3://{s3_bucket}/models/tiny-two-nodes"
    model_files = upload_model(storage, saved["tmp"] / "model", model)
    log = tmp / "requests.log"
    procs = run_nodes(tmp, model, saved["uri"], 4, 2, 2, "--request-log", str(log), "--micro-batch-size", "1")
    for node, proc in enumerate(procs):
        assert proc.returncode == 0, f"node {node}: {proc.stderr[-4000:]}"
    result = torch.load(tmp / "out.pt", weights_only=False)
    assert result["resumed"] == 4 and result["world_size"] == 4
    assert_same(saved["result"]["snapshots"][4], result["snapshots"]["resumed"])

    step = step_uri(saved["uri"], 4)[len("s3://"):]
    data = {f"/{step}/{name}" for name in read_manifest(storage, step_uri(saved["uri"], 4))["files"]}
    data |= {f"/{model[len('s3://'):]}/{name}" for name in model_files}
    requests = read_requests(log)
    # A file's download starts with a whole GET or the range at byte 0, whatever its parts.
    starts = Counter((node, target) for node, _, op, target, rng in requests
                     if op == "GetObject" and target in data and (rng == "-" or rng.startswith("bytes=0-")))
    for node in ("0", "1"):
        assert {path: starts[(node, path)] for path in data} == dict.fromkeys(data, 1), f"node {node}"
    model_key = model[len("s3://"):].split("/", 1)[1]
    touching = {rank for _, rank, _, target, _ in requests if target in data or model_key in target}
    assert touching == {0, 2}, f"ranks {touching} sent requests for the data (local rank 0 is 0 and 2)"
    for node in range(2):
        staged = [p for p in (tmp / f"node-{node}" / "staging").rglob("*") if p.is_file()]
        assert staged == [], f"node {node} kept its staging copy: {staged}"


def test_a_failed_model_download_fails_the_other_node_at_once(saved, storage, s3_bucket):
    """Node 0 cannot write its model cache: node 1, whose download succeeded, hears of it
    through the download group at once instead of waiting out the download timeout (or,
    as before, a default 30-min barrier)."""
    tmp = saved["tmp"] / "bad-cache"
    tmp.mkdir()
    model = f"s3://{s3_bucket}/models/tiny-bad-cache"
    upload_model(storage, saved["tmp"] / "model", model)
    (tmp / "not-a-dir").write_text("")
    start = time.monotonic()
    procs = run_nodes(tmp, model, saved["uri"] + "-bad-cache", 1, 2, 1, timeout=180,
                      env=[{"RFT_MODEL_CACHE": str(tmp / "not-a-dir" / "models")}, {"RFT_MODEL_DOWNLOAD_TIMEOUT": "600"}])
    assert time.monotonic() - start < 120
    assert [p.returncode != 0 for p in procs] == [True, True]
    assert "NotADirectoryError" in procs[0].stderr
    assert (f"downloading the model {model} failed on the node of rank 0: NotADirectoryError"
            in procs[1].stderr), procs[1].stderr[-3000:]


RSS_CHILD = textwrap.dedent("""
    import json, re, sys
    from pathlib import Path
    from rft_contract.manifest import verify_objects
    from rft_contract.s3 import S3Storage
    from rft_contract.storage import download_to

    uri, prefix, dest, expected = sys.argv[1], sys.argv[2], Path(sys.argv[3]), json.loads(sys.argv[4])
    s = S3Storage(read_part_size=4 << 20, read_window=4)
    download_to(s, prefix + "/small", dest / "small")  # warm: client, pools, threads
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss over exec from the (large) parent.
    peak = lambda: int(re.search(r"VmHWM:\\s+(\\d+) kB", Path("/proc/self/status").read_text())[1]) * 1024
    base = peak()
    download_to(s, uri, dest / "big", expected)
    after_download = peak()
    problem = verify_objects(s, prefix)
    print(json.dumps({"download": after_download - base, "verify": peak() - base, "problem": problem}))
""")


def test_streamed_download_and_verify_keep_memory_bounded(storage, s3_bucket, tmp_path):
    """A 200 MB object downloaded with its manifest check, then the remote verification
    of its step: peak RSS grows by a few parts (4 x 4 MiB in flight), not by the object."""
    import json

    from rft_contract.manifest import file_entry, write_manifest

    prefix = f"s3://{s3_bucket}/rss"
    blob = os.urandom(1 << 20) * 200
    storage.write_bytes(f"{prefix}/big", blob)
    storage.write_bytes(f"{prefix}/small", b"warm")
    write_manifest(storage, prefix, {"files": {"big": file_entry(blob), "small": file_entry(b"warm")}})
    expected = file_entry(blob)
    del blob
    res = subprocess.run([sys.executable, "-c", RSS_CHILD, f"{prefix}/big", prefix, str(tmp_path),
                          json.dumps(expected)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(HERE.parents[1])})
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.splitlines()[-1])
    assert got["problem"] is None
    assert (tmp_path / "big").stat().st_size == 200 << 20
    assert got["download"] < 64 << 20 and got["verify"] < 64 << 20, got


def _saved_two_steps(tmp_path, storage, uri) -> TinyRole:
    role = TinyRole()
    mgr = one_rank_manager(storage, uri, tmp_path, role)
    role.train()
    mgr.save(1, {"buffer": {"offset": 1}})
    role.train()
    mgr.save(2, {"buffer": {"offset": 2}})
    return role


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("damage, reason", [("flip", "sha256 differs"), ("truncate", "size")])
def test_corrupted_file_is_refused_by_name_and_the_step_is_not_loaded(tmp_path, storage, s3_bucket, caplog,
                                                                      damage, reason):
    uri = f"s3://{s3_bucket}/corrupt-load-{damage}"
    _saved_two_steps(tmp_path, storage, uri)
    target = join(step_uri(uri, 2), "__0_0.distcp")
    data = bytearray(storage.read_bytes(target))
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
    else:
        del data[-10:]
    storage.write_bytes(target, bytes(data))

    fresh = TinyRole(seed=1)
    before = {k: v.clone() for k, v in fresh.model.state_dict().items()}
    node = tmp_path / "node-staging"
    mgr = one_rank_manager(storage, uri, tmp_path, fresh, node_staging_dir=str(node))
    with pytest.raises(CorruptCheckpoint, match=rf"step 2 not loaded: {target}: {reason}"):
        mgr.load(2)
    assert mgr.app.step == 0
    assert_same(before, fresh.model.state_dict())
    assert not [p for p in node.rglob("*") if p.is_file()], "nothing of the refused step is left on disk"
    # resume names the file, skips the step and loads the previous one.
    with caplog.at_level(logging.WARNING, logger="rft_trainer.checkpoint"):
        assert mgr.resume() == 1 and mgr.app.extra == {"buffer": {"offset": 1}}
    assert f"checkpoint step 2 not loaded: {target}: {reason}" in caplog.text and "trying an older step" in caplog.text
    assert not [p for p in node.rglob("*") if p.is_file()], "the staging copy is removed after the load"


class CountingStorage(LocalStorage):
    """Counts reads per object (whole or streamed)."""

    def __init__(self):
        self.reads: Counter = Counter()

    def read_bytes(self, uri: str) -> bytes:
        self.reads[uri] += 1
        return super().read_bytes(uri)

    def read_parts(self, uri: str, size: int | None = None):
        self.reads[uri] += 1
        return super().read_parts(uri, size)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_files_already_staged_with_a_matching_checksum_are_not_downloaded_again(tmp_path):
    uri = str(tmp_path / "store")
    _saved_two_steps(tmp_path, LocalStorage(), uri)
    prefix = step_uri(uri, 2)
    manifest = read_manifest(LocalStorage(), prefix)
    names = sorted(manifest["files"])
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / names[0]).write_bytes(LocalStorage().read_bytes(join(prefix, names[0])))  # intact: kept
    damaged = bytearray(LocalStorage().read_bytes(join(prefix, names[1])))
    damaged[0] ^= 1
    (dest / names[1]).write_bytes(bytes(damaged))  # same size, other bytes: downloaded again
    counting = CountingStorage()
    got = download_verified(counting, prefix, dest, manifest)
    assert (got.reused, got.files) == (1, len(names) - 1)
    assert counting.reads[join(prefix, names[0])] == 0
    assert all(counting.reads[join(prefix, n)] == 1 for n in names[1:])
    assert (dest / names[1]).read_bytes() == LocalStorage().read_bytes(join(prefix, names[1]))
    assert sorted(p.name for p in dest.iterdir()) == names  # no temp files left


def test_verified_download_of_a_missing_file_names_it(tmp_path):
    prefix = str(tmp_path / "store" / "step")
    manifest = {"files": {"gone.distcp": {"size": 1, "sha256": hashlib.sha256(b"x").hexdigest()}}}
    with pytest.raises(IntegrityError, match="gone.distcp: listed in manifest.json but missing"):
        download_verified(LocalStorage(), prefix, tmp_path / "dest", manifest)


@pytest.fixture
def s3_gets(s3_env, monkeypatch):
    """Object paths of every GetObject sent by S3 clients created after this fixture."""
    import boto3

    session = boto3.session.Session()
    gets: list[str] = []
    session.events.register("before-send.s3.GetObject",
                            lambda request, **_: gets.append(request.url.split("://", 1)[1].split("/", 1)[1]))
    monkeypatch.setattr(boto3, "DEFAULT_SESSION", session)
    return gets


def test_model_cache_reuses_matching_files_across_attempts(bucket, s3_gets, tmp_path, monkeypatch):
    """A kept cache (hostPath/PVC) on a later attempt: unchanged files are not downloaded
    again; a changed object, a damaged local file and a removed object are followed."""
    from rft_trainer.modelcache import fetch_model

    local = save_tiny_model(tmp_path / "model")
    model = f"s3://{bucket}/models/tiny"
    names = upload_model(S3Storage(), local, model)
    monkeypatch.setenv("RFT_MODEL_CACHE", str(tmp_path / "cache"))

    def attempt() -> tuple[Path, list[str]]:
        rt = Runtime(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))  # a new process
        s3_gets.clear()
        path = Path(fetch_model(model, rt))
        return path, sorted(g.rsplit("/", 1)[1] for g in s3_gets if "/models/tiny/" in g)

    path, got = attempt()
    assert got == names and sorted(p.name for p in path.iterdir()) == sorted([".complete", ".lock", *names])
    (path / ".tmp-model.safetensors-killed").write_bytes(b"partial")  # an attempt killed mid-file
    assert attempt() == (path, [])
    assert not (path / ".tmp-model.safetensors-killed").exists()
    S3Storage().write_bytes(f"{model}/config.json", (local / "config.json").read_bytes() + b"\n")
    data = bytearray((path / "model.safetensors").read_bytes())
    data[-1] ^= 1
    (path / "model.safetensors").write_bytes(bytes(data))
    assert attempt() == (path, ["config.json", "model.safetensors"])
    assert (path / "model.safetensors").read_bytes() == (local / "model.safetensors").read_bytes()
    assert (path / "config.json").read_bytes().endswith(b"\n")
    extra = next(n for n in names if n not in ("config.json", "model.safetensors"))
    S3Storage().delete(f"{model}/{extra}")
    assert attempt() == (path, [])
    assert not (path / extra).exists()


def test_streamed_download_survives_slowdowns(bucket, s3_server, monkeypatch, tmp_path):
    """Parts answered `503 SlowDown` are retried (botocore) and the file still verifies."""
    from rft_contract.manifest import file_entry
    from rft_contract.storage import download_to

    from .faultproxy import FaultProxy

    blob = os.urandom(3 << 20)
    S3Storage().write_bytes(f"s3://{bucket}/slow/obj", blob)
    proxy = FaultProxy(s3_server, fail_fraction=0.3, seed=1).start()
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        got = download_to(S3Storage(read_part_size=256 << 10, read_window=4), f"s3://{bucket}/slow/obj",
                          tmp_path / "obj", file_entry(blob))
        assert proxy.injected > 0
    finally:
        proxy.stop()
    assert got.size == len(blob) and (tmp_path / "obj").read_bytes() == blob


def test_a_checkpoint_from_before_the_value_model_and_the_decay_groups_resumes(tmp_path, world_of_one):
    """Checkpoints written when the critic was `AutoModelForTokenClassification` (one label)
    and AdamW had one parameter group resume into `models.ValueModel` and the two groups
    (no decay on biases and norms): the same weights and per-parameter optimizer state,
    each group's scheduled lr as saved, weight decay as configured now."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    from rft_contract.config import load_config
    from rft_trainer.engine import FSDPTrainEngine
    from rft_trainer.roles import make_scheduler
    from tests.fixtures.batches import synthetic_batch

    path = str(save_tiny_model(tmp_path / "m"))
    old = {}
    for name, model in (("actor", AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)),
                        ("critic", AutoModelForTokenClassification.from_pretrained(path, num_labels=1,
                                                                                   dtype=torch.float32))):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        scheduler = make_scheduler(optimizer, warmup_steps=4, total_steps=10)
        for _ in range(2):
            model(input_ids=torch.ones(1, 4, dtype=torch.long)).logits.square().mean().backward()
            optimizer.step()
            scheduler.step()
        old[name] = SimpleNamespace(model=model, optimizer=optimizer, scheduler=scheduler)
    uri = str(tmp_path / "run")
    CheckpointManager(LocalStorage(), uri, world_of_one, roles=old, staging_dir=str(tmp_path / "s")).save(2, {})

    config = load_config({
        "model": {"path": path}, "algorithm": {"name": "ppo", "micro_batch_size": 2, "kl_coef": 0.0},
        "optimizer": {"warmup_steps": 4}, "trainer": {"total_steps": 10, "batch_size": 4,
                                                      "fsdp": {"mixed_precision": "fp32"}},
        "checkpoint": {"uri": uri}}, env={})
    engine = FSDPTrainEngine(config, world_of_one)
    engine.prepare()
    ckpt = build_checkpointer(config, LocalStorage(), world_of_one, engine.checkpoint_roles())
    assert ckpt.resume() == 2 and ckpt.app.extra == {}
    for name, role in (("actor", engine.actor), ("critic", engine.critic)):
        before, now = old[name], role
        assert_same(before.model.state_dict(), now.model.state_dict())
        saved_state = {n: before.optimizer.state[p] for n, p in before.model.named_parameters()}
        for n, p in now.model.named_parameters():
            assert_same(saved_state[n], now.optimizer.state[p], f"{name}.{n}")
        groups = now.optimizer.param_groups
        assert [g["weight_decay"] for g in groups] == [0.01, 0.0]
        assert [g["lr"] for g in groups] == [before.optimizer.param_groups[0]["lr"]] * 2 == [0.75e-3] * 2
        assert now.scheduler.last_epoch == 2 and now.scheduler.get_last_lr() == [0.75e-3] * 2
    engine.train_step(synthetic_batch(4, 4, 6, vocab=24, seed=0))  # and it trains on
    assert [g["lr"] for g in engine.actor.optimizer.param_groups] == [1e-3, 1e-3]
