"""Our methods inside vLLM's workers, reached through its dev-mode `/collective_rpc` route.

The engine starts with `--worker-extension-cls rft_serving.vllm_worker.RFTWorkerExtension`
(vLLM mixes the class into its worker; the methods' names must not clash with the
worker's, hence the `rft_` prefix). The module imports nothing of ours, and at import
time only the standard library and vLLM's LoRA worker manager (`keep_loaded_adapters`):
it runs in the engine's Python, next to vLLM.

Why: vLLM's in-place `reload_weights` loads every tensor the checkpoint names into the
layer that owns it and then re-runs that layer's post-load processing. A tied output
layer (`lm_head` sharing the input embedding's Parameter) receives no tensor of its own,
so its processing is not re-run; on the CPU build that processing packs the weight for
the GEMM kernel, and the packed copy keeps the OLD embedding: the engine then samples
from new input embeddings and the old output layer (vLLM logs `Following weights were not
loaded from checkpoint: {'lm_head.weight'}`). `rft_reload_weights` reloads, then re-runs
the post-load processing of every output layer tied to an embedding. The sync agent's
probe check (sync_agent.py) catches this and any other served-vs-trained mismatch.

`rft_fingerprint` reports what each worker holds, for the exact check against the export's
`fingerprint.json` (rft_contract.fingerprint): [sum, sum of squares] in float64 of every
unquantized parameter. On the CPU build a linear layer or LM head computes with a packed
copy of its weight (`cpu_linear`; linear layers' `weight` is emptied after packing, and a
tied head's packed copy is what goes stale), so those weights are read back through the
kernel itself, `quant_method.apply` on rows of the identity matrix: each output element is
one weight times 1.0, exact in any precision. Elsewhere (GPUs) the parameter is what the
kernel reads. Quantized layers are left out (their values are not the export's; the agent
leaves those tensors to the probe). Fused layers (qkv_proj) are compared against the sum of
their sources by the agent (`packed`).

`rft_lora_fingerprint` reports the same of the LoRA adapter in each slot of the adapted
layers (what the LoRA kernels read), for the exact check of a run-time adapter
(engines.VLLMEngine, a LoRA job's versions).

Importing the module (vLLM does, in each worker, when it resolves the extension) also
mends vLLM 0.32.0's in-place adapter loads (`keep_loaded_adapters`): the request an
adapter was loaded in place with keeps `load_inplace`, and the server stores it as the one
every later request for that name carries, so the worker read the adapter's file again and
swapped it into the slots before every forward step (vllm#33791; upstream fixes proposed
in vllm#36373 and vllm#41482, unmerged in 0.32.0): a greedy completion through a LoRA
job's policy took 1.33x as long as through an adapter loaded once (bench/lora.py --vllm).
"""

from __future__ import annotations

import copy
import logging
import os

log = logging.getLogger("rft_serving.vllm_worker")
RELOAD_ENV = "RFTJOB_VLLM_RELOAD"  # "plain": skip the tied heads' refresh (a diagnostic)


class RFTWorkerExtension:
    """Mixed into vLLM's worker class: `self` is the worker (it has `reload_weights` and
    `model_runner`)."""

    def rft_reload_weights(self, weights_path: str) -> dict:
        """Reload from `weights_path` in place, then refresh tied output layers.
        Returns {"retied": [names of the layers refreshed]}. With RFTJOB_VLLM_RELOAD=plain in
        the engine's environment (a diagnostic: what vLLM's own reload leaves, checks on)
        the refresh is skipped."""
        self.reload_weights(weights_path=weights_path)
        if os.environ.get(RELOAD_ENV) == "plain":
            log.warning("%s=plain: tied output layers not refreshed (vLLM's own reload)", RELOAD_ENV)
            return {"retied": []}
        return {"retied": refresh_tied_heads(self.model_runner.get_model())}


    def rft_fingerprint(self) -> dict:
        """`fingerprint` of this worker's model."""
        return fingerprint(self.model_runner.get_model())

    def rft_lora_fingerprint(self, path: str | None = None) -> dict:
        """`lora_fingerprint` of this worker's adapters, and with `path` (a PEFT adapter's
        directory) `adapter_file_stats` of its file in the slots' dtype ("file"); "loads":
        how many adapter files this worker has read (`keep_loaded_adapters`)."""
        out = lora_fingerprint(self.model_runner)
        manager = getattr(self.model_runner, "lora_manager", None)
        out["loads"] = getattr(manager, LOADS, 0) if manager is not None else None
        if path is not None:
            out["file"] = adapter_file_stats(path, out.get("dtype") or "float32")
        return out

    def rft_nccl_version(self) -> list | None:
        """The NCCL this worker's torch runs (NCCL refuses a communicator of mixed versions:
        the sync agent compares it with trainer rank 0's before joining); None without NCCL."""
        import torch

        try:
            return list(torch.cuda.nccl.version())
        except Exception:  # noqa: BLE001 - a CPU build, or no NCCL
            return None


