"""The operator against a real control plane: kube-apiserver + etcd + controller-manager
(garbage collector) + scheduler, with KWOK running the pods on fake GPU nodes."""

from __future__ import annotations

import kubernetes
import pytest

from rft_contract import names
from rft_contract.times import parse_time

from .conftest import wait_for
from .operator_fixtures import (
    create_job, end_pod, events, gang_ranks, get_job, hold_pod, job_manifest, patch_spec, patch_status,
    pod_deleting, pods, refusing_trainer_pods, release_pod, wait_phase, wait_status,
)

pytestmark = pytest.mark.integration


def running_pods(api, ns, job, attempt):
    return [p for p in pods(api, ns, job)
            if p.metadata.labels.get(names.LABEL_ATTEMPT) == str(attempt)
            and p.status.phase == "Running" and not p.metadata.deletion_timestamp]


def start_running(api, ns, name, **overrides) -> dict:
    create_job(api, ns, job_manifest(name, **overrides))
    return wait_phase(api, ns, name, names.RUNNING, 90)


def test_create_runs_the_gang_on_gpu_nodes(operator, api, namespace, kubectl):
    status = start_running(api, namespace, "gang")
    assert status["attempt"] == 1 and status["restarts"] == 0
    assert status["observedGeneration"] == 1
    running = {x["type"]: x for x in status["conditions"]}[names.COND_RUNNING]
    assert running["status"] == "True" and running["observedGeneration"] == 1
    trainer_pods = pods(api, namespace, "gang")
    assert sorted(p.metadata.name for p in trainer_pods) == ["gang-trainer-1-0", "gang-trainer-1-1"]
    for p in trainer_pods:
        assert p.spec.node_name.startswith("kwok-gpu-"), p.spec.node_name  # the real scheduler placed it
        assert p.spec.containers[0].resources.limits["nvidia.com/gpu"] == "8"
        assert p.metadata.owner_references[0].kind == "RFTJob"
    # Two 8-GPU pods cannot share an 8-GPU node.
    assert len({p.spec.node_name for p in trainer_pods}) == 2

    core, rbac = kubernetes.client.CoreV1Api(api), kubernetes.client.RbacAuthorizationV1Api(api)
    svc = core.read_namespaced_service("gang-trainer", namespace)
    assert svc.spec.cluster_ip == "None" and svc.spec.publish_not_ready_addresses
    core.read_namespaced_config_map("gang-config", namespace)
    core.read_namespaced_service_account("gang-rft-trainer", namespace)
    rbac.read_namespaced_role("gang-status-writer", namespace)
    rbac.read_namespaced_role_binding("gang-status-writer", namespace)
    # Event timestamps have one-second resolution, so only membership is checked.
    assert {names.REASON_CREATED, names.REASON_ALL_RUNNING} <= set(events(api, namespace, "gang"))

    out = kubectl("get", "rftjobs", "-n", namespace).stdout
    header, row = out.splitlines()[0].split(), out.splitlines()[1].split()
    assert header == ["NAME", "PHASE", "STEP", "CHECKPOINT", "WEIGHTS", "SYNCED", "EVAL", "QUEUE", "AGE"]
    assert row[:3] == ["gang", "Running", "0/100"]
    assert "gang" in kubectl("get", "rft", "-n", namespace).stdout  # short name
    assert "gang" in kubectl("get", "rft", "-n", namespace, "-o", "name").stdout


def test_pod_failure_restarts_the_gang_as_attempt_2(operator, api, namespace):
    start_running(api, namespace, "retry")
    end_pod(api, namespace, "retry-trainer-1-1", 1)
    status = wait_phase(api, namespace, "retry", names.RUNNING, 90, attempt=2)
    assert status["restarts"] == 1
    assert status["lastFailure"]["pod"] == "retry-trainer-1-1"
    assert status["lastFailure"]["exitCode"] == 1
    assert len(running_pods(api, namespace, "retry", 2)) == 2
    # Nothing of attempt 1 still runs; the failed pod is kept for its logs.
    old = {p.metadata.name: p.status.phase for p in pods(api, namespace, "retry")
           if p.metadata.labels[names.LABEL_ATTEMPT] == "1"}
    assert old == {"retry-trainer-1-1": "Failed"}
    # The Event is its own write, after the status: wait for it (read once, it raced under load).
    wait_for(lambda: names.REASON_RESTARTING in events(api, namespace, "retry"), 30, "the Restarting event")


