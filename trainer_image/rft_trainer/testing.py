"""Tiny models and tokenizers built locally (no downloads), for tests, benchmarks and the
demo. A 2-layer Qwen2 over a small word-level vocabulary of digits and arithmetic."""

from __future__ import annotations

import json
import os
from pathlib import Path

SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>"]
SYMBOLS = [str(d) for d in range(10)] + ["+", "-", "*", "=", " ", "?", "A", "B", "C", "D"]


def tiny_vocab() -> list[str]:
    return SPECIAL + SYMBOLS


def save_tiny_tokenizer(path: str | os.PathLike) -> None:
    """A character-level tokenizer saved as an HF `PreTrainedTokenizerFast`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(tiny_vocab())}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
        unk_token="<unk>",
    )
    fast.save_pretrained(str(path))


def save_tiny_model(path: str | os.PathLike, *, hidden: int = 64, layers: int = 2,
                    heads: int = 4, kv_heads: int = 2, intermediate: int = 128,
                    seed: int = 0, with_tokenizer: bool = True) -> Path:
    """A random-initialised Qwen2 causal LM in HF format (safetensors)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path = Path(path)
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tiny_vocab()), hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=256, tie_word_embeddings=False,
        pad_token_id=0, eos_token_id=1, bos_token_id=2,
    )
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(str(path), safe_serialization=True)
    if with_tokenizer:
        save_tiny_tokenizer(path)
    (path / "rft_tiny.json").write_text(json.dumps({"seed": seed, "params": model.num_parameters()}))
    return path
