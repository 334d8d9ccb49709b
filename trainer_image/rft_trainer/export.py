"""Export the policy as an HF model directory for inference engines:
`<checkpoint.uri>/weights/step-NNNNNNNN/` with safetensors shards, the HF index, config,
tokenizer files and a `manifest.json` written last (every file with size and sha256).

`WeightExporter` is the synchronizer's side in the trainer: it writes a version through
the engine's `export_policy` (`export_hf` for the FSDP engine), keeps `sync.keep` of them
and hands each on (the Trainer reports it; the operator promotes it; the sync agents load it).

Gathering streams one parameter at a time: every rank takes part in the all-gather of
each sharded tensor, rank 0 alone keeps the full tensor, cast to the export dtype, in a
bucket that is written and uploaded once it reaches `max_shard_bytes`. No rank ever holds
a full copy of the model, and rank 0 holds at most one bucket plus one tensor. Rank 0
also records each tensor's fingerprint as exported (`fingerprint.json`,
rft_contract.fingerprint), the exact check every engine's load is held to.

The fast path (`FastPath`, on unless `sync.fastPath: false`): rank 0 keeps the version's
files in a local directory, hashes each as it is written, and uploads them to S3 on a
thread beside the export. Once the last file is written the manifest is complete: rank 0
serves the directory on its weights server (rft_contract.relay's, the one the replicas run)
and announces the version with the server's URL and the manifest's digest, so the first
replica streams it from the trainer while the upload runs, and the rest of the relay tree
from it. The manifest is written to S3 (the commit) only after every upload finished and
matched the local hash; S3 stays the source for a replica that joins late or restarts, and
for rollback. A replica takes a manifest from a peer only if its digest is the announced
one, and every file only if it matches that manifest, as on the S3 path.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import shutil
import uuid
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from rft_contract import layout
from rft_contract.layout import weights_uri
from rft_contract.fingerprint import FINGERPRINT_FILE, Fingerprint, export_stats
from rft_contract.hashing import sha256_file
from rft_contract.manifest import (apply_retention, committed, manifest_digest, read_manifest, verify_objects,
                                   write_manifest)
from rft_contract.podenv import PodEnv
from rft_contract.storage import Storage, join, upload_file
from rft_contract.times import now_text
from rft_contract.relay import PeerServer, Transfer, url_host, version_dir_name
from rft_contract.spec import LoraSpec

from . import lora
from .parallelize import Runtime, tied_parameters

log = logging.getLogger(__name__)

ADAPTER_FORMAT = "peft-lora"  # the manifest's `format` of an adapter-only version (export_adapter)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "generation_config.json",
                   "chat_template.jinja")


def committed_versions(storage: Storage, root: str) -> list[int]:
    """Exported versions whose manifest exists (the commit marker), ascending."""
    return committed(layout.list_step_dirs(storage, join(root, layout.WEIGHTS)))


def apply_weights_retention(storage: Storage, root: str, keep: int,
                            protect: set[int] = frozenset()) -> list[int]:
    """Keep the newest `keep` committed versions (and `protect`, e.g. a pinned version);
    returns the committed versions that remain, ascending (from the same listing)."""
    return apply_retention(storage, join(root, layout.WEIGHTS), keep, protect, kind="weights", unit="version").kept


class WeightExporter:
    """Writes policy versions under `<root>/weights/step-N/` and hands each on: the checkpoint
    manager's `upload_state_dict` (and so the engine's seed methods) end here.

    `write(storage, dest, dtype)` is the engine's `export_policy`; it is collective, so every
    rank calls `publish` at the same step. Then rank 0 keeps the newest `keep` versions (and
    `pinned`) and calls `on_publish(step, uri, manifest, versions, seconds)` (`seconds`: the
    export's, not the retention's), which reports
    `status.trainer.latestWeights`. A step is published once: a second call returns the
    first's manifest (the seed's `save_state_dict`, `upload_state_dict` and `sync_weight` may
    all be called at one step). Step 0 is the initial policy, `model.path`, which the
    inference pods start on: nothing to publish."""

    def __init__(self, storage: Storage, root: str, dtype: str, keep: int, pinned: int | None,
                 write: Callable[..., dict | None],
                 on_publish: Callable[[int, str, dict, list[int] | None, float], None] | None = None,
                 fast: "FastPath | None" = None,
                 on_announce: Callable[[int, str, dict, "Announced"], None] | None = None):
        self.storage, self.root, self.dtype, self.keep, self.pinned = storage, root, dtype, keep, pinned
        self.write, self.on_publish = write, on_publish
        # Rank 0 on the fast path: `write` gets a `stage` (keyword) and `on_announce` is
        # called once the version is served from this pod, before its upload ends. An
        # engine whose export_policy takes no stage (written before it) publishes through S3.
        if fast is not None and "stage" not in inspect.signature(write).parameters:
            log.warning("the engine's export_policy takes no `stage`: weights go through S3 only")
            fast = None
        self.fast, self.on_announce = fast, on_announce
        self.last_step: int | None = None  # the last version published
        # More versions kept past `keep` (spec.evaluation's best, and the one being scored).
        self.keep_also: Callable[[], set[int]] = set
        self.last_manifest: dict | None = None  # its manifest (rank 0)

    def publish(self, step: int) -> dict | None:
        """Export step `step` (collective) unless published already; its manifest on rank 0.
        A failed export is not tried again at the same step, on every rank alike (they
        must agree on whether to enter the collective): the error reaches the caller."""
        if step == self.last_step or step == 0:
            return self.last_manifest if step else None
        start = time.perf_counter()
        uri = weights_uri(self.root, step)
        self.last_manifest = None
        stage = None
        if self.fast is not None:
            stage = self.fast.stage(step, lambda m, a: self.on_announce and self.on_announce(step, uri, m, a))
        try:
            if stage is None:
                manifest = self.write(self.storage, uri, self.dtype)
            else:
                manifest = self.write(self.storage, uri, self.dtype, stage=stage)
        except BaseException:
            if stage is not None:
                stage.abandon()
            raise
        finally:
            self.last_step = step
        seconds = time.perf_counter() - start
        self.last_manifest = manifest
        if manifest is None:  # not rank 0
            return None
        protect = {v for v in (self.pinned, *self.keep_also()) if v is not None}
        try:
            versions = apply_weights_retention(self.storage, self.root, self.keep, protect)
        except Exception as e:  # noqa: BLE001 - a failed cleanup must not stop training
            log.warning("weights retention failed: %s", e)
            versions = None
        if self.on_publish is not None:
            self.on_publish(step, uri, manifest, versions, seconds)
        return manifest


class Announced(dict):
    """What a fast-path announcement adds to `status.trainer.latestWeights`:
    {"peer": the weights server's URL, "manifest": the manifest's digest}."""


class Stage:
    """One version on the fast path: the local directory export_hf writes it into (kept
    while it is served), and `announce(manifest)`, which serves it and reports it."""

    def __init__(self, fast: "FastPath", step: int, on_announce: Callable[[dict, Announced], None]):
        self.fast, self.step, self.on_announce = fast, step, on_announce
        self.export_id = uuid.uuid4().hex[:16]
        self.path = fast.root / version_dir_name(step, self.export_id)
        self.path.mkdir(parents=True)

    def announce(self, manifest: dict) -> None:
        self.fast.serve(self.path, manifest)
        self.on_announce(manifest, Announced(peer=self.fast.url, manifest=manifest_digest(manifest)))

    def abandon(self) -> None:
        """The export failed: stop serving it and free the disk."""
        self.fast.drop(self.path)


class FastPath:
    """Rank 0's weights server: the newest version's directory, served to the replicas
    (relay.PeerServer: only the files its manifest lists, each only once complete)."""

    def __init__(self, root: Path, server: PeerServer, url: str):
        self.root, self.server, self.url = Path(root), server, url
        self.serving: Path | None = None
        self.manifest: dict | None = None  # the served version's

    @classmethod
    def start(cls, env: PodEnv) -> "FastPath | None":
        """The server on `env.weights_peer_port`, announced at the pod's IP; None when the
        operator did not ask for it (`sync.fastPath: false`, or not in a pod)."""
        if not (env.weights_peer_port and env.pod_ip):
            return None
        base = env.staging_dir if env.staging_dir and os.path.isdir(env.staging_dir) else None
        root = Path(tempfile.mkdtemp(prefix="rft-weights-", dir=base))
        server = PeerServer(root, port=env.weights_peer_port).start()
        log.info("fast path: serving each exported version on port %d while it uploads", server.port)
        return cls(root, server, f"http://{url_host(env.pod_ip)}:{server.port}")

    def stage(self, step: int, on_announce: Callable[[dict, Announced], None]) -> Stage:
        """A directory for version `step`. The version served until now is committed (the
        exports run one after the other), so it goes first: one export on disk at a time;
        a replica still reading it reads the rest from S3."""
        if self.serving is not None:
            self.drop(self.serving)
        return Stage(self, step, on_announce)

    def serve(self, path: Path, manifest: dict) -> None:
        """Serve `path` (complete and hashed) instead of the version before it."""
        self.server.publish(Transfer(path.name, manifest, path, complete=True))
        old, self.serving, self.manifest = self.serving, path, manifest
        if old is not None and old != path:
            self.drop(old)  # a replica still reading it gets a short body and reads S3

    def drop(self, path: Path) -> None:
        self.server.forget(path.name)
        shutil.rmtree(path, ignore_errors=True)
        if self.serving == path:
            self.serving = self.manifest = None

    def stop(self) -> None:
        self.server.stop()
        shutil.rmtree(self.root, ignore_errors=True)


class _Writer:
    """Rank 0's side: buckets of tensors -> safetensors files, uploaded as they fill. On
    the fast path (`stage`) the files stay in the stage's directory, each hashed there and
    uploaded on a thread beside the export; `finish` waits for the uploads."""

    def __init__(self, storage: Storage, dest: str, tmp: Path, max_shard_bytes: int, stage: Stage | None = None,
                 file_name: Callable[[int], str] | None = None):
        self.storage, self.dest, self.tmp, self.max = storage, dest, tmp, max_shard_bytes
        self.stage = stage
        self.file_name = file_name or (lambda i: f"model-{i:05d}.safetensors")  # i: 1, 2, ...
        self.bucket: dict[str, torch.Tensor] = {}
        self.bucket_bytes = 0
        self.files: dict[str, dict] = {}
        self.weight_map: dict[str, str] = {}
        self.total_bytes = 0
        self._uploads: dict[str, Future] = {}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="weights-upload") if stage is not None else None

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self.bucket[name] = tensor.contiguous()
        self.bucket_bytes += tensor.numel() * tensor.element_size()
        self.total_bytes += tensor.numel() * tensor.element_size()
        if self.bucket_bytes >= self.max:
            self.flush()

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self.bucket:
            return
        name = self.file_name(len(self.files) + 1)
        path = self.tmp / name
        save_file(self.bucket, str(path), metadata={"format": "pt"})
        for key in self.bucket:
            self.weight_map[key] = name
        self.upload(path)
        if self.stage is None:
            path.unlink()
        self.bucket, self.bucket_bytes = {}, 0

    def add_file(self, name: str, data: bytes) -> None:
        """A small file of the version (JSON), written beside the tensors and uploaded."""
        (self.tmp / name).write_bytes(data)
        self.upload(self.tmp / name)

    def upload(self, path: Path) -> None:
        if self._pool is None:
            got = upload_file(self.storage, path, join(self.dest, path.name))  # streamed, hashed as it goes
            self.files[path.name] = {"size": got.size, "sha256": got.sha256}
            return
        self.files[path.name] = {"size": path.stat().st_size, "sha256": sha256_file(path)}
        self._uploads[path.name] = self._pool.submit(upload_file, self.storage, path, join(self.dest, path.name))

    def finish(self) -> None:
        """Every upload done, each of the bytes hashed before it (the fast path). Raises the
        first upload's error, or names a file whose upload does not match the local hash."""
        if self._pool is None:
            return
        try:
            for name, pending in self._uploads.items():
                got = pending.result()
                if (got.size, got.sha256) != (self.files[name]["size"], self.files[name]["sha256"]):
                    raise RuntimeError(f"{name}: the bytes uploaded differ from the bytes served "
                                       "(the file changed on local disk)")
        finally:
            self._pool.shutdown(wait=True, cancel_futures=True)


