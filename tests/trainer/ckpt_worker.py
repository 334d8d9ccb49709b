"""Run under torchrun by tests/trainer/test_checkpoint.py.

    ckpt_worker.py MODEL_DIR URI OUT --steps N [--interval I] [--keep K] [--block] [--request-log FILE]
                  [--micro-batch-size M] [--lora]

Builds a PPO engine (actor + critic) on the tiny model, resumes from the newest verified
checkpoint under URI (if any) into the engine's `checkpoint_roles()` with the job's
checkpointer (`build_checkpointer`, as the Trainer does), then trains up to step N on
fixed synthetic batches
(batch of step s has seed s), calling `maybe_save` after every step. Rank 0 writes to OUT
(test harness only) the resumed step/extra, and full-state snapshots: "resumed" and one
per trained step, plus each step's metrics. With --request-log, every process appends one
line per S3 request it sends: `<node> <rank> <operation> <path?query> <range>` (node =
torchrun's GROUP_RANK), so a test can count downloads per node whatever code path sends them.
"""

import argparse
import os
from urllib.parse import unquote, urlsplit

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict)

from rft_contract.config import load_config
from rft_contract.storage import get_storage
from tests.fixtures.batches import synthetic_batch
from rft_trainer.checkpoint import build_checkpointer
from rft_trainer.engine import FSDPTrainEngine
from rft_trainer.parallelize import init_distributed

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def _copy(x):
    """Deep copy: full state dicts may alias the live parameters (1 rank, CPU)."""
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: _copy(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_copy(v) for v in x)
    return x


def snapshot(engine: FSDPTrainEngine) -> dict:
    out = {"rng": torch.get_rng_state().clone()}
    for name, role in (("actor", engine.actor), ("critic", engine.critic)):
        out[name] = {"model": get_model_state_dict(role.model, options=FULL),
                     "optim": get_optimizer_state_dict(role.model, role.optimizer, options=FULL),
                     "sched": role.scheduler.state_dict()}
    return _copy(out)


def buffer_position(step: int) -> dict:
    return {"buffer": {"shard": f"shard-{step:06d}", "offset": 3 * step, "stats": {"batches": step}}}


def log_requests(path: str) -> None:
    """Hook botocore before any S3 client exists (clients copy the session's handlers)."""
    import boto3

    boto3.setup_default_session()
    node, rank = os.environ.get("GROUP_RANK", "0"), os.environ.get("RANK", "0")

    def on_send(request, event_name: str, **_) -> None:
        url = urlsplit(request.url)
        target = unquote(url.path + (f"?{url.query}" if url.query else ""))
        rng = request.headers.get("Range") or "-"
        rng = rng.decode() if isinstance(rng, bytes) else rng
        with open(path, "a") as f:  # one short O_APPEND write per line: processes never interleave
            f.write(f"{node} {rank} {event_name.rsplit('.', 1)[1]} {target} {rng}\n")

    boto3.DEFAULT_SESSION.events.register("before-send.s3", on_send)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model_dir")
    p.add_argument("uri")
    p.add_argument("out")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--interval", type=int, default=1)
    p.add_argument("--keep", type=int, default=3)
    p.add_argument("--block", action="store_true")
    p.add_argument("--request-log")
    p.add_argument("--micro-batch-size", type=int, default=2)  # must divide 12 / world size
    p.add_argument("--lora", action="store_true", help="LoRA adapters on the actor, and a KL term (the base)")
    args = p.parse_args()
    if args.request_log:
        log_requests(args.request_log)
    model = {"path": args.model_dir, **({"lora": {"rank": 4, "alpha": 8}} if args.lora else {})}
    config = load_config({
        "model": model,
        "algorithm": {"name": "ppo", "learning_rate": 1e-3, "critic_learning_rate": 1e-3,
                      "kl_coef": 0.01 if args.lora else 0.0,
                      "micro_batch_size": args.micro_batch_size, "mini_batch_size": 12, "epochs": 1},
        "optimizer": {"warmup_steps": 3},
        "trainer": {"total_steps": 100, "batch_size": 12, "fsdp": {"mixed_precision": "fp32"}},
        "checkpoint": {"uri": args.uri, "interval": args.interval, "keep": args.keep},
    })
    rt = init_distributed()
    engine = FSDPTrainEngine(config, rt)
    engine.prepare()
    ckpt = build_checkpointer(config, get_storage(args.uri), rt, engine.checkpoint_roles())
    resumed = ckpt.resume()
    if resumed is not None:
        engine.set_train_step_num(resumed)
    result = {"resumed": resumed, "extra": None if resumed is None else ckpt.app.extra,
              "world_size": rt.world_size,
              "sharded": isinstance(engine.actor.model, FSDPModule),
              "snapshots": {"resumed": snapshot(engine)}, "metrics": {}}
    while engine.step < args.steps:
        _, metrics = engine.train_step(synthetic_batch(12, 4, 6, vocab=24, group_size=4, seed=engine.step + 1))
        ckpt.maybe_save(engine.step, buffer_position(engine.step), block=args.block)
        result["metrics"][engine.step] = metrics
        result["snapshots"][engine.step] = snapshot(engine)
    ckpt.wait_on_save_thread()
    if rt.is_main:
        torch.save(result, args.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from rft_trainer.__main__ import exit_process

    main()
    exit_process(0)  # see exit_process: teardown may abort after the work is done
