"""The sync agent: one per inference pod, beside the engine. Level-triggered.

It watches its RFTJob and converges the engine to `status.weightSync.target`:

    target != served  ->  download the weights to local disk (once per version)
                      ->  verify every file against the export's manifest.json
                      ->  ask the engine to reload from that directory (hot: no restart)
                      ->  confirm the engine reports the new version
                      ->  merge-patch status.weightSync.replicas[<pod>]
                          = {version, id, time, loadSeconds, downloadSeconds, ...}

Failures are retried with capped backoff and reported in the same entry (`error`,
`errorTime`, `attempts`) while the old weights keep serving. A restarted agent (or a
restarted engine) is found out by comparing the engine's own report with the target,
so both converge without memory of the past. Target version 0 is the base model
(`spec.model.path`), which may have no manifest: it is then loaded unverified.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import requests

from .reporting import GROUP, PLURAL, VERSION, describe, job_api, now
from .storage import get_storage, join

log = logging.getLogger("rft_trainer.sync_agent")
MANIFEST = "manifest.json"


class SyncError(RuntimeError):
    """A failed step of one sync attempt; the message goes into the replica entry."""


# ------------------------------------------------------------------ engines


class Engine:
    """How to reload one kind of inference engine and ask what it serves."""

    def __init__(self, url: str, timeout: float = 600.0):
        self.url, self.timeout = url.rstrip("/"), timeout

    def served(self) -> int | None:
        raise NotImplementedError

    def load(self, path: str, version: int) -> None:
        raise NotImplementedError

    def _post(self, path: str, body: dict | None = None, params: dict | None = None) -> dict:
        try:
            r = requests.post(self.url + path, json=body, params=params, timeout=self.timeout)
        except requests.RequestException as e:
            raise SyncError(f"engine {path}: {type(e).__name__}") from None
        if r.status_code >= 400:
            raise SyncError(f"engine {path}: HTTP {r.status_code} {r.text[:300]}")
        return r.json() if r.content else {}


class ReferenceEngine(Engine):
    """rft_trainer.serve: GET /weights, POST /weights/load {path, version}."""

    def served(self) -> int | None:
        try:
            r = requests.get(self.url + "/weights", timeout=10)
            r.raise_for_status()
        except requests.RequestException as e:
            raise SyncError(f"engine not reachable at {self.url}: {type(e).__name__}") from None
        return r.json().get("version")

    def load(self, path: str, version: int) -> None:
        self._post("/weights/load", {"path": path, "version": version})


class SGLangEngine(Engine):
    """SGLang's `/update_weights_from_disk` (documented; not exercised in CI here)."""

    def __init__(self, url: str, **kw):
        super().__init__(url, **kw)
        self._loaded: int | None = None

    def served(self) -> int | None:
        return self._loaded

    def load(self, path: str, version: int) -> None:
        out = self._post("/update_weights_from_disk", {"model_path": path, "weight_version": str(version)})
        if out.get("success") is False:
            raise SyncError(f"engine refused the weights: {out.get('message', '')[:300]}")
        self._loaded = version


class VLLMEngine(SGLangEngine):
    """vLLM's weight-update endpoints (dev mode), bracketed by pause/resume so no request
    mixes versions. Not exercised in CI here (no vLLM on CPU)."""

    def load(self, path: str, version: int) -> None:
        self._post("/pause", params={"mode": "wait"})
        try:
            self._post("/update_weights", {"weights_path": path, "weight_version": str(version)})
        finally:
            self._post("/resume")
        self._loaded = version


ENGINES = {"reference": ReferenceEngine, "sglang": SGLangEngine, "vllm": VLLMEngine}


# ------------------------------------------------------------------ weights on local disk


def version_dir(dest: Path, target: dict) -> Path:
    return dest / f"v{target['version']:08d}-{target.get('id') or 'base'}"


def fetch(target: dict, dest: Path, storage=None) -> tuple[Path, dict[str, float]]:
    """Download (unless already here) and verify the target's weights; returns the local
    directory and timings. Local targets (a path in the image) are used in place."""
    uri = target["uri"]
    out = version_dir(dest, target)
    times = {"downloadSeconds": 0.0, "verifySeconds": 0.0}
    if not uri.startswith("s3://"):
        path = Path(uri.removeprefix("file://"))
        if (path / MANIFEST).exists():
            start = time.perf_counter()
            verify_dir(path, json.loads((path / MANIFEST).read_text()), target)
            times["verifySeconds"] = time.perf_counter() - start
        return path, times
    if (out / ".verified").exists():
        return out, times
    storage = storage or get_storage(uri)
    tmp = dest / f".tmp-{out.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    start = time.perf_counter()
    try:
        manifest = _download(storage, uri, tmp)
        times["downloadSeconds"] = time.perf_counter() - start
        start = time.perf_counter()
        if manifest is not None:
            verify_dir(tmp, manifest, target)
        else:
            log.warning("version %s at %s has no manifest.json: loading it unverified", target["version"], uri)
        times["verifySeconds"] = time.perf_counter() - start
        (tmp / ".verified").write_text(json.dumps(target))
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    except SyncError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    except Exception as e:  # storage errors: name the type and a short reason only
        shutil.rmtree(tmp, ignore_errors=True)
        raise SyncError(f"download of {uri} failed: {_short(e)}") from None
    return out, times


