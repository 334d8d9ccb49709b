"""The sync agent: one per inference pod, beside the engine. Level-triggered.

It watches its RFTJob and converges the engine to `status.weightSync.target`:

    target != served  ->  fetch the weights to local disk (once per version): from the
                          parent replica when it advertises a server, else from S3
                      ->  verify every file against the export's manifest.json (read
                          from S3), in the pass that writes it
                      ->  merge-patch status.weightSync.replicas[<pod>] = {version: null,
                          id: null}, and go no further unless that patch was written
                      ->  ask the engine to reload from that directory (hot: no restart)
                          and to match the export's fingerprint, tensor by tensor
                          (rft_contract.fingerprint; reference and vLLM), and score its
                          probe (rft_contract.probe); the engine is labelled with the
                          version only if both match
                      ->  confirm the engine reports the new version
                      ->  merge-patch status.weightSync.replicas[<pod>]
                          = {version, id, time, loadSeconds, downloadSeconds, probe,
                             fingerprint, ...}

Failures are retried with capped backoff and reported in the same entry (`error`,
`errorTime`, `attempts`) while the old weights keep serving. Two need the engine restarted
(through rft_serving.supervise, in the engine container): weights that fail the probe
after an in-place reload (vLLM's stale tied lm_head) are loaded again by a fresh start
from the same files and checked again; a reload that failed part-way (vLLM then holds a
mix of weights, and its next request kills it) is never resumed: the engine starts again
on the last version that passed, and the export that broke it is not tried again for
`broken_retry_seconds` (a newer one is). The entry's `engineRestarts` and `lastRestart`
say what happened. A restarted agent (or a
restarted engine) is found out by comparing the engine's own report with the target,
so both converge without memory of the past: an engine that reports another version, or
none of ours (vLLM and SGLang restart labelled "default"), is reloaded even if the agent
believes it loaded the target, and its entry first says what the engine reports now.
Target version 0 is the base model (`spec.model.path`), which may have no manifest: it is
then loaded unverified.

The relay (rft_contract.relay): with `peer_server` the agent serves the versions it has, and the one
it is fetching as the bytes arrive, to its children in a tree by replica index (replica i
reads replica (i - 1) // fanout), and advertises the server's URL in its entry (`peer`).
So S3 serves a version about once, whatever the number of replicas; a parent that is
unreachable, slow or corrupt costs its child an S3 read, never a wrong load. The entry's
`source` says where the last fetch came from. On the fast path (a target with `peer` and
`manifest`: rft_trainer.export.FastPath) replica 0's parent is the trainer, and every
replica takes the manifest from its parent when its digest is the target's, else waits for
the version's commit in S3 (weights.fetch).

A load vLLM's fingerprint check refuses (still paused) goes back in place to the last good
version (`Previous`), which serves again: the entry's error names the parameters, nothing
restarts, and the export is held off like a broken one. So does an adapter (a LoRA job)
that vLLM refuses to load, or that fails its probe although the exact check found it in
the LoRA slots as exported (a restart would load the same bytes onto the same base).

vLLM and SGLang start from `<dest>/initial`, a link the init container points at the
weights it fetched; after each load the agent points it at the weights just loaded (and
never deletes what it points at), so an engine container that restarts finds weights.

The entry's `version` is null while a reload may be changing the weights: null is written
(and the write confirmed) before `engine.load` starts, and replaced only after the engine
reports the target (by the new version) or after a failure (by the version the engine
itself reports then, null if it reports none of ours). So, as far as the engine's report
after a failed load is true, the engine serves the weights of the entry's integer version
whenever the entry has one. Exceptions: an engine container that restarts, until the next
pass (at most `resync_seconds` later) finds it out (vLLM and SGLang restart from
`<dest>/initial`, the weights last loaded, except when they restart after a load and
before the link is moved); and SGLang's refused cache flush, after which SGLang has the new
weights but reports the old version (its responses carry their own versions, so explorers
never use the record for it). Explorers that attribute requests to this record (engines
that report no version) read it before and after each request, so a request that ran
during a reload reads null at least once, or two different versions, and is dropped.
They read it from the agent itself, not from the API server: `GET <peer server>/record`
answers {"version", "generation"} from the agent's memory, updated with every entry it
writes (before the write goes out), and the generation changes with every change of the
version (null included), so a reload back to the same version number is seen too
(`record()`). An older agent without the route answers 404 and explorers read its status
entry instead (then two API reads per request, and a reload back to the same number within
one request goes unseen). The time between the end of a load and the entry's new version
costs requests (dropped), never labels. The operator counts a null entry as not synced.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import struct
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from rft_contract import names
from rft_contract.layout import ADAPTER_CONFIG, ADAPTER_FILE, ADAPTER_KEY_PREFIX, ALL_LINEAR, is_adapter_dir, picks_module
from rft_contract.jobapi import describe, job_api, now, patch_status, watch_job
from rft_contract.podmetrics import SyncAgentMetrics
from rft_contract.probe import read_probe
from rft_contract.podenv import PodEnv
from rft_contract.storage import get_storage

from .engines import ENGINE_DOWN, ENGINES, Engine, EngineBroken, Previous, ProbeMismatch, SyncError
from rft_contract.relay import VERIFIED, Peer, PeerServer, parent_index, url_host
from .nccl_link import Incoming, NcclLink, NcclUnavailable
from .weights import Fetched, Superseded, fetch, fetch_head, version_dir

log = logging.getLogger("rft_serving.sync_agent")
# Failed attempts before an engine that has never answered is worth a warning.
ENGINE_START_ATTEMPTS = 12
# `<dest>/initial`: where vLLM/SGLang start from (rft_operator.rollout_pods passes
# `--fetch-only <dest>/initial` to the init container and the same path to the engine).
INITIAL_LINK = "initial"
# What the engine container runs from the helpers volume (install_helpers).
HELPER_FILES = ("__init__.py", "supervise.py", "cpu_isa.py", "vllm_worker.py")


# ------------------------------------------------------------------ the agent


START_ADAPTER_DIR = "start-adapter"  # under the agent's dest: spec.model.lora.adapterPath's copy
ZERO_ADAPTER_DIR = "zero-adapter"  # under the agent's dest: version 0 as an adapter (_zero_adapter)


class SyncAgent:
    """`peer_server`/`peer_url`: serve this replica's weights to its children in the tree
    (rft_contract.relay) and advertise where, in its status entry (`peer`); `fanout`: children per
    replica, which also decides this replica's parent (0: always read S3)."""

    def __init__(self, job: str, namespace: str, pod: str, engine: Engine, dest: str | Path,
                 api=None, resync_seconds: float = 10.0, max_backoff: float = 30.0, storage=None,
                 peer_server: PeerServer | None = None, peer_url: str | None = None, fanout: int = 0,
                 peer_timeout: float = 30.0, probe_tolerance: float | None = None,
                 engine_start_timeout: float = 900.0, broken_retry_seconds: float = 300.0,
                 env: PodEnv | None = None, transport: str = "files"):
        self.job, self.namespace, self.pod = job, namespace, pod
        self.env = PodEnv.read() if env is None else env  # the S3 client's knobs
        self.engine, self.dest, self.storage = engine, Path(dest), storage
        self.peer_server, self.peer_url, self.fanout = peer_server, peer_url, fanout
        self.peer_timeout = peer_timeout
        self.api = api if api is not None else job_api()
        self.resync_seconds, self.max_backoff = resync_seconds, max_backoff
        self.dest.mkdir(parents=True, exist_ok=True)
        self._status: dict[str, Any] = {}
        self._changed = threading.Event()
        self._stop = threading.Event()
        self.served: dict | None = None  # the target we last loaded: {version, id, uri}
        # A LoRA job's adapter versions load onto the base model (spec.model.path, version 0):
        # its local copy, kept while adapters serve (a restarted engine loads it again).
        self.base: Path | None = None
        self.model_path: str | None = None  # spec.model.path, from the watched job
        self.start_adapter: str | None = None  # spec.model.lora.adapterPath: version 0 is the base with it
        self.lora: dict | None = None  # spec.model.lora, as the job says it
        self.engine_version: int | None = None  # what the engine last reported
        self.attempts = 0
        self.syncs = 0
        self.probe_tolerance = probe_tolerance  # None: by the export's dtype (rft_contract.probe)
        self.engine_start_timeout, self.broken_retry_seconds = engine_start_timeout, broken_retry_seconds
        # The last target that loaded and passed its probe: (target, local dir, probe).
        self.good: tuple[dict, Path, Any] | None = None
        # ((version, id), monotonic time before which that export is not tried again).
        self.broken: tuple[tuple[int, str | None], float] | None = None
        self.broken_reason = ""  # what the held-off export's last try said
        self.engine_seen: float | None = None  # monotonic time the engine first answered
        # What explorers read around each request (`record()`): the entry's version as last
        # written, and a generation that changes whenever it does. The boot id tells this
        # process's generations from a restarted agent's.
        self._record_lock = threading.Lock()
        self._record: tuple[int | None, int] = (None, 0)
        self._boot = uuid.uuid4().hex[:12]
        self.metrics = SyncAgentMetrics()  # main() serves it (/metrics, port `metrics`)
        # spec.sync.transport nccl: the weights of a version rank 0 serves come over NCCL
        # (vLLM only; rft_serving.nccl_link), its other files and a copy for restarts as usual.
        self.nccl = NcclLink() if transport == "nccl" and hasattr(engine, "receive") else None
        self._nccl_said = ""  # the last reason a version came from its files instead

    # --- watching the job
    def target(self) -> dict | None:
        return (self._status.get("weightSync") or {}).get("target")

    def _watch(self) -> None:
        """Keep `_status` current: a GET, then a watch from its resourceVersion."""
        while not self._stop.is_set():
            try:
                for obj in watch_job(self.api, self.namespace, self.job, self._stop):
                    self._update(obj)
            except Exception as e:  # noqa: BLE001 - reconnect with a pause
                log.warning("watching rftjob %s/%s: %s; reconnecting", self.namespace, self.job, describe(e))
                self._stop.wait(2.0)

    def _update(self, obj: dict) -> None:
        status = obj.get("status") or {}
        model = (obj.get("spec") or {}).get("model") or {}
        if model:
            self.model_path = model.get("path") or self.model_path
            self.lora = model.get("lora")
            self.start_adapter = (self.lora or {}).get("adapterPath")
        changed = (status.get("weightSync") or {}).get("target") != self.target()
        self._status = status
        if changed:
            self._changed.set()

    # --- converging
    def run(self) -> None:
        threading.Thread(target=self._watch, name="rftjob-watch", daemon=True).start()
        if self.peer_url:
            self._patch({"peer": self.peer_url})  # children find this replica's server here
        backoff = 1.0
        while not self._stop.is_set():
            delay = self.resync_seconds  # also catches an engine that restarted empty
            target = self.target()
            if target is not None:
                try:
                    self.converge(target)
                    backoff = 1.0
                except Superseded as e:  # a newer target (or a stop): converge to it at once
                    log.info("%s", e)
                    continue
                except Exception as e:  # noqa: BLE001 - every failure is reported, then retried
                    self.attempts += 1
                    # A SyncError says what went wrong in words; anything else is a bug
                    # or an answer we did not expect: its type and text, and the trace.
                    message = str(e) if isinstance(e, SyncError) else f"{type(e).__name__}: {e}"
                    self._log_failure(target, e, message)
                    self.report_error(message)
                    self.metrics.observe_failure()
                    delay, backoff = backoff, min(self.max_backoff, backoff * 2)
                self.metrics.observe_versions(target.get("version"), self.engine_version)
            self._changed.wait(delay)  # a new target cuts any wait short
            self._changed.clear()

    def _log_failure(self, target: dict, e: Exception, message: str) -> None:
        """A warning, but for an engine that has not answered yet since the agent started:
        it is still starting (vLLM takes a minute or more), which is expected: one info line,
        then warnings again from the ENGINE_START_ATTEMPTS-th failure (minutes of backoff:
        an engine that never comes up)."""
        if self.engine_seen is None and isinstance(e, SyncError) and ENGINE_DOWN in message \
                and self.attempts < ENGINE_START_ATTEMPTS:
            if self.attempts == 1:
                log.info("waiting for the engine to answer (%s)", message)
            return
        log.warning("sync to version %s failed (attempt %d): %s", target.get("version"), self.attempts, message,
                    exc_info=not isinstance(e, SyncError))

    def stop(self) -> None:
        self._stop.set()
        self._changed.set()

    def converge(self, target: dict) -> bool:
        """Make the engine serve `target`. Returns True if it loaded something."""
        try:
            serving = self.engine_version = self.engine.served()  # the engine's word, always
        except SyncError:
            self.engine_version = None
            raise
        if self.engine_seen is None:
            self.engine_seen = time.monotonic()
            log.info("the engine answers (serving version %s)", serving)
        # What we loaded into it: our memory, or after an agent restart our status entry.
        known = self.served or self._entry()
        if known.get("version") is not None and serving != known.get("version"):
            # The engine lost what we loaded (its container restarted): say so, then reload.
            log.warning("engine reports version %s, but version %s was loaded into it "
                        "(engine restarted?): reloading", serving, known.get("version"))
            self.served = None
            if self.nccl is not None:
                self.nccl.forget()  # a new engine process: no communicator with rank 0
            self._patch({"version": serving, "id": None, "time": now()})
            known = {}
        if serving == target["version"] and known.get("version") == serving \
                and known.get("id") == target.get("id"):
            if self.attempts or not self._reported(target):
                self.report_ok(target, None)
            else:
                self._set_record(serving)  # the entry already says it (an agent restart)
            self.served = dict(target)
            if self.good is None:
                self.good = self._on_disk(target)  # what a fall-back goes back to
            return False
        self._check_not_broken(target)
        start = time.perf_counter()
        self._ensure_storage(target)
        incoming, got = self._over_nccl(target)
        if got is None:
            log.info("fetching version %s from %s", target["version"], target.get("uri"))
            got = self._fetch(target)
        path, times = got.path, got.times
        path = self._as_served(target, path)
        # An adapter loads onto the base: its files here before the replica says unsynced.
        base = self._base(target) if is_adapter_dir(path) else None
        probe = _probe_of(path, target)
        t_reload = time.perf_counter()
        self.served = None  # from here on, only the engine's report says what it serves
        # Before the weights change: say the replica serves no known version (see the module
        # doc). Without that entry written, the record could attribute new weights to the
        # old version, so a patch that fails stops this attempt before the engine is touched.
        if not self._patch({"version": None, "id": None}):
            raise SyncError("could not mark the replica's status entry unsynced before reloading")
        self.engine_version = None  # unknown until the engine says otherwise
        # What a load the engine refuses before serving it goes back to, in place (vLLM).
        previous = Previous(str(self.good[1]), self.good[0]["version"], self.good[2]) if self.good else None
        extra: dict[str, Any] = {"incoming": incoming} if incoming else {}
        if base is not None:
            extra["base"] = str(base)
        try:
            try:
                verdict = self.engine.load(str(path), target["version"], probe, self.probe_tolerance,
                                           previous=previous, **extra)
            except ProbeMismatch as e:
                if e.serving is not None:
                    # Refused (before it served a request, or an adapter after its probe,
                    # while the record said no version), and the last good version serves
                    # again: no restart; the export is not tried again for a while.
                    self._hold_off(target, str(e))
                    self.served = dict(self.good[0])
                    raise
                if not self.engine.restartable:
                    # It refused them and serves what it did before; the export is not
                    # tried again for a while (each try loads a whole model copy).
                    self._hold_off(target, str(e))
                    raise
                if incoming is not None:  # the restart starts from the files: get them first
                    try:
                        path = self._fetch(target).path
                    except SyncError as fetching:
                        self._fall_back(target, f"{e}; its files for a restart: {fetching}")
                        raise
                verdict = self._restart_on(target, path, probe, str(e))
            except EngineBroken as e:
                self._fall_back(target, str(e))
                raise
        except SyncError:
            # A failed load or restart may have changed what it serves: report only what
            # the engine's own label says (an unchecked engine carries none).
            self._ask_engine()
            raise
        try:
            self.engine_version = self.engine.served()
        except SyncError:
            self.engine_version = None  # not the version from before the load
            raise
        if self.engine_version != target["version"]:
            raise SyncError(f"engine reports version {self.engine_version} after loading {target['version']}")
        times["reloadSeconds"] = time.perf_counter() - t_reload
        times["loadSeconds"] = time.perf_counter() - start
        self.served = dict(target)
        self.syncs += 1
        log.info("serving version %s (%s) after %.2fs%s", target["version"], path, times["loadSeconds"],
                 f"; probe: {verdict.describe()}" if verdict else " (no probe to check)")
        self.report_ok(target, times, got.source, verdict, getattr(self.engine, "fingerprint_verdict", None))
        self.metrics.observe_sync(times, got.s3_bytes, got.peer_bytes)
        if incoming is not None:
            # Served; now the files, which a restart starts from and a refused later
            # version goes back to (until then, those of the version before).
            try:
                path = self._fetch(target).path
            except SyncError as e:
                log.warning("version %s serves (over NCCL), but its files did not arrive (%s): a restart "
                            "would start from version %s's", target["version"], e,
                            self.good[0]["version"] if self.good else "the initial")
                return True
        self.good = (dict(target), path, probe)
        if not is_adapter_dir(path):
            self.base = path  # what adapters load onto from now on
        self._link_initial(path)
        self._cleanup(target)
        return True

    def _base(self, target: dict) -> Path:
        """The base model's local copy, for an adapter version (`target`): the last full
        version loaded, else version 0 (spec.model.path) fetched now."""
        if not self.engine.lora_adapters:
            raise SyncError(f"version {target['version']} is a LoRA adapter, and this engine loads whole "
                            "models only")
        if self.base is not None and self.base.is_dir():
            return self.base
        if not self.model_path:
            raise SyncError(f"version {target['version']} is a LoRA adapter and the base model's path "
                            "(spec.model.path) is not known yet")
        log.info("fetching the base model %s for the adapter of version %s", self.model_path, target["version"])
        self.base = fetch({"version": 0, "uri": self.model_path}, self.dest, self.storage,
                          wait=self._superseded(target)).path
        return self.base

    def _start(self, target: dict) -> Path:
        """The starting adapter (spec.model.lora.adapterPath), fetched beside the versions
        (unverified, like a base model without a manifest)."""
        log.info("version 0 is the base with the adapter %s", self.start_adapter)
        return fetch({"version": 0, "uri": self.start_adapter}, self.dest / START_ADAPTER_DIR, self.storage,
                     wait=self._superseded(target)).path

    def _zero_adapter(self, base: Path) -> Path:
        """Version 0 of a LoRA job on an engine that serves the policy only as an adapter:
        `write_zero_adapter` with the job's spec.model.lora."""
        try:
            return write_zero_adapter(self.dest / ZERO_ADAPTER_DIR, self.lora or {}, str(base))
        except (OSError, ValueError) as e:
            raise SyncError(f"version 0: could not write the zero adapter on {base}: {e}") from None

    def _fetch(self, target: dict) -> Fetched:
        """The target's files, checked: from the parent replica (or on the fast path the
        trainer), else S3; published to this replica's children as they arrive."""
        return fetch(target, self.dest, self.storage, self.parent(target), self.peer_server, self.peer_timeout,
                     wait=self._superseded(target))

    def _over_nccl(self, target: dict) -> tuple[Incoming | None, Fetched | None]:
        """On the NCCL transport, for a version rank 0 serves: its files other than the
        weights (checked, from rank 0) and the engine's link ready to receive the weights.
        (None, None): this version loads from its files (said once per reason)."""
        if self.nccl is None or not target.get("peer") or not target.get("manifest"):
            return None, None
        try:
            got = fetch_head(target, self.dest, self.storage, self.peer_timeout, wait=self._superseded(target))
            incoming = self.nccl.prepare(self.engine, target["peer"], version_dir(self.dest, target).name)
        except NcclUnavailable as e:
            if str(e) != self._nccl_said:
                log.warning("version %s from its files, not over NCCL: %s", target["version"], e)
                self._nccl_said = str(e)
            return None, None
        self._nccl_said = ""
        return incoming, Fetched(got.path, got.times, "nccl trainer")

    def _restart_on(self, target: dict, path: Path, probe, reason: str):
        """The engine loaded `target` but does not serve it right: restart it from the files
        on disk and check again. A second mismatch means the export itself disagrees with
        the trainer's probe: back to the last good version, and the error says so."""
        log.warning("%s: restarting the engine from %s", reason,
                    f"the base, then the adapter {path}" if is_adapter_dir(path) else path)
        before = self._initial()
        self._link_initial(path)
        self._restart_engine(reason)
        try:
            # The engine's exact check (vLLM's fingerprint) runs on the fresh start too.
            return self.engine.adopt(target["version"], probe, self.probe_tolerance, path=str(path))
        except ProbeMismatch as e:
            message = f"{e} (the reload's result was: {reason})"
            self._fall_back(target, message, before)
            raise SyncError(message) from None

    def _fall_back(self, target: dict, reason: str, before: Path | None = None) -> None:
        """After a load that broke the engine or was wrong twice: restart the engine on the
        last version that passed (its directory is what `initial` points at, or is pointed
        at now), label it, and hold off retrying this export (`broken_retry_seconds`).
        Without one known to this process, on whatever `initial` pointed at `before` this
        attempt (what the engine started with), unlabelled: the entry then says no version."""
        self._hold_off(target, reason)
        last = self.good
        if last is not None:
            self._link_initial(last[1])
        elif before is not None:
            self._link_initial(before)
        try:
            self._restart_engine(reason)
            if last is not None:
                self.engine.adopt(last[0]["version"], last[2], self.probe_tolerance, path=str(last[1]))
                self.served = dict(last[0])
        except SyncError as e:
            log.error("could not bring the engine back on the last good version: %s", e)
        self._ask_engine()
        log.error("version %s not served (%s); serving version %s", target["version"], reason, self.engine_version)

    def _restart_engine(self, reason: str) -> None:
        if self.nccl is not None:
            self.nccl.forget()
        self._patch({"lastRestart": f"{now()}: {reason[:300]}"})
        self.engine.restart(reason, self.engine_start_timeout, self._stop.is_set)

    def _hold_off(self, target: dict, reason: str = "") -> None:
        """Do not try this export again for `broken_retry_seconds` (a newer one at once);
        `reason` stays in the entry's error meanwhile."""
        self.broken = ((target["version"], target.get("id")), time.monotonic() + self.broken_retry_seconds)
        self.broken_reason = reason

    def _ensure_storage(self, target: dict) -> None:
        if self.storage is None and str(target.get("uri", "")).startswith("s3://"):
            self.storage = get_storage(target["uri"], self.env)  # one client for the agent's life

    def _check_not_broken(self, target: dict) -> None:
        if self.broken is None:
            return
        export, until = self.broken
        if export != (target["version"], target.get("id")):
            self.broken = None
            return
        left = until - time.monotonic()
        if left > 0:
            last = f". Last time: {self.broken_reason}" if self.broken_reason else ""
            raise SyncError(f"version {target['version']} broke the engine or failed its probe; retrying it "
                            f"in {left:.0f}s (a newer version is tried at once){last}")

    def _ask_engine(self) -> None:
        try:
            self.engine_version = self.engine.served()
        except SyncError:
            self.engine_version = None

    def _superseded(self, target: dict):
        """`wait(seconds)` for a fetch that waits on a commit: True once the target changed
        or the agent stops (the run loop then converges to the new target)."""
        def wait(seconds: float) -> bool:
            self._stop.wait(seconds)
            return self._stop.is_set() or self.target() != target
        return wait

    def parent(self, target: dict | None = None) -> Peer | None:
        """The replica to read weights from (rft_contract.relay's tree), if it advertises a server;
        for replica 0, the trainer's weights server when the target names one (the fast path)."""
        prefix = names.inference_pod_name(self.job, 0)[:-1]
        index = self.pod[len(prefix):]
        if self.fanout < 1 or not self.pod.startswith(prefix) or not index.isdigit():
            return None
        p = parent_index(int(index), self.fanout)
        if p is None:
            peer = (target or {}).get("peer")
            return Peer("trainer", peer) if peer else None
        pod = names.inference_pod_name(self.job, p)
        url = (((self._status.get("weightSync") or {}).get("replicas") or {}).get(pod) or {}).get("peer")
        return Peer(pod, url) if url else None

    def _entry(self) -> dict:
        return ((self._status.get("weightSync") or {}).get("replicas") or {}).get(self.pod) or {}

    def _reported(self, target: dict) -> bool:
        entry = self._entry()
        return entry.get("version") == target["version"] and entry.get("id") == target.get("id") \
            and not entry.get("error")

    def _on_disk(self, target: dict) -> tuple[dict, Path, Any] | None:
        """(target, its verified local copy, its probe) when that copy is here (fetched by
        the init container or an earlier agent process); else None."""
        path = version_dir(self.dest, target)
        if not (path / VERIFIED).is_file():
            return None
        try:
            probe = read_probe(path)
            served = self._as_served(target, path, fetch=False)
        except (OSError, ValueError, SyncError):
            return None
        return (dict(target), served, probe) if served is not None else None

    def _as_served(self, target: dict, path: Path, fetch: bool = True) -> Path | None:
        """What the engine serves for `target` from its files at `path`: for a LoRA job's
        version 0, the base with the starting adapter (spec.model.lora.adapterPath;
        `fetch`: fetched now, else None unless it is here) or, on an engine that serves the
        policy as an adapter (vLLM), with zeros (`base` is then `path`); else `path`."""
        if target["version"] != 0 or is_adapter_dir(path):
            return path
        if self.start_adapter:
            adapter = self._start(target) if fetch else self.dest / START_ADAPTER_DIR
            if not fetch and not is_adapter_dir(adapter):
                return None  # not here: fetched by the next load
        elif self.lora and getattr(self.engine, "adapter_policy", False):
            adapter = self._zero_adapter(path)
        else:
            return path
        self.base = path
        return adapter

    def _initial(self) -> Path | None:
        """Where the engine's start-up link points now (None: no link)."""
        link = self.dest / INITIAL_LINK
        return link.resolve() if link.is_symlink() else None

    def _link_initial(self, path: Path) -> None:
        """Point the engine's start-up link (made by the init container) at `path`; an
        adapter leaves it on the base (the engine starts from the base, then loads it)."""
        link = self.dest / INITIAL_LINK
        if not link.is_symlink() or is_adapter_dir(path):
            return  # the reference engine starts empty: no link
        tmp = self.dest / f".{INITIAL_LINK}.tmp"
        try:
            if tmp.is_symlink() or tmp.exists():
                tmp.unlink()
            tmp.symlink_to(Path(path).resolve())
            os.replace(tmp, link)
        except OSError as e:
            log.warning("could not point %s at %s: %s", link, path, e)

    def _cleanup(self, keep: dict) -> None:
        link = self.dest / INITIAL_LINK
        start_up = link.resolve() if link.is_symlink() else None
        for d in self.dest.iterdir():
            if d.is_dir() and not d.is_symlink() and d.name.startswith("v") and d != self.base \
                    and d != version_dir(self.dest, keep) and d.resolve() != start_up:
                shutil.rmtree(d, ignore_errors=True)
                if self.peer_server is not None:
                    self.peer_server.forget(d.name)

    # --- reporting
    def report_ok(self, target: dict, times: dict | None, source: str | None = None, verdict=None,
                  fingerprint=None) -> None:
        entry = {"version": target["version"], "id": target.get("id"), "time": now(),
                 "error": None, "errorTime": None, "attempts": None}
        if verdict is not None:
            entry["probe"] = verdict.record()
        if fingerprint is not None:
            entry["fingerprint"] = fingerprint.record()
        self._add_restarts(entry)
        entry.update({k: round(v, 3) for k, v in (times or {}).items()})
        if source is not None:
            entry["source"] = source  # "s3", "peer <pod>", "peer <pod>, then s3", "local", "nccl trainer"
        if self.peer_url:
            entry["peer"] = self.peer_url
        self.attempts = 0
        self._patch(entry)

    def report_error(self, message: str) -> None:
        # The version the engine itself last reported: it keeps serving that.
        entry = {"version": self.engine_version, "error": message[:500], "errorTime": now(),
                 "attempts": self.attempts}
        self._add_restarts(entry)
        self._patch(entry)

    def _add_restarts(self, entry: dict) -> None:
        """The supervisor's restart count (it outlives agent restarts; a new engine
        container starts it from 0 again), when the engine runs under one."""
        try:
            restarts = self.engine.restarts()
        except Exception:  # noqa: BLE001 - the count is a report, never a reason to fail one
            restarts = None
        if restarts is not None:
            entry["engineRestarts"] = restarts

    def record(self) -> dict:
        """{"version": the entry's version as last written (null: unknown or reloading),
        "generation": changes whenever the version does}: the peer server's `/record`."""
        with self._record_lock:
            version, n = self._record
        return {"version": version, "generation": f"{self._boot}:{n}"}

    def _set_record(self, version: Any) -> None:
        version = version if isinstance(version, int) and not isinstance(version, bool) else None
        with self._record_lock:
            old, n = self._record
            if version is None or version != old:
                self._record = (version, n + 1)

    def _patch(self, entry: dict) -> bool:
        """Merge-patch this pod's entry; False when 5 tries failed (the next pass reports
        again). The record explorers read changes first: a reload never starts while it
        still names the old version."""
        if "version" in entry:
            self._set_record(entry["version"])
        status = {"weightSync": {"replicas": {self.pod: entry}}}
        for attempt in range(5):
            try:
                patch_status(self.api, self.namespace, self.job, status)
                return True
            except Exception as e:  # noqa: BLE001 - the next pass reports again
                log.warning("status patch failed (%s); retry %d/5", describe(e), attempt + 1)
                self._stop.wait(min(10.0, 0.5 * 2 ** attempt))
        return False


