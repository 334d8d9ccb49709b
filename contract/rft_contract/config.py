"""The job config every pod loads: the RFTJob's resolved spec plus who the pod is.

The operator writes the spec's fields the pods read (`rft_contract.podconfig.render`:
snake_case, defaults applied, an explicit list of fields) into the `<job>-config`
ConfigMap, mounted at `$RFT_CONFIG` (/etc/rft/config.json). The trainer, the explorers and the tests validate
it with the same models the CRD is generated from, so an unknown or mistyped key gives
the same message in every pod (`ConfigError`, starting with the dotted key to fix): a
typo silently falling back to a default (say `lerning_rate`) costs a whole training run.

A hand-written YAML or JSON file works too (`python -m rft_trainer --config my.yaml`);
keys the RFTJob requires only for its pods (`trainer.image`) may be left out there.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, ClassVar, Mapping

import yaml
from pydantic import Field, ValidationError

from .errors import describe
from .layout import buffer_uri
from .checks import Check
from .names import ENV_ATTEMPT, ENV_CONFIG, ENV_JOB_NAME, ENV_JOB_NAMESPACE, ENV_JOB_UID, ENV_POD_NAME
from .podconfig import reads_operator_only
from .podenv import PodEnv
from .spec import Model, RFTJobSpec


class ConfigError(ValueError):
    """A bad config; the message starts with the full dotted key to fix."""


class JobIdentity(Model):
    """Who we are; the pod's env (set by the operator) wins over the file's `job`."""

    name: str = ""
    namespace: str = ""
    uid: str = ""
    attempt: int = Field(default=0, ge=0)
    pod: str = ""


class JobConfig(RFTJobSpec):
    """The resolved spec: `buffer.uri` and `buffer.wait` are set. The spec's rules that read
    a field pods never get (podconfig.OPERATOR_ONLY, e.g. trainer.securityContext) are the
    API server's alone: here they would judge that field's default, not the job's value."""

    rules: ClassVar[tuple[Check, ...]] = tuple(c for c in RFTJobSpec.rules if not reads_operator_only(c.rule))

    job: JobIdentity = Field(default_factory=JobIdentity)
    # The knobs the pod's environment sets (podenv.py), read once by `load_config`; not
    # part of the file (nor of `to_dict` and the config hash).
    env: PodEnv = Field(default_factory=PodEnv, exclude=True)

    @property
    def fsdp(self):
        return self.trainer.fsdp

    def to_dict(self) -> dict[str, Any]:
        """The file format `load_config` reads, JSON-ready."""
        return self.model_dump(mode="json")


_ENV = {"name": ENV_JOB_NAME, "namespace": ENV_JOB_NAMESPACE, "uid": ENV_JOB_UID,
        "attempt": ENV_ATTEMPT, "pod": ENV_POD_NAME}


class _YamlLoader(yaml.SafeLoader):
    """PyYAML (YAML 1.1) reads `1e-6` as a string; learning rates are written that way."""


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$"),
    list("-+0123456789."),
)


def load_config(source: str | Path | Mapping[str, Any] | None = None,
                env: Mapping[str, str] | None = None) -> JobConfig:
    """Load and validate a config from a dict, or a JSON/YAML file (default $RFT_CONFIG)."""
    env = os.environ if env is None else env
    data = dict(_read(source if source is not None else env.get(ENV_CONFIG, "")))
    job = data.get("job")
    if isinstance(job, Mapping):
        data["job"] = {**job, **_job_from_env(env)}
    elif job is None:
        data["job"] = _job_from_env(env)
    if "env" in data:
        raise ConfigError("env: not a config key; the pod's environment sets it (rft_contract.podenv.VARIABLES)")
    try:
        data["env"] = PodEnv.read(env)
    except ValueError as e:
        raise ConfigError(f"env {e}") from None
    try:
        cfg = JobConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(describe(e, JobConfig, style="snake")) from None
    return _resolve(cfg)


def load_explorer_config(source: str | Path | Mapping[str, Any] | None = None,
                         env: Mapping[str, str] | None = None) -> JobConfig:
    """The same config; an explorer needs its `explorer` section."""
    cfg = load_config(source, env)
    if cfg.explorer is None:
        raise ConfigError("explorer: required section is missing")
    return cfg


def _read(source: str | Path | Mapping[str, Any]) -> Mapping[str, Any]:
    if isinstance(source, Mapping):
        return source
    if not str(source):
        raise ConfigError(f"config: no path given and {ENV_CONFIG} is not set")
    path = Path(source)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read config: {e}") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.load(text, _YamlLoader)
    except (ValueError, yaml.YAMLError) as e:
        raise ConfigError(f"{path}: not valid {path.suffix.lstrip('.') or 'YAML'}: {e}") from None
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: expected a mapping, got {type(data).__name__}")
    return data


def _job_from_env(env: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {k: env[v] for k, v in _ENV.items() if env.get(v)}
    if "attempt" in out:
        try:
            out["attempt"] = int(out["attempt"])
        except ValueError:
            raise ConfigError(f"env {ENV_ATTEMPT}: expected an integer, got {out['attempt']!r}") from None
    return out


def _resolve(cfg: JobConfig) -> JobConfig:
    """Cross-field rules, and defaults that depend on other sections."""
    alg = cfg.algorithm
    if alg.mini_batch_size is not None and alg.micro_batch_size > alg.mini_batch_size:
        raise ConfigError(
            f"algorithm.micro_batch_size: must not exceed algorithm.mini_batch_size "
            f"({alg.micro_batch_size} > {alg.mini_batch_size})"
        )
    b = cfg.buffer
    buffer = b.model_copy(update={
        "uri": b.uri or buffer_uri(cfg.checkpoint.uri),
        "wait": cfg.explorer is not None if b.wait is None else b.wait,
    })
    return cfg.model_copy(update={"buffer": buffer})