def test_the_attempt_history_tells_where_each_attempt_started_and_ended(operator, api, namespace):
    """What the person on call reads in `kubectl get rftjob -o yaml`: attempt 1 from step 0
    to the step it last reported, ended by the pod failure; attempt 2 from the checkpoint
    its trainer says it resumed from (and an event saying so)."""
    start_running(api, namespace, "story")
    patch_status(api, namespace, "story", {"trainer": {
        "attempt": 1, "step": 7, "resumedFrom": {"attempt": 1, "step": 0, "checkpoint": None}}})
    wait_status(api, namespace, "story", lambda s: (s.get("attempts") or [{}])[0].get("startStep") == 0, 60,
                "attempt 1's start recorded")
    end_pod(api, namespace, "story-trainer-1-0", 1)
    wait_phase(api, namespace, "story", names.RUNNING, 90, attempt=2)
    ckpt = "s3://ckpts/run/ckpt/step-00000005"
    patch_status(api, namespace, "story", {"trainer": {
        "attempt": 2, "step": 5, "resumedFrom": {"attempt": 2, "step": 5, "checkpoint": ckpt}}})
    s = wait_status(api, namespace, "story", lambda s: len(s.get("attempts") or []) == 2
                    and s["attempts"][1].get("startStep") == 5, 60, "attempt 2's start recorded")
    first, second = s["attempts"]
    assert (first["startStep"], first["endStep"], first["reason"]) == (0, 7, s["lastFailure"]["reason"])
    assert first["ended"] == s["lastFailure"]["time"]
    assert second == {"attempt": 2, "startStep": 5, "checkpoint": ckpt}
    wait_for(lambda: "ResumedFromCheckpoint" in events(api, namespace, "story"), 30, "the resume event")


def test_fatal_exit_code_fails_the_job(operator, api, namespace):
    start_running(api, namespace, "fatal")
    end_pod(api, namespace, "fatal-trainer-1-0", 78)
    status = wait_phase(api, namespace, "fatal", names.FAILED, 60)
    assert status["restarts"] == 0 and status["completionTime"]
    failed = {x["type"]: x for x in status["conditions"]}[names.COND_FAILED]
    assert failed["status"] == "True" and failed["reason"] == names.REASON_FATAL_EXIT
    assert "exit code 78" in failed["message"]
    wait_for(lambda: not running_pods(api, namespace, "fatal", 1), 60, "the rest of the gang to stop")


def test_restart_budget_exhausted_fails_the_job(operator, api, namespace):
    start_running(api, namespace, "budget", failurePolicy={"maxRestarts": 1, "backoffSeconds": 0})
    end_pod(api, namespace, "budget-trainer-1-0", 1)
    wait_phase(api, namespace, "budget", names.RUNNING, 90, attempt=2)
    end_pod(api, namespace, "budget-trainer-2-0", 1)
    status = wait_phase(api, namespace, "budget", names.FAILED, 60)
    assert status["restarts"] == 1 and status["attempt"] == 2
    assert "maxRestarts=1" in status["message"]
    failed = {x["type"]: x for x in status["conditions"]}[names.COND_FAILED]
    assert failed["reason"] == names.REASON_BACKOFF_LIMIT


def test_all_pods_succeeding_completes_the_job(operator, api, namespace):
    start_running(api, namespace, "done")
    end_pod(api, namespace, "done-trainer-1-0", 0)
    end_pod(api, namespace, "done-trainer-1-1", 0)
    status = wait_phase(api, namespace, "done", names.SUCCEEDED, 60)
    assert status["completionTime"] >= status["startTime"]
    wait_for(lambda: names.REASON_SUCCEEDED in events(api, namespace, "done"), 30, "the Succeeded event")


