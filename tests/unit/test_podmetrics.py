"""rft_contract.podmetrics: the /metrics server of the job's pods and each program's set,
updated with made-up numbers and read back from its registry (no trainer, engine or API)."""

import logging
import socket
import threading
import time
import urllib.request

import pytest

from rft_contract import podmetrics
from rft_contract.podmetrics import ExplorerMetrics, PodMetrics, SyncAgentMetrics, TrainerMetrics


def value(m: PodMetrics, metric: str, **labels) -> float | None:
    return m.registry.get_sample_value(metric, labels)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


@pytest.mark.parametrize("env, port", [({}, 9400), ({"RFT_METRICS_PORT": "9500"}, 9500),
                                       ({"RFT_METRICS_PORT": "0"}, 0), ({"RFT_METRICS_PORT": " "}, 9400),
                                       ({"RFT_METRICS_PORT": "http"}, 9400), ({"RFT_METRICS_PORT": "70000"}, 9400)])
def test_the_port_is_9400_unless_the_environment_says_otherwise(env, port):
    assert podmetrics.metrics_port(env) == port


@pytest.mark.parametrize("metrics, names", [
    (TrainerMetrics, ["rft_trainer_step", "rft_trainer_metric", "rft_trainer_throughput_tokens_per_second",
                      "rft_trainer_checkpoint_step", "rft_trainer_uploaded_bytes_total"]),
    (SyncAgentMetrics, ["rft_sync_agent_served_version", "rft_sync_agent_target_version",
                        "rft_sync_agent_last_sync_seconds", "rft_sync_agent_sync_failures_total",
                        'rft_sync_agent_fetched_bytes_total{source="s3"}']),
    (ExplorerMetrics, ["rft_explorer_samples_written_total", "rft_explorer_staleness_versions",
                       "rft_explorer_request_failures_total", 'rft_explorer_dropped_samples_total{reason="straddled"}']),
])
def test_each_program_serves_its_own_registry_over_http(metrics, names):
    m = metrics()
    port = free_port()
    assert m.serve(port, addr="127.0.0.1") == port
    try:
        text = scrape(port)
    finally:
        m.close()
    for name in names + ["process_resident_memory_bytes"]:
        assert name in text
    assert "python_gc_objects_collected_total" not in text  # not the process-wide default registry


def test_each_set_has_a_registry_of_its_own():
    a, b = TrainerMetrics(), TrainerMetrics()  # a second one in the same process: no clash
    a.observe_step(3, {})
    assert value(a, "rft_trainer_step") == 3 and value(b, "rft_trainer_step") == 0


def test_port_0_serves_nothing(monkeypatch):
    monkeypatch.setenv("RFT_METRICS_PORT", "0")
    m = ExplorerMetrics()
    assert m.serve() is None and m.server is None
    m.close()  # nothing to close


def test_a_port_in_use_is_logged_not_fatal(caplog):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with caplog.at_level(logging.WARNING, logger="rft_contract.podmetrics"):
            assert SyncAgentMetrics().serve(port, addr="127.0.0.1") is None
    assert f"cannot listen on 127.0.0.1:{port}" in caplog.text


# ------------------------------------------------------------------ the trainer


def test_the_trainer_exposes_every_numeric_step_metric_by_name():
    m = TrainerMetrics()
    m.observe_job(attempt=2, total_steps=20)
    m.observe_step(7, {"actor/pg_loss": -0.25, "perf/throughput": 1234.5, "time/step": 2.5,
                       "training/global_step": 7, "buffer/dropped_stale": 3.0, "note": "text", "flag": True},
                   now=lambda: 1000.0)
    assert (value(m, "rft_trainer_step"), value(m, "rft_trainer_total_steps"), value(m, "rft_trainer_attempt")) \
        == (7, 20, 2)
    assert value(m, "rft_trainer_metric", name="actor/pg_loss") == -0.25
    assert value(m, "rft_trainer_metric", name="buffer/dropped_stale") == 3
    assert value(m, "rft_trainer_metric", name="note") is None and value(m, "rft_trainer_metric", name="flag") is None
    assert value(m, "rft_trainer_throughput_tokens_per_second") == 1234.5
    assert value(m, "rft_trainer_step_seconds") == 2.5
    assert value(m, "rft_trainer_last_step_timestamp_seconds") == 1000.0
    m.observe_step(8, {"actor/pg_loss": 0.5})  # a step without throughput keeps the last one
    assert value(m, "rft_trainer_metric", name="actor/pg_loss") == 0.5
    assert value(m, "rft_trainer_throughput_tokens_per_second") == 1234.5


def test_the_trainer_exposes_buffer_checkpoint_and_weights_figures():
    m = TrainerMetrics()
    m.observe_buffer({"e000": 64, "e001": 32}, dropped_stale=5, samples=96)
    assert value(m, "rft_trainer_buffer_dropped_stale_samples") == 5 and value(m, "rft_trainer_buffer_samples") == 96
    assert value(m, "rft_trainer_buffer_consumed_samples", stream="e001") == 32
    m.observe_checkpoint(10, 1000, 4.5, now=lambda: 50.0)
    m.observe_checkpoint(20, 2000, None)  # seconds unknown (resumed): the last known stays
    assert value(m, "rft_trainer_checkpoint_step") == 20 and value(m, "rft_trainer_checkpoint_bytes") == 2000
    assert value(m, "rft_trainer_checkpoint_seconds") == 4.5
    m.observe_weights(20, 300, 1.25)
    m.observe_weights(21, None, 1.0)
    assert value(m, "rft_trainer_weights_version") == 21 and value(m, "rft_trainer_weights_export_seconds") == 1.0
    assert value(m, "rft_trainer_uploaded_bytes_total", kind="checkpoint") == 3000
    assert value(m, "rft_trainer_uploaded_bytes_total", kind="weights") == 300


