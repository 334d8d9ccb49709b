"""The trainer's S3 inputs against a real S3-compatible server over HTTP: the storage
interface, experience shards read from an S3 prefix, and the model fetched from S3."""

import hashlib
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from rft_trainer.experience import BufferReader, write_shard
from rft_trainer.modelcache import fetch_model
from rft_trainer.parallelize import Runtime
from rft_contract.s3 import S3Storage
from rft_contract import hashing
from rft_contract.storage import HashingReader, LocalStorage, get_storage, upload_file
from tests.fixtures.models import save_tiny_model
from tests.fixtures.batches import synthetic_batch


def test_storage_interface(bucket):
    s = get_storage(f"s3://{bucket}/x")
    assert isinstance(s, S3Storage)
    s.write_bytes(f"s3://{bucket}/a/1.bin", b"one")
    s.write_bytes(f"s3://{bucket}/a/2.bin", b"two" * 1000)
    s.write_bytes(f"s3://{bucket}/b/3.bin", b"three")
    assert s.list(f"s3://{bucket}/a/") == [f"s3://{bucket}/a/1.bin", f"s3://{bucket}/a/2.bin"]
    assert s.read_bytes(f"s3://{bucket}/a/2.bin") == b"two" * 1000
    assert s.exists(f"s3://{bucket}/b/3.bin") and not s.exists(f"s3://{bucket}/b/4.bin")
    s.delete(f"s3://{bucket}/b/3.bin")
    s.delete(f"s3://{bucket}/b/3.bin")  # missing: not an error
    assert not s.exists(f"s3://{bucket}/b/3.bin")
    try:
        s.read_bytes(f"s3://{bucket}/nope")
        raise AssertionError("expected FileNotFoundError")
    except FileNotFoundError as e:
        assert "nope" in str(e)


def test_multipart_upload_round_trips(bucket):
    s = S3Storage(part_size=5 * 2**20)  # S3's minimum part size: forces a multipart upload
    blob = os.urandom(11 * 2**20)
    s.write_bytes(f"s3://{bucket}/big.bin", blob)
    assert s.read_bytes(f"s3://{bucket}/big.bin") == blob


@pytest.mark.parametrize("size", [3 << 20, 12 << 20], ids=["one-put", "multipart"])
def test_upload_file_hashes_the_bytes_it_streams_in_one_pass(bucket, tmp_path, monkeypatch, size):
    """The manifest entry comes from the reads that fed the upload: with a second read of
    the file made impossible, the sha256 is still right, on the single-PUT path (where
    botocore rewinds the body after computing its CRC32) and on the multipart path."""
    blob = os.urandom(size)
    path = tmp_path / "shard.distcp"
    path.write_bytes(blob)

    def no_second_pass(_):
        raise AssertionError("the file was read again to hash it")

    monkeypatch.setattr(hashing, "sha256_file", no_second_pass)
    s = S3Storage(part_size=5 << 20, upload_window=2)
    got = upload_file(s, path, f"s3://{bucket}/up/shard.distcp")
    assert (got.size, got.sha256) == (size, hashlib.sha256(blob).hexdigest())
    assert s.read_bytes(f"s3://{bucket}/up/shard.distcp") == blob
    local = upload_file(LocalStorage(), path, str(tmp_path / "copy" / "shard.distcp"))
    assert local == got and (tmp_path / "copy" / "shard.distcp").read_bytes() == blob


def test_hashing_reader_counts_rewound_bytes_once_and_rehashes_after_a_skip(tmp_path):
    blob = os.urandom(10_000)
    (tmp_path / "f").write_bytes(blob)
    want = (len(blob), hashlib.sha256(blob).hexdigest())
    with open(tmp_path / "f", "rb") as f:
        r = HashingReader(f)
        r.read(4000)
        r.seek(1000)  # a retried request body, re-read from an earlier offset
        r.read(5000)
        r.read()
        assert r.sha256() == want
    with open(tmp_path / "f", "rb") as f:
        r = HashingReader(f)
        r.seek(2000)  # a reader that skips ahead: the reads miss bytes, the file is hashed again
        r.read()
        assert r.sha256() == want


UPLOAD_RSS_CHILD = textwrap.dedent("""
    import json, re, sys
    from pathlib import Path
    from rft_contract.s3 import S3Storage
    from rft_contract.storage import upload_file

    path, small, uri = sys.argv[1:4]
    s = S3Storage(part_size=8 << 20, concurrency=2, upload_window=2)
    upload_file(s, small, uri + ".warm")  # warm: client, pools, threads
    peak = lambda: int(re.search(r"VmHWM:\\s+(\\d+) kB", Path("/proc/self/status").read_text())[1]) * 1024
    base = peak()
    got = upload_file(s, path, uri)
    print(json.dumps({"rss": peak() - base, "sha256": got.sha256}))
""")


