"""The trainer's status reporter: delivery policy (coalescing, urgency, retry until it
lands, flush at close) against a stand-in API that applies merge patches the way the API
server does and can be taken down; the real API server path is in tests/integration.

No sleeps: tests wait on the stand-in's condition variable, and retry delays are injected."""

import copy
import logging
import threading

import pytest

from rft_contract import names
from rft_trainer.reporting import (
    StatusReporter, backoff_delay, compute_flush_timeout, describe_status, merge,
)

from .testing import merge_patch

WAIT = 10  # seconds: only reached when a test fails


class ApiDown(Exception):
    """What the kubernetes client raises; the body may echo secrets and must not be logged."""

    status, reason = 503, "Service Unavailable"

    def __str__(self) -> str:
        return "HTTP response body: Authorization: Bearer SECRET-TOKEN"


class FakeApi:
    """Fails while `down` (or for its first `fail_attempts` calls); `hold` keeps a call
    waiting until the test releases it."""

    def __init__(self, fail_attempts: int = 0, down: bool = False):
        self.cond = threading.Condition()
        self.state: dict = {}  # status.trainer as the API server holds it
        self.delivered: list[dict] = []  # trainer patches that landed
        self.attempts = 0
        self.fail_attempts, self.down = fail_attempts, down
        self.hold: threading.Event | None = None
        self.held = threading.Event()

    def patch_namespaced_custom_object_status(self, group, version, ns, plural, name, body, **kw):
        if self.hold is not None:
            self.held.set()
            assert self.hold.wait(WAIT)
        with self.cond:
            self.attempts += 1
            failing = self.down or self.attempts <= self.fail_attempts
            if not failing:
                trainer = copy.deepcopy(body["status"]["trainer"])
                self.delivered.append(trainer)
                self.state = merge_patch(self.state, trainer)
            self.cond.notify_all()
        if failing:
            raise ApiDown()

    def wait(self, predicate, message: str = "condition") -> None:
        with self.cond:
            assert self.cond.wait_for(predicate, WAIT), f"timed out waiting for {message}"

    def set_down(self, down: bool) -> None:
        with self.cond:
            self.down = down


def reporter(api, **kw) -> StatusReporter:
    kw.setdefault("min_interval", 0)
    kw.setdefault("backoff", lambda failures: 0.001)
    return StatusReporter("job", "ns", api, **kw)


def test_disabled_outside_a_cluster(monkeypatch):
    monkeypatch.delenv("RFT_JOB_NAME", raising=False)
    r = StatusReporter.from_env()
    assert not r.enabled
    r.report_step(1, 10)  # no-op, no thread
    r.close()


def test_step_updates_are_coalesced_and_checkpoints_are_urgent():
    api = FakeApi()
    r = reporter(api, min_interval=3600)
    r.report_checkpoint(5, "s3://b/ckpt/step-00000005", 123, 1.5)  # urgent: goes out at once
    api.wait(lambda: api.delivered, "the checkpoint")
    for step in range(1, 50):
        r.report_step(step, 100, {"actor/pg_loss": 0.5, "not/summarised": 1.0})
        r.report_buffer({"e000": step * 4}, 0, step * 4)
    r.close(timeout=WAIT)  # flushes the coalesced latest step
    assert api.delivered[0]["lastCheckpoint"]["step"] == 5
    last = api.delivered[-1]
    assert last["step"] == 49 and last["progress"] == "49/100"
    assert last["metrics"] == {"actor_pg_loss": 0.5}
    assert last["buffer"] == {"consumed": {"e000": 196}, "droppedStale": 0, "samples": 196}
    assert len(api.delivered) == 2  # 49 step and buffer reports became one patch


def test_an_outage_loses_nothing_and_the_newest_state_lands():
    api = FakeApi(down=True)
    r = reporter(api)
    r.report_checkpoint(10, "s3://b/ckpt/step-00000010", 1, 0.1)
    api.wait(lambda: api.attempts >= 3, "failed attempts")
    for step in range(11, 21):
        r.report_step(step, 20, {"actor/pg_loss": step / 100})
        r.report_weights(step, f"s3://b/weights/step-{step:08d}", f"id-{step}", [step - 1, step])
    r.report_buffer({"e000": 80, "e001": 40}, 3, 117)
    api.wait(lambda: api.attempts >= 20, "more failed attempts")  # 5 tries used to be the end
    api.set_down(False)
    api.wait(lambda: api.delivered, "delivery after the outage")
    r.close(timeout=WAIT)
    assert api.state["lastCheckpoint"]["step"] == 10  # reported first, still there
    assert api.state["step"] == 20 and api.state["progress"] == "20/20"
    assert api.state["latestWeights"] == {"version": 20, "uri": "s3://b/weights/step-00000020",
                                          "time": api.state["latestWeights"]["time"], "id": "id-20"}
    assert api.state["weightVersions"] == [19, 20]
    assert api.state["buffer"] == {"consumed": {"e000": 80, "e001": 40}, "droppedStale": 3, "samples": 117}
    assert len(api.delivered) == 1 and r.failures >= 20


