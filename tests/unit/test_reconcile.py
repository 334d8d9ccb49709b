"""The reconcile checklist, pass by pass, against hand-built observations."""

from datetime import timedelta

from rft_contract import names
from rft_contract.spec import parse_spec
from rft_operator.reconcile import Observed, PodView, reconcile

from .testing import NOW, SPEC, cond, last_failure, make_job, observed, pod, status


def test_new_job_creates_children_and_gang():
    plan = reconcile(make_job(), observed(cm_hash=None), NOW)
    kinds = [o["kind"] for o in plan.create]
    assert kinds == ["ConfigMap", "Pod", "Pod"]  # static children exist except the ConfigMap
    assert [o["metadata"]["name"] for o in plan.create[1:]] == ["demo-trainer-1-0", "demo-trainer-1-1"]
    assert plan.status["phase"] == names.PENDING and plan.status["attempt"] == 1
    assert plan.status["restarts"] == 0
    assert plan.status["trainer"] == {"totalSteps": 100, "progress": "0/100"}
    assert [e.reason for e in plan.events] == [names.REASON_CREATED]
    assert plan.status_changed


def test_missing_static_children_are_recreated():
    plan = reconcile(make_job(status=status(names.RUNNING)), Observed(pods=[pod(1, 0), pod(1, 1)]), NOW)
    assert sorted(o["kind"] for o in plan.create) == ["ConfigMap", "Role", "RoleBinding", "Service", "ServiceAccount"]


def test_drifted_configmap_is_replaced():
    plan = reconcile(make_job(status=status(names.RUNNING)), observed([pod(1, 0), pod(1, 1)], cm_hash="stale"), NOW)
    assert [o["kind"] for o in plan.patch] == ["ConfigMap"]


def test_all_running_sets_phase_running_and_start_time():
    plan = reconcile(make_job(status=status(names.PENDING)), observed([pod(1, 0), pod(1, 1)]), NOW)
    assert plan.status["phase"] == names.RUNNING
    assert plan.status["startTime"] == "2026-11-30T12:00:00Z"
    assert cond(plan, names.COND_RUNNING)["status"] == "True"
    assert [e.reason for e in plan.events] == [names.REASON_ALL_RUNNING]
    assert not [o for o in plan.create if o["kind"] == "Pod"]


def test_partially_scheduled_gang_stays_pending_and_fills_gaps():
    plan = reconcile(make_job(status=status(names.PENDING)), observed([pod(1, 0)]), NOW)
    assert plan.status["phase"] == names.PENDING
    assert [o["metadata"]["name"] for o in plan.create if o["kind"] == "Pod"] == ["demo-trainer-1-1"]
    assert plan.status["message"] == "attempt 1: waiting for all 2 trainer pods to run"


def test_a_pod_that_starts_while_the_gang_is_pending_costs_no_status_write():
    job = make_job(status=status(names.PENDING))
    first = reconcile(job, observed([pod(1, 0, "Pending"), pod(1, 1, "Pending")]), NOW)
    job["status"] = first.status
    plan = reconcile(job, observed([pod(1, 0), pod(1, 1, "Pending")]), NOW)
    assert plan.status["phase"] == names.PENDING and not plan.status_changed


def test_steady_state_is_a_no_op():
    first = reconcile(make_job(status=status(names.PENDING)), observed([pod(1, 0), pod(1, 1)]), NOW)
    job = make_job(status={**first.status})
    again = reconcile(job, observed([pod(1, 0), pod(1, 1)]), NOW + timedelta(seconds=5))
    assert again.status_changed is False
    assert again.events == [] and again.delete_pods == []


def test_retryable_failure_restarts_the_whole_gang():
    job = make_job(status=status(names.RUNNING))
    plan = reconcile(job, observed([pod(1, 0), pod(1, 1, "Failed", exit_code=1)]), NOW)
    assert plan.status["phase"] == names.RESTARTING
    assert plan.status["restarts"] == 1
    assert plan.delete_pods == ["demo-trainer-1-0"]  # the failed pod stays for its logs
    assert plan.status["lastFailure"]["pod"] == "demo-trainer-1-1"
    assert plan.status["lastFailure"]["exitCode"] == 1
    assert plan.requeue_after == 30
    assert plan.events[0].type == "Warning" and plan.events[0].reason == names.REASON_RESTARTING


