"""FSDP2 correctness: one optimiser step on the same global batch with 2 gloo ranks under
torchrun gives the same parameters as 1 process (float32 on CPU; tolerance 1e-5 absolute,
the order of float32 reduction differences across two partial sums)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.fixtures.models import save_tiny_model

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def run_step(model_dir, out, nproc: int, algo: str, *extra: str) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0",
           str(HERE / "fsdp_step.py"), str(model_dir), str(out), algo, *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parents[1])}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    return torch.load(out, weights_only=False)


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_two_ranks_match_one_process(tiny, tmp_path, algo):
    one = run_step(tiny, tmp_path / "one.pt", 1, algo)
    two = run_step(tiny, tmp_path / "two.pt", 2, algo)
    assert one["params"].keys() == two["params"].keys()
    worst = max((one["params"][k] - two["params"][k]).abs().max().item() for k in one["params"])
    assert worst < 1e-5, f"largest parameter difference {worst}"
    # And the step did train: parameters moved away from the initial weights.
    from safetensors.torch import load_file
    init = load_file(str(tiny / "model.safetensors"))
    moved = max((one["params"][k] - init[k]).abs().max().item() for k in init)
    assert moved > 1e-4
    assert abs(one["metrics"]["actor/pg_loss"] - two["metrics"]["actor/pg_loss"]) < 1e-5


def test_rollout_correction_two_ranks_match_one_process_and_change_the_step(tiny, tmp_path):
    """algorithm.rolloutCorrection through the engine under torchrun: the correction is
    computed on the all-gathered batch, so 2 ranks take the step of 1 process and report
    the same rollout_corr/ metrics; some tokens are rejected, and the step is not the
    uncorrected one."""
    one = run_step(tiny, tmp_path / "one.pt", 1, "grpo", "--rollout-correction")
    two = run_step(tiny, tmp_path / "two.pt", 2, "grpo", "--rollout-correction")
    worst = max((one["params"][k] - two["params"][k]).abs().max().item() for k in one["params"])
    assert worst < 1e-5, f"largest parameter difference {worst}"
    corr = {k: v for k, v in one["metrics"].items() if k.startswith("rollout_corr/")}
    for k, v in corr.items():
        assert abs(v - two["metrics"][k]) < 1e-5 * max(1.0, abs(v)), (k, v, two["metrics"][k])
    assert 0 < corr["rollout_corr/rollout_rs_masked_fraction"] < 1, corr
    assert corr["rollout_corr/rollout_is_ratio_fraction_high"] > 0, corr
    plain = run_step(tiny, tmp_path / "plain.pt", 1, "grpo")
    assert "rollout_corr/kl" not in plain["metrics"]  # the synthetic batch has no engine log-probs

    def differs(run):
        return max((run["params"][k] - plain["params"][k]).abs().max().item() for k in plain["params"])

    assert differs(one) > 1e-6
    # IS weights alone change the step; the engine's log-probs without the setting do not.
    assert differs(run_step(tiny, tmp_path / "is.pt", 1, "grpo", "--rollout-is")) > 1e-6
    measured = run_step(tiny, tmp_path / "measured.pt", 1, "grpo", "--rollout-logprobs")
    assert differs(measured) == 0.0 and measured["metrics"]["rollout_corr/kl"] != 0


def test_activation_checkpointing_gives_the_same_step_on_cpu(tiny, tmp_path):
    """Activation checkpointing changes what is recomputed in the backward pass, not the math.

    Only activation checkpointing is exercised here. `fsdp.cpuOffload` is set as well, but on
    CPU it is a no-op (the parameters already live on the CPU; `parallelize.apply_fsdp` logs
    and ignores it), so CPU offload cannot be exercised without a GPU: bench/gpu_check.sh
    runs it on one."""
    plain = run_step(tiny, tmp_path / "plain.pt", 1, "grpo")
    checkpointed = run_step(tiny, tmp_path / "checkpointed.pt", 1, "grpo", "--activation-checkpointing")
    worst = max((plain["params"][k] - checkpointed["params"][k]).abs().max().item() for k in plain["params"])
    assert worst < 1e-5, worst


@pytest.fixture(scope="module")
def tiny_llama_tied(tmp_path_factory):
    from tests.fixtures.architectures import save_tiny

    return save_tiny("llama", tmp_path_factory.mktemp("llama") / "model", tie=True)


@pytest.mark.parametrize("family, algo", [("qwen2", "grpo"), ("qwen2", "ppo"), ("llama-tied", "grpo"),
                                           ("qwen2-bf16", "grpo")])
def test_lora_two_ranks_match_one_process_and_only_the_adapters_train(tiny, tiny_llama_tied, tmp_path, family, algo):
    """spec.model.lora: the adapters of every linear layer train, sharded like the rest;
    the base stays what the checkpoint holds, bit for bit (the reference for the KL term
    is the base with the adapters off); 2 ranks give 1 process's step. PPO's critic stays
    fully trained. Qwen2 with its own lm_head, Llama with the embeddings tied to it (the
    head is not adapted: `all-linear` leaves the output layer out); bf16 master weights
    with the adapters in fp32, both sharded in the same groups."""
    from safetensors.torch import load_file

    from rft_trainer import lora

    model = tiny_llama_tied if family == "llama-tied" else tiny
    flags = ("--lora", "--bf16") if family.endswith("-bf16") else ("--lora",)
    one = run_step(model, tmp_path / "one.pt", 1, algo, *flags)
    two = run_step(model, tmp_path / "two.pt", 2, algo, *flags)
    assert one["params"].keys() == two["params"].keys()
    worst = max((one["params"][k] - two["params"][k]).abs().max().item() for k in one["params"])
    assert worst < 1e-5, f"largest parameter difference {worst}"
    adapters = [k for k in one["params"] if lora.is_adapter_key(k)]
    # Every linear layer of the 2 decoder blocks (q, k, v, o, gate, up, down), not lm_head.
    assert len(adapters) == 2 * 7 * 2 and not any("lm_head" in k for k in adapters)
    dtype = torch.bfloat16 if family.endswith("-bf16") else torch.float32
    init = {k: v.to(dtype) for k, v in load_file(str(model / "model.safetensors")).items()}
    base = {lora.hf_name(k): v for k, v in one["params"].items() if not lora.is_adapter_key(k)}
    assert base.keys() - init.keys() == ({"lm_head.weight"} if family == "llama-tied" else set())
    assert all(torch.equal(base[k], v) for k, v in init.items())
    if family == "llama-tied":
        assert torch.equal(base["lm_head.weight"], base["model.embed_tokens.weight"])
    # B starts at zero: the step moved it.
    assert max(one["params"][k].abs().max().item() for k in adapters if ".lora_B." in k) > 1e-4
    assert abs(one["metrics"]["actor/pg_loss"] - two["metrics"]["actor/pg_loss"]) < 1e-5
