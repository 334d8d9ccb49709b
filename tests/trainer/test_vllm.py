"""The sync agent against a real vLLM: PyPI's CPU build (0.32.0, e2e/vllm_env.py) serving
SmolLM2-135M-Instruct (tied embeddings), under rft_serving.supervise as an inference pod
runs it. Exports are written the trainer's way (HF safetensors + the trainer's probe,
rft_trainer.probe) from perturbed copies of SmolLM2, in fp32 so the probe's tolerance is
tight (2e-3 mean |log-prob difference|; an identical model scores within 1e-4).

With our worker extension every version reloads in place and passes its probe; an export
with a wrong-shaped tensor breaks the engine part-way (as vLLM does), and the agent brings
it back on the previous version while requests keep being served (the explorer's client
retries the ones the restart cut). Without the extension vLLM's in-place reload leaves the
tied lm_head on the old weights: tests/e2e/test_vllm.py shows the probe catching that in
an inference pod and a restart curing it.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from rft_contract.fingerprint import FINGERPRINT_FILE, Fingerprint, export_stats
from rft_contract.probe import PROBE_FILE
from rft_rollout.rollouts import InferenceClient
from rft_serving.engines import EngineBroken, SyncError, VLLMEngine
from rft_serving.sync_agent import INITIAL_LINK
from rft_trainer.probe import build_probe
from tests.conftest import wait_for
from tests.fixtures.real_model import smollm2_dir
from tests.fixtures.vllm_server import VLLMServer
from tests.trainer.test_engines import make_agent

pytestmark = pytest.mark.real_vllm
PROBE_TEXT = ("<|im_start|>user\nWhat is 17 + 25?<|im_end|>\n<|im_start|>assistant\n"
              "17 + 25 = 42. The answer is 42.")


def write_export(base: Path, out: Path, step: int, seed: int, corrupt: bool = False) -> Path:
    """A trained-looking version of `base`: every weight moved (the tied embedding most),
    saved as the trainer exports it, with the trainer's probe."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(base)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.3 if "embed" in name else 0.02
            p.add_(torch.randn(p.shape, generator=gen) * p.std() * scale)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    ids = tokenizer(PROBE_TEXT)["input_ids"]
    (out / PROBE_FILE).write_text(build_probe(model, torch.device("cpu"), ids, "fp32", step).to_json())
    # The fingerprint as export_hf writes it (the tied head is the embedding).
    stats = {name: export_stats(p.detach()) for name, p in model.named_parameters()}
    tied = {"lm_head.weight": "model.embed_tokens.weight"} if model.config.tie_word_embeddings else {}
    (out / FINGERPRINT_FILE).write_text(Fingerprint(stats, "fp32", step, tied).to_json())
    if corrupt:  # a wrong-shaped tensor: vLLM's reload fails part-way through the layers
        path = out / "model.safetensors"
        tensors = load_file(path)
        key = "model.layers.20.mlp.down_proj.weight"
        tensors[key] = torch.zeros(tensors[key].shape[1], tensors[key].shape[0] // 2)
        save_file(tensors, path, metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    base = smollm2_dir()
    root = tmp_path_factory.mktemp("exports")
    return {"base": base, **{v: write_export(base, root / f"v{v}", v, seed=v, corrupt=(v == 3))
                             for v in (1, 2, 3, 4)}}


def start(tmp_path: Path, base: Path, extension: bool) -> tuple[VLLMServer, Path]:
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / INITIAL_LINK).symlink_to(base)  # what the init container fetched
    return VLLMServer(dest / INITIAL_LINK, tmp_path / "vllm.log", extension=extension).start(), dest


def target(exports, v: int) -> dict:
    return {"version": v, "id": f"x{v}", "uri": str(exports[v])}


def test_with_our_extension_versions_reload_in_place_and_a_corrupt_one_falls_back(tmp_path, exports):
    server, dest = start(tmp_path, exports["base"], extension=True)
    try:
        engine = VLLMEngine(server.url, supervisor=server.supervisor)
        agent, api = make_agent(engine, tmp_path, target(exports, 1))
        agent.engine_start_timeout = 600
        entry = lambda: api.status["weightSync"]["replicas"]["job-inference-0"]  # noqa: E731
        for v in (1, 2):
            assert agent.converge(target(exports, v))
            assert entry()["version"] == v and entry()["probe"]["meanDiff"] < 2e-3
            assert entry()["fingerprint"] == {"params": 183}  # every parameter checked, all equal
        assert engine.extension is True and engine.restarts() == 0

        # Explorers keep sampling, attributing by the agent's record (0.32.0 reports no
        # versions), while an export that breaks the engine arrives.
        client = InferenceClient([server.url], timeout=120, version_of=lambda i: entry().get("version"))
        stop, done, errors, versions = threading.Event(), [], [], []

        def explore():
            while not stop.is_set():
                try:
                    out = client.complete({"model": "policy", "prompt": "1 + 1 =", "max_tokens": 4,
                                           "temperature": 0.0})
                    done.append(1)
                    versions.extend(out.versions or [])
                except Exception as e:  # noqa: BLE001 - a lost request fails the test below
                    errors.append(repr(e))

        threads = [threading.Thread(target=explore, daemon=True) for _ in range(2)]
        for t in threads:
            t.start()
        with pytest.raises(EngineBroken, match="version 3: the reload failed part-way"):
            agent.converge(target(exports, 3))
        # Back on version 2: restarted from its files, checked, labelled.
        assert engine.restarts() == 1 and engine.served() == 2 and agent.engine_version == 2
        assert (dest / INITIAL_LINK).resolve() == exports[2].resolve()
        assert engine.check(agent.good[2], None, "after the fall-back").ok
        assert "version 3: the reload failed part-way" in entry()["lastRestart"]
        before = len(done)
        # A few requests on the restarted engine, then stop.
        wait_for(lambda: len(done) >= before + 2 or errors, 300, "requests served after the fall-back")
        stop.set()
        for t in threads:
            t.join(180)
        assert not errors, errors  # no request lost: the ones the restart cut were retried
        assert client.failures >= 1  # ...and there were some (held during the pause)
        assert 3 not in versions and set(v for v in versions if isinstance(v, int)) <= {2}
        with pytest.raises(SyncError, match="version 3 broke the engine"):
            agent.converge(target(exports, 3))  # not again at once
        assert agent.converge(target(exports, 4)) and entry()["version"] == 4  # a newer one at once
    finally:
        server.stop()
