"""The commit marker of a checkpoint step or a weights export: `manifest.json`, written
last, listing every file with its size and sha256. S3 has no rename, so a directory
without a manifest is an upload that never finished. One verifier (remote objects, a
local copy, or `download_verified`, which checks each file in the pass that downloads
it) and one retention policy serve checkpoints and weight exports alike. Every check
streams: no file is ever whole in memory.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection

from .layout import list_step_dirs
from .storage import IntegrityError, Storage, download_to, join, mismatch, read_parts, sha256_file

log = logging.getLogger("rft_contract.manifest")

MANIFEST = "manifest.json"


def file_entry(data: bytes) -> dict[str, Any]:
    """A manifest's entry for one file's bytes."""
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def read_manifest(storage: Storage, prefix: str) -> dict[str, Any]:
    return json.loads(storage.read_bytes(join(prefix, MANIFEST)))


def write_manifest(storage: Storage, prefix: str, manifest: dict[str, Any]) -> None:
    """The commit: call it after every listed file is uploaded."""
    storage.write_bytes(join(prefix, MANIFEST), json.dumps(manifest, indent=1, sort_keys=True).encode())


def manifest_digest(manifest: dict[str, Any]) -> str:
    """`sha256:<hex>` of the manifest's content (canonical JSON: sorted keys, no spaces),
    whatever bytes carried it: what a weights target names, so that a manifest from a peer
    (the trainer's fast path, a parent replica) is trusted exactly as far as the one in S3."""
    body = json.dumps(manifest, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return "sha256:" + hashlib.sha256(body.encode()).hexdigest()


def _mismatch(name: str, size: int, digest: str, meta: dict[str, Any]) -> str | None:
    reason = mismatch(size, digest, meta)
    return f"{name}: {reason}" if reason else None


def verify_objects(storage: Storage, prefix: str) -> str | None:
    """None if the directory at `prefix` is committed and intact, else why it is not.
    Reads every object (sha256 needs the bytes), streamed part by part."""
    try:
        manifest = read_manifest(storage, prefix)
    except FileNotFoundError:
        return f"no {MANIFEST} (upload never completed)"
    except ValueError as e:
        return f"unreadable {MANIFEST}: {e}"
    for name, meta in sorted(manifest.get("files", {}).items()):
        h, size = hashlib.sha256(), 0
        try:
            for part in read_parts(storage, join(prefix, name)):
                h.update(part)
                size += len(part)
        except FileNotFoundError:
            return f"{name}: listed in {MANIFEST} but missing"
        if reason := _mismatch(name, size, h.hexdigest(), meta):
            return reason
    return None


def verify_local(path: Path, manifest: dict[str, Any]) -> str | None:
    """The same check over a downloaded copy in `path`, streamed from disk."""
    for name, meta in sorted(manifest.get("files", {}).items()):
        f = path / name
        if not f.is_file():
            return f"{name}: listed in {MANIFEST} but missing"
        if reason := _mismatch(name, f.stat().st_size, sha256_file(f), meta):
            return reason
    return None


@dataclass(frozen=True)
class Downloaded:
    files: int  # downloaded (and verified in the same pass)
    reused: int  # already in `dest` with the listed size and sha256
    bytes: int  # of the downloaded files


def download_verified(storage: Storage, prefix: str, dest: Path, manifest: dict[str, Any]) -> Downloaded:
    """Copy every file the manifest lists from `prefix` into `dest`, each checked against
    its entry while it streams to disk (see `storage.download_to`); files already in
    `dest` with the listed size and sha256 are kept. IntegrityError names the first file
    that is missing or differs; a file that fails is never left in `dest`."""
    files = reused = nbytes = 0
    for name, meta in sorted(manifest.get("files", {}).items()):
        try:
            got = download_to(storage, join(prefix, name), dest / name, meta)
        except FileNotFoundError:
            raise IntegrityError(f"{join(prefix, name)}: listed in {MANIFEST} but missing") from None
        reused += got.reused
        files += not got.reused
        nbytes += 0 if got.reused else got.size
    return Downloaded(files, reused, nbytes)


def committed(found: dict[int, tuple[str, set[str]]]) -> list[int]:
    """Steps of a `list_step_dirs` listing that carry a manifest, ascending."""
    return sorted(s for s, (_, names) in found.items() if MANIFEST in names)


@dataclass(frozen=True)
class Retention:
    deleted: list[int]  # steps removed (committed ones past `keep`, and older leftovers)
    kept: list[int]  # committed steps that remain


def apply_retention(storage: Storage, base: str, keep: int, protect: Collection[int] = (),
                    kind: str = "checkpoint", unit: str = "step") -> Retention:
    """Keep the newest `keep` committed steps under `base` (plus `protect`, e.g. a pinned
    version); delete older committed ones and uncommitted leftovers older than the newest
    commit (crashed uploads; newer ones may be in flight). Manifests go first, so a
    reader never sees a committed step with missing files."""
    found = list_step_dirs(storage, base)
    done = committed(found)
    if not done:
        return Retention([], [])
    newest_first = done[::-1]
    doomed = (set(newest_first[keep:]) | {s for s, (_, names) in found.items()
                                          if MANIFEST not in names and s < done[-1]}) - set(protect)
    for s in sorted(doomed):
        prefix, names = found[s]
        for name in sorted(names, key=lambda n: n != MANIFEST):
            storage.delete(join(prefix, name))
        log.info("%s retention: deleted %s %d", kind, unit, s)
    return Retention(sorted(doomed), sorted(set(done) - doomed))
