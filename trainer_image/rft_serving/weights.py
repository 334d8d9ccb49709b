"""Weights on the inference pod's local disk: download a target export once per (version,
id), verify every file against its manifest, and hand the engine a local directory.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path

from rft_contract.manifest import MANIFEST, read_manifest, verify_local
from rft_contract.storage import download_to, get_storage, join

from .engines import SyncError

log = logging.getLogger("rft_serving.weights")


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
        manifest = read_manifest(storage, uri)
    except FileNotFoundError:
        manifest = None
    if manifest is None:
        base = uri.rstrip("/") + "/"
        names = [o[len(base):] for o in storage.list(base)]
        if not names:
            raise SyncError(f"{uri}: no such weights (nothing under the prefix)")
    else:
        names = list(manifest["files"])
    for name in names:
        download_to(storage, join(uri, name), to / name)  # streamed, multipart on S3
    return manifest


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


