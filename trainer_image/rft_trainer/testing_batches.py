"""Deterministic experience batches and a sampler, for tests and benchmarks."""

from __future__ import annotations

import torch

from .experience import Experiences


def synthetic_batch(batch_size: int, prompt_len: int, response_len: int, vocab: int,
                    group_size: int = 4, seed: int = 0) -> Experiences:
    """Random tokens with realistic masks: right-padded responses of varying length."""
    g = torch.Generator().manual_seed(seed)
    T = prompt_len + response_len
    tokens = torch.randint(4, vocab, (batch_size, T), generator=g)
    lengths = torch.randint(1, response_len + 1, (batch_size,), generator=g)
    pos = torch.arange(T)[None, :]
    attention = pos < (prompt_len + lengths)[:, None]
    action = attention & (pos >= prompt_len)
    tokens = torch.where(attention, tokens, torch.zeros_like(tokens))
    return Experiences(
        tokens=tokens, attention_mask=attention, action_mask=action,
        prompt_lengths=torch.full((batch_size,), prompt_len),
        rewards=torch.rand(batch_size, generator=g),
        group_ids=torch.arange(batch_size) // group_size,
    ).validate()


@torch.no_grad()
def sample(model, prompts: torch.Tensor, new_tokens: int, generator: torch.Generator,
           temperature: float = 1.0) -> torch.Tensor:
    """Ancestral sampling without a KV cache (tiny models only): returns (B, P+new)."""
    seq = prompts
    for _ in range(new_tokens):
        logits = model(input_ids=seq, use_cache=False).logits[:, -1].float() / temperature
        probs = torch.softmax(logits, dim=-1)
        nxt = torch.multinomial(probs, 1, generator=generator)
        seq = torch.cat([seq, nxt], dim=1)
    return seq
