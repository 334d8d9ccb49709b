"""Run under torchrun: one train step on 2 ranks, then export the policy to S3 in
the given dtype; rank 0 also saves the full parameters locally for comparison."""

import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from rft_contract.config import load_config
from rft_contract.probe import PROBE_FILE
from rft_trainer.export import export_hf
from rft_trainer.probe import build_probe
from rft_contract.s3 import S3Storage
from tests.fixtures.batches import synthetic_batch
from rft_trainer.engine import FSDPTrainEngine
from rft_trainer.parallelize import init_distributed


def main(model_dir: str, dest: str, dtype: str, out: str) -> None:
    config = load_config({
        "model": {"path": model_dir},
        "algorithm": {"name": "grpo", "learning_rate": 1e-3, "kl_coef": 0.0, "micro_batch_size": 2},
        "trainer": {"total_steps": 5, "batch_size": 8, "fsdp": {"mixed_precision": "fp32"}},
        "checkpoint": {"uri": "s3://unused/x"},
    })
    rt = init_distributed()
    engine = FSDPTrainEngine(config, rt)
    engine.prepare()
    engine.train_step(synthetic_batch(8, 4, 6, vocab=24, seed=3))
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    before = get_model_state_dict(engine.actor.model, options=options)
    check = build_probe(engine.actor.model, rt.device, engine.probe_tokens, dtype, 1)
    # Small shards so the export really streams several files.
    export_hf(engine.actor.model, rt, S3Storage(), dest, model_dir, step=1, dtype=dtype,
              max_shard_bytes=64 * 1024, extra_files={PROBE_FILE: check.to_json().encode()})
    full = get_model_state_dict(engine.actor.model, options=options)
    if dist.get_rank() == 0:
        # The probe rounded the weights for its forward and put them back bit for bit.
        assert all(torch.equal(before[k], full[k]) for k in full), "the probe changed the weights"
        torch.save(full, out)
    dist.barrier()  # no rank tears the group down while another still talks to it
    dist.destroy_process_group()


if __name__ == "__main__":
    from rft_trainer.__main__ import exit_process

    main(*sys.argv[1:])
    exit_process(0)  # see exit_process: teardown may abort after the work is done
