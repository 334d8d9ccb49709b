"""Actor-update throughput: the FSDP2 engine against a plain PyTorch loop.

    python bench/train_step.py [--sizes tiny,medium] [--ranks 1,2] [--batch 4]
                               [--seq 64+64] [--steps 3] [--micro 2] [--repeat 3]
                               [--threads N] [--peak-tflops X]

For each model size it measures, in the same invocation:
  * plain: one process, the HF model from `AutoModelForCausalLM.from_pretrained` (fp32,
    no FSDP), the same fixed batch, the same loss as `Actor.update_policy` (token_logprobs
    with entropy, losses.policy_loss with the same clip ratio and aggregation, each
    micro-batch weighted by its share of the mini-batch), grad clipping and an AdamW step;
  * engine: `FSDPTrainEngine` (fp32) under torchrun with 1, 2, ... ranks, timing
    `engine.actor.update_policy(local, old_lp, adv, None)` on each rank's slice of the
    same global batch. The script re-runs itself with `--worker` as the torchrun worker.
Old log-probs and advantages are computed once before timing, as train_step does; one
warm-up update, then `--steps` timed updates (each a full optimiser step on the batch).
tokens/s counts the attention-mask tokens of the global batch per second of update time
(the median timed step; for several ranks, the slowest rank's time of each step).
The whole comparison runs `--repeat` times, interleaved (plain, engine x1, engine x2,
plain, ...), so a noisy minute hits every way alike: each row gives the median over the
runs and their spread (min-max), and `x plain` is the median of the per-run ratios
against the plain loop of the same run (goal for 1 rank: >= 0.95), with their spread.

On CPU the ranks share the machine's cores (OMP_NUM_THREADS = threads / ranks, threads
defaulting to all cores), so more ranks add communication, not compute: with gloo every
update all-gathers the full fp32 parameters twice (forward, and again in backward as
blocks are resharded after forward) and reduce-scatters the gradients, all through the
same CPUs. On a busy machine multi-threaded runs of small ops slow down erratically
(OpenMP threads wait for a core); `--threads 1` gives steadier, single-core numbers.
On CUDA each rank gets a GPU and the plain loop runs on one GPU (`--peak-tflops` then
gives MFU). Everything goes to stdout; no thresholds: it prints numbers.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.fixtures, run from anywhere

from rft_trainer.algorithms import advantages as advs  # noqa: E402
from rft_trainer.algorithms import losses  # noqa: E402
from rft_contract.config import JobConfig as Config, load_config  # noqa: E402
from rft_trainer.roles import make_optimizer, token_logprobs  # noqa: E402
from tests.fixtures.models import save_tiny_model, tiny_vocab  # noqa: E402
from tests.fixtures.batches import synthetic_batch  # noqa: E402

# Arguments of save_tiny_model. medium: ~99M parameters, almost all in the 12 blocks
# (the tiny vocabulary is 24 tokens, so embeddings and lm_head are ~37K).
SIZES: dict[str, dict[str, int]] = {
    "tiny": {},  # save_tiny_model's defaults: hidden 64, 2 layers, 4 heads / 2 kv, mlp 128
    "medium": {"hidden": 768, "layers": 12, "heads": 12, "kv_heads": 12, "intermediate": 2560},
}
MARK = "TRAIN_STEP_RESULT "
LR = 1e-6


# ------------------------------------------------------------------ shared setup


def parse_seq(text: str) -> tuple[int, int]:
    """'64+64' or '64,64' -> (prompt, response); a single number is split in half."""
    for sep in ("+", ","):
        if sep in text:
            p, r = (int(x) for x in text.split(sep))
            return p, r
    total = int(text)
    return total - total // 2, total // 2


def make_config(model_dir: str, args) -> Config:
    return load_config({
        "model": {"path": model_dir},
        # kl_coef 0: no reference model is built (update_policy gets ref_logprob=None).
        "algorithm": {"name": "grpo", "learning_rate": LR, "kl_coef": 0.0,
                      "micro_batch_size": args.micro, "mini_batch_size": args.batch, "epochs": 1},
        "trainer": {"total_steps": 1000, "batch_size": args.batch,
                    "fsdp": {"mixed_precision": "fp32"}},
        "checkpoint": {"uri": "s3://unused/bench"},
    })


def make_batch(args):
    prompt, response = parse_seq(args.seq)
    return synthetic_batch(args.batch, prompt, response, vocab=len(tiny_vocab()),
                           group_size=min(4, args.batch), seed=1)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------ worker (torchrun)


def worker(args) -> None:
    import torch.distributed as dist

    from rft_trainer.engine import FSDPTrainEngine

    config = make_config(args.model, args)
    engine = FSDPTrainEngine(config)
    engine.prepare()
    rt, actor = engine.rt, engine.actor
    batch = make_batch(args).to(rt.device)
    local = engine.local_slice(batch)
    # As train_step: old log-probs on the local slice, GRPO advantages over whole groups.
    old_lp, _ = actor.compute_log_prob(local)
    adv, _ = advs.grpo_advantages(batch.rewards, batch.group_ids, batch.action_mask.float(),
                                  norm_by_std=config.algorithm.norm_adv_by_std)
    adv = adv[engine.local_indices(len(batch))]

    times, first = [], {}
    for i in range(1 + args.steps):
        sync(rt.device)
        dist.barrier()
        start = time.perf_counter()
        metrics = actor.update_policy(local, old_lp, adv, None)
        sync(rt.device)
        t = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=rt.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if i == 0:
            first = metrics
        else:
            times.append(float(t))
    if rt.is_main:
        tokens = int(batch.attention_mask.sum())
        print(MARK + json.dumps({
            "ranks": rt.world_size, "tokens": tokens, "step_s": times,
            "pg_loss": first["actor/pg_loss"], "grad_norm": first["actor/grad_norm"],
            "threads": torch.get_num_threads(), "device": str(rt.device),
            "attn": getattr(actor.model.config, "_attn_implementation", "?"),
        }), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def run_engine(model_dir: str, ranks: int, args, threads: int) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}",
           "--master-port=0", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0",
           str(Path(__file__).resolve()), "--worker", "--model", model_dir,
           "--batch", str(args.batch), "--seq", args.seq, "--steps", str(args.steps),
           "--micro", str(args.micro)]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, threads // ranks))}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
    for line in res.stdout.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    tail = (res.stderr or res.stdout)[-3000:]
    return {"error": f"torchrun exited {res.returncode}:\n{tail}"}


# ------------------------------------------------------------------ plain baseline


def run_plain(model_dir: str, args, device: torch.device) -> dict:
    """The same update as Actor._update_mini with one mini-batch, without FSDP."""
    from transformers import AutoModelForCausalLM

    config = make_config(model_dir, args)
    a, o = config.algorithm, config.optimizer
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    opt = make_optimizer(model, a.learning_rate, o.betas, o.weight_decay, decay_all=o.weight_decay_all)
    batch = make_batch(args).to(device)
    mask = batch.action_mask.float()
    idx = torch.arange(len(batch), device=device)
    mode = a.loss_aggregation

    def count(m: torch.Tensor) -> float:
        return losses.aggregate_count(m, mode)

    def forward(sel):
        mb = batch.select(sel)
        return model(input_ids=mb.tokens, attention_mask=mb.attention_mask.long(),
                     use_cache=False).logits, mb.tokens

    with torch.no_grad():
        old_lp = torch.cat([token_logprobs(*forward(sel))[0] for sel in idx.split(a.micro_batch_size)])
    adv, _ = advs.grpo_advantages(batch.rewards, batch.group_ids, mask, norm_by_std=a.norm_adv_by_std)
    total = count(mask)

    def update() -> dict:
        opt.zero_grad(set_to_none=True)
        pg = []
        for sel in idx.split(a.micro_batch_size):
            logits, tokens = forward(sel)
            m = mask[sel]
            lp, ent = token_logprobs(logits, tokens, with_entropy=True)
            loss, metrics = losses.policy_loss(
                old_lp[sel], lp, adv[sel], m, a.clip_ratio_low or a.clip_ratio,
                a.clip_ratio_high or a.clip_ratio, a.dual_clip_ratio, mode)
            float(losses.aggregate(ent.detach(), m, "token-mean"))  # the engine's entropy metric
            (loss * count(m) / max(total, 1.0)).backward()
            pg.append(float(metrics["actor/pg_loss"]))
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), a.grad_clip)
        if torch.isfinite(grad_norm):
            opt.step()
        return {"pg_loss": sum(pg) / len(pg), "grad_norm": float(grad_norm)}

    times, first = [], {}
    for i in range(1 + args.steps):
        sync(device)
        start = time.perf_counter()
        m = update()
        sync(device)
        if i == 0:
            first = m
        else:
            times.append(time.perf_counter() - start)
    tokens = int(batch.attention_mask.sum())
    out = {"ranks": 0, "tokens": tokens, "step_s": times,
           "params": n_params, "threads": torch.get_num_threads(), "device": str(device),
           "attn": getattr(model.config, "_attn_implementation", "?"), **first}
    del model, opt
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


# ------------------------------------------------------------------ report


def model_flops(params: int, layers: int, hidden: int, seq: int, tokens: int) -> float:
    """Training FLOPs of one update: 6 N per token (forward 2N + backward 4N) plus the
    attention score/value matmuls, 12 * layers * hidden * seq per token (PaLM, app. B)."""
    return (6 * params + 12 * layers * hidden * seq) * tokens


def fmt_rate(x: float) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6)):
        if x >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{x:.0f} "


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="tiny,medium", help=f"comma list of {', '.join(SIZES)}")
    p.add_argument("--ranks", default="1,2", help="comma list of torchrun world sizes")
    p.add_argument("--batch", type=int, default=4, help="global batch (sequences)")
    p.add_argument("--seq", default="64+64", help="prompt+response lengths (or one total, split in half)")
    p.add_argument("--steps", type=int, default=3, help="timed updates after 1 warm-up")
    p.add_argument("--micro", type=int, default=2, help="micro-batch size (per rank)")
    p.add_argument("--repeat", type=int, default=3, help="runs of the whole comparison, interleaved")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="peak dense TFLOP/s of one device in fp32 (torch leaves TF32 off), for MFU")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads in all: the plain loop's, split evenly over ranks (default: all cores)")
    p.add_argument("--timeout", type=int, default=1200, help="seconds per torchrun run")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)

    t_start = time.perf_counter()
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    sizes = [s for s in args.sizes.split(",") if s]
    ranks_list = [int(r) for r in args.ranks.split(",") if r]
    for s in sizes:
        if s not in SIZES:
            p.error(f"--sizes: unknown size {s!r} (known: {', '.join(SIZES)})")
    for r in ranks_list:
        if args.batch % r or (args.batch // r) % args.micro:
            p.error(f"--batch {args.batch} must split into {r} ranks of whole micro-batches of {args.micro}")
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = args.threads or cores
    torch.set_num_threads(threads)
    prompt, response = parse_seq(args.seq)
    seq = prompt + response
    load = f", load average {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""
    where = f"cuda x {torch.cuda.device_count()}" if cuda else f"cpu, {cores} cores{load}, {threads} threads"
    print(f"device: {where}; "
          f"torch {torch.__version__}; fp32; batch {args.batch} x seq {prompt}+{response}, "
          f"micro-batch {args.micro}, {args.steps} timed updates after 1 warm-up")

    rows = []  # (size, params, spec, ranks, [result per run])
    with tempfile.TemporaryDirectory(prefix="rft-train-step-") as tmp:
        for size in sizes:
            spec = {"hidden": 64, "layers": 2, **SIZES[size]}
            model_dir = str(save_tiny_model(Path(tmp) / size, **SIZES[size], with_tokenizer=False))
            runs: dict[int, list[dict]] = {0: [], **{r: [] for r in ranks_list}}
            for rep in range(args.repeat):
                plain = run_plain(model_dir, args, device)
                n = plain["params"]
                print(f"\n[{size} run {rep + 1}/{args.repeat}] {n / 1e6:.2f}M params; plain ({plain['device']}, "
                      f"{plain['threads']} threads, attn {plain['attn']}): steps "
                      f"{[round(t, 3) for t in plain['step_s']]} s, first pg_loss {plain['pg_loss']:.6f} "
                      f"grad_norm {plain['grad_norm']:.6f}", flush=True)
                runs[0].append(plain)
                for r in ranks_list:
                    if cuda and r > torch.cuda.device_count():
                        print(f"[{size}] {r} ranks: skipped ({torch.cuda.device_count()} GPUs)")
                        continue
                    res = run_engine(model_dir, r, args, threads)
                    if "error" in res:
                        print(f"[{size}] engine, {r} ranks: FAILED\n{res['error']}", flush=True)
                        res = None
                    else:
                        print(f"[{size} run {rep + 1}/{args.repeat}] engine {r} rank(s) ({res['device']}, "
                              f"{res['threads']} threads each, attn {res['attn']}): steps "
                              f"{[round(t, 3) for t in res['step_s']]} s, first pg_loss {res['pg_loss']:.6f} "
                              f"grad_norm {res['grad_norm']:.6f}", flush=True)
                    runs[r].append(res)
            for r, results in runs.items():
                rows.append((size, n, spec, r, results))
            shutil.rmtree(model_dir, ignore_errors=True)

    print("\nMFU formula: FLOPs per update = (6 * N + 12 * layers * hidden * seq) * tokens, i.e. "
          "forward+backward matmuls over all N parameters plus attention scores/values "
          f"(PaLM app. B; seq = padded length {seq}, not halved for the causal mask); "
          "tokens = attention-mask tokens of the global batch (padding computed but not credited); "
          "the old-log-prob forward is outside the timed update.")
    if args.peak_tflops is None:
        print("MFU needs a device peak: pass --peak-tflops (one device, fp32). FLOP/s only below.")
    print(f"tokens/s = tokens / median step time of a run; the row is the median over {args.repeat} runs "
          "[min-max]; x plain = median [min-max] of each run's tokens/s over the plain loop's in the same run; "
          "x plain/dev divides by the devices used (GPUs; CPU ranks share one machine).")
    hdr = (f"{'size':<7} {'params':>8} {'run':>9} {'tokens':>6} {'step s':>8} {'tokens/s [min-max]':>24} "
           f"{'x plain [min-max]':>20} {'x plain/dev':>11} {'FLOP/s':>14} {'MFU':>6}")
    print("\n" + hdr + "\n" + "-" * len(hdr))
    plain_rates: dict[str, list[float | None]] = {}
    for size, n, spec, r, results in rows:
        rates = [res["tokens"] / statistics.median(res["step_s"]) if res else None for res in results]
        if r == 0:
            plain_rates[size] = rates
        ok = [x for x in rates if x is not None]
        if not ok:
            continue
        ratios = [x / b for x, b in zip(rates, plain_rates[size]) if x is not None and b]
        rate, ratio = statistics.median(ok), statistics.median(ratios)
        step = next(res for res in results if res)["tokens"] / rate
        tokens = next(res for res in results if res)["tokens"]
        devices = r if (cuda and r) else 1
        flops = model_flops(n, spec["layers"], spec["hidden"], seq, tokens) / step
        mfu = f"{flops / (args.peak_tflops * 1e12 * devices):.1%}" if args.peak_tflops else "n/a"
        name = "plain" if r == 0 else f"fsdp x{r}"
        spread = f"{rate:.1f} [{min(ok):.1f}-{max(ok):.1f}]"
        rspread = f"{ratio:.2f} [{min(ratios):.2f}-{max(ratios):.2f}]"
        print(f"{size:<7} {n / 1e6:>7.2f}M {name:>9} {tokens:>6} {step:>8.3f} {spread:>24} "
              f"{rspread:>20} {ratio / devices:>11.2f} {fmt_rate(flops) + 'FLOP/s':>14} {mfu:>6}")
    load = f" (load average now {os.getloadavg()[0]:.1f})" if hasattr(os, "getloadavg") else ""
    print(f"\nwall time: {time.perf_counter() - t_start:.1f} s{load}")


if __name__ == "__main__":
    main()
