"""LoRA adapters on the policy (`spec.model.lora`), with PEFT.

PEFT's `inject_adapter_in_model` puts its LoRA layers into the model in place: the model
stays the transformers model it was (its config, blocks, tying and `fully_shard` wrapping
unchanged), each adapted linear layer becomes a `peft.tuners.lora.Linear` holding the
frozen original as `base_layer` and the trainable `lora_A` / `lora_B`, and every other
parameter is frozen. So in the model's state dict an adapted weight `...q_proj.weight`
reads `...q_proj.base_layer.weight`, next to `...q_proj.lora_A.default.weight` and
`...q_proj.lora_B.default.weight`.

What the rest of the trainer does with it:
- build (parallelize.build_model): adapters injected on the meta device, before sharding;
  rank 0 fills the base weights from the checkpoint and the adapters from `initial_state`
  (PEFT's initialisation: A Kaiming-uniform, B zero, so step 0 is the base model), seeded
  by the trainer's seed on rank 0 alone: 1 and N ranks start from the same adapters;
- the optimizer holds the trainable parameters only (roles.make_optimizer);
- the reference policy for the KL term is the same model with its adapters off
  (`adapters_off`), as verl does: no second copy of the weights;
- checkpoints hold the trainable parameters and their optimizer state only
  (checkpoint.AppState: `ignore_frozen_params`), the base comes from `model.path`;
- each weight version is the adapter alone, in PEFT's format (`adapter_items`,
  `adapter_config`: what `PeftModel.from_pretrained` and vLLM's `load_lora_adapter` read)
  when the job's engine serves adapters (`EngineProfile.lora_adapters`); else the base
  with the adapters merged (`merged`), a plain HF model every engine loads:
  W + (alpha / rank) B A, computed in fp32.
The critic (PPO) stays fully trained: its value head is new and its backbone learns a
different function from the policy's.
"""

from __future__ import annotations

import json
import math
import os
from contextlib import contextmanager
from typing import Iterable, Iterator

import torch
from torch import nn

from rft_contract.layout import ADAPTER_CONFIG, ADAPTER_FILE, ADAPTER_KEY_PREFIX, picks_module
from rft_contract.spec import ALL_LINEAR, LoraSpec

ADAPTER = "default"  # PEFT's adapter name: one adapter per model
BASE = ".base_layer."


def alpha(spec: LoraSpec) -> float:
    """LoRA's alpha as the spec means it: its own, else the rank (scale 1)."""
    return spec.alpha if spec.alpha is not None else spec.rank


def inject(model: nn.Module, spec: LoraSpec) -> nn.Module:
    """The model with LoRA layers in place (on its device, meta included), base frozen.
    ValueError naming spec.model.lora.targetModules when they match no linear layer, or
    match a module that is not one."""
    from peft import LoraConfig, inject_adapter_in_model
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.tuners_utils import BaseTunerLayer

    targets = ALL_LINEAR if spec.target_modules == [ALL_LINEAR] else list(spec.target_modules)
    config = LoraConfig(r=spec.rank, lora_alpha=alpha(spec), lora_dropout=spec.dropout, target_modules=targets, bias="none")
    try:
        inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    except ValueError as e:  # PEFT: "Target modules {...} not found in the base model ..."
        raise ValueError(f"spec.model.lora.targetModules {spec.target_modules}: {str(e).splitlines()[0]}") from None
    field = f"spec.model.lora.targetModules {spec.target_modules}"
    others = sorted(name for name, m in model.named_modules()
                    if isinstance(m, BaseTunerLayer) and not isinstance(m, LoraLinear))
    if others:
        raise ValueError(f"{field} match modules that are not linear layers: {', '.join(others[:4])}; "
                         "name linear layers (e.g. q_proj, v_proj)")
    adapted = layers(model)
    if targets != ALL_LINEAR:  # PEFT refuses only when no name matched: a typo beside a good name passed
        if unmatched := [t for t in targets if not any(picks_module(t, n) for n in adapted)]:
            raise ValueError(f"{field}: {', '.join(unmatched)} matched no linear layer of the model")
    shared: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        shared[id(p)] = shared.get(id(p), 0) + 1
    if tied := sorted(n for n, m in adapted.items() if shared.get(id(m.base_layer.weight), 0) > 1):
        raise ValueError(f"{field} adapt {', '.join(tied)}, whose weight is tied to another (the embeddings): "
                         "the engines re-tie it on load, so its adapter would be lost; leave it out")
    for m in adapted.values():
        # fp32 adapters whatever the base's dtype (PEFT's PeftModel does the same): with bf16
        # master weights an Adam step of lr 1e-5 is below half an ulp of A's values and would
        # round away. The forward casts the input to the adapters' dtype and the result back.
        m.lora_A.float()
        m.lora_B.float()
    return model


