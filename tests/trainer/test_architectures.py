"""Every causal LM of transformers is either trained or refused with its reason.

For each model_type of transformers' `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`:
- `models.TESTED` (decoder-only, builds from a tiny random config on CPU): the tiny model
  (tests/fixtures/architectures.py) is saved to SeaweedFS and built from its s3:// path.
  * Every such type: on 1 rank it is causal as built, takes one GRPO step whose policy,
    exported in fp32 and loaded back with plain `from_pretrained`, equals the trained
    weights, and one PPO step (actor + critic) with gradients in both; on 2 gloo ranks
    (sharded: `fully_shard` per block, each family's own buffer init on DTensors) the same
    PPO step gives the same actor and critic to 1e-5.
  * The core families (CORE), each tied and untied, with a reference model (KL) too: the
    GRPO step and its export also on 2 ranks, the GRPO- and PPO-trained weights and losses
    equal to 1e-5, a checkpoint saved, and the 1-rank run's checkpoint loaded into the
    2-rank engine (DCP resharding) as exactly the 1-rank weights.
  One 1-rank process, then one 2-rank run, each loop over all their cases (no process
  start per architecture): 87-129 s on 1 rank and 158-162 s on 2 ranks on a 2-core machine
  shared with other jobs (load 3-16), 4.3-5.1 minutes in all with the S3 server's start.
- `models.REFUSED`: the startup check refuses it, naming the reason. The encoder-only ones
  are built here too, to show they really attend both ways.
A model_type in neither table (a newer transformers) fails
`test_every_causal_lm_type_is_tested_or_refused`: decide which it is.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rft_trainer import models
from rft_trainer.models import REFUSED, TESTED, UnsupportedModelError, check_supported
from tests.fixtures.architectures import is_causal, tiny_config

HERE = Path(__file__).parent
CORE = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gemma", "gemma2", "gemma3_text", "phi3", "olmo2",
        "granite")


def causal_lm_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def default_config(model_type: str):
    """The architecture's default configuration, or a stand-in naming only its model_type
    (some defaults do not validate)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.for_model(model_type)
    except Exception:  # noqa: BLE001
        return SimpleNamespace(model_type=model_type)


def test_every_causal_lm_type_is_tested_or_refused():
    """Each model_type of transformers' causal-LM mapping is trained by the matrix or refused
    with a reason. One that a newer transformers brought after the tables were written
    (a fresh machine installs the newest release the range allows) is in neither: it is
    judged by its config at startup (tried with a warning, or refused), which must not
    fail any other way; the test names them so that the tables catch up."""
    types = causal_lm_types()
    both = [t for t in types if t in TESTED and t in REFUSED]
    assert not both, f"model_types in both models.TESTED and models.REFUSED: {both}"
    newer = [t for t in types if t not in TESTED and t not in REFUSED]
    for model_type in types:
        if model_type in REFUSED:
            with pytest.raises(UnsupportedModelError, match=re.escape(REFUSED[model_type])):
                check_supported(default_config(model_type))
        elif model_type in TESTED:
            check_supported(default_config(model_type), critic=True)
        else:
            try:
                check_supported(default_config(model_type), critic=True)
            except UnsupportedModelError as e:
                assert f"model_type {model_type!r}" in str(e), e
    if newer:
        import transformers

        print(f"transformers {transformers.__version__} has causal-LM model_types the tables do not list "
              f"(judged by their config): {newer}; add each to the matrix (tests/fixtures/architectures.py) "
              "or to models.REFUSED with a reason")


def test_refused_encoder_only_types_really_attend_both_ways():
    from transformers import AutoModelForCausalLM

    encoders = [t for t, why in REFUSED.items() if why == models.ENCODER_ONLY]
    assert len(encoders) > 10
    for model_type in encoders:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config(model_type))
        if model_type == "xmod":  # language adapters: pick one
            model.set_default_language(model.config.languages[0])
        assert not is_causal(model), model_type


def test_what_is_not_in_the_tables_is_judged_by_its_config(monkeypatch):
    from transformers import AutoConfig

    with pytest.raises(UnsupportedModelError, match="'t5': encoder-decoder"):
        check_supported(AutoConfig.for_model("t5"))
    with pytest.raises(UnsupportedModelError, match="'llava': multimodal .*train its text model, model_type llama"):
        check_supported(AutoConfig.for_model("llava"))
    with pytest.raises(UnsupportedModelError, match="'vit': no causal-LM class in transformers"):
        check_supported(AutoConfig.for_model("vit"))
    # A causal LM without a backbone class: GRPO is tried, PPO (a critic) refused.
    monkeypatch.delitem(REFUSED, "trocr")
    check_supported(AutoConfig.for_model("trocr"), critic=False)
    with pytest.raises(UnsupportedModelError, match=r"'trocr': no backbone class .* \(TrOCRForCausalLM\)"):
        check_supported(AutoConfig.for_model("trocr"), critic=True)