def _download(storage, uri: str, to: Path) -> dict | None:
    """Files listed in the manifest (or, without one, every object under the prefix)."""
    try:
        manifest = json.loads(storage.read_bytes(join(uri, MANIFEST)))
    except FileNotFoundError:
        manifest = None
    if manifest is None:
        base = uri.rstrip("/") + "/"
        names = [o[len(base):] for o in storage.list(base)]
        if not names:
            raise SyncError(f"{uri}: no such weights (nothing under the prefix)")
    else:
        names = list(manifest["files"])
    download = getattr(storage, "download_file", None)
    for name in names:
        target = to / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if download is not None:
            download(join(uri, name), target)  # streamed, multipart
        else:
            target.write_bytes(storage.read_bytes(join(uri, name)))
    return manifest


def verify_dir(path: Path, manifest: dict, target: dict) -> None:
    if target.get("id") and manifest.get("id") and manifest["id"] != target["id"]:
        raise SyncError(f"manifest id {manifest['id']} is not the target's {target['id']} "
                        "(version re-exported meanwhile)")
    for name, meta in manifest["files"].items():
        f = path / name
        if not f.exists() or f.stat().st_size != meta["size"]:
            raise SyncError(f"{name}: size differs from manifest.json")
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
        if h.hexdigest() != meta["sha256"]:
            raise SyncError(f"{name}: sha256 differs from manifest.json")


def _short(e: Exception) -> str:
    """Exception type and S3 error code: never the message, which may echo request
    details (URLs with signatures)."""
    response = getattr(e, "response", None)
    code = response.get("Error", {}).get("Code") if isinstance(response, dict) else None
    return f"{type(e).__name__}" + (f" ({code})" if code else "")


# ------------------------------------------------------------------ the agent


