"""The inference-engine axis: the contract's catalogue (rft_contract.engines) is the one place
an engine's facts live. The spec, the CRD, the inference pod and the sync agent's adapters
follow it, and a new engine is one catalogue line plus its adapter."""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import yaml

from rft_contract import names
from rft_contract.engines import ENGINE_ENV, ENGINES, adapter_policy, lora_rank
from rft_contract.spec import InferenceSpec, parse_spec
from rft_operator.rollout_pods import build_inference_pod
from rft_serving import engines as adapters
from tests.fixtures import catalogues
from tests.unit.testing import REF, SPEC

ROOT = Path(__file__).resolve().parents[2]


def inference_schema(crd: dict) -> dict:
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return spec["properties"]["inference"]


def test_the_spec_the_crd_and_the_sync_agent_follow_the_catalogue():
    names = list(ENGINES)
    assert list(InferenceSpec.model_fields["engine"].annotation.__args__) == names
    crd = inference_schema(yaml.safe_load((ROOT / "crds" / "rftjob.yaml").read_text()))
    assert crd["properties"]["engine"]["enum"] == names
    assert list(adapters.ENGINES) == names
    assert {n: a.restartable for n, a in adapters.ENGINES.items()} == {n: p.restartable for n, p in ENGINES.items()}
    assert {n: a.lora_adapters for n, a in adapters.ENGINES.items()} == {
        n: p.lora_adapters for n, p in ENGINES.items()}
    assert {n: a.adapter_policy for n, a in adapters.ENGINES.items()} == {
        n: adapter_policy(p, True) for n, p in ENGINES.items()}
    assert ENGINE_ENV[0] == "PYTHONPATH" and all(k in ENGINE_ENV for p in ENGINES.values()
                                                 for k, _ in (*p.env, *p.lora_env))


def test_a_lora_job_s_vllm_serves_the_base_apart_and_loads_adapters_at_run_time():
    spec = parse_spec({**SPEC, "model": {**SPEC["model"], "lora": {"rank": 12}},
                       "inference": {"engine": "vllm", "image": "vllm:1"}})
    engine = build_inference_pod(REF, spec, 0)["spec"]["containers"][0]
    command = engine["command"] + engine["args"]
    assert command[command.index("--served-model-name") + 1] == names.BASE_MODEL_NAME
    # vLLM's --max-lora-rank takes its MaxLoRARanks only: 12 rounds up to 16.
    assert command[-5:] == ["--enable-lora", "--max-lora-rank", "16", "--max-loras", "1"]
    assert {"name": "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "value": "1"} in engine["env"]
    plain = build_inference_pod(REF, parse_spec({**SPEC, "inference": {"engine": "vllm", "image": "vllm:1"}}), 0)
    command = plain["spec"]["containers"][0]["command"] + plain["spec"]["containers"][0]["args"]
    assert "--enable-lora" not in command and command[command.index("--served-model-name") + 1] == "policy"
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in json.dumps(plain)
    # The reference server loads adapters itself: its command is the same.
    ref = parse_spec({**SPEC, "model": {**SPEC["model"], "lora": {"rank": 12}}, "inference": {"engine": "reference"}})
    command = build_inference_pod(REF, ref, 0)["spec"]["containers"][0]["args"]
    assert "--enable-lora" not in command and "policy" in command
    assert [lora_rank(ENGINES["vllm"], r) for r in (1, 2, 8, 9, 300, 512)] == [1, 8, 8, 16, 320, 512]


def test_no_module_outside_the_catalogue_branches_on_an_engine_s_name():
    quoted = "|".join(re.escape(n) for n in ENGINES)
    branch = re.compile(rf"""(==|!=|\bin\b)\s*\(?\s*["']({quoted})["']|["']({quoted})["']\s*(==|!=|:\s*\[)""")
    found = [f"{path.relative_to(ROOT)}:{i}: {line.strip()}"
             for d in ("operator", "contract", "trainer_image") for path in sorted((ROOT / d).rglob("*.py"))
             if path.name != "engines.py"
             for i, line in enumerate(path.read_text().splitlines(), 1) if branch.search(line)]
    assert not found, "decide by the profile (rft_contract.engines), not by name:\n" + "\n".join(found)


NEW_ENGINE = '''
    EngineProfile("toy", ("toy-server", "--weights", "{initial}", *SERVER_FLAGS), readiness_path="/alive",
                  supervised=True, restartable=True, env=(("TOY_ROUTES", "1"),)),
'''

RENDER = textwrap.dedent('''
    import json
    from rft_contract.spec import parse_spec
    from rft_operator import rollout_pods
    from tests.unit.testing import REF, SPEC
    spec = parse_spec({**SPEC, "inference": {"engine": "toy", "image": "toy:1", "args": ["--fast"]}})
    pod = rollout_pods.build_inference_pod(REF, spec, 0)
    print(json.dumps(pod))
    try:
        parse_spec({**SPEC, "inference": {"engine": "toy", "image": "toy:1", "env": [{"name": "TOY_ROUTES", "value": "0"}]}})
    except ValueError as e:
        print(json.dumps({"refused": str(e)}))
''')


def test_a_new_engine_is_one_catalogue_line(tmp_path):
    out = catalogues.run(catalogues.with_entry(tmp_path, "engines", NEW_ENGINE), "-c", RENDER)
    pod, refused = (json.loads(line) for line in out.splitlines())
    engine = pod["spec"]["containers"][0]
    assert engine["image"] == "toy:1" and engine["readinessProbe"]["httpGet"]["path"] == "/alive"
    command = engine["command"] + engine["args"]
    assert command[:3] == ["python3", "-m", "rft_serving.supervise"]  # supervised: the agent can restart it
    assert command[command.index("--") + 1:] == ["toy-server", "--weights", "/var/lib/rft/weights/initial", "--host",
                                                 "0.0.0.0", "--port", "8000", "--served-model-name", "policy",
                                                 "--dtype", "bfloat16", "--fast"]
    assert {"name": "TOY_ROUTES", "value": "1"} in engine["env"]
    assert [c["name"] for c in pod["spec"]["initContainers"]] == ["fetch-weights"]  # the initial weights
    assert "TOY_ROUTES" in refused["refused"]  # inference.env may not set what the operator sets
