"""The one place that builds models and applies parallelism, in a fixed order:

0. refuse a model the trainer cannot train (`models.check_supported`, a ValueError);
1. build the HF model on the meta device (no memory, no init cost);
2. optional activation checkpointing;
3. `fully_shard` every decoder block (the classes of the model's `_no_split_modules`),
   then the root, with a MixedPrecisionPolicy
   (bf16 compute / fp32 gradient reduction on GPU; plain fp32 on CPU). A world of one
   rank without mixed precision or offload is left unsharded: there FSDP2 would only
   copy every block's parameters in and out on each micro-batch (the tiny model's update
   ran at 0.67x a plain loop with it, 1.22x without); `get_state_dict`, DCP and the
   exporter treat plain tensors and DTensors alike, so checkpoints move between the two;
4. materialise the shards (`to_empty`), fill the non-persistent buffers with the model's
   own `initialize_weights` (`models.init_non_persistent_buffers`), and load the weights
   from an HF directory: rank 0 loads them with transformers' `from_pretrained` (each
   family's key conversions) and the shards are scattered from it, so no rank but the
   first ever holds a full copy.

Works with nccl on GPU and gloo on CPU; a single process is a world of size 1.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

from .models import (ValueModel, check_supported, decoder_blocks, init_non_persistent_buffers,
                     load_config)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Runtime:
    """Where this process runs: its rank, the world, and the device it computes on.
    `local_rank` / `local_world_size`: its place among the processes of its node (one pod);
    local rank 0 downloads what the node shares (model, checkpoint)."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    local_world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def backend_for(cuda: bool, cpu_offload: bool) -> str:
    """NCCL on GPUs; with CPU offload the clipping and export collectives also touch CPU
    DTensors, which need gloo beside NCCL (as torchtitan does)."""
    if not cuda:
        return "gloo"
    return "cuda:nccl,cpu:gloo" if cpu_offload else "nccl"


def init_distributed(cpu_offload: bool = False) -> Runtime:
    """Join the torchrun group (or form a world of one outside torchrun)."""
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("LOCAL_RANK", "0")
        dist.init_process_group(backend_for(torch.cuda.is_available(), cpu_offload))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return Runtime(dist.get_rank(), dist.get_world_size(), local_rank, device, local_world_size)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mixed_precision(device: torch.device, mode: str) -> MixedPrecisionPolicy | None:
    """bf16 compute with fp32 gradient reduction on GPU; CPU stays fp32 (bf16 matmuls on
    CPU are slow and lose the bit-exactness we test against)."""
    if device.type != "cuda" or mode != "bf16":
        return None
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def apply_fsdp(model: nn.Module, device: torch.device, mode: str = "bf16",
               reshard_after_forward: bool = True, cpu_offload: bool = False) -> nn.Module:
    """`fully_shard` the blocks and the root; the model as it is when sharding would
    change nothing but add copies (one rank, no mixed precision, no offload)."""
    kwargs = {"reshard_after_forward": reshard_after_forward}
    mp = mixed_precision(device, mode)
    if mp is not None:
        kwargs["mp_policy"] = mp
    if cpu_offload and device.type == "cuda":
        kwargs["offload_policy"] = CPUOffloadPolicy()
    elif cpu_offload:
        log.info("fsdp.cpu_offload ignored: parameters already live on the CPU")
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world == 1 and mp is None and "offload_policy" not in kwargs:
        log.info("one rank without mixed precision or offload: the model is not sharded")
        return model
    for block in decoder_blocks(model):
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def build_model(path: str, rt: Runtime, *, kind: str = "causal_lm", fsdp_mode: str = "bf16",
                reshard_after_forward: bool = True, cpu_offload: bool = False,
                activation_checkpointing: bool = False, load_weights: bool = True,
                param_dtype: str = "fp32") -> nn.Module:
    """Build, shard and load one model. `kind`: "causal_lm" (actor, reference) or
    "critic" (`models.ValueModel`: the backbone and a value head, values 0 at step 0).
    `param_dtype` is the master weights' dtype (`spec.model.dtype`). A model the trainer
    cannot train is refused first (`models.check_supported`)."""
    from transformers import AutoModelForCausalLM

    path = fetch_model(path, rt)
    config = load_config(path)
    check_supported(config, critic=(kind == "critic"))
    # Tied embeddings stay tied: the shared Parameter belongs to the root module, which
    # fully_shard shards once; to_empty and set_model_state_dict keep the one tensor
    # (a checkpoint without lm_head.weight loads strictly).
    with torch.device("meta"):
        model = ValueModel(config) if kind == "critic" else AutoModelForCausalLM.from_config(config)
    # fp32 master weights by default; FSDP's MixedPrecisionPolicy computes in bf16 on GPU.
    model.to({"fp32": torch.float32, "bf16": torch.bfloat16}[param_dtype])
    if activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    apply_fsdp(model, rt.device, fsdp_mode, reshard_after_forward, cpu_offload)
    model.to_empty(device="cpu" if cpu_offload and rt.device.type == "cuda" else rt.device)
    if not isinstance(model, FSDPModule) and kind != "critic":
        # to_empty gave each module its own new Parameter (meta -> real device), which
        # unties shared ones; fully_shard had made the root own them.
        model.tie_weights()
    init_non_persistent_buffers(model)  # rotary inv_freq, ...: in no checkpoint
    if kind == "critic":
        # The value head is not in an LM checkpoint: start it at zero (values 0 at step 0),
        # instead of leaving to_empty's uninitialised memory.
        model.reset_value_head()
    if load_weights:
        load_full_state_dict(model, path, rt, critic=(kind == "critic"))
    return model


