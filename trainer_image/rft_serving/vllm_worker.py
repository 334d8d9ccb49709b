"""Our methods inside vLLM's workers, reached through its dev-mode `/collective_rpc` route.

The engine starts with `--worker-extension-cls rft_serving.vllm_worker.RFTWorkerExtension`
(vLLM mixes the class into its worker; the methods' names must not clash with the
worker's, hence the `rft_` prefix). The module imports nothing of ours and nothing at
import time beyond the standard library: it runs in the engine's Python, next to vLLM.

Why: vLLM's in-place `reload_weights` loads every tensor the checkpoint names into the
layer that owns it and then re-runs that layer's post-load processing. A tied output
layer (`lm_head` sharing the input embedding's Parameter) receives no tensor of its own,
so its processing is not re-run; on the CPU build that processing packs the weight for
the GEMM kernel, and the packed copy keeps the OLD embedding: the engine then samples
from new input embeddings and the old output layer (vLLM logs `Following weights were not
loaded from checkpoint: {'lm_head.weight'}`). `rft_reload_weights` reloads, then re-runs
the post-load processing of every output layer tied to an embedding. The sync agent's
probe check (sync_agent.py) catches this and any other served-vs-trained mismatch.
"""

from __future__ import annotations

import logging

log = logging.getLogger("rft_serving.vllm_worker")


class RFTWorkerExtension:
    """Mixed into vLLM's worker class: `self` is the worker (it has `reload_weights` and
    `model_runner`)."""

    def rft_reload_weights(self, weights_path: str) -> dict:
        """Reload from `weights_path` in place, then refresh tied output layers.
        Returns {"retied": [names of the layers refreshed]}."""
        self.reload_weights(weights_path=weights_path)
        return {"retied": refresh_tied_heads(self.model_runner.get_model())}


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
