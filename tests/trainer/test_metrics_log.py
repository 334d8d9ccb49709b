"""Per-step metrics as JSON Lines next to the checkpoints: on local disk and on a real
S3-compatible server."""

from __future__ import annotations

import json
import math
import threading
import time

import pytest

from rft_contract.layout import metrics_uri
from rft_trainer.metrics import MetricsLog, read_metrics
from rft_contract.storage import LocalStorage, get_storage


def lines(uri: str) -> list[dict]:
    return [json.loads(raw) for raw in get_storage(uri).read_bytes(uri).splitlines()]


class CountingStorage(LocalStorage):
    def __init__(self) -> None:
        self.writes = 0

    def write_bytes(self, uri: str, data: bytes) -> None:
        self.writes += 1
        super().write_bytes(uri, data)


class BrokenStorage(LocalStorage):
    """Reads fail with a network error, writes too until `healed`."""

    def __init__(self) -> None:
        self.healed, self.tries = False, 0

    def read_bytes(self, uri: str) -> bytes:
        raise ConnectionError("endpoint unreachable")

    def write_bytes(self, uri: str, data: bytes) -> None:
        self.tries += 1
        if not self.healed:
            raise ConnectionError("endpoint unreachable")
        super().write_bytes(uri, data)


def test_layout_and_round_trip(tmp_path):
    root = str(tmp_path / "job")
    log = MetricsLog(root, attempt=2, flush_every=100, clock=lambda: 1700000000.12345)  # background writer
    log.append(1, {"actor/pg_loss": 0.5, "perf/throughput": 1200})
    log.append(2, {"actor/pg_loss": float("nan"), "actor/entropy": math.inf})
    log.close()
    assert metrics_uri(root, 2) == f"{root}/metrics/attempt-002.jsonl"
    assert lines(metrics_uri(root, 2)) == [
        {"step": 1, "time": 1700000000.123, "attempt": 2, "actor/pg_loss": 0.5, "perf/throughput": 1200.0},
        {"step": 2, "time": 1700000000.123, "attempt": 2, "actor/pg_loss": None, "actor/entropy": None},
    ]


def test_flushes_every_n_steps_and_on_close(tmp_path):
    root, storage = str(tmp_path), CountingStorage()
    log = MetricsLog(root, attempt=0, flush_every=3, flush_seconds=3600, storage=storage, background=False)
    uri = metrics_uri(root, 0)
    for step in (1, 2):
        log.append(step, {"loss": 1.0})
    assert storage.writes == 0 and not storage.exists(uri)
    log.append(3, {"loss": 1.0})
    assert storage.writes == 1 and [x["step"] for x in lines(uri)] == [1, 2, 3]
    log.append(4, {"loss": 1.0})
    log.flush()
    log.flush()  # nothing new: no write
    assert storage.writes == 2
    log.close()
    assert storage.writes == 2 and [x["step"] for x in lines(uri)] == [1, 2, 3, 4]


def test_flushes_after_flush_seconds(tmp_path, monkeypatch):
    import rft_trainer.metrics as m

    now = [1000.0]
    monkeypatch.setattr(m.time, "monotonic", lambda: now[0])
    storage = CountingStorage()
    log = MetricsLog(str(tmp_path), attempt=0, flush_every=1000, flush_seconds=30, storage=storage,
                     background=False)
    log.append(1, {"loss": 1.0})
    now[0] += 29
    log.append(2, {"loss": 1.0})
    assert storage.writes == 0
    now[0] += 1
    log.append(3, {"loss": 1.0})
    assert storage.writes == 1


def test_failing_storage_never_raises_and_retries_later(tmp_path):
    storage = BrokenStorage()
    log = MetricsLog(str(tmp_path), attempt=0, flush_every=2, storage=storage, background=False)
    for step in range(1, 6):
        log.append(step, {"loss": float(step)})
    log.close()
    assert storage.tries == 3 and log.failures == 3  # steps 2 and 4, then close
    storage.healed = True
    log.close()  # still unwritten: the whole attempt goes out once storage is back
    assert [x["step"] for x in lines(metrics_uri(str(tmp_path), 0))] == [1, 2, 3, 4, 5]


