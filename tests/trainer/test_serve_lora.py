"""The reference server serving LoRA adapters as the trainer exports them (export_adapter,
PEFT's format) over real HTTP: each adapter loads onto the one base it serves, is checked
against the export's fingerprint and probe, and serves what PEFT itself computes with it;
a request on the version before keeps its weights; an adapter no snapshot holds is
deleted; a wrong adapter is refused and the previous one keeps serving."""

from __future__ import annotations

import gc
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from rft_contract.probe import PROBE_FILE
from rft_contract.storage import LocalStorage
from rft_serving import serve
from rft_trainer import probe as trainer_probe
from rft_trainer.export import export_adapter
from tests.fixtures.batches import synthetic_batch
from tests.trainer.conftest import one_process_group
from tests.trainer.test_lora import prepared
from tests.trainer.test_serve import call

TOKENS = [3, 7, 1, 9, 4, 12, 5, 2, 8, 6]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The tiny base and two adapter versions of a LoRA job (bf16, as jobs sync them)."""
    from tests.fixtures.models import save_tiny_model

    root = tmp_path_factory.mktemp("lora-serve")
    base = save_tiny_model(root / "base")
    batch = synthetic_batch(8, prompt_len=4, response_len=6, vocab=24, group_size=4, seed=1)
    out = {}
    with one_process_group() as rt:
        engine = prepared(base, rt, inference={"engine": "reference"})
        for version in (1, 2):
            engine.train_step(batch)
            check = trainer_probe.build_probe(engine.actor.model, torch.device("cpu"), TOKENS, "bf16", version)
            export_adapter(engine.actor.model, rt, LocalStorage(), str(root / f"v{version}"),
                           engine.config.model.lora, str(base), version, dtype="bf16",
                           extra_files={PROBE_FILE: check.to_json().encode()})
            out[version] = str(root / f"v{version}")
    return str(base), out


def peft_logprobs(base: str, adapter: str | None) -> list[float]:
    """What PEFT itself computes: the base with `adapter` loaded (or none), fp32."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model = (PeftModel.from_pretrained(model, adapter) if adapter else model).eval()
    ids = torch.tensor([TOKENS])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0].tolist()


def load(server, path, version, **extra):
    body = {"path": path, "version": version, **extra}
    probe_file = f"{path}/{PROBE_FILE}"
    try:
        body["probe"] = {k: v for k, v in json.load(open(probe_file)).items() if k != "format"}
    except FileNotFoundError:
        pass
    return call(server.url, "/weights/load", body)


def scored(server) -> list[float]:
    status, _, out = call(server.url, "/weights/score", {"token_ids": TOKENS})
    assert status == 200, out
    return out["logprobs"]


def close(a: list[float], b: list[float], tol: float = 1e-5) -> bool:
    return max(abs(x - y) for x, y in zip(a, b)) < tol


def test_each_adapter_serves_what_peft_computes_with_it_on_the_one_base(server, exported):
    base, adapters = exported
    assert load(server, base, 0)[0] == 200
    before = server.current  # a request in flight on the base holds this snapshot
    status, _, out = load(server, adapters[1], 1)
    assert status == 200, out
    assert out["fingerprint"] == {"params": 28}  # the adapter's tensors, exactly: 2 layers x 7 x (A, B)
    assert out["probe"]["meanDiff"] < 1e-2, out["probe"]
    assert call(server.url, "/weights")[2]["adapter"] is True
    v1 = peft_logprobs(base, adapters[1])
    assert close(scored(server), v1)
    unadapted = peft_logprobs(base, None)
    assert not close(v1, unadapted, 1e-3)  # the adapter is served, not the base
    # The base's snapshots still compute the base: the one a request held, and the one
    # the PeftModel serves as `__base__`.
    assert close(serve.score_tokens(before, TOKENS), unadapted)
    assert close(serve.score_tokens(server.base, TOKENS), unadapted)
    held = server.current  # a request in flight on version 1
    assert load(server, adapters[2], 2)[0] == 200
    assert close(scored(server), peft_logprobs(base, adapters[2]))
    assert close(serve.score_tokens(held, TOKENS), v1)  # side by side with version 2
    # Version 1's adapter goes once nothing holds it (deleted at the next load); one base.
    del held, before
    gc.collect()
    assert load(server, adapters[1], 1)[0] == 200
    assert len(server._peft.peft_config) <= 2, list(server._peft.peft_config)
    assert close(scored(server), v1)