def test_upload_file_keeps_memory_to_the_parts_in_flight(bucket, tmp_path, s3_env):
    """A 200 MB file uploads with peak RSS grown by a few 8 MiB parts (2 in memory), not
    by the file (the checkpoint commit used to read each file whole and hash it)."""
    blob = os.urandom(1 << 20) * 200
    (tmp_path / "big").write_bytes(blob)
    (tmp_path / "small").write_bytes(b"warm")
    digest = hashlib.sha256(blob).hexdigest()
    del blob
    res = subprocess.run([sys.executable, "-c", UPLOAD_RSS_CHILD, str(tmp_path / "big"), str(tmp_path / "small"),
                          f"s3://{bucket}/rss/big"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.splitlines()[-1])
    assert got["sha256"] == digest
    assert got["rss"] < 64 << 20, got


def test_buffer_reader_over_an_s3_prefix(bucket):
    prefix = f"s3://{bucket}/run/buffer"
    batches = [synthetic_batch(4, 3, 5, vocab=24, seed=i) for i in range(3)]
    for i, b in enumerate(batches):
        write_shard(prefix, f"shard-{i:04d}", b)
    # An uncommitted shard (tensors without the JSON written last) is invisible.
    S3Storage().write_bytes(f"{prefix}/shard-0009.safetensors", b"partial")
    reader = BufferReader(prefix, batch_size=4)
    got = [reader.next_batch() for _ in range(3)]
    assert reader.next_batch() is None
    for want, have in zip(batches, got):
        assert torch.equal(want.tokens, have.tokens) and torch.equal(want.rewards, have.rewards)


def test_model_is_fetched_from_s3_once(bucket, tmp_path, monkeypatch):
    local = save_tiny_model(tmp_path / "model")
    s = S3Storage()
    for f in sorted(local.iterdir()):
        s.write_bytes(f"s3://{bucket}/models/tiny/{f.name}", f.read_bytes())
    monkeypatch.setenv("RFT_MODEL_CACHE", str(tmp_path / "cache"))
    rt = Runtime(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    path = fetch_model(f"s3://{bucket}/models/tiny", rt)
    assert (tmp_path / "cache") in __import__("pathlib").Path(path).parents
    assert sorted(os.listdir(path)) == sorted([".complete", ".lock", *os.listdir(local)])
    assert open(os.path.join(path, "model.safetensors"), "rb").read() == (local / "model.safetensors").read_bytes()
    s.delete(f"s3://{bucket}/models/tiny/config.json")  # a second fetch must not download again
    assert fetch_model(f"s3://{bucket}/models/tiny", rt) == path


def test_trainer_runs_from_s3_model_and_buffer(bucket, s3_env, tmp_path):
    local = save_tiny_model(tmp_path / "model")
    s = S3Storage()
    for f in sorted(local.iterdir()):
        s.write_bytes(f"s3://{bucket}/models/tiny/{f.name}", f.read_bytes())
    for i in range(2):
        write_shard(f"s3://{bucket}/run/buffer", f"shard-{i:04d}", synthetic_batch(8, 4, 6, vocab=24, seed=i))
    config = {
        "model": {"path": f"s3://{bucket}/models/tiny"},
        "algorithm": {"name": "grpo", "learning_rate": 1e-4, "micro_batch_size": 4},
        "trainer": {"total_steps": 2, "batch_size": 8, "fsdp": {"mixed_precision": "fp32"}},
        "checkpoint": {"uri": f"s3://{bucket}/run"},
    }  # buffer.uri defaults to <checkpoint.uri>/buffer
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(config))
    env = {**os.environ, **s3_env, "RFT_MODEL_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-m", "rft_trainer.launch", "--nproc-per-node=2",
                          "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0", "-m", "rft_trainer",
                          "--config", str(cfg)], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    steps = [json.loads(x)["step"] for x in res.stdout.splitlines() if x.startswith("{")]
    assert steps == [1, 2]
    assert "test-secret" not in res.stdout + res.stderr  # credentials never logged


def test_a_job_starts_from_a_lora_adapter_in_s3(bucket, world_of_one, tmp_path, monkeypatch):
    """spec.model.lora.adapterPath as an s3:// prefix holding PEFT's files (no config.json):
    fetched like a model, and the new job's policy is the one that exported it."""
    from rft_contract.storage import LocalStorage
    from rft_trainer.export import export_adapter
    from tests.trainer.test_lora import prepared, trained

    monkeypatch.setattr(world_of_one.models, "root", str(tmp_path / "cache"))
    tiny = save_tiny_model(tmp_path / "tiny")
    engine, batch = trained(tiny, world_of_one)
    export_adapter(engine.actor.model, world_of_one, LocalStorage(), str(tmp_path / "a"), engine.config.model.lora,
                   str(tiny), 2, dtype="fp32")
    s = S3Storage()
    for f in sorted((tmp_path / "a").iterdir()):
        s.write_bytes(f"s3://{bucket}/adapters/a/{f.name}", f.read_bytes())
    started = prepared(tiny, world_of_one, adapter_path=f"s3://{bucket}/adapters/a")
    want, _ = engine.actor.compute_log_prob(batch)
    got, _ = started.actor.compute_log_prob(batch)
    assert (got - want).abs().max().item() < 1e-6
