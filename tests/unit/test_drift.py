"""A live child against the render (`drift`): whose it is, whether it still holds what was
rendered, and the patch that brings it back."""

import pytest

from rft_contract import names
from rft_operator import drift


def test_extra_keys_the_server_or_users_add_are_fine():
    assert drift.covers({"a": 1, "b": [{"x": 1, "y": 2}]}, {"b": [{"x": 1}]})
    assert not drift.covers({"b": [{"x": 1}, {"x": 2}]}, {"b": [{"x": 1}]})
    assert not drift.covers({}, {"a": None})


@pytest.mark.parametrize("refs, want", [
    ([], drift.FOREIGN),
    ([{"kind": names.KIND, "name": "demo", "uid": "0000-1111", "controller": True}], drift.OURS),
    ([{"kind": names.KIND, "name": "demo", "uid": "old", "controller": True}], drift.PREVIOUS),
    ([{"kind": names.KIND, "name": "other", "uid": "x", "controller": True}], drift.FOREIGN),
    ([{"kind": names.KIND, "name": "demo", "uid": "0000-1111"}], drift.FOREIGN),  # not its controller
    ([{"kind": "Deployment", "name": "demo", "uid": "y", "controller": True}], drift.FOREIGN),
])
def test_classify_owner(refs, want):
    assert drift.classify_owner({"ownerReferences": refs}, "demo", "0000-1111", names.KIND) == want


@pytest.mark.parametrize("rendered, live, want", [
    # Our namespace: a key we no longer render goes; anyone else's stays.
    ({"rft.dev/job": "j"}, {"rft.dev/job": "j", "rft.dev/old": "x", "example.com/x": "y"},
     {"rft.dev/job": "j", "rft.dev/old": None}),
    # Listed by the previous render (`rft.dev/managed-keys`): goes once not rendered.
    ({"rft.dev/spec-hash": "h"},
     {"rft.dev/spec-hash": "g", "a.io/k": "1", "b.io/k": "2", "rft.dev/managed-keys": '{"annotations":["a.io/k"]}'},
     {"rft.dev/spec-hash": "h", "a.io/k": None, "rft.dev/managed-keys": None}),
    ({"rft.dev/spec-hash": "h"}, {}, {"rft.dev/spec-hash": "h"}),
])
def test_compute_patch_removes_only_keys_we_rendered(rendered, live, want):
    obj = {"kind": "ServiceAccount", "metadata": {"name": "sa", "annotations": rendered}}
    patch = drift.compute_patch(obj, {"metadata": {"annotations": live}})
    assert patch["metadata"]["annotations"] == want and obj["metadata"]["annotations"] == rendered  # not mutated


def test_build_managed_keys_lists_keys_outside_our_namespaces():
    assert drift.build_managed_keys({"labels": {"rft.dev/job": "j", "app.kubernetes.io/managed-by": "x"},
                                      "annotations": {"rft.dev/spec-hash": "h"}}) == ""
    assert drift.build_managed_keys({"annotations": {"b.io/k": "1", "a.io/k": "2", "rft.dev/spec-hash": "h"}}) == (
        '{"annotations":["a.io/k","b.io/k"]}')