def test_an_adapter_that_is_not_the_export_is_refused_and_the_previous_keeps_serving(server, exported, tmp_path):
    import shutil

    base, adapters = exported
    assert load(server, base, 0)[0] == 200
    assert load(server, adapters[1], 1)[0] == 200
    bad = tmp_path / "v2-bad"
    shutil.copytree(adapters[2], bad)
    tensors = load_file(str(bad / "adapter_model.safetensors"))
    name = sorted(k for k in tensors if ".lora_B." in k)[0]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] += 2 ** -6  # one value, a few bf16 steps: the probe may not see it
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    status, _, out = load(server, str(bad), 2)
    assert status == 409 and "fingerprint" in out and name in json.dumps(out["fingerprint"]), out
    assert server.current.version == 1
    assert close(scored(server), peft_logprobs(base, adapters[1]))


def test_an_adapter_needs_a_base_and_loads_the_one_named(server, exported):
    base, adapters = exported
    status, _, out = load(server, adapters[1], 1)
    assert status == 409 and out["error"]["param"] == "base", out
    assert server.current is None
    status, _, out = load(server, adapters[1], 1, base=base)  # an engine that restarted empty
    assert status == 200, out
    assert close(scored(server), peft_logprobs(base, adapters[1]))


def test_the_sync_agent_loads_each_adapter_onto_the_base_even_after_both_restarted(server, exported, tmp_path):
    """The agent with the real server: version 0 (the base), then adapters, each checked;
    a server and an agent that restarted empty load the base (spec.model.path) again
    before the adapter."""
    from rft_serving.engines import ReferenceEngine
    from tests.trainer.test_engines import make_agent

    base, adapters = exported
    engine = ReferenceEngine(server.url)
    agent, api = make_agent(engine, tmp_path, {"version": 0, "uri": base})
    assert agent.converge({"version": 0, "uri": base}) and engine.served() == 0
    for version in (1, 2):
        manifest = json.loads(open(f"{adapters[version]}/manifest.json").read())
        target = {"version": version, "id": manifest["id"], "uri": adapters[version]}
        assert agent.converge(target) and engine.served() == version
        assert api.patches[-1]["fingerprint"] == {"params": 28}, api.patches[-1]
        assert close(scored(server), peft_logprobs(base, adapters[version]))
    # Both restart: the server serves nothing, the agent knows only the job.
    server.current = server.base = server._peft = None
    agent, api = make_agent(ReferenceEngine(server.url), tmp_path / "again", target)
    agent._update({"spec": {"model": {"path": base}}, "status": api.status})
    assert agent.converge(target) and engine.served() == 2
    assert server.base.path == base and close(scored(server), peft_logprobs(base, adapters[2]))


def test_an_adapter_the_server_refuses_leaves_the_previous_serving_and_the_entry_says_why(server, exported, tmp_path):
    import shutil

    from rft_serving.engines import ProbeMismatch, ReferenceEngine
    from tests.trainer.test_engines import make_agent

    base, adapters = exported
    engine = ReferenceEngine(server.url)
    agent, api = make_agent(engine, tmp_path, {"version": 0, "uri": base})
    assert agent.converge({"version": 0, "uri": base})
    good = {"version": 1, "id": json.load(open(f"{adapters[1]}/manifest.json"))["id"], "uri": adapters[1]}
    assert agent.converge(good)
    bad = tmp_path / "v2-bad"
    shutil.copytree(adapters[2], bad)
    fingerprint = json.loads((bad / "fingerprint.json").read_text())
    name = sorted(k for k in fingerprint["params"] if ".lora_A." in k)[0]
    fingerprint["params"][name][0] += 1.0  # the export says otherwise than the file: not the export
    (bad / "fingerprint.json").write_text(json.dumps(fingerprint))
    manifest = json.loads((bad / "manifest.json").read_text())
    manifest["files"].pop("fingerprint.json")  # (so the manifest still verifies the rest)
    (bad / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ProbeMismatch, match=name.split(".lora_A")[0]) as refused:
        agent.converge({"version": 2, "id": manifest["id"], "uri": str(bad)})
    assert engine.served() == 1 and close(scored(server), peft_logprobs(base, adapters[1]))
    agent.report_error(str(refused.value))  # what run() does with a failed attempt
    entry = api.status["weightSync"]["replicas"]["job-inference-0"]
    assert entry["version"] == 1 and name in entry["error"], entry
    assert agent.broken is not None  # and the export is held off, not tried again at once


