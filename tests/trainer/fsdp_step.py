"""Run under torchrun: one train_step on a fixed global batch, then rank 0 writes the full
parameters to OUT. tests/trainer/test_fsdp.py compares 1 process against 2 ranks."""

import dataclasses
import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from rft_contract.config import load_config
from tests.fixtures.batches import synthetic_batch
from rft_trainer.engine import FSDPTrainEngine


def main(model_dir: str, out: str, algo: str, *flags: str) -> None:
    checkpointing = "--activation-checkpointing" in flags
    model = {"path": model_dir}
    if "--lora" in flags:  # all-linear, scale 2: the adapters alone train
        model["lora"] = {"rank": 4, "alpha": 8}
    if "--bf16" in flags:  # bf16 master weights (the adapters stay fp32)
        model["dtype"] = "bf16"
    algorithm = {"name": algo, "learning_rate": 1e-3, "critic_learning_rate": 1e-3,
                 "kl_coef": 0.01, "micro_batch_size": 2, "mini_batch_size": 8, "epochs": 1}
    if "--rollout-correction" in flags:  # sequence IS and a token band that rejects some tokens
        algorithm["rollout_correction"] = {"rollout_is": "sequence", "rollout_is_threshold": 1.2,
                                           "rollout_rs": [{"name": "token_k1", "threshold": 1.3}]}
    if "--rollout-is" in flags:  # token IS alone
        algorithm["rollout_correction"] = {"rollout_is": "token", "rollout_is_threshold": 1.2}
    config = load_config({
        "model": model,
        "algorithm": algorithm,
        "trainer": {"total_steps": 10, "batch_size": 8, "fsdp": {"mixed_precision": "fp32",
                                                             "activation_checkpointing": checkpointing,
                                                             # A no-op on CPU (parameters live there
                                                             # already): set only as GPU users would.
                                                             "cpu_offload": checkpointing}},
        "checkpoint": {"uri": "s3://unused/x"},
    })
    engine = FSDPTrainEngine(config)
    engine.prepare()
    batch = synthetic_batch(8, prompt_len=4, response_len=6, vocab=24, group_size=4, seed=1)
    if {"--rollout-correction", "--rollout-is", "--rollout-logprobs"} & set(flags):
        # an engine's log-probs: near the random model's log(1/24)
        noise = torch.randn(batch.tokens.shape, generator=torch.Generator().manual_seed(2)) * 0.3
        batch = dataclasses.replace(batch, rollout_logprobs=(-3.18 + noise) * batch.action_mask)
    _, metrics = engine.train_step(batch)
    full = get_model_state_dict(engine.actor.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        torch.save({"params": full, "metrics": metrics}, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from rft_trainer.__main__ import exit_process

    main(*sys.argv[1:])
    exit_process(0)  # see exit_process: teardown may abort after the work is done
