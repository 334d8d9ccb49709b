"""The operator's Prometheus metrics, read back from the exposition text a scrape gets."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from rft_operator.controller import Controller
from rft_operator.metrics import OperatorMetrics

from .testing import NOW, make_job

A, B, C = ("team-a", "alpha"), ("team-a", "beta"), ("team-b", "gamma")


def scrape(m: OperatorMetrics) -> dict[tuple[str, frozenset], float]:
    """{(sample name, labels): value} parsed from the text format."""
    text = generate_latest(m.registry).decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def phases(m: OperatorMetrics) -> dict[str, float]:
    return {dict(labels)["phase"]: v for (name, labels), v in scrape(m).items() if name == "rftjob_jobs"}


def job_value(m: OperatorMetrics, name: str, key: tuple[str, str], **labels: str) -> float | None:
    want = frozenset({"namespace": key[0], "job": key[1], **labels}.items())
    return scrape(m).get((name, want))


def body(key: tuple[str, str], **status) -> dict:
    job = make_job(status=status)
    job["metadata"].update(namespace=key[0], name=key[1])
    return job


def test_each_job_counts_in_exactly_one_phase():
    m = OperatorMetrics()
    m.observe_job(A, body(A, phase="Running"))
    m.observe_job(B, body(B, phase="Running"))
    m.observe_job(C, body(C))  # no status yet: the operator has not seen it
    assert phases(m) == {"Pending": 1, "Running": 2, "Restarting": 0, "Suspended": 0,
                         "Succeeded": 0, "Failed": 0}

    m.observe_job(A, body(A, phase="Running"))  # seen again: still one job
    m.observe_job(A, body(A, phase="Succeeded"))
    m.observe_job(C, body(C, phase="Failed"))
    assert phases(m) == {"Pending": 0, "Running": 1, "Restarting": 0, "Suspended": 0,
                         "Succeeded": 1, "Failed": 1}


def test_deleted_job_drops_its_series():
    m = OperatorMetrics()
    m.observe_job(A, body(A, phase="Running", restarts=2, trainer={"step": 7}))
    m.observe_job(B, body(B, phase="Running", restarts=0))
    assert job_value(m, "rftjob_job_restarts", A) == 2
    assert job_value(m, "rftjob_trainer_step", A) == 7

    m.observe_job(A, None)
    m.observe_job(A, None)  # forgetting twice is harmless
    assert phases(m)["Running"] == 1
    assert job_value(m, "rftjob_job_restarts", A) is None
    assert job_value(m, "rftjob_trainer_step", A) is None
    assert job_value(m, "rftjob_job_restarts", B) == 0
    assert job_value(m, "rftjob_trainer_step", B) is None  # no step reported yet: no series


def test_weight_sync_gauges_follow_status():
    m = OperatorMetrics()
    ws = {"syncedReplicas": 1, "desiredReplicas": 3, "synced": "1/3", "lagSteps": 20}
    m.observe_job(A, body(A, phase="Running", trainer={"step": 40}, weightSync=ws))
    assert job_value(m, "rftjob_weight_sync_lag_steps", A) == 20
    assert job_value(m, "rftjob_weight_sync_replicas", A, state="synced") == 1
    assert job_value(m, "rftjob_weight_sync_replicas", A, state="desired") == 3

    ws = {"syncedReplicas": 3, "desiredReplicas": 3, "synced": "3/3", "lagSteps": 0}
    m.observe_job(A, body(A, phase="Running", trainer={"step": 41}, weightSync=ws))
    assert job_value(m, "rftjob_weight_sync_lag_steps", A) == 0
    assert job_value(m, "rftjob_weight_sync_replicas", A, state="synced") == 3
    assert job_value(m, "rftjob_trainer_step", A) == 41

    m.observe_job(B, body(B, phase="Running"))  # train-only: no weightSync, no series
    assert job_value(m, "rftjob_weight_sync_lag_steps", B) is None
    assert job_value(m, "rftjob_weight_sync_replicas", B, state="desired") is None


def test_phase_budget_checkpoint_and_conditions_per_job():
    m = OperatorMetrics()
    trainer = {"step": 37, "lastCheckpoint": {"step": 30, "uri": "s3://ckpts/demo/step-30",
                                              "time": "2026-11-30T11:59:00Z"}}
    conditions = [{"type": "Running", "status": "True", "reason": "Running"},
                  {"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded"}]
    progress = {"step": 37, "attempt": 2, "since": "2026-11-30T11:58:00Z"}
    m.observe_job(A, body(A, phase="Running", restarts=1, trainer=trainer, conditions=conditions,
                          progress=progress))
    assert job_value(m, "rftjob_job_phase", A, phase="Running") == 1
    assert job_value(m, "rftjob_job_phase", A, phase="Restarting") == 0  # every phase, so a change shows
    assert job_value(m, "rftjob_job_max_restarts", A) == 2  # the demo's spec.failurePolicy
    assert job_value(m, "rftjob_checkpoint_interval_steps", A) == 10
    assert job_value(m, "rftjob_weight_sync_interval_steps", A) == 1  # the default
    assert job_value(m, "rftjob_progress_timestamp_seconds", A) == NOW.timestamp() - 120
    assert job_value(m, "rftjob_last_checkpoint_step", A) == 30
    assert job_value(m, "rftjob_last_checkpoint_timestamp_seconds", A) == (NOW.timestamp() - 60)
    assert job_value(m, "rftjob_job_condition", A, type="Running", status="True", reason="Running") == 1
    assert job_value(m, "rftjob_job_condition", A, type="Progressing", status="False",
                     reason="ProgressDeadlineExceeded") == 1

    # Spec fields left out: the contract's defaults; no checkpoint yet: no series.
    job = body(B, phase="Running", trainer={"step": 3})
    del job["spec"]["failurePolicy"], job["spec"]["checkpoint"]["interval"]
    m.observe_job(B, job)
    assert job_value(m, "rftjob_job_max_restarts", B) == 3
    assert job_value(m, "rftjob_checkpoint_interval_steps", B) == 100
    assert job_value(m, "rftjob_last_checkpoint_step", B) is None
    assert job_value(m, "rftjob_last_checkpoint_timestamp_seconds", B) is None
    assert job_value(m, "rftjob_progress_timestamp_seconds", B) is None
    assert not [k for k in scrape(m) if k[0] == "rftjob_job_condition" and ("job", "beta") in k[1]]

    m.observe_job(A, None)
    assert not [k for k in scrape(m) if ("job", "alpha") in k[1]]


def test_api_writes_are_read_from_the_kube_counters():
    m = OperatorMetrics()
    assert ("rftjob_api_writes_total", frozenset()) not in scrape(m)
    kube = SimpleNamespace(requests=0, seconds=0.0)
    m.track_writes(kube)
    kube.requests, kube.seconds = 12, 1.5
    got = scrape(m)
    assert got[("rftjob_api_writes_total", frozenset())] == 12
    assert got[("rftjob_api_write_seconds_total", frozenset())] == 1.5


def test_registries_are_separate():
    one, two = OperatorMetrics(), OperatorMetrics()
    one.reconciles.inc()
    one.observe_job(A, body(A, phase="Running"))
    assert scrape(two)[("rftjob_reconciles_total", frozenset())] == 0
    assert phases(two)["Running"] == 0


class FakeKube:
    def __init__(self, fail: bool = False):
        self.requests, self.seconds, self.fail = 0, 0.0, fail
        self.statuses: list[dict] = []

    def patch_status(self, ns, name, status, rv):
        self.requests += 1
        if self.fail:
            raise RuntimeError("API server down")
        self.statuses.append(status)
        return str(int(rv) + 1)

    def post_event(self, *args):
        self.requests += 1

    def create(self, obj):
        self.requests += 1
        return True

    def merge_patch(self, obj):
        self.requests += 1

    def delete_pod(self, ns, name):
        self.requests += 1


def run_controller(kube: FakeKube, jobs: dict, keys: list) -> OperatorMetrics:
    """Drain `keys` through real workers (reconcile + apply, with the fake API)."""
    async def go():
        ctl = Controller(kube, jobs.get, lambda key: [], lambda key: [], workers=1, clock=lambda: NOW)
        ctl.start()
        for key in keys:
            ctl.queue.add(key)
        for _ in range(200):
            await asyncio.sleep(0.01)
            if len(ctl.queue) == 0 and not ctl.queue._processing:
                break
        await ctl.stop()
        return ctl.metrics

    return asyncio.run(go())


def test_controller_counts_reconciles_errors_and_duration():
    job = body(A)
    m = run_controller(FakeKube(), {A: job}, [A, B])  # B does not exist: observed, not reconciled
    got = scrape(m)
    assert got[("rftjob_reconciles_total", frozenset())] == 1
    assert got[("rftjob_reconcile_errors_total", frozenset())] == 0
    assert got[("rftjob_reconcile_duration_seconds_count", frozenset())] == 1
    assert got[("rftjob_api_writes_total", frozenset())] >= 1  # at least the status write
    assert phases(m)["Pending"] == 1  # the body it reconciled, not the one it wrote

    m = run_controller(FakeKube(fail=True), {A: job}, [A])
    got = scrape(m)
    assert got[("rftjob_reconciles_total", frozenset())] == 1
    assert got[("rftjob_reconcile_errors_total", frozenset())] == 1
    assert got[("rftjob_reconcile_duration_seconds_count", frozenset())] == 1


def test_serve_exposes_the_current_controllers_metrics():
    import socket
    import urllib.request

    from rft_operator import metrics

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    current: list[OperatorMetrics] = []
    assert metrics.serve(port, lambda: current[0] if current else None, addr="127.0.0.1")

    def get() -> str:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()

    assert "process_cpu_seconds_total" in get() and "rftjob_" not in get()  # before startup
    current.append(OperatorMetrics())
    current[0].observe_job(A, body(A, phase="Restarting", restarts=1))
    assert 'rftjob_jobs{phase="Restarting"} 1.0' in get().splitlines()
    assert not metrics.serve(port, lambda: None, addr="127.0.0.1")  # in use: logged, not raised