def export_hf(model: nn.Module, rt: Runtime, storage: Storage, dest: str, model_dir: str | None,
              step: int, dtype: str = "bf16", max_shard_bytes: int = 2 << 30,
              extra_files: dict[str, bytes] | None = None, stage: Stage | None = None) -> dict | None:
    """Collective: every rank must call it. Returns the manifest on rank 0, None elsewhere.
    `extra_files` (rank 0's count): written beside the weights and listed in the manifest
    (the probe, `probe.json`). `stage` (rank 0, the fast path): write into its directory and
    announce the version there before the upload ends."""
    # Names as the base model has them: LoRA adapters (rft_trainer.lora) are merged in.
    aliases = {lora.hf_name(a): lora.hf_name(n) for a, n in tied_parameters(model).items()}
    parameters = {lora.hf_name(name) for name, _ in model.named_parameters()  # what engines compare (no buffers)
                  if not lora.is_adapter_key(name)}
    gathered = _gathered(model, lambda name: lora.hf_name(name) not in aliases)  # a tied weight once (HF re-ties it)

    def small_files(writer: _Writer) -> None:
        index = {"metadata": {"total_size": writer.total_bytes}, "weight_map": writer.weight_map}
        writer.add_file("model.safetensors.index.json", json.dumps(index, indent=1).encode())
        config = model.config
        config.torch_dtype = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[dtype]
        config.save_pretrained(str(writer.tmp))  # tie_word_embeddings as trained
        writer.upload(writer.tmp / "config.json")
        for name in TOKENIZER_FILES:
            if model_dir and name != "config.json" and os.path.exists(os.path.join(model_dir, name)):
                shutil.copy(os.path.join(model_dir, name), writer.tmp / name)
                writer.upload(writer.tmp / name)

    return _export(rt, storage, dest, step, dtype, "hf-safetensors",
                   lambda compute: lora.merged(model, gathered, compute=compute), parameters, aliases,
                   small_files, max_shard_bytes, extra_files, stage)


