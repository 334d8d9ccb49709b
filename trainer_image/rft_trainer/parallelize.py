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

Works with nccl on GPU and gloo on CPU; a single process is a world of size 1. Fetching an
s3:// model to the node is modelcache.py's (`fetch_model`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

from rft_contract.podenv import PodEnv
from rft_contract.spec import LoraSpec

from . import lora as lora_adapters
from .modelcache import ModelCache
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
    # This process's downloads of s3:// models (modelcache.py): asked again by every role's
    # build and every export, fetched once.
    models: ModelCache = field(default_factory=ModelCache, compare=False, repr=False)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def backend_for(cuda: bool, cpu_offload: bool) -> str:
    """NCCL on GPUs; with CPU offload the clipping and export collectives also touch CPU
    DTensors, which need gloo beside NCCL (as torchtitan does)."""
    if not cuda:
        return "gloo"
    return "cuda:nccl,cpu:gloo" if cpu_offload else "nccl"


def init_distributed(cpu_offload: bool = False, env: PodEnv | None = None) -> Runtime:
    """Join the torchrun group (or form a world of one outside torchrun). `env`: the pod's
    knobs for the model cache (`JobConfig.env`; None: read from the process environment)."""
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
    return Runtime(dist.get_rank(), dist.get_world_size(), local_rank, device, local_world_size,
                   models=ModelCache(env))


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
                param_dtype: str = "fp32", lora: LoraSpec | None = None, seed: int = 0) -> nn.Module:
    """Build, shard and load one model. `kind`: "causal_lm" (actor, reference) or
    "critic" (`models.ValueModel`: the backbone and a value head, values 0 at step 0).
    `param_dtype` is the master weights' dtype (`spec.model.dtype`). `lora`: LoRA
    adapters on a causal LM (rft_trainer.lora), the base frozen, new adapters drawn from
    `seed`. A model the trainer cannot train is refused first (`models.check_supported`)."""
    from transformers import AutoModelForCausalLM

    path = rt.models.fetch(path, rt)
    config = load_config(path)
    check_supported(config, critic=(kind == "critic"), warn=False)  # the engine's startup check warned
    # Tied embeddings stay tied: the shared Parameter belongs to the root module, which
    # fully_shard shards once; to_empty and set_model_state_dict keep the one tensor
    # (a checkpoint without lm_head.weight loads strictly).
    with torch.device("meta"):
        model = ValueModel(config) if kind == "critic" else AutoModelForCausalLM.from_config(config)
    # fp32 master weights by default; FSDP's MixedPrecisionPolicy computes in bf16 on GPU.
    model.to({"fp32": torch.float32, "bf16": torch.bfloat16}[param_dtype])
    if lora is not None:
        lora_adapters.inject(model, lora)
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
        start = rt.models.fetch(lora.adapter_path, rt) if lora is not None and lora.adapter_path else None
        load_full_state_dict(model, path, rt, critic=(kind == "critic"), seed=seed,
                             adapter=(lora, start) if start else None)
    return model


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


def load_full_state_dict(model: nn.Module, path: str, rt: Runtime, critic: bool = False, seed: int = 0,
                         adapter: tuple[LoraSpec, str] | None = None) -> None:
    """Rank 0 reads the HF weights; every rank receives only its shards. A tied model's
    checkpoint holds the shared tensor once (HF drops `lm_head.weight`): the alias is
    filled from it, so the strict load still names every other missing key. The critic's
    value head is in no LM checkpoint: every other key must be. A model with LoRA
    adapters gets new ones, drawn from `seed` on rank 0 (`lora.initial_state`), or those
    of `adapter` (the spec and the starting adapter's local directory)."""
    full, error = {}, None
    if rt.is_main:
        try:
            full = read_hf_state_dict(path, model.backbone_type if critic else None)
            if lora_adapters.has_adapters(model):
                start = lora_adapters.read_adapter(model, *adapter) if adapter else None
                full = lora_adapters.initial_state(model, full, seed, start)
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