def test_suspend_and_resume(operator, api, namespace):
    start_running(api, namespace, "pause")
    patch_spec(api, namespace, "pause", {"suspend": True})
    status = wait_phase(api, namespace, "pause", names.SUSPENDED, 60)
    assert {x["type"]: x for x in status["conditions"]}[names.COND_SUSPENDED]["status"] == "True"
    wait_for(lambda: not pods(api, namespace, "pause"), 60, "suspended pods to be deleted")
    kubernetes.client.CoreV1Api(api).read_namespaced_config_map("pause-config", namespace)  # kept
    patch_spec(api, namespace, "pause", {"suspend": False})
    status = wait_phase(api, namespace, "pause", names.RUNNING, 90, attempt=2)
    assert status["restarts"] == 0  # a resume is not a failure
    assert len(running_pods(api, namespace, "pause", 2)) == 2
    assert {x["type"]: x for x in status["conditions"]}[names.COND_SUSPENDED]["status"] == "False"


def test_deleting_the_job_garbage_collects_children(operator, api, namespace):
    start_running(api, namespace, "gc")
    kubernetes.client.CustomObjectsApi(api).delete_namespaced_custom_object(
        names.GROUP, names.VERSION, namespace, names.PLURAL, "gc")
    core = kubernetes.client.CoreV1Api(api)
    rbac = kubernetes.client.RbacAuthorizationV1Api(api)
    sel = f"{names.LABEL_JOB}=gc"

    def all_gone():
        return not any([
            core.list_namespaced_pod(namespace, label_selector=sel).items,
            core.list_namespaced_service(namespace, label_selector=sel).items,
            core.list_namespaced_config_map(namespace, label_selector=sel).items,
            core.list_namespaced_service_account(namespace, label_selector=sel).items,
            rbac.list_namespaced_role(namespace, label_selector=sel).items,
            rbac.list_namespaced_role_binding(namespace, label_selector=sel).items,
        ])

    wait_for(all_gone, 90, "the garbage collector to remove every child")


def test_children_deleted_by_hand_are_repaired(operator, api, namespace):
    start_running(api, namespace, "repair")
    core = kubernetes.client.CoreV1Api(api)
    core.delete_namespaced_config_map("repair-config", namespace)
    core.delete_namespaced_service("repair-trainer", namespace)
    wait_for(lambda: core.read_namespaced_config_map("repair-config", namespace), 60, "ConfigMap back")
    wait_for(lambda: core.read_namespaced_service("repair-trainer", namespace), 60, "Service back")
    # A trainer pod deleted by hand breaks the gang: the attempt ends and a new one starts.
    core.delete_namespaced_pod("repair-trainer-1-0", namespace)
    status = wait_phase(api, namespace, "repair", names.RUNNING, 90, attempt=2)
    assert status["lastFailure"]["reason"] == names.REASON_POD_DELETED


def test_operator_killed_while_restarting_and_while_creating_the_gang_counts_one_restart(
        operator, api, namespace):
    """SIGKILL the operator in the two windows where a restart is half done: after it
    recorded `Restarting` while the old gang is still going away, and after it created only
    part of the next gang. Each window is held open on purpose (a finalizer on an old pod,
    then an admission policy refusing rank 1 of attempt 2), so the kills land in them every
    time. Afterwards exactly one gang of attempt 2 exists (counted by labels, not names) and
    restarts and attempt each moved by exactly one."""
    start_running(api, namespace, "crash", failurePolicy={"backoffSeconds": 0})
    hold_pod(api, namespace, "crash-trainer-1-0")
    try:
        end_pod(api, namespace, "crash-trainer-1-1", 1)
        wait_status(api, namespace, "crash", lambda s: s.get("phase") == names.RESTARTING
                    and pod_deleting(api, namespace, "crash-trainer-1-0"), 60, "Restarting, old gang going")

        # Window 1: Restarting recorded, the old rank 0 still terminating.
        operator.kill()
        since = operator.log_offset()
        operator.start()
        operator.wait_logged(f"{namespace}/crash: 2 pods seen, phase Restarting -> Restarting,", since)
        status = get_job(api, namespace, "crash")["status"]
        assert (status["phase"], status["restarts"], status["attempt"]) == (names.RESTARTING, 1, 1)

        # Window 2: attempt 2's rank 0 created, rank 1 refused by the API server.
        with refusing_trainer_pods(api, namespace, attempt=2, ranks_from=1):
            release_pod(api, namespace, "crash-trainer-1-0")
            wait_for(lambda: "CreateFailed" in events(api, namespace, "crash"), 60, "rank 1 of attempt 2 refused")
            # The ranks are created side by side: rank 0's create may end after rank 1's refusal.
            wait_for(lambda: gang_ranks(api, namespace, "crash") == {1: [1], 2: [0]}, 60, "rank 0 of attempt 2")
            operator.kill()
        operator.start()
    finally:
        release_pod(api, namespace, "crash-trainer-1-0")

    status = wait_phase(api, namespace, "crash", names.RUNNING, 90, attempt=2)
    assert status["restarts"] == 1
    assert gang_ranks(api, namespace, "crash") == {1: [1], 2: [0, 1]}  # the failed pod stays for its logs
    assert len(running_pods(api, namespace, "crash", 2)) == 2
    reasons = events(api, namespace, "crash")
    assert reasons.count(names.REASON_RESTARTING) == 1 and reasons.count(names.REASON_RESTARTED) == 1


