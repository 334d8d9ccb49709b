"""Weights on the inference pod's local disk: fetch a target export once per (version, id),
every file checked against the export's manifest in the pass that writes it, and hand the
engine a local directory.

The manifest is always read from S3 (it is the export's commit); the files come from the
parent replica when there is one (`rft_contract.relay`: streamed while the parent still receives
them) and from S3 otherwise, or as soon as the parent fails one file (unreachable, 404,
stalled, cut short, or bytes that do not match the manifest). While it fetches, the agent
publishes the growing directory to its own `PeerServer`, so its children stream from it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import queue
import shutil
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from rft_contract.manifest import MANIFEST, manifest_digest, verify_local
from rft_contract.storage import download_to, get_storage, join, mismatch, read_parts

from .engines import SyncError
from rft_contract.relay import CHUNK, MANIFEST_COPY, VERIFIED, Peer, PeerError, PeerServer, Transfer, \
    is_safe_file_name, read_from_peer, read_manifest_from_peer, version_dir_name, write_all

log = logging.getLogger("rft_serving.weights")


def version_dir(dest: Path, target: dict) -> Path:
    return dest / version_dir_name(target["version"], target.get("id"))


@dataclass
class Fetched:
    """A local copy of the target's weights and how it got there."""

    path: Path
    times: dict[str, float] = field(default_factory=lambda: {"downloadSeconds": 0.0, "verifySeconds": 0.0})
    source: str = "local"  # "s3", "peer <pod>", "peer <pod>, then s3", or "local" (on disk already)
    s3_bytes: int = 0
    peer_bytes: int = 0
    manifest: dict | None = None  # fetch_head's: what the weights arriving otherwise must match


def fetch(target: dict, dest: Path, storage=None, peer: Peer | None = None,
          server: PeerServer | None = None, peer_timeout: float = 30.0,
          wait: Callable[[float], bool] | None = None, commit_timeout: float = 3600.0) -> Fetched:
    """Download (unless already here) and verify the target's weights. `peer`: the parent
    to read the files from (S3 when None or when it fails); `server`: where to publish the
    download for children. Local targets (a path in the image) are used in place.

    A target that names its manifest's digest (the fast path: announced before its upload
    ends) takes the manifest from `peer` if it matches, else waits for the commit in S3,
    up to `commit_timeout`, through `wait(seconds)` (True: stop waiting, `Superseded`)."""
    uri = target["uri"]
    out = version_dir(dest, target)
    if not uri.startswith("s3://"):
        got = Fetched(Path(uri.removeprefix("file://")))
        if (got.path / MANIFEST).exists():
            start = time.perf_counter()
            verify_dir(got.path, json.loads((got.path / MANIFEST).read_text()), target)
            got.times["verifySeconds"] = time.perf_counter() - start
        return got
    if (out / VERIFIED).exists():
        return Fetched(out)
    storage = storage or get_storage(uri)
    tmp = dest / f".tmp-{out.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    start = time.perf_counter()
    job: _Fetch | None = None
    try:
        if target.get("manifest"):
            manifest, peer = _announced_manifest(target, storage, uri, peer, out.name, peer_timeout,
                                                 wait or time.sleep, commit_timeout)
        else:
            try:
                manifest = _read_manifest(storage, uri)
            except FileNotFoundError:
                manifest = None
        if manifest is None:
            got = _download_unverified(storage, uri, target, tmp)
        else:
            check_manifest(manifest, target)
            job = _Fetch(storage, uri, manifest, out.name, tmp, peer, server, peer_timeout)
            if target.get("manifest") and peer is not None:  # S3 may lack the files yet: read it once committed
                job.before_s3 = lambda: await_commit(target, storage, uri, wait or time.sleep, commit_timeout)
            got = job.run()
        got.times["downloadSeconds"] = time.perf_counter() - start - got.times["verifySeconds"]
        (tmp / VERIFIED).write_text(json.dumps(target))
        shutil.rmtree(out, ignore_errors=True)
        if job is not None:
            job.transfer.moved(out, lambda: tmp.rename(out))
        else:
            tmp.rename(out)
    except Exception as e:
        if job is not None:
            job.transfer.fail()  # children's streams end short: they read S3
            if server is not None:
                server.forget(out.name, job.transfer)
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, SyncError):
            raise
        # Storage errors: name the type and a short reason only.
        raise SyncError(f"download of {uri} failed: {_short(e)}") from None
    return replace(got, path=out)


