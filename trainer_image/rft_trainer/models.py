"""What the trainer knows about model architectures, in one place:

- `check_supported`: the startup check. A model_type is trained only if it is a decoder-only
  causal LM of transformers; known ones that cannot be (encoder-only, encoder-decoder,
  multimodal, ...) are refused with the reason (`REFUSED`). `TESTED` lists the types that
  tests/trainer/test_architectures.py trains, and that test fails on any model_type of
  transformers' causal-LM mapping that is in neither table.
- `ValueModel`: the critic, a causal LM's backbone (`AutoModel`) with a linear value head.
- `init_non_persistent_buffers`: the buffers no checkpoint holds (rotary `inv_freq`,
  Gemma's `embed_scale`, ...), from the model's own `initialize_weights`.
- `decoder_blocks`: the modules `fully_shard` wraps one by one.
- `no_weight_decay`: the parameters AdamW leaves undecayed by default.

The critic's saved form (in checkpoints; exports hold the actor only): `model.*` is the backbone
exactly as `AutoModel` names its parameters, `score.weight` (1, hidden) and `score.bias`
(1,) the value head. For the families whose `*ForTokenClassification` is `model` + `score`
(Llama, Qwen2, Mistral, Gemma, ... in transformers 5) these are the keys of the critic the
trainer built before (`AutoModelForTokenClassification` with one label), so its checkpoints
resume.
"""

from __future__ import annotations

import json
import logging
import os
import re

import torch
from torch import nn

log = logging.getLogger(__name__)


class UnsupportedModelError(ValueError):
    """The model cannot be trained here; the message names its model_type and why."""


# ---------------------------------------------------------------- the startup check

ENCODER_ONLY = "encoder-only (bidirectional attention, a masked LM like BERT), not a causal LM"
ENCODER_DECODER = "encoder-decoder (seq2seq); the trainer takes decoder-only causal LMs"
NO_CRITIC = "no backbone class (AutoModel) for the PPO critic; GRPO works"
DRAFTER = "a speculative-decoding drafter (reads the target model's hidden states), not a standalone LM"


def multimodal(text_type: str | None = None) -> str:
    """The reason for a model with a vision or audio tower."""
    if text_type:
        return f"multimodal (vision/audio tower): train its text model, model_type {text_type}"
    return "multimodal (vision/audio tower); the trainer takes text-only causal LMs"


def untested(why: str) -> str:
    return f"not tested: {why}"


# model_type -> why it is refused, for every model_type of transformers' causal-LM mapping
# that tests/trainer/test_architectures.py does not train (that test says so when a newer
# transformers brings one that is in neither table).
REFUSED: dict[str, str] = {
    **dict.fromkeys(
        ("bert", "bert-generation", "big_bird", "camembert", "data2vec-text", "electra", "ernie", "megatron-bert",
         "rembert", "roberta", "roberta-prelayernorm", "roc_bert", "roformer", "xlm", "xlm-roberta",
         "xlm-roberta-xl", "xmod"), ENCODER_ONLY),
    "xlnet": "a permutation LM (XLNet): without a permutation mask every token attends both ways",
    "cpmant": "a prefix LM (CPM-Ant): its forward marks every input token as context, which attends both ways",
    **dict.fromkeys(
        ("bart", "bigbird_pegasus", "blenderbot", "blenderbot-small", "marian", "mbart", "mvp", "pegasus",
         "plbart", "prophetnet", "trocr", "whisper"), ENCODER_DECODER),
    "gemma3": multimodal("gemma3_text"), "gemma3n": multimodal("gemma3n_text"), "gemma4": multimodal("gemma4_text"),
    "gemma4_unified": multimodal("gemma4_unified_text"), "llama4": multimodal("llama4_text"),
    "qwen3_5": multimodal("qwen3_5_text"), "qwen3_5_moe": multimodal("qwen3_5_moe_text"),
    "qwen4_exp": multimodal("qwen4_exp_text"), "dots3_note": multimodal("dots3_note_text"),
    "fuyu": multimodal("persimmon"),
    **dict.fromkeys(("emu3", "git", "got_ocr2", "mllama", "phi4_multimodal", "moss_transcribe_diarize", "moshi",
                     "musicgen", "musicgen_melody"), multimodal()),
    "gemma4_assistant": DRAFTER, "gemma4_unified_assistant": DRAFTER,
    "reformer": "LSH/local attention in chunks: training needs every sequence padded to a multiple of the chunk length",
    "blt": untested("a byte-level patching model (entropy patcher, local encoder and decoder around the "
                    "transformer); a small configuration still allocates gigabytes"),
    "dots3_note_text": untested("no small configuration of it validates (per-layer attributes)"),
    "zamba": untested("no small configuration of it builds (its shared-block ties assume the default layout)"),
}

