"""Per-step training metrics, kept next to the checkpoints as JSON Lines.

Layout (one object per attempt, one JSON object per line):

    <checkpoint.uri>/metrics/attempt-000.jsonl   {"step": 1, "time": ..., "attempt": 0, "actor/pg_loss": ...}
    <checkpoint.uri>/metrics/attempt-001.jsonl   after a restart: resumes from the checkpoint, so
                                                 it repeats the steps logged after that save

Object stores have no append, so rank 0 keeps its attempt's lines in memory and rewrites
the whole object every `flush_every` steps or `flush_seconds` (and on close), from a
background thread. A failed write is logged and retried at the next flush, never raised:
metrics must not stop or stall training.
`read_metrics` merges the attempts into one history, a later attempt's step replacing an
earlier one's.
"""

from __future__ import annotations

import json
import logging
import math
import re
import threading
import time
from typing import Any, Callable

from rft_contract.layout import METRICS, metrics_uri
from rft_contract.storage import Storage, get_storage, join

log = logging.getLogger("rft_trainer.metrics")

_ATTEMPT_FILE = re.compile(r"/attempt-(\d+)\.jsonl$")


def _jsonable(v: Any) -> Any:
    """Tensors and numpy scalars become floats; NaN/inf become null (strict JSON)."""
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    try:
        v = float(v)
    except (TypeError, ValueError):
        return str(v)
    return v if math.isfinite(v) else None


class MetricsLog:
    """Rank 0's log of one attempt. Writes go out from a background thread (a slow or
    unreachable store must not stall the step); `background=False` writes inline."""

    def __init__(self, uri_prefix: str, attempt: int, flush_every: int = 10, flush_seconds: float = 30.0,
                 storage: Storage | None = None, clock: Callable[[], float] = time.time,
                 background: bool = True):
        self.uri = metrics_uri(uri_prefix, attempt)
        self.attempt, self.flush_every, self.flush_seconds = attempt, flush_every, flush_seconds
        self.storage = storage or get_storage(uri_prefix)
        self.clock = clock
        self.failures = 0
        # A process restarted within the same attempt keeps what that attempt logged.
        self._data = bytearray(self._read_existing())
        self._written = len(self._data)  # bytes of _data the stored object holds
        self._since, self._last = 0, time.monotonic()  # appends and time since the last flush was due
        self._cond = threading.Condition()
        self._write_lock = threading.Lock()
        self._due = self._closed = False
        self._thread = None
        if background:
            self._thread = threading.Thread(target=self._run, name="rft-metrics", daemon=True)
            self._thread.start()

    def _read_existing(self) -> bytes:
        try:
            data = self.storage.read_bytes(self.uri)
        except FileNotFoundError:
            return b""
        except Exception as e:  # noqa: BLE001 - unreadable: start afresh rather than fail
            log.warning("metrics: cannot read %s (%s); starting a new log", self.uri, e)
            return b""
        return data if not data or data.endswith(b"\n") else data + b"\n"

    def append(self, step: int, metrics: dict[str, Any]) -> None:
        line = {"step": step, "time": round(self.clock(), 3), "attempt": self.attempt,
                **{k: _jsonable(v) for k, v in metrics.items()}}
        with self._cond:
            self._data += json.dumps(line, allow_nan=False).encode() + b"\n"
            self._since += 1
            due = self._since >= self.flush_every or time.monotonic() - self._last >= self.flush_seconds
            if due:
                self._since, self._last, self._due = 0, time.monotonic(), True
                self._cond.notify()
        if due and self._thread is None:
            self.flush()

    def _run(self) -> None:
        while True:
            with self._cond:  # the timeout also retries a failed write while no steps come
                self._cond.wait_for(lambda: self._due or self._closed, timeout=self.flush_seconds)
                if self._closed:
                    return
                self._due = False
            self.flush()

    def flush(self) -> bool:
        """Rewrite the attempt's object with every line so far. False if that failed
        (logged; the lines stay in memory and the next flush writes them)."""
        with self._write_lock:  # one write at a time, so a newer object is never overwritten
            with self._cond:
                if self._written == len(self._data):
                    return True
                data = bytes(self._data)
            try:
                self.storage.write_bytes(self.uri, data)
            except Exception as e:  # noqa: BLE001 - never crash training over metrics
                self.failures += 1
                log.warning("metrics: writing %s failed (%s); will retry", self.uri, e)
                return False
            self._written = len(data)
            return True

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()
        self.flush()


def read_metrics(checkpoint_uri: str, storage: Storage | None = None) -> list[dict[str, Any]]:
    """Every step's metrics across attempts, ordered by step. A step logged by several
    attempts (a resumed run replays the steps after its checkpoint) keeps the latest."""
    storage = storage or get_storage(checkpoint_uri)
    files = []
    for uri in storage.list(join(checkpoint_uri, METRICS) + "/"):
        m = _ATTEMPT_FILE.search(uri)
        if m:
            files.append((int(m.group(1)), uri))
    by_step: dict[int, dict[str, Any]] = {}
    for _, uri in sorted(files):
        for n, raw in enumerate(storage.read_bytes(uri).splitlines(), 1):
            try:
                line = json.loads(raw)
                by_step[int(line["step"])] = line
            except (ValueError, KeyError, TypeError):
                log.warning("metrics: skipping bad line %d of %s", n, uri)
    return [by_step[s] for s in sorted(by_step)]
