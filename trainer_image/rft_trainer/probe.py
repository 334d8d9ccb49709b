"""The trainer's side of the weight-sync probe (rft_contract.probe): score a short token
sequence with the weights exactly as exported, for the sync agents to compare with what
each engine serves after a reload.

"Exactly as exported": the export casts the master weights to its dtype (bf16 by
default), so the probe is scored with every parameter rounded to that dtype for the one
forward pass and restored bit for bit after (the shards are copied to host memory
meanwhile). The forward runs as training runs it (fp32 on CPU; FSDP's mixed precision on
GPU), without dropout. Collective: every rank runs the forward on the same tokens.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from rft_contract.probe import MAX_TOKENS, Probe

from .roles import evaluating, token_logprobs

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def probe_tokens(tokens: torch.Tensor, attention_mask: torch.Tensor) -> list[int]:
    """The first sequence of a batch (prompt and response, padding dropped), cut to
    MAX_TOKENS: the policy's own kind of text."""
    return tokens[0][attention_mask[0].bool()][:MAX_TOKENS].tolist()


def fallback_tokens(vocab_size: int, n: int = 32) -> list[int]:
    """A fixed spread of token ids, for an export before any batch (never in the loop)."""
    return [(7919 * i + 13) % vocab_size for i in range(n)]


@contextmanager
def rounded_to(model: nn.Module, dtype: torch.dtype) -> Iterator[None]:
    """Every floating parameter rounded to `dtype` inside the block, restored after."""
    saved = []
    with torch.no_grad():
        for p in model.parameters():
            local = p.data.to_local() if hasattr(p.data, "to_local") else p.data  # a DTensor's shard
            if not local.is_floating_point() or local.dtype == dtype:
                continue
            saved.append((local, local.to("cpu", copy=True)))
            local.copy_(local.to(dtype))
    try:
        yield
    finally:
        with torch.no_grad():
            for local, copy in saved:
                local.copy_(copy)


@torch.no_grad()
def build_probe(model: nn.Module, device: torch.device, token_ids: list[int], dtype: str, step: int) -> Probe:
    """The probe for the weights `export_hf(model, dtype=dtype)` writes."""
    ids = torch.tensor([token_ids], device=device)
    with rounded_to(model, DTYPES[dtype]), evaluating(model):
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
    logprobs, _ = token_logprobs(logits, ids)
    return Probe(list(token_ids), logprobs[0, 1:].float().tolist(), dtype, step)
