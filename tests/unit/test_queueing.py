"""Queueing by Kueue (`queueing.py`) and its part in a reconcile pass: the Workload the
job owns, the gate on its pods, the placement from the admission, the eviction and the
status the job's controller owes Kueue. Kueue itself runs in tests/integration/test_kueue.py."""

from __future__ import annotations

import copy
from datetime import timedelta

from rft_contract import names
from rft_contract.spec import parse_spec
from rft_operator import queueing
from rft_operator.reconcile import reconcile

from .testing import LOOP, NOW, REF, SPEC, at, cond, make_job, merge_patch, observed, pod, rollout_pods, status

FLAVOR = {"apiVersion": queueing.API_VERSION, "kind": "ResourceFlavor", "metadata": {"name": "h100"},
          "spec": {"nodeLabels": {"gpu.example.com/type": "h100"},
                   "tolerations": [{"key": "gpu.example.com/reserved", "operator": "Exists", "effect": "NoSchedule"}]}}


def queued_job(spec: dict = SPEC, job_status: dict | None = None, **labels: str) -> dict:
    job = make_job(spec, job_status)
    job["metadata"]["labels"] = {queueing.LABEL_QUEUE_NAME: "team-a-queue", **labels}
    return job


def workload(*conditions: tuple[str, str, str, str], admission: dict | None = None, active: bool = True,
             checks: list | None = None) -> dict:
    """The job's Workload as Kueue left it: conditions as (type, status, reason, message)."""
    w = queueing.build_workload(REF, parse_spec(SPEC), "team-a-queue", None)
    w["spec"]["active"] = active
    w["metadata"].update(resourceVersion="7", generation=1, uid="wl-uid")
    w["status"] = {"conditions": [{"type": t, "status": s, "reason": r, "message": m,
                                   "lastTransitionTime": at(-60)} for t, s, r, m in conditions]}
    if admission is not None:
        w["status"]["admission"] = admission
    if checks is not None:
        w["status"]["admissionChecks"] = checks
    return w


ADMISSION = {"clusterQueue": "gpus", "podSetAssignments": [
    {"name": "trainer", "count": 2, "flavors": {"nvidia.com/gpu": "h100", "cpu": "h100"}}]}
PENDING = ("QuotaReserved", "False", "Pending",
           "couldn't assign flavors to pod set trainer: insufficient quota for nvidia.com/gpu in flavor h100, "
           "request > maximum capacity (32 > 16)")
ADMITTED = [("QuotaReserved", "True", "QuotaReserved", "Quota reserved in ClusterQueue gpus"),
            ("Admitted", "True", "Admitted", "The workload is admitted")]
EVICTED = ("Evicted", "True", "Preempted", "Preempted to accommodate a workload (UID: x) due to prioritization")


def observe(pods=(), wl: dict | None = None, flavors: dict | None = None, kueue: bool = True, priority=None):
    o = observed(pods)
    o.kueue, o.workload, o.flavors, o.priority = kueue, wl, flavors or {}, priority
    return o


def created_pods(plan) -> list[dict]:
    return [x for x in plan.create if x["kind"] == "Pod"]


# ------------------------------------------------------------------ the Workload


def test_a_job_without_the_label_has_no_workload_and_no_queue_status():
    plan = reconcile(make_job(), observe(kueue=True), NOW)
    assert not [x for x in plan.create if x["kind"] == "Workload"]
    assert plan.status["queue"] is None
    assert names.COND_ADMITTED not in {x["type"] for x in plan.status["conditions"]}
    assert len(created_pods(plan)) == 2


def test_a_queued_job_creates_its_workload_and_no_pods_until_admitted():
    plan = reconcile(queued_job(), observe(), NOW)
    (wl,) = [x for x in plan.create if x["kind"] == "Workload"]
    assert not created_pods(plan)
    assert wl["apiVersion"] == "kueue.x-k8s.io/v1beta2"
    assert wl["metadata"]["name"] == "rftjob-demo"
    assert wl["metadata"]["ownerReferences"][0]["uid"] == REF.uid
    assert wl["metadata"]["ownerReferences"][0]["controller"] is True
    assert wl["metadata"]["labels"][names.LABEL_JOB] == "demo"
    assert wl["spec"]["queueName"] == "team-a-queue"
    assert wl["spec"]["active"] is True
    assert [(x["name"], x["count"]) for x in wl["spec"]["podSets"]] == [("trainer", 2)]
    requests = wl["spec"]["podSets"][0]["template"]["spec"]["containers"][0]["resources"]["requests"]
    assert requests["nvidia.com/gpu"] == "8"
    assert plan.status["phase"] == names.PENDING
    assert plan.status["queue"]["state"] == "Queued"


