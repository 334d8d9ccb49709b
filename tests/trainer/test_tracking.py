"""Experiment tracking (rft_trainer.tracking): TensorBoard event files on the real S3 test
server read back with TensorBoard's own reader, one MLflow run across attempts on a real
`mlflow server` read back through its REST API, W&B offline files, and a tracker that is
down never stopping training nor leaking a credential."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
import urllib.parse
import urllib.request

import pytest
import torch

from e2e.mlflow_server import MLflowServer

from rft_contract.config import load_config
from rft_contract.storage import get_storage
from rft_trainer.experience import write_shard
from rft_trainer.tracking import Rejected, Tracker, build_tracker, mlflow_state_uri
from tests.conftest import wait_for
from tests.fixtures.batches import synthetic_batch
from tests.fixtures.models import save_tiny_model

SECRET = "s3cr3t-Pa55word-never-shown"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """A real MLflow tracking server (sqlite backend, local artifacts) on a free port."""
    with MLflowServer(tmp_path_factory.mktemp("mlflow")) as server:
        print(f"mlflow server ready in {server.started_in:.1f}s")
        yield server.url


def rest(url: str, path: str, **query) -> dict:
    with urllib.request.urlopen(f"{url}/api/2.0/mlflow/{path}?{urllib.parse.urlencode(query)}", timeout=10) as r:
        return json.loads(r.read())


def config(root: str, tracking: dict, attempt: int = 0, uid: str = "uid-1", **extra):
    return load_config({
        "model": {"path": "/models/tiny"},
        "algorithm": {"name": "grpo", "learning_rate": 1e-4},
        "trainer": {"total_steps": 6, "batch_size": 8, "gpus_per_node": 0},
        "checkpoint": {"uri": root},
        "tracking": tracking,
        "job": {"name": "demo", "namespace": "ml", "uid": uid, "attempt": attempt},
        **extra,
    }, env={})


def run_attempt(cfg, steps, tmp_path, finished: bool, **kw) -> Tracker:
    tracker = build_tracker(cfg, local_dir=str(tmp_path / f"local-{cfg.job.attempt}"), **kw)
    for step in steps:
        tracker.log_metrics(step, {"actor/pg_loss": step / 10, "critic/advantages/mean": -step,
                                   "perf/throughput": 100.0 * step})
    tracker.log_tags({"rft.weights.uri": f"{cfg.checkpoint.uri}/weights/step-{steps[-1]:08d}"}, steps[-1])
    tracker.close(finished=finished)
    return tracker


# ------------------------------------------------------------------ TensorBoard on S3

def test_tensorboard_event_files_on_s3_one_run_per_attempt(bucket, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root = f"s3://{bucket}/jobs/demo"
    run_attempt(config(root, {"tensorboard": {}}, attempt=0), [1, 2, 3], tmp_path, finished=False)
    run_attempt(config(root, {"tensorboard": {}}, attempt=1), [3, 4, 5], tmp_path, finished=True)

    storage, local = get_storage(root), tmp_path / "downloaded"
    objects = storage.list(f"{root}/tensorboard/")
    assert {o.split("/")[-2] for o in objects} == {"attempt-000", "attempt-001"}
    for uri in objects:
        path = local / uri[len(f"{root}/tensorboard/"):]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(storage.read_bytes(uri))
    runs = {}
    for attempt in ("attempt-000", "attempt-001"):
        acc = EventAccumulator(str(local / attempt))
        acc.Reload()
        assert {"actor/pg_loss", "critic/advantages/mean", "perf/throughput"} <= set(acc.Tags()["scalars"])
        runs[attempt] = [(e.step, round(e.value, 6)) for e in acc.Scalars("actor/pg_loss")]
        assert "rft/config/text_summary" in acc.Tags()["tensors"]  # the resolved spec, as text
    assert runs == {"attempt-000": [(1, 0.1), (2, 0.2), (3, 0.3)], "attempt-001": [(3, 0.3), (4, 0.4), (5, 0.5)]}


def test_tensorboard_uploads_on_each_flush_interval_before_the_end(tmp_path):
    root = str(tmp_path / "job")
    tracker = build_tracker(config(root, {"tensorboard": {}}), local_dir=str(tmp_path / "local"),
                            flush_seconds=0.2)
    tracker.log_metrics(1, {"actor/pg_loss": 0.5})
    storage = get_storage(root)
    first = wait_for(lambda: storage.list(f"{root}/tensorboard/attempt-000/"), timeout=30, interval=0.05,
                     message="the first upload")
    size = len(storage.read_bytes(first[0]))
    tracker.log_metrics(2, {"actor/pg_loss": 0.4})
    wait_for(lambda: len(storage.read_bytes(first[0])) > size, timeout=30, interval=0.05,
             message="the grown event file uploaded again")
    tracker.close(finished=True)
    assert tracker.status()["tensorboard"] == {"ok": True, "error": None, "dropped": 0, "lastStep": 2}


# ------------------------------------------------------------------ MLflow

def test_mlflow_one_run_across_a_restart_params_tags_and_steps(mlflow_server, bucket, tmp_path):
    root = f"s3://{bucket}/jobs/demo"
    tracking = {"mlflow": {"trackingUri": mlflow_server, "experiment": "rft-demo"}}
    first = run_attempt(config(root, tracking, attempt=0), [1, 2, 3], tmp_path, finished=False)
    assert first.status()["mlflow"] == {"ok": True, "error": None, "dropped": 0, "lastStep": 3}
    record = json.loads(get_storage(root).read_bytes(mlflow_state_uri(root)))
    run_id = record["run_id"]
    assert rest(mlflow_server, "runs/get", run_id=run_id)["run"]["info"]["status"] == "KILLED"

    # The restarted attempt: a new Tracker, attempt 1, the spec's totalSteps edited meanwhile.
    second_cfg = config(root, tracking, attempt=1, trainer={"total_steps": 9, "batch_size": 8, "gpus_per_node": 0})
    run_attempt(second_cfg, [4, 5, 6], tmp_path, finished=True)
    assert json.loads(get_storage(root).read_bytes(mlflow_state_uri(root)))["run_id"] == run_id

    experiment = rest(mlflow_server, "experiments/get-by-name", experiment_name="rft-demo")["experiment"]
    with urllib.request.urlopen(urllib.request.Request(
            f"{mlflow_server}/api/2.0/mlflow/runs/search", method="POST", headers={"Content-Type": "application/json"},
            data=json.dumps({"experiment_ids": [experiment["experiment_id"]]}).encode()), timeout=10) as r:
        runs = json.loads(r.read())["runs"]
    assert [r["info"]["run_id"] for r in runs] == [run_id]  # one run for the job
    history = rest(mlflow_server, "metrics/get-history", run_id=run_id, metric_key="actor/pg_loss")["metrics"]
    assert [(m["step"], round(m["value"], 6)) for m in history] == [(s, s / 10) for s in range(1, 7)]
    assert [m["step"] for m in rest(mlflow_server, "metrics/get-history", run_id=run_id,
                                    metric_key="critic/advantages/mean")["metrics"]] == [1, 2, 3, 4, 5, 6]
    run = rest(mlflow_server, "runs/get", run_id=run_id)["run"]
    assert run["info"]["status"] == "FINISHED"
    params = {p["key"]: p["value"] for p in run["data"]["params"]}
    tags = {t["key"]: t["value"] for t in run["data"]["tags"]}
    assert params["algorithm.name"] == "grpo" and params["algorithm.learning_rate"] == "0.0001"
    assert params["trainer.total_steps"] == "6" and tags["rft.changed.trainer.total_steps"] == "9"
    assert params["checkpoint.uri"] == root and params["job.name"] == "demo"
    assert tags["rft.weights.uri"] == f"{root}/weights/step-00000006"
    assert tags["rft.job"] == "demo" and tags["mlflow.runName"] == "demo"


def test_mlflow_takes_metric_names_it_would_refuse_renamed_and_keeps_the_step(mlflow_server, bucket, tmp_path):
    """MLflow refuses a whole batch (HTTP 400) for one name with `@` (the evaluation's
    `eval/pass@4`): the step's other metrics would go with it. Renamed as verl does."""
    root = f"s3://{bucket}/jobs/names"
    tracker = build_tracker(config(root, {"mlflow": {"trackingUri": mlflow_server, "experiment": "rft-names"}}),
                            local_dir=str(tmp_path / "local"))
    tracker.log_metrics(1, {"actor/pg_loss": 0.5, "eval/pass@4": 0.25, "odd(name)": 1.0})
    tracker.close(finished=True)
    assert tracker.status()["mlflow"]["dropped"] == 0
    run_id = json.loads(get_storage(root).read_bytes(mlflow_state_uri(root)))["run_id"]
    got = {key: [m["value"] for m in rest(mlflow_server, "metrics/get-history", run_id=run_id,
                                          metric_key=key)["metrics"]]
           for key in ("actor/pg_loss", "eval/pass_at_4", "odd_name_")}
    assert got == {"actor/pg_loss": [0.5], "eval/pass_at_4": [0.25], "odd_name_": [1.0]}