class SyncAgent:
    def __init__(self, job: str, namespace: str, pod: str, engine: Engine, dest: str | Path,
                 api=None, resync_seconds: float = 10.0, max_backoff: float = 30.0, storage=None):
        self.job, self.namespace, self.pod = job, namespace, pod
        self.engine, self.dest, self.storage = engine, Path(dest), storage
        self.api = api if api is not None else job_api()
        self.resync_seconds, self.max_backoff = resync_seconds, max_backoff
        self.dest.mkdir(parents=True, exist_ok=True)
        self._status: dict[str, Any] = {}
        self._changed = threading.Event()
        self._stop = threading.Event()
        self.served: dict | None = None  # the target we last loaded: {version, id, uri}
        self.attempts = 0
        self.syncs = 0

    # --- watching the job
    def target(self) -> dict | None:
        return (self._status.get("weightSync") or {}).get("target")

    def _watch(self) -> None:
        """Keep `_status` current: a GET, then a watch from its resourceVersion."""
        from kubernetes import watch

        while not self._stop.is_set():
            try:
                obj = self.api.get_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, self.job)
                self._update(obj)
                w = watch.Watch()
                for ev in w.stream(self.api.list_namespaced_custom_object, GROUP, VERSION, self.namespace,
                                   PLURAL, field_selector=f"metadata.name={self.job}",
                                   resource_version=obj["metadata"]["resourceVersion"], timeout_seconds=60):
                    if self._stop.is_set():
                        w.stop()
                        return
                    if ev["type"] in ("ADDED", "MODIFIED"):
                        self._update(ev["object"])
            except Exception as e:  # noqa: BLE001 - reconnect with a pause
                log.warning("watching rftjob %s/%s: %s; reconnecting", self.namespace, self.job, describe(e))
                self._stop.wait(2.0)

    def _update(self, obj: dict) -> None:
        status = obj.get("status") or {}
        changed = (status.get("weightSync") or {}).get("target") != self.target()
        self._status = status
        if changed:
            self._changed.set()

    # --- converging
    def run(self) -> None:
        threading.Thread(target=self._watch, name="rftjob-watch", daemon=True).start()
        backoff = 1.0
        while not self._stop.is_set():
            delay = self.resync_seconds  # also catches an engine that restarted empty
            target = self.target()
            if target is not None:
                try:
                    self.converge(target)
                    backoff = 1.0
                except SyncError as e:
                    self.attempts += 1
                    log.warning("sync to version %s failed (attempt %d): %s",
                                target.get("version"), self.attempts, e)
                    self.report_error(str(e))
                    delay, backoff = backoff, min(self.max_backoff, backoff * 2)
            self._changed.wait(delay)  # a new target cuts any wait short
            self._changed.clear()

    def stop(self) -> None:
        self._stop.set()
        self._changed.set()

    def converge(self, target: dict) -> bool:
        """Make the engine serve `target`. Returns True if it loaded something."""
        serving = self.engine.served()
        # What the engine holds: our memory, or after an agent restart our status entry.
        known = self.served or self._entry()
        if serving == target["version"] and known.get("version") == serving \
                and known.get("id") == target.get("id"):
            if self.attempts or not self._reported(target):
                self.report_ok(target, None)
            self.served = dict(target)
            return False
        start = time.perf_counter()
        path, times = fetch(target, self.dest, self.storage)
        t_reload = time.perf_counter()
        self.engine.load(str(path), target["version"])
        if self.engine.served() != target["version"]:
            raise SyncError(f"engine reports version {self.engine.served()} after loading {target['version']}")
        times["reloadSeconds"] = time.perf_counter() - t_reload
        times["loadSeconds"] = time.perf_counter() - start
        self.served = dict(target)
        self.syncs += 1
        log.info("serving version %s (%s) after %.2fs", target["version"], path, times["loadSeconds"])
        self.report_ok(target, times)
        self._cleanup(target)
        return True

    def _entry(self) -> dict:
        return ((self._status.get("weightSync") or {}).get("replicas") or {}).get(self.pod) or {}

    def _reported(self, target: dict) -> bool:
        entry = self._entry()
        return entry.get("version") == target["version"] and entry.get("id") == target.get("id") \
            and not entry.get("error")

    def _cleanup(self, keep: dict) -> None:
        for d in self.dest.iterdir():
            if d.is_dir() and d.name.startswith("v") and d != version_dir(self.dest, keep):
                shutil.rmtree(d, ignore_errors=True)

    # --- reporting
    def report_ok(self, target: dict, times: dict | None) -> None:
        entry = {"version": target["version"], "id": target.get("id"), "time": now(),
                 "error": None, "errorTime": None, "attempts": None}
        entry.update({k: round(v, 3) for k, v in (times or {}).items()})
        self.attempts = 0
        self._patch(entry)

    def report_error(self, message: str) -> None:
        self._patch({"version": (self.served or {}).get("version"), "error": message[:500],
                     "errorTime": now(), "attempts": self.attempts})

    def _patch(self, entry: dict) -> None:
        body = {"status": {"weightSync": {"replicas": {self.pod: entry}}}}
        for attempt in range(5):
            try:
                self.api.patch_namespaced_custom_object_status(
                    GROUP, VERSION, self.namespace, PLURAL, self.job, body,
                    _content_type="application/merge-patch+json", _preload_content=False)
                return
            except Exception as e:  # noqa: BLE001 - the next pass reports again
                log.warning("status patch failed (%s); retry %d/5", describe(e), attempt + 1)
                self._stop.wait(min(10.0, 0.5 * 2 ** attempt))


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
    path, _ = fetch(target, agent.dest, agent.storage)
    if out.exists() or out.is_symlink():
        out.unlink() if out.is_symlink() else shutil.rmtree(out)
    out.symlink_to(path.resolve())
    agent.served = dict(target)
    log.info("fetched version %s to %s", target["version"], out)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="rft_trainer.sync_agent")
    ap.add_argument("--engine", choices=sorted(ENGINES), default="reference")
    ap.add_argument("--engine-port", type=int, default=int(os.environ.get("RFT_INFERENCE_PORT", "8000")))
    ap.add_argument("--engine-url", help="default http://$RFT_POD_IP:<engine-port>")
    ap.add_argument("--dest", default="/var/lib/rft/weights", help="local weights directory")
    ap.add_argument("--fetch-only", metavar="DIR", help="download the current target to DIR and exit")
    ap.add_argument("--job", default=os.environ.get("RFT_JOB_NAME"))
    ap.add_argument("--namespace", default=os.environ.get("RFT_JOB_NAMESPACE"))
    ap.add_argument("--pod", default=os.environ.get("RFT_POD_NAME"))
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not (args.job and args.namespace and args.pod):
        log.error("need --job/--namespace/--pod (or RFT_JOB_NAME/RFT_JOB_NAMESPACE/RFT_POD_NAME)")
        return 78
    url = args.engine_url or f"http://{os.environ.get('RFT_POD_IP') or '127.0.0.1'}:{args.engine_port}"
    agent = SyncAgent(args.job, args.namespace, args.pod, ENGINES[args.engine](url), args.dest)
    if args.fetch_only:
        return fetch_only(agent, Path(args.fetch_only))
    signal.signal(signal.SIGTERM, lambda *_: agent.stop())
    log.info("sync agent for %s/%s pod %s, engine %s at %s", args.namespace, args.job, args.pod, args.engine, url)
    agent.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
