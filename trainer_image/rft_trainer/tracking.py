"""Experiment tracking (`spec.tracking`): rank 0 sends each step's metrics, under verl's
names (`actor/pg_loss`, ...), to TensorBoard, MLflow and Weights & Biases.

A tracker that is down never stops or slows training:
* `Tracker.log_metrics` only appends to one bounded queue per backend and returns. When a
  queue is full (the tracker has been down for a while) the oldest report is dropped and
  counted.
* Each backend has its own thread, so a slow MLflow server does not hold TensorBoard
  back. Every call into a backend is guarded: a failure is retried with capped backoff,
  the reports staying queued; a report the tracker refuses (HTTP 4xx) is dropped and
  counted instead of blocking the queue.
* How each fares goes to `status.trainer.tracking.<backend>` (`ok`, `error`, `dropped`,
  `lastStep`) through the trainer's status reporter, and to the log on the first failure,
  every minute while it lasts, and on recovery.
* Credentials (the trackers' Secret keys of rft_contract.trackers, the S3 secret) come
  from the environment, read by the clients themselves; an error message is
  scrubbed of their values before it is logged or reported.

Where things go, `<root>` being `checkpoint.uri`:

    <tensorboard.uri or <root>/tensorboard>/attempt-NNN/events.out.tfevents.*   one run per attempt
    <tensorboard.uri or <root>/tensorboard>/explorer/...   the explorer's rollouts (explorer-<i> for several)
    <root>/tracking/mlflow-run.json   the MLflow run of the job: a resumed attempt continues it
    <root>/tracking/mlflow-run-explorer.json   the explorer's run, `<job>_explorer`
    <root>/tracking/wandb/            W&B's offline run files, for `wandb sync` (wandb-explorer/ the explorer's)

Rollouts you can read: each step, `spec.tracking.rolloutSamples` (default 4) of the batch's
samples (`SAMPLE_COLUMNS`: step, weights version, lag, reward, task, prompt, response; texts cut
at MAX_SAMPLE_CHARS and scrubbed by `redact`) go to every backend as `rollouts/samples`: a
W&B table, an MLflow table artifact `rollouts/step-NNNNNNNN.json` (a failed artifact upload is
logged and skipped: it never holds the metrics back), TensorBoard text (a markdown table).

The explorers log each shard's rollout figures (`rollout/rewards/mean`, ...; step = the
explorer's shard count) to runs of their own (`build_tracker(role=...)`), as Trinity-RFT
makes one run per role.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import math
import os
import re
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, NamedTuple

from rft_contract.storage import Storage, get_storage, join, upload_file
from rft_contract.podconfig import render as render_pod_config
from rft_contract.trackers import MAX_SAMPLE_CHARS, REDACTED_ENV, TRACKERS

from .reporting import backoff_delay

log = logging.getLogger("rft_trainer.tracking")

TENSORBOARD = "tensorboard"
TRACKING = "tracking"
MLFLOW_RUN_FILE = "mlflow-run.json"
# Environment variables whose values never appear in a log line or the status: the
# trackers' Secret keys (the catalogue's, rft_contract.trackers) and the S3 secret.
SECRET_ENV = REDACTED_ENV + ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
QUEUE_CAPACITY = 10_000  # reports (one per step) kept per backend while it is down
FLUSH_SECONDS = 30.0
FAILING_LOG_EVERY = 60.0
MAX_ERROR_CHARS = 300
SAMPLES = "rollouts/samples"  # the rollouts table's name in every backend
SAMPLE_COLUMNS = ("step", "version", "lag", "reward", "task_id", "finish_reason", "prompt", "response")
SAMPLES_CAPACITY = 100  # rollouts tables kept per backend while it is down (metrics keep QUEUE_CAPACITY)
TABLE_BACKOFF_SECONDS = 600.0  # after an MLflow table upload failed, tables are skipped this long


def redact(text: str, env: dict[str, str] | None = None) -> str:
    """`text` without the values of SECRET_ENV nor a URL's user:password@."""
    env = os.environ if env is None else env
    for key in SECRET_ENV:
        value = env.get(key) or ""
        if len(value) >= 4:  # a shorter value would mangle ordinary words
            text = text.replace(value, "***")
    return re.sub(r"//[^/@\s]*@", "//***@", text)


