"""The admission policies are generated from the status model; the committed file must be
what the generator prints, and every status field must be covered by the status policy."""

import typing
from pathlib import Path

import yaml
from pydantic import BaseModel

from rft_contract import names
from rft_contract.spec import RFTJobSpec
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
                                    policygen.OPERATOR_STATUS_POLICY, policygen.OWNER_POLICY}
    # The owner check is evaluated against each RFTJob of the namespace (none: refused),
    # only on creating objects labelled as ours: the API server looks parameters up before
    # matchConditions, and the garbage collector updates and deletes children of gone jobs.
    (owner,) = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicyBinding"
                and d["spec"]["policyName"] == policygen.OWNER_POLICY]
    assert owner["spec"]["paramRef"] == {"selector": {}, "parameterNotFoundAction": "Deny"}
    assert owner["spec"]["matchResources"]["objectSelector"] == {"matchLabels": {names.LABEL_MANAGED_BY: names.MANAGED_BY}}
    (policy,) = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicy" and d["metadata"]["name"] ==
                 policygen.OWNER_POLICY]
    assert {op for rule in policy["spec"]["matchConstraints"]["resourceRules"] for op in rule["operations"]} \
        == {"CREATE"}
    assert all("paramRef" not in d["spec"] for d in docs
               if d["kind"] == "ValidatingAdmissionPolicyBinding" and d["spec"]["policyName"] != policygen.OWNER_POLICY)
    assert all(d["spec"]["validationActions"] == ["Deny"] for d in docs if "validationActions" in d["spec"])


def _secret_fields(model, path=()):
    """Every `...Secret` field of the spec, as its CEL path (`spec.?a.?bSecret`)."""
    for name, field in model.model_fields.items():
        alias = field.alias or name
        nested = [t for t in typing.get_args(field.annotation) or (field.annotation,)
                  if isinstance(t, type) and issubclass(t, BaseModel)]
        if alias.endswith("Secret"):
            yield ".?".join(("params.spec", *path, alias))
        for t in nested:
            yield from _secret_fields(t, (*path, alias))


def test_pods_may_read_every_secret_the_spec_names():
    """A Secret field the owner policy does not list would make the operator's own pods refused."""
    (secrets,) = [v["expression"] for v in policygen.owner_policy()["spec"]["variables"] if v["name"] == "secrets"]
    fields = sorted(_secret_fields(RFTJobSpec))
    assert {"params.spec.?tracking.?mlflow.?credentialsSecret", "params.spec.?tracking.?wandb.?apiKeySecret",
            "params.spec.?checkpoint.?credentialsSecret"} <= set(fields)
    assert [f for f in fields if f not in secrets] == []