# s3:// model prefix -> its local directory: build_model (per role) and every export ask
# again; all ranks ask at the same points, so they all skip the collective alike.
_fetched_models: dict[str, str] = {}
_download_group = None
LOCK = ".lock"
COMPLETE = ".complete"  # the cache's record: {name: {size, etag, sha256}} of the verified files


def fetch_model(path: str, rt: Runtime) -> str:
    """A local directory for `path`: itself, or an s3:// prefix downloaded once per node
    into $RFT_MODEL_CACHE. Local rank 0 downloads, reusing files whose size and sha256
    match (a hostPath or PVC cache survives attempts); every rank then waits for all
    nodes on a gloo group whose timeout is $RFT_MODEL_DOWNLOAD_TIMEOUT (default 3600 s), and
    a failed download fails every rank at once, naming the node's error."""
    if not path.startswith("s3://"):
        return path
    if path in _fetched_models:
        return _fetched_models[path]
    import hashlib

    cache = os.environ.get("RFT_MODEL_CACHE", os.path.join(os.environ.get("TMPDIR", "/tmp"), "rft-models"))
    local = os.path.join(cache, hashlib.sha256(path.encode()).hexdigest()[:16])
    group = _model_download_group(rt)  # before any rank starts a download that others wait for
    error = None
    if rt.local_rank == 0:
        try:
            sync_model_dir(path, local)
        except Exception as e:  # reported to every rank below, so none waits for the timeout
            error = e
    reports: list = [None] * rt.world_size
    if group is not None:
        dist.all_gather_object(reports, None if error is None else f"{type(error).__name__}: {error}", group=group)
    if error is not None:
        raise error
    if failed := [(r, msg) for r, msg in enumerate(reports) if msg]:
        raise RuntimeError(f"downloading the model {path} failed on the node of rank {failed[0][0]}: {failed[0][1]}")
    _fetched_models[path] = local
    return local


def _model_download_group(rt: Runtime):
    """A gloo group for the download wait, with its own timeout (a default-timeout
    barrier would give up on a large model after 30 min, or wait that long for a
    failed one)."""
    global _download_group
    if not dist.is_initialized() or rt.world_size == 1:
        return None
    if _download_group is None:
        from datetime import timedelta

        seconds = float(os.environ.get("RFT_MODEL_DOWNLOAD_TIMEOUT", "3600"))
        _download_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=seconds))
    return _download_group