# ------------------------------------------------------------------ a tracker that is down

class Recorder:
    """Stands in for the status reporter: keeps `status.trainer` as merge patches build it."""

    def __init__(self):
        self.trainer: dict = {}
        self.lock = threading.Lock()

    def report_tracking(self, tracking):
        with self.lock:
            for key, value in tracking.items():
                self.trainer.setdefault("tracking", {})[key] = dict(value)

    def __getattr__(self, name):  # report_step, report_checkpoint, close, ...
        return lambda *a, **kw: None


def test_an_unreachable_tracker_never_stops_training_and_never_shows_the_password(
        tmp_path, world_of_one, monkeypatch, caplog, capfd):
    import rft_trainer.trainer as trainer_module
    from rft_trainer.trainer import Trainer

    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "rft")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", SECRET)
    recorder = Recorder()
    monkeypatch.setattr(trainer_module.StatusReporter, "from_env", classmethod(lambda cls, **kw: recorder))
    caplog.set_level(logging.DEBUG)
    save_tiny_model(tmp_path / "model")
    for i in range(3):
        write_shard(str(tmp_path / "buffer"), f"shard-{i:04d}", synthetic_batch(8, 4, 6, vocab=24, seed=i))
    refused = f"http://127.0.0.1:{free_port()}"  # nothing listens there: connections are refused
    cfg = load_config({
        "model": {"path": str(tmp_path / "model")},
        "algorithm": {"name": "grpo", "learning_rate": 1e-4, "micro_batch_size": 2},
        "trainer": {"total_steps": 3, "batch_size": 8, "gpus_per_node": 0, "fsdp": {"mixed_precision": "fp32"}},
        "checkpoint": {"uri": str(tmp_path / "ckpt"), "interval": 100},
        "buffer": {"uri": str(tmp_path / "buffer")},
        "tracking": {"mlflow": {"trackingUri": refused, "experiment": "e"}, "tensorboard": {}},
    }, env={})
    trainer = Trainer(cfg)
    trainer.prepare()
    started = time.monotonic()
    assert asyncio.run(trainer.train()) == "finished" and trainer.train_step_num == 3
    assert time.monotonic() - started < 60
    monkeypatch.setattr(trainer_module, "TRACKING_CLOSE_SECONDS", 1.0)
    with monkeypatch.context() as m:  # the fixture destroys the process group
        m.setattr(trainer_module.torch.distributed, "is_initialized", lambda: False)
        asyncio.run(trainer.shutdown())  # closes the trackers: gives up on mlflow after 1 s

    tracking = recorder.trainer["tracking"]
    assert tracking["mlflow"]["ok"] is False and "Connection" in tracking["mlflow"]["error"]
    assert tracking["mlflow"]["lastStep"] is None
    assert tracking["tensorboard"] == {"ok": True, "error": None, "dropped": 0, "lastStep": 3}
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(tmp_path / "ckpt" / "tensorboard" / "attempt-000"))
    acc.Reload()  # each step's rollouts table, from the batch it trained
    assert [e.step for e in acc.Tensors("rollouts/samples/text_summary")] == [1, 2, 3]
    assert any("tracking: mlflow failed" in r.getMessage() for r in caplog.records)
    out, err = capfd.readouterr()
    shown = json.dumps(recorder.trainer) + out + err + "\n".join(r.getMessage() for r in caplog.records)
    assert SECRET not in shown


