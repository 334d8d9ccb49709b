"""Run under torchrun with the real SmolLM2-135M-Instruct (tied embeddings) from S3:

    real_model_worker.py MODEL_URI CKPT_URI OUT ALGO STEPS [--resume] [--save-at N] [--export DEST]

Trains STEPS steps of ALGO on fixed global batches (batch i is the same on every world
size), optionally resuming from the newest checkpoint under CKPT_URI, saving a checkpoint
after step N, and exporting the policy to DEST at the end. Rank 0 writes the full actor
(and critic) parameters to OUT. tests/trainer/test_real_model.py compares world sizes."""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from rft_contract.config import load_config
from rft_contract.storage import get_storage
from rft_trainer.checkpoint import build_checkpointer
from rft_trainer.engine import FSDPTrainEngine
from rft_trainer.export import export_hf
from rft_trainer.modelcache import fetch_model
from rft_trainer.parallelize import init_distributed
from tests.fixtures.batches import synthetic_batch

VOCAB = 49152


def full(model) -> dict[str, torch.Tensor]:
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def main() -> None:
    ap = argparse.ArgumentParser()
    for name in ("model", "ckpt", "out", "algo"):
        ap.add_argument(name)
    ap.add_argument("steps", type=int)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--save-at", type=int)
    ap.add_argument("--export")
    args = ap.parse_args()
    config = load_config({
        "model": {"path": args.model},
        "algorithm": {"name": args.algo, "learning_rate": 1e-5, "critic_learning_rate": 1e-5,
                      "kl_coef": 0.01, "micro_batch_size": 2, "mini_batch_size": 4},
        "trainer": {"total_steps": 100, "batch_size": 4, "fsdp": {"mixed_precision": "fp32"}},
        "checkpoint": {"uri": args.ckpt, "interval": 1000},
    }, env={})
    rt = init_distributed()
    engine = FSDPTrainEngine(config, rt)
    engine.prepare()
    ckpt = build_checkpointer(config, get_storage(args.ckpt), rt, engine.checkpoint_roles())
    if args.resume:
        step = ckpt.resume()
        assert step is not None, "no checkpoint to resume from"
        engine.set_train_step_num(step)
    metrics = {}
    while engine.train_step_num < args.steps:
        batch = synthetic_batch(4, prompt_len=6, response_len=6, vocab=VOCAB, group_size=2,
                                seed=engine.train_step_num)
        _, metrics = engine.train_step(batch)
        if engine.train_step_num == args.save_at:
            ckpt.save(engine.train_step_num, {})
    actor = engine.actor.model
    tied = actor.lm_head.weight is actor.model.embed_tokens.weight
    out = {"actor": full(actor), "tied": tied, "metrics": metrics, "step": engine.train_step_num}
    if engine.critic is not None:
        out["critic"] = full(engine.critic.model)
    if args.export:
        export_hf(actor, rt, get_storage(args.export), args.export, fetch_model(args.model, rt),
                  engine.train_step_num, dtype="fp32")
    if dist.get_rank() == 0:
        torch.save(out, args.out)
    ckpt.wait_on_save_thread()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from rft_trainer.__main__ import exit_process

    main()
    exit_process(0)  # see exit_process: teardown may abort after the work is done