def test_the_workload_has_a_pod_set_per_role_with_the_pods_counts():
    wl = queueing.build_workload(REF, parse_spec(LOOP), "q", ("high", 1000))
    assert [(x["name"], x["count"]) for x in wl["spec"]["podSets"]] == [("trainer", 2), ("inference", 2),
                                                                       ("explorer", 1)]
    assert wl["spec"]["priorityClassRef"] == {"group": "kueue.x-k8s.io", "kind": "WorkloadPriorityClass",
                                              "name": "high"}
    assert wl["spec"]["priority"] == 1000


def test_a_priority_class_that_does_not_exist_waits_with_its_name_and_creates_nothing():
    job = queued_job(**{queueing.LABEL_PRIORITY_CLASS: "urgent"})
    plan = reconcile(job, observe(priority=None), NOW)
    assert not plan.create or all(x["kind"] != "Workload" and x["kind"] != "Pod" for x in plan.create)
    assert plan.status["phase"] == names.PENDING
    admitted = cond(plan, names.COND_ADMITTED)
    assert admitted["status"] == "False" and admitted["reason"] == "PriorityClassNotFound"
    assert "urgent" in admitted["message"]


def test_without_kueue_installed_a_queued_job_waits_and_says_so():
    plan = reconcile(queued_job(), observe(kueue=False), NOW)
    assert not plan.create or all(x["kind"] not in ("Workload", "Pod") for x in plan.create)
    assert "not installed" in plan.status["message"]
    assert cond(plan, names.COND_ADMITTED)["reason"] == "KueueNotInstalled"


def test_kueues_reason_for_waiting_is_in_the_status():
    plan = reconcile(queued_job(), observe(wl=workload(PENDING)), NOW)
    assert not created_pods(plan)
    assert "insufficient quota for nvidia.com/gpu" in plan.status["message"]
    admitted = cond(plan, names.COND_ADMITTED)
    assert (admitted["status"], admitted["reason"]) == ("False", "Pending")
    assert "32 > 16" in admitted["message"]
    assert cond(plan, names.COND_RECONCILING)["status"] == "True"


# ------------------------------------------------------------------ admission and placement


def test_admitted_pods_carry_the_flavors_node_labels_toleration_and_podset_label():
    plan = reconcile(queued_job(), observe(wl=workload(*ADMITTED, admission=ADMISSION), flavors={"h100": FLAVOR}),
                     NOW)
    pods = created_pods(plan)
    assert len(pods) == 2
    for p in pods:
        assert p["spec"]["nodeSelector"]["gpu.example.com/type"] == "h100"
        assert FLAVOR["spec"]["tolerations"][0] in p["spec"]["tolerations"]
        # the job's own toleration stays
        assert SPEC["trainer"]["tolerations"][0] in p["spec"]["tolerations"]
        assert p["metadata"]["labels"][queueing.LABEL_PODSET] == "trainer"
    assert plan.status["queue"] == {"name": "team-a-queue", "state": "Admitted", "workload": "rftjob-demo",
                                    "clusterQueue": "gpus"}
    assert cond(plan, names.COND_ADMITTED)["status"] == "True"


def test_admission_checks_pod_set_updates_apply_after_the_flavor():
    checks = [{"name": "prov", "state": "Ready", "podSetUpdates": [
        {"name": "trainer", "labels": {"a": "b"}, "annotations": {"c": "d"},
         "nodeSelector": {"zone": "z1"}, "tolerations": [{"key": "z", "operator": "Exists"}]}]}]
    placement = queueing.compute_placement(ADMISSION, checks, {"h100": FLAVOR})["trainer"]
    assert placement.node_selector == {"gpu.example.com/type": "h100", "zone": "z1"}
    assert {"key": "z", "operator": "Exists"} in placement.tolerations
    assert placement.labels == {queueing.LABEL_PODSET: "trainer", "a": "b"}
    pod_obj = queueing.place({"kind": "Pod", "metadata": {"labels": {"x": "y"}}, "spec": {"nodeSelector": {"k": "v"}}},
                             placement)
    assert pod_obj["metadata"]["annotations"] == {"c": "d"}
    assert pod_obj["spec"]["nodeSelector"] == {"k": "v", "gpu.example.com/type": "h100", "zone": "z1"}