def fetch_head(target: dict, dest: Path, storage=None, peer_timeout: float = 30.0,
               wait: Callable[[float], bool] | None = None, commit_timeout: float = 3600.0) -> Fetched:
    """What a replica needs of an announced version besides its weights, which reach the
    engine over NCCL (rft_serving.nccl_link): the manifest whose digest the target names
    and every file it lists except the safetensors (the fingerprint, the probe, the
    config), each checked, from the trainer's server (`target["peer"]`) or else S3, into
    `dest/<version dir>.head`. Its `manifest` key: the manifest."""
    uri = target["uri"]
    name = version_dir(dest, target).name
    out = dest / f"{name}.head"
    storage = storage or get_storage(uri)
    tmp = dest / f".tmp-{out.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    start = time.perf_counter()
    try:
        peer = Peer("trainer", target["peer"])
        manifest, peer = _announced_manifest(target, storage, uri, peer, name, peer_timeout,
                                             wait or time.sleep, commit_timeout)
        check_manifest(manifest, target)
        job = _Fetch(storage, uri, manifest, name, tmp, peer, None, peer_timeout)
        if peer is not None:  # S3 may lack the files yet: read it once committed
            job.before_s3 = lambda: await_commit(target, storage, uri, wait or time.sleep, commit_timeout)
        got = job.run(only=lambda name: not name.endswith(".safetensors"))
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, SyncError):
            raise
        raise SyncError(f"download of {uri}'s small files failed: {_short(e)}") from None
    got.times["downloadSeconds"] = time.perf_counter() - start - got.times["verifySeconds"]
    return replace(got, path=out, manifest=manifest)


class _Fetch:
    """One verified download of a manifest's files into `tmp`, published while it runs."""

    def __init__(self, storage, uri: str, manifest: dict, name: str, tmp: Path,
                 peer: Peer | None, server: PeerServer | None, peer_timeout: float):
        self.storage, self.uri, self.manifest, self.tmp = storage, uri, manifest, tmp
        self.peer, self.peer_timeout = peer, peer_timeout
        self.peer_name = peer.pod if peer is not None else None
        self.transfer = Transfer(name, manifest, tmp)
        self.server = server
        self.hash_seconds = 0.0
        self.s3_bytes = self.peer_bytes = 0
        self.used_peer = self.fell_back = False
        self.before_s3: Callable[[], object] | None = None  # called once, before the first S3 read

    def run(self, only: Callable[[str], bool] | None = None) -> Fetched:
        """Every file of the manifest (`only`: those it accepts by name)."""
        (self.tmp / MANIFEST_COPY).write_text(json.dumps(self.manifest))
        if self.server is not None:
            self.server.publish(self.transfer)
        for name, meta in sorted(self.manifest["files"].items()):
            if only is not None and not only(name):
                continue
            if self.peer is not None and self._from_peer(name, meta):
                continue
            self._from_s3(name, meta)
        source = "s3"
        if self.used_peer:
            source = f"peer {self.peer_name}" + (", then s3" if self.fell_back else "")
        return Fetched(self.tmp, {"verifySeconds": self.hash_seconds}, source, self.s3_bytes, self.peer_bytes)

    def _from_peer(self, name: str, meta: dict) -> bool:
        """The file from the parent, checked; False (and no peer from here on) if it failed.
        A stream cut mid-body is asked for once more: the parent may have restarted the
        file from S3 (its own parent failed), and its children should not all follow."""
        self.used_peer = True
        for attempt in (1, 2):
            try:
                with self._writing(name, meta) as sink:
                    read_from_peer(self.peer, self.transfer.name, name, meta["size"], sink.f, sink.add,
                                   self.peer_timeout)
                self.peer_bytes += meta["size"]
                return True
            except PeerError as e:
                self.transfer.restart(name)  # our own children's streams of it end too
                if e.retry and attempt == 1:
                    log.info("%s from peer %s: %s; asking again", name, self.peer.pod, e)
                    continue
                error = e
            except SyncError as e:  # bytes that do not match the manifest
                self.transfer.restart(name)
                error = e
            break
        log.warning("%s from peer %s failed (%s): reading it and the rest from S3", name, self.peer.pod, error)
        self.peer, self.fell_back = None, True
        return False

    def _from_s3(self, name: str, meta: dict) -> None:
        if self.before_s3 is not None:
            before, self.before_s3 = self.before_s3, None
            before()
        uri = join(self.uri, name)
        try:
            with self._writing(name, meta) as sink:
                for part in read_parts(self.storage, uri, meta.get("size")):
                    part = memoryview(part)
                    for i in range(0, len(part), CHUNK):  # children see progress per CHUNK
                        piece = part[i:i + CHUNK]
                        write_all(sink.f, piece)
                        sink.add(piece)
        except FileNotFoundError:
            raise SyncError(f"{uri}: listed in {MANIFEST} but missing") from None
        self.s3_bytes += meta["size"]

    def _writing(self, name: str, meta: dict) -> "_Sink":
        if not is_safe_file_name(name):  # checked with the manifest; never write outside tmp
            raise SyncError(f"{MANIFEST} lists {name!r}: not a plain file name")
        return _Sink(self, name, meta)