def test_progress_deadline_restarts_a_gang_that_never_steps(operator, api, namespace):
    """KWOK trainers never report a step: 5 s after the gang runs, the operator restarts it,
    on its own clock (no event comes), saying why from the trainer's report."""
    deadline = 5
    status = start_running(api, namespace, "stall", failurePolicy={
        "progressDeadlineSeconds": deadline, "backoffSeconds": 10, "maxRestarts": 3})
    # Act as the trainer's rank 0, which reports why it cannot step.
    waiting = {"reason": names.WAIT_DATA, "since": status["startTime"], "message": "no shard in the buffer"}
    patch_status(api, namespace, "stall", {"trainer": {"waiting": waiting, "buffer": {"droppedStale": 12}}})

    status = wait_status(api, namespace, "stall", lambda s: s.get("restarts") == 1, 60, "the deadline's restart")
    failure = status["lastFailure"]
    assert (failure["reason"], failure["attempt"]) == (names.REASON_PROGRESS_DEADLINE, 1)
    assert f"(spec.failurePolicy.progressDeadlineSeconds={deadline})" in failure["message"]
    assert "trainer waiting for experiences for" in failure["message"]
    assert "(12 stale dropped): no shard in the buffer" in failure["message"]
    # The operator woke up by itself at the deadline, not at the next 10 s resync (both
    # times are whole seconds, rounded down).
    since = parse_time(status["progress"]["since"])
    assert deadline <= (parse_time(failure["time"]) - since).total_seconds() <= deadline + 2, status["progress"]
    progressing = {x["type"]: x for x in status["conditions"]}[names.COND_PROGRESSING]
    assert (progressing["status"], progressing["reason"]) == ("False", names.REASON_PROGRESS_DEADLINE)
    assert progressing["message"] == failure["message"]
    wait_for(lambda: names.REASON_PROGRESS_DEADLINE in events(api, namespace, "stall"), 30, "the deadline's event")

    # Turn the deadline off during the backoff: attempt 2 then runs and stays.
    patch_spec(api, namespace, "stall", {"failurePolicy": {"progressDeadlineSeconds": 0}})
    status = wait_phase(api, namespace, "stall", names.RUNNING, 90, attempt=2)
    assert status["restarts"] == 1
    assert gang_ranks(api, namespace, "stall") == {2: [0, 1]}  # KWOK removed the deleted attempt 1
    assert len(running_pods(api, namespace, "stall", 2)) == 2
    progressing = {x["type"]: x for x in status["conditions"]}[names.COND_PROGRESSING]
    assert (progressing["status"], progressing["reason"]) == ("True", names.REASON_STEPPING)


def test_spec_change_updates_config_for_the_next_attempt(operator, api, namespace):
    start_running(api, namespace, "edit")
    patch_spec(api, namespace, "edit", {"trainer": {"totalSteps": 500}})
    core = kubernetes.client.CoreV1Api(api)
    wait_for(lambda: '"total_steps": 500' in core.read_namespaced_config_map("edit-config", namespace).data["config.json"],
             60, "ConfigMap to carry the new totalSteps")
    status = wait_status(api, namespace, "edit", lambda s: s.get("observedGeneration") == 2, 60)
    assert status["phase"] == names.RUNNING and status["attempt"] == 1
