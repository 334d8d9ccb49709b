"""One GRPO step of a real model at the settings RL fine-tuning runs at (lr 1e-6, fp32 master
weights, the default bf16 export), exporting the policy before and after the step through
the engine's own `export_policy` into two local directories."""

import sys

from rft_contract.config import load_config
from rft_contract.storage import LocalStorage
from rft_trainer.engine import FSDPTrainEngine
from rft_trainer.parallelize import init_distributed
from tests.fixtures.batches import synthetic_batch


def main(model_dir: str, before: str, after: str) -> None:
    config = load_config({
        "model": {"path": model_dir},
        "algorithm": {"name": "grpo", "learning_rate": 1e-6, "kl_coef": 0.0, "micro_batch_size": 4},
        "trainer": {"total_steps": 5, "batch_size": 4, "fsdp": {"mixed_precision": "fp32"}},
        "checkpoint": {"uri": "file:///unused"},
    })
    rt = init_distributed()
    engine = FSDPTrainEngine(config, rt)
    engine.prepare()
    engine.train_step(synthetic_batch(4, 8, 8, vocab=4000, seed=3))  # the probe's tokens
    engine.export_policy(LocalStorage(), before, "bf16")
    engine.train_step(synthetic_batch(4, 8, 8, vocab=4000, seed=4))
    engine.export_policy(LocalStorage(), after, "bf16")


if __name__ == "__main__":
    from rft_trainer.__main__ import exit_process

    main(*sys.argv[1:])
    exit_process(0)
