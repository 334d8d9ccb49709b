"""The pieces every child shares (rft_operator.objects), one table each."""

import pytest

from rft_contract import names
from rft_contract.spec import parse_spec
from rft_operator import objects

from .testing import REF, SPEC


def spec_with(**trainer):
    return parse_spec({**SPEC, "trainer": {**SPEC["trainer"], **trainer}})


@pytest.mark.parametrize("trainer, want", [
    ({"tolerations": []}, {}),
    ({"tolerations": [], "nodeSelector": {"pool": "gpu"}}, {"nodeSelector": {"pool": "gpu"}}),
    ({"tolerations": [], "priorityClassName": "high", "schedulerName": "volcano"},
     {"priorityClassName": "high", "schedulerName": "volcano"}),
    ({}, {"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]}),
])
def test_build_placement(trainer, want):
    assert objects.build_placement(spec_with(**trainer)) == want


def test_build_pod_carries_placement_and_owner():
    pod = objects.build_pod(REF, spec_with(nodeSelector={"pool": "gpu"}), "p", {"a": "b"}, {"containers": []})
    assert pod["spec"] == {"containers": [], "nodeSelector": {"pool": "gpu"},
                           "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                           "volumes": [{"name": "tmp", "emptyDir": {}}]}
    assert pod["metadata"]["ownerReferences"][0] == {"apiVersion": names.API_VERSION, "kind": names.KIND, "name": "demo",
                                                     "uid": "0000-1111", "controller": True, "blockOwnerDeletion": True}


def test_with_scratch_space_mounts_tmp_and_sets_home_unless_set():
    mine = {"name": "a", "env": [{"name": "HOME", "value": "/home/me"}, {"name": "X", "value": "$(HOME)/x"}],
            "volumeMounts": [{"name": "w", "mountPath": "/w"}]}
    out = objects.with_scratch_space({"initContainers": [{"name": "i"}], "containers": [mine],
                                      "volumes": [{"name": "w", "emptyDir": {}}]})
    tmp = {"name": "tmp", "mountPath": "/tmp"}
    logs = {"terminationMessagePolicy": "FallbackToLogsOnError"}
    assert out["volumes"] == [{"name": "w", "emptyDir": {}}, {"name": "tmp", "emptyDir": {}}]
    assert out["initContainers"] == [{"name": "i", "env": [{"name": "HOME", "value": "/tmp"}], "volumeMounts": [tmp],
                                      **logs}]
    assert out["containers"] == [{**mine, "volumeMounts": [*mine["volumeMounts"], tmp], **logs}]


@pytest.mark.parametrize("resources, gpus, want", [
    ({}, 0, {}),
    ({}, 2, {"requests": {"nvidia.com/gpu": "2"}, "limits": {"nvidia.com/gpu": "2"}}),
    ({"requests": {"cpu": 4}}, 0, {"requests": {"cpu": "4"}}),  # quantities as strings
    ({"limits": {"memory": "1Gi"}}, 1, {"requests": {"nvidia.com/gpu": "1"}, "limits": {"memory": "1Gi", "nvidia.com/gpu": "1"}}),
])
def test_build_resources(resources, gpus, want):
    assert objects.build_resources(spec_with(resources=resources).trainer.resources, gpus) == want


@pytest.mark.parametrize("checkpoint, want_names", [
    ({"uri": "s3://bkt"}, []),
    ({"uri": "s3://bkt", "endpoint": "http://minio:9000", "region": "eu-1"}, ["AWS_ENDPOINT_URL", "AWS_REGION"]),
    ({"uri": "s3://bkt", "credentialsSecret": "s"}, ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"]),
])
def test_build_s3_env(checkpoint, want_names):
    env = objects.build_s3_env(parse_spec({**SPEC, "checkpoint": checkpoint}))
    assert [e["name"] for e in env] == want_names
    assert all("value" not in e for e in env if e["name"].startswith("AWS_") and "ACCESS" in e["name"])
    assert [e["valueFrom"]["secretKeyRef"].get("optional", False) for e in env if "valueFrom" in e] == (
        [False, False, True] if "credentialsSecret" in checkpoint else [])


@pytest.mark.parametrize("a, b, same", [
    ({"x": 1, "y": 2}, {"y": 2, "x": 1}, True),   # key order does not matter
    ({"x": 1}, {"x": 2}, False),
])
def test_spec_hash(a, b, same):
    assert (objects.spec_hash(a) == objects.spec_hash(b)) is same
    assert len(objects.spec_hash(a)) == 16
