"""What the trainer knows about architectures (rft_trainer/models.py): non-persistent
buffers from each family's own initialisation, the blocks FSDP wraps, the critic's form."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rft_trainer.models import (UnsupportedModelError, ValueModel, decoder_blocks,
                                init_non_persistent_buffers)
from rft_trainer.parallelize import build_model
from tests.fixtures.architectures import VOCAB, save_tiny, tiny_config


def non_persistent(model: nn.Module) -> dict[str, torch.Tensor]:
    return {f"{prefix}.{name}": getattr(module, name) for prefix, module in model.named_modules()
            for name in getattr(module, "_non_persistent_buffers_set", ())}


@pytest.mark.parametrize("model_type", ["gemma3_text", "llama", "phi3", "qwen3_moe", "gpt_neox"])
def test_non_persistent_buffers_are_the_ones_transformers_computes(tmp_path, world_of_one, model_type):
    """Built on the meta device and materialised with to_empty, the model must hold the
    buffers no checkpoint has (rotary inv_freq, Gemma's embed_scale) exactly as a model
    built on the CPU, and give the same logits."""
    from transformers import AutoModelForCausalLM

    path = save_tiny(model_type, tmp_path / "m")
    reference = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    built = build_model(str(path), world_of_one, fsdp_mode="fp32")
    want, got = non_persistent(reference), non_persistent(built)
    assert want and want.keys() == got.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    ids = torch.randint(3, VOCAB, (2, 7))
    assert torch.equal(built(input_ids=ids).logits, reference(input_ids=ids).logits)


class Table(nn.Module):
    """A module whose buffers no `_init_weights` knows."""

    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.ones(3), persistent=False)
        self.register_buffer("index", torch.arange(3), persistent=False)
        self.register_buffer("causal", torch.ones(3, dtype=torch.bool), persistent=False)


@pytest.mark.parametrize("buffer", ["scale", "index", "causal"])
def test_a_buffer_the_family_does_not_initialise_is_refused_by_name(buffer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    model.model.table = Table()
    for name in {"scale", "index", "causal"} - {buffer}:
        model.model.table._non_persistent_buffers_set.discard(name)  # persistent: loaded, not checked
    with pytest.raises(UnsupportedModelError, match=rf"'llama': Table buffer '{buffer}' \(model.table.{buffer}\)"):
        init_non_persistent_buffers(model)


def test_decoder_blocks_are_the_no_split_modules_outermost_first():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    assert set(model._no_split_modules) == {"LlamaDecoderLayer"}
    assert decoder_blocks(model) == list(model.model.layers)
    critic = ValueModel(tiny_config("llama"))
    assert decoder_blocks(critic) == list(critic.model.layers)
    model._no_split_modules = None  # no declaration: the usual attribute paths
    assert decoder_blocks(model) == list(model.model.layers)


@pytest.mark.parametrize("model_type", ["qwen2", "llama", "gemma"])
def test_the_critic_saves_what_the_token_classification_critic_saved(model_type):
    """Checkpoints of the earlier critic (`AutoModelForTokenClassification`, one label)
    resume: same state-dict keys and shapes, `model.*` and `score.weight`/`score.bias`."""
    from transformers import AutoModelForTokenClassification

    config = tiny_config(model_type)
    critic = ValueModel(config)
    config.num_labels = 1
    before = AutoModelForTokenClassification.from_config(config)
    assert {k: v.shape for k, v in critic.state_dict().items()} == {k: v.shape for k, v in before.state_dict().items()}
    critic.reset_value_head()
    values = critic(torch.randint(3, VOCAB, (2, 5)), torch.ones(2, 5, dtype=torch.long))
    assert values.shape == (2, 5) and not values.any()  # zero head: every value 0 at step 0