def describe_error(e: BaseException) -> str:
    """One line naming the exception, scrubbed of credentials, at most MAX_ERROR_CHARS."""
    line = " ".join(redact(f"{type(e).__name__}: {e}").split())
    return line if len(line) <= MAX_ERROR_CHARS else line[:MAX_ERROR_CHARS - 3] + "..."


class Rejected(Exception):
    """The tracker refused these reports (a 4xx answer): retrying them cannot help."""


class Event(NamedTuple):
    kind: str  # "metrics", "tags" or "samples" ({"rows": [{column: value}]})
    step: int | None
    data: dict[str, Any]
    time: float  # when it was reported: a report delivered late keeps its own time


def scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """The values that are numbers (tensors and numpy scalars included), as floats."""
    out = {}
    for key, value in metrics.items():
        try:
            out[key] = float(value)
        except (TypeError, ValueError):
            continue
    return out


def sample_row(values: dict[str, Any], env: dict[str, str] | None = None) -> dict[str, Any]:
    """One rollouts-table row with every SAMPLE_COLUMNS key: texts cut at MAX_SAMPLE_CHARS
    and scrubbed like the logs, numbers as they are, a missing value None."""
    row = {}
    for column in SAMPLE_COLUMNS:
        value = values.get(column)
        if isinstance(value, str):  # scrubbed before it is cut: a secret across the cut leaves no prefix
            value = redact(value, env)
            value = value if len(value) <= MAX_SAMPLE_CHARS else value[:MAX_SAMPLE_CHARS - 3] + "..."
        elif isinstance(value, float) and not math.isfinite(value):
            value = None  # JSON has no NaN
        row[column] = value
    return row


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The rows as a markdown table (TensorBoard's text plugin renders it)."""
    def cell(v: Any) -> str:
        return "" if v is None else str(v).replace("|", "\\|").replace("\n", "<br>")
    lines = ["| " + " | ".join(SAMPLE_COLUMNS) + " |", "|" + "---|" * len(SAMPLE_COLUMNS)]
    return "\n".join(lines + ["| " + " | ".join(cell(r.get(c)) for c in SAMPLE_COLUMNS) + " |" for r in rows])


def flatten(data: Any, prefix: str = "") -> dict[str, str]:
    """`{"a": {"b": 1}}` -> `{"a.b": "1"}`; lists as JSON; None left out."""
    if isinstance(data, dict) and data:
        out: dict[str, str] = {}
        for key, value in data.items():
            out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    if data is None:
        return {}
    return {prefix: data if isinstance(data, str) else json.dumps(data)}


def build_params(config) -> dict[str, str]:
    """What the run was trained with, flattened: the fields of the pods' config
    (rft_contract.podconfig: what the operator hands the pods, so no secret and no field
    that here would only hold its default) and who the job is, not what changes per
    attempt."""
    job = config.job.model_dump(mode="json", exclude={"attempt", "pod"})
    return flatten(render_pod_config(config, job))


# ------------------------------------------------------------------ one backend's thread

class BackendWorker:
    """Delivers one backend's queue from a daemon thread: `open()` once, `write(events)`
    in batches, `flush()` every `flush_seconds`, `close(finished)` at the end. Calls that
    fail are retried after `backoff(failures)` seconds; `on_status(name, state)` hears of
    every change of `state` ({ok, error, dropped, lastStep})."""

    def __init__(self, backend, on_status: Callable[[str, dict], None], capacity: int = QUEUE_CAPACITY,
                 flush_seconds: float = FLUSH_SECONDS, batch_size: int = 50,
                 backoff: Callable[[int], float] = backoff_delay):
        self.backend, self.name, self.on_status = backend, backend.name, on_status
        self.capacity, self.flush_seconds, self.batch_size, self.backoff = capacity, flush_seconds, batch_size, backoff
        self.state: dict[str, Any] = {"ok": None, "error": None, "dropped": 0, "lastStep": None}
        self._queue: collections.deque[Event] = collections.deque()
        self._tables = 0  # samples events in the queue (at most SAMPLES_CAPACITY)
        self.dropped_tables = 0  # rollouts tables left out while the backend was down
        self._cond = threading.Condition()
        self._opened = self._closing = self._abandoned = self._finished = False
        self._failures, self._down_since, self._last_log = 0, None, 0.0
        self._thread = threading.Thread(target=self._run, name=f"rft-track-{self.name}", daemon=True)
        self._thread.start()

    def put(self, event: Event) -> None:
        with self._cond:
            if self._closing:
                return
            self._queue.append(event)
            self._tables += event.kind == "samples"
            dropped = self._trim()
            self._cond.notify()
        if dropped > 0:
            self._update(dropped=dropped)

    def _trim(self) -> int:
        """Under the lock: at most SAMPLES_CAPACITY tables and `capacity` other reports
        queued, the oldest left out first (tables are counted in `dropped_tables`, not in
        the state's `dropped`, which counts metric reports). Returns the reports left out."""
        if self._tables > SAMPLES_CAPACITY:  # only while the backend is down
            excess, kept = self._tables - SAMPLES_CAPACITY, collections.deque()
            for ev in self._queue:
                if excess and ev.kind == "samples":
                    excess -= 1
                    continue
                kept.append(ev)
            self.dropped_tables += self._tables - SAMPLES_CAPACITY
            self._queue, self._tables = kept, SAMPLES_CAPACITY
        dropped = 0
        while len(self._queue) - self._tables > self.capacity:
            ev = self._queue.popleft()
            if ev.kind == "samples":
                self._tables -= 1
                self.dropped_tables += 1
            else:
                dropped += 1
        return dropped

    def close(self, finished: bool, timeout: float) -> int:
        """Deliver what is queued and close the backend within `timeout` seconds; returns
        the number of reports left undelivered (then the thread is abandoned)."""
        with self._cond:
            self._closing, self._finished = True, finished
            self._cond.notify_all()
        self._thread.join(timeout)
        with self._cond:
            if not self._thread.is_alive():
                return 0
            self._abandoned = True
            self._cond.notify_all()
            return len(self._queue) + 1  # the batch in flight too

    def _run(self) -> None:
        next_flush = time.monotonic() + self.flush_seconds
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closing or self._abandoned,
                                    timeout=max(0.0, next_flush - time.monotonic()))
                if self._abandoned:
                    return
                batch = [self._queue.popleft() for _ in range(min(len(self._queue), self.batch_size))]
                self._tables -= sum(ev.kind == "samples" for ev in batch)
                closing = self._closing and not self._queue
            if not self._deliver(batch):
                self._requeue(batch)
                self._pause()
                continue
            if closing or time.monotonic() >= next_flush:
                if not self._guard(self.backend.flush):
                    self._pause()
                    continue
                next_flush = time.monotonic() + self.flush_seconds
            if closing:
                self._guard(lambda: self.backend.close(self._finished))
                return

    def _deliver(self, batch: list[Event]) -> bool:
        if not self._opened:
            if not self._guard(self.backend.open):
                return False
            self._opened = True
        if not batch:
            return True
        try:
            self.backend.write(batch)
        except Rejected as e:  # retrying cannot help: count them and go on
            self._fail(e, retry=False)
            self._update(dropped=len(batch))
            return True
        except Exception as e:  # noqa: BLE001 - a tracker never stops training
            self._fail(e)
            return False
        steps = [ev.step for ev in batch if ev.kind == "metrics" and ev.step is not None]
        self._succeed(last_step=max(steps) if steps else None)
        return True

    def _guard(self, call: Callable[[], Any]) -> bool:
        try:
            call()
        except Exception as e:  # noqa: BLE001 - a tracker never stops training
            self._fail(e)
            return False
        self._succeed()
        return True

    def _requeue(self, batch: list[Event]) -> None:
        """Put a failed batch back in front, older than anything reported since."""
        with self._cond:
            self._queue.extendleft(reversed(batch))
            self._tables += sum(ev.kind == "samples" for ev in batch)
            dropped = self._trim()
        if dropped:
            self._update(dropped=dropped)

    def _pause(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._abandoned, timeout=self.backoff(self._failures))

    def _fail(self, e: BaseException, retry: bool = True) -> None:
        error, now = describe_error(e), time.monotonic()
        self._failures += retry
        if self._down_since is None:
            self._down_since = self._last_log = now
            log.warning("tracking: %s failed (%s); %s", self.name, error,
                        "retrying in the background" if retry else "dropped the reports it refused")
        elif now - self._last_log >= FAILING_LOG_EVERY:
            self._last_log = now
            log.warning("tracking: %s still failing after %.0fs (%s); %d reports queued", self.name,
                        now - self._down_since, error, len(self._queue))
        self._update(ok=False, error=error)

    def _succeed(self, last_step: int | None = None) -> None:
        if self._down_since is not None:
            log.info("tracking: %s works again after %.0fs", self.name, time.monotonic() - self._down_since)
            self._down_since, self._failures = None, 0
        changes: dict[str, Any] = {"ok": True, "error": None}
        if last_step is not None:
            changes["lastStep"] = last_step
        self._update(**changes)

    def _update(self, dropped: int = 0, **changes: Any) -> None:
        """Apply `changes` to the state and add `dropped` to its count (from either thread);
        report the state if it changed."""
        with self._cond:
            if dropped:
                changes["dropped"] = self.state["dropped"] + dropped
            if all(self.state.get(k) == v for k, v in changes.items()):
                return
            self.state.update(changes)
            state = dict(self.state)
        try:
            self.on_status(self.name, state)
        except Exception as e:  # noqa: BLE001
            log.warning("tracking: reporting %s's state failed: %s", self.name, describe_error(e))


