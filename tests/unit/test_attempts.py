"""The attempt history on its own (rft_operator.attempts): where each attempt started and
ended and why, and the event when a trainer says where it resumed from."""

from __future__ import annotations

from rft_contract import names
from rft_operator.attempts import KEEP, REASON_RESUMED_FROM, compute_attempts

from .testing import NOW

CKPT = "s3://ckpts/run/ckpt/step-00000005"


def failure(attempt: int, reason: str = names.REASON_POD_FAILED) -> dict:
    return {"attempt": attempt, "reason": reason, "message": "m", "time": "2026-12-03T10:00:00Z"}


def test_an_attempt_is_recorded_from_its_start_to_its_failure():
    got = compute_attempts(None, {"attempt": 1, "phase": names.PENDING}, {}, NOW)
    assert got.records == [{"attempt": 1}] and got.events == ()
    trainer = {"resumedFrom": {"attempt": 1, "step": 0, "checkpoint": None}}
    got = compute_attempts(got.records, {"attempt": 1, "phase": names.RUNNING}, trainer, NOW)
    assert got.records == [{"attempt": 1, "startStep": 0}]  # no None: stored, a null would vanish
    assert got.events == ()  # a first attempt from scratch is not news
    assert compute_attempts(got.records, {"attempt": 1, "phase": names.RUNNING}, trainer, NOW).records is None
    ended = compute_attempts(got.records, {"attempt": 1, "phase": names.RESTARTING, "lastFailure": failure(1)},
                             {**trainer, "step": 7, "attempt": 1}, NOW)
    assert ended.records == [{"attempt": 1, "startStep": 0, "endStep": 7,
                              "reason": names.REASON_POD_FAILED, "ended": "2026-12-03T10:00:00Z"}]


def test_the_next_attempt_says_where_it_resumed():
    first = [{"attempt": 1, "startStep": 0, "endStep": 7, "reason": names.REASON_POD_FAILED, "ended": "t"}]
    status = {"attempt": 2, "phase": names.RUNNING, "lastFailure": failure(1)}
    # Its trainer has not reported yet: the last step is attempt 1's.
    got = compute_attempts(first, status, {"step": 7, "attempt": 1}, NOW)
    assert got.records == [*first, {"attempt": 2}] and got.events == ()
    trainer = {"step": 5, "attempt": 2, "resumedFrom": {"attempt": 2, "step": 5, "checkpoint": CKPT}}
    got = compute_attempts(got.records, status, trainer, NOW)
    assert got.records[-1] == {"attempt": 2, "startStep": 5, "checkpoint": CKPT}
    assert [(e.type, e.reason, e.message) for e in got.events] == [
        ("Normal", REASON_RESUMED_FROM, f"attempt 2 resumed from step 5 ({CKPT})")]
    assert compute_attempts(got.records, status, trainer, NOW).events == ()  # once
    done = compute_attempts(got.records, {**status, "phase": names.SUCCEEDED, "completionTime": "t2"},
                            {**trainer, "step": 20}, NOW)
    assert done.records[-1] == {"attempt": 2, "startStep": 5, "checkpoint": CKPT, "endStep": 20,
                                "reason": names.SUCCEEDED, "ended": "t2"}
    assert done.records[0] == first[0]  # earlier attempts never change


def test_a_restart_without_a_checkpoint_is_a_warning():
    old = [{"attempt": 1, "startStep": 0, "endStep": 3, "reason": names.REASON_POD_FAILED, "ended": "t"}]
    trainer = {"resumedFrom": {"attempt": 2, "step": 0, "checkpoint": None}}
    got = compute_attempts(old, {"attempt": 2, "phase": names.RUNNING, "lastFailure": failure(1)}, trainer, NOW)
    assert [(e.type, e.message) for e in got.events] == [
        ("Warning", "attempt 2 started from step 0: no checkpoint to resume from")]


def test_suspension_and_failures_not_of_a_pod_end_an_attempt():
    got = compute_attempts([{"attempt": 1, "startStep": 0}], {"attempt": 1, "phase": names.SUSPENDED},
                           {"step": 4, "attempt": 1}, NOW)
    assert (got.records[0]["reason"], got.records[0]["endStep"]) == (names.SUSPENDED, 4)
    got = compute_attempts([{"attempt": 1}], {"attempt": 1, "phase": names.FAILED, "completionTime": "t"}, {}, NOW,
                           failed_reason=names.REASON_INVALID_SPEC)
    assert got.records == [{"attempt": 1, "reason": names.REASON_INVALID_SPEC, "ended": "t"}]


def test_only_the_last_few_attempts_are_kept():
    old = [{"attempt": n, "startStep": 0, "endStep": 1, "reason": names.REASON_POD_FAILED, "ended": "t"}
           for n in range(1, KEEP + 1)]
    got = compute_attempts(old, {"attempt": KEEP + 1, "phase": names.PENDING}, {}, NOW)
    assert [r["attempt"] for r in got.records] == list(range(2, KEEP + 2))


def test_an_attempt_whose_end_was_missed_says_unknown():
    got = compute_attempts([{"attempt": 1, "startStep": 0}], {"attempt": 2, "phase": names.PENDING}, {}, NOW)
    assert got.records[0]["reason"] == "Unknown" and got.records[1] == {"attempt": 2}


def test_no_attempt_yet_no_history():
    assert compute_attempts(None, {"attempt": 0}, {}, NOW).records is None


def test_a_record_as_stored_is_unchanged_on_the_next_pass():
    """Nothing None in a record: the API server drops nulls, and a record that differs from
    its stored self would cost a status write on every pass."""
    trainer = {"step": 3, "attempt": 2, "resumedFrom": {"attempt": 2, "step": 0, "checkpoint": None}}
    status = {"attempt": 2, "phase": names.RUNNING}
    got = compute_attempts([], status, trainer, NOW)
    assert all(v is not None for r in got.records for v in r.values())
    assert compute_attempts(got.records, status, trainer, NOW).records is None
