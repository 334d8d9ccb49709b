"""The trainer's configuration: one small frozen dataclass per component.

The operator mounts `RFTJobSpec.model_dump(mode="json")` (snake_case) at
`$RFT_CONFIG` (/etc/rft/config.json). Trainer-level keys live under `trainer`
(`total_steps`, `batch_size`, `seed`, nested `fsdp`) next to keys only the operator uses
(image, nodes, resources, ...), which are accepted and ignored. Sections the operator
knows but the trainer does not need (`inference`, `explorer`, `failure_policy`,
`suspend`) are ignored too; any other unknown key is a `ConfigError` naming its dotted
path, because a typo silently falling back to a default (say `lerning_rate`) costs a
whole training run.

`optimizer` and `reporting` are trainer-only sections (not in the RFTJob API yet); the
trainer uses their defaults unless a hand-written config sets them.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping, Union, get_args, get_origin, get_type_hints

import yaml


class ConfigError(ValueError):
    """A bad config; the message starts with the full dotted key to fix."""


def _f(default: Any = dataclasses.MISSING, **bounds: Any) -> Any:
    """A field with range bounds (ge, gt, le, lt, min_len) checked by the loader."""
    if isinstance(default, tuple | list):
        return field(default_factory=lambda: tuple(default), metadata=bounds)
    return field(default=default, metadata=bounds)


@dataclass(frozen=True)
class ModelConfig:
    path: str = _f(min_len=1)
    tokenizer_path: str | None = None
    # fp32 master weights by default: FSDP's MixedPrecisionPolicy already computes in
    # bf16, while an lr of 1e-6 applied to bf16 weights (8 mantissa bits) rounds to nothing.
    dtype: Literal["fp32", "bf16"] = "fp32"


@dataclass(frozen=True)
class AlgorithmConfig:
    name: Literal["grpo", "ppo"]
    learning_rate: float = _f(1e-6, gt=0, le=1)
    critic_learning_rate: float = _f(1e-5, gt=0, le=1)
    kl_coef: float = _f(0.001, ge=0)
    kl_estimator: Literal["k1", "k2", "k3", "low_var_kl"] = "low_var_kl"
    clip_ratio: float = _f(0.2, gt=0, lt=1)
    dual_clip_ratio: float | None = _f(None, gt=1)
    entropy_coef: float = _f(0.0, ge=0)
    epochs: int = _f(1, ge=1, le=100)
    mini_batch_size: int | None = _f(None, ge=1)
    micro_batch_size: int = _f(1, ge=1)
    grad_clip: float = _f(1.0, gt=0)
    loss_aggregation: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = (
        "token-mean"
    )
    gamma: float = _f(1.0, ge=0, le=1)
    lam: float = _f(1.0, ge=0, le=1)
    norm_adv_by_std: bool = True
    cliprange_value: float = _f(0.5, gt=0)
    # KL as a loss term (GRPO style) rather than folded into the reward (classic PPO).
    use_kl_loss: bool = True


@dataclass(frozen=True)
class OptimizerConfig:
    betas: tuple[float, float] = _f((0.9, 0.999), ge=0, lt=1)
    weight_decay: float = _f(0.01, ge=0)
    warmup_steps: int = _f(0, ge=0)
    lr_schedule: Literal["constant", "cosine"] = "constant"
    # Cosine decays to learning_rate * min_lr_ratio at total_steps.
    min_lr_ratio: float = _f(0.0, ge=0, le=1)


@dataclass(frozen=True)
class FSDPConfig:
    reshard_after_forward: bool = True
    activation_checkpointing: bool = False
    cpu_offload: bool = False
    mixed_precision: Literal["bf16", "fp32"] = "bf16"


@dataclass(frozen=True)
class CheckpointConfig:
    uri: str = _f(min_len=1)
    interval: int = _f(100, ge=1)
    keep: int = _f(3, ge=1)
    endpoint: str | None = None
    region: str | None = None


@dataclass(frozen=True)
class BufferConfig:
    # None in the spec means `<checkpoint.uri>/buffer` (the S3 layout in DESIGN.md);
    # load_config resolves it, so the loaded value is never None.
    uri: str | None = None
    max_staleness: int = _f(1, ge=0)
    # Experiences per training step; None in the file means trainer.batch_size.
    batch_size: int | None = _f(None, ge=1)
    # Wait for explorers to write more data instead of finishing when the buffer runs
    # dry. None means: wait iff the job has explorers (`explorer` section present).
    wait: bool | None = None
    poll_seconds: float = _f(2.0, gt=0)


@dataclass(frozen=True)
class SyncConfig:
    interval: int = _f(1, ge=1)
    pinned_version: int | None = _f(None, ge=0)
    # Exported weights versions kept in S3 (the pinned one is kept in addition).
    keep: int = _f(5, ge=1)


@dataclass(frozen=True)
class ReportingConfig:
    log_every: int = _f(1, ge=1)
    metrics_path: str | None = None


@dataclass(frozen=True)
class TrainerConfig:
    total_steps: int = _f(ge=1)
    batch_size: int = _f(ge=1)
    seed: int = _f(0, ge=0)


@dataclass(frozen=True)
class JobIdentity:
    """Who we are; the pod's env (set by the operator) wins over the file's `job`."""

    name: str = ""
    namespace: str = ""
    uid: str = ""
    attempt: int = _f(0, ge=0)
    pod: str = ""


@dataclass(frozen=True)
class Config:
    model: ModelConfig
    algorithm: AlgorithmConfig
    trainer: TrainerConfig
    checkpoint: CheckpointConfig
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    buffer: BufferConfig = field(default_factory=BufferConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    reporting: ReportingConfig = field(default_factory=ReportingConfig)
    job: JobIdentity = field(default_factory=JobIdentity)

    def to_dict(self) -> dict[str, Any]:
        """The file format `load_config` reads (fsdp nested under trainer), JSON-ready."""
        out = json.loads(json.dumps(dataclasses.asdict(self)))
        out["trainer"]["fsdp"] = out.pop("fsdp")
        return out


# Where each section lives in the file, and keys only the operator uses.
_SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "algorithm": AlgorithmConfig,
    "trainer": TrainerConfig,
    "checkpoint": CheckpointConfig,
    "optimizer": OptimizerConfig,
    "buffer": BufferConfig,
    "sync": SyncConfig,
    "reporting": ReportingConfig,
    "job": JobIdentity,
}
_OPERATOR_SECTIONS = frozenset({"inference", "explorer", "failure_policy", "suspend"})
_OPERATOR_KEYS = {
    "trainer": frozenset({
        "image", "image_pull_policy", "nodes", "gpus_per_node", "resources", "env",
        "master_port", "shm_size", "termination_grace_period_seconds", "node_selector",
        "tolerations", "priority_class_name", "scheduler_name", "service_account_name",
        "security_context",
    }),
    "checkpoint": frozenset({"credentials_secret"}),
}
_ENV = {"name": "RFT_JOB_NAME", "namespace": "RFT_JOB_NAMESPACE", "uid": "RFT_JOB_UID",
        "attempt": "RFT_ATTEMPT", "pod": "RFT_POD_NAME"}


class _YamlLoader(yaml.SafeLoader):
    """PyYAML (YAML 1.1) reads `1e-6` as a string; learning rates are written that way."""


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$"),
    list("-+0123456789."),
)


def load_config(
    source: str | Path | Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
) -> Config:
    """Load and validate a config from a dict, or a JSON/YAML file (default $RFT_CONFIG)."""
    env = os.environ if env is None else env
    data = _read(source if source is not None else env.get("RFT_CONFIG", ""))
    _reject_unknown(data, "", set(_SECTIONS) | {"fsdp"}, _OPERATOR_SECTIONS)
    if "fsdp" in data:
        raise ConfigError("fsdp: belongs under trainer (trainer.fsdp)")
    for name in ("model", "algorithm", "trainer", "checkpoint"):
        if data.get(name) is None:
            raise ConfigError(f"{name}: required section is missing")
    parts: dict[str, Any] = {}
    for name, cls in _SECTIONS.items():
        section = dict(_mapping(data.get(name) or {}, name))
        if name == "trainer":
            parts["fsdp"] = _build(FSDPConfig, section.pop("fsdp", None) or {}, "trainer.fsdp")
        if name == "job":
            section.update(_job_from_env(env))
        parts[name] = _build(cls, section, name, _OPERATOR_KEYS.get(name, frozenset()))
    if parts["buffer"].wait is None:
        parts["buffer"] = dataclasses.replace(parts["buffer"], wait=bool(data.get("explorer")))
    return _resolve(Config(**parts))


def _read(source: str | Path | Mapping[str, Any]) -> Mapping[str, Any]:
    if isinstance(source, Mapping):
        return source
    if not str(source):
        raise ConfigError("config: no path given and RFT_CONFIG is not set")
    path = Path(source)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read config: {e}") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.load(text, _YamlLoader)
    except (ValueError, yaml.YAMLError) as e:
        raise ConfigError(f"{path}: not valid {path.suffix.lstrip('.') or 'YAML'}: {e}") from None
    return _mapping(data, str(path))


def _job_from_env(env: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {k: env[v] for k, v in _ENV.items() if env.get(v)}
    if "attempt" in out:
        try:
            out["attempt"] = int(out["attempt"])
        except ValueError:
            raise ConfigError(f"env RFT_ATTEMPT: expected an integer, got {out['attempt']!r}") from None
    return out


def _resolve(cfg: Config) -> Config:
    """Cross-field rules and defaults that depend on other sections."""
    alg = cfg.algorithm
    if alg.mini_batch_size is not None and alg.micro_batch_size > alg.mini_batch_size:
        raise ConfigError(
            f"algorithm.micro_batch_size: must not exceed algorithm.mini_batch_size "
            f"({alg.micro_batch_size} > {alg.mini_batch_size})"
        )
    buffer = dataclasses.replace(
        cfg.buffer,
        uri=cfg.buffer.uri or cfg.checkpoint.uri.rstrip("/") + "/buffer",
        batch_size=cfg.buffer.batch_size or cfg.trainer.batch_size,
    )
    return dataclasses.replace(cfg, buffer=buffer)


def _mapping(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
    return value


def _reject_unknown(data: Mapping[str, Any], where: str, known: set[str], ignored: frozenset) -> None:
    for key in data:
        if key in known or key in ignored:
            continue
        dotted = f"{where}.{key}" if where else str(key)
        close = difflib.get_close_matches(str(key), sorted(known), n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ConfigError(f"{dotted}: unknown key{hint}")


def _build(cls: type, data: Any, where: str, ignored: frozenset = frozenset()) -> Any:
    data = _mapping(data, where)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    _reject_unknown(data, where, set(fields), ignored)
    hints = get_type_hints(cls)
    kwargs = {}
    for name, f in fields.items():
        if name in data:
            kwargs[name] = _check(data[name], hints[name], f.metadata, f"{where}.{name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{where}.{name}: required key is missing")
    return cls(**kwargs)


def _check(value: Any, tp: Any, bounds: Mapping[str, Any], key: str) -> Any:
    """Type-check one value (no coercion beyond int -> float) and check its bounds."""
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        if value is None:
            return None
        (tp,) = [a for a in get_args(tp) if a is not type(None)]
        origin = get_origin(tp)
    if origin is Literal:
        if value not in get_args(tp):
            allowed = ", ".join(repr(a) for a in get_args(tp))
            raise ConfigError(f"{key}: must be one of {allowed}, got {value!r}")
        return value
    if origin is tuple:
        args = get_args(tp)
        if not isinstance(value, list | tuple) or len(value) != len(args):
            raise ConfigError(f"{key}: expected a list of {len(args)} numbers, got {value!r}")
        return tuple(_check(v, a, bounds, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, int | float) and not isinstance(value, bool),
        str: isinstance(value, str),
    }[tp]
    if not ok:
        raise ConfigError(f"{key}: expected {tp.__name__}, got {type(value).__name__} {value!r}")
    value = float(value) if tp is float else value
    _check_bounds(value, bounds, key)
    return value


def _check_bounds(value: Any, bounds: Mapping[str, Any], key: str) -> None:
    if isinstance(value, float) and value != value:
        raise ConfigError(f"{key}: must be a number, got nan")
    rules = {
        "ge": (lambda v, b: v >= b, ">="), "gt": (lambda v, b: v > b, ">"),
        "le": (lambda v, b: v <= b, "<="), "lt": (lambda v, b: v < b, "<"),
    }
    for name, bound in bounds.items():
        if name == "min_len":
            if len(value) < bound:
                raise ConfigError(f"{key}: must not be empty")
        elif not rules[name][0](value, bound):
            raise ConfigError(f"{key}: must be {rules[name][1]} {bound}, got {value!r}")