class Tracker:
    """Rank 0's fan-out to the configured backends. `report(tracking)` gets the state of
    every backend whenever one changes (wired to `status.trainer.tracking`)."""

    def __init__(self, backends: Iterable, report: Callable[[dict], None] | None = None, **worker_kw: Any):
        self.report = report
        self.workers = [BackendWorker(b, self._on_status, **worker_kw) for b in backends]

    def log_metrics(self, step: int, metrics: dict[str, Any]) -> None:
        self._put(Event("metrics", step, scalars(metrics), time.time()))

    def log_tags(self, tags: dict[str, Any], step: int | None = None) -> None:
        self._put(Event("tags", step, {k: str(v) for k, v in tags.items()}, time.time()))

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """A table of rollouts (`sample_row`s) at `step`."""
        if rows:
            self._put(Event("samples", step, {"rows": [sample_row(r) for r in rows]}, time.time()))

    def _put(self, event: Event) -> None:
        for worker in self.workers:
            worker.put(event)

    def status(self) -> dict[str, dict]:
        return {w.name: dict(w.state) for w in self.workers}

    def _on_status(self, name: str, state: dict) -> None:
        if self.report is not None:
            self.report({name: state})

    def close(self, finished: bool, timeout: float = 30.0) -> None:
        """Deliver what is queued and end the runs (`finished`: the job is done, else the
        attempt stopped and a later one resumes), within `timeout` seconds overall."""
        deadline = time.monotonic() + timeout
        for worker in self.workers:
            lost = worker.close(finished, max(0.0, deadline - time.monotonic()))
            if lost:
                log.error("tracking: %s: %d reports NOT delivered at exit (gave up after %.0fs; last "
                          "error %s)", worker.name, lost, timeout, worker.state["error"] or "none")