# Trained by tests/trainer/test_architectures.py (GRPO and PPO; its docstring says how deep).
TESTED: frozenset[str] = frozenset((
    "afmoe", "apertus", "apertus1p5_text", "arcee", "aria_text", "axk1", "axk2", "bailing_hybrid",
    "bamba", "beam", "biogpt", "bitnet", "bloom", "codegen", "cohere", "cohere2", "cohere2_moe",
    "cohere_compass_text", "ctrl", "cwm", "dbrx", "deepseek_v2", "deepseek_v3", "deepseek_v32",
    "deepseek_v4", "diffllama", "doge", "dory", "dots1", "ernie4_5", "ernie4_5_moe", "exaone",
    "exaone4", "exaone_moe", "falcon", "falcon_h1", "falcon_mamba", "flex_olmo", "flint", "gemma",
    "gemma2", "gemma3_text", "gemma3n_text", "gemma4_text", "gemma4_unified_text", "glm", "glm4",
    "glm4_moe", "glm4_moe_lite", "glm_moe_dsa", "gpt-sw3", "gpt2", "gpt_bigcode", "gpt_neo",
    "gpt_neox", "gpt_neox_japanese", "gpt_oss", "gptj", "granite", "granite_swa", "granitemoe",
    "granitemoe_swa", "granitemoehybrid", "granitemoeshared", "helium", "hrm_text",
    "hunyuan_v1_dense", "hunyuan_v1_moe", "hy_v3", "hy_v4", "hyperclovax", "inkling2_loop_text",
    "inkling2_text", "inkling_text", "internlm3", "iquestcoder", "jais2", "jamba", "jetmoe",
    "kimi_linear", "kolibri1", "laguna", "lara_mini", "lfm2", "lfm2_moe", "lfm3", "llama",
    "llama4_text", "longcat_flash", "mamba", "mamba2", "mellum", "mimo_v2_flash", "minicpm3",
    "minimax", "minimax_m2", "minimax_m3_vl_text", "ministral", "ministral3", "mistral", "mixtral",
    "modernbert-decoder", "mpt", "nanochat", "nemotron", "nemotron_h", "olmo", "olmo2", "olmo3",
    "olmo_hybrid", "olmoe", "openai-gpt", "opt", "persimmon", "phi", "phi3", "phimoe", "qwen2",
    "qwen2_moe", "qwen3", "qwen3_5_moe_text", "qwen3_5_text", "qwen3_moe", "qwen3_next",
    "qwen4_exp_text", "recurrent_gemma", "rwkv", "sarvam_mla", "sarvam_moe", "seed_oss", "smollm3",
    "solar_open", "stablelm", "starcoder2", "vaultgemma", "xglm", "xlstm", "youtu", "zamba2", "zaya",
))


def read_model_type(path: str) -> str:
    """The model_type of a local HF directory, from its config.json."""
    with open(os.path.join(path, "config.json")) as f:
        return str(json.load(f).get("model_type", ""))