def test_a_flavor_not_read_places_nothing_from_it():
    placement = queueing.compute_placement(ADMISSION, [], {})["trainer"]
    assert placement.node_selector == {} and placement.tolerations == ()


def test_admission_without_the_admitted_condition_is_not_enough():
    """Quota reserved, admission checks pending: still queued."""
    wl = workload(("QuotaReserved", "True", "QuotaReserved", "reserved"),
                  ("Admitted", "False", "UnsatisfiedChecks", "The workload has not all checks ready"),
                  admission=ADMISSION)
    plan = reconcile(queued_job(), observe(wl=wl), NOW)
    assert not created_pods(plan)
    assert "not all checks ready" in plan.status["message"]


def test_inference_and_explorers_wait_for_admission_too():
    plan = reconcile(queued_job(LOOP), observe(rollout_pods(LOOP), wl=workload(PENDING)), NOW)
    assert not created_pods(plan)
    assert len(plan.delete_pods) == 3  # the three rollout pods the job had


def test_the_gang_runs_then_reports_pods_ready():
    wl = workload(*ADMITTED, admission=ADMISSION)
    plan = reconcile(queued_job(job_status=status(names.PENDING)), observe([pod(1, 0), pod(1, 1)], wl=wl,
                                                                            flavors={"h100": FLAVOR}), NOW)
    assert plan.status["phase"] == names.RUNNING
    ready = {x["type"]: x for x in plan.workload_status["status"]["conditions"]}[queueing.PODS_READY]
    assert ready["status"] == "True"
    assert plan.workload_status["metadata"]["resourceVersion"] == "7"
    assert "admission" not in plan.workload_status["status"]


# ------------------------------------------------------------------ eviction


def test_evicted_while_running_stops_the_gang_as_a_disruption_and_waits():
    wl = workload(*ADMITTED, EVICTED, admission=ADMISSION)
    job = queued_job(job_status=status(names.RUNNING, attempt=2, restarts=1, disruptions=0))
    plan = reconcile(job, observe([pod(2, 0), pod(2, 1)], wl=wl), NOW)
    assert sorted(plan.delete_pods) == ["demo-trainer-2-0", "demo-trainer-2-1"]
    assert not created_pods(plan)
    assert plan.status["phase"] == names.PENDING
    assert plan.status["attempt"] == 3  # the next admission starts attempt 3 from the checkpoint
    assert plan.status["restarts"] == 1  # the budget is untouched
    assert plan.status["disruptions"] == 1
    assert plan.status["queue"]["state"] == "Evicted"
    assert any(e.reason == names.REASON_EVICTED and "Preempted" in e.message for e in plan.events)
    # pods still there: the admission stays until they are gone (their final checkpoint)
    assert plan.workload_status is None


def test_the_admission_is_cleared_once_the_pods_are_gone():
    wl = workload(*ADMITTED, EVICTED, admission=ADMISSION)
    job = queued_job(job_status=status(names.PENDING, attempt=3, disruptions=1))
    plan = reconcile(job, observe([pod(2, 0, "Failed", 143), pod(2, 1, "Failed", 143)], wl=wl), NOW)
    patch = plan.workload_status
    assert patch["status"]["admission"] is None
    by_type = {x["type"]: x for x in patch["status"]["conditions"]}
    assert (by_type["QuotaReserved"]["status"], by_type["QuotaReserved"]["reason"]) == ("False", "Pending")
    assert by_type["Admitted"]["status"] == "False"
    assert (by_type["Requeued"]["status"], by_type["Requeued"]["reason"]) == ("True", "Preempted")
    assert by_type["Evicted"] == wl["status"]["conditions"][2]  # Kueue's, kept
    assert plan.status["disruptions"] == 1 and plan.status["attempt"] == 3  # counted once
    after = merge_patch(wl, {"status": patch["status"]})
    assert "admission" not in after["status"]