LOADS = "rft_adapter_loads"  # on the worker's LoRA manager: adapter files read


def keep_loaded_adapters() -> bool:
    """Make the adapter each request uses, before each forward step, a use of the one the
    worker holds under that id, never a new read of a file (see the module's docstring):
    vLLM 0.32.0's `LRUCacheWorkerLoRAManager._apply_adapters` runs `add_adapter` on every
    request's adapter before every step and, while the request says `load_inplace`, loads
    its file again; a request that waited through a pause would even load the version
    before (its request names that version's path) over the one the agent just loaded and
    checked. A load (`/v1/load_lora_adapter`, vLLM's `add_lora`: the sync agent's load and
    roll back) still reads its file whole before it replaces the adapter in place. Also
    counts the files read (`LOADS`, in `rft_lora_fingerprint`'s reply). False where vLLM
    is not importable (not in an engine)."""
    try:
        from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager
    except ImportError:
        return False
    original_apply, original_load = LRUCacheWorkerLoRAManager._apply_adapters, LRUCacheWorkerLoRAManager._load_adapter
    if getattr(original_apply, "rft_keeps_loaded", False):
        return True

    def _apply_adapters(self, lora_requests):
        held, uses = self.list_adapters(), set()
        for request in lora_requests:
            if request and request.load_inplace and request.lora_int_id in held:
                request = copy.copy(request)
                request.load_inplace = False  # a use: vLLM only touches and activates it
            uses.add(request)
        return original_apply(self, uses)

    def _load_adapter(self, lora_request):
        lora = original_load(self, lora_request)
        setattr(self, LOADS, getattr(self, LOADS, 0) + 1)
        return lora

    _apply_adapters.rft_keeps_loaded = True
    LRUCacheWorkerLoRAManager._apply_adapters = _apply_adapters
    LRUCacheWorkerLoRAManager._load_adapter = _load_adapter
    return True


keep_loaded_adapters()


IDENTITY_ROWS = 256  # identity rows per pass through a kernel: memory is rows x out_features


UNQUANTIZED = ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod")


def fingerprint(model) -> dict:
    """{"stats": {name: [sum, sum of squares]}, "packed": the model's packed_modules_mapping}
    of this worker's parameters."""
    import torch

    stats = {}
    with torch.no_grad():
        for module_name, module in model.named_modules():
            method = getattr(module, "quant_method", None)
            if method is not None and type(method).__name__ not in UNQUANTIZED:
                continue  # quantized: not the exported values
            for param_name, param in module.named_parameters(recurse=False):
                name = f"{module_name}.{param_name}" if module_name else param_name
                if not param.is_floating_point():
                    continue
                if param_name == "weight" and callable(getattr(module, "cpu_linear", None)) \
                        and _kernel_shape(module) is not None:
                    stats[name] = _through_kernel(module, param.dtype)
                elif param.numel():
                    stats[name] = _stats(param)
    packed = getattr(model, "packed_modules_mapping", None) or {}
    return {"stats": stats, "packed": {k: list(v) for k, v in dict(packed).items()}}


