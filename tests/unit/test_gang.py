"""The gang concern on its own: (spec, stored status, trainer pods, now) -> Gang."""

from datetime import timedelta

import pytest

from rft_contract import names
from rft_contract.spec import parse_spec
from rft_operator import gang

from .testing import NOW, REF, SPEC, last_failure, pod, status

FAILED_AT = last_failure()


# id, spec overrides (None: invalid spec), stored status, pods, seconds after NOW,
# expected: phase, attempt, restarts, created pod names, deleted pod names, event reasons, requeue_after
CASES = [
    ("new-job", {}, {}, [], 0,
     (names.PENDING, 1, 0, ["demo-trainer-1-0", "demo-trainer-1-1"], [], [names.REASON_CREATED], None)),
    ("invalid-spec", None, status(names.RUNNING), [pod(1, 0), pod(1, 1, deleting=True)], 0,
     (names.FAILED, 1, 0, [], ["demo-trainer-1-0"], [names.REASON_INVALID_SPEC], None)),
    ("terminal-stops-live-pods", {}, status(names.SUCCEEDED), [pod(1, 0), pod(1, 1, "Succeeded")], 0,
     (names.SUCCEEDED, 1, 0, [], ["demo-trainer-1-0"], [], None)),
    ("suspend", {"suspend": True}, status(names.RUNNING), [pod(1, 0), pod(1, 1)], 0,
     (names.SUSPENDED, 1, 0, [], ["demo-trainer-1-0", "demo-trainer-1-1"], [names.REASON_SUSPENDED], None)),
    ("created-suspended-stays-at-attempt-0", {"suspend": True}, {}, [], 0,
     (names.SUSPENDED, 0, 0, [], [], [names.REASON_SUSPENDED], None)),
    ("resume", {}, status(names.SUSPENDED), [], 0,
     (names.PENDING, 2, 0, ["demo-trainer-2-0", "demo-trainer-2-1"], [], [names.REASON_RESUMED], None)),
    # A running gang comes back when its progress deadline (1800 s by default) would pass.
    ("all-running", {}, status(names.PENDING), [pod(1, 0), pod(1, 1)], 0,
     (names.RUNNING, 1, 0, [], [], [names.REASON_ALL_RUNNING], 1800.0)),
    ("running-steady-no-event", {}, status(names.RUNNING), [pod(1, 0), pod(1, 1)], 0,
     (names.RUNNING, 1, 0, [], [], [], 1800.0)),
    ("partial-gang-fills-gaps", {}, status(names.PENDING), [pod(1, 1, "Pending")], 0,
     (names.PENDING, 1, 0, ["demo-trainer-1-0"], [], [], None)),
    ("all-succeeded", {}, status(names.RUNNING), [pod(1, 0, "Succeeded"), pod(1, 1, "Succeeded")], 0,
     (names.SUCCEEDED, 1, 0, [], [], [names.REASON_SUCCEEDED], None)),
    ("retryable-failure-restarts", {}, status(names.RUNNING), [pod(1, 0), pod(1, 1, "Failed", 1)], 0,
     (names.RESTARTING, 1, 1, [], ["demo-trainer-1-0"], [names.REASON_RESTARTING], 30.0)),
    ("fatal-exit-fails", {}, status(names.RUNNING), [pod(1, 0), pod(1, 1, "Failed", 78)], 0,
     (names.FAILED, 1, 0, [], ["demo-trainer-1-0"], [names.REASON_FATAL_EXIT], None)),
    ("budget-spent-fails", {}, status(names.RUNNING, 3, 2), [pod(3, 0, "Failed", 1), pod(3, 1)], 0,
     (names.FAILED, 3, 2, [], ["demo-trainer-3-1"], [names.REASON_BACKOFF_LIMIT], None)),
    ("vanished-pod-while-running", {}, status(names.RUNNING), [pod(1, 0)], 0,
     (names.RESTARTING, 1, 1, [], ["demo-trainer-1-0"], [names.REASON_RESTARTING], 30.0)),
    ("backoff-not-over", {}, status(names.RESTARTING, restarts=1, lastFailure=FAILED_AT), [pod(1, 1, "Failed", 1)], 10,
     (names.RESTARTING, 1, 1, [], [], [], 20.0)),
    ("backoff-over-old-pod-terminating", {}, status(names.RESTARTING, restarts=1, lastFailure=FAILED_AT),
     [pod(1, 0, deleting=True)], 31,
     (names.RESTARTING, 1, 1, [], [], [], None)),
    ("backoff-over-next-attempt", {}, status(names.RESTARTING, restarts=1, lastFailure=FAILED_AT),
     [pod(1, 1, "Failed", 1)], 31,
     (names.PENDING, 2, 1, ["demo-trainer-2-0", "demo-trainer-2-1"], [], [names.REASON_RESTARTED], None)),
    ("stale-attempt-stopped-before-new-gang", {}, status(names.PENDING, 2), [pod(1, 0)], 0,
     (names.PENDING, 2, 0, [], ["demo-trainer-1-0"], [], None)),
]


@pytest.mark.parametrize("spec_over, old, pods, after, want", [x[1:] for x in CASES], ids=[x[0] for x in CASES])
def test_compute_gang(spec_over, old, pods, after, want):
    spec = None if spec_over is None else parse_spec({**SPEC, **spec_over})
    g = gang.compute_gang(REF, spec, "invalid spec: boom", old, pods, NOW + timedelta(seconds=after))
    got = (g.phase, g.attempt, g.status["restarts"], [o["metadata"]["name"] for o in g.create], list(g.delete),
           [e.reason for e in g.events], g.requeue_after)
    assert got == want


@pytest.mark.parametrize("old, pods, want_reason, want_warning, want_failed_reason", [
    (status(names.RUNNING), [pod(1, 0), pod(1, 1, "Failed", 78)],
     names.REASON_FATAL_EXIT, True, names.REASON_FATAL_EXIT),
    (status(names.RUNNING), [pod(1, 0), pod(1, 1, "Failed", 1)], names.REASON_RESTARTING, True, None),
    (status(names.PENDING), [pod(1, 0), pod(1, 1)], names.REASON_ALL_RUNNING, False, None),
    (status(names.FAILED), [pod(1, 0), pod(1, 1)], None, None, None),  # terminal: nothing more to say
])
def test_events_and_failed_reason(old, pods, want_reason, want_warning, want_failed_reason):
    g = gang.compute_gang(REF, parse_spec(SPEC), "", old, pods, NOW)
    assert g.failed_reason == want_failed_reason
    if want_reason is None:
        assert g.events == ()
    else:
        assert [(e.reason, e.type == "Warning") for e in g.events] == [(want_reason, want_warning)]


@pytest.mark.parametrize("old, key, want", [
    (status(names.PENDING), "startTime", "2026-11-30T12:00:00Z"),
    (status(names.PENDING, startTime="2026-11-30T10:00:00Z"), "startTime", "2026-11-30T10:00:00Z"),  # kept
    (status(names.RUNNING, completionTime="2026-11-30T10:00:00Z"), "completionTime",
     "2026-11-30T10:00:00Z"),  # fail keeps it
    (status(names.RUNNING), "completionTime", "2026-11-30T12:00:00Z"),
])
def test_times_are_set_once(old, key, want):
    pods = [pod(1, 0), pod(1, 1)] if key == "startTime" else [pod(1, 0), pod(1, 1, "Failed", 78)]
    assert gang.compute_gang(REF, parse_spec(SPEC), "", old, pods, NOW).status[key] == want
