"""Weights export for inference: HF safetensors + config + tokenizer + manifest in S3,
gathered from 2 FSDP ranks; the result loads with plain `from_pretrained`."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rft_contract.layout import weights_uri
from rft_contract.probe import compare, read_probe
from rft_trainer.export import verify
from rft_contract.s3 import S3Storage
from tests.fixtures.models import save_tiny_model

HERE = Path(__file__).parent


def export(tiny, bucket, s3_env, tmp_path, dtype):
    dest = weights_uri(f"s3://{bucket}/run", 1)
    out = tmp_path / f"full-{dtype}.pt"
    env = {**os.environ, **s3_env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parents[1])}
    res = subprocess.run([sys.executable, "-m", "rft_trainer.launch", "--nproc-per-node=2",
                          "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0",
                          str(HERE / "export_worker.py"), str(tiny), dest, dtype, str(out)],
                         capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    local = S3Storage().download_prefix(dest, tmp_path / f"weights-{dtype}")
    return dest, local, torch.load(out, weights_only=False)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_exported_weights_load_with_from_pretrained(bucket, s3_env, tmp_path, dtype):
    tiny = save_tiny_model(tmp_path / "model")
    dest, local, trained = export(tiny, bucket, s3_env, tmp_path, dtype)
    manifest = verify(S3Storage(), dest)
    assert manifest["step"] == 1 and manifest["dtype"] == dtype
    shards = [f for f in manifest["files"] if f.endswith(".safetensors")]
    assert len(shards) > 1  # streamed in several buckets
    assert {"config.json", "model.safetensors.index.json", "tokenizer.json"} <= set(manifest["files"])
    model = AutoModelForCausalLM.from_pretrained(str(local), dtype=torch.float32)
    loaded = model.state_dict()
    tol = 0 if dtype == "fp32" else 1e-2
    for name, value in trained.items():
        assert (loaded[name] - value).abs().max().item() <= tol * max(1.0, value.abs().max().item()), name
    # The exported weights are the trained ones, not the initial ones.
    init = AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.float32).state_dict()
    assert max((init[k] - loaded[k]).abs().max().item() for k in init) > 1e-4
    assert AutoTokenizer.from_pretrained(str(local)).eos_token == "<eos>"
    cfg = json.loads((local / "config.json").read_text())
    assert cfg.get("dtype", cfg.get("torch_dtype")) == {"fp32": "float32", "bf16": "bfloat16"}[dtype]
    # The probe (rft_trainer.probe): the log-probs of its tokens under the weights as exported,
    # which is what an engine serving this directory must reproduce.
    probe = read_probe(local)
    assert probe.dtype == dtype and probe.step == 1 and 2 <= len(probe.token_ids) <= 64
    ids = torch.tensor([probe.token_ids])
    with torch.no_grad():
        served = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])[:, 0]
    assert compare(served.tolist(), probe, tolerance=1e-5).ok, compare(served.tolist(), probe).describe()
    if dtype == "bf16":  # the master weights would not match: the probe saw the rounded ones
        master = AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.float32)
        master.load_state_dict(trained)
        with torch.no_grad():
            unrounded = torch.log_softmax(master(input_ids=ids).logits[0, :-1].float(), -1).gather(
                -1, ids[0, 1:, None])[:, 0]
        assert not compare(unrounded.tolist(), probe, tolerance=1e-5).ok


def test_a_corrupted_file_fails_verification(bucket, s3_env, tmp_path):
    tiny = save_tiny_model(tmp_path / "model")
    dest, _, _ = export(tiny, bucket, s3_env, tmp_path, "bf16")
    S3Storage().write_bytes(f"{dest}/model-00001.safetensors", b"garbage")
    with pytest.raises(ValueError, match="model-00001.safetensors"):
        verify(S3Storage(), dest)


# ------------------------------------------------------------------ the fast path


class _Uploads:
    """Local storage whose uploads fail when `fail` is set (an S3 outage mid-export)."""

    def __init__(self, storage):
        self.storage, self.fail = storage, False

    def upload_file(self, path, uri):
        if self.fail:
            raise ConnectionError("S3 is down")
        return self.storage.upload_file(path, uri)

    def __getattr__(self, name):
        return getattr(self.storage, name)


def _fast(tmp_path):
    from rft_contract.relay import PeerServer
    from rft_trainer.export import FastPath

    root = tmp_path / "served"
    root.mkdir()
    server = PeerServer(root, host="127.0.0.1").start()
    return FastPath(root, server, f"http://127.0.0.1:{server.port}")


def test_the_fast_path_serves_what_it_then_commits_and_drops_a_failed_export(tmp_path):
    """Rank 0 on the fast path: the version is served (every file listed, hashed locally)
    and announced with the manifest's digest before the commit; the committed manifest is
    the announced one and the uploaded bytes are the served ones. The version before is no
    longer served. An export whose upload fails is announced but never committed, and
    neither it nor its files stay on the trainer's disk."""
    from rft_contract.manifest import manifest_digest
    from rft_contract.relay import Peer, read_from_peer, read_manifest_from_peer
    from rft_contract.storage import LocalStorage
    from rft_trainer.export import WeightExporter, export_hf
    from rft_trainer.parallelize import Runtime

    model_dir = save_tiny_model(tmp_path / "m", seed=1)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    rt = Runtime(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    storage = _Uploads(LocalStorage())
    root = str(tmp_path / "s3" / "run")
    fast = _fast(tmp_path)
    seen: dict[int, tuple] = {}

    def announce(step, uri, manifest, a):
        # What a replica sees at this moment: the manifest and a file from the trainer, none in "S3".
        peer = Peer("trainer", a["peer"])
        name = f"v{step:08d}-{manifest['id']}"
        served = read_manifest_from_peer(peer, name, 5)
        out = tmp_path / f"got-{step}"
        with open(out, "wb") as f:
            read_from_peer(peer, name, "config.json", served["files"]["config.json"]["size"], f, lambda _: None, 5)
        seen[step] = (a, served, os.path.exists(os.path.join(uri, "manifest.json")), out.read_bytes())

    exporter = WeightExporter(storage, root, "fp32", keep=5, pinned=None, fast=fast, on_announce=announce,
                              write=lambda s, dest, dtype, stage=None: export_hf(
                                  model, rt, s, dest, str(model_dir), int(dest[-8:]), dtype=dtype, stage=stage))
    try:
        committed = exporter.publish(1)
        announced, served, in_s3_then, config = seen[1]
        assert announced == {"peer": fast.url, "manifest": manifest_digest(committed)} and served == committed
        assert not in_s3_then  # announced before the commit
        assert config == (Path(weights_uri(root, 1)) / "config.json").read_bytes()
        assert fast.serving is not None and fast.serving.name == f"v00000001-{committed['id']}"
        first = fast.serving

        storage.fail = True
        with pytest.raises(ConnectionError):
            exporter.publish(2)
        assert 2 in seen and not (Path(weights_uri(root, 2)) / "manifest.json").exists()  # never committed
        assert fast.serving is None and not first.exists() and list(fast.root.iterdir()) == []
    finally:
        fast.stop()


def test_an_engine_whose_export_takes_no_stage_publishes_through_s3(tmp_path, caplog):
    from rft_trainer.export import WeightExporter

    fast = _fast(tmp_path)
    try:
        exporter = WeightExporter(None, "s3://b/run", "bf16", 5, None, write=lambda storage, dest, dtype: None,
                                  fast=fast)
        assert exporter.fast is None and "takes no `stage`" in caplog.text
    finally:
        fast.stop()
