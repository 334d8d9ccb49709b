"""Static children stay as rendered: every one carries a spec hash, and a hand edit or a
spec change is patched back (an immutable field: deleted and created again). Pure
(`reconcile.compute_static_children`, `drift.compute_patch`; drift's own rules: test_drift.py)."""

import copy
import json

import pytest

from rft_contract import names
from rft_contract.spec import parse_spec
from rft_operator import drift
from rft_operator.model import ChildView
from rft_operator.reconcile import Observed, compute_static_children, reconcile

from .testing import NOW, REF, SPEC, make_job, merge_patch, status


def rendered(spec=SPEC):
    create = compute_static_children(REF, parse_spec(spec), names.RUNNING, {}).create
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
    """(kinds to create, keys to patch, keys to recreate); nothing is ever deleted here."""
    o = observe(objs)
    static = compute_static_children(REF, parse_spec(spec), names.RUNNING, o.children, o.live)
    assert static.delete == []
    return ([x["kind"] for x in static.create], [(x["kind"], x["metadata"]["name"]) for x in static.patch],
            [(x["kind"], x["metadata"]["name"]) for x in static.recreate])


def test_every_static_child_carries_a_spec_hash():
    children = rendered()
    assert {k for k, _ in children} >= {"ConfigMap", "Service", "Role", "RoleBinding", "ServiceAccount"}
    for obj in children.values():
        assert obj["metadata"]["annotations"][names.ANNOTATION_SPEC_HASH], obj["metadata"]["name"]


def test_children_as_served_are_steady():
    assert plan({k: as_served(v) for k, v in rendered().items()}) == ([], [], [])


def _edit(key, fn):
    live = {k: as_served(v) for k, v in rendered().items()}
    fn(live[key])
    return plan(live)


SVC = ("Service", names.service_name("demo"))
RB = ("RoleBinding", names.status_role_name("demo"))


@pytest.mark.parametrize("key, edit", [
    (SVC, lambda o: o["spec"]["ports"][0].update(port=1234)),
    (SVC, lambda o: o["spec"]["ports"].append({"name": "x", "port": 1, "protocol": "TCP", "targetPort": 1})),
    (SVC, lambda o: o["spec"].update(selector={"app": "other"})),
    (RB, lambda o: o["subjects"].append({"kind": "ServiceAccount", "name": "intruder", "namespace": "team-a"})),
    (RB, lambda o: o["subjects"][0].update(name="someone-else")),
    (("ConfigMap", "demo-config"), lambda o: o["data"].update({names.CONFIG_FILE: "{}"})),
    (SVC, lambda o: o["metadata"]["labels"].pop(names.LABEL_ROLE, None) or o["metadata"]["labels"].pop(names.LABEL_JOB)),
], ids=["service-port", "service-extra-port", "service-selector", "binding-extra-subject", "binding-subject",
        "configmap-data", "labels"])
def test_hand_edits_are_patched_back(key, edit):
    assert _edit(key, edit) == ([], [key], [])


def test_changed_role_ref_is_recreated():
    assert _edit(RB, lambda o: o["roleRef"].update(name="other")) == ([], [], [RB])


def test_a_spec_change_shows_as_hash_drift():
    _check_drift({"masterPort": 29600}, [SVC])  # the pods' config does not carry the port (rft_contract.podconfig)


@pytest.mark.parametrize("trainer, want", [
    ({"totalSteps": 500}, [("ConfigMap", "demo-config")]),
    ({"masterPort": 29600, "totalSteps": 500}, sorted([SVC, ("ConfigMap", "demo-config")])),
], ids=["config", "both"])
def test_a_spec_change_to_what_pods_read_drifts_the_config(trainer, want):
    _check_drift(trainer, want)


def _check_drift(trainer: dict, want: list) -> None:
    live = {k: as_served(v) for k, v in rendered().items()}
    spec = {**SPEC, "trainer": {**SPEC["trainer"], **trainer}}
    assert sorted(plan(live, spec)[1]) == want
    # The hash alone tells, without the live fields.
    hashes = observe(live).children
    replace = compute_static_children(REF, parse_spec(spec), names.RUNNING, hashes).patch
    assert sorted((x["kind"], x["metadata"]["name"]) for x in replace) == want


# ------------------------------------------------------------------ keys we no longer render

SA_ANNOTATIONS = {"eks.amazonaws.com/role-arn": "arn:aws:iam::1:role/rft", "team.example.com/cost-center": "42"}


def _served_with(spec, edit=lambda o: None):
    live = {k: as_served(v) for k, v in rendered(spec).items()}
    for obj in live.values():
        edit(obj)
    return live


def _patches(live, spec):
    o = observe(live)
    return {(x["kind"], x["metadata"]["name"]): x
            for x in compute_static_children(REF, parse_spec(spec), names.RUNNING, o.children, o.live).patch}


