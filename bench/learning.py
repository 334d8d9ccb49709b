"""Does GRPO make a real model better? SmolLM2-135M-Instruct (tests/fixtures/real_model.py)
on an arithmetic taskset phrased as chat questions, through the production pieces: the
reference inference server, the explorer (chat template, rewards, experience shards),
the buffer reader, the FSDP2 engine, the HF export and the server's hot reload.

    python bench/learning.py [--steps 12] [--tasks-per-step 8] [--rollouts 4]
    python bench/learning.py --lag 2 --max-staleness 1 --stale-samples keep --rollout-is token

Prints held-out accuracy (greedy decoding, `math_accuracy`) before and after training,
the mean training reward per step, and seconds per step split into rollouts, training
and weight sync. Not part of CI (minutes on a CPU); docs/trainer.md has one run's figures.

Off-policy (`--lag L`): the explorer runs L versions ahead of the trainer, as an
asynchronous one does: step s's rollouts come from version max(0, s - 1 - L) while the
trainer is at s - 1. `--max-staleness` and `--stale-samples` are spec.buffer's (drop:
samples staler than maxStaleness are skipped, and a run whose every batch is too stale
starves; keep: trained under `--rollout-is`, spec.algorithm.rolloutCorrection.rolloutIs).
`make bench-offpolicy` runs the synchronous run, then three at lag 2 (drop, too stale to
train; uncorrected, maxStaleness 2; kept under token IS), one after another.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "contract"), str(ROOT / "trainer_image"), str(ROOT)]

from rft_contract.config import load_config  # noqa: E402
from rft_contract.storage import LocalStorage  # noqa: E402
from rft_rollout.evaluation import evaluate  # noqa: E402
from rft_rollout.explorer import Explorer  # noqa: E402
from rft_rollout.rewards import math_accuracy  # noqa: E402
from rft_rollout.tasksets import write_taskset  # noqa: E402
from rft_serving.serve import ReferenceServer  # noqa: E402
from rft_trainer.engine import FSDPTrainEngine  # noqa: E402
from rft_trainer.experience import BufferReader  # noqa: E402
from rft_trainer.export import export_hf  # noqa: E402
from tests.fixtures.real_model import smollm2_dir  # noqa: E402


def questions(n: int, seed: int, exclude: set[str] = frozenset()) -> list[dict[str, str]]:
    """Two-digit additions and subtractions as chat questions."""
    rng, out = random.Random(seed), []
    while len(out) < n:
        a, b, op = rng.randint(10, 60), rng.randint(1, 40), rng.choice("+-")
        prompt = f"What is {a} {op} {b}? Answer with the number only."
        if prompt not in exclude and prompt not in {t["prompt"] for t in out}:
            out.append({"id": f"s{seed}-{len(out)}", "prompt": prompt, "answer": str(a + b if op == "+" else a - b)})
    return out


def accuracy(url: str, tasks: list[dict[str, str]], tokenizer, max_tokens: int) -> float:
    return evaluate(url, tasks, tokenizer, math_accuracy, max_tokens=max_tokens, timeout=3600).mean_reward  # greedy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--tasks-per-step", type=int, default=8)
    ap.add_argument("--rollouts", type=int, default=4, help="samples per task (the GRPO group)")
    ap.add_argument("--eval", type=int, default=64, help="held-out tasks")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--lag", type=int, default=0, help="versions the explorer runs ahead of the trainer")
    ap.add_argument("--max-staleness", type=int, default=0, help="spec.buffer.maxStaleness")
    ap.add_argument("--stale-samples", choices=("drop", "keep"), default="drop", help="spec.buffer.staleSamples")
    ap.add_argument("--rollout-is", choices=("token", "sequence"), default=None,
                    help="spec.algorithm.rolloutCorrection.rolloutIs (truncated at 2.0)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    model_dir = smollm2_dir()
    work = Path(tempfile.mkdtemp(prefix="rft-learning-"))
    train = questions(args.steps * args.tasks_per_step, seed=1)
    held_out = questions(args.eval, seed=2, exclude={t["prompt"] for t in train})
    write_taskset(str(work / "train.jsonl"), train)
    batch = args.tasks_per_step * args.rollouts
    config = load_config({
        "model": {"path": str(model_dir)},
        "algorithm": {"name": "grpo", "learning_rate": args.lr, "kl_coef": 0.0,
                      "micro_batch_size": 8, "mini_batch_size": batch,
                      **({"rollout_correction": {"rollout_is": args.rollout_is}} if args.rollout_is else {})},
        "trainer": {"total_steps": args.steps, "batch_size": batch, "fsdp": {"mixed_precision": "fp32"}},
        "checkpoint": {"uri": str(work / "run")},
        "buffer": {"uri": str(work / "buffer"), "max_staleness": args.max_staleness,
                   **({"stale_samples": "keep"} if args.stale_samples == "keep" else {})},
        "inference": {"replicas": 1},
        "explorer": {"taskset_uri": str(work / "train.jsonl"), "rollouts_per_task": args.rollouts,
                     "sampling": {"temperature": args.temperature, "max_tokens": args.max_tokens},
                     "reward": "math_accuracy", "tasks_per_shard": args.tasks_per_step},
    }, env={})

    server = ReferenceServer(host="127.0.0.1", port=0, served_model_name="policy", device="cpu")
    server.start()
    server.load(str(model_dir), 0)
    tokenizer = server.current.tokenizer
    before = accuracy(server.url, held_out, tokenizer, args.max_tokens)
    print(f"held-out accuracy before: {before:.3f} ({len(held_out)} tasks, greedy)", flush=True)

    explorer = Explorer(config, [server.url], tokenizer=tokenizer)
    engine = FSDPTrainEngine(config)
    engine.prepare()
    reader = BufferReader(config.buffer.uri, batch,
                          max_staleness=None if args.stale_samples == "keep" else args.max_staleness)
    versions, served = {0: str(model_dir)}, 0  # exported versions: where each lies
    rows, starved = [], None
    for step in range(1, args.steps + 1):
        t_load = time.perf_counter()
        if (behind := max(0, step - 1 - args.lag)) != served:  # the explorer's policy, `lag` behind
            server.load(versions[behind], behind)
            served = behind
        t0 = time.perf_counter()
        explorer.run(max_shards=1)
        t1 = time.perf_counter()
        exp = reader.next_batch(current_version=step - 1)
        if exp is None:  # every sample too stale: drop starves the trainer
            starved = {"step": step, "dropped_stale": reader.stats["dropped_stale"] + sum(reader.pending_stale.values())}
            print(json.dumps({"starved": starved}), flush=True)
            break
        _, metrics = engine.train_step(exp)
        t2 = time.perf_counter()
        dest = str(work / "weights" / f"step-{step:08d}")
        export_hf(engine.actor.model, engine.rt, LocalStorage(), dest, str(model_dir), step, dtype="fp32")
        versions[step] = dest
        t3 = time.perf_counter()
        row = {"step": step, "reward": round(float(exp.rewards.float().mean()), 3),
               "rollout_s": round(t1 - t0, 1), "train_s": round(t2 - t1, 1), "sync_s": round(t3 - t2 + t0 - t_load, 1),
               "pg_loss": round(metrics["actor/pg_loss"], 4), "lag": metrics.get("staleness/lag_mean"),
               "is_weight_mean": metrics.get("rollout_corr/rollout_is_mean"),
               "mismatch_kl": metrics.get("rollout_corr/kl"),
               "dropped_stale": reader.stats["dropped_stale"]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    last = max(versions)
    server.load(versions[last], last)
    after = accuracy(server.url, held_out, tokenizer, args.max_tokens)
    server.stop()
    per_step = sum(r["rollout_s"] + r["train_s"] + r["sync_s"] for r in rows) / max(1, len(rows))
    k = max(1, len(rows) // 3)
    print(json.dumps({
        "lag": args.lag, "max_staleness": args.max_staleness, "stale_samples": args.stale_samples,
        "rollout_is": args.rollout_is, "trained_steps": last, "starved": starved,
        "dropped_stale": reader.stats["dropped_stale"] + sum(reader.pending_stale.values()),
        "held_out_before": round(before, 3), "held_out_after": round(after, 3),
        "reward_first_third": round(sum(r["reward"] for r in rows[:k]) / k, 3),
        "reward_last_third": round(sum(r["reward"] for r in rows[-k:]) / k, 3),
        "seconds_per_step": round(per_step, 1),
        "rollout_s": round(sum(r["rollout_s"] for r in rows) / len(rows), 1),
        "train_s": round(sum(r["train_s"] for r in rows) / len(rows), 1),
        "sync_s": round(sum(r["sync_s"] for r in rows) / len(rows), 1),
        "steps": args.steps, "batch": batch}), flush=True)


if __name__ == "__main__":
    main()