def test_a_terminating_pod_keeps_the_admission():
    """Its SIGTERM is the final checkpoint: the quota goes only when it is done."""
    wl = workload(*ADMITTED, EVICTED, admission=ADMISSION)
    job = queued_job(job_status=status(names.PENDING, attempt=3, disruptions=1))
    plan = reconcile(job, observe([pod(2, 0, deleting=True), pod(2, 1, "Failed", 143)], wl=wl), NOW)
    assert plan.workload_status is None


def test_readmitted_starts_the_next_attempt():
    wl = workload(*ADMITTED, ("Evicted", "False", "QuotaReserved", "Previously: preempted"),
                  ("Requeued", "True", "Preempted", "x"), admission=ADMISSION)
    job = queued_job(job_status=status(names.PENDING, attempt=3, disruptions=1))
    plan = reconcile(job, observe([pod(2, 0, "Failed", 143), pod(2, 1, "Failed", 143)], wl=wl,
                                  flavors={"h100": FLAVOR}), NOW)
    assert sorted(x["metadata"]["name"] for x in created_pods(plan)) == ["demo-trainer-3-0", "demo-trainer-3-1"]
    assert plan.status["attempt"] == 3 and plan.status["disruptions"] == 1


def test_evicted_while_restarting_is_no_second_disruption():
    wl = workload(*ADMITTED, EVICTED, admission=ADMISSION)
    job = queued_job(job_status=status(names.RESTARTING, attempt=2, restarts=1, disruptions=0))
    plan = reconcile(job, observe([pod(2, 0, "Failed", 1), pod(2, 1)], wl=wl), NOW)
    assert plan.status["disruptions"] == 0
    assert plan.status["attempt"] == 3
    assert "demo-trainer-2-1" in plan.delete_pods


# ------------------------------------------------------------------ suspend and the end


def test_suspend_deactivates_the_workload_and_resume_activates_it():
    job = queued_job({**SPEC, "suspend": True}, status(names.RUNNING))
    plan = reconcile(job, observe([pod(1, 0), pod(1, 1)], wl=workload(*ADMITTED, admission=ADMISSION)), NOW)
    (patch,) = [x for x in plan.patch if x["kind"] == "Workload"]
    assert patch["spec"] == {"active": False}
    assert plan.status["phase"] == names.SUSPENDED
    assert len(plan.delete_pods) == 2
    assert plan.status["queue"]["suspended"] is True  # the operator holds it inactive
    deactivated = workload(("Evicted", "True", "Deactivated", "deactivated"), active=False)
    resumed = reconcile(queued_job(SPEC, status(names.SUSPENDED, queue=plan.status["queue"])),
                        observe(wl=deactivated), NOW)
    (patch,) = [x for x in resumed.patch if x["kind"] == "Workload"]
    assert patch["spec"] == {"active": True}
    assert resumed.status["phase"] == names.PENDING and not created_pods(resumed)
    assert resumed.status["queue"]["suspended"] is True  # until it is seen active
    active = copy.deepcopy(deactivated)
    active["spec"]["active"] = True
    later = reconcile(queued_job(SPEC, status(names.PENDING, attempt=2, queue=resumed.status["queue"])),
                      observe(wl=active), NOW)
    assert not [x for x in later.patch if x["kind"] == "Workload"]
    assert "suspended" not in later.status["queue"]


def test_a_workload_kueue_deactivated_itself_stays_inactive():
    """An admission check rejected it, or its requeue limit was reached: Kueue's decision."""
    wl = workload(("Evicted", "True", "Deactivated", "The workload is deactivated due to exceeding the maximum "
                   "number of re-queuing retries"), active=False)
    plan = reconcile(queued_job(job_status=status(names.PENDING)), observe(wl=wl), NOW)
    assert not [x for x in plan.patch if x["kind"] == "Workload"]
    assert not created_pods(plan)
    assert "re-queuing retries" in plan.status["message"]


