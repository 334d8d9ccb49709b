"""The API models: defaults, validation messages, and the generated CRD."""

from decimal import Decimal
from pathlib import Path

import pytest
import yaml

from rft_operator import crdgen
from rft_contract.checks import is_qualified_name, parse_quantity
from rft_contract.spec import RFTJobSpec, parse_spec

from .testing import SPEC

ROOT = Path(__file__).resolve().parents[2]


def test_committed_crd_matches_models():
    committed = (ROOT / "crds" / "rftjob.yaml").read_text()
    assert committed == crdgen.render(), (
        "crds/rftjob.yaml is stale: run `python -m rft_operator.crdgen > crds/rftjob.yaml`"
    )


def test_manifests_carry_the_same_crd():
    base = yaml.safe_load((ROOT / "manifests" / "base" / "kustomization.yaml").read_text())
    assert "../../crds" in base["resources"]
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
    assert cols == ["Phase", "Step", "Checkpoint", "Weights", "Synced", "Eval", "Queue", "Age"]


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


# ------------------------------------------------------------------ admission corpus

CORPUS = ROOT / "tests" / "integration" / "admission"


def _corpus(kind):
    return sorted((CORPUS / kind).glob("*.yaml"), key=lambda p: p.name)


def _header(path, key):
    prefix = f"# {key}: "
    return next((line[len(prefix):] for line in path.read_text().splitlines() if line.startswith(prefix)), None)


@pytest.mark.parametrize("path", [p for p in _corpus("invalid") if _header(p, "admission-only") is None],
                         ids=lambda p: p.stem)
def test_parse_spec_refuses_what_admission_refuses(path):
    """pydantic and the API server agree: every invalid corpus manifest is refused by
    parse_spec too (except admission-only rules), naming the field, never echoing a
    credential. The API server's side: tests/integration/test_admission_corpus.py."""
    with pytest.raises(ValueError) as e:
        parse_spec(yaml.safe_load(path.read_text())["spec"])
    assert str(e.value).startswith("spec"), str(e.value)
    secret = _header(path, "secret")
    assert secret is None or secret not in str(e.value)


@pytest.mark.parametrize("path", _corpus("valid"), ids=lambda p: p.stem)
def test_parse_spec_accepts_what_admission_accepts(path):
    parse_spec(yaml.safe_load(path.read_text())["spec"])


def test_builtin_rewards_match_the_explorer():
    from rft_contract.checks import BUILTIN_REWARDS
    from rft_rollout.rewards import BUILTINS

    assert sorted(BUILTIN_REWARDS) == sorted(BUILTINS)


@pytest.mark.parametrize("quantity, value", [
    (8, 8), ("500m", Decimal("0.5")), ("1.5Gi", 1536 * 2**20), ("1e3", 1000), (".5", Decimal("0.5")),
    ("10G", 10**10), ("+1Ki", 1024), ("-1", -1), ("1K", None), ("16 Gi", None), ("lots", None), ("1.5.3", None), ("", None),
])
def test_parse_quantity(quantity, value):
    assert parse_quantity(quantity) == value


@pytest.mark.parametrize("name, ok", [
    ("cpu", True), ("nvidia.com/gpu", True), ("node.kubernetes.io/instance-type", True), ("a_b.C-d", True),
    ("", False), ("-cpu", False), ("a/b/c", False), ("/name", False), ("Example.com/x", False), ("x" * 64, False),
    ("example.com/" + "x" * 63, True), ("bad key", False),
])
def test_qualified_names(name, ok):
    assert is_qualified_name(name) is ok


def _schema_at(*path):
    node = crdgen.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    for key in path:
        node = node["items"] if key == "[]" else node["properties"][key]
    return node


def test_lists_that_are_sets_or_maps_say_so():
    env = _schema_at("trainer", "env")
    assert (env["x-kubernetes-list-type"], env["x-kubernetes-list-map-keys"]) == ("map", ["name"])
    for path in (("failurePolicy", "fatalExitCodes"), ("failurePolicy", "retryableExitCodes"),
                 ("trainer", "securityContext", "addCapabilities")):
        assert _schema_at(*path)["x-kubernetes-list-type"] == "set", path


def test_endpoint_rules_run_on_the_checkpoint_not_the_string():
    """The API server quotes a string that fails its own rule; the endpoint may hold a
    credential, so its rules live on the object and only name the field."""
    assert "x-kubernetes-validations" not in _schema_at("checkpoint", "endpoint")
    paths = [r.get("fieldPath") for r in _schema_at("checkpoint")["x-kubernetes-validations"]]
    assert paths.count(".endpoint") == 4  # credentials, shape, host and port, immutable


def test_service_account_name_is_gone_and_annotations_are_bounded():
    assert "serviceAccountName" not in _schema_at("trainer")["properties"]
    annotations = _schema_at("serviceAccountAnnotations")
    assert annotations["maxProperties"] == 16 and annotations["additionalProperties"]["maxLength"] == 4096
