"""The tracker axis: the contract's catalogue (rft_contract.trackers) is the one place a
tracker's Secret facts live; the pods' secretKeyRefs, the owner webhook's list of Secrets a
pod may read, the trainer's redaction and its backends are derived from it."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from rft_contract.spec import TrackingSpec, parse_spec
from rft_contract.trackers import SECRET_PATHS, TRACKERS
from rft_operator import builders, ownerhook
from rft_trainer import tracking

from .testing import REF, SPEC

ROOT = Path(__file__).resolve().parents[2]
WITH_SECRET = [p for p in TRACKERS.values() if p.secret_field]
SECTIONS = {"tensorboard": {}, "mlflow": {"trackingUri": "https://mlflow.example", "experiment": "rft"},
            "wandb": {"project": "rft"}}


def test_the_spec_the_trainer_and_the_image_follow_the_catalogue():
    sections = [f for f in TrackingSpec.model_fields if f not in TrackingSpec.non_tracker_fields]
    assert sections == list(TRACKERS) == list(tracking.BACKENDS) == list(SECTIONS)
    for p in WITH_SECRET:
        field = TrackingSpec.model_fields[p.name].annotation.__args__[0].model_fields[p.secret_field]
        assert all(k.name in field.description for k in p.secret_keys), p.name  # kubectl explain names the keys
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    packages = " ".join(deps["dependencies"] + sum(deps["optional-dependencies"].values(), []))
    assert all(re.search(rf"\b{re.escape(p.package)}[<>=]", packages) for p in TRACKERS.values() if p.package)


@pytest.mark.parametrize("profile", WITH_SECRET, ids=lambda p: p.name)
def test_a_tracker_s_secret_reaches_its_pods_key_by_key_and_nothing_else_does(profile):
    spec = parse_spec({**SPEC, "tracking": {profile.name: {**SECTIONS[profile.name],
                                                           profile.secret_path.rsplit(".", 1)[1]: "the-secret"}}})
    env = [e for e in builders.build_trainer_pod(REF, spec, 1, 0)["spec"]["containers"][0]["env"]
           if (e.get("valueFrom") or {}).get("secretKeyRef", {}).get("name") == "the-secret"]
    assert env == [{"name": k.name, "valueFrom": {"secretKeyRef": {
        "name": "the-secret", "key": k.name, **({"optional": True} if k.optional else {})}}} for k in profile.secret_keys]
    stored = spec.model_dump(mode="json", by_alias=True, exclude_none=True)
    assert "the-secret" in ownerhook.spec_secrets(stored)  # the webhook lets its pods read it
    pod = {"metadata": {"labels": {}}, "spec": {"containers": [{"env": [
        {"name": "X", "valueFrom": {"secretKeyRef": {"name": "other", "key": "x"}}}]}]}}
    assert profile.secret_path in ownerhook.check_pod(pod, stored)  # ... and names the field when it refuses
    values = {k.name: f"value-of-{k.name.lower()}" for k in profile.secret_keys}
    scrubbed = tracking.redact(" ".join(values.values()), env=values)
    assert all((values[k.name] in scrubbed) is not k.redact for k in profile.secret_keys)


def test_no_module_outside_the_catalogue_names_a_tracker_s_secret_key():
    keys = "|".join(re.escape(k.name) for p in TRACKERS.values() for k in p.secret_keys)
    literal = re.compile(rf"""["']({keys})["']""")
    found = [f"{path.relative_to(ROOT)}:{i}" for d in ("operator", "contract", "trainer_image")
             for path in sorted((ROOT / d).rglob("*.py")) if path.name != "trackers.py"
             for i, line in enumerate(path.read_text().splitlines(), 1) if literal.search(line)]
    assert not found, found
    assert SECRET_PATHS == tuple(p.secret_path for p in WITH_SECRET)
