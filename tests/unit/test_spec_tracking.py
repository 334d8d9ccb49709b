"""spec.tracking: the experiment trackers' models, their messages and their CRD schema."""

from __future__ import annotations

import pytest

from rft_contract.config import ConfigError, load_config
from rft_contract.spec import parse_spec
from rft_operator import crdgen
from rft_operator.children import build_trainer_config
from rft_operator.objects import JobRef
from rft_trainer.tracking import build_params, flatten

from .testing import SPEC

MLFLOW = {"trackingUri": "https://mlflow.ml.svc:5000", "experiment": "rft"}


def with_tracking(tracking: dict) -> dict:
    return {**SPEC, "tracking": tracking}


def test_every_backend_is_optional_and_defaults_apply():
    assert parse_spec(SPEC).tracking is None
    assert parse_spec(with_tracking({})).tracking.tensorboard is None
    spec = parse_spec(with_tracking({
        "tensorboard": {},
        "mlflow": {**MLFLOW, "credentialsSecret": "mlflow-creds"},
        "wandb": {"project": "rft", "entity": "team"},
    })).tracking
    assert spec.tensorboard.uri is None  # <checkpoint.uri>/tensorboard, resolved by the trainer
    assert (spec.mlflow.tracking_uri, spec.mlflow.experiment, spec.mlflow.credentials_secret) == (
        "https://mlflow.ml.svc:5000", "rft", "mlflow-creds")
    assert (spec.wandb.project, spec.wandb.entity, spec.wandb.mode, spec.wandb.api_key_secret) == (
        "rft", "team", "online", None)
    assert parse_spec(with_tracking({"tensorboard": {"uri": "s3://boards/demo"}})).tracking.tensorboard.uri == \
        "s3://boards/demo"


@pytest.mark.parametrize("tracking, message", [
    ({"mlflow": {"experiment": "rft"}}, "spec.tracking.mlflow.trackingUri: required key is missing"),
    ({"mlflow": {"trackingUri": "http://mlflow:5000"}}, "spec.tracking.mlflow.experiment: required key is missing"),
    ({"mlflow": {**MLFLOW, "experiment": ""}}, "spec.tracking.mlflow.experiment:"),
    ({"mlflow": {**MLFLOW, "trackingUri": "file:///tmp/mlruns"}},
     "spec.tracking.mlflow: tracking.mlflow.trackingUri must be an http:// or https:// URL"),
    ({"mlflow": {**MLFLOW, "trackingUri": "https://bob:hunter22@mlflow:5000"}},
     "spec.tracking.mlflow: tracking.mlflow.trackingUri must not carry credentials (user:password@host): put "
     "them in the Secret named by tracking.mlflow.credentialsSecret"),
    ({"mlflow": {**MLFLOW, "trackingUri": "http://mlflow:99999"}},
     "spec.tracking.mlflow: tracking.mlflow.trackingUri must have a DNS name or an IP address"),
    ({"mlflow": {**MLFLOW, "credentialsSecret": "Not_A_Name"}}, "spec.tracking.mlflow.credentialsSecret:"),
    ({"mlflow": {**MLFLOW, "password": "x"}}, "spec.tracking.mlflow.password:"),
    ({"wandb": {"mode": "offline"}}, "spec.tracking.wandb.project: required key is missing"),
    ({"wandb": {"project": "team/rft"}}, "spec.tracking.wandb.project: must not contain any of / \\ # ? % :"),
    ({"wandb": {"project": "rft", "mode": "disabled"}}, "spec.tracking.wandb.mode: must be one of 'online', 'offline'"),
    ({"tensorboard": {"uri": "s3://tb/demo"}}, "spec.tracking.tensorboard.uri: the S3 bucket must be 3 to 63"),
    ({"tensorbord": {}}, "spec.tracking.tensorbord:"),
])
def test_bad_tracking_names_the_field(tracking, message):
    with pytest.raises(ValueError) as e:
        parse_spec(with_tracking(tracking))
    assert str(e.value).startswith(message), str(e.value)
    assert "hunter22" not in str(e.value)


def test_a_pod_config_says_it_in_snake_case():
    config = {"model": {"path": "/m"}, "algorithm": {"name": "grpo"},
              "trainer": {"total_steps": 1, "batch_size": 8, "gpus_per_node": 0},
              "checkpoint": {"uri": "s3://ckpts/x"}, "tracking": {"mlflow": {"experiment": "rft"}}}
    with pytest.raises(ConfigError, match=r"^tracking\.mlflow\.tracking_uri: required key is missing"):
        load_config(config, env={})


def test_without_tracking_the_job_config_and_its_hash_are_unchanged():
    """Unset, the field stays out of the ConfigMap: a running job sees no drift, and an
    older trainer image no unknown key."""
    ref = JobRef("demo", "ml", "uid-1")
    assert "tracking" not in build_trainer_config(ref, parse_spec(SPEC))
    config = build_trainer_config(ref, parse_spec(with_tracking({"mlflow": MLFLOW})))
    assert config["tracking"]["mlflow"] == {"tracking_uri": "https://mlflow.ml.svc:5000", "experiment": "rft",
                                            "credentials_secret": None}
    assert load_config(config, env={}).tracking.mlflow.experiment == "rft"


def test_the_crd_checks_the_tracking_uri_on_the_object_and_has_no_defaults():
    tracking = crdgen.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "properties"]["tracking"]
    mlflow = tracking["properties"]["mlflow"]
    assert mlflow["required"] == ["trackingUri", "experiment"]
    assert "x-kubernetes-validations" not in mlflow["properties"]["trackingUri"]  # never quoted back
    assert [r["fieldPath"] for r in mlflow["x-kubernetes-validations"]] == [".trackingUri"] * 3
    assert tracking["properties"]["wandb"]["properties"]["mode"]["enum"] == ["online", "offline"]
    assert not any("default" in node for node in _objects(tracking))
    # s3:// is an admission rule (a hand-written local config may name a directory)
    assert "self.startsWith('s3://')" in str(tracking["properties"]["tensorboard"]["properties"]["uri"])
    assert parse_spec(with_tracking({"tensorboard": {"uri": "/var/log/tb"}})).tracking.tensorboard.uri == "/var/log/tb"


def _objects(node):
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from _objects(value)
    elif isinstance(node, list):
        for value in node:
            yield from _objects(value)


def test_params_are_the_flattened_spec_without_env_values():
    spec = {**SPEC, "trainer": {**SPEC["trainer"], "env": [{"name": "HF_TOKEN", "value": "hf_secret"}]},
            "tracking": {"mlflow": MLFLOW}}
    rendered = build_trainer_config(JobRef("demo", "ns", "uid-1"), parse_spec(spec))
    config = load_config({**rendered, "job": {**rendered["job"], "attempt": 3}}, env={})
    params = build_params(config)
    assert params["algorithm.name"] == "grpo" and params["trainer.nodes"] == "2"
    assert params["tracking.mlflow.experiment"] == "rft" and params["job.name"] == "demo"
    assert "hf_secret" not in str(params) and "job.attempt" not in params
    # Exactly the fields the pods get: none that in the pod would only hold its default
    # (trainer.tolerations, masterPort, ...: the pod spec's, podconfig.OPERATOR_ONLY).
    pods = flatten(rendered)
    assert set(params) - set(pods) == {"buffer.uri", "buffer.wait"}  # as load_config resolves them
    assert all(params[k] == v for k, v in pods.items())
    assert not any(k.startswith(("trainer.tolerations", "trainer.master_port", "trainer.image")) for k in params)
