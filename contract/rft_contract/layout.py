"""Where one job's data lives, under `spec.checkpoint.uri` (docs/design.md, "S3 layout"):

    <root>/ckpt/step-NNNNNNNN/      DCP checkpoint files + manifest.json (the commit)
    <root>/weights/step-NNNNNNNN/   HF safetensors export + manifest.json (the commit); a LoRA
                                    job's engines that load adapters: PEFT's adapter files
                                    (ADAPTER_CONFIG, adapter_model.safetensors) instead
    <root>/merged/step-NNNNNNNN/    a LoRA job with adapter versions, at its end: the base with
                                    the adapter merged (HF safetensors + manifest.json)
    <root>/buffer/                  experience shards `<seq>-e<idx>` (default buffer.uri)
    <root>/metrics/attempt-NNN.jsonl  the trainer's per-step metrics, one file per attempt

Pure string functions plus one listing helper; the trainer, the sync agent, the explorer
and the operator all build URIs here, so the layout is defined once.
"""

from __future__ import annotations

import re

import os

from .storage import Storage, join

CHECKPOINTS = "ckpt"
WEIGHTS = "weights"
MERGED = "merged"
BUFFER = "buffer"
METRICS = "metrics"
# What makes a weights version a LoRA adapter (PEFT's saved format), not a whole model.
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_KEY_PREFIX = "base_model.model."  # what PEFT's saved tensor names start with
ADAPTER_FILE = "adapter_model.safetensors"  # its tensors (PeftModel.save_pretrained's one file)
ALL_LINEAR = "all-linear"  # PEFT's target_modules for every linear layer but the output head


def picks_module(target: str, module: str) -> bool:
    """Whether a LoRA target name picks the module named `module`, as PEFT matches them: the
    name itself, or a suffix of it after a '.'."""
    return module == target or module.endswith("." + target)
_STEP_DIR = re.compile(r"step-(\d+)")


def step_dir(base: str, step: int) -> str:
    return join(base, f"step-{step:08d}")


def checkpoint_uri(root: str, step: int) -> str:
    return step_dir(join(root, CHECKPOINTS), step)


def weights_uri(root: str, version: int) -> str:
    return step_dir(join(root, WEIGHTS), version)


def is_adapter_dir(path: str | os.PathLike) -> bool:
    """A local weights directory that holds a LoRA adapter (loaded onto a base), not a model."""
    return os.path.isfile(os.path.join(path, ADAPTER_CONFIG))


def merged_uri(root: str, step: int) -> str:
    return step_dir(join(root, MERGED), step)


def buffer_uri(root: str) -> str:
    return join(root, BUFFER)


def metrics_uri(root: str, attempt: int) -> str:
    return join(root, METRICS, f"attempt-{attempt:03d}.jsonl")


def list_step_dirs(storage: Storage, base: str) -> dict[int, tuple[str, set[str]]]:
    """`<base>/step-NNNNNNNN/<name>` objects, from one listing: step -> (its prefix URI,
    the names under it). Checkpoints and weight exports share this layout."""
    base = base.rstrip("/") + "/"
    out: dict[int, tuple[str, set[str]]] = {}
    for obj in storage.list(base):
        head, _, name = obj[len(base):].partition("/")
        m = _STEP_DIR.fullmatch(head)
        if m and name:
            out.setdefault(int(m.group(1)), (base + head, set()))[1].add(name)
    return out