def test_a_failed_patch_is_merged_under_what_was_reported_while_it_was_in_flight():
    api = FakeApi(fail_attempts=1)
    api.hold = threading.Event()
    r = reporter(api)
    r.report_weights(1, "s3://b/weights/step-00000001", "id-1", [1])
    r.report_checkpoint(1, "s3://b/ckpt/step-00000001", 1, 0.1)
    assert api.held.wait(WAIT)  # that patch is in flight (and will fail)
    r.report_weights(2, "s3://b/weights/step-00000002", "id-2")  # newer, without weightVersions
    api.hold.set()
    api.wait(lambda: api.delivered, "the retry")
    r.close(timeout=WAIT)
    assert api.attempts == 2
    assert api.state["latestWeights"]["version"] == 2 and api.state["latestWeights"]["id"] == "id-2"
    assert api.state["weightVersions"] == [1]  # from the failed patch, not overwritten
    assert api.state["lastCheckpoint"]["step"] == 1


def test_reporting_never_blocks_on_a_hung_api():
    api = FakeApi()
    api.hold = threading.Event()
    r = reporter(api)
    r.report_step(1, 10)
    assert api.held.wait(WAIT)
    done = threading.Event()

    def train():
        for step in range(2, 100):
            r.report_step(step, 10, {"actor/pg_loss": 1.0})
            r.report_waiting(names.WAIT_DATA, "no experiences", "2024-01-01T00:00:00Z", 1.0)
        done.set()

    threading.Thread(target=train, daemon=True).start()
    assert done.wait(WAIT), "report_* blocked while a patch hung"
    api.hold.set()
    r.close(timeout=WAIT)
    assert api.state["step"] == 99 and api.state["waiting"]["reason"] == names.WAIT_DATA


def test_waiting_is_urgent_and_the_next_step_clears_it_once():
    api = FakeApi()
    r = reporter(api, min_interval=3600)
    r.report_step(1, 10)  # urgent (no metrics)
    api.wait(lambda: len(api.delivered) == 1)
    assert api.delivered[0]["waiting"] is None  # what an earlier attempt left is cleared
    r.report_step(2, 10)
    api.wait(lambda: len(api.delivered) == 2)
    assert "waiting" not in api.delivered[1]  # no null while nothing was waiting
    api.delivered.pop(0)
    r.report_waiting(names.WAIT_STALE, "all experiences stale", "2024-01-01T00:00:00Z", 12.345)
    api.wait(lambda: len(api.delivered) == 2, "the urgent waiting")
    assert api.state["waiting"] == {"reason": names.WAIT_STALE, "message": "all experiences stale",
                                    "since": "2024-01-01T00:00:00Z", "seconds": 12.3}
    r.report_step(2, 10)
    api.wait(lambda: len(api.delivered) == 3)
    assert api.delivered[2]["waiting"] is None and "waiting" not in api.state
    r.report_step(3, 10)
    api.wait(lambda: len(api.delivered) == 4)
    assert "waiting" not in api.delivered[3]
    r.close(timeout=WAIT)


def test_failures_log_once_then_once_a_minute_then_recovery(caplog):
    now = [1000.0]
    api = FakeApi(down=True)
    r = reporter(api, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="rft_trainer.reporting"):
        r.report_weights(7, "s3://b/weights/step-00000007")
        api.wait(lambda: api.attempts >= 10)
        with api.cond:  # the thread is about to fail again, or waiting to retry
            now[0] += 61
            seen = api.attempts
        api.wait(lambda: api.attempts >= seen + 10)
        r.report_step(8, 10)
        r.report_step(9, 10)
        with api.cond:
            now[0] += 30
            api.down = False
        api.wait(lambda: api.delivered)
        r.close(timeout=WAIT)
    msgs = [(rec.levelname, rec.getMessage()) for rec in caplog.records]
    warnings = [m for level, m in msgs if level == "WARNING"]
    assert len(warnings) == 2, msgs
    assert warnings[0].startswith("status patch failed (HTTP 503 Service Unavailable)")
    assert "still failing after 61s" in warnings[1] and "latestWeights version 7" in warnings[1]
    infos = [m for level, m in msgs if level == "INFO"]
    assert len(infos) == 1 and "after 91s" in infos[0] and "3 reports merged" in infos[0], infos
    assert "SECRET" not in caplog.text