# ------------------------------------------------------------------ backends

class TensorBoardBackend:
    """Event files written locally by tensorboardX, uploaded to `<uri>/attempt-NNN/` on each
    flush and at the end (an object store has no append: a file is uploaded again while
    it grows; past `roll_bytes` a new file is started, so old ones are not re-sent)."""

    name = "tensorboard"

    def __init__(self, uri: str, attempt: int, local_dir: str, config_text: str | None = None,
                 storage: Storage | None = None, roll_bytes: int = 16 << 20, run: str | None = None):
        run = run or f"attempt-{attempt:03d}"  # an explorer's run is its role: every restart adds files to it
        self.dest, self.local = join(uri, run), Path(local_dir) / TENSORBOARD / run
        self.storage = storage or get_storage(uri)
        self.config_text, self.roll_bytes = config_text, roll_bytes
        self.writer = None
        self._files = 0
        self._uploaded: dict[str, int] = {}  # file name -> size uploaded

    def open(self) -> None:
        if self.writer is None:
            # tensorboardX warns on every NaN scalar; NaN is a value worth plotting, not news
            logging.getLogger("tensorboardX.x2num").setLevel(logging.ERROR)
            self._new_writer()
            if self.config_text:
                self.writer.add_text("rft/config", self.config_text, 0)

    def _new_writer(self) -> None:
        from tensorboardX import SummaryWriter

        self.local.mkdir(parents=True, exist_ok=True)
        self._files += 1  # two files opened in the same second must not share a name
        self.writer = SummaryWriter(logdir=str(self.local), flush_secs=3600, max_queue=100_000,
                                    filename_suffix=f".{self._files}")

    def write(self, events: list[Event]) -> None:
        for ev in events:
            if ev.kind == "samples":
                self.writer.add_text(SAMPLES, markdown_table(ev.data["rows"]), ev.step or 0, walltime=ev.time)
                continue
            for key, value in ev.data.items():
                if ev.kind == "metrics":
                    self.writer.add_scalar(key, value, ev.step, walltime=ev.time)
                else:
                    self.writer.add_text(key, value, ev.step or 0, walltime=ev.time)

    def flush(self) -> None:
        self.writer.flush()
        self._upload()
        current = list(self.local.glob(f"events.out.tfevents.*.{self._files}"))
        if current and current[0].stat().st_size >= self.roll_bytes:
            self.writer.close()
            self._upload()
            self._new_writer()

    def _upload(self) -> None:
        for path in sorted(self.local.iterdir()):
            size = path.stat().st_size
            if self._uploaded.get(path.name) != size:
                upload_file(self.storage, path, join(self.dest, path.name))
                self._uploaded[path.name] = size

    def close(self, finished: bool) -> None:
        self.writer.close()
        self._upload()


