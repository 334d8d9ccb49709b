"""A real pretrained model end to end: SmolLM2-135M-Instruct (a Llama with tied
embeddings and a chat template, tests/fixtures/real_model.py) from S3 -> FSDP2 on 1 and
2 ranks -> PPO steps (actor and critic) -> checkpoint -> resume on another world size ->
HF export -> `from_pretrained` -> the reference server answers a chat request.

PPO covers both roles GRPO uses (actor, reference) plus the critic. Tolerance: 1e-5
absolute on every parameter after 4 steps (float32 on CPU; the two worlds differ only
in the order of reductions)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rft_contract.s3 import S3Storage
from tests.fixtures.real_model import smollm2_dir

HERE = Path(__file__).parent
STEPS = 4


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return smollm2_dir()


@pytest.fixture
def model_uri(bucket, smollm2) -> str:
    storage = S3Storage()
    for f in smollm2.iterdir():
        if f.is_file() and not f.name.startswith("."):
            storage.client.upload_file(str(f), bucket, f"models/smollm2/{f.name}")
    return f"s3://{bucket}/models/smollm2"


def run(tmp_path, nproc: int, *args: str) -> dict:
    out = tmp_path / f"out-{nproc}-{abs(hash(args))}.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0", str(HERE / "real_model_worker.py"),
           args[0], args[1], str(out), *args[2:]]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parents[1]),
           "RFT_MODEL_CACHE": str(tmp_path / f"model-cache-{nproc}"),
           "RFT_CKPT_STAGING": str(tmp_path / "staging")}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert res.returncode == 0, res.stderr[-4000:]
    try:
        return torch.load(out, weights_only=False)
    finally:
        out.unlink()  # ~1 GB each (actor and critic in float32): a CI machine's disk is shared


def worst(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.timeout(1200)
def test_smollm2_trains_resumes_exports_and_serves(model_uri, bucket, tmp_path, smollm2):
    # Checkpoints on local disk (S3 checkpoints have their own tests); the model and the
    # export go through S3.
    ckpt, export = str(tmp_path / "run"), f"s3://{bucket}/run/weights/step-00000004"
    one = run(tmp_path, 1, model_uri, str(tmp_path / "run-one"), "ppo", str(STEPS))
    shutil.rmtree(tmp_path / "run-one", ignore_errors=True)
    two = run(tmp_path, 2, model_uri, ckpt, "ppo", str(STEPS), "--save-at", "3", "--export", export)
    resumed = run(tmp_path, 1, model_uri, ckpt, "ppo", str(STEPS), "--resume")
    shutil.rmtree(ckpt)  # a PPO checkpoint of a 135M model with its optimizer state: 3 GB

    # The tie survives FSDP2 on both world sizes, and training moved the weights.
    assert one["tied"] and two["tied"] and resumed["tied"]
    init = {k: v for k, v in _hf_params(smollm2).items()}
    assert max((two["actor"][k] - init[k]).abs().max().item() for k in init) > 1e-6
    assert torch.equal(two["actor"]["lm_head.weight"], two["actor"]["model.embed_tokens.weight"])
    # 2 ranks == 1 process, and a 2-rank checkpoint resumed on 1 rank continues exactly.
    for role in ("actor", "critic"):
        assert worst(one[role], two[role]) < 1e-5, role
        assert worst(two[role], resumed[role]) < 1e-5, role

    # The export holds the embedding once and keeps tie_word_embeddings.
    local = tmp_path / "export"
    S3Storage().download_prefix(export, local)
    config = json.loads((local / "config.json").read_text())
    assert config["tie_word_embeddings"] is True
    from safetensors import safe_open

    keys = set()
    for f in local.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            keys |= set(st.keys())
    assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(local, dtype=torch.float32)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert worst({k: v for k, v in model.state_dict().items()}, two["actor"]) == 0.0

    _serves_a_chat_request(local)


def _hf_params(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    params = load_file(str(path / "model.safetensors"))
    params["lm_head.weight"] = params["model.embed_tokens.weight"]
    return params


def _serves_a_chat_request(model_dir: Path) -> None:
    """The reference server renders the chat template and answers with the exported weights."""
    import requests

    from rft_serving.serve import ReferenceServer

    server = ReferenceServer(host="127.0.0.1", port=0, served_model_name="policy", device="cpu")
    server.start()
    try:
        server.load(str(model_dir), 4)
        r = requests.post(server.url + "/v1/chat/completions", timeout=300, json={
            "model": "policy", "messages": [{"role": "user", "content": "What is 2+3?"}],
            "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["weights_version"] == 4
        assert body["choices"][0]["message"]["content"].strip()
    finally:
        server.stop()