def test_a_finished_job_finishes_its_workload_once():
    wl = workload(*ADMITTED, admission=ADMISSION)
    job = queued_job(job_status=status(names.SUCCEEDED, completionTime=at(0)))
    plan = reconcile(job, observe([pod(1, 0, "Succeeded", 0), pod(1, 1, "Succeeded", 0)], wl=wl), NOW)
    finished = {x["type"]: x for x in plan.workload_status["status"]["conditions"]}[queueing.FINISHED]
    assert (finished["status"], finished["reason"]) == ("True", "Succeeded")
    done = merge_patch(wl, {"status": plan.workload_status["status"]})
    again = reconcile(job, observe([pod(1, 0, "Succeeded", 0), pod(1, 1, "Succeeded", 0)], wl=done), NOW)
    assert again.workload_status is None


def test_an_unchanged_workload_writes_nothing():
    wl = workload(*ADMITTED, (queueing.PODS_READY, "True", "PodsReady", "x"), admission=ADMISSION)
    job = queued_job(job_status=status(names.RUNNING))
    plan = reconcile(job, observe([pod(1, 0), pod(1, 1)], wl=wl, flavors={"h100": FLAVOR}), NOW)
    assert plan.workload_status is None
    assert not [x for x in plan.patch if x["kind"] == "Workload"]


def test_workload_status_keeps_transition_times_of_unchanged_conditions():
    wl = workload(*ADMITTED, EVICTED, admission=ADMISSION)
    patch = queueing.compute_workload_status(copy.deepcopy(wl), names.PENDING, False, NOW)
    by_type = {x["type"]: x for x in patch["status"]["conditions"]}
    assert by_type["Evicted"]["lastTransitionTime"] == at(-60)
    assert by_type["QuotaReserved"]["lastTransitionTime"] == at(0)


def test_once_its_admission_is_cleared_an_evicted_job_is_queued_again_with_kueues_words():
    wl = workload(("QuotaReserved", "False", "Pending", "Preempted to accommodate a workload"),
                  ("Admitted", "False", "NoReservation", "The workload has no reservation"), EVICTED)
    q = queueing.read_queue("team-a-queue", wl, {})
    assert (q.state, q.admitted) == ("Queued", False)
    assert "Preempted to accommodate" in q.message


# ------------------------------------------------------------------ what the review found


def test_a_gang_that_succeeded_is_done_even_if_evicted_after():
    wl = workload(*ADMITTED, EVICTED, admission=ADMISSION)
    job = queued_job(job_status=status(names.RUNNING))
    plan = reconcile(job, observe([pod(1, 0, "Succeeded", 0), pod(1, 1, "Succeeded", 0)], wl=wl), NOW)
    assert plan.status["phase"] == names.SUCCEEDED and plan.status["attempt"] == 1


def test_an_invalid_spec_still_finishes_the_workload_once_the_pods_are_gone():
    job = queued_job({**SPEC, "trainer": {**SPEC["trainer"], "nodes": 0}}, status(names.RUNNING))
    wl = workload(*ADMITTED, admission=ADMISSION)
    plan = reconcile(job, observe([pod(1, 0), pod(1, 1)], wl=wl), NOW)
    assert plan.status["phase"] == names.FAILED and len(plan.delete_pods) == 2
    assert plan.workload_status is None  # its pods still hold what Kueue counted
    gone = reconcile(queued_job(job["spec"], plan.status), observe(wl=wl), NOW)
    finished = {x["type"]: x for x in gone.workload_status["status"]["conditions"]}[queueing.FINISHED]
    assert (finished["status"], finished["reason"]) == ("True", "Failed")


def test_a_succeeded_job_finishes_its_workload_after_its_inference_pods():
    job = queued_job(LOOP, status(names.SUCCEEDED, completionTime=at(-5)))
    wl = workload(*ADMITTED, admission=ADMISSION)
    done = [pod(1, 0, "Succeeded", 0), pod(1, 1, "Succeeded", 0)]
    serving = rollout_pods(LOOP)
    assert reconcile(job, observe([*done, *serving], wl=wl), NOW).workload_status is None
    assert reconcile(job, observe(done, wl=wl), NOW).workload_status is not None


def test_with_its_label_removed_an_evicted_job_still_gives_the_quota_back():
    wl = workload(*ADMITTED, EVICTED, admission=ADMISSION)
    plan = reconcile(make_job(SPEC, status(names.PENDING, attempt=2)), observe(wl=wl), NOW)
    assert plan.workload_status["status"]["admission"] is None