def test_restart_within_an_attempt_keeps_earlier_lines(tmp_path):
    root = str(tmp_path)
    first = MetricsLog(root, attempt=1, flush_every=1, background=False)
    first.append(1, {"loss": 1.0})
    second = MetricsLog(root, attempt=1, flush_every=1, background=False)  # same attempt, new process
    second.append(2, {"loss": 2.0})
    assert [x["step"] for x in read_metrics(root)] == [1, 2]


def write_attempts(root: str) -> None:
    """Attempt 0 logs steps 1-5 and dies; it had checkpointed step 3, so attempt 1
    replays 4 and 5 (with different values) and goes on to 7."""
    a0 = MetricsLog(root, attempt=0, flush_every=1, background=False)
    for step in range(1, 6):
        a0.append(step, {"loss": float(step)})  # no close: the pod died
    a1 = MetricsLog(root, attempt=1)
    for step in range(4, 8):
        a1.append(step, {"loss": step / 10})
    a1.close()


def expected_history() -> list[tuple[int, int, float]]:
    return [(1, 0, 1.0), (2, 0, 2.0), (3, 0, 3.0), (4, 1, 0.4), (5, 1, 0.5), (6, 1, 0.6), (7, 1, 0.7)]


def test_read_metrics_merges_attempts_with_replayed_steps(tmp_path):
    root = str(tmp_path / "job")
    write_attempts(root)
    get_storage(root).write_bytes(f"{root}/metrics/notes.txt", b"not a log")  # ignored
    assert [(x["step"], x["attempt"], x["loss"]) for x in read_metrics(root)] == expected_history()
    assert read_metrics(str(tmp_path / "empty")) == []


def test_read_metrics_orders_attempts_numerically(tmp_path):
    root = str(tmp_path)
    for attempt in (9, 10):  # "attempt-010" must win over "attempt-009"
        log = MetricsLog(root, attempt=attempt)
        log.append(1, {"loss": float(attempt)})
        log.close()
    assert [x["attempt"] for x in read_metrics(root)] == [10]


def test_s3_round_trip_and_merge(bucket):
    root = f"s3://{bucket}/team-a/demo"
    write_attempts(root)
    storage = get_storage(root)
    assert storage.list(f"{root}/metrics/") == [f"{root}/metrics/attempt-000.jsonl",
                                                f"{root}/metrics/attempt-001.jsonl"]
    assert [x["step"] for x in lines(f"{root}/metrics/attempt-001.jsonl")] == [4, 5, 6, 7]
    assert [(x["step"], x["attempt"], x["loss"]) for x in read_metrics(root)] == expected_history()


def test_s3_unreachable_does_not_raise(s3_env):
    import boto3
    from botocore.config import Config

    from rft_contract.s3 import S3Storage

    # Nothing listens on port 9; one attempt each, or botocore's backoff takes a minute.
    client = boto3.client("s3", endpoint_url="http://127.0.0.1:9",
                          config=Config(retries={"max_attempts": 1}, connect_timeout=1))
    log = MetricsLog("s3://nowhere/job", attempt=0, flush_every=1, storage=S3Storage(client))
    log.append(1, {"loss": 1.0})
    log.close()
    assert log.failures >= 1 and not log.flush()


def test_a_slow_store_does_not_stall_append(tmp_path):
    release = threading.Event()

    class SlowStorage(LocalStorage):
        def write_bytes(self, uri: str, data: bytes) -> None:
            release.wait(10)
            super().write_bytes(uri, data)

    log = MetricsLog(str(tmp_path), attempt=0, flush_every=1, storage=SlowStorage())
    start = time.monotonic()
    for step in range(1, 21):  # each append is due; the writer is stuck in the first write
        log.append(step, {"loss": 1.0})
    assert time.monotonic() - start < 5
    release.set()
    log.close()
    assert [x["step"] for x in read_metrics(str(tmp_path))] == list(range(1, 21))


@pytest.mark.parametrize("value", [3, 2.5, True])
def test_numbers_stay_numbers(tmp_path, value):
    log = MetricsLog(str(tmp_path), attempt=0, flush_every=1, background=False)
    log.append(1, {"x": value})
    assert lines(metrics_uri(str(tmp_path), 0))[0]["x"] == float(value)