def test_the_trainer_counts_samples_by_version_lag_and_outcome():
    m = TrainerMetrics()
    m.observe_samples({("0", "trained"): 30, ("2", "dropped"): 4})
    m.observe_samples({("0", "trained"): 2, ("8plus", "masked"): 1})
    assert value(m, "rft_trainer_samples_total", lag="0", outcome="trained") == 32
    assert value(m, "rft_trainer_samples_total", lag="2", outcome="dropped") == 4
    assert value(m, "rft_trainer_samples_total", lag="8plus", outcome="masked") == 1
    # The per-lag tracker counts are left out of rft_trainer_metric: a gauge would keep a lag seen once.
    m.observe_step(3, {"staleness/dropped_lag_5": 8.0, "staleness/lag_mean": 0.5})
    assert value(m, "rft_trainer_metric", name="staleness/dropped_lag_5") is None
    assert value(m, "rft_trainer_metric", name="staleness/lag_mean") == 0.5


# ------------------------------------------------------------------ the sync agent


def test_the_sync_agent_exposes_versions_sync_times_bytes_and_failures():
    m = SyncAgentMetrics()
    assert value(m, "rft_sync_agent_target_version") == value(m, "rft_sync_agent_served_version") == -1
    m.observe_versions(4, None)  # a reload in flight: none known
    assert (value(m, "rft_sync_agent_target_version"), value(m, "rft_sync_agent_served_version")) == (4, -1)
    m.observe_sync({"downloadSeconds": 1.5, "verifySeconds": 0.25, "reloadSeconds": 2.0, "loadSeconds": 3.75},
                   s3_bytes=100, peer_bytes=0, now=lambda: 7.0)
    m.observe_sync({"loadSeconds": 0.5}, s3_bytes=0, peer_bytes=100)
    m.observe_versions(4, 4)
    m.observe_failure()
    assert value(m, "rft_sync_agent_served_version") == 4
    assert value(m, "rft_sync_agent_syncs_total") == 2 and value(m, "rft_sync_agent_sync_failures_total") == 1
    assert value(m, "rft_sync_agent_last_sync_seconds") == 0.5
    assert value(m, "rft_sync_agent_last_sync_phase_seconds", phase="reload") == 2.0
    assert value(m, "rft_sync_agent_fetched_bytes_total", source="s3") == 100
    assert value(m, "rft_sync_agent_fetched_bytes_total", source="peer") == 100


class _FailingEngine:
    restartable = False

    def served(self):
        from rft_serving.engines import ENGINE_DOWN, SyncError

        raise SyncError(f"{ENGINE_DOWN}: connection refused")

    def restarts(self):
        return None


class _Api:
    """Patches are accepted; reads fail (the agent's watch thread retries in the background)."""

    def patch_namespaced_custom_object_status(self, *args, **kwargs):
        return None


def test_the_sync_agent_counts_a_failed_pass_and_shows_the_target(tmp_path):
    from rft_serving.sync_agent import SyncAgent

    agent = SyncAgent("demo", "team-a", "demo-inference-0", _FailingEngine(), tmp_path, api=_Api(),
                      max_backoff=0.05)
    agent._status = {"weightSync": {"target": {"version": 3, "id": "x", "uri": "s3://b/w/3"}}}
    thread = threading.Thread(target=agent.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while value(agent.metrics, "rft_sync_agent_sync_failures_total") == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        agent.stop()
        thread.join(5)
    assert value(agent.metrics, "rft_sync_agent_sync_failures_total") >= 1
    assert value(agent.metrics, "rft_sync_agent_target_version") == 3
    assert value(agent.metrics, "rft_sync_agent_served_version") == -1


# ------------------------------------------------------------------ the explorer


def test_the_explorer_exposes_what_it_wrote_with_which_policy_and_its_errors():
    m = ExplorerMetrics()
    m.observe_trainer(9)
    m.observe_request_failures(2)
    m.observe_shard(8, [7, 8, 8, 9], reward_mean=0.375, seconds=12.5,
                    dropped={"straddled": 1, "unversioned": 0}, now=lambda: 70.0)
    m.observe_request_failures(5)
    m.observe_shard(4, [9], reward_mean=1.0, seconds=3.0, dropped={"straddled": 0, "unversioned": 2})
    assert value(m, "rft_explorer_shards_written_total") == 2 and value(m, "rft_explorer_samples_written_total") == 12
    assert value(m, "rft_explorer_policy_version", bound="min") == value(m, "rft_explorer_policy_version",
                                                                        bound="max") == 9
    assert value(m, "rft_explorer_trainer_step") == 9 and value(m, "rft_explorer_staleness_versions") == 0
    assert value(m, "rft_explorer_reward_mean") == 1.0 and value(m, "rft_explorer_last_shard_seconds") == 3.0
    assert value(m, "rft_explorer_request_failures_total") == 5
    assert value(m, "rft_explorer_dropped_samples_total", reason="straddled") == 1
    assert value(m, "rft_explorer_dropped_samples_total", reason="unversioned") == 2


def test_the_explorers_staleness_is_the_trainer_step_minus_the_oldest_sample_version():
    m = ExplorerMetrics()
    m.observe_trainer(10)
    m.observe_shard(3, [7, 9, 10], reward_mean=0.0, seconds=1.0, dropped={})
    assert value(m, "rft_explorer_staleness_versions") == 3
    assert value(m, "rft_explorer_policy_version", bound="min") == 7