def test_the_queue_name_follows_the_label_while_no_quota_is_held():
    wl = workload(PENDING)
    job = queued_job()
    job["metadata"]["labels"][queueing.LABEL_QUEUE_NAME] = "other-queue"
    (patch,) = [x for x in reconcile(job, observe(wl=wl), NOW).patch if x["kind"] == "Workload"]
    assert patch["spec"] == {"queueName": "other-queue"}
    admitted = workload(*ADMITTED, admission=ADMISSION)
    assert not [x for x in reconcile(job, observe(wl=admitted, flavors={"h100": FLAVOR}), NOW).patch
                if x["kind"] == "Workload"]


def test_a_queued_job_whose_pods_changed_gets_its_workload_made_again():
    wl = workload(PENDING)
    plan = reconcile(queued_job({**SPEC, "trainer": {**SPEC["trainer"], "nodes": 4, "batchSize": 64}}),
                     observe(wl=wl), NOW)
    assert [(x["kind"], x["metadata"]["name"]) for x in plan.delete] == [("Workload", "rftjob-demo")]
    assert not reconcile(queued_job(), observe(wl=wl), NOW).delete  # unchanged: kept


def test_an_admission_that_contradicts_the_jobs_node_selector_fails_the_job():
    spec = {**SPEC, "trainer": {**SPEC["trainer"], "nodeSelector": {"gpu.example.com/type": "a100"}}}
    w = queueing.build_workload(REF, parse_spec(spec), "team-a-queue", None)
    w["metadata"].update(resourceVersion="7", generation=1)
    w["status"] = workload(*ADMITTED, admission=ADMISSION)["status"]
    plan = reconcile(queued_job(spec, status(names.PENDING)), observe(wl=w, flavors={"h100": FLAVOR}), NOW)
    assert plan.status["phase"] == names.FAILED and not created_pods(plan)
    assert "gpu.example.com/type=h100" in plan.status["message"] and "a100" in plan.status["message"]


def test_a_flavor_not_read_yet_holds_the_pods():
    plan = reconcile(queued_job(job_status=status(names.PENDING)), observe(wl=workload(*ADMITTED, admission=ADMISSION)),
                     NOW)
    assert not created_pods(plan)
    assert "ResourceFlavor h100" in plan.status["message"]


def test_what_the_operator_may_not_read_holds_the_job_and_says_why():
    o = observe(wl=workload(PENDING))
    o.kueue_error = "the operator may not read Kueue's cluster-scoped objects (HTTP 403 Forbidden)"
    plan = reconcile(queued_job(), o, NOW)
    assert not created_pods(plan) and "HTTP 403" in plan.status["message"]
    assert cond(plan, names.COND_ADMITTED)["reason"] == "KueueForbidden"


def test_a_pod_that_outlives_its_grace_period_no_longer_holds_the_admission():
    wl = workload(*ADMITTED, EVICTED, admission=ADMISSION)
    job = queued_job(job_status=status(names.PENDING, attempt=3, disruptions=1))
    long_gone = pod(2, 0, deletion_deadline=NOW - timedelta(seconds=61), grace=30)
    plan = reconcile(job, observe([long_gone, pod(2, 1, "Failed", 143)], wl=wl), NOW)
    assert plan.workload_status["status"]["admission"] is None
    just_deleted = pod(2, 0, deletion_deadline=NOW + timedelta(seconds=20), grace=30)
    assert reconcile(job, observe([just_deleted], wl=wl), NOW).workload_status is None


def test_pods_ready_goes_false_while_the_gang_restarts():
    wl = workload(*ADMITTED, (queueing.PODS_READY, "True", "PodsReady", "x"), admission=ADMISSION)
    job = queued_job(job_status=status(names.RUNNING))
    plan = reconcile(job, observe([pod(1, 0, "Failed", 1), pod(1, 1)], wl=wl, flavors={"h100": FLAVOR}), NOW)
    assert plan.status["phase"] == names.RESTARTING
    ready = {x["type"]: x for x in plan.workload_status["status"]["conditions"]}[queueing.PODS_READY]
    assert (ready["status"], ready["reason"]) == ("False", "WaitForRecovery")
