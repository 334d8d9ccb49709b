"""Optimizer knobs of `spec.optimizer` and `spec.model.dtype` do what their docs say."""

from __future__ import annotations

import math

import pytest
import torch

from rft_trainer.parallelize import backend_for, build_model
from rft_trainer.roles import make_optimizer, make_scheduler
from tests.fixtures.models import save_tiny_model


def lrs(schedule: str, min_lr_ratio: float, steps: int = 12, warmup: int = 2) -> list[float]:
    opt = make_optimizer(torch.nn.Linear(2, 2), lr=1.0)
    sched = make_scheduler(opt, warmup, total_steps=10, schedule=schedule, min_lr_ratio=min_lr_ratio)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_cosine_decays_to_min_lr_ratio_and_stays_there():
    got = lrs("cosine", 0.1)
    assert got[:2] == [0.5, 1.0]  # linear warmup
    assert got[2] == pytest.approx(1.0)
    assert got[6] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert got[10:] == pytest.approx([0.1, 0.1])  # at and past total_steps


def test_cosine_without_floor_reaches_zero_and_constant_ignores_the_ratio():
    assert lrs("cosine", 0.0)[10] == pytest.approx(0.0)
    assert lrs("constant", 0.5)[2:] == pytest.approx([1.0] * 10)


@pytest.mark.parametrize("dtype, want", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_master_weights_dtype(tmp_path, world_of_one, dtype, want):
    model = build_model(str(save_tiny_model(tmp_path / "m")), world_of_one, fsdp_mode="fp32", param_dtype=dtype)
    assert {p.dtype for p in model.parameters()} == {want}


@pytest.mark.parametrize("cuda, offload, want", [
    (False, False, "gloo"), (False, True, "gloo"),
    (True, False, "nccl"), (True, True, "cuda:nccl,cpu:gloo"),
])
def test_process_group_backend(cuda, offload, want):
    """CPU offload on GPUs puts DTensors on the CPU: their collectives need gloo too."""
    assert backend_for(cuda, offload) == want


def test_one_rank_in_fp32_is_not_sharded_and_keeps_tied_embeddings_tied(tmp_path, world_of_one):
    """FSDP2 on one rank would only copy parameters in and out (parallelize.apply_fsdp); the
    plain model must still load the weights and keep a shared Parameter shared."""
    from safetensors.torch import load_file
    from torch.distributed.fsdp import FSDPModule

    path = save_tiny_model(tmp_path / "m", tie_word_embeddings=True)
    model = build_model(str(path), world_of_one, fsdp_mode="fp32")
    assert not isinstance(model, FSDPModule)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    saved = load_file(str(path / "model.safetensors"))
    assert torch.equal(model.model.embed_tokens.weight, saved["model.embed_tokens.weight"])


def group_names(model, optimizer) -> list[tuple[float, set[str]]]:
    name = {id(p): n for n, p in model.named_parameters()}
    return [(g["weight_decay"], {name[id(p)] for p in g["params"]}) for g in optimizer.param_groups]


@pytest.mark.parametrize("model_type, biases", [("llama", ()), ("gemma", ()), ("qwen2", ("q_proj", "k_proj", "v_proj"))])
def test_no_weight_decay_on_biases_and_norms_unless_decay_all(tmp_path, world_of_one, model_type, biases):
    """The groups the docs promise (spec.optimizer.weightDecayAll): weight decay on every
    weight matrix and embedding, none on the normalisation weights (Gemma's RMSNorm scales
    by 1 + w, Llama's by w) and biases; one decayed group with decay_all."""
    from tests.fixtures.architectures import save_tiny

    model = build_model(str(save_tiny(model_type, tmp_path / "m")), world_of_one, fsdp_mode="fp32")
    names = {n for n, _ in model.named_parameters()}
    norms = {"model.norm.weight"} | {f"model.layers.{i}.{n}.weight" for i in (0, 1)
                                     for n in ("input_layernorm", "post_attention_layernorm")}
    no_decay = norms | {f"model.layers.{i}.self_attn.{b}.bias" for i in (0, 1) for b in biases}
    assert no_decay <= names
    # Decayed: the projections' weight matrices and the embeddings (lm_head too when untied).
    assert names - no_decay == {n for n in names if n.endswith("_proj.weight")
                                or n in ("model.embed_tokens.weight", "lm_head.weight")}
    assert group_names(model, make_optimizer(model, 1e-3, weight_decay=0.1)) == [(0.1, names - no_decay),
                                                                              (0.0, no_decay)]
    assert group_names(model, make_optimizer(model, 1e-3, weight_decay=0.1, decay_all=True)) == [(0.1, names)]
