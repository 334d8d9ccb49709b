"""The trainer's status reporter: delivery policy (coalescing, urgency, retries) with a
recording stand-in for the API; the real API server path is in tests/integration."""

import threading

from rft_trainer.reporting import StatusReporter, merge


class Recorder:
    def __init__(self, fail_first: int = 0):
        self.calls, self.fail_first = [], fail_first
        self.event = threading.Event()

    def patch_namespaced_custom_object_status(self, group, version, ns, plural, name, body, **kw):
        if self.fail_first:
            self.fail_first -= 1
            raise RuntimeError("boom")
        self.calls.append(body)
        self.event.set()


def test_disabled_outside_a_cluster(monkeypatch):
    monkeypatch.delenv("RFT_JOB_NAME", raising=False)
    r = StatusReporter.from_env()
    assert not r.enabled
    r.report_step(1, 10)  # no-op, no thread
    r.close()


def test_step_updates_are_coalesced_and_checkpoints_are_urgent():
    api = Recorder()
    r = StatusReporter("job", "ns", api, min_interval=3600)
    r.report_checkpoint(5, "s3://b/ckpt/step-00000005", 123, 1.5)  # urgent: goes out at once
    assert api.event.wait(5)
    for step in range(1, 50):
        r.report_step(step, 100, {"actor/pg_loss": 0.5, "not/summarised": 1.0})
    r.close()  # flushes the coalesced latest step
    assert api.calls[0]["status"]["trainer"]["lastCheckpoint"]["step"] == 5
    last = api.calls[-1]["status"]["trainer"]
    assert last["step"] == 49 and last["progress"] == "49/100"
    assert last["metrics"] == {"actor_pg_loss": 0.5}
    assert len(api.calls) == 2  # 49 step reports became one patch


def test_failures_are_retried_not_raised():
    api = Recorder(fail_first=2)
    r = StatusReporter("job", "ns", api, min_interval=0, retries=5)
    r.report_weights(3, "s3://b/weights/step-00000003")
    assert api.event.wait(10)
    r.close()
    assert r.failures == 2 and api.calls[0]["status"]["trainer"]["latestWeights"]["version"] == 3


def test_merge_is_deep():
    assert merge({"a": {"b": 1, "c": 2}}, {"a": {"c": 3}, "d": 4}) == {"a": {"b": 1, "c": 3}, "d": 4}