# MLflow refuses a batch (HTTP 400) with any metric name beyond these characters.
_MLFLOW_NAME_BAD = re.compile(r"[^\w/.\- :]")


def mlflow_metric_name(key: str) -> str:
    """`key` as MLflow takes it: `@` as `_at_` (verl's choice: `eval/pass@4` is
    `eval/pass_at_4`), any other character it refuses as `_`."""
    return _MLFLOW_NAME_BAD.sub("_", key.replace("@", "_at_"))


class MLflowBackend:
    """One MLflow run per job. The first attempt creates it and writes its id to
    `<root>/tracking/mlflow-run.json`; a resumed attempt reads that and continues the run
    (steps continue; params it already has are kept, a changed one is tagged
    `rft.changed.<param>`). Credentials: MLflow's own MLFLOW_TRACKING_USERNAME/PASSWORD or
    MLFLOW_TRACKING_TOKEN."""

    name = "mlflow"

    def __init__(self, tracking_uri: str, experiment: str, state_uri: str, params: dict[str, str],
                 tags: dict[str, str], run_name: str | None = None, storage: Storage | None = None):
        self.tracking_uri, self.experiment, self.state_uri = tracking_uri, experiment, state_uri
        self.params, self.tags, self.run_name = params, tags, run_name
        self.storage = storage or get_storage(state_uri)
        self.client = None
        self.run_id: str | None = None
        self._saved = self._started = False
        self.table_failures = 0  # rollouts tables not uploaded (the artifact store refused or is down)
        self._tables_from = 0.0  # monotonic time before which tables are skipped (after a failure)

    def open(self) -> None:
        # Our worker retries; MLflow's own retries (7, exponential) would hide an outage for minutes.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
        from mlflow.tracking import MlflowClient

        self.client = self.client or MlflowClient(tracking_uri=self.tracking_uri)
        if self.run_id is None:
            self.run_id = self._resumable_run() or self._create_run()
        if not self._saved:  # after a failed write, the same run (not a new one) is retried
            record = {"run_id": self.run_id, "tracking_uri": self.tracking_uri, "experiment": self.experiment}
            self.storage.write_bytes(self.state_uri, json.dumps(record).encode())
            self._saved = True
        if not self._started:
            self._log_params()
            self._started = True

    def _resumable_run(self) -> str | None:
        from mlflow.exceptions import MlflowException

        try:
            record = json.loads(self.storage.read_bytes(self.state_uri))
        except FileNotFoundError:
            return None
        try:
            run = self.client.get_run(record["run_id"])
        except MlflowException as e:
            if e.get_http_status_code() != 404:
                raise
            log.warning("tracking: mlflow run %s of %s is gone; starting a new run", record["run_id"], self.state_uri)
            return None
        if run.info.lifecycle_stage != "active":
            log.warning("tracking: mlflow run %s was deleted; starting a new run", run.info.run_id)
            return None
        self.client.update_run(run.info.run_id, status="RUNNING")
        self._saved = True
        changed = {k: v for k, v in self.params.items() if k in run.data.params and run.data.params[k] != v}
        self.params = {k: v for k, v in self.params.items() if k not in run.data.params}
        self.tags = {**self.tags, **{f"rft.changed.{k}": v for k, v in changed.items()}}
        log.info("tracking: continuing mlflow run %s", run.info.run_id)
        return run.info.run_id

    def _create_run(self) -> str:
        from mlflow.exceptions import MlflowException

        experiment = self.client.get_experiment_by_name(self.experiment)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:
            try:
                experiment_id = self.client.create_experiment(self.experiment)
            except MlflowException:  # created meanwhile by someone else
                experiment_id = self.client.get_experiment_by_name(self.experiment).experiment_id
        run = self.client.create_run(experiment_id, run_name=self.run_name)
        log.info("tracking: mlflow run %s in experiment %r", run.info.run_id, self.experiment)
        return run.info.run_id

    def _log_params(self) -> None:
        from mlflow.entities import Param, RunTag

        params = [Param(k[:250], v[:6000]) for k, v in self.params.items()]
        tags = [RunTag(k[:250], v[:8000]) for k, v in self.tags.items()]
        for i in range(0, max(len(params), len(tags)), 100):
            self.client.log_batch(self.run_id, params=params[i:i + 100], tags=tags[i:i + 100])

    def write(self, events: list[Event]) -> None:
        from mlflow.entities import Metric, RunTag
        from mlflow.exceptions import MlflowException

        metrics = [Metric(mlflow_metric_name(k), v, int(ev.time * 1000), ev.step or 0)
                   for ev in events if ev.kind == "metrics" for k, v in ev.data.items()]
        tags = {k: v for ev in events if ev.kind == "tags" for k, v in ev.data.items()}
        try:
            for i in range(0, len(metrics), 1000):
                self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])
            if tags:
                self.client.log_batch(self.run_id, tags=[RunTag(k, v[:8000]) for k, v in tags.items()])
        except MlflowException as e:
            code = e.get_http_status_code()
            if 400 <= code < 500 and code not in (401, 403, 408, 429):
                raise Rejected(describe_error(e)) from None
            raise
        for ev in events:
            if ev.kind == "samples":
                self._log_table(ev.step or 0, ev.data["rows"])

    def _log_table(self, step: int, rows: list[dict[str, Any]]) -> None:
        """One JSON artifact per step in the layout of MLflow's table files (pandas'
        "split" orient), written as text: `log_table` needs pandas, which mlflow-skinny (the
        trainer image's) lacks, and on every call re-reads the run and grows one run tag
        (`mlflow.loggedArtifacts`, which `mlflow.load_table` searches) past MLflow's tag
        size limit within a few hundred steps. A tracking server without an artifact store the trainer can
        reach must not hold the metrics back, so a failure is logged (the first, then every
        100th) and the table skipped."""
        if time.monotonic() < self._tables_from:
            self.table_failures += 1
            return
        table = {"columns": list(SAMPLE_COLUMNS), "data": [[r[c] for c in SAMPLE_COLUMNS] for r in rows]}
        try:
            self.client.log_text(self.run_id, json.dumps(table), f"rollouts/step-{step:08d}.json")
        except Exception as e:  # noqa: BLE001 - a table is never worth the metrics
            # A store that fails slowly (a direct s3:// artifact root whose client retries)
            # must not cost that time on every step: skip tables for a while.
            self.table_failures += 1
            self._tables_from = time.monotonic() + TABLE_BACKOFF_SECONDS
            log.warning("tracking: mlflow: rollouts table of step %d not uploaded (%d so far); tables are "
                        "skipped for %.0fs: %s", step, self.table_failures, TABLE_BACKOFF_SECONDS, describe_error(e))

    def flush(self) -> None:
        pass

    def close(self, finished: bool) -> None:
        # KILLED: the attempt stopped (preemption, a gang restart); the next one sets it RUNNING.
        self.client.set_terminated(self.run_id, status="FINISHED" if finished else "KILLED")