def _probe_of(path: Path, target: dict):
    """The export's probe (rft_contract.probe); None for exports without one (version 0, the
    base model as uploaded). A probe that does not parse fails the attempt: the export is
    not what the trainer writes."""
    try:
        return read_probe(path)
    except (OSError, ValueError) as e:
        raise SyncError(f"version {target['version']}: {e}") from None


def install_helpers(out: Path) -> None:
    """Copy this package's sources to `out/rft_serving` for the engine container (init
    container mode): the engine runs supervise.py and, for vLLM, vllm_worker.py from there,
    whatever else its image has (standard library only, plus the engine's own packages)."""
    here = Path(__file__).resolve().parent
    dest = out / "rft_serving"
    tmp = out / ".rft_serving.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in HELPER_FILES:
        shutil.copy(here / name, tmp / name)
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    log.info("engine helpers %s in %s", ", ".join(HELPER_FILES), dest)


def write_zero_adapter(out: Path, lora: dict, base: str) -> Path:
    """An adapter that adds nothing, in PEFT's format: the job's rank, alpha and target
    modules (`lora`: spec.model.lora as the RFTJob says it), B A = 0 on every layer, so the
    engine serves the base's exact outputs under the policy's name. vLLM refuses an adapter
    without tensors, so it holds one pair of zeros, on the first layer of the base the
    targets name (`_zero_layer`). Written without torch (the sidecar has none)."""
    rank = int(lora["rank"])
    targets = lora.get("targetModules") or [ALL_LINEAR]
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank,
              "lora_alpha": float(lora.get("alpha") or rank), "lora_dropout": 0.0, "bias": "none",
              "target_modules": ALL_LINEAR if targets == [ALL_LINEAR] else list(targets),
              "base_model_name_or_path": base}
    module, (rows, cols) = _zero_layer(Path(base), targets)
    tensors = {f"{ADAPTER_KEY_PREFIX}{module}.lora_A.weight": (rank, cols),
               f"{ADAPTER_KEY_PREFIX}{module}.lora_B.weight": (rows, rank)}
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in tensors.items():
        size = 4 * shape[0] * shape[1]
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)  # safetensors pads its header to 8 bytes
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
    (tmp / ADAPTER_FILE).write_bytes(struct.pack("<Q", len(encoded)) + encoded + bytes(offset))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def _zero_layer(base: Path, targets: list[str]) -> tuple[str, tuple[int, int]]:
    """A linear layer of the model at `base` that `targets` name, and its weight's (out, in),
    from its safetensors headers: the first 2-D `<module>.weight` whose module `targets`
    matches as PEFT does (the name, or a suffix after a '.'); for all-linear, one that is
    not an embedding or the output head (no dimension of the vocabulary's size). ValueError
    when none."""
    try:
        vocab = json.loads((base / "config.json").read_text()).get("vocab_size")
    except (OSError, ValueError):
        vocab = None
    found = []
    for file in sorted(base.glob("*.safetensors")):
        with open(file, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        for name in sorted(header):
            shape = header[name].get("shape") if name != "__metadata__" else None
            if not name.endswith(".weight") or not shape or len(shape) != 2:
                continue
            module = name.removesuffix(".weight")
            if targets == [ALL_LINEAR]:
                if vocab not in shape and "embed" not in module and module.rsplit(".", 1)[-1] != "lm_head":
                    found.append((module, (shape[0], shape[1])))
            elif any(picks_module(t, module) for t in targets):
                found.append((module, (shape[0], shape[1])))
    # An attention projection first: every engine adapts those (a MoE's router or experts
    # may not be adaptable).
    found.sort(key=lambda m: "attn" not in m[0])
    if not found:
        raise ValueError(f"no linear layer of {base} (its *.safetensors) matches spec.model.lora.targetModules "
                         f"{targets}")
    return found[0]


def fetch_only(agent: SyncAgent, out: Path, timeout: float = 3600.0) -> int:
    """Init-container mode: download the current target to `out` for engines that must
    start from weights on disk (vLLM, SGLang), then exit."""
    threading.Thread(target=agent._watch, daemon=True).start()
    deadline = time.monotonic() + timeout
    while agent.target() is None and time.monotonic() < deadline:
        agent._changed.wait(5.0)
        agent._changed.clear()
    target = agent.target()
    if target is None:
        log.error("no status.weightSync.target after %.0fs", timeout)
        return 1
    while True:  # a target announced but never committed is superseded by the next one
        agent._ensure_storage(target)
        try:
            path = fetch(target, agent.dest, agent.storage, agent.parent(target), None, agent.peer_timeout,
                         wait=agent._superseded(target)).path
            break
        except Superseded:
            if agent._stop.is_set() or agent.target() is None:
                return 1
            target = agent.target()
    if is_adapter_dir(path):  # a LoRA job's version: the engine starts from the base, then loads it
        path = agent._base(target)
    if out.exists() or out.is_symlink():
        out.unlink() if out.is_symlink() else shutil.rmtree(out)
    out.symlink_to(path.resolve())
    agent.served = dict(target)
    log.info("fetched version %s to %s", target["version"], out)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="rft_serving.sync_agent")
    ap.add_argument("--engine", choices=sorted(ENGINES), default="reference")
    ap.add_argument("--engine-port", type=int, default=int(os.environ.get("RFT_INFERENCE_PORT", "8000")))
    ap.add_argument("--engine-url", help="default http://$RFT_POD_IP:<engine-port>")
    ap.add_argument("--dest", default="/var/lib/rft/weights", help="local weights directory")
    ap.add_argument("--fetch-only", metavar="DIR", help="download the current target to DIR and exit")
    ap.add_argument("--job", default=os.environ.get("RFT_JOB_NAME"))
    ap.add_argument("--namespace", default=os.environ.get("RFT_JOB_NAMESPACE"))
    ap.add_argument("--pod", default=os.environ.get("RFT_POD_NAME"))
    ap.add_argument("--peer-port", type=int, default=0,
                    help="serve this replica's weights to its children on this port (0: don't)")
    ap.add_argument("--fanout", type=int, default=0,
                    help="children per replica in the relay tree (0: every replica reads S3)")
    ap.add_argument("--peer-timeout", type=float, default=30.0,
                    help="seconds without bytes from the parent before reading S3 instead")
    ap.add_argument("--supervisor-port", type=int, default=0,
                    help="the engine's supervisor (rft_serving.supervise) on 127.0.0.1 (0: none)")
    ap.add_argument("--probe-tolerance", type=float, default=None,
                    help="mean |served - trained| log-prob per probe token that passes "
                         "(default: by the export's dtype, rft_contract.probe)")
    ap.add_argument("--engine-start-timeout", type=float, default=900.0,
                    help="seconds an engine restart may take before the attempt fails")
    ap.add_argument("--transport", choices=("files", "nccl"), default="files",
                    help="nccl: a vLLM engine takes the weights of a version trainer rank 0 serves over NCCL "
                         "(spec.sync.transport; rft_serving.nccl_link), else from the files")
    ap.add_argument("--install-helpers", metavar="DIR",
                    help="with --fetch-only: also copy the engine's helpers (supervise, vllm_worker) to DIR")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not (args.job and args.namespace and args.pod):
        log.error("need --job/--namespace/--pod (or RFT_JOB_NAME/RFT_JOB_NAMESPACE/RFT_POD_NAME)")
        return 78
    try:
        env = PodEnv.read()
    except ValueError as e:
        log.error("%s", e)
        return 78
    pod_ip = env.pod_ip
    url = args.engine_url or f"http://{pod_ip or '127.0.0.1'}:{args.engine_port}"
    server = peer_url = None
    if args.peer_port and not args.fetch_only:
        server = PeerServer(Path(args.dest), port=args.peer_port)  # bound; started once `record` is set
        peer_url = f"http://{url_host(pod_ip)}:{server.port}" if pod_ip else None
    supervisor = f"http://127.0.0.1:{args.supervisor_port}" if args.supervisor_port else None
    engine = ENGINES[args.engine](url, supervisor=supervisor)
    agent = SyncAgent(args.job, args.namespace, args.pod, engine, args.dest,
                      peer_server=server, peer_url=peer_url, fanout=args.fanout, peer_timeout=args.peer_timeout,
                      probe_tolerance=args.probe_tolerance, engine_start_timeout=args.engine_start_timeout,
                      env=env, transport=args.transport)
    if server is not None:
        server.record = agent.record  # explorers read it around each request: never a 404 from us
        server.start()
    if args.fetch_only:
        if args.install_helpers:
            install_helpers(Path(args.install_helpers))
        return fetch_only(agent, Path(args.fetch_only))
    signal.signal(signal.SIGTERM, lambda *_: agent.stop())
    agent.metrics.serve()
    log.info("sync agent for %s/%s pod %s, engine %s at %s", args.namespace, args.job, args.pod, args.engine, url)
    agent.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