class FlakyBackend:
    """Fails until `healed`; records what it received."""

    name = "flaky"

    def __init__(self, error: Exception | None = None):
        self.healed, self.error, self.steps, self.closed = False, error, [], None

    def open(self):
        pass

    def write(self, events):
        if not self.healed:
            raise self.error or ConnectionRefusedError(111, "Connection refused")
        self.steps += [e.step for e in events]

    def flush(self):
        pass

    def close(self, finished):
        self.closed = finished


def test_a_full_queue_drops_the_oldest_reports_and_counts_them():
    backend, states = FlakyBackend(), []
    tracker = Tracker([backend], report=states.append, capacity=5, backoff=lambda n: 0.01)
    for step in range(1, 13):
        tracker.log_metrics(step, {"actor/pg_loss": 1.0})
    wait_for(lambda: tracker.status()["flaky"]["dropped"] == 7 and tracker.status()["flaky"]["ok"] is False,
             timeout=10, interval=0.01)
    backend.healed = True
    tracker.close(finished=True, timeout=10)
    assert backend.steps == [8, 9, 10, 11, 12] and backend.closed is True
    assert tracker.status()["flaky"] == {"ok": True, "error": None, "dropped": 7, "lastStep": 12}
    assert any(s["flaky"]["ok"] is False and s["flaky"]["lastStep"] is None and
               s["flaky"]["error"] == "ConnectionRefusedError: [Errno 111] Connection refused" for s in states)