def test_an_annotation_dropped_from_the_spec_is_removed_and_others_keys_stay():
    before = {**SPEC, "serviceAccountAnnotations": SA_ANNOTATIONS}
    sa = ("ServiceAccount", names.service_account_name("demo", names.ROLE_TRAINER))
    assert json.loads(rendered(before)[sa]["metadata"]["annotations"][names.ANNOTATION_MANAGED_KEYS]) == {
        "annotations": sorted(SA_ANNOTATIONS)}

    def added_by_others(obj):  # the API server, kubectl, another controller
        obj["metadata"]["annotations"]["kubectl.kubernetes.io/last-applied-configuration"] = "{}"
        obj["metadata"]["labels"]["example.com/team"] = "ml"

    live = _served_with(before, added_by_others)
    after = {**SPEC, "serviceAccountAnnotations": {"eks.amazonaws.com/role-arn": "arn:aws:iam::1:role/rft"}}
    patch = _patches(live, after)[sa]["metadata"]
    assert patch["annotations"]["team.example.com/cost-center"] is None  # ours before, not any more
    assert patch["annotations"]["eks.amazonaws.com/role-arn"] == "arn:aws:iam::1:role/rft"
    managed = json.loads(patch["annotations"][names.ANNOTATION_MANAGED_KEYS])
    assert managed == {"annotations": ["eks.amazonaws.com/role-arn"]}
    assert "kubectl.kubernetes.io/last-applied-configuration" not in patch["annotations"]  # not ours: untouched
    assert "example.com/team" not in patch["labels"]
    # All annotations gone from the spec: the list of managed keys goes too.
    patch = _patches(live, SPEC)[sa]["metadata"]
    assert {k for k, v in patch["annotations"].items() if v is None} == {
        *SA_ANNOTATIONS, names.ANNOTATION_MANAGED_KEYS}
    # Once the server merged the patches, the children are steady; others' keys are still there.
    for key, patch in _patches(live, SPEC).items():
        live[key] = merge_patch(live[key], patch)
    assert plan(live, SPEC) == ([], [], [])
    assert "kubectl.kubernetes.io/last-applied-configuration" in live[sa]["metadata"]["annotations"]
    assert not set(SA_ANNOTATIONS) & set(live[sa]["metadata"]["annotations"])


def test_a_label_in_our_namespace_we_no_longer_render_is_removed():
    def stale(obj):
        obj["metadata"]["labels"]["rft.dev/replica"] = "0"  # e.g. rendered by an older operator
        obj["metadata"]["labels"]["example.com/team"] = "ml"
    live = _served_with(SPEC, stale)
    patch = drift.compute_patch(rendered()[SVC], observe(live).live[SVC])
    labels = patch["metadata"]["labels"]
    assert labels["rft.dev/replica"] is None and "example.com/team" not in labels
    assert drift.compute_patch(rendered()[SVC], None) == rendered()[SVC]  # nothing known of it: nothing removed


# ------------------------------------------------------------------ children the spec no longer renders

FULL = {**SPEC, "inference": {"replicas": 1, "gpusPerReplica": 1}, "explorer": {"tasksetUri": "s3://data/t.jsonl"}}


def _deleted(spec, phase=names.RUNNING):
    o = observe({k: as_served(v) for k, v in rendered(FULL).items()})
    static = compute_static_children(REF, parse_spec(spec) if spec else None, phase, o.children, o.live)
    assert all(set(x) == {"kind", "metadata"} and x["metadata"]["namespace"] == "team-a" for x in static.delete)
    return sorted((x["kind"], x["metadata"]["name"]) for x in static.delete)


def test_children_the_spec_no_longer_renders_are_deleted():
    without_explorer = {k: v for k, v in FULL.items() if k != "explorer"}
    assert _deleted(FULL) == []
    assert _deleted(without_explorer) == [("Role", "demo-status-reader"), ("RoleBinding", "demo-status-reader"),
                                          ("ServiceAccount", "demo-rft-explorer")]
    assert _deleted(SPEC) == [("Role", "demo-status-reader"), ("RoleBinding", "demo-status-reader"),
                              ("Service", "demo-inference"), ("ServiceAccount", "demo-rft-explorer"),
                              ("ServiceAccount", "demo-rft-inference")]
    # A finished job, or one whose spec is invalid, creates nothing and deletes nothing:
    # the garbage collector takes them with the job.
    assert _deleted(SPEC, names.SUCCEEDED) == _deleted(SPEC, names.FAILED) == _deleted(None) == []


def test_reconcile_plans_the_deletions():
    o = observe({k: as_served(v) for k, v in rendered(FULL).items()})
    plan_ = reconcile(make_job(status=status(names.RUNNING)), o, NOW)
    assert ("ServiceAccount", "demo-rft-inference") in [(x["kind"], x["metadata"]["name"]) for x in plan_.delete]
    assert not [x for x in plan_.delete_pods if x.startswith("demo-trainer")]