def load_config(path: str):
    """The HF config of a local directory; a model_type transformers does not know (custom
    code is never run: no trust_remote_code) is an UnsupportedModelError."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    model_type = read_model_type(path)
    if model_type not in CONFIG_MAPPING_NAMES:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not an architecture of transformers {_tf_version()} "
            "(custom modelling code is not run)")
    return AutoConfig.from_pretrained(path)


def check_supported(config, critic: bool = False, warn: bool = True) -> None:
    """Refuse, naming model_type, the class and why, what the trainer cannot train:
    `critic` when the job needs one (PPO). A model_type in neither table but a decoder-only
    causal LM of transformers is tried, with a warning when `warn` (the engine's startup
    check warns; the build of each role checks again without)."""
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_MAPPING_NAMES)

    model_type = getattr(config, "model_type", "")
    cls = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    if model_type in REFUSED:
        why = REFUSED[model_type]
    elif getattr(config, "is_encoder_decoder", False):
        why = ENCODER_DECODER
    elif cls is None:
        text = getattr(config, "text_config", None)
        why = (multimodal(getattr(text, "model_type", None)) if text is not None
               else f"no causal-LM class in transformers {_tf_version()}")
    elif critic and model_type not in MODEL_MAPPING_NAMES:
        why = NO_CRITIC
    else:
        if model_type not in TESTED and warn:
            log.warning("model_type %r (%s) is not among the architectures the trainer is tested on", model_type, cls)
        return
    # Why first: the operator quotes the first 200 characters of the pod's last line.
    raise UnsupportedModelError(f"model_type {model_type!r}: {why} ({cls or 'no causal-LM class'})")


def _tf_version() -> str:
    import transformers

    return transformers.__version__


# ---------------------------------------------------------------- the critic


def hidden_size(config) -> int:
    return int(config.get_text_config().hidden_size)


class ValueModel(nn.Module):
    """The PPO critic, as verl's and TRL's value models: the causal LM's backbone
    (`AutoModel.from_config`) and `score`, nn.Linear(hidden, 1), zero-initialised so every
    value is 0 at step 0. No dropout outside the backbone. forward -> values (B, T), the
    value of each position's hidden state (roles.Critic aligns them with the tokens)."""

    def __init__(self, config):
        from transformers import AutoModel

        super().__init__()
        self.config = config
        self.model = AutoModel.from_config(config)
        self.backbone_type = type(self.model)  # the causal LM's module its weights come from
        self.score = nn.Linear(hidden_size(config), 1)

    def reset_value_head(self) -> None:
        with torch.no_grad():
            self.score.weight.zero_()
            self.score.bias.zero_()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        return self.score(out.last_hidden_state).squeeze(-1)

    def gradient_checkpointing_enable(self, **kwargs) -> None:
        self.model.gradient_checkpointing_enable(**kwargs)


# ---------------------------------------------------------------- buffers and blocks


def _sentinel(t: torch.Tensor):
    if t.is_floating_point() or t.is_complex():
        return float("nan")
    if t.dtype == torch.bool:
        return None  # no value tells "never written" apart: see init_non_persistent_buffers
    return torch.iinfo(t.dtype).min


