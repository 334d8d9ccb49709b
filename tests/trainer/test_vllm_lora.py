"""A LoRA job's versions on a real vLLM (PyPI's CPU build, 0.32.0) as an inference pod runs
it: started from the base with the catalogue's LoRA flags (the base serves as
"policy-base"), each version is a PEFT adapter the sync agent loads in place as the
adapter "policy", the one the explorers and the probe ask for. bf16 as jobs serve, and an
alpha / rank of 3, which vLLM folds into B in bf16: the exact check reproduces it.

- Version 0 is the base with an adapter of zeros: it serves exactly what the base does.
- Each version's adapter is read once, at its load, not again as requests use it.
- Each version's adapter is checked exactly in the LoRA kernels' slots (vllm_worker's
  `rft_lora_fingerprint`) and by the probe before it carries the version's label.
- An adapter vLLM refuses (rank above --max-lora-rank) leaves the previous one serving,
  labelled, and the replica entry says why; so does an adapter the exact check refuses.
- A restarted engine (from the base) gets the current adapter again. A version that fails
  its probe after the load, though the exact check passed, goes back in place to the previous
  adapter (a restart would load the same bytes); without the exact check (an engine with a
  worker extension of its own) it is tried once more on a fresh engine, then the engine
  falls back on the previous adapter.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rft_contract import names
from rft_contract.probe import PROBE_FILE
from rft_serving.engines import ProbeMismatch, SyncError, VLLMEngine
from rft_serving.sync_agent import INITIAL_LINK
from rft_trainer.probe import build_probe
from tests.fixtures.real_model import smollm2_dir
from tests.fixtures.vllm_server import VLLMServer
from tests.trainer.test_engines import make_agent
from tests.trainer.test_vllm import PROBE_TEXT

pytestmark = pytest.mark.real_vllm
RANK, ALPHA = 8, 24.0
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# What the job says (spec.model.lora) as the agent reads it from the RFTJob.
LORA = {"rank": RANK, "alpha": ALPHA, "targetModules": TARGETS}


def write_adapter(base: Path, out: Path, step: int, seed: int, rank: int = RANK) -> Path:
    """A trained-looking adapter (PEFT's saved format, every A and B moved) and its probe as
    the trainer writes it for a bf16 version."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=ALPHA * rank / RANK, target_modules=TARGETS))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.03)
    model.save_pretrained(out)
    ids = AutoTokenizer.from_pretrained(base)(PROBE_TEXT)["input_ids"]
    (out / PROBE_FILE).write_text(build_probe(model, torch.device("cpu"), ids, "bf16", step).to_json())
    return out


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    base = smollm2_dir()
    root = tmp_path_factory.mktemp("adapters")
    out = {v: write_adapter(base, root / f"v{v}", v, seed=v) for v in (1, 2, 4, 5, 6)}
    for v in (5, 6):  # probes the engine cannot match
        probe = json.loads((out[v] / PROBE_FILE).read_text())
        probe["logprobs"] = [x - 1.0 for x in probe["logprobs"]]
        (out[v] / PROBE_FILE).write_text(json.dumps(probe))
    out[3] = write_adapter(base, root / "v3", 3, seed=3, rank=4 * RANK)  # above the engine's --max-lora-rank
    return {"base": base, **out}


def target(adapters, v: int) -> dict:
    return {"version": v, "id": f"x{v}", "uri": str(adapters[v])}  # fetched to <dest>/v0000000<v>-x<v>


def score(engine: VLLMEngine, model: str, token_ids: list[int]) -> list[float]:
    out = engine._post("/v1/completions", {"model": model, "prompt": token_ids, "max_tokens": 0, "echo": True,
                                           "logprobs": 0, "temperature": 0})
    return out["choices"][0]["logprobs"]["token_logprobs"][1:]


def adapter_loads(engine: VLLMEngine) -> int:
    """How many adapter files the engine's worker has read."""
    return engine._post("/collective_rpc", {"method": "rft_lora_fingerprint"})["results"][0]["loads"]


def test_adapter_versions_load_in_place_verified_and_a_refused_one_keeps_the_previous(
        tmp_path, adapters, monkeypatch):
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / INITIAL_LINK).symlink_to(adapters["base"])  # what the init container fetched: the base
    server = VLLMServer(dest / INITIAL_LINK, tmp_path / "vllm.log", dtype="bfloat16", lora_rank=RANK).start()
    try:
        engine = VLLMEngine(server.url, supervisor=server.supervisor)
        agent, api = make_agent(engine, tmp_path, {"version": 0, "id": None, "uri": str(adapters["base"])})
        agent.model_path, agent.lora = str(adapters["base"]), LORA
        agent.engine_start_timeout = 600
        entry = lambda: api.status["weightSync"]["replicas"]["job-inference-0"]  # noqa: E731
        ids = list(range(1000, 1040))

        # Version 0: the base with zeros, as the policy: exactly the base's log-probs.
        assert agent.converge({"version": 0, "id": None, "uri": str(adapters["base"])})
        assert entry()["version"] == 0 and entry()["fingerprint"]["params"] >= 2 * len(TARGETS) * 30
        base = score(engine, names.BASE_MODEL_NAME, ids)
        assert score(engine, names.SERVED_MODEL_NAME, ids) == base

        for v in (1, 2):
            assert agent.converge(target(adapters, v))
            assert entry()["version"] == v and entry()["error"] is None, entry()
            assert entry()["fingerprint"]["params"] >= 2 * len(TARGETS) * 30  # every slice checked
            assert entry()["probe"]["meanDiff"] < 0.05
            served = score(engine, names.SERVED_MODEL_NAME, ids)
            assert max(abs(a - b) for a, b in zip(served, base)) > 1e-2  # the adapter is applied
        assert (dest / INITIAL_LINK).resolve() == Path(adapters["base"]).resolve()  # restarts start from the base

        # Each version's adapter was read once, at its load: generating through it reads no
        # file (vLLM 0.32.0 alone read it again before every forward step after an in-place
        # load: vllm_worker.keep_loaded_adapters).
        assert adapter_loads(engine) == 3  # version 0's zeros, versions 1 and 2
        engine._post("/v1/completions", {"model": names.SERVED_MODEL_NAME, "prompt": ids, "max_tokens": 16,
                                         "temperature": 0, "ignore_eos": True})
        assert adapter_loads(engine) == 3

        # vLLM refuses an adapter above --max-lora-rank: version 2 keeps serving, labelled.
        with pytest.raises(ProbeMismatch, match="version 3: the engine refused the adapter") as refused:
            agent.converge(target(adapters, 3))
        agent.report_error(str(refused.value))  # what the agent's loop does with it
        assert entry()["version"] == 2 and "serving version 2 again" in entry()["error"], entry()
        assert engine.served() == 2 and engine.restarts() == 0
        assert score(engine, names.SERVED_MODEL_NAME, ids) == served

        # An adapter the exact check refuses (here: one B in the slots made to differ from
        # the file's, as a stale or partial load would): rolled back in place, no restart.
        post = engine._post

        def stale_v4(path, body=None, params=None):
            out = post(path, body, params)
            if (body or {}).get("method") == "rft_lora_fingerprint" \
                    and Path(body["kwargs"]["path"]).name in ("v4", "v00000004-x4"):  # the export or its copy
                layers = next(iter(out["results"][0]["adapters"].values()))
                layer = next(m for m in layers.values() if m["b"][0][1] > 0)  # an adapted layer
                layer["b"][0] = [layer["b"][0][0] * 1.001, layer["b"][0][1]]
            return out

        monkeypatch.setattr(engine, "_post", stale_v4)
        with pytest.raises(ProbeMismatch, match="version 4: the engine does not hold the exported adapter"):
            agent.converge(target(adapters, 4))
        assert agent.engine_version == 2 and engine.served() == 2 and engine.restarts() == 0
        monkeypatch.setattr(engine, "_post", post)

        # A restarted engine starts from the base and gets version 2's adapter again.
        engine.restart("test")
        assert engine.served() is None
        assert agent.converge(target(adapters, 2))
        assert entry()["version"] == 2 and score(engine, names.SERVED_MODEL_NAME, ids) == served

        # A version that fails its probe although the exact check found it in the slots as
        # exported: a restart would load the same bytes onto the same base, so version 2's
        # adapter goes back in place, checked; nothing restarts.
        with pytest.raises(ProbeMismatch, match=r"version 5 after a reload: the engine does not serve the "
                                                r"trained weights: .*; serving version 2 again") as refused:
            agent.converge(target(adapters, 5))
        agent.report_error(str(refused.value))
        assert entry()["version"] == 2 and "serving version 2 again" in entry()["error"], entry()
        assert agent.broken[0] == (5, "x5")  # not tried again for a while
        assert engine.restarts() == 1 and engine.served() == 2 and agent.engine_version == 2
        assert score(engine, names.SERVED_MODEL_NAME, ids) == served

        # Without the exact check (an engine started with a worker extension of its own), a
        # version that fails its probe: the engine restarts from the base and takes the
        # adapter again (adopt), fails again, and falls back on version 2's adapter.
        monkeypatch.setattr(engine, "extension", False)
        with pytest.raises(SyncError, match="version 6 after a fresh start from disk: the engine does not serve"):
            agent.converge(target(adapters, 6))
        assert engine.restarts() == 3 and engine.served() == 2 and agent.engine_version == 2
        assert (dest / INITIAL_LINK).resolve() == Path(adapters["base"]).resolve()
        assert score(engine, names.SERVED_MODEL_NAME, ids) == served
    finally:
        server.stop()