class WandbBackend:
    """A W&B run whose id derives from the job (its uid), so a resumed attempt continues it
    (`resume="allow"`; W&B ignores the steps a resumed attempt replays). Offline, its files
    go to `<root>/tracking/wandb/` on each flush and at the end, for `wandb sync`."""

    name = "wandb"

    def __init__(self, project: str, entity: str | None, mode: str, run_id: str, local_dir: str,
                 params: dict[str, str], upload_uri: str | None, run_name: str | None = None,
                 storage: Storage | None = None):
        self.project, self.entity, self.mode, self.run_id = project, entity, mode, run_id
        self.dir, self.params, self.upload_uri, self.run_name = Path(local_dir), params, upload_uri, run_name
        self.storage = storage or (get_storage(upload_uri) if upload_uri else None)
        self.run = None
        self._table = None  # the run's incremental rollouts table
        self._uploaded: dict[str, int] = {}

    def open(self) -> None:
        if self.run is not None:
            return
        import wandb

        self.dir.mkdir(parents=True, exist_ok=True)
        settings = wandb.Settings(silent=True, console="off", x_disable_stats=True, save_code=False,
                                  disable_git=True)
        self.run = wandb.init(project=self.project, entity=self.entity, mode=self.mode, dir=str(self.dir),
                              id=self.run_id, resume="allow", name=self.run_name, config=self.params,
                              settings=settings, reinit="create_new")

    def write(self, events: list[Event]) -> None:
        for ev in events:
            if ev.kind == "metrics":
                self.run.log(ev.data, step=ev.step)
            elif ev.kind == "samples":
                self._log_table(ev)
            else:
                self.run.summary.update(ev.data)

    def _log_table(self, ev: Event) -> None:
        """One incremental table for the run (a table per step would be an artifact version
        per step); a step W&B has passed (replayed after a resume) is not logged again."""
        import wandb

        if ev.step is not None and ev.step < self.run.step:
            return
        if self._table is None:
            self._table = wandb.Table(columns=list(SAMPLE_COLUMNS), log_mode="INCREMENTAL")
        for r in ev.data["rows"]:
            self._table.add_data(*(r[c] for c in SAMPLE_COLUMNS))
        self.run.log({SAMPLES: self._table}, step=ev.step)

    def flush(self) -> None:
        if self.mode == "offline" and self.upload_uri:
            for path in sorted(p for p in (self.dir / "wandb").rglob("*") if p.is_file()):
                size, rel = path.stat().st_size, path.relative_to(self.dir / "wandb").as_posix()
                if self._uploaded.get(rel) != size:
                    upload_file(self.storage, path, join(self.upload_uri, rel))
                    self._uploaded[rel] = size

    def close(self, finished: bool) -> None:
        self.run.finish(exit_code=0 if finished else 1)
        self.flush()


