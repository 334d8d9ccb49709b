"""The admission policies are generated from the status model; the committed file must be
what the generator prints, and every status field must be covered by the status policy."""

from pathlib import Path

import yaml

from rft_contract.status import RFTJobStatus
from rft_operator import policygen

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "manifests" / "base" / "admission-policies.yaml"


def test_committed_policies_match_the_generator():
    assert COMMITTED.read_text() == policygen.render(), (
        "manifests/base/admission-policies.yaml is stale: run "
        "`python -m rft_operator.policygen > manifests/base/admission-policies.yaml`")


def test_status_policy_covers_every_status_field():
    """A status field missing from the policy would be writable by every pod identity."""
    policy = policygen.status_policy()["spec"]
    kept = {v["name"]: v["expression"] for v in policy["variables"]}
    for name, field in RFTJobStatus.model_fields.items():
        alias = field.alias or name
        covered = [k for k in ("trainerKept", "operatorKept", "syncTargetKept") if f".?{alias} ==" in kept[k]]
        assert covered or alias == "weightSync", f"status.{alias} is not covered by the status policy"


def test_every_document_is_a_policy_or_its_binding():
    docs = list(yaml.safe_load_all(COMMITTED.read_text()))
    policies = {d["metadata"]["name"] for d in docs if d["kind"] == "ValidatingAdmissionPolicy"}
    bindings = {d["spec"]["policyName"] for d in docs if d["kind"] == "ValidatingAdmissionPolicyBinding"}
    assert policies == bindings == {policygen.STATUS_POLICY, policygen.OPERATOR_POLICY,
                                    policygen.OPERATOR_STATUS_POLICY}
    # No parameters: a binding's paramRef.selector makes the API server evaluate its policy
    # once per matching object for every request, which made each wave of jobs quadratic
    # (issue 38). The owner webhook looks the one RFTJob up instead.
    assert all(not d["spec"].get("paramKind") for d in docs if d["kind"] == "ValidatingAdmissionPolicy")
    assert all("paramRef" not in d["spec"] for d in docs if d["kind"] == "ValidatingAdmissionPolicyBinding")
    assert all(d["spec"]["validationActions"] == ["Deny"] for d in docs if "validationActions" in d["spec"])