def sync_model_dir(path: str, local: str) -> None:
    """`_sync_model_dir` under an exclusive lock on the cache directory: two pods of a job
    on one node may share a hostPath or PVC cache, and a download killed mid-file leaves a
    partial `.tmp-` file that only a holder of the lock may remove."""
    import fcntl

    os.makedirs(local, exist_ok=True)
    with open(os.path.join(local, LOCK), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        _sync_model_dir(path, local)


def _sync_model_dir(path: str, local: str) -> None:
    """Make `local` a verified copy of every object under the s3:// prefix `path`.

    Each file is streamed to disk and hashed in one pass (`download_to`). A file already
    there is kept when its size and sha256 match the expected ones: the prefix's
    manifest.json entry (a weights export), else the record in `.complete` of the same
    object (same size and ETag) downloaded before. Files no longer under the prefix are
    removed (a stale *.safetensors would be loaded)."""
    import json
    import time

    from rft_contract.manifest import MANIFEST
    from rft_contract.s3 import S3Storage
    from rft_contract.storage import LocalStorage, download_to

    storage, base, root = S3Storage(), path.rstrip("/") + "/", os.path.abspath(local)
    objects = {uri[len(base):]: meta for uri, meta in storage.list_objects(base).items() if not uri.endswith("/")}
    if "config.json" not in objects:
        raise FileNotFoundError(f"{path}: no config.json under this prefix (is it an HF model directory?)")
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
    import json

    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, ValueError):  # absent, or an older empty marker: nothing to trust
        return {}
    return record if isinstance(record, dict) else {}


def tied_parameters(model: nn.Module) -> dict[str, str]:
    """alias -> the name it shares its Parameter with: {"lm_head.weight":
    "model.embed_tokens.weight"} when the embeddings are tied."""
    first: dict[int, str] = {}
    aliases = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases


def read_hf_state_dict(path: str, backbone: type | None = None) -> dict[str, torch.Tensor]:
    """The weights of a local HF directory as the model built here names them: loaded by
    transformers itself (`from_pretrained` of the causal LM), which applies each family's
    key renames and conversions (transformers 5 fuses MoE experts that checkpoints store
    one by one). For the critic, the causal LM's module of class `backbone` (what
    `AutoModel` builds) under `model.`: loading `AutoModel` from an LM checkpoint instead
    can miss weights (DeepSeek-V4's final norm in transformers 5.24). A weight the
    checkpoint lacks is an error, as a strict load would say, never a random
    initialisation."""
    from transformers import AutoModelForCausalLM

    src, info = AutoModelForCausalLM.from_pretrained(path, dtype="auto", output_loading_info=True)
    missing = sorted(info.get("missing_keys") or ()) + sorted(info.get("mismatched_keys") or ())
    if missing:
        raise ValueError(f"{path}: the checkpoint lacks or mismatches weights of {type(src).__name__}: "
                         f"{', '.join(map(str, missing[:8]))}{' ...' if len(missing) > 8 else ''}")
    if backbone is None:
        return src.state_dict()
    found = [m for m in src.modules() if type(m) is backbone]
    if len(found) != 1:
        raise ValueError(f"{path}: {type(src).__name__} holds {len(found)} {backbone.__name__} modules, "
                         "not the one backbone the critic is built on")
    return {f"model.{k}": v for k, v in found[0].state_dict().items()}


def load_full_state_dict(model: nn.Module, path: str, rt: Runtime, critic: bool = False) -> None:
    """Rank 0 reads the HF weights; every rank receives only its shards. A tied model's
    checkpoint holds the shared tensor once (HF drops `lm_head.weight`): the alias is
    filled from it, so the strict load still names every other missing key. The critic's
    value head is in no LM checkpoint: every other key must be."""
    full, error = {}, None
    if rt.is_main:
        try:
            full = read_hf_state_dict(path, model.backbone_type if critic else None)
            for alias, name in tied_parameters(model).items():
                if alias not in full and name in full:
                    full[alias] = full[name]
            if critic:
                own = set(model.state_dict().keys())
                if missing := sorted(k for k in own - set(full) if not k.startswith("score.")):
                    raise ValueError(f"{path}: no weights for the critic's backbone keys {missing[:8]}")
                full = {k: v for k, v in full.items() if k in own}
        except Exception as e:  # said to every rank: none waits in the broadcast below
            error = (isinstance(e, ValueError), f"{type(e).__name__}: {e}")
    if rt.world_size > 1:
        said = [error]
        dist.broadcast_object_list(said, src=0)
        error = said[0]
    if error:  # a ValueError (bad checkpoint) stays one: fatal; anything else may be retried
        raise (ValueError if error[0] else RuntimeError)(f"loading the model weights on rank 0: {error[1]}")
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=not critic)
    set_model_state_dict(model, full, options=options)
