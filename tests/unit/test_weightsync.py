"""Weight-sync promotion and counting (operator side), pass by pass."""

import pytest

from rft_contract import names
from rft_operator import weightsync as sync
from rft_operator.builders import build_configmap
from rft_contract.spec import parse_spec
from rft_operator.reconcile import reconcile

from .testing import LOOP, NOW, REF, SPEC, STATIC, cond, make_job, observed, pod, rollout_pods, status

W = "s3://ckpts/demo/weights/step-"


def loop_observed(extra=(), **kw):
    obs = observed([pod(1, 0), pod(1, 1), *extra], cm_hash=None)
    loop_accounts = {("ServiceAccount", f"demo-rft-{r}"): "" for r in ("inference", "explorer")}
    readers = {(kind, "demo-status-reader"): "" for kind in ("Role", "RoleBinding")}
    obs.children = {**STATIC, **loop_accounts, **readers, ("Service", "demo-inference"): "", **{
        ("ConfigMap", "demo-config"): build_configmap(REF, parse_spec(LOOP))["metadata"]["annotations"][names.ANNOTATION_SPEC_HASH]}}
    return obs


def run(trainer=None, replicas=None, spec=LOOP, phase=names.RUNNING, pods=None, old_target=None, **st):
    ws = {"replicas": replicas or {}}
    if old_target:
        ws["target"] = old_target
    body = make_job(spec, status(phase, trainer=trainer or {}, weightSync=ws, **st))
    return reconcile(body, loop_observed(rollout_pods(spec) if pods is None else pods), NOW)


def test_new_loop_job_creates_inference_and_explorer_pods_and_targets_the_base_model():
    plan = run(pods=[])
    created = [o["metadata"]["name"] for o in plan.create]
    assert created == ["demo-inference-0", "demo-inference-1", "demo-explorer-0"]
    ws = plan.status["weightSync"]
    assert ws["target"] == {"version": 0, "uri": "s3://models/tiny-qwen", "id": None, "peer": None, "manifest": None}
    assert ws["synced"] == "0/2" and ws["desiredReplicas"] == 2
    assert cond(plan, names.COND_WEIGHTS_SYNCED)["reason"] == names.REASON_SYNCING


def test_latest_weights_are_promoted_and_replicas_counted():
    trainer = {"step": 4, "latestWeights": {"version": 3, "uri": W + "00000003", "id": "abc"}}
    plan = run(trainer, {"demo-inference-0": {"version": 3, "id": "abc"},
                         "demo-inference-1": {"version": 2, "id": "old"}})
    ws = plan.status["weightSync"]
    assert ws["target"] == {"version": 3, "uri": W + "00000003", "id": "abc", "peer": None, "manifest": None}
    assert (ws["syncedReplicas"], ws["synced"], ws["lagSteps"]) == (1, "1/2", 2)
    assert [e.message for e in plan.events if e.reason == "WeightsTarget"] == [
        f"serving target is now version 3 ({W}00000003) (the first)"]
    # A routine promotion of the next export: status and metrics, no event.
    plan = run(trainer, {}, old_target={"version": 2, "uri": W + "00000002", "id": "old"})
    assert plan.status["weightSync"]["target"]["version"] == 3
    assert not [e for e in plan.events if e.reason == "WeightsTarget"]
    plan = run(trainer, {"demo-inference-0": {"version": 3, "id": "abc"},
                         "demo-inference-1": {"version": 3, "id": "abc"}},
               old_target={"version": 3, "uri": W + "00000003", "id": "abc"})
    assert plan.status["weightSync"]["synced"] == "2/2"
    assert cond(plan, names.COND_WEIGHTS_SYNCED)["status"] == "True"
    assert not [e for e in plan.events if e.reason == "WeightsTarget"]  # no change, no event


def test_a_re_export_of_the_same_version_is_not_synced_until_reloaded():
    trainer = {"step": 3, "latestWeights": {"version": 3, "uri": W + "00000003", "id": "new"}}
    plan = run(trainer, {"demo-inference-0": {"version": 3, "id": "old"},
                         "demo-inference-1": {"version": 3, "id": "new"}})
    assert plan.status["weightSync"]["synced"] == "1/2"


EVAL = {"tasksetUri": "s3://data/heldout.jsonl"}


@pytest.mark.parametrize("best, want", [(2, 2), (0, 0), (None, 3)])
def test_pinned_best_follows_the_best_score(best, want):
    """pinnedVersion best serves status.trainer.evaluation.best; before any score, the
    current target stays, and the condition says why."""
    spec = {**LOOP, "sync": {"pinnedVersion": "best"}, "evaluation": EVAL}
    trainer = {"step": 3, "latestWeights": {"version": 3, "uri": W + "00000003"}, "weightVersions": [1, 2, 3]}
    if best is not None:
        trainer["evaluation"] = {"best": {"version": best, "accuracy": 0.5}}
    plan = run(trainer, spec=spec, old_target={"version": 3, "uri": W + "00000003"})
    assert plan.status.get("weightSync", {}).get("target", {"version": 3})["version"] == want
    if best is None:
        c_ = cond(plan, names.COND_WEIGHTS_SYNCED)
        assert c_["status"] == "False" and "pinnedVersion=best: no version scored yet" in c_["message"]


