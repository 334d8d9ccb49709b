"""Owns the checkpoint format and its commit: `CheckpointManager` saves and resumes an engine's
roles (+ step, extra, RNG) as sharded, crash-consistent DCP checkpoints in any `Storage`.

The Trainer builds it (`build_checkpointer`) and offers it every step (`maybe_save` decides
whether a save is due). A step saved on N ranks resumes on M.

Layout (docs/design.md): `<uri>/ckpt/step-00000100/{.metadata, __0_0.distcp, __1_0.distcp, ...,
manifest.json}`: the files torch.distributed.checkpoint (DCP) writes, plus our manifest.

- **Save.** Every rank DCP-saves one `AppState` (model + optimizer + LR scheduler per role,
  trainer step, `extra` such as the buffer position, RNG) into its *own* local staging
  dir (`$RFT_CKPT_STAGING`, default `$TMPDIR/rft-ckpt`; no shared filesystem needed), then
  uploads the files it wrote. Sizes and sha256 are gathered to rank 0, which writes
  `manifest.json` *last*: S3 has no rename, so the manifest is the commit.
- **Async.** `save(step, block=False)` returns once the state is copied in host memory
  (`dcp.async_save`: the training loop stalls for a memory copy, not for a disk write or
  an upload); the local DCP write, the upload and the commit run in the background, and
  their collectives use a dedicated gloo group so they never interleave with training
  collectives. The commit stays ours, after the DCP write: every rank's files uploaded
  (each streamed from disk and sha256-hashed in the same pass, `storage.upload_file`),
  then the manifest. The copy doubles the host memory of the state while a save is in
  flight. Rule: **at most one save in flight**; `save`, `load`, `resume` and
  `wait_on_save_thread` first wait for the previous one, and re-raise its error.
- **The seed's names** (Trinity-RFT's checkpoint manager): `save_checkpoint(step,
  block_until_saved, model_state_dict_only)`, `upload_state_dict(step)` (the policy to the
  synchronizer: the Trainer's `WeightExporter`, export.py) and `wait_on_save_thread()`. The
  engine's seed methods (`TrainEngineWrapper.save_checkpoint`, `save_state_dict`,
  `upload_state_dict`, `sync_weight`) call these.
- **Read.** A step counts only if `manifest.json` exists and every file it lists exists
  with the listed size and sha256 (`verify_step`, `latest_verified`, which logs one
  warning line per skipped step with the reason: a full remote check, streamed, for tools
  and tests; resume checks while it downloads instead).
- **Resume.** Rank 0 picks the newest committed step (manifest present, every listed
  file in the listing: no data read) and broadcasts it. On each node, local rank 0
  downloads it into the node's staging volume (`$RFT_STAGING_DIR/ckpt/step-N`), checking
  every file's size and sha256 in the same streamed pass; then every rank there
  `dcp.load`s from that directory, and local rank 0 removes it. A corrupted or missing
  file fails the step on every rank (the error names the file) and the next older
  step is tried. Without `$RFT_STAGING_DIR` (outside the operator's pods) every rank
  downloads into its own dir under the save staging root. DCP reshards, so a step
  saved on N ranks loads on M. The frozen reference model is not saved (it is the
  initial policy and reloads from `model.path`).
- **Retention** (rank 0, after each commit): keep the newest `keep` committed steps;
  delete older ones (manifest first, so a half-deleted step never reads as complete) and
  orphaned prefixes (crashed uploads) older than the newest committed step. Newer
  orphans may be an upload in flight and are kept.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
import threading
import time
from collections.abc import Collection
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from rft_contract import layout
from rft_contract.manifest import (MANIFEST, IntegrityError, download_verified, read_manifest, verify_objects,
                                   write_manifest)
from rft_contract.manifest import apply_retention as manifest_retention
from rft_contract.podenv import PodEnv
from rft_contract.storage import Storage, join, upload_file
from rft_contract.times import now_text

from . import lora
from .parallelize import Runtime

if TYPE_CHECKING:
    from .export import WeightExporter

log = logging.getLogger("rft_trainer.checkpoint")


def should_save_on_stop(now: float, stop_at: float, last_commit_at: float | None,
                        last_save_seconds: float | None, grace_seconds: float | None,
                        recent_seconds: float = 60.0) -> tuple[bool, str]:
    """On SIGTERM: save once more only if the last commit is not recent and the save is
    expected to finish inside the pod's termination grace period (with a 1.5x margin;
    a save cut off by SIGKILL commits nothing). Times are monotonic seconds."""
    if last_commit_at is not None and now - last_commit_at < recent_seconds:
        return False, f"last checkpoint committed {now - last_commit_at:.0f}s ago"
    if grace_seconds and last_save_seconds is not None:
        left = grace_seconds - (now - stop_at)
        if 1.5 * last_save_seconds > left:
            return False, f"a save takes ~{last_save_seconds:.0f}s but only {left:.0f}s of grace remain"
    return True, "saving before exit"


TRANSFER_TIMEOUT = timedelta(hours=4)


class CheckpointError(RuntimeError):
    pass


class CorruptCheckpoint(CheckpointError):
    """A step whose files are missing or differ from its manifest: resume tries an older one."""


def step_uri(uri: str, step: int) -> str:
    return layout.checkpoint_uri(uri, step)


def list_steps(storage: Storage, uri: str) -> dict[int, tuple[str, set[str]]]:
    """step -> (its prefix URI, names of the objects under it), from one listing."""
    return layout.list_step_dirs(storage, join(uri, layout.CHECKPOINTS))


def verify_step(storage: Storage, prefix: str) -> str | None:
    """None if the step at `prefix` is complete and intact, else the reason it is not."""
    return verify_objects(storage, prefix)


def latest_verified(storage: Storage, uri: str) -> int | None:
    """The newest step whose manifest verifies; logs a warning for each newer one skipped."""
    steps = list_steps(storage, uri)
    for step in sorted(steps, reverse=True):
        reason = verify_step(storage, steps[step][0])
        if reason is None:
            return step
        log.warning("checkpoint step %d skipped (%s): %s", step, steps[step][0], reason)
    return None


def apply_retention(storage: Storage, uri: str, keep: int, protect: Collection[int] = ()) -> list[int]:
    """Delete all but the newest `keep` committed steps (and `protect`: the checkpoint of
    spec.evaluation's best version), and uncommitted prefixes older than the newest
    committed step. Returns the deleted steps."""
    return manifest_retention(storage, join(uri, layout.CHECKPOINTS), keep, protect, kind="checkpoint",
                              unit="step").deleted


# ---------------------------------------------------------------- what is saved


def _all_gather(obj: Any, group) -> list[Any]:
    if group is None:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _rng_states(group) -> dict[str, list[bytes]]:
    """Every rank's RNG states, gathered so the (deduplicated) saved value holds all."""
    mine = {"cpu": torch.get_rng_state().numpy().tobytes(),
            "cuda": torch.cuda.get_rng_state().numpy().tobytes() if torch.cuda.is_available() else b""}
    per_rank = _all_gather(mine, group)
    return {k: [r[k] for r in per_rank] for k in ("cpu", "cuda")}


def _restore_rng(states: dict[str, list[bytes]], rank: int) -> None:
    """Rank r takes saved rank r's stream (r mod the saved world size when it grew)."""
    def pick(k: str) -> torch.Tensor | None:
        saved = states.get(k) or []
        b = saved[rank % len(saved)] if saved else b""
        return torch.frombuffer(bytearray(b), dtype=torch.uint8) if b else None

    if (cpu := pick("cpu")) is not None:
        torch.set_rng_state(cpu)
    if torch.cuda.is_available() and (cuda := pick("cuda")) is not None:
        torch.cuda.set_rng_state(cuda)


class AppState(Stateful):
    """Everything a resume needs, as one DCP `Stateful`.

    roles: name -> object with `.model` (FSDP2, or a plain module on one rank in fp32),
    `.optimizer`, `.scheduler` (the engine's Actor and Critic). `get_state_dict`/
    `set_state_dict` give DTensor shards (plain tensors: one whole shard) that DCP reshards
    on load, so any world size resumes what any other saved. `extra` is any JSON-able dict
    (the buffer position), stored as one string so its shape may change between runs.
    Optimizer state is per parameter; a checkpoint whose optimizer had other parameter
    groups (one group, before biases and norms were kept out of weight decay) loads into
    the live groups (`regroup`): `saved_groups` tells `state_dict` how many to expect.
    """

    def __init__(self, roles: dict[str, Any], rank: int = 0, group=None):
        self.roles = {k: v for k, v in roles.items() if v is not None}
        self.rank, self.group = rank, group
        self.step, self.extra = 0, {}
        self.saved_groups: dict[str, int] = {}  # role -> its optimizer's groups in the step being loaded

    def state_dict(self) -> dict[str, Any]:
        sd: dict[str, Any] = {"step": self.step, "extra": json.dumps(self.extra, sort_keys=True),
                              "rng": _rng_states(self.group)}
        for name, role in self.roles.items():
            model_sd, optim_sd = get_state_dict(role.model, role.optimizer, options=_options(role.model))
            if lora.has_adapters(role.model):  # a tied head's alias of the frozen embeddings stays in otherwise
                model_sd = {k: v for k, v in model_sd.items() if lora.is_adapter_key(k)}
            if (n := self.saved_groups.get(name, len(optim_sd["param_groups"]))) != len(optim_sd["param_groups"]):
                # DCP loads into this dict's keys: as many groups as were saved, each with
                # the keys every AdamW group has.
                optim_sd = {**optim_sd, "param_groups": [dict(optim_sd["param_groups"][0]) for _ in range(n)]}
            sd[name] = {"model": model_sd, "optim": optim_sd, "scheduler": role.scheduler.state_dict()}
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        for name, role in self.roles.items():
            part = sd[name]
            live = get_state_dict(role.model, role.optimizer, options=_options(role.model))[1]["param_groups"]
            optim, picked = regroup(part["optim"], live)
            set_state_dict(role.model, role.optimizer, model_state_dict=part["model"], optim_state_dict=optim,
                           options=_options(role.model))
            # The scheduler keeps one entry per group too (base_lrs, _last_lr, lr_lambdas).
            n = len(part["optim"]["param_groups"])
            role.scheduler.load_state_dict({k: [v[i] for i in picked] if isinstance(v, list) and len(v) == n else v
                                            for k, v in part["scheduler"].items()})
        self.step, self.extra = int(sd["step"]), json.loads(sd["extra"])
        _restore_rng(sd["rng"], self.rank)


def _options(model) -> StateDictOptions | None:
    """A model with LoRA adapters (rft_trainer.lora) saves and loads its adapters only
    (`AppState.state_dict` drops any other key left): the frozen base is `model.path`'s,
    loaded at build."""
    if not lora.has_adapters(model):
        return None
    return StateDictOptions(ignore_frozen_params=True, strict=False)


def regroup(saved: dict, live_groups: list[dict]) -> tuple[dict, list[int]]:
    """A saved optimizer state dict ({"state": {fqn: ...}, "param_groups": [{"params": [fqn],
    ...}]}) in the live optimizer's groups: each parameter's state as saved; each group's
    hyperparameters (the scheduled lr, betas, ...) from the saved group that held its first
    parameter, but weight_decay the live group's (it is configuration: decayed or not).
    Also returns, per live group, the index of that saved group."""
    owner = {fqn: i for i, g in enumerate(saved["param_groups"]) for fqn in g["params"]}
    picked = [owner[g["params"][0]] for g in live_groups]
    groups = [{**saved["param_groups"][i], "params": list(g["params"]), "weight_decay": g["weight_decay"]}
              for i, g in zip(picked, live_groups)]
    return {"state": saved["state"], "param_groups": groups}, picked


def saved_param_groups(path: str | Path, roles) -> dict[str, int]:
    """role -> how many optimizer parameter groups the DCP checkpoint at `path` holds."""
    keys = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    out = {}
    for name in roles:
        prefix = f"app.{name}.optim.param_groups."
        out[name] = len({k[len(prefix):].split(".", 1)[0] for k in keys if k.startswith(prefix)})
    return out


# ---------------------------------------------------------------- the manager


def config_hash(config) -> str:
    """A short hash of the whole job config, recorded in each manifest to explain odd resumes."""
    return hashlib.sha256(json.dumps(config.to_dict(), sort_keys=True, default=str).encode()).hexdigest()[:16]


def build_checkpointer(config, storage: Storage, rt: Runtime, roles: dict[str, Any]) -> "CheckpointManager":
    """The job's checkpointer: `config.checkpoint`'s uri, keep and interval on `storage`,
    saving `roles` (the engine's `checkpoint_roles()`)."""
    c = config.checkpoint
    return CheckpointManager(storage, c.uri, rt, c.keep, c.interval, roles, config_hash=config_hash(config),
                             env=config.env)



class CheckpointManager:
    """Saves and restores an `AppState` under `<uri>/ckpt/` (see the module docstring).

    Every rank constructs it and calls `save`/`maybe_save`/`resume` at the same steps.
    `staging_dir`: where each rank stages its saves (default `env.ckpt_staging`:
    `$RFT_CKPT_STAGING`, else `$TMPDIR/rft-ckpt`); `node_staging_dir`: the node's shared
    resume download dir (default `env.staging_dir`: `$RFT_STAGING_DIR`; unset: every rank
    downloads into `staging_dir`). `env`: the pod's knobs (`JobConfig.env`); None: read
    from the process environment.
    """

    def __init__(self, storage: Storage, uri: str, rt: Runtime, keep: int = 3, interval: int = 100,
                 roles: dict[str, Any] | None = None, staging_dir: str | None = None,
                 config_hash: str | None = None, node_staging_dir: str | None = None,
                 env: PodEnv | None = None):
        self.storage, self.uri, self.rt = storage, uri, rt
        self.keep, self.interval, self.config_hash = keep, interval, config_hash
        env = PodEnv.read() if env is None else env
        self.staging = Path(staging_dir or env.ckpt_staging)
        node = node_staging_dir or env.staging_dir
        self.node_staging = Path(node) if node else None
        # Commit collectives run in the upload thread: a group of their own keeps them
        # from interleaving with the training loop's collectives on the default group.
        # Its timeout covers the slowest rank's upload and a node's resume download of a
        # large checkpoint (gloo's default, 30 min, does not for tens of GB).
        # (Also on one rank: an async save needs a CPU group, and the default may be NCCL.)
        self.group = dist.new_group(backend="gloo", timeout=TRANSFER_TIMEOUT) if dist.is_initialized() else None
        self.app = AppState(roles or {}, rt.rank, self.group)
        self.last_saved: int | None = None  # staged (maybe still uploading)
        # Steps kept past `keep` (spec.evaluation's best version's checkpoint, if it has one).
        self.keep_also: Callable[[], set[int]] = set
        # Called on rank 0 as on_commit(step, prefix_uri) once a manifest is written,
        # from the upload thread when block=False (e.g. to report status.checkpoint).
        self.on_commit = None
        # What the Trainer saves beside the roles (the buffer position) when a save is
        # asked for by step alone (`save_checkpoint`), and where the policy goes for the
        # synchronizer (`upload_state_dict`): both set by the Trainer.
        self.extra_state: Callable[[], dict] | None = None
        self.weights: WeightExporter | None = None
        self.last_committed: int | None = None  # manifest written
        self.last_commit_at: float | None = None  # time.monotonic() of that commit
        self.last_commit_seconds: float | None = None  # its stage + upload time
        self._stage_seconds = 0.0  # the last save's staging, for last_commit_seconds
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    # ------------------------------------------------------------ save

    def save_checkpoint(self, step: int, block_until_saved: bool = False,
                        model_state_dict_only: bool = False) -> None:
        """The seed's save: step `step` with the Trainer's `extra_state()`, returning once the
        state is copied (committed, with `block_until_saved`). A step saved already (or
        resumed from) is not saved again (that would rewrite its files under its own
        manifest); its upload in flight is waited for, as a save would. `model_state_dict_only`: only the policy, for the synchronizer
        (`upload_state_dict`). Collective."""
        if model_state_dict_only:
            self.upload_state_dict(step)
        elif step == self.last_saved:
            self.wait_on_save_thread()  # as a save would: a failed upload of it is raised now
        else:
            self.save(step, self.extra_state() if self.extra_state is not None else None, block=block_until_saved)

    def upload_state_dict(self, trainer_step: int) -> dict | None:
        """Hand the policy at `trainer_step` to the synchronizer. Weights reach the inference
        pods through storage, so this exports the version and reports it
        (`WeightExporter.publish`; once per step). Collective; the manifest on rank 0."""
        if self.weights is None:
            raise CheckpointError("upload_state_dict: no weight exporter; the Trainer sets "
                                  "`checkpointer.weights` in prepare()")
        return self.weights.publish(trainer_step)

    def maybe_save(self, step: int, extra: dict | None = None, *, block: bool = False) -> bool:
        """Save when `step` is a multiple of `interval`; the loop calls this every step."""
        if step % self.interval:
            return False
        self.save(step, extra, block=block)
        return True

    def save(self, step: int, extra: dict | None = None, *, block: bool = True) -> None:
        """Write step `step`. With block=False, return once the state is copied in memory;
        the local write and the upload run in the background (at most one save in
        flight: this first waits for the previous)."""
        self.wait_on_save_thread()
        self.app.step, self.app.extra = step, dict(extra or {})
        self.staging.mkdir(parents=True, exist_ok=True)
        local = Path(tempfile.mkdtemp(prefix=f"step-{step:08d}-rank{self.rt.rank}-", dir=self.staging))
        start = time.perf_counter()
        writer = dcp.FileSystemWriter(str(local))
        try:
            if block:
                written = None
                dcp.save({"app": self.app}, storage_writer=writer, no_dist=not dist.is_initialized())
            else:
                # One rank alone writes without collectives: in this thread they would run
                # on the default group, beside the training loop's.
                written = dcp.async_save({"app": self.app}, storage_writer=writer, process_group=self.group,
                                         no_dist=self.group is None)
        except BaseException:
            shutil.rmtree(local, ignore_errors=True)
            raise
        self.last_saved = step
        self._stage_seconds = time.perf_counter() - start
        if self.rt.is_main:
            log.info("checkpoint step %d %s in %.2fs", step, "written locally" if block else "copied for an async save",
                     self._stage_seconds)
        if block:
            self._commit(step, local)
        else:
            self._thread = threading.Thread(target=self._commit_in_background, args=(step, local, written),
                                            name=f"ckpt-commit-{step}", daemon=True)
            self._thread.start()

    def wait_on_save_thread(self) -> None:
        """Block until the save in flight (if any) is committed; re-raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise CheckpointError(str(err)) from err

    close = wait_on_save_thread

    def _commit_in_background(self, step: int, local: Path, written) -> None:
        try:
            self._commit(step, local, written)
        except BaseException as e:  # surfaced by wait_on_save_thread()
            self._error = e

    def _commit(self, step: int, local: Path, written=None) -> None:
        """Upload this rank's files (after `written`, the async DCP write, completes),
        then rank 0 writes the manifest; every rank learns the outcome."""
        prefix = step_uri(self.uri, step)
        start = upload_start = time.perf_counter()
        files, err = {}, None
        try:
            if written is not None:
                written.result()
            upload_start = time.perf_counter()
            for path in sorted(local.iterdir()):
                got = upload_file(self.storage, path, join(prefix, path.name))
                files[path.name] = {"size": got.size, "sha256": got.sha256}
        except Exception as e:  # still join the gather, so no rank hangs
            err = f"rank {self.rt.rank}: {type(e).__name__}: {e}"
        finally:
            shutil.rmtree(local, ignore_errors=True)
        reports = _all_gather((files, err), self.group)  # every rank has uploaded
        status = None
        if self.rt.is_main:
            status = self._write_manifest(step, prefix, reports)
        if self.group is not None:
            box = [status]
            dist.broadcast_object_list(box, src=0, group=self.group)
            status = box[0]
        if status:
            raise CheckpointError(f"checkpoint step {step} not committed: {status}")
        self.last_committed = step
        self.last_commit_at = time.monotonic()
        # For status reporting: bytes of every rank's files, staging + upload time.
        self.last_commit_bytes = sum(m["size"] for f, _ in reports for m in f.values())
        self.last_commit_seconds = self._stage_seconds + time.perf_counter() - start
        self.last_upload_seconds = time.perf_counter() - upload_start  # this rank's files + the commit
        if self.rt.is_main:
            log.info("checkpoint step %d committed to %s in %.2fs", step, prefix, time.perf_counter() - start)
            if self.on_commit is not None:
                try:
                    self.on_commit(step, prefix)
                except Exception as e:  # reporting must not fail a committed save
                    log.warning("checkpoint on_commit hook failed: %s", e)

    def _write_manifest(self, step: int, prefix: str, reports: list) -> str | None:
        """Rank 0: write the manifest (the commit), then apply retention. Returns an
        error message, or None on success."""
        errors = [e for _, e in reports if e]
        if errors:
            return "; ".join(errors)
        merged: dict[str, dict] = {}
        for files, _ in reports:
            if dup := merged.keys() & files.keys():
                return f"two ranks wrote {sorted(dup)}"
            merged.update(files)
        manifest = {"step": step, "world_size": self.rt.world_size, "format": "torch.distributed.checkpoint",
                    "created": now_text(), "files": merged}
        if self.config_hash:
            manifest["config_hash"] = self.config_hash
        try:
            write_manifest(self.storage, prefix, manifest)
        except Exception as e:
            return f"writing manifest.json: {type(e).__name__}: {e}"
        try:
            apply_retention(self.storage, self.uri, self.keep, {s for s in self.keep_also() if s is not None})
        except Exception as e:  # a failed cleanup must not undo a good commit
            log.warning("checkpoint retention failed: %s", e)
        return None

    # ------------------------------------------------------------ load

    def resume(self) -> int | None:
        """Load the newest committed step that downloads intact into the roles; returns it
        (and sets `self.app.step`/`.extra`), or None when there is none (a fresh start)."""
        self.wait_on_save_thread()
        below = None
        while True:
            picked = self._from_main(lambda: self._pick_step(below))
            if picked is None:
                log.info("no complete checkpoint under %s: starting fresh", self.uri)
                return None
            step, manifest = picked
            try:
                self._load(step, manifest)
                # Committed already: a stop or a dry buffer right after the resume must not
                # upload the same step again over its own manifest.
                self.last_saved = self.last_committed = step
                return step
            except CorruptCheckpoint as e:
                if self.rt.is_main:
                    log.warning("%s; trying an older step", e)
                below = step

    def _pick_step(self, below: int | None) -> tuple[int, dict] | None:
        """Rank 0: the newest committed step under `below` whose manifest's files are all
        listed, with its manifest. Reads manifests only; the sizes and sha256 are checked
        by the download. Logs each newer step skipped."""
        steps = list_steps(self.storage, self.uri)
        for step in sorted((s for s in steps if below is None or s < below), reverse=True):
            prefix, names = steps[step]
            reason = None
            if MANIFEST not in names:
                reason = f"no {MANIFEST} (upload never completed)"
            else:
                try:
                    manifest = read_manifest(self.storage, prefix)
                except (FileNotFoundError, ValueError) as e:
                    reason = f"unreadable {MANIFEST}: {e}"
                else:
                    missing = sorted(set(manifest.get("files", {})) - names)
                    if not missing:
                        return step, manifest
                    reason = f"{missing[0]}: listed in {MANIFEST} but missing"
            log.warning("checkpoint step %d skipped (%s): %s", step, prefix, reason)
        return None

    def _from_main(self, decide) -> Any:
        """`decide()` on rank 0, broadcast; its error is raised on every rank (so none
        waits for an answer that never comes)."""
        box: list = [None]
        if self.rt.is_main:
            try:
                box = [(decide(), None)]
            except Exception as e:
                box = [(None, f"{type(e).__name__}: {e}")]
        if self.group is not None:
            dist.broadcast_object_list(box, src=0, group=self.group)
        value, error = box[0]
        if error:
            raise CheckpointError(f"rank 0: {error}")
        return value

    def load(self, step: int) -> AppState:
        """Load step `step` (see `_load`); CorruptCheckpoint names a missing or damaged file."""
        self.wait_on_save_thread()

        def read() -> dict | str:
            try:
                return read_manifest(self.storage, step_uri(self.uri, step))
            except (FileNotFoundError, ValueError) as e:
                return f"{MANIFEST}: {type(e).__name__}: {e}"

        manifest = self._from_main(read)
        if isinstance(manifest, str):
            raise CorruptCheckpoint(f"checkpoint step {step} not loaded: {manifest}")
        return self._load(step, manifest)

    def _load(self, step: int, manifest: dict) -> AppState:
        """Local rank 0 of each node (every rank without a node staging dir) downloads the
        step, verifying each file as it streams; all ranks learn every node's outcome, then
        DCP-load from the node's copy (resharding to this world size) and the downloader
        removes it."""
        prefix = step_uri(self.uri, step)
        if self.node_staging is not None:
            # The bucket's layout, under the node's volume: <staging>/ckpt/step-NNNNNNNN/.
            local, downloads = Path(step_uri(str(self.node_staging), step)), self.rt.local_rank == 0
        else:
            self.staging.mkdir(parents=True, exist_ok=True)
            local = Path(tempfile.mkdtemp(prefix=f"load-{step:08d}-rank{self.rt.rank}-", dir=self.staging))
            downloads = True
        start = time.perf_counter()
        report, got = None, None
        if downloads:
            try:
                got = download_verified(self.storage, prefix, local, manifest)
            except IntegrityError as e:
                report = ("corrupt", str(e))
            except Exception as e:  # every rank must hear of it, or the others would wait
                report = ("error", f"rank {self.rt.rank}: {type(e).__name__}: {e}")
        failed = sorted({r for r in _all_gather(report, self.group) if r})
        if failed:
            if downloads:
                shutil.rmtree(local, ignore_errors=True)
            kind = CorruptCheckpoint if all(k == "corrupt" for k, _ in failed) else CheckpointError
            raise kind(f"checkpoint step {step} not loaded: " + "; ".join(msg for _, msg in failed))
        fetched = time.perf_counter() - start
        try:
            self.app.saved_groups = saved_param_groups(local, self.app.roles)
            dcp.load({"app": self.app}, storage_reader=dcp.FileSystemReader(str(local)),
                     no_dist=not dist.is_initialized())
        finally:
            self.app.saved_groups = {}
            _all_gather(None, self.group)  # every rank of the node is done reading the copy
            if downloads:
                shutil.rmtree(local, ignore_errors=True)
        if self.rt.is_main:
            log.info("checkpoint step %d (saved on %s ranks) loaded on %d ranks in %.2fs", step,
                     manifest.get("world_size"), self.rt.world_size, time.perf_counter() - start)
        if got is not None and self.rt.local_rank == 0:
            log.info("checkpoint step %d: %d files (%.2f GB) downloaded and verified in %.2fs, %d reused",
                     step, got.files, got.bytes / 1e9, fetched, got.reused)
        return self.app