# ------------------------------------------------------------------ from the config

def mlflow_state_uri(root: str, role: str | None = None) -> str:
    """Where the MLflow run's id is kept: the trainer's `mlflow-run.json`, a role's
    `mlflow-run-<role>.json`."""
    return join(root, TRACKING, MLFLOW_RUN_FILE if role is None else f"mlflow-run-{role}.json")


def explorer_role(index: int, replicas: int) -> str:
    """An explorer's tracking role: `explorer`, or `explorer-<i>` when there are several
    (each its own run: their shards are counted apart)."""
    return "explorer" if replicas == 1 else f"explorer-{index}"


class RunContext(NamedTuple):
    """What every backend's run is named and kept by (`build_tracker`)."""

    root: str  # checkpoint.uri
    job: Any  # config.job
    role: str | None  # None: the trainer's rank 0; else `explorer_role`
    local_dir: str
    params: dict
    run_name: str | None
    env: Any  # config.env (rft_contract.podenv.PodEnv): the S3 client's knobs

    def storage(self, uri: str) -> Storage:
        return get_storage(uri, self.env)


def _tensorboard(spec, ctx: RunContext):
    uri = spec.uri or join(ctx.root, TENSORBOARD)
    return TensorBoardBackend(uri, ctx.job.attempt, ctx.local_dir, storage=ctx.storage(uri),
                              config_text=json.dumps(ctx.params, indent=1, sort_keys=True), run=ctx.role)