def lora_fingerprint(model_runner) -> dict:
    """What this worker's LoRA kernels read for each adapter in a slot (vLLM 0.32.0:
    `lora_manager._adapter_manager`, an LRU cache of LoRAModels each copied into a slot of
    every adapted layer's `lora_a_stacked` / `lora_b_stacked` when activated; a load
    activates it): {"adapters": {adapter id: {module: {"a": [[sum, sum of squares] per
    slice], "b": [...]}}}, "packed": the model's packed_modules_mapping, "dtype": the slots'}.
    A fused layer (qkv_proj) has one slice per source module; a slot is padded to the
    largest rank with zeros, and its B is the adapter's times alpha / rank (vLLM folds the
    scale in when it loads). {"adapters": {}} without LoRA."""
    import torch

    manager = getattr(getattr(model_runner, "lora_manager", None), "_adapter_manager", None)
    if manager is None:
        return {"adapters": {}}
    adapters: dict[str, dict] = {}
    dtype = None
    with torch.no_grad():
        for slot, adapter_id in enumerate(manager.lora_index_to_id):
            if adapter_id is None:
                continue
            modules = {}
            for name, module in manager.modules.items():
                if not hasattr(module, "lora_a_stacked"):
                    continue
                a, b = module.lora_a_stacked, module.lora_b_stacked
                a = list(a) if isinstance(a, (tuple, list)) else [a]
                b = list(b) if isinstance(b, (tuple, list)) else [b]
                modules[name] = {"a": [_stats(x[slot]) for x in a], "b": [_stats(x[slot]) for x in b]}
                dtype = dtype or str(a[0].dtype).removeprefix("torch.")
            adapters[str(adapter_id)] = modules
    packed = getattr(model_runner.get_model(), "packed_modules_mapping", None) or {}
    return {"adapters": adapters, "packed": {k: list(v) for k, v in dict(packed).items()}, "dtype": dtype}


def adapter_file_stats(path: str, dtype: str) -> dict:
    """{tensor name without PEFT's `base_model.model.` prefix: [sum, sum of squares, n]} of
    the adapter file at `path`, each tensor as vLLM 0.32.0 holds it: converted to `dtype`,
    and B multiplied by alpha / rank in that dtype (`LoRALayerWeights.optimize`). Read with
    safetensors here, apart from vLLM's loader, so a load that left the slots stale or
    partial differs."""
    import json

    import torch
    from safetensors.torch import load_file

    with open(os.path.join(path, "adapter_config.json")) as f:
        config = json.load(f)
    scale = float(config["lora_alpha"]) / float(config["r"])
    out = {}
    for name, tensor in load_file(os.path.join(path, "adapter_model.safetensors")).items():
        tensor = tensor.to(getattr(torch, dtype))
        if ".lora_B." in name and scale != 1:
            tensor *= scale
        out[name.removeprefix("base_model.model.")] = [*_stats(tensor), float(tensor.numel())]
    return out


def _kernel_shape(module) -> tuple[int, int] | None:
    """(in, out) features of this worker's part of a linear layer or LM head."""
    if hasattr(module, "input_size_per_partition") and hasattr(module, "output_size_per_partition"):
        return module.input_size_per_partition, module.output_size_per_partition
    if type(module).__name__ == "ParallelLMHead":
        return module.embedding_dim, module.num_embeddings_per_partition
    return None


def _through_kernel(module, dtype) -> list[float]:
    """[sum, sum of squares] of the weight the kernel computes with, read through it."""
    import torch

    k, _ = _kernel_shape(module)
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    total = squares = 0.0
    for start in range(0, k, IDENTITY_ROWS):
        n = min(IDENTITY_ROWS, k - start)
        rows = torch.zeros(n, k, dtype=dtype, device=device)
        rows[torch.arange(n), start + torch.arange(n)] = 1
        out = module.quant_method.apply(module, rows, None).double()  # rows of W^T, bias left out
        total += out.sum().item()
        squares += out.norm().item() ** 2
    return [total, squares]


def _stats(tensor) -> list[float]:
    flat = tensor.detach().reshape(-1)
    total = squares = 0.0
    for start in range(0, flat.numel(), 1 << 20):  # as rft_contract.fingerprint.tensor_stats
        part = flat[start:start + (1 << 20)].double()
        total += part.sum().item()
        squares += part.norm().item() ** 2
    return [total, squares]


def refresh_tied_heads(model) -> list[str]:
    """Re-run the post-load processing of each module whose `weight` is the same tensor as
    an embedding's (a tied LM head); the embedding's own processing already ran."""
    import torch

    embeddings = {}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and hasattr(module, "num_embeddings") and not _is_head(module):
            embeddings.setdefault(weight.data_ptr(), name)
    refreshed = []
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not _is_head(module) or not isinstance(weight, torch.Tensor):
            continue
        if weight.data_ptr() not in embeddings:
            continue  # untied: the reload loaded and processed it
        method = getattr(module, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(module)
            refreshed.append(name)
    if refreshed:
        log.info("refreshed tied output layers after the reload: %s", refreshed)
    return refreshed


def _is_head(module) -> bool:
    return type(module).__name__ == "ParallelLMHead"
