"""A model named by an s3:// prefix, fetched to the node once: local rank 0 downloads into the
node's model cache, reusing files whose size and sha256 match (a hostPath or PVC cache
survives attempts), and every rank waits for all nodes on a group of its own.

`ModelCache` belongs to the process's `Runtime` (`rt.models`), so there is no module-level
state: the directories fetched so far and the download group live there. Its knobs come
from the pod's `PodEnv` (`JobConfig.env`: `RFT_MODEL_CACHE`, `RFT_MODEL_DOWNLOAD_TIMEOUT`
from spec.model.cache, and the S3 ones), handed to `init_distributed`.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from rft_contract.manifest import MANIFEST
from rft_contract.layout import ADAPTER_CONFIG
from rft_contract.podenv import PodEnv
from rft_contract.storage import LocalStorage, download_to

# `rt` below is the process's parallelize.Runtime (not imported: the Runtime holds the cache).
log = logging.getLogger(__name__)

LOCK = ".lock"
COMPLETE = ".complete"  # the cache's record: {name: {size, etag, sha256}} of the verified files


class ModelCache:
    """s3:// model prefix -> its local directory, for one process (`Runtime.models`)."""

    def __init__(self, env: PodEnv | None = None):
        self.env = PodEnv.read() if env is None else env
        self.root, self.timeout = self.env.model_cache, self.env.model_download_timeout
        self._local: dict[str, str] = {}  # every rank asks at the same points, so all skip alike
        self._group = None

    def fetch(self, path: str, rt: Any) -> str:
        """A local directory for `path`: itself, or the s3:// prefix downloaded once per
        node. Every rank waits for all nodes on a gloo group whose timeout is the
        download timeout; a failed download fails every rank at once, naming the node's
        error."""
        if not path.startswith("s3://"):
            return path
        if path in self._local:
            return self._local[path]
        local = os.path.join(self.root, hashlib.sha256(path.encode()).hexdigest()[:16])
        group = self._download_group(rt)  # before any rank starts a download that others wait for
        error = None
        if rt.local_rank == 0:
            try:
                sync_model_dir(path, local, self.env)
            except Exception as e:  # reported to every rank below, so none waits for the timeout
                error = e
        reports: list = [None] * rt.world_size
        if group is not None:
            dist.all_gather_object(reports, None if error is None else f"{type(error).__name__}: {error}", group=group)
        if error is not None:
            raise error
        if failed := [(r, msg) for r, msg in enumerate(reports) if msg]:
            raise RuntimeError(f"downloading the model {path} failed on the node of rank {failed[0][0]}: {failed[0][1]}")
        self._local[path] = local
        return local

    def _download_group(self, rt: Any):
        """A gloo group for the download wait, with its own timeout (a default-timeout
        barrier would give up on a large model after 30 min, or wait that long for a
        failed one)."""
        if not dist.is_initialized() or rt.world_size == 1:
            return None
        if self._group is None:
            self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout))
        return self._group


def fetch_model(path: str, rt: Any) -> str:
    """`rt.models.fetch(path, rt)`: the local directory of a model path (see ModelCache)."""
    return rt.models.fetch(path, rt)


def sync_model_dir(path: str, local: str, env: PodEnv | None = None) -> None:
    """`_sync_model_dir` under an exclusive lock on the cache directory: two pods of a job
    on one node may share a hostPath or PVC cache, and a download killed mid-file leaves a
    partial `.tmp-` file that only a holder of the lock may remove."""
    os.makedirs(local, exist_ok=True)
    with open(os.path.join(local, LOCK), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        _sync_model_dir(path, local, env)


def _sync_model_dir(path: str, local: str, env: PodEnv | None) -> None:
    """Make `local` a verified copy of every object under the s3:// prefix `path`.

    Each file is streamed to disk and hashed in one pass (`download_to`). A file already
    there is kept when its size and sha256 match the expected ones: the prefix's
    manifest.json entry (a weights export), else the record in `.complete` of the same
    object (same size and ETag) downloaded before. Files no longer under the prefix are
    removed (a stale *.safetensors would be loaded)."""
    from rft_contract.s3 import S3Storage  # boto3, imported only where a model is on S3

    storage, base, root = S3Storage(env=env), path.rstrip("/") + "/", os.path.abspath(local)
    objects = {uri[len(base):]: meta for uri, meta in storage.list_objects(base).items() if not uri.endswith("/")}
    if "config.json" not in objects and ADAPTER_CONFIG not in objects:
        raise FileNotFoundError(f"{path}: no config.json (an HF model) or {ADAPTER_CONFIG} (a PEFT adapter, "
                                "spec.model.lora.adapterPath) under this prefix")
    listed = json.loads(storage.read_bytes(base + MANIFEST)).get("files", {}) if MANIFEST in objects else {}
    record = _read_record(os.path.join(root, COMPLETE))
    start, files, nbytes, reused = time.perf_counter(), {}, 0, 0
    for name, obj in sorted(objects.items()):
        expected = listed.get(name)
        old = record.get(name) if isinstance(record.get(name), dict) else {}
        if expected is None and (old.get("size"), old.get("etag")) == (obj["size"], obj["etag"]):
            expected = old
        got = download_to(storage, base + name, os.path.join(root, name), expected or {"size": obj["size"]})
        files[name] = {"size": got.size, "etag": obj["etag"], "sha256": got.sha256}
        reused += got.reused
        nbytes += 0 if got.reused else got.size
    for dirpath, _, names in os.walk(root):
        for n in names:
            rel = os.path.relpath(os.path.join(dirpath, n), root)
            if rel not in files and rel not in (COMPLETE, LOCK):  # incl. partial .tmp- files of a killed attempt
                os.remove(os.path.join(dirpath, n))
    LocalStorage().write_bytes(os.path.join(root, COMPLETE), json.dumps(files, indent=1, sort_keys=True).encode())
    log.info("model %s in %s: %d files downloaded (%.2f GB), %d reused from the cache, in %.1fs", path, root,
             len(files) - reused, nbytes / 1e9, reused, time.perf_counter() - start)


def _read_record(path: str) -> dict:
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, ValueError):  # absent, or an older empty marker: nothing to trust
        return {}
    return record if isinstance(record, dict) else {}