def test_refused_reports_are_dropped_not_retried_and_errors_never_carry_secrets(monkeypatch, caplog):
    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    backend = FlakyBackend(Rejected(f"400 bad metric for https://user:{SECRET}@mlflow/ key {SECRET}"))
    tracker = Tracker([backend], backoff=lambda n: 0.01)
    tracker.log_metrics(1, {"x": 1.0})
    wait_for(lambda: tracker.status()["flaky"]["dropped"] == 1, timeout=10, interval=0.01)
    backend.healed = True
    tracker.log_metrics(2, {"x": 1.0})
    tracker.close(finished=True, timeout=10)
    assert backend.steps == [2] and tracker.status()["flaky"]["lastStep"] == 2
    assert "***" in caplog.text and SECRET not in caplog.text


def test_close_gives_up_in_time_on_a_tracker_that_hangs(caplog):
    class Hanging(FlakyBackend):
        def write(self, events):
            time.sleep(5)

    worker_backend = Hanging()
    tracker = Tracker([worker_backend], backoff=lambda n: 0.01)
    tracker.log_metrics(1, {"x": 1.0})
    started = time.monotonic()
    tracker.close(finished=True, timeout=0.5)
    assert time.monotonic() - started < 2
    assert "reports NOT delivered at exit" in caplog.text


def test_logging_a_step_costs_microseconds_whatever_the_backends_do():
    class Slow(FlakyBackend):
        def write(self, events):
            time.sleep(0.05)

    tracker = Tracker([Slow()], backoff=lambda n: 0.01)
    metrics = {f"actor/m{i}": float(i) for i in range(30)}
    started = time.perf_counter()
    for step in range(1, 1001):
        tracker.log_metrics(step, metrics)
    per_step = (time.perf_counter() - started) / 1000
    tracker.close(finished=True, timeout=0.1)
    assert per_step < 0.001, per_step


# ------------------------------------------------------------------ W&B offline

