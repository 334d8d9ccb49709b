"""The conditions concern on its own: phase, failure reason, checkpoint, WeightsSynced -> conditions."""

from datetime import timedelta

import pytest

from rft_contract import names
from rft_contract import times
from rft_operator import conditions
from rft_operator.conditions import Cond

from .testing import NOW

PHASE_TYPES = (names.COND_RUNNING, names.COND_SUSPENDED, names.COND_SUCCEEDED, names.COND_FAILED)


@pytest.mark.parametrize("phase, true_type, reasons", [
    # reasons in PHASE_TYPES order
    (None, None, (names.PENDING, names.REASON_NOT_SUSPENDED, names.PENDING, names.PENDING)),
    (names.PENDING, None, (names.PENDING, names.REASON_NOT_SUSPENDED, names.PENDING, names.PENDING)),
    (names.RUNNING, names.COND_RUNNING, (names.RUNNING, names.REASON_NOT_SUSPENDED, names.RUNNING, names.RUNNING)),
    (names.RESTARTING, None, (names.RESTARTING, names.REASON_NOT_SUSPENDED, names.RESTARTING, names.RESTARTING)),
    (names.SUSPENDED, names.COND_SUSPENDED, (names.SUSPENDED, names.REASON_SUSPENDED, names.SUSPENDED, names.SUSPENDED)),
    (names.SUCCEEDED, names.COND_SUCCEEDED, (names.SUCCEEDED, names.REASON_NOT_SUSPENDED, names.SUCCEEDED, names.SUCCEEDED)),
    (names.FAILED, names.COND_FAILED, (names.FAILED, names.REASON_NOT_SUSPENDED, names.FAILED, "WhyItFailed")),
])
def test_build_phase_conditions(phase, true_type, reasons):
    conds = conditions.build_phase_conditions(phase, "the message", "WhyItFailed")
    assert tuple(x.type for x in conds) == PHASE_TYPES
    assert [x.type for x in conds if x.status] == ([true_type] if true_type else [])
    assert tuple(x.reason for x in conds) == reasons
    # Running always explains itself; the others only while True.
    assert {x.type for x in conds if x.message} == {names.COND_RUNNING} | ({true_type} if true_type else set())


@pytest.mark.parametrize("checkpoint, status, reason, message", [
    ({}, False, names.REASON_NO_CHECKPOINT, "no checkpoint committed yet"),
    ({"step": None, "uri": "s3://x"}, False, names.REASON_NO_CHECKPOINT, "no checkpoint committed yet"),
    ({"step": 0, "uri": "s3://c/ckpt/step-00000000"}, True, names.REASON_CHECKPOINT_SAVED, "step 0 at s3://c/ckpt/step-00000000"),
    ({"step": 5}, True, names.REASON_CHECKPOINT_SAVED, "step 5 at None"),
])
def test_build_checkpointed(checkpoint, status, reason, message):
    assert conditions.build_checkpointed(checkpoint) == Cond(names.COND_CHECKPOINTED, status, reason, message)


def failed(status, reason):
    return {"type": names.COND_FAILED, "status": status, "reason": reason}


@pytest.mark.parametrize("old, want", [
    (None, names.FAILED),
    ([], names.FAILED),
    ([failed("True", names.REASON_FATAL_EXIT)], names.REASON_FATAL_EXIT),
    ([failed("False", names.REASON_FATAL_EXIT)], names.FAILED),  # not failed then: no reason to keep
    ([{"type": names.COND_RUNNING, "status": "True", "reason": "X"}], names.FAILED),
])
def test_compute_failed_reason(old, want):
    assert conditions.compute_failed_reason(old) == want