def test_restarting_waits_for_backoff_then_starts_next_attempt():
    job = make_job(status=status(names.RESTARTING, restarts=1, lastFailure=last_failure()))
    early = reconcile(job, observed([pod(1, 1, "Failed", exit_code=1)]), NOW + timedelta(seconds=10))
    assert early.status["phase"] == names.RESTARTING
    assert early.delete_pods == []  # the failed pod stays for its logs
    assert early.requeue_after == 20
    waiting = reconcile(job, observed([pod(1, 0, "Running", deleting=True)]), NOW + timedelta(seconds=31))
    assert waiting.status["phase"] == names.RESTARTING and not waiting.create
    due = reconcile(job, observed([pod(1, 1, "Failed", exit_code=1)]), NOW + timedelta(seconds=31))
    assert due.status["attempt"] == 2 and due.status["phase"] == names.PENDING
    assert [o["metadata"]["name"] for o in due.create if o["kind"] == "Pod"] == ["demo-trainer-2-0", "demo-trainer-2-1"]
    pod_labels = [o["metadata"]["labels"][names.LABEL_ATTEMPT] for o in due.create if o["kind"] == "Pod"]
    assert pod_labels == ["2", "2"]


def test_fatal_exit_code_fails_the_job():
    plan = reconcile(make_job(status=status(names.RUNNING)), observed([pod(1, 0), pod(1, 1, "Failed", exit_code=78)]), NOW)
    assert plan.status["phase"] == names.FAILED
    assert plan.status["restarts"] == 0
    assert "fatal" in plan.status["message"] and "78" in plan.status["message"]
    assert plan.delete_pods == ["demo-trainer-1-0"]
    assert cond(plan, names.COND_FAILED)["reason"] == names.REASON_FATAL_EXIT
    assert plan.status["completionTime"] == "2026-11-30T12:00:00Z"


def test_exhausted_budget_fails_the_job():
    plan = reconcile(make_job(status=status(names.RUNNING, attempt=3, restarts=2)),
                     observed([pod(3, 0, "Failed", exit_code=1), pod(3, 1)]), NOW)
    assert plan.status["phase"] == names.FAILED
    assert "maxRestarts=2" in plan.status["message"]
    assert cond(plan, names.COND_FAILED)["reason"] == names.REASON_BACKOFF_LIMIT


def test_pod_deleted_by_hand_while_running_ends_the_attempt():
    plan = reconcile(make_job(status=status(names.RUNNING)), observed([pod(1, 0)]), NOW)
    assert plan.status["phase"] == names.RESTARTING
    assert plan.status["lastFailure"]["reason"] == names.REASON_POD_DELETED


def test_pod_deleted_before_gang_ran_is_recreated():
    plan = reconcile(make_job(status=status(names.PENDING)), observed([pod(1, 0, "Pending")]), NOW)
    assert plan.status["phase"] == names.PENDING
    assert [o["metadata"]["name"] for o in plan.create if o["kind"] == "Pod"] == ["demo-trainer-1-1"]


def test_all_succeeded():
    plan = reconcile(make_job(status=status(names.RUNNING)), observed([pod(1, 0, "Succeeded"), pod(1, 1, "Succeeded")]), NOW)
    assert plan.status["phase"] == names.SUCCEEDED
    assert plan.status["completionTime"] == "2026-11-30T12:00:00Z"
    assert cond(plan, names.COND_SUCCEEDED)["status"] == "True"


def test_terminal_job_is_left_alone():
    job = make_job(status=status(names.SUCCEEDED, completionTime="2026-11-30T11:00:00Z"))
    plan = reconcile(job, observed([pod(1, 0, "Succeeded"), pod(1, 1, "Succeeded")]), NOW)
    assert plan.create == [] and plan.delete_pods == []
    assert plan.status["completionTime"] == "2026-11-30T11:00:00Z"


def test_suspend_deletes_pods_and_resume_starts_a_new_attempt():
    spec = {**SPEC, "suspend": True}
    plan = reconcile(make_job(spec, status=status(names.RUNNING)), observed([pod(1, 0), pod(1, 1)]), NOW)
    assert plan.status["phase"] == names.SUSPENDED
    assert sorted(plan.delete_pods) == ["demo-trainer-1-0", "demo-trainer-1-1"]
    assert cond(plan, names.COND_SUSPENDED)["status"] == "True"
    assert plan.status["restarts"] == 0
    resumed = reconcile(make_job(status=plan.status), observed([]), NOW)
    assert resumed.status["phase"] == names.PENDING and resumed.status["attempt"] == 2
    assert resumed.status["restarts"] == 0
    assert [e.reason for e in resumed.events] == [names.REASON_RESUMED]
    assert len([o for o in resumed.create if o["kind"] == "Pod"]) == 2


def test_new_gang_waits_until_old_attempt_is_gone():
    plan = reconcile(make_job(status=status(names.PENDING, attempt=2)), observed([pod(1, 0, deleting=True)]), NOW)
    assert not [o for o in plan.create if o["kind"] == "Pod"]
    plan = reconcile(make_job(status=status(names.PENDING, attempt=2)), observed([pod(1, 0)]), NOW)
    assert plan.delete_pods == ["demo-trainer-1-0"]