def _mlflow(spec, ctx: RunContext):
    job, role = ctx.job, ctx.role
    tags = {"rft.job": job.name, "rft.namespace": job.namespace, "rft.uid": job.uid,
            "rft.checkpoint_uri": ctx.root, "rft.role": role or "trainer",
            "rft.attempt": None if role else str(job.attempt)}  # an explorer outlives the gang's attempts
    state = mlflow_state_uri(ctx.root, role)
    return MLflowBackend(spec.tracking_uri, spec.experiment, state, ctx.params,
                         {k: v for k, v in tags.items() if v}, run_name=ctx.run_name, storage=ctx.storage(state))


def _wandb(spec, ctx: RunContext):
    role = ctx.role
    run_id = "rft-" + hashlib.sha256(((ctx.job.uid or ctx.root) + (f"/{role}" if role else "")).encode()).hexdigest()[:16]
    upload = join(ctx.root, TRACKING, "wandb" if role is None else f"wandb-{role}")
    return WandbBackend(spec.project, spec.entity, spec.mode, run_id, str(Path(ctx.local_dir) / "wandb-run"),
                        ctx.params, upload, run_name=ctx.run_name, storage=ctx.storage(upload))


# The catalogue's trackers (rft_contract.trackers), by name: spec.tracking.<name> -> its backend.
BACKENDS: dict[str, Callable[[Any, RunContext], Any]] = {
    "tensorboard": _tensorboard,
    "mlflow": _mlflow,
    "wandb": _wandb,
}


def build_tracker(config, report: Callable[[dict], None] | None = None, local_dir: str | None = None,
                  role: str | None = None, **worker_kw: Any) -> Tracker | None:
    """The trackers `config.tracking` names (None: none), for the trainer's rank 0 (`role`
    None) or another role (`explorer_role`). Event and run files are written under
    `local_dir` (default a new temp dir) before they are uploaded.

    As Trinity-RFT does, a role other than the trainer gets runs of its own beside the
    trainer's: MLflow and W&B runs named `<job>_<role>` (continued across the pod's
    restarts like the trainer's across attempts), and the TensorBoard run `<role>` next to
    the trainer's `attempt-NNN` ones."""
    spec = config.tracking
    sections = {name: getattr(spec, name) for name in TRACKERS if getattr(spec, name, None)} if spec else {}
    if not sections:
        return None
    job = config.job
    ctx = RunContext(config.checkpoint.uri, job, role, local_dir or tempfile.mkdtemp(prefix="rft-tracking-"),
                     build_params(config), (f"{job.name}_{role}" if role else job.name) or None, config.env)
    return Tracker([BACKENDS[name](section, ctx) for name, section in sections.items()], report, **worker_kw)
