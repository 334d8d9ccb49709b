"""The exact weights check against a real vLLM (PyPI's CPU build 0.32.0, bf16, our worker
extension), with versions one GRPO step apart at lr 1e-6 (the `lr1e6_exports` fixture: the
trainer's own bf16 export of SmolLM2-135M, tied embeddings). On the CPU build the linear
layers' weights exist only as the kernels' packed copies: the worker reads them back
through the kernels (vllm_worker.fingerprint). The probe cannot tell these versions apart;
the fingerprint names the stale tensor:

- vLLM's plain in-place `reload_weights` leaves the tied `lm_head`'s packed copy on the old
  embedding (the bug the worker extension works around): named `lm_head.weight`;
- a reload whose files lacked one layer's tensor (a partial reload: vLLM warns and keeps the
  old values): named by that layer.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rft_contract.fingerprint import read_fingerprint
from rft_contract.probe import compare, read_probe
from rft_serving.engines import Previous, ProbeMismatch, VLLMEngine
from tests.fixtures.vllm_server import VLLMServer

pytestmark = pytest.mark.real_vllm
STALE = "model.layers.3.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def engine(lr1e6_exports, tmp_path_factory):
    old, _ = lr1e6_exports
    server = VLLMServer(old, tmp_path_factory.mktemp("vllm") / "vllm.log", extension=True, dtype="bfloat16").start()
    try:
        yield VLLMEngine(server.url, supervisor=server.supervisor)
    finally:
        server.stop()


def without(src: Path, dest: Path, name: str) -> Path:
    """A copy of the export `src` whose weights lack tensor `name` (one file, no index)."""
    from safetensors.torch import load_file, save_file

    dest.mkdir()
    tensors = {}
    for shard in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(shard))
    del tensors[name]
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    for f in src.iterdir():
        if f.suffix == ".json" and f.name != "model.safetensors.index.json":
            shutil.copy(f, dest / f.name)
    return dest


def test_a_correct_reload_passes_with_every_exported_tensor_placed(engine, lr1e6_exports):
    old, new = lr1e6_exports
    verdict = engine.load(str(new), 2, read_probe(new))
    assert verdict.ok and engine.served() == 2
    check = engine.fingerprint_verdict
    assert check.ok and not check.missing, check.describe()
    assert check.params == 30 * 6 + 3  # 30 layers x (qkv, o, gate_up, down, 2 norms); embedding, norm, lm_head
    engine.load(str(old), 1, read_probe(old))  # back where the next test expects it
    assert engine.fingerprint_verdict.ok


def test_vllms_plain_reload_leaves_the_tied_head_stale_and_the_fingerprint_names_it(engine, lr1e6_exports):
    _, new = lr1e6_exports
    engine._post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(new)}})
    # The probe passes it: at lr 1e-6 the stale head is inside the bf16 tolerance.
    probe = read_probe(new)
    assert compare(engine.score(probe.token_ids), probe).ok
    with pytest.raises(ProbeMismatch) as e:
        engine.check_fingerprint(str(new), 2)
    assert "1 of" in str(e.value) and "lm_head.weight" in str(e.value)
    # Our extension's reload (what the agent does) refreshes it: the check passes.
    engine._reload(str(new))
    assert engine.check_fingerprint(str(new), 2).ok


def test_a_partial_reload_leaves_a_layer_stale_and_the_fingerprint_names_it(engine, lr1e6_exports, tmp_path):
    old, new = lr1e6_exports
    engine._reload(str(old))
    assert engine.check_fingerprint(str(old), 1).ok
    partial = without(new, tmp_path / "partial", STALE)
    engine._reload(str(partial))  # vLLM warns "weights were not loaded" and keeps the old ones
    with pytest.raises(ProbeMismatch) as e:
        engine.check_fingerprint(str(new), 2)
    assert STALE in str(e.value) and "1 of" in str(e.value)
    assert json.loads((new / "fingerprint.json").read_text())["params"][STALE] != \
        read_fingerprint(old).params[STALE]  # the versions do differ there
    engine._reload(str(new))
    assert engine.check_fingerprint(str(new), 2).ok


class PlainReload(VLLMEngine):
    """An engine whose in-place reload is vLLM's plain `reload_weights` (the stale tied head)
    while our extension still reports what the worker holds."""

    EXTENSION_METHOD = "reload_weights"


@pytest.mark.parametrize("case", ["stale tied head", "stale layer"])
def test_a_reload_the_fingerprint_refuses_goes_back_to_the_previous_version_before_serving(
        engine, lr1e6_exports, tmp_path, case):
    """What the agent asks for (`previous`): refused while paused, the last good version is
    reloaded in place, checked the same way and served again; no restart, and no request
    ever answered by the refused weights."""
    old, new = lr1e6_exports
    engine.load(str(old), 1, read_probe(old))
    previous = Previous(str(old), 1, read_probe(old))
    if case == "stale tied head":
        loader, files, stale = PlainReload(engine.url), new, "lm_head.weight"
        loader.extension = True
    else:
        loader, files, stale = engine, without(new, tmp_path / "partial", STALE), STALE
    with pytest.raises(ProbeMismatch) as e:
        loader.load(str(files), 2, read_probe(new), previous=previous)
    assert e.value.serving == 1 and stale in str(e.value) and "serving version 1 again" in str(e.value)
    assert engine.served() == 1 and loader.fingerprint_verdict.ok  # the old version, checked
    assert engine.check_fingerprint(str(old), 1).ok
    probe = read_probe(old)
    assert compare(engine.score(probe.token_ids), probe).ok  # answering again (not paused)