def test_wandb_offline_writes_its_run_files_and_uploads_them(tmp_path):
    root = str(tmp_path / "job")
    tracking = {"wandb": {"project": "rft-demo", "mode": "offline"}}
    tracker = run_attempt(config(root, tracking), [1, 2, 3], tmp_path, finished=True)
    assert tracker.status()["wandb"]["ok"] is True and tracker.status()["wandb"]["lastStep"] == 3
    runs = list((tmp_path / "local-0" / "wandb-run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    data = next(runs[0].glob("run-*.wandb")).read_bytes()
    assert b"actor/pg_loss" in data and b"critic/advantages/mean" in data
    uploaded = get_storage(root).list(f"{root}/tracking/wandb/")
    assert any(u.endswith(".wandb") and runs[0].name in u for u in uploaded)


# ------------------------------------------------------------------ rollouts you can read

def test_every_tracker_shows_each_step_s_rollouts_as_a_table_cut_and_scrubbed(mlflow_server, tmp_path, monkeypatch):
    """log_samples: a W&B table, an MLflow table artifact, TensorBoard markdown, each read
    back from what the tracker wrote; a long response is cut, a credential scrubbed."""
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    root = str(tmp_path / "job")
    tracking = {"tensorboard": {}, "mlflow": {"trackingUri": mlflow_server, "experiment": "rft-rollouts"},
                "wandb": {"project": "rft-demo", "mode": "offline"}}
    tracker = build_tracker(config(root, tracking), local_dir=str(tmp_path / "local"))
    rows = [{"step": 3, "version": 1, "lag": 1, "reward": 1.0, "task_id": "t-7", "finish_reason": "stop",
             "prompt": "What is 2 + 3?", "response": "5 | five\nfive"},
            {"step": 3, "version": 2, "lag": 0, "reward": 0.0, "task_id": "t-8", "finish_reason": "length",
             "prompt": f"key {SECRET}", "response": "x" * 5000}]
    tracker.log_metrics(3, {"actor/pg_loss": 0.1})
    tracker.log_samples(3, rows)
    tracker.close(finished=True)
    assert all(s["ok"] and s["dropped"] == 0 for s in tracker.status().values()), tracker.status()

    acc = EventAccumulator(str(tmp_path / "local" / "tensorboard" / "attempt-000"))
    acc.Reload()
    (event,) = acc.Tensors("rollouts/samples/text_summary")
    text = event.tensor_proto.string_val[0].decode()
    assert event.step == 3 and "| step | version | lag | reward |" in text and "5 \\| five<br>five" in text
    assert SECRET not in text and "key ***" in text and "x" * 1997 + "..." in text and "x" * 1998 not in text

    run_id = json.loads(get_storage(root).read_bytes(mlflow_state_uri(root)))["run_id"]
    path = MlflowClient(mlflow_server).download_artifacts(run_id, "rollouts/step-00000003.json", str(tmp_path / "dl"))
    table = json.loads(open(path).read())
    assert table["columns"] == ["step", "version", "lag", "reward", "task_id", "finish_reason", "prompt", "response"]
    assert [r[:6] for r in table["data"]] == [[3, 1, 1, 1.0, "t-7", "stop"], [3, 2, 0, 0.0, "t-8", "length"]]
    assert table["data"][1][6] == "key ***" and len(table["data"][1][7]) == 2000
    import pandas
    frame = pandas.read_json(path, orient="split")  # the layout of MLflow's tables
    assert list(frame.columns) == table["columns"] and list(frame["task_id"]) == ["t-7", "t-8"]

    (run,) = (tmp_path / "local" / "wandb-run" / "wandb").glob("offline-run-*")
    (wandb_table,) = run.glob("files/media/table/rollouts/samples_3_*.table.json")
    data = json.loads(wandb_table.read_text())
    assert data["columns"] == table["columns"] and [r[4] for r in data["data"]] == ["t-7", "t-8"]
    assert SECRET not in wandb_table.read_text()


def test_a_tracker_that_is_down_keeps_at_most_100_tables_and_every_metric_report():
    """Tables cost up to hundreds of KB each: while a backend is down the oldest beyond
    SAMPLES_CAPACITY are left out (counted apart), never a metric report."""
    from rft_trainer.tracking import SAMPLES_CAPACITY

    backend = FlakyBackend()
    tracker = Tracker([backend], backoff=lambda n: 0.01)
    for step in range(1, 251):
        tracker.log_metrics(step, {"actor/pg_loss": 1.0})
        tracker.log_samples(step, [{"step": step, "response": "x"}])
    worker = tracker.workers[0]
    with worker._cond:
        tables = [ev.step for ev in worker._queue if ev.kind == "samples"]
        metrics = [ev.step for ev in worker._queue if ev.kind == "metrics"]
    assert len(tables) <= SAMPLES_CAPACITY + worker.batch_size and tables[-1] == 250  # the newest kept
    assert worker.dropped_tables >= 250 - SAMPLES_CAPACITY - worker.batch_size
    backend.healed = True
    tracker.close(finished=True)
    assert sorted(set(s for s in backend.steps)) == list(range(1, 251))  # every metric step delivered
    assert tracker.status()["flaky"]["dropped"] == 0


def test_an_mlflow_table_that_fails_skips_tables_for_a_while_and_keeps_the_metrics(mlflow_server, tmp_path,
                                                                                  monkeypatch, caplog):
    root = str(tmp_path / "job")
    tracking = {"mlflow": {"trackingUri": mlflow_server, "experiment": "rft-tables-down"}}
    tracker = build_tracker(config(root, tracking), local_dir=str(tmp_path / "local"))
    backend = tracker.workers[0].backend
    calls = []

    def refused(*a, **kw):
        calls.append(a)
        raise ConnectionError("artifact store unreachable")

    backend.open()
    monkeypatch.setattr(backend.client, "log_text", refused)
    for step in (1, 2, 3):
        tracker.log_metrics(step, {"actor/pg_loss": step / 10})
        tracker.log_samples(step, [{"step": step, "response": "x"}])
    tracker.close(finished=True)
    run_id = json.loads(get_storage(root).read_bytes(mlflow_state_uri(root)))["run_id"]
    history = rest(mlflow_server, "metrics/get-history", run_id=run_id, metric_key="actor/pg_loss")["metrics"]
    assert [m["step"] for m in history] == [1, 2, 3] and tracker.status()["mlflow"]["ok"]
    assert len(calls) == 1 and backend.table_failures == 3  # tried once, then skipped
    assert sum("tables are skipped" in r.getMessage() for r in caplog.records) == 1


def test_a_secret_across_the_cut_is_scrubbed_whole_and_nan_is_none(monkeypatch):
    from rft_trainer.tracking import sample_row

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    row = sample_row({"prompt": "a" * 1990 + SECRET, "reward": float("nan")})
    assert row["prompt"] == "a" * 1990 + "***" and row["reward"] is None
    row = sample_row({"response": "b" * 1995 + SECRET + "c" * 10})
    assert SECRET[:3] not in row["response"] and row["response"].endswith("...") and len(row["response"]) == 2000


def test_the_trainer_picks_the_rows_from_the_batch_it_trained():
    from rft_trainer.trainer import rollout_rows

    batch = synthetic_batch(8, 4, 6, vocab=24, seed=0)
    batch.weights_version = torch.tensor([4, 4, 5, 5, 3, 3, 5, 5])
    batch.info = [{"task_id": f"t{i}", "prompt": f"p{i}", "response": f"r{i}", "finish_reason": "stop"}
                  for i in range(8)]
    rows = rollout_rows(batch, step=6, k=3)
    assert rows == rollout_rows(batch, step=6, k=3) and len(rows) == 3  # the same rows on every run
    for r in rows:
        i = int(r["task_id"][1:])
        assert r == {"step": 6, "version": batch.weights_version[i].item(), "lag": 5 - batch.weights_version[i].item(),
                     "reward": float(batch.rewards[i]), "task_id": f"t{i}", "finish_reason": "stop",
                     "prompt": f"p{i}", "response": f"r{i}"}
    assert len(rollout_rows(batch, step=6, k=64)) == 8 and rollout_rows(batch, step=6, k=0) == []
    bare = synthetic_batch(4, 4, 6, vocab=24, seed=1)  # a hand-written buffer: no versions, no texts
    assert [(r["version"], r["lag"], r["prompt"]) for r in rollout_rows(bare, step=2, k=2)] == [(None, None, None)] * 2


def test_a_role_gets_runs_of_its_own_beside_the_trainers(tmp_path):
    """build_tracker(role=...): the explorer's MLflow run id file, W&B run id and upload
    place, and TensorBoard run all differ from the trainer's, named after the role (a W&B
    run id must not collide: the role is part of the hash); the trainer's are unchanged."""
    from rft_trainer.tracking import explorer_role

    root = str(tmp_path / "job")
    tracking = {"tensorboard": {}, "wandb": {"project": "p", "mode": "offline"},
                "mlflow": {"tracking_uri": "http://127.0.0.1:9", "experiment": "e"}}
    backends = {}
    for role in (None, explorer_role(0, 1), explorer_role(1, 2)):
        tracker = build_tracker(config(root, tracking, attempt=3), local_dir=str(tmp_path / f"l-{role}"), role=role)
        backends[role] = {w.name: w.backend for w in tracker.workers}
        tracker.close(finished=False, timeout=1)
    assert [explorer_role(0, 1), explorer_role(1, 2)] == ["explorer", "explorer-1"]
    names = {role: (b["mlflow"].run_name, b["mlflow"].state_uri, b["wandb"].run_name, b["wandb"].upload_uri,
                    b["tensorboard"].dest) for role, b in backends.items()}
    assert names == {
        None: ("demo", f"{root}/tracking/mlflow-run.json", "demo", f"{root}/tracking/wandb",
               f"{root}/tensorboard/attempt-003"),
        "explorer": ("demo_explorer", f"{root}/tracking/mlflow-run-explorer.json", "demo_explorer",
                     f"{root}/tracking/wandb-explorer", f"{root}/tensorboard/explorer"),
        "explorer-1": ("demo_explorer-1", f"{root}/tracking/mlflow-run-explorer-1.json", "demo_explorer-1",
                       f"{root}/tracking/wandb-explorer-1", f"{root}/tensorboard/explorer-1")}
    assert len({b["wandb"].run_id for b in backends.values()}) == 3
    assert backends[None]["mlflow"].tags["rft.attempt"] == "3" and "rft.attempt" not in backends["explorer"]["mlflow"].tags