def test_close_kicks_a_retry_and_keeps_retrying_until_it_lands(caplog):
    api = FakeApi(fail_attempts=7)
    # After the first failure only close() cuts the wait short; then close() must go on
    # retrying (with backoff) through six more failures.
    r = reporter(api, backoff=lambda failures: 3600.0 if failures == 1 else 0.001)
    r.report_weights(1, "s3://b/weights/step-00000001")
    api.wait(lambda: api.attempts >= 1)
    with caplog.at_level(logging.ERROR, logger="rft_trainer.reporting"):
        r.close(timeout=WAIT)
    assert api.state["latestWeights"]["version"] == 1 and api.attempts == 8
    assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR]


def test_close_gives_up_after_its_timeout_naming_what_was_lost(caplog):
    api = FakeApi(down=True)
    r = reporter(api, backoff=lambda failures: 0.01)
    r.report_step(100, 100, {"actor/pg_loss": 0.1})
    r.report_weights(100, "s3://b/weights/step-00000100", "id-100", [90, 100])
    r.report_checkpoint(100, "s3://b/ckpt/step-00000100", 1, 0.1)
    with caplog.at_level(logging.ERROR, logger="rft_trainer.reporting"):
        r.close(timeout=0.5)
    errors = [rec.getMessage() for rec in caplog.records if rec.levelname == "ERROR"]
    assert len(errors) == 1, errors
    for what in ("NOT delivered", "step 100/100", "latestWeights version 100", "lastCheckpoint step 100",
                 "weightVersions [90, 100]", "HTTP 503", "latestWeights,"):
        assert what in errors[0], (what, errors[0])
    assert "SECRET" not in caplog.text
    r._thread.join(WAIT)
    assert not r._thread.is_alive() and api.attempts > 3


def test_close_returns_on_time_when_a_request_hangs(caplog):
    api = FakeApi()
    api.hold = threading.Event()
    r = reporter(api)
    r.report_weights(5, "s3://b/weights/step-00000005")
    assert api.held.wait(WAIT)
    with caplog.at_level(logging.INFO, logger="rft_trainer.reporting"):
        r.close(timeout=0.1)
        errors = [rec.getMessage() for rec in caplog.records if rec.levelno == logging.ERROR]
        assert len(errors) == 1 and "still unanswered" in errors[0] and "latestWeights version 5" in errors[0]
        api.hold.set()  # the server answers after all
        r._thread.join(WAIT)
    assert api.state["latestWeights"]["version"] == 5
    assert "status delivered after close() gave up on it" in caplog.text


@pytest.mark.parametrize("grace,expected", [
    (None, 15.0), ("30", 15.0), ("600", 300.0), ("60", 30.0), ("15", 10.0), ("5", 10.0), ("x", 15.0),
])
def test_close_timeout_fits_the_grace_period(grace, expected):
    env = {} if grace is None else {names.ENV_GRACE_SECONDS: grace}
    assert compute_flush_timeout(env) == expected


def test_backoff_is_exponential_capped_and_jittered():
    assert 0.25 <= backoff_delay(1) <= 0.5
    assert 2.0 <= backoff_delay(4) <= 4.0
    assert all(5.0 <= backoff_delay(n) <= 10.0 for n in (6, 10, 1000))


def test_describe_status_names_versions_and_cleared_waiting():
    text = describe_status({"step": 3, "totalSteps": 9, "latestWeights": {"version": 2, "uri": "s3://x"},
                            "waiting": None})
    assert text == ("keys latestWeights,step,totalSteps,waiting; step 3/9; latestWeights version 2; "
                    "waiting cleared")


def test_merge_is_deep_and_keeps_nulls_for_the_patch():
    assert merge({"a": {"b": 1, "c": 2}}, {"a": {"c": 3}, "d": 4}) == {"a": {"b": 1, "c": 3}, "d": 4}
    assert merge({"waiting": {"reason": "x"}}, {"waiting": None}) == {"waiting": None}
    assert merge({"waiting": None}, {"waiting": {"reason": "y"}}) == {"waiting": {"reason": "y"}}