@pytest.mark.parametrize("pin, versions, want, ok", [
    (2, [1, 2, 3], 2, True),
    (0, [1, 2, 3], 0, True),          # back to the base model
    (3, [], 3, True),                 # the latest export needs no list
    (7, [1, 2, 3], 3, False),         # missing: keep serving the current target
])
def test_pinned_version(pin, versions, want, ok):
    spec = {**LOOP, "sync": {"pinnedVersion": pin}}
    trainer = {"step": 3, "latestWeights": {"version": 3, "uri": W + "00000003"}, "weightVersions": versions}
    plan = run(trainer, spec=spec, old_target={"version": 3, "uri": W + "00000003"})
    assert plan.status.get("weightSync", {}).get("target", {"version": 3})["version"] == want
    c_ = cond(plan, names.COND_WEIGHTS_SYNCED)
    if not ok:
        assert c_["status"] == "False" and c_["reason"] == names.REASON_PIN_MISSING
        assert "pinnedVersion=7" in c_["message"] and "1, 2, 3" in c_["message"]
    elif pin == 2:
        # Every key is sent: `id: None` deletes the old target's id in the merge patch.
        assert plan.status["weightSync"]["target"] == {"version": 2, "uri": W + "00000002", "id": None,
                                                       "peer": None, "manifest": None}


def test_replica_errors_show_in_the_condition():
    plan = run({"step": 1}, {"demo-inference-0": {"version": 0},
                             "demo-inference-1": {"version": None, "error": "download failed: SlowDown"}})
    c_ = cond(plan, names.COND_WEIGHTS_SYNCED)
    assert c_["reason"] == names.REASON_SYNC_ERROR and "demo-inference-1: download failed" in c_["message"]


def test_entries_of_removed_replicas_are_pruned():
    spec = {**LOOP, "inference": {**LOOP["inference"], "replicas": 1}}
    plan = run({"step": 1}, {"demo-inference-0": {"version": 0}, "demo-inference-1": {"version": 0}},
               spec=spec, pods=rollout_pods(LOOP))
    assert plan.status["weightSync"]["replicas"] == {"demo-inference-1": None}
    assert "demo-inference-1" in plan.delete_pods


def test_drifted_or_failed_rollout_pods_are_replaced_but_not_the_trainers():
    plan = run({"step": 1}, pods=rollout_pods(stale=["demo-explorer-0"], failed=["demo-inference-0"]))
    assert sorted(plan.delete_pods) == ["demo-explorer-0", "demo-inference-0"]


@pytest.mark.parametrize("phase", [names.SUSPENDED, names.FAILED])
def test_suspend_and_failure_remove_rollout_pods(phase):
    spec = {**LOOP, "suspend": phase == names.SUSPENDED}
    plan = run({"step": 1}, spec=spec, phase=phase)
    assert {"demo-inference-0", "demo-inference-1", "demo-explorer-0"} <= set(plan.delete_pods)
    assert not [o for o in plan.create if o["kind"] == "Pod"]


def test_after_success_inference_waits_for_the_final_weights_then_goes():
    trainer = {"step": 5, "latestWeights": {"version": 5, "uri": W + "00000005", "id": "f"}}
    done = {"completionTime": "2026-11-30T11:59:00Z"}
    plan = run(trainer, {"demo-inference-0": {"version": 5, "id": "f"}}, phase=names.SUCCEEDED, **done)
    rollout_deletes = lambda plan: sorted(x for x in plan.delete_pods if "-trainer-" not in x)  # noqa: E731
    assert rollout_deletes(plan) == ["demo-explorer-0"] and plan.requeue_after > 0
    plan = run(trainer, {n: {"version": 5, "id": "f"} for n in ("demo-inference-0", "demo-inference-1")},
               phase=names.SUCCEEDED, **done)
    assert rollout_deletes(plan) == ["demo-explorer-0", "demo-inference-0", "demo-inference-1"]


def test_train_only_jobs_have_no_weight_sync_status():
    plan = reconcile(make_job(SPEC, status(names.RUNNING)), observed([pod(1, 0), pod(1, 1)]), NOW)
    assert "weightSync" not in plan.status
    assert all(x["type"] != names.COND_WEIGHTS_SYNCED for x in plan.status["conditions"])


def test_count_synced_lag_uses_the_oldest_served_version():
    n = sync.count_synced({"a": {"version": 4}, "b": {"version": 2}}, ["a", "b"], {"version": 4}, 6)
    assert (n.synced, n.lag_steps) == (1, 4)