class _Sink:
    """One file being written: publishes progress as pieces land, hashes them on a thread
    of its own (sha256 releases the GIL, so hashing overlaps the next piece's download and
    write), and on exit checks size and sha256 against the manifest; only then is the file
    `verified` for children. Pieces handed to `add` must not be reused by the caller."""

    _DONE = None

    def __init__(self, fetch: _Fetch, name: str, meta: dict):
        self.fetch, self.name, self.meta = fetch, name, meta
        self.h, self.size = hashlib.sha256(), 0
        self._pieces: queue.Queue = queue.Queue(maxsize=4)  # at most 4 pieces in memory
        self._hasher = threading.Thread(target=self._hash, name=f"sha256-{name}", daemon=True)

    def __enter__(self) -> "_Sink":
        self.f = open(self.fetch.tmp / self.name, "wb", buffering=0)
        self.fetch.transfer.wrote(self.name, 0)
        self._hasher.start()
        return self

    def _hash(self) -> None:
        while (piece := self._pieces.get()) is not self._DONE:
            self.h.update(piece)

    def add(self, piece: memoryview) -> None:
        self._pieces.put(piece)
        self.size += len(piece)
        self.fetch.transfer.wrote(self.name, self.size)

    def __exit__(self, kind, exc, tb) -> None:
        self.f.close()
        t = time.perf_counter()
        self._pieces.put(self._DONE)
        self._hasher.join()
        # Only the hashing that did not overlap the transfer: its cost on the way.
        self.fetch.hash_seconds += time.perf_counter() - t
        if kind is not None:
            return
        if reason := mismatch(self.size, self.h.hexdigest(), self.meta):
            raise SyncError(f"{self.name}: {reason}")
        self.fetch.transfer.verified(self.name)


def _download_unverified(storage, uri: str, target: dict, to: Path) -> Fetched:
    """No manifest (a base model as the user uploaded it): every object under the prefix,
    from S3, loaded unverified. Nothing to check a peer's bytes against, so no relay."""
    log.warning("version %s at %s has no manifest.json: loading it unverified", target["version"], uri)
    base = uri.rstrip("/") + "/"
    names = [o[len(base):] for o in storage.list(base)]
    if not names:
        raise SyncError(f"{uri}: no such weights (nothing under the prefix)")
    total = 0
    for name in names:
        total += download_to(storage, join(uri, name), to / name).size  # streamed, multipart on S3
    return Fetched(to, {"verifySeconds": 0.0}, "s3", total)