@pytest.mark.parametrize("old, this_pass, want", [
    ([failed("True", names.REASON_FATAL_EXIT)], None, names.REASON_FATAL_EXIT),            # kept across passes
    ([failed("True", names.REASON_FATAL_EXIT)], names.REASON_INVALID_SPEC, names.REASON_INVALID_SPEC),  # this pass wins
    (None, names.REASON_BACKOFF_LIMIT, names.REASON_BACKOFF_LIMIT),
])
def test_failed_reason_precedence(old, this_pass, want):
    out = conditions.compute_job_conditions(old, {"phase": names.FAILED, "message": "m"}, this_pass, {}, None, 1, NOW)
    assert next(x for x in out if x["type"] == names.COND_FAILED)["reason"] == want


KSTATUS_TYPES = (names.COND_READY, names.COND_RECONCILING, names.COND_STALLED)


@pytest.mark.parametrize("sync_cond, want_types", [
    (None, sorted(PHASE_TYPES + KSTATUS_TYPES + (names.COND_CHECKPOINTED, names.COND_PROGRESSING))),
    (Cond(names.COND_WEIGHTS_SYNCED, True, names.REASON_SYNCED),
     sorted(PHASE_TYPES + KSTATUS_TYPES + (names.COND_CHECKPOINTED, names.COND_PROGRESSING, names.COND_WEIGHTS_SYNCED))),
])
def test_compute_job_conditions_writes_every_managed_type(sync_cond, want_types):
    out = conditions.compute_job_conditions(None, {"phase": names.RUNNING, "message": "m"}, None,
                                            {"lastCheckpoint": {"step": 1}}, sync_cond, 3, NOW)
    assert [x["type"] for x in out] == want_types
    assert all(x["observedGeneration"] == 3 for x in out)
    assert {x["type"] for x in out if x["status"] == "True"} == (
        {names.COND_RUNNING, names.COND_CHECKPOINTED, names.COND_PROGRESSING, names.COND_READY}
        | ({names.COND_WEIGHTS_SYNCED} if sync_cond else set()))


SYNCING = Cond(names.COND_WEIGHTS_SYNCED, False, "Syncing", "0/2 replicas serve version 3")


@pytest.mark.parametrize("phase, sync_cond, ready, reconciling, stalled, reason", [
    (None, None, False, True, False, names.PENDING),
    (names.PENDING, None, False, True, False, names.PENDING),
    (names.RESTARTING, None, False, True, False, names.RESTARTING),
    (names.RUNNING, None, True, False, False, names.RUNNING),  # no inference: nothing to wait for
    (names.RUNNING, Cond(names.COND_WEIGHTS_SYNCED, True, names.REASON_SYNCED), True, False, False, names.RUNNING),
    (names.RUNNING, SYNCING, False, True, False, "Syncing"),
    # Inference scaled to 0 (as Argo CD's check): no replica to wait for.
    (names.RUNNING, Cond(names.COND_WEIGHTS_SYNCED, False, names.REASON_NO_REPLICAS, "spec.inference.replicas is 0"),
     True, False, False, names.RUNNING),
    (names.SUSPENDED, None, True, False, False, names.SUSPENDED),
    (names.SUCCEEDED, SYNCING, True, False, False, names.SUCCEEDED),
    (names.FAILED, None, False, False, True, "WhyItFailed"),
])
def test_kstatus_conditions(phase, sync_cond, ready, reconciling, stalled, reason):
    """What kstatus computes from them: Stalled -> Failed, Reconciling -> InProgress, Ready
    False -> InProgress, Ready True -> Current."""
    got = {x.type: x for x in conditions.build_kstatus(phase, "the message", "WhyItFailed", sync_cond)}
    assert (got[names.COND_READY].status, got[names.COND_RECONCILING].status, got[names.COND_STALLED].status) == (
        ready, reconciling, stalled)
    abnormal = [x for x in got.values() if x.status and x.type != names.COND_READY] or [got[names.COND_READY]]
    assert abnormal[0].reason == reason
    if stalled:
        assert got[names.COND_STALLED].message == "the message"


