"""Static children stay as rendered: every one carries a spec hash, and a hand edit or a
spec change is patched back (an immutable field: deleted and created again). Pure
(`reconcile.compute_static_children`, `policy.covers`, `policy.classify_owner`)."""

import copy

import pytest

from rft_contract import names as c
from rft_contract.spec import parse_spec
from rft_operator import policy
from rft_operator.model import ChildView
from rft_operator.objects import JobRef
from rft_operator.reconcile import Observed, compute_static_children

from .conftest import SPEC

REF = JobRef("demo", "team-a", "0000-1111")


def rendered(spec=SPEC):
    create, _, _ = compute_static_children(REF, parse_spec(spec), c.RUNNING, {})
    return {(o["kind"], o["metadata"]["name"]): o for o in create}


def as_served(obj):
    """The object as the API server returns it: identity, and defaults it fills in."""
    out = copy.deepcopy(obj)
    out["metadata"].update(uid="u-" + obj["metadata"]["name"], resourceVersion="7",
                           creationTimestamp="2026-11-30T11:00:00Z")
    if obj["kind"] == "Service":
        out["spec"].update(type="ClusterIP", clusterIPs=["None"], sessionAffinity="None", ipFamilies=["IPv4"])
        for port in out["spec"]["ports"]:
            port["protocol"] = "TCP"
    if obj["kind"] == "RoleBinding":
        for s in out["subjects"]:
            s.setdefault("apiGroup", "")
    return out


def observe(objs):
    views = [ChildView.from_object(o["kind"], o) for o in objs.values()]
    return Observed.from_views([], views)


def plan(objs, spec=SPEC):
    o = observe(objs)
    create, replace, recreate = compute_static_children(REF, parse_spec(spec), c.RUNNING, o.children, o.live)
    return ([x["kind"] for x in create], [(x["kind"], x["metadata"]["name"]) for x in replace],
            [(x["kind"], x["metadata"]["name"]) for x in recreate])


def test_every_static_child_carries_a_spec_hash():
    children = rendered()
    assert {k for k, _ in children} >= {"ConfigMap", "Service", "Role", "RoleBinding", "ServiceAccount"}
    for obj in children.values():
        assert obj["metadata"]["annotations"][c.ANNOTATION_SPEC_HASH], obj["metadata"]["name"]


def test_children_as_served_are_steady():
    assert plan({k: as_served(v) for k, v in rendered().items()}) == ([], [], [])


def _edit(key, fn):
    live = {k: as_served(v) for k, v in rendered().items()}
    fn(live[key])
    return plan(live)


SVC = ("Service", c.service_name("demo"))
RB = ("RoleBinding", c.status_role_name("demo"))


@pytest.mark.parametrize("key, edit", [
    (SVC, lambda o: o["spec"]["ports"][0].update(port=1234)),
    (SVC, lambda o: o["spec"]["ports"].append({"name": "x", "port": 1, "protocol": "TCP", "targetPort": 1})),
    (SVC, lambda o: o["spec"].update(selector={"app": "other"})),
    (RB, lambda o: o["subjects"].append({"kind": "ServiceAccount", "name": "intruder", "namespace": "team-a"})),
    (RB, lambda o: o["subjects"][0].update(name="someone-else")),
    (("ConfigMap", "demo-config"), lambda o: o["data"].update({c.CONFIG_FILE: "{}"})),
    (SVC, lambda o: o["metadata"]["labels"].pop(c.LABEL_ROLE, None) or o["metadata"]["labels"].pop(c.LABEL_JOB)),
], ids=["service-port", "service-extra-port", "service-selector", "binding-extra-subject", "binding-subject",
        "configmap-data", "labels"])
def test_hand_edits_are_patched_back(key, edit):
    assert _edit(key, edit) == ([], [key], [])


def test_changed_role_ref_is_recreated():
    assert _edit(RB, lambda o: o["roleRef"].update(name="other")) == ([], [], [RB])


def test_a_spec_change_shows_as_hash_drift():
    live = {k: as_served(v) for k, v in rendered().items()}
    spec = {**SPEC, "trainer": {**SPEC["trainer"], "masterPort": 29600}}
    want = sorted([SVC, ("ConfigMap", "demo-config")])  # the config carries the port too
    assert sorted(plan(live, spec)[1]) == want
    # The hash alone tells, without the live fields.
    hashes = observe(live).children
    _, replace, _ = compute_static_children(REF, parse_spec(spec), c.RUNNING, hashes)
    assert sorted((x["kind"], x["metadata"]["name"]) for x in replace) == want


def test_extra_keys_the_server_or_users_add_are_fine():
    assert policy.covers({"a": 1, "b": [{"x": 1, "y": 2}]}, {"b": [{"x": 1}]})
    assert not policy.covers({"b": [{"x": 1}, {"x": 2}]}, {"b": [{"x": 1}]})
    assert not policy.covers({}, {"a": None})


@pytest.mark.parametrize("refs, want", [
    ([], policy.FOREIGN),
    ([{"kind": c.KIND, "name": "demo", "uid": "0000-1111", "controller": True}], policy.OURS),
    ([{"kind": c.KIND, "name": "demo", "uid": "old", "controller": True}], policy.PREVIOUS),
    ([{"kind": c.KIND, "name": "other", "uid": "x", "controller": True}], policy.FOREIGN),
    ([{"kind": c.KIND, "name": "demo", "uid": "0000-1111"}], policy.FOREIGN),  # not its controller
    ([{"kind": "Deployment", "name": "demo", "uid": "y", "controller": True}], policy.FOREIGN),
])
def test_classify_owner(refs, want):
    assert policy.classify_owner({"ownerReferences": refs}, "demo", "0000-1111", c.KIND) == want