class Superseded(SyncError):
    """The wait for a version's commit ended: the target changed or the agent stops."""


def _announced_manifest(target: dict, storage, uri: str, peer: Peer | None, name: str, peer_timeout: float,
                        wait: Callable[[float], bool], commit_timeout: float) -> tuple[dict, Peer | None]:
    """The manifest whose digest the target names, and the peer to read the files from
    (None once the peer sent a manifest that does not match: not asked again)."""
    want = target["manifest"]
    if peer is not None:
        try:
            manifest = read_manifest_from_peer(peer, name, peer_timeout)
            if manifest_digest(manifest) == want:
                return manifest, peer
            log.warning("the manifest from peer %s is not the one announced (%s): reading S3", peer.pod, want)
            peer = None
        except PeerError as e:
            log.info("no manifest from peer %s (%s): waiting for version %s in S3", peer.pod, e, target["version"])
            if not e.answered:
                peer = None  # unreachable: not asked for the files either
            # A peer that answered (not started yet) may still stream the files.
    return await_commit(target, storage, uri, wait, commit_timeout), peer


def await_commit(target: dict, storage, uri: str, wait: Callable[[float], bool], commit_timeout: float) -> dict:
    """The manifest in S3 once the trainer committed it, checked against the announced digest."""
    want = target["manifest"]
    deadline, pause = time.monotonic() + commit_timeout, 0.2
    while True:
        try:
            manifest = _read_manifest(storage, uri)
        except FileNotFoundError:
            manifest = None
        if manifest is not None and target.get("id") and manifest.get("id") != target["id"]:
            manifest = None  # the same step exported before (a resumed attempt): not this commit yet
        if manifest is not None:
            if manifest_digest(manifest) != want:
                raise SyncError(f"the manifest in {uri} is not the one announced for version "
                                f"{target['version']} (exported again meanwhile?)")
            return manifest
        if time.monotonic() > deadline:
            raise SyncError(f"version {target['version']} was announced but not committed to {uri} "
                            f"within {commit_timeout:.0f}s, and its peer did not serve it")
        if wait(pause):
            raise Superseded(f"stopped waiting for version {target['version']}'s commit")
        pause = min(2.0, pause * 2)


def _read_manifest(storage, uri: str) -> dict:
    """The export's manifest in one GET (a read through the transfer manager costs a HEAD
    and a thread pool first)."""
    return json.loads(b"".join(read_parts(storage, join(uri, MANIFEST))))


def check_manifest(manifest: dict, target: dict) -> None:
    if target.get("id") and manifest.get("id") and manifest["id"] != target["id"]:
        raise SyncError(f"manifest id {manifest['id']} is not the target's {target['id']} "
                        "(version re-exported meanwhile)")
    bad = [n for n in manifest.get("files", {}) if not is_safe_file_name(n)]
    if bad:
        raise SyncError(f"{MANIFEST} lists {bad[0]!r}: not a plain file name")


def verify_dir(path: Path, manifest: dict, target: dict) -> None:
    if target.get("id") and manifest.get("id") and manifest["id"] != target["id"]:
        raise SyncError(f"manifest id {manifest['id']} is not the target's {target['id']} "
                        "(version re-exported meanwhile)")
    if problem := verify_local(path, manifest):
        raise SyncError(problem)


def _short(e: Exception) -> str:
    """Exception type and S3 error code: never the message, which may echo request
    details (URLs with signatures)."""
    response = getattr(e, "response", None)
    code = response.get("Error", {}).get("Code") if isinstance(response, dict) else None
    return f"{type(e).__name__}" + (f" ({code})" if code else "")