def test_a_job_that_starts_from_an_adapter_serves_version_0_as_the_base_with_it(server, exported, tmp_path):
    """spec.model.lora.adapterPath: version 0 is the policy the trainer starts from, the
    base with that adapter, not the bare base; later versions load onto the same base."""
    from rft_serving.engines import ReferenceEngine
    from tests.trainer.test_engines import make_agent

    base, adapters = exported
    engine = ReferenceEngine(server.url)
    version0 = {"version": 0, "uri": base}
    agent, api = make_agent(engine, tmp_path, version0)
    agent._update({"spec": {"model": {"path": base, "lora": {"rank": 4, "adapterPath": adapters[1]}}},
                   "status": api.status})
    assert agent.converge(version0) and engine.served() == 0
    assert close(scored(server), peft_logprobs(base, adapters[1]))
    assert not agent.converge(version0)  # in sync
    v2 = {"version": 2, "id": json.load(open(f"{adapters[2]}/manifest.json"))["id"], "uri": adapters[2]}
    assert agent.converge(v2) and engine.served() == 2
    assert close(scored(server), peft_logprobs(base, adapters[2])) and server.base.path == base


def test_concurrent_requests_on_the_base_and_two_adapters_each_get_their_own_while_adapters_load(server, exported):
    """The model holding the adapters serves one per forward: requests on the base, v1
    and v2 in threads, sampling and scoring, while versions keep loading (and old
    adapters are deleted), each get exactly their own snapshot's log-probs."""
    import threading

    base, adapters = exported
    assert load(server, base, 0)[0] == 200
    snapshots = {"base": server.current}
    assert load(server, adapters[1], 1)[0] == 200
    snapshots["v1"] = server.current
    assert load(server, adapters[2], 2)[0] == 200
    snapshots["v2"] = server.current
    want = {"base": peft_logprobs(base, None), "v1": peft_logprobs(base, adapters[1]),
            "v2": peft_logprobs(base, adapters[2])}
    bad, errors, stop = [], [], threading.Event()

    def score(name):
        while not stop.is_set():
            try:
                if not close(serve.score_tokens(snapshots[name], TOKENS), want[name]):
                    bad.append(name)
            except Exception as e:  # noqa: BLE001 - counted, asserted below
                errors.append(f"{name}: {type(e).__name__}: {e}"[:200])

    def sample():
        s = serve.Sampling(max_tokens=6, n=3, temperature=1.0, seed=1)
        while not stop.is_set():
            try:
                serve.generate(snapshots["v1"], ["1+2="], s)
            except Exception as e:  # noqa: BLE001
                errors.append(f"sample: {type(e).__name__}: {e}"[:200])

    threads = [threading.Thread(target=score, args=(n,)) for n in want] + [threading.Thread(target=sample)]
    for t in threads:
        t.start()
    try:
        for version in range(3, 13):  # loads (and deletions of unheld adapters) meanwhile
            assert load(server, adapters[1 + version % 2], version)[0] == 200
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors and not bad, (errors[:3], len(bad))
    assert len(server._peft.peft_config) <= 4, list(server._peft.peft_config)  # v1, v2, the newest (+ one)
