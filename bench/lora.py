"""LoRA against full fine-tuning of the same model, in the same run: the trainer's peak
memory, checkpoint bytes, bytes per weight version, the time to export and load one, and
step time.

    python bench/lora.py [--model smollm2|tiny] [--rank 16] [--steps 4] [--batch 8]
                         [--prompt 16] [--response 48] [--vllm] [--out .local/bench/lora.json]

Each side is its own process (a fresh one: its peak RSS is its own), one rank on CPU, the
engine the trainer runs (FSDPTrainEngine: GRPO, klCoef 0.001 so there is a reference
policy, fp32 master weights), fixed synthetic batches. Full fine-tuning holds a second
model for the reference and AdamW state for every weight; LoRA (rank --rank, alpha 2 x
rank, all-linear) holds the adapters' AdamW state and uses the base with its adapters off
as the reference. After the steps: a checkpoint (CheckpointManager, local disk) and a weight
version in bf16 (the default sync.dtype) as a job with the reference engine syncs it: the
whole model (export_hf) against the adapter alone (export_adapter); then the reference
server (in this process) loads it, as a replica's engine does after the download: the whole
model into a new model, the adapter onto the base it serves already (loaded before the clock
starts). The bytes of a version are what each replica downloads (the relay moves each byte
once per replica). With --vllm, each side's version also loads into a real vLLM (the CPU
build, bf16) as the sync agent loads it, all steps and checks: the whole model reloaded in
place, against the adapter loaded in place of the last (`vllm_load_seconds`); then a greedy
32-token completion through what it serves (`vllm_generate_seconds`: LoRA's kernels cost
time on CPU), and the adapter files that engine read (3 loads: 3).

Columns: peak RSS of the trainer (MiB, the process's maximum before the server loads
anything), trainable parameters, checkpoint MiB, bytes per weight version (MiB), its export
and its load (s), and the median step time after the first step (s); `lora / full` the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def side(args) -> dict:
    """One side, in this process: train, checkpoint, export; the figures as a dict."""
    import torch

    from rft_contract.config import load_config
    from rft_contract.storage import LocalStorage
    from rft_trainer.checkpoint import CheckpointManager
    from rft_trainer.engine import FSDPTrainEngine
    from rft_serving.serve import ReferenceServer
    from rft_trainer.export import export_adapter, export_hf
    from rft_trainer.parallelize import init_distributed
    from tests.fixtures.batches import synthetic_batch

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1",
                       "LOCAL_RANK": "0"})
    model_dir, vocab = model_path(args.model)
    model = {"path": str(model_dir)}
    if args.side == "lora":
        model["lora"] = {"rank": args.rank, "alpha": 2 * args.rank}
    config = load_config({
        "model": model,
        "algorithm": {"name": "grpo", "learning_rate": 1e-5, "kl_coef": 0.001, "micro_batch_size": args.batch,
                      "mini_batch_size": args.batch, "epochs": 1},
        "trainer": {"total_steps": 100, "batch_size": args.batch, "fsdp": {"mixed_precision": "fp32"}},
        "checkpoint": {"uri": "s3://unused/x"},
    }, env={})
    rt = init_distributed()
    engine = FSDPTrainEngine(config, rt)
    engine.prepare()
    times = []
    for step in range(args.steps):
        batch = synthetic_batch(args.batch, args.prompt, args.response, vocab=vocab, group_size=4, seed=step)
        t = time.perf_counter()
        engine.train_step(batch)
        times.append(time.perf_counter() - t)
    work = Path(tempfile.mkdtemp(prefix=f"rft-bench-lora-{args.side}-"))
    roles = engine.checkpoint_roles()
    CheckpointManager(LocalStorage(), str(work / "run"), rt, roles={k: v for k, v in roles.items() if v},
                      staging_dir=str(work / "staging")).save(engine.step, {})
    version = str(work / "weights")
    if args.side == "lora":
        manifest = export_adapter(engine.actor.model, rt, LocalStorage(), version, config.model.lora,
                                  str(model_dir), engine.step, dtype="bf16")
    else:
        manifest = export_hf(engine.actor.model, rt, LocalStorage(), version, str(model_dir), engine.step,
                             dtype="bf16")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    trainable = sum(p.numel() for p in engine.actor.model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in engine.actor.model.parameters())
    torch.distributed.destroy_process_group()
    del engine
    server = ReferenceServer()
    if args.side == "lora":
        server.load(str(model_dir), 0)  # the base the replica serves already
        server.load(version, 1)  # the first adapter wraps a copy of the base (once per server)
    t = time.perf_counter()
    server.load(version, 2)  # a version as every later sync loads it
    load_seconds = time.perf_counter() - t
    return {"side": args.side, "version_dir": version, "peak_rss_mib": peak, "trainable": trainable,
            "parameters": total,
            "checkpoint_bytes": sum(f.stat().st_size for f in (work / "run").rglob("*") if f.is_file()),
            "version_bytes": sum(f["size"] for f in manifest["files"].values()),
            "export_seconds": manifest["export_seconds"], "load_seconds": load_seconds,
            "step_seconds": statistics.median(times[1:] or times),
            "first_step_seconds": times[0], "torch_threads": torch.get_num_threads()}


def vllm_figures(side: str, model_dir: Path, version: str, rank: int, loads: int = 3,
                 generations: int = 4, tokens: int = 32) -> dict:
    """Into a real vLLM (the CPU build, bf16, one engine started from the base as an
    inference pod's: with the catalogue's LoRA flags on the lora side): the median seconds of
    the sync agent's whole load of `version` (VLLMEngine.load: pause, reload or adapter load,
    the exact check, resume, label; each load from a directory of its own), then of a
    greedy `tokens`-token completion through the policy it serves (the whole model, or the
    base with the adapter), and on the lora side
    how many adapter files the engine read (one per load: none as requests use it)."""
    import requests

    from rft_contract import names
    from rft_serving.engines import VLLMEngine
    from tests.fixtures.vllm_server import VLLMServer

    work = Path(tempfile.mkdtemp(prefix=f"rft-bench-lora-vllm-{side}-"))
    server = VLLMServer(model_dir, work / "vllm.log", dtype="bfloat16",
                        lora_rank=rank if side == "lora" else None).start()
    try:
        engine = VLLMEngine(server.url)
        times = []
        for v in range(1, loads + 1):
            fetched = work / f"v{v}"  # each version its own directory, as the agent fetches them
            shutil.copytree(version, fetched)
            t = time.perf_counter()
            engine.load(str(fetched), v, None)
            times.append(time.perf_counter() - t)
            assert engine.fingerprint_verdict is not None and engine.fingerprint_verdict.ok, side
        generate = []
        for _ in range(generations):
            t = time.perf_counter()
            requests.post(f"{server.url}/v1/completions", json={
                "model": names.SERVED_MODEL_NAME, "prompt": "Once upon a time", "max_tokens": tokens,
                "temperature": 0, "ignore_eos": True}, timeout=300).raise_for_status()
            generate.append(time.perf_counter() - t)
        out = {"vllm_load_seconds": statistics.median(times), "vllm_generate_seconds": statistics.median(generate)}
        if side == "lora":
            rpc = requests.post(f"{server.url}/collective_rpc", json={"method": "rft_lora_fingerprint"}, timeout=300)
            out["vllm_adapter_reads"] = rpc.json()["results"][0]["loads"]
        return out
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


def model_path(name: str) -> tuple[Path, int]:
    if name == "smollm2":
        from tests.fixtures.real_model import smollm2_dir

        return smollm2_dir(), 49152
    from tests.fixtures.models import save_tiny_model, tiny_vocab

    path = Path(tempfile.mkdtemp(prefix="rft-bench-lora-model-")) / "tiny"
    save_tiny_model(path, hidden=256, layers=4, intermediate=768)
    return path, len(tiny_vocab())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--response", type=int, default=48)
    ap.add_argument("--out", default=str(ROOT / ".local" / "bench" / "lora.json"))
    ap.add_argument("--vllm", action="store_true",
                    help="also load each side's version into a real vLLM (CPU build; smollm2 only)")
    ap.add_argument("--side", choices=("full", "lora"), help=argparse.SUPPRESS)  # one side, in this process
    args = ap.parse_args()
    if args.side:
        print(json.dumps(side(args)))
        return
    results = {}
    for name in ("full", "lora"):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(ROOT / d) for d in ("contract", "trainer_image", ".")] + [os.environ.get("PYTHONPATH", "")])}
        res = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--side", name], env=env,
                             capture_output=True, text=True, timeout=3600)
        if res.returncode != 0:
            sys.exit(f"{name}: exit {res.returncode}\n{res.stderr[-3000:]}")
        results[name] = json.loads(res.stdout.strip().splitlines()[-1])
    if args.vllm:
        for name in ("full", "lora"):  # one engine at a time (each holds the model)
            results[name].update(vllm_figures(name, model_path(args.model)[0], results[name]["version_dir"],
                                              args.rank))
    full, lora = results["full"], results["lora"]
    print(f"\n{args.model}: {full['parameters'] / 1e6:.1f}M parameters, GRPO with a KL term, fp32 master weights, "
          f"1 rank on CPU ({full['torch_threads']} threads), batch {args.batch} x {args.prompt}+{args.response} "
          f"tokens, {args.steps} steps; LoRA rank {args.rank}, alpha {2 * args.rank}, all-linear")
    rows = [("peak RSS (MiB)", "peak_rss_mib", "{:.0f}"), ("trainable parameters", "trainable", "{:,}"),
            ("checkpoint (MiB)", "checkpoint_bytes", "mib"), ("weight version (MiB)", "version_bytes", "mib"),
            ("export a version (s)", "export_seconds", "{:.2f}"), ("load a version (s)", "load_seconds", "{:.3f}"),
            ("step (s, median after the first)", "step_seconds", "{:.2f}")]
    if args.vllm:
        rows[-1:-1] = [("load a version into vLLM (s)", "vllm_load_seconds", "{:.3f}"),
                       ("vLLM: 32 tokens through it (s)", "vllm_generate_seconds", "{:.3f}")]
    print(f"{'':34} {'full':>12} {'lora':>12} {'lora / full':>12}")
    for label, key, fmt in rows:
        a, b = full[key], lora[key]
        show = (lambda v: f"{v / 2**20:.2f}") if fmt == "mib" else fmt.format
        print(f"{label:34} {show(a):>12} {show(b):>12} {b / a:12.3f}")
    if args.vllm:
        print(f"adapter files the LoRA side's vLLM read: {lora['vllm_adapter_reads']} (3 loads, 4 completions: 3)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    print(f"results in {out}")


if __name__ == "__main__":
    main()
