"""The commit marker of a checkpoint step or a weights export: `manifest.json`, written
last, listing every file with its size and sha256. S3 has no rename, so a directory
without a manifest is an upload that never finished. One verifier (remote objects or a
local copy) and one retention policy serve checkpoints and weight exports alike.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection

from .layout import list_step_dirs
from .storage import Storage, join

log = logging.getLogger("rft_contract.manifest")

MANIFEST = "manifest.json"
_CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def file_entry(data: bytes) -> dict[str, Any]:
    """A manifest's entry for one file's bytes."""
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def read_manifest(storage: Storage, prefix: str) -> dict[str, Any]:
    return json.loads(storage.read_bytes(join(prefix, MANIFEST)))


def write_manifest(storage: Storage, prefix: str, manifest: dict[str, Any]) -> None:
    """The commit: call it after every listed file is uploaded."""
    storage.write_bytes(join(prefix, MANIFEST), json.dumps(manifest, indent=1, sort_keys=True).encode())


def _mismatch(name: str, size: int, digest: str, meta: dict[str, Any]) -> str | None:
    if size != meta["size"]:
        return f"{name}: size {size}, {MANIFEST} says {meta['size']}"
    if digest != meta["sha256"]:
        return f"{name}: sha256 differs from {MANIFEST} (corrupted object)"
    return None


def verify_objects(storage: Storage, prefix: str) -> str | None:
    """None if the directory at `prefix` is committed and intact, else why it is not.
    Reads every object (sha256 needs the bytes)."""
    try:
        manifest = read_manifest(storage, prefix)
    except FileNotFoundError:
        return f"no {MANIFEST} (upload never completed)"
    except ValueError as e:
        return f"unreadable {MANIFEST}: {e}"
    for name, meta in sorted(manifest.get("files", {}).items()):
        try:
            data = storage.read_bytes(join(prefix, name))
        except FileNotFoundError:
            return f"{name}: listed in {MANIFEST} but missing"
        if reason := _mismatch(name, len(data), hashlib.sha256(data).hexdigest(), meta):
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