PD = names.REASON_PROGRESS_DEADLINE
PD_FAILURE = {"attempt": 1, "reason": PD, "message": "step 4 has not moved for 61s", "time": "t"}
POD_FAILURE = {**PD_FAILURE, "reason": names.REASON_POD_FAILED, "message": "pod failed"}
PROGRESS = {"step": 4, "attempt": 1, "since": "2026-11-30T11:59:00Z"}


@pytest.mark.parametrize("gang_status, failed_reason, deadline, want", [
    ({"phase": names.RUNNING, "attempt": 1, "progress": PROGRESS}, names.FAILED, 60,
     (True, names.REASON_STEPPING, "step 4 of attempt 1 reported at 2026-11-30T11:59:00Z; restarted after 60s")),
    ({"phase": names.RUNNING, "attempt": 2, "progress": {"step": None, "attempt": 2, "since": "T"}}, names.FAILED, 60,
     (True, names.REASON_STEPPING, "attempt 2: no step reported since T")),
    ({"phase": names.RUNNING, "attempt": 1, "progress": PROGRESS}, names.FAILED, 0,
     (True, names.REASON_STEPPING, "no progress deadline")),
    ({"phase": names.PENDING, "attempt": 1}, names.FAILED, 60, (False, names.PENDING, "")),
    (None, names.FAILED, 60, (False, names.PENDING, "")),
    ({"phase": names.SUSPENDED, "attempt": 1}, names.FAILED, 60, (False, names.SUSPENDED, "")),
    ({"phase": names.SUCCEEDED, "attempt": 1}, names.FAILED, 60, (False, names.SUCCEEDED, "")),
    # The deadline's failure stays the reason while the gang restarts and the next one starts...
    ({"phase": names.RESTARTING, "attempt": 1, "lastFailure": PD_FAILURE}, names.FAILED, 60, (False, PD, "has not moved")),
    ({"phase": names.PENDING, "attempt": 2, "lastFailure": PD_FAILURE}, names.FAILED, 60, (False, PD, "has not moved")),
    ({"phase": names.FAILED, "attempt": 1, "lastFailure": PD_FAILURE}, PD, 60, (False, PD, "has not moved")),
    # ... but not for other failures, nor once the job failed of something else.
    ({"phase": names.RESTARTING, "attempt": 1, "lastFailure": POD_FAILURE}, names.FAILED, 60, (False, names.RESTARTING, "")),
    ({"phase": names.PENDING, "attempt": 3, "lastFailure": PD_FAILURE}, names.FAILED, 60, (False, names.PENDING, "")),
    ({"phase": names.FAILED, "attempt": 1, "lastFailure": PD_FAILURE}, names.REASON_INVALID_SPEC, 60, (False, names.FAILED, "")),
])
def test_build_progressing(gang_status, failed_reason, deadline, want):
    got = conditions.build_progressing(gang_status or {}, failed_reason, deadline)
    assert got.type == names.COND_PROGRESSING
    assert (got.status, got.reason) == want[:2]
    assert want[2] in got.message and (want[2] or not got.message)


def test_conditions_transition_time_moves_only_on_flip():
    first = conditions.compute_conditions(None, [Cond("Running", False, "Pending", "wait")], 1, NOW)
    later = NOW + timedelta(minutes=5)
    same = conditions.compute_conditions(first, [Cond("Running", False, "Pending", "still")], 2, later)
    flipped = conditions.compute_conditions(same, [Cond("Running", True, "AllPodsRunning")], 2, later)
    assert same[0]["lastTransitionTime"] == first[0]["lastTransitionTime"]
    assert same[0]["message"] == "still" and same[0]["observedGeneration"] == 2
    assert flipped[0]["lastTransitionTime"] == times.format_time(later)
    assert flipped[0]["status"] == "True"


def test_conditions_keep_foreign_types():
    old = [{"type": "Checkpointed", "status": "True", "reason": "Saved", "message": "", "lastTransitionTime": "x"}]
    out = conditions.compute_conditions(old, [Cond("Running", True, "AllPodsRunning")], 1, NOW)
    assert {x["type"] for x in out} == {"Checkpointed", "Running"}