def test_invalid_stored_spec_fails_with_field_name():
    spec = {**SPEC, "trainer": {**SPEC["trainer"], "nodes": 0}}
    plan = reconcile(make_job(spec), observed(), NOW)
    assert plan.status["phase"] == names.FAILED
    assert "spec.trainer.nodes" in plan.status["message"]
    assert plan.create == []


def test_pod_view_reads_exit_code():
    body = {
        "metadata": {"name": "demo-trainer-1-0", "labels": {names.LABEL_ATTEMPT: "1", names.LABEL_RANK: "0"}},
        "status": {"phase": "Failed", "containerStatuses": [
            {"name": "trainer", "state": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}]},
    }
    v = PodView.from_pod(body)
    assert (v.attempt, v.rank, v.phase, v.exit_code, v.reason) == (1, 0, "Failed", 137, "OOMKilled")


def test_checkpointed_condition_follows_the_trainers_report():
    job = make_job(status=status(names.RUNNING))
    plan = reconcile(job, observed([pod(1, 0), pod(1, 1)]), NOW)
    assert cond(plan, names.COND_CHECKPOINTED)["status"] == "False"
    assert cond(plan, names.COND_CHECKPOINTED)["reason"] == names.REASON_NO_CHECKPOINT
    reported = {**status(names.RUNNING), "trainer": {"progress": "5/100",
                                                 "lastCheckpoint": {"step": 5, "uri": "s3://ckpts/demo/ckpt/step-00000005"}}}
    plan = reconcile(make_job(status=reported), observed([pod(1, 0), pod(1, 1)]), NOW)
    checkpointed = cond(plan, names.COND_CHECKPOINTED)
    assert checkpointed["status"] == "True" and checkpointed["reason"] == names.REASON_CHECKPOINT_SAVED
    assert "step 5" in checkpointed["message"]
    assert "trainer" not in plan.status  # the operator never writes the trainer's subtree


# ---------------------------------------------------------------- the render cache


def test_the_spec_is_validated_once_while_it_stays_the_same(monkeypatch):
    from rft_operator import reconcile as rc

    calls = []
    monkeypatch.setattr(rc, "parse_spec", lambda spec: calls.append(1) or parse_spec(spec))
    renders = rc.RenderCache()
    job = make_job()
    for _ in range(3):  # e.g. three pod events
        reconcile(job, observed([pod(1, 0), pod(1, 1)]), NOW, renders)
    assert len(calls) == 1
    reconcile(job, observed([pod(1, 0), pod(1, 1)]), NOW)  # no cache: rendered afresh
    assert len(calls) == 2
    reconcile({**job, "metadata": {**job["metadata"], "uid": "another"}}, observed([pod(1, 0), pod(1, 1)]), NOW,
              renders)  # deleted and created again under the same name
    assert len(calls) == 3
    renders.forget(job["metadata"]["namespace"], job["metadata"]["name"])
    assert len(renders) == 0


def test_a_spec_changed_in_place_is_rendered_again():
    from rft_operator.reconcile import RenderCache

    renders = RenderCache()
    job = make_job(status=status(names.RUNNING))
    assert not reconcile(job, observed([pod(1, 0), pod(1, 1)]), NOW, renders).patch
    job["spec"]["trainer"]["totalSteps"] = 7  # same dict, same generation: content decides
    plan = reconcile(job, observed([pod(1, 0), pod(1, 1)]), NOW, renders)
    assert [o["kind"] for o in plan.patch] == ["ConfigMap"]
    assert plan.status["trainer"] == {"totalSteps": 7, "progress": "0/7"}


def test_the_cache_holds_at_most_its_limit_forgetting_the_oldest():
    from rft_operator.reconcile import RenderCache

    from rft_operator.objects import JobRef

    renders = RenderCache(limit=2)
    refs = [JobRef.from_body(make_job() | {"metadata": {**make_job()["metadata"], "name": f"j{i}"}}) for i in range(3)]
    first = [renders.render(ref, SPEC) for ref in refs]
    assert len(renders) == 2
    assert renders.render(refs[2], SPEC) is first[2]  # the newest kept
    assert renders.render(refs[0], SPEC) is not first[0]  # the oldest forgotten, rendered again


def test_a_new_job_of_the_same_name_gets_children_owned_by_its_uid():
    reconcile(make_job(), observed(cm_hash=None), NOW)
    job = make_job()
    job["metadata"]["uid"] = "2222-3333"
    plan = reconcile(job, Observed(), NOW)
    assert {r["uid"] for o in plan.create for r in o["metadata"]["ownerReferences"]} == {"2222-3333"}


def test_children_handed_out_are_copies_of_the_cached_render():
    first = reconcile(make_job(), Observed(), NOW)
    first.create[0]["metadata"]["labels"]["edited"] = "by a caller"
    again = reconcile(make_job(), Observed(), NOW)
    assert "edited" not in again.create[0]["metadata"]["labels"]