def test_a_model_type_transformers_does_not_know_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "my_custom_lm", "auto_map": {}}))
    with pytest.raises(UnsupportedModelError, match="'my_custom_lm' is not an architecture of transformers"):
        models.load_config(str(tmp_path))


# ---------------------------------------------------------------- the matrix


def plan() -> list[dict]:
    deep = [{"name": f"{t}-{'tied' if tie else 'untied'}", "model_type": t, "tie": tie, "deep": True}
            for t in CORE for tie in (True, False)]
    cheap = [{"name": t, "model_type": t, "deep": False} for t in sorted(TESTED) if t not in CORE]
    return deep + cheap


def run_worker(cases: list[dict], bucket: str, nproc: int, tmp_path: Path, env: dict) -> dict:
    plan_file = tmp_path / f"plan-{nproc}.json"
    (tmp_path / "params").mkdir(exist_ok=True)
    plan_file.write_text(json.dumps({"bucket": bucket, "params_dir": str(tmp_path / "params"), "cases": cases}))
    out = tmp_path / f"out-{nproc}.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--rdzv-backend=c10d",
           "--rdzv-endpoint=127.0.0.1:0", str(HERE / "arch_worker.py"), str(plan_file), str(out),
           *(["--create"] if nproc == 1 else [])]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stderr[-5000:]
    return torch.load(out, weights_only=False)


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def finite(metrics: dict) -> bool:
    return all(math.isfinite(v) for v in metrics.values())


@pytest.mark.timeout(900)
def test_every_tested_architecture_trains_exports_and_resumes(bucket, s3_env, tmp_path):
    cases = plan()
    assert {c["model_type"] for c in cases} == set(TESTED)
    env = {**os.environ, **s3_env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parents[1]),
           "RFT_MODEL_CACHE": str(tmp_path / "models"), "RFT_CKPT_STAGING": str(tmp_path / "staging")}
    start = time.perf_counter()
    one = run_worker(cases, bucket, 1, tmp_path, env)
    one_seconds = time.perf_counter() - start
    two = run_worker(cases, bucket, 2, tmp_path, env)
    print(f"matrix: {len(cases)} cases on 1 rank in {one_seconds:.0f}s, on 2 ranks in "
          f"{time.perf_counter() - start - one_seconds:.0f}s")
    failed = {f"{name} ({n} rank{'s' * (n > 1)})": r["error"]
              for n, results in ((1, one), (2, two)) for name, r in results.items() if r["error"]}
    assert not failed, "\n\n".join(f"{name}: {error}" for name, error in failed.items())
    for case in cases:
        name, a, b = case["name"], one[case["name"]], two[case["name"]]
        assert a["causal"], f"{name}: later tokens change earlier logits"
        assert a["export"] == {"error": None, "missing": [], "max_diff": 0.0}, (name, a["export"])
        for algo, norms in (("grpo", ("actor/grad_norm",)), ("ppo", ("actor/grad_norm", "critic/grad_norm"))):
            assert finite(a[algo]), (name, algo, a[algo])
            assert all(a[algo][k] > 0 for k in norms), (name, algo, a[algo])
        for key in ("actor/pg_loss", "critic/vf_loss"):
            assert abs(a["ppo"][key] - b["ppo"][key]) < 1e-5, (name, key)
        if not case["deep"]:
            assert max(b["vs_one_rank"].values()) < 1e-5, (name, b["vs_one_rank"])
            continue
        assert a["tied"] == b["tied"] == case["tie"], name
        for key in ("grpo_actor", "actor", "critic"):
            assert max_diff(a[key], b[key]) < 1e-5, (name, key)
        assert abs(a["grpo"]["actor/pg_loss"] - b["grpo"]["actor/pg_loss"]) < 1e-5, name
        assert b["export"] == {"error": None, "missing": [], "max_diff": 0.0}, (name, b["export"])
        assert b["resumed_step"] == 1
        assert max_diff(b["resumed"]["actor"], a["actor"]) == 0.0 and max_diff(b["resumed"]["critic"], a["critic"]) == 0.0
