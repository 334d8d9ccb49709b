"""The weights fingerprint (rft_contract.fingerprint) at the settings RL runs at: a real model
(SmolLM2-135M, tied embeddings) trained at lr 1e-6 with fp32 master weights and exported in
bf16, the default. Between two such versions the probe's log-probs barely move, so a reload
that left one layer (or the tied output layer) stale passes the probe; the fingerprint
names it, and the reference server keeps serving the previous version."""

import json

import pytest
import torch

from rft_contract.fingerprint import FINGERPRINT_FILE, compare, model_stats, read_fingerprint
from rft_contract.manifest import MANIFEST
from rft_contract.probe import read_probe
from rft_serving import serve
from rft_serving.serve import ReferenceServer, RequestError

STALE = "model.layers.3.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def versions(lr1e6_exports):
    return lr1e6_exports


def load_with(monkeypatch, change):
    """Make the server's loader apply `change(weights)` after loading: a reload gone wrong."""
    real = serve.load_weights

    def load(path, version, device):
        w = real(path, version, device)
        change(w)
        return w

    monkeypatch.setattr(serve, "load_weights", load)


def test_the_export_lists_its_fingerprint_and_it_matches_what_from_pretrained_loads(versions):
    old, new = versions
    manifest = json.loads((new / MANIFEST).read_text())
    assert FINGERPRINT_FILE in manifest["files"]  # hashed and fetched like the weights
    fp = read_fingerprint(new)
    assert fp.dtype == "bf16" and fp.tied == {"lm_head.weight": "model.embed_tokens.weight"}
    w = serve.load_weights(str(new), 2, "cpu")  # fp32 on CPU: the bf16 values exactly
    assert compare(model_stats(w.model.named_parameters()), fp).ok
    # The two versions differ in bf16 at lr 1e-6, layer by layer: the check is not vacuous.
    before = read_fingerprint(old)
    assert before.params[STALE] != fp.params[STALE]
    assert not compare(model_stats(serve.load_weights(str(old), 1, "cpu").model.named_parameters()), fp).ok


@pytest.mark.parametrize("stale", [STALE, "lm_head.weight"])
def test_a_stale_tensor_is_refused_by_name_and_the_previous_version_keeps_serving(versions, monkeypatch, stale):
    old, new = versions
    server = ReferenceServer()
    server.load(str(old), 1, read_probe(old))
    previous = serve.load_weights(str(old), 1, "cpu").model.state_dict()

    def keep_old(w):
        with torch.no_grad():
            if stale == "lm_head.weight":  # the output layer kept the old embedding (untied copy)
                w.model.lm_head.weight = torch.nn.Parameter(previous["model.embed_tokens.weight"].clone())
            else:
                w.model.get_parameter(stale).copy_(previous[stale])
        held.append(w)

    held: list = []
    load_with(monkeypatch, keep_old)
    with pytest.raises(RequestError) as e:
        server.load(str(new), 2, read_probe(new))
    assert e.value.status == 409 and e.value.type == "fingerprint_mismatch"
    assert stale in e.value.message and "1 of" in e.value.message  # that tensor, and only it
    assert server.current.version == 1  # never served the unverified version
    # The probe alone passes it: at lr 1e-6 the stale tensor moves the log-probs far less
    # than the bf16 tolerance (this is why the fingerprint exists).
    assert serve._check(held[0], read_probe(new), None, 2).ok

    monkeypatch.undo()
    seconds, verdict = server.load(str(new), 2, read_probe(new))
    assert server.current.version == 2 and verdict.ok
