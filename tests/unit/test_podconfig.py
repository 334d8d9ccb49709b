"""The pods' config of its own (rft_contract.podconfig): an explicit list of the spec's fields,
read by this version and the previous release's trainer images alike."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import typing

import jsonschema
import pytest
import yaml
from pydantic import BaseModel
from pydantic.alias_generators import to_snake

from e2e import releases
from rft_contract import podconfig
from rft_contract.config import JobConfig, load_config
from rft_contract.spec import RFTJobSpec, parse_spec
from rft_operator.children import build_trainer_config
from rft_operator.objects import JobRef

from .testing import SPEC

REF = JobRef("demo", "team-a", "uid-1")


def full_spec() -> RFTJobSpec:
    return parse_spec(yaml.safe_load(releases.POD_CONFIG_SPEC.read_text()))


def _model(annotation) -> type[BaseModel] | None:
    for a in typing.get_args(annotation) or (annotation,):
        if isinstance(a, type) and issubclass(a, BaseModel):
            return a
    return None


def _unclassified(model: type[BaseModel], tree: dict, prefix: str = "") -> list[str]:
    """Fields of `model` neither in `tree` (POD_CONFIG at this level) nor OPERATOR_ONLY, or in both."""
    out = []
    for name, info in model.model_fields.items():
        path, sub = prefix + name, tree.get(name)
        if (sub is not None) == (path in podconfig.OPERATOR_ONLY):
            out.append(path)
        elif isinstance(sub, dict):
            out += _unclassified(_model(info.annotation), sub, path + ".")
    return out


def test_every_spec_field_reaches_the_pods_or_stays_with_the_operator_by_name():
    assert _unclassified(RFTJobSpec, podconfig.POD_CONFIG) == []
    assert all(why for why in podconfig.OPERATOR_ONLY.values())


def test_a_new_spec_field_reaches_no_pod_until_it_is_listed(monkeypatch):
    monkeypatch.delitem(podconfig.POD_CONFIG["sync"], "probe_tolerance")
    assert _unclassified(RFTJobSpec, podconfig.POD_CONFIG) == ["sync.probe_tolerance"]
    assert "probe_tolerance" not in build_trainer_config(REF, full_spec())["sync"]


def test_the_config_carries_no_secret_and_nothing_only_the_pod_spec_needs():
    config = build_trainer_config(REF, full_spec())
    text = yaml.safe_dump(config)
    for absent in ("HF_TOKEN", "s3-creds", "VLLM_LOGGING_LEVEL", "--max-model-len", "runAsUser", "run_as_user",
                   "role-arn", "masterPort", "master_port", "tolerations", "max_restarts"):
        assert absent not in text, absent
    assert config["inference"]["image"] == "vllm/vllm-openai:v0.32.0"  # the pods' schema checks it is set


def test_this_version_s_config_is_read_by_the_previous_release_s_trainer_image():
    schema, _ = releases.pod_config()
    jsonschema.validators.validator_for(schema)(schema).validate(build_trainer_config(REF, full_spec()))
    # ... which refuses what it does not know (the check above could not fail otherwise).
    with pytest.raises(jsonschema.ValidationError, match="unexpected"):
        config = build_trainer_config(REF, full_spec())
        config["trainer"]["new_field"] = 1
        jsonschema.validators.validator_for(schema)(schema).validate(config)


PREVIOUS_LOAD = """
import json, sys
from rft_contract.config import JobConfig, load_config
for line in sys.stdin:
    try:
        load_config(json.loads(line), env={})
        print("ok")
    except Exception as e:
        print("refused:", str(e).splitlines()[0])
"""


def test_this_version_s_configs_load_in_the_previous_release_s_own_code(tmp_path):
    """Its schema above has no Python rules: here its own `load_config` reads our configs
    (the full spec, and the same with each engine), from git history."""
    commit = releases.PREVIOUS
    try:
        releases.extract(commit, ["contract"], tmp_path)
    except subprocess.CalledProcessError as e:
        pytest.skip(f"commit {commit} is not in this clone's history (a shallow clone): {e.stderr.decode()[:200]}")
    configs = []
    for engine in ("reference", "vllm", "sglang"):
        spec = yaml.safe_load(releases.POD_CONFIG_SPEC.read_text())
        spec["inference"]["engine"] = engine
        configs.append(build_trainer_config(REF, parse_spec(spec)))
    out = subprocess.run([sys.executable, "-c", PREVIOUS_LOAD], input="\n".join(json.dumps(c) for c in configs),
                         env={**os.environ, "PYTHONPATH": str(tmp_path / "contract")}, cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:3] == ["ok"] * 3, out.stdout


def test_the_previous_release_s_config_is_read_by_this_version():
    _, previous = releases.pod_config()
    ours = load_config(build_trainer_config(REF, full_spec()), env={})
    # Everything the pods read, the same (the previous release also carried what no pod reads).
    assert podconfig.render(load_config(previous, env={}), {}) == podconfig.render(ours, {})


def test_a_rule_on_a_field_pods_never_get_is_the_api_server_s_alone():
    """A hostPath model cache needs trainer.securityContext.allowPrivileged, which is the pod
    spec's: the pods' schema judged its default (false) and refused every such job's config."""
    spec = {**SPEC, "model": {**SPEC["model"], "cache": {"hostPath": "/var/cache/rft"}},
            "trainer": {**SPEC["trainer"], "securityContext": {"allowPrivileged": True}}}
    assert load_config(build_trainer_config(REF, parse_spec(spec)), env={}).model.cache.host_path == "/var/cache/rft"
    with pytest.raises(ValueError, match="allowPrivileged"):  # the API server's side still refuses it
        parse_spec({**spec, "trainer": SPEC["trainer"]})


def test_a_field_added_later_is_rendered_only_away_from_its_default(monkeypatch):
    monkeypatch.setitem(podconfig.ADDED, ("sync", "probe_tolerance"), 2)
    base = {**SPEC, "checkpoint": SPEC["checkpoint"]}
    assert "probe_tolerance" not in build_trainer_config(REF, parse_spec(base))["sync"]  # an older image reads it
    tuned = {**base, "sync": {**base.get("sync", {}), "probeTolerance": 0.5}}
    assert build_trainer_config(REF, parse_spec(tuned))["sync"]["probe_tolerance"] == 0.5


def _nested_models(model: type[BaseModel], path: str = ""):
    for name, info in model.model_fields.items():
        sub = _model(info.annotation)
        if sub is not None:
            yield f"{path}{name}", sub
            yield from _nested_models(sub, f"{path}{name}.")


def test_no_rule_in_the_pods_schema_mixes_a_field_pods_get_with_one_they_do_not():
    """The top-level rules that read an operator-only field are the API server's alone
    (JobConfig skips them); a nested model's rule must read only fields the pods get, or
    only fields they do not (then the pods judge defaults, which pass)."""
    assert all(not podconfig.reads_operator_only(c.rule) for c in JobConfig.rules)
    mixed = []
    for path, model in _nested_models(RFTJobSpec):
        if path in podconfig.OPERATOR_ONLY:
            continue  # the pods never get the model at all
        for c in getattr(model, "rules", ()):
            if c.ok is None:
                continue
            fields = {to_snake(f) for f in re.findall(r"self\.\??([A-Za-z_]\w*)", c.rule)}
            out = {f for f in fields if f"{path}.{f}" in podconfig.OPERATOR_ONLY}
            if out and out != fields:
                mixed.append(f"{path}: {c.rule}")
    assert not mixed, mixed