def _non_persistent(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    out = []
    for prefix, module in model.named_modules():
        for name in sorted(getattr(module, "_non_persistent_buffers_set", ())):
            if getattr(module, name, None) is not None:
                out.append((prefix, module, name))
    return out


def _still_sentinel(t: torch.Tensor, fill) -> bool:
    if t.numel() == 0:
        return False
    if isinstance(fill, float):
        return bool(torch.isnan(t).any())
    return bool((t == fill).any())


@torch.no_grad()
def init_non_persistent_buffers(model: nn.Module) -> None:
    """Fill the buffers that no checkpoint holds (`to_empty` left them uninitialised) the
    way transformers does when it loads a model from the meta device
    (`_move_missing_keys_from_meta_to_device`, `_initialize_missing_keys`): mark every
    parameter and persistent buffer `_is_hf_initialized` (the `transformers.initialization`
    functions then skip it) and call each family's own `initialize_weights`, whose
    `_init_weights` sets rotary `inv_freq`, Gemma's `embed_scale`, ... Never rebuilding a
    module from its config: not every module has one (Gemma3TextScaledWordEmbedding).

    Each buffer is filled with a sentinel first (NaN, or the dtype's minimum for integers);
    one that survives means the family does not initialise it: UnsupportedModelError naming
    the module class and the buffer. Boolean buffers get their value twice, from all-False
    and all-True, and must agree."""
    from transformers import PreTrainedModel

    buffers = _non_persistent(model)
    if not buffers:
        return
    pretrained = [m for m in model.modules() if isinstance(m, PreTrainedModel)]
    if not pretrained:
        raise UnsupportedModelError(f"{type(model).__name__} is not a transformers model")
    for t in [*model.parameters(), *_persistent_buffers(model)]:
        t._is_hf_initialized = True
    fills = [_sentinel(getattr(m, name)) for _, m, name in buffers]
    bools = [b for b, fill in zip(buffers, fills) if fill is None]
    for (_, m, name), fill in zip(buffers, fills):
        getattr(m, name).fill_(False if fill is None else fill)
    _initialize(model, pretrained)
    if bools:  # once more from all-True: a buffer the init sets reads the same
        first = [getattr(m, name).clone() for _, m, name in bools]
        for _, m, name in bools:
            getattr(m, name).fill_(True)
        _initialize(model, pretrained)
        for (prefix, m, name), before in zip(bools, first):
            if not torch.equal(getattr(m, name), before):
                _not_initialised(pretrained[0], m, prefix, name)
    for (prefix, m, name), fill in zip(buffers, fills):
        if fill is not None and _still_sentinel(getattr(m, name), fill):
            _not_initialised(pretrained[0], m, prefix, name)


def _not_initialised(model, module: nn.Module, prefix: str, name: str):
    model_type = getattr(getattr(model, "config", None), "model_type", "?")
    where = f"{prefix}.{name}" if prefix else name
    raise UnsupportedModelError(
        f"model_type {model_type!r}: {type(module).__name__} buffer {name!r} ({where}) is not set by the "
        "model's initialize_weights, and no checkpoint holds it (a non-persistent buffer)")


def _persistent_buffers(model: nn.Module) -> list[torch.Tensor]:
    out = []
    for module in model.modules():
        skip = getattr(module, "_non_persistent_buffers_set", set())
        out += [b for name, b in module.named_buffers(recurse=False) if name not in skip and b is not None]
    return out


def _initialize(model: nn.Module, pretrained: list) -> None:
    """Run the outermost transformers models' `initialize_weights` (each recurses into its
    sub-models with their own `_init_weights`), with the modules' done-flags cleared.
    `fully_shard` gives a sharded model a class of its own (FSDPLlamaForCausalLM), defined
    outside transformers, which `is_custom_code` would take for remote code: then every
    module whose own tensors are all marked counts as done, and FalconH1Model never sets
    its layers' `mup_vector`. The model's own class answers instead."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if getattr(module, "_is_hf_initialized", False):
            module._is_hf_initialized = False
    inner = {id(m) for p in pretrained for m in p.modules() if m is not p}
    for p in pretrained:
        if id(p) in inner:
            continue
        cls = type(p)
        if issubclass(cls, FSDPModule):
            cls = next(c for c in cls.__bases__ if c is not FSDPModule)
        p.is_custom_code = cls.is_custom_code
        try:
            p.initialize_weights()
        finally:
            del p.is_custom_code


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks `fully_shard` wraps one by one: the modules whose class the
    model lists in `_no_split_modules` (what HF accelerate's FSDP wrapping uses), outermost
    only; failing that (BioGPT, CTRL and GPT-1 list none), the first ModuleList of
    `num_hidden_layers` modules."""
    from transformers import PreTrainedModel

    names: set[str] = set()
    configs = []
    for m in model.modules():
        if isinstance(m, PreTrainedModel):
            names |= set(m._no_split_modules or ())
            configs.append(m.config.get_text_config())
    found: list[nn.Module] = []
    _collect(model, names, found, root=True)
    if found:
        return found
    layers = {getattr(c, "num_hidden_layers", None) for c in configs} - {None}
    for m in model.modules():
        if isinstance(m, nn.ModuleList) and len(m) in layers:
            return list(m)
    raise UnsupportedModelError(f"cannot find the decoder blocks of {type(model).__name__} "
                                "(no _no_split_modules, no ModuleList of num_hidden_layers modules)")


def _collect(module: nn.Module, names: set[str], found: list[nn.Module], root: bool = False) -> None:
    if not root and type(module).__name__ in names:
        found.append(module)
        return
    for child in module.children():
        _collect(child, names, found)


# ---------------------------------------------------------------- weight decay

NORM_CLASS = re.compile(r"LayerNorm|RMSNorm|GroupNorm|BatchNorm")


def is_norm(module: nn.Module) -> bool:
    """A normalisation layer: torch's, or a class named like one (LlamaRMSNorm,
    GemmaRMSNorm, ...), transformers' own test in `_init_weights`."""
    return (isinstance(module, (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase))
            or bool(NORM_CLASS.search(type(module).__name__)))


def no_weight_decay(model: nn.Module) -> set[str]:
    """Names of the parameters AdamW does not decay by default (HF Trainer's and OpenRLHF's
    convention): every bias, and every parameter of a normalisation layer. A norm's weight
    is a gain, which decay pulls towards 0; the families that scale by `1 + w` (Gemma,
    Qwen3-Next, ...) store it as an offset, which decay pulls towards 1 instead, so one
    setting would mean different things per family."""
    out = set()
    for prefix, module in model.named_modules():
        for name, _ in module.named_parameters(recurse=False):
            full = f"{prefix}.{name}" if prefix else name
            if name == "bias" or is_norm(module):
                out.add(full)
    return out