def export_adapter(model: nn.Module, rt: Runtime, storage: Storage, dest: str, spec: LoraSpec, base: str | None,
                   step: int, dtype: str = "bf16", extra_files: dict[str, bytes] | None = None,
                   stage: Stage | None = None) -> dict | None:
    """The LoRA adapters alone, as PEFT saves them (`adapter_config.json`,
    `adapter_model.safetensors`; rft_trainer.lora), for engines that load an adapter onto
    the base they serve; the fingerprint covers the adapters, the probe the base with them.
    Collective, like `export_hf` (every rank gathers each adapter)."""
    parameters = {lora.peft_name(name) for name, _ in model.named_parameters() if lora.is_adapter_key(name)}

    def small_files(writer: _Writer) -> None:
        lora.adapter_config(model, spec, base).save_pretrained(str(writer.tmp))
        writer.upload(writer.tmp / layout.ADAPTER_CONFIG)

    def tensors(compute: bool):
        return lora.adapter_items(_gathered(model, lora.is_adapter_key))

    return _export(rt, storage, dest, step, dtype, ADAPTER_FORMAT, tensors, parameters, {}, small_files,
                   None, extra_files, stage, file_name=lambda i: lora.ADAPTER_FILE)


def _gathered(model: nn.Module, keep: Callable[[str], bool]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) of the state dict's entries `keep` takes, on every rank (each
    sharded one is all-gathered: a collective)."""
    return ((name, value.full_tensor() if hasattr(value, "full_tensor") else value)
            for name, value in model.state_dict().items() if keep(name))


def _export(rt: Runtime, storage: Storage, dest: str, step: int, dtype: str, fmt: str,
            tensors: Callable[[bool], Iterable[tuple[str, torch.Tensor]]], parameters: set[str],
            aliases: dict[str, str], small_files: Callable[["_Writer"], None], max_shard_bytes: int | None,
            extra_files: dict[str, bytes] | None, stage: Stage | None,
            file_name: Callable[[int], str] | None = None) -> dict | None:
    """The export both formats share: `tensors(compute)` (every rank consumes it; rank 0,
    `compute` True, keeps the values) cast to `dtype` into safetensors files, uploaded as
    they fill; then `small_files`, the fingerprint of `parameters` and `extra_files`; the
    manifest last."""
    start = time.perf_counter()
    cast = DTYPES[dtype]
    max_bytes = max_shard_bytes if max_shard_bytes is not None else 1 << 62  # None: one file
    if stage is not None and rt.is_main:
        tmp = None  # the stage's directory outlives the export (it is served)
        writer = _Writer(storage, dest, stage.path, max_bytes, stage, file_name)
    else:
        tmp = Path(tempfile.mkdtemp(prefix="rft-export-")) if rt.is_main else None
        writer = _Writer(storage, dest, tmp, max_bytes, file_name=file_name) if rt.is_main else None
    stats: dict[str, tuple[float, float, float]] = {}  # the fingerprint (rft_contract.fingerprint)
    try:
        for name, full in tensors(writer is not None):
            if writer is not None:
                out = full.detach().to(dtype=cast) if full.is_floating_point() else full.detach()
                if out.is_floating_point() and name in parameters:
                    stats[name] = export_stats(out)  # of the values as exported, on the device
                writer.add(name, out.to("cpu"))
                del out
            del full
        if writer is None:
            return None
        writer.flush()
        small_files(writer)
        fingerprint = {FINGERPRINT_FILE: Fingerprint(stats, dtype, step, aliases).to_json().encode()}
        for name, data in {**fingerprint, **(extra_files or {})}.items():
            writer.add_file(name, data)
        # `id` tells two exports of the same step apart (a resumed attempt re-exports
        # the steps it replays): sync agents reload when (version, id) changes.
        export_id = stage.export_id if stage is not None else uuid.uuid4().hex[:16]
        manifest = {"step": step, "id": export_id, "format": fmt, "dtype": dtype,
                    "files": writer.files, "bytes": writer.total_bytes,
                    "created": now_text(),
                    "export_seconds": round(time.perf_counter() - start, 3)}
        if writer.stage is not None:
            writer.stage.announce(manifest)  # replicas stream it from here while the uploads run
        writer.finish()
        # Written last: readers treat a weights directory without it as absent.
        write_manifest(storage, dest, manifest)
        log.info("exported step %d (%s, %s, %.1f MiB) to %s in %.1fs", step, fmt, dtype,
                 writer.total_bytes / 2**20, dest, manifest["export_seconds"])
        return manifest
    finally:
        if writer is not None and writer._pool is not None:
            writer._pool.shutdown(wait=True, cancel_futures=True)  # nothing reads the files after this
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if dist.is_initialized() and rt.world_size > 1:
            dist.barrier()


def verify(storage: Storage, dest: str) -> dict:
    """The manifest of a weights directory, after checking every file's size and sha256.
    Raises ValueError naming the first file that does not match."""
    if problem := verify_objects(storage, dest):
        raise ValueError(f"{dest}: {problem}")
    return read_manifest(storage, dest)