def layers(model: nn.Module) -> dict[str, nn.Module]:
    """The model's LoRA layers by module name."""
    from peft.tuners.lora import Linear as LoraLinear

    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLinear)}


def has_adapters(model: nn.Module) -> bool:
    return bool(layers(model))


def is_adapter_key(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def hf_name(name: str) -> str:
    """The checkpoint's name of a parameter of the adapted model: `base_layer` removed."""
    return name.replace(BASE, ".")


def peft_name(name: str) -> str:
    """An adapter parameter's key in PEFT's saved file: `...q_proj.lora_A.default.weight`
    -> `base_model.model....q_proj.lora_A.weight`."""
    return ADAPTER_KEY_PREFIX + name.replace(f".lora_A.{ADAPTER}.", ".lora_A.").replace(f".lora_B.{ADAPTER}.", ".lora_B.")


def adapter_items(items: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The adapters of (name, tensor) pairs of the adapted model's state dict, named as
    PEFT saves them (`peft_name`); every other pair is left out."""
    return ((peft_name(name), value) for name, value in items if is_adapter_key(name))


def adapter_config(model: nn.Module, spec: LoraSpec, base: str | None = None):
    """PEFT's `LoraConfig` of the model's adapters (save it with `save_pretrained`): the
    spec's rank, alpha and dropout, its target modules (`all-linear` as the names of the
    layers it adapted here, which engines that do not resolve it read), `base` as
    `base_model_name_or_path`."""
    from peft import LoraConfig

    adapted = layers(model)
    targets = sorted({name.rsplit(".", 1)[-1] for name in adapted}) if spec.target_modules == [ALL_LINEAR] \
        else list(spec.target_modules)
    return LoraConfig(r=spec.rank, lora_alpha=alpha(spec), lora_dropout=spec.dropout, bias="none", task_type="CAUSAL_LM", target_modules=targets,
                      fan_in_fan_out=any(m.fan_in_fan_out for m in adapted.values()),
                      base_model_name_or_path=base)


def read_adapter(model: nn.Module, spec: LoraSpec, path: str) -> dict[str, torch.Tensor]:
    """The starting adapter (`spec.adapter_path`, fetched to the directory `path`: PEFT's
    saved format) under the model's state-dict keys. ValueError naming
    spec.model.lora.adapterPath when it is not a LoRA adapter of this rank and alpha that
    adapts exactly the layers the spec adapts, in their shapes."""
    from safetensors.torch import load_file

    field = f"spec.model.lora.adapterPath {spec.adapter_path}"
    try:
        with open(os.path.join(path, ADAPTER_CONFIG)) as f:
            config = json.load(f)
        tensors = load_file(os.path.join(path, ADAPTER_FILE))
    except (OSError, ValueError) as e:
        raise ValueError(f"{field}: not a PEFT adapter ({ADAPTER_CONFIG} and {ADAPTER_FILE}): "
                         f"{type(e).__name__}: {e}") from None
    want_alpha = alpha(spec)
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        raise ValueError(f"{field}: peft_type {config.get('peft_type') if isinstance(config, dict) else None!r} "
                         "is not LORA")
    # What PEFT would scale or shape otherwise than the trainer's LoRA (r, alpha, no bias).
    if other := [k for k, ok in (("use_rslora", not config.get("use_rslora")), ("use_dora", not config.get("use_dora")),
                                 ("rank_pattern", not config.get("rank_pattern")),
                                 ("alpha_pattern", not config.get("alpha_pattern")),
                                 ("bias", config.get("bias", "none") == "none")) if not ok]:
        raise ValueError(f"{field}: sets {', '.join(other)}, which the trainer's LoRA does not (plain LoRA: "
                         "one rank and alpha for every layer, no bias)")
    if (config.get("r"), float(config.get("lora_alpha") or 0)) != (spec.rank, float(want_alpha)):
        raise ValueError(f"{field}: its rank {config.get('r')} and alpha {config.get('lora_alpha')} are not "
                         f"spec.model.lora's ({spec.rank}, {want_alpha:g})")
    keys = {peft_name(f"{prefix}.lora_{x}.{ADAPTER}.weight"): f"{prefix}.lora_{x}.{ADAPTER}.weight"
            for prefix in layers(model) for x in ("A", "B")}
    if missing := sorted({k.rsplit(".lora_", 1)[0] for k in keys.keys() - tensors.keys()}):
        raise ValueError(f"{field}: no adapter for {len(missing)} layers spec.model.lora.targetModules adapts: "
                         f"{', '.join(m.removeprefix(ADAPTER_KEY_PREFIX) for m in missing[:4])}")
    if extra := sorted(tensors.keys() - keys.keys()):
        raise ValueError(f"{field}: adapts what spec.model.lora.targetModules does not: "
                         f"{', '.join(e.removeprefix(ADAPTER_KEY_PREFIX) for e in extra[:4])}")
    state = model.state_dict()
    out = {}
    for name, key in keys.items():
        if tuple(tensors[name].shape) != tuple(state[key].shape):
            raise ValueError(f"{field}: {name.removeprefix(ADAPTER_KEY_PREFIX)} is {tuple(tensors[name].shape)}, "
                             f"the model's {tuple(state[key].shape)}")
        out[key] = tensors[name].to(state[key].dtype)
    return out


def initial_state(model: nn.Module, hf: dict[str, torch.Tensor], seed: int,
                  start: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Rank 0: the adapted model's full state dict from the HF checkpoint's tensors `hf`,
    with the adapters of `start` (`read_adapter`), else new adapters as PEFT initialises
    them (A Kaiming-uniform, B zero), drawn from `seed` in module order, whatever the world
    size."""
    if start is not None:
        return {**{k: v for k, v in initial_state(model, hf, seed).items() if not is_adapter_key(k)}, **start}
    gen = torch.Generator().manual_seed(seed)
    adapted = layers(model)
    out = {}
    for name in model.state_dict().keys():
        if is_adapter_key(name):
            continue
        if hf_name(name) in hf:
            out[name] = hf[hf_name(name)]
    for prefix, m in adapted.items():
        a, b = m.lora_A[ADAPTER].weight, m.lora_B[ADAPTER].weight
        init_a = torch.empty(a.shape, dtype=torch.float32)
        nn.init.kaiming_uniform_(init_a, a=math.sqrt(5), generator=gen)  # peft lora.layer.reset_lora_parameters
        out[f"{prefix}.lora_A.{ADAPTER}.weight"] = init_a.to(a.dtype)
        out[f"{prefix}.lora_B.{ADAPTER}.weight"] = torch.zeros(b.shape, dtype=b.dtype)
    return out


@contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """The base model (the reference policy): every adapter off, then on again. Only the
    flag PEFT's forward reads (`disable_adapters`) is set: PEFT's `enable_adapters` also
    flips the adapters' requires_grad, on whichever parameters FSDP2 has registered at
    that moment (sharded or unsharded), which could leave the sharded ones frozen."""
    adapted = list(layers(model).values())
    for m in adapted:
        m._disable_adapters = True
    try:
        yield
    finally:
        for m in adapted:
            m._disable_adapters = False


def merged(model: nn.Module, items: Iterable[tuple[str, torch.Tensor]],
           compute: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """The (name, full tensor) pairs of the model's state dict as the base model names
    them, each adapted weight merged with its adapter as PEFT's `get_delta_weight` has it:
    W + (alpha / rank) B A (transposed for a layer stored (in, out), GPT-2's Conv1D), in
    fp32, back in W's dtype; the adapters themselves are not yielded. `compute` False (the
    ranks that write nothing): every item is still consumed, the merge skipped."""
    roles: dict[str, tuple[str, str]] = {}  # state-dict key -> (layer, W | A | B)
    for prefix, m in layers(model).items():
        roles[f"{prefix}{BASE}weight"] = (prefix, "W")
        roles[f"{prefix}.lora_A.{ADAPTER}.weight"] = (prefix, "A")
        roles[f"{prefix}.lora_B.{ADAPTER}.weight"] = (prefix, "B")
    adapted = layers(model)
    scale = {prefix: m.scaling[ADAPTER] for prefix, m in adapted.items()}
    held: dict[str, dict[str, torch.Tensor]] = {}
    for name, value in items:
        if name not in roles:
            yield hf_name(name), value
            continue
        prefix, kind = roles[name]
        parts = held.setdefault(prefix, {})
        parts[kind] = value
        if len(parts) == 3:
            w, a, b = parts["W"], parts["A"], parts["B"]
            del held[prefix]
            if not compute:
                yield f"{prefix}.weight", w
                continue
            delta = b.float() @ a.float()
            if adapted[prefix].fan_in_fan_out:
                delta = delta.T
            yield f"{prefix}.weight", (w.float() + scale[prefix] * delta).to(w.dtype)
    if held:
        raise RuntimeError(f"adapted layers without their base weight or adapters in the state dict: {sorted(held)[:4]}")
