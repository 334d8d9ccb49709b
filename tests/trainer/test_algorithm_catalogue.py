"""The algorithm axis: the contract's catalogue (rft_contract.algorithms) is the one place an
algorithm's facts live, and a new algorithm is one catalogue line plus one registered
estimator: the spec, the CRD, the admission rule and the trainer follow."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import yaml

from rft_contract.algorithms import ALGORITHMS, LOSS_AGGREGATIONS
from rft_contract.spec import AlgorithmSpec
from rft_trainer.algorithms import ADV_ESTIMATORS, AGG_MODES
from tests.fixtures import catalogues

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("operator/rft_operator", "contract/rft_contract", "trainer_image/rft_trainer", "trainer_image/rft_serving")


def algorithm_schema(crd: dict) -> dict:
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return spec["properties"]["algorithm"]["properties"]


def test_the_spec_the_crd_and_the_trainer_follow_the_catalogue():
    names = list(ALGORITHMS)
    assert list(AlgorithmSpec.model_fields["name"].annotation.__args__) == names
    crd = algorithm_schema(yaml.safe_load((ROOT / "crds" / "rftjob.yaml").read_text()))
    assert crd["name"]["enum"] == names
    assert crd["lossAggregation"]["enum"] == list(LOSS_AGGREGATIONS) == list(AGG_MODES)
    assert all(p.summary in crd["name"]["description"] for p in ALGORITHMS.values())
    assert {p.advantage for p in ALGORITHMS.values()} <= set(ADV_ESTIMATORS)


def test_no_module_outside_the_catalogue_branches_on_an_algorithm_s_name():
    quoted = "|".join(re.escape(n) for n in ALGORITHMS)
    branch = re.compile(rf"""(==|!=|\bin\b)\s*\(?\s*["']({quoted})["']|["']({quoted})["']\s*(==|!=)""")
    found = [f"{path.relative_to(ROOT)}:{i}: {line.strip()}"
             for d in SOURCES for path in sorted((ROOT / d).rglob("*.py"))
             for i, line in enumerate(path.read_text().splitlines(), 1) if branch.search(line)]
    assert not found, "decide by the profile (rft_contract.algorithms), not by name:\n" + "\n".join(found)


NEW_ALGORITHM = '''
    AlgorithmProfile("rloo", advantage="rloo", needs_critic=False, needs_groups=True, summary="leave-one-out"),
'''

DRIVER = textwrap.dedent('''
    import torch
    from rft_contract.config import load_config
    from rft_contract.spec import RFTJobSpec
    from rft_trainer.algorithms import register_adv_est
    from rft_trainer.engine import FSDPTrainEngine
    from rft_trainer.experience import Experiences
    from rft_trainer.parallelize import Runtime

    @register_adv_est("rloo")  # the one implementation: each score less the mean of the others'
    def rloo(b, a):
        adv = torch.zeros_like(b.scores)
        for g in b.group_ids.unique():
            i = b.group_ids == g
            adv[i] = b.scores[i] - (b.scores[i].sum() - b.scores[i]) / (int(i.sum()) - 1)
        adv = adv[:, None] * b.response_mask
        return adv, adv

    job = {"model": {"path": "s3://models/tiny"}, "algorithm": {"name": "rloo"},
           "trainer": {"total_steps": 2, "batch_size": 4}, "checkpoint": {"uri": "s3://ckpts/x"}}
    engine = FSDPTrainEngine(load_config(job, env={}), Runtime(0, 1, 0, torch.device("cpu")))
    batch = Experiences(tokens=torch.ones(4, 3, dtype=torch.long), attention_mask=torch.ones(4, 3, dtype=torch.bool),
                        action_mask=torch.tensor([[0, 1, 1]] * 4, dtype=torch.bool),
                        prompt_lengths=torch.ones(4, dtype=torch.long), rewards=torch.tensor([1.0, 0.0, 0.5, 0.5]),
                        group_ids=torch.tensor([0, 0, 1, 1])).validate()
    adv, _, values = engine._advantages(batch, batch, None, None)
    print("advantages", adv[:, 1].tolist(), "critic", engine.algorithm.needs_critic, values)
    spec = {"model": {"path": "s3://models/tiny"}, "algorithm": {"name": "rloo"}, "checkpoint": {"uri": "s3://ckpts/x"},
            "trainer": {"totalSteps": 2, "batchSize": 4}, "buffer": {"uri": "s3://buffer/x"},
            "inference": {}, "explorer": {"rolloutsPerTask": 2, "tasksetUri": "s3://tasks/x"}}
    RFTJobSpec.model_validate(spec)  # groups of two: accepted
    spec["explorer"]["rolloutsPerTask"] = 1
    try:
        RFTJobSpec.model_validate(spec)
        print("refused False")
    except ValueError as e:
        print("refused", "rloo needs spec.explorer.rolloutsPerTask >= 2" in str(e), e)
''')


def test_a_new_algorithm_is_one_catalogue_line_and_one_registered_estimator(tmp_path):
    env = catalogues.with_entry(tmp_path, "algorithms", NEW_ALGORITHM)
    out = catalogues.run(env, "-c", DRIVER)
    assert "advantages [1.0, -1.0, 0.0, 0.0] critic False None" in out, out
    assert "refused True" in out, out  # needs_groups: the admission rule covers it
    crd = yaml.safe_load(catalogues.run(env, "-m", "rft_operator.crdgen"))
    schema = algorithm_schema(crd)
    assert schema["name"]["enum"][-1] == "rloo" and "leave-one-out" in schema["name"]["description"]
    rule = next(v["rule"] for v in crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
                ["properties"]["spec"]["x-kubernetes-validations"] if "rolloutsPerTask" in v["rule"])
    assert "'rloo'" in rule
