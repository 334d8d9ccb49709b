"""Training steps of the real trainer engine on whatever device torchrun gives it, with
the model-FLOPs utilisation (MFU) printed. Run by bench/gpu_check.sh on a GPU; it also
runs on CPU (no MFU then) so it can be checked anywhere:

    torchrun --nproc-per-node=1 bench/gpu_step.py --model DIR [--cpu-offload] [--steps 5]

MFU = achieved model FLOP/s / peak FLOP/s, with model FLOPs per step counted as
    6 * N * T_update   (forward + backward of the actor on every token it trains on)
  + 2 * N * T          (the actor's no-grad old-log-prob forward)
  + 2 * N * T          (the reference model's forward, when klCoef > 0)
where N is the parameter count (tied embeddings counted once) and T the tokens in the
global batch; attention's quadratic term is left out (short sequences here), as in
PaLM's MFU definition. Peak: --peak-tflops (989 = H100/H200 SXM dense bf16).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist

from rft_contract.config import load_config
from rft_trainer.engine import FSDPTrainEngine
from tests.fixtures.batches import synthetic_batch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--response-len", type=int, default=256)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--cpu-offload", action="store_true")
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    args = ap.parse_args()
    config = load_config({
        "model": {"path": args.model},
        "algorithm": {"name": "grpo", "learning_rate": 1e-6, "kl_coef": 0.001, "micro_batch_size": args.micro},
        "trainer": {"total_steps": args.steps + 1, "batch_size": args.batch,
                    "fsdp": {"mixed_precision": "bf16", "cpu_offload": args.cpu_offload}},
        "checkpoint": {"uri": "/tmp/rft-gpu-check/ckpt"},
    }, env={})
    engine = FSDPTrainEngine(config)
    engine.prepare()
    rt = engine.rt
    n_params = sum(p.numel() for p in engine.actor.model.parameters())  # shared once
    vocab = engine.actor.model.config.vocab_size
    cuda = rt.device.type == "cuda"
    times = []
    for step in range(args.steps + 1):  # step 0 warms up (allocator, kernels)
        batch = synthetic_batch(args.batch, args.prompt_len, args.response_len, vocab, seed=step).to(rt.device)
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        _, metrics = engine.train_step(batch)
        if cuda:
            torch.cuda.synchronize()
        if step:
            times.append(time.perf_counter() - start)
    tokens = args.batch * (args.prompt_len + args.response_len)
    passes = 6 + 2 + (2 if engine.ref is not None else 0)
    flops = passes * n_params * tokens
    step_s = sorted(times)[len(times) // 2]
    out = {"backend": dist.get_backend(), "device": str(rt.device), "world": rt.world_size,
           "cpu_offload": args.cpu_offload, "params": n_params, "tokens_per_step": tokens,
           "step_seconds_median": round(step_s, 4), "tokens_per_second": round(tokens / step_s, 1),
           "model_tflops_per_step": round(flops / 1e12, 3), "pg_loss": metrics.get("actor/pg_loss")}
    if cuda:
        out["mfu"] = round(flops / step_s / (args.peak_tflops * 1e12 * rt.world_size), 4)
        out["max_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    if rt.is_main:
        print(json.dumps(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
