"""The API models: defaults, validation messages, and the generated CRD."""

from pathlib import Path

import pytest
import yaml

from rft_operator import crdgen
from rft_contract.spec import RFTJobSpec, parse_spec

from .conftest import SPEC

ROOT = Path(__file__).resolve().parents[2]


def test_committed_crd_matches_models():
    committed = (ROOT / "crds" / "rftjob.yaml").read_text()
    assert committed == crdgen.render(), (
        "crds/rftjob.yaml is stale: run `python -m rft_operator.crdgen > crds/rftjob.yaml`"
    )


def test_manifests_carry_the_same_crd():
    base = yaml.safe_load((ROOT / "manifests" / "kustomization.yaml").read_text())
    assert "../crds" in base["resources"]
    crds = yaml.safe_load((ROOT / "crds" / "kustomization.yaml").read_text())
    assert crds["resources"] == ["rftjob.yaml"]


def _walk(node, path="$"):
    yield path, node
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _walk(v, f"{path}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _walk(v, f"{path}[{i}]")


def test_crd_schema_is_structural_and_has_no_defaults():
    schema = crdgen.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, node in _walk(schema):
        if not isinstance(node, dict) or path.endswith("x-kubernetes-validations"):
            continue
        assert "default" not in node, f"schema default at {path} would cause GitOps drift"
        assert "$ref" not in node and "anyOf" not in node and "title" not in node, path
        if path.endswith((".properties", ".rules")) or "x-kubernetes-validations" in path:
            continue
        if any(k in node for k in ("properties", "items", "minimum", "pattern")):
            assert "type" in node, f"untyped schema node at {path}"


def test_crd_names_and_columns():
    crd = crdgen.build_crd()["spec"]
    assert crd["names"]["shortNames"] == ["rft"] and crd["names"]["categories"] == ["rft"]
    version = crd["versions"][0]
    assert version["subresources"] == {"status": {}}
    cols = [c["name"] for c in version["additionalPrinterColumns"] if "priority" not in c]
    assert cols == ["Phase", "Step", "Checkpoint", "Weights", "Synced", "Age"]


def test_defaults_live_in_the_models():
    spec = parse_spec(SPEC)
    assert spec.failure_policy.max_restarts == 2  # given
    assert spec.checkpoint.keep == 3  # default
    assert spec.trainer.termination_grace_period_seconds == 300
    assert spec.failure_policy.fatal_exit_codes == [78]
    assert spec.suspend is False


@pytest.mark.parametrize(
    "patch, field",
    [
        ({"trainer": {**SPEC["trainer"], "nodes": 0}}, "spec.trainer.nodes"),
        ({"algorithm": {"name": "dpo"}}, "spec.algorithm.name"),
        ({"checkpoint": {"uri": "s3://ckpts/x", "keep": 0}}, "spec.checkpoint.keep"),
        ({"trainer": {**SPEC["trainer"], "bogus": 1}}, "spec.trainer.bogus"),
    ],
)
def test_parse_spec_names_the_field(patch, field):
    with pytest.raises(ValueError) as e:
        parse_spec({**SPEC, **patch})
    assert str(e.value).startswith(field), str(e.value)


def test_camel_case_round_trip():
    spec = RFTJobSpec.model_validate(SPEC)
    dumped = spec.model_dump(by_alias=True, exclude_defaults=True)
    assert dumped["trainer"]["gpusPerNode"] == 8
    assert dumped["checkpoint"]["credentialsSecret"] == "s3-creds"
    assert RFTJobSpec.model_validate(yaml.safe_load(yaml.safe_dump(dumped))) == spec
