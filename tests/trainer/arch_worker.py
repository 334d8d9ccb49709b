"""Run under torchrun by tests/trainer/test_architectures.py: every case of a plan in one
process per rank (no process start per architecture).

    arch_worker.py PLAN OUT [--create]

PLAN (JSON): {"bucket": B, "params_dir": D, "cases": [{"name", "model_type", "tie", "deep"}, ...]}.
Per case:
- `--create` (the 1-rank run, first): rank 0 saves the tiny random model (tests/fixtures/
  architectures.py) and uploads it to s3://B/models/NAME/; every build reads it from there.
- GRPO (deep cases; every case on 1 rank): one step, the policy exported in fp32, and on
  rank 0 the export loaded with `from_pretrained` and compared with the trained parameters;
  on 1 rank also whether the model as built is causal.
- PPO (every case): one step (actor + critic). Deep cases (with a reference model, as GRPO)
  keep the trained actor and critic for the test to compare across world sizes, save a
  checkpoint to s3://B/ckpt/NAME-wW, and on 2 ranks load the 1-rank run's checkpoint into
  the same engine (DCP reshards an unsharded save onto 2 ranks) and keep it as "resumed".
  The others (no reference model) leave their 1-rank weights in D/NAME.pt, which the 2-rank
  run compares with its own ("vs_one_rank": the largest difference per role) and removes.
Rank 0 writes OUT (torch.save): {name: {"error": str | None, "seconds", "tied", "causal",
"grpo": metrics, "export": {...}, "ppo": metrics, ...}}. An exception in a case is recorded
and the next case runs (errors are deterministic, so every rank skips alike).
"""

import gc
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from rft_contract.config import load_config
from rft_contract.layout import weights_uri
from rft_contract.s3 import S3Storage
from rft_contract.storage import get_storage
from rft_trainer.checkpoint import CheckpointManager, build_checkpointer
from rft_trainer.engine import FSDPTrainEngine
from rft_trainer.parallelize import init_distributed, tied_parameters
from tests.fixtures.architectures import VOCAB, is_causal, save_tiny
from tests.fixtures.batches import synthetic_batch

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def job(algo: str, model: str, ckpt: str, kl_coef: float):
    return load_config({
        "model": {"path": model},
        "algorithm": {"name": algo, "learning_rate": 1e-3, "critic_learning_rate": 1e-3, "kl_coef": kl_coef,
                      "micro_batch_size": 2, "mini_batch_size": 8},
        "trainer": {"total_steps": 10, "batch_size": 8, "fsdp": {"mixed_precision": "fp32"}},
        "checkpoint": {"uri": ckpt},
    }, env={})


def full(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in get_model_state_dict(model, options=FULL).items()}


def upload(case: dict, uri: str) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = save_tiny(case["model_type"], d, tie=case.get("tie"))
        for f in sorted(path.iterdir()):
            S3Storage().upload_file(f, f"{uri}/{f.name}")


def export_round_trip(engine: FSDPTrainEngine, rt, trained: dict) -> dict | None:
    """Export (collective); rank 0 loads it with plain `from_pretrained` and compares."""
    from transformers import AutoModelForCausalLM

    dest = weights_uri(engine.config.checkpoint.uri, engine.train_step_num)
    engine.export_policy(S3Storage(), dest, "fp32")
    if not rt.is_main:
        return None
    try:  # rank 0 alone: an error here must not skip a collective the other ranks enter
        with tempfile.TemporaryDirectory() as d:
            local = S3Storage().download_prefix(dest, d)
            loaded = AutoModelForCausalLM.from_pretrained(str(local), dtype=torch.float32).state_dict()
    except Exception as e:  # noqa: BLE001 - recorded for the test
        return {"error": f"{type(e).__name__}: {e}"}
    return {"error": None, "missing": sorted(set(trained) - set(loaded)),
            "max_diff": max((loaded[k] - v).abs().max().item() for k, v in trained.items() if k in loaded)}


def run_case(case: dict, plan: dict, rt, create: bool) -> dict:
    name, deep, bucket, out = case["name"], case["deep"], plan["bucket"], {}
    model = f"s3://{bucket}/models/{name}"
    if create and rt.is_main:
        upload(case, model)
    batch = synthetic_batch(8, 4, 6, vocab=VOCAB, group_size=4, seed=1)
    kl_coef = 0.01 if deep else 0.0  # a reference model is one more build of the same class
    if deep or rt.world_size == 1:
        engine = FSDPTrainEngine(job("grpo", model, f"s3://{bucket}/grpo/{name}-w{rt.world_size}", kl_coef), rt)
        engine.prepare()
        out["tied"] = bool(tied_parameters(engine.actor.model))
        if rt.world_size == 1:  # the model as built here, unsharded
            out["causal"] = is_causal(engine.actor.model)
        _, out["grpo"] = engine.train_step(batch)
        trained = full(engine.actor.model)
        out["export"] = export_round_trip(engine, rt, trained)
        if deep:
            out["grpo_actor"] = trained
        del engine, trained
    config = job("ppo", model, f"s3://{bucket}/ckpt/{name}-w{rt.world_size}", kl_coef)
    engine = FSDPTrainEngine(config, rt)
    engine.prepare()
    _, out["ppo"] = engine.train_step(batch)
    trained = {"actor": full(engine.actor.model), "critic": full(engine.critic.model)}
    if deep:
        out.update(trained)
        storage = get_storage(config.checkpoint.uri)
        build_checkpointer(config, storage, rt, engine.checkpoint_roles()).save(engine.train_step_num, {})
        if rt.world_size > 1:
            one = CheckpointManager(storage, f"s3://{bucket}/ckpt/{name}-w1", rt,
                                    roles={"actor": engine.actor, "critic": engine.critic})
            out["resumed_step"] = one.resume()
            out["resumed"] = {"actor": full(engine.actor.model), "critic": full(engine.critic.model)}
    elif rt.is_main:  # the PPO-trained weights of the 1-rank run, compared here on 2 ranks
        kept = Path(plan["params_dir"]) / f"{name}.pt"
        if rt.world_size == 1:
            torch.save(trained, kept)
        else:
            one = torch.load(kept, weights_only=True)
            kept.unlink()
            out["vs_one_rank"] = {role: max_diff(one[role], trained[role]) for role in trained}
    return out


def max_diff(a: dict, b: dict) -> float:
    if a.keys() != b.keys():
        return float("inf")
    return max((a[k] - b[k]).abs().max().item() for k in a)


def main(plan_path: str, out_path: str, *flags: str) -> None:
    plan = json.loads(open(plan_path).read())
    rt = init_distributed()
    results = {}
    for case in plan["cases"]:
        start = time.perf_counter()
        try:
            result = run_case(case, plan, rt, "--create" in flags)
            result["error"] = None
        except Exception as e:  # noqa: BLE001 - recorded; the test names the case
            result = {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"}
        result["seconds"] = time.perf_counter() - start
        results[case["name"]] = result
        t = time.perf_counter()
        gc.collect()  # the engines' reference cycles; then spare the next pass what survived
        gc.freeze()
        result["gc"] = time.perf_counter() - t
        if rt.is_main:
            print(f"arch {case['name']}: {'ok' if result['error'] is None else 'FAILED'} "
                  f"in {result['seconds']:.2f}s gc {result['gc']:.2f}s", file=sys.stderr, flush=True)
    if rt.is_main:
        torch.save(results, out_path)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from rft_trainer.__main__ import exit_process

    main(*sys.argv[1:])
    exit_process(0)  # see exit_process: teardown may abort after the work is done
