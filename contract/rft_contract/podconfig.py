"""The pods' config, rendered from the RFTJob spec by an explicit list of fields: what reaches
the trainer, explorer and sync-agent pods (`POD_CONFIG`) and what stays with the operator
(`OPERATOR_ONLY`, each with the reason). Every spec field is in exactly one of the two
(tests/unit/test_podconfig.py), so a new spec field reaches no pod until it is added here.

Why an allow-list: every pod validates its config with unknown keys forbidden
(`rft_contract.config`), so a key an older trainer image does not know makes it exit 78.
`CONFIG_VERSION` is the format's; the promise between versions:
- a config this version renders validates under the previous release's schema for every
  spec that release accepted (its schema is vendored in e2e/releases/<commit>/pod-config/);
- a config the previous release rendered loads here.
A field added later therefore goes into the config only when it is set away from its
default (`ADDED`), so that a job which does not use it keeps running on an older image.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel
from pydantic.alias_generators import to_camel

CONFIG_VERSION = 1

# spec section -> the fields pods read: True for the whole value (a scalar, a list, a map
# or a sub-model that reaches pods whole), or a dict of its fields.
_CACHE = {"host_path": True, "persistent_volume_claim": True, "size_limit": True, "download_timeout_seconds": True}
_FSDP = {"reshard_after_forward": True, "activation_checkpointing": True, "cpu_offload": True, "mixed_precision": True}
POD_CONFIG: dict[str, Any] = {
    "model": {"path": True, "tokenizer_path": True, "dtype": True, "cache": _CACHE, "lora": True},
    "algorithm": {name: True for name in (
        "name", "learning_rate", "critic_learning_rate", "kl_coef", "kl_estimator", "clip_ratio", "clip_ratio_low",
        "clip_ratio_high", "dual_clip_ratio", "entropy_coef", "epochs", "mini_batch_size", "micro_batch_size",
        "grad_clip", "loss_aggregation", "gamma", "lam", "norm_adv_by_std", "cliprange_value", "use_kl_loss",
        "rollout_correction")},
    "trainer": {**{name: True for name in ("nodes", "gpus_per_node", "total_steps", "batch_size", "seed")},
                "fsdp": _FSDP},
    "checkpoint": {name: True for name in ("uri", "interval", "keep", "endpoint", "region", "staging_size_limit")},
    # image: the pods' schema checks that a vLLM or SGLang job names one.
    "inference": {name: True for name in ("replicas", "image", "engine", "port")},
    "explorer": {**{name: True for name in (
        "replicas", "taskset_uri", "rollouts_per_task", "reward", "prompt_format", "tasks_per_shard",
        "request_timeout", "concurrency", "max_n", "poll_interval")},
        "sampling": {"temperature": True, "top_p": True, "max_tokens": True}},
    "buffer": {name: True for name in ("uri", "max_staleness", "stale_samples", "wait", "poll_seconds")},
    "sync": {name: True for name in ("interval", "pinned_version", "keep", "dtype", "probe_tolerance")},
    "optimizer": {name: True for name in (
        "betas", "weight_decay", "weight_decay_all", "warmup_steps", "lr_schedule", "min_lr_ratio")},
    "reporting": {"log_every": True},
    "tracking": {"tensorboard": {"uri": True},
                 "mlflow": {"tracking_uri": True, "experiment": True, "credentials_secret": True},
                 "wandb": {"project": True, "entity": True, "mode": True, "api_key_secret": True},
                 "rollout_samples": True},
    "evaluation": True,
}

# Spec fields that reach no pod, and why.
_POD_SPEC = "the pod spec's, rendered by the operator; no program reads it"
_SENSITIVE = "the pod spec's: a value may be sensitive, and a ConfigMap is readable by more people"
OPERATOR_ONLY: dict[str, str] = {
    "suspend": "the operator's: it removes the pods",
    "failure_policy": "the operator's: it decides restarts",
    "service_account_annotations": "the ServiceAccounts', set by the operator",
    "trainer.image": _POD_SPEC, "trainer.image_pull_policy": _POD_SPEC, "trainer.resources": _POD_SPEC,
    "trainer.master_port": "the launcher's flag (--master-port) and the Service's port",
    "trainer.shm_size": _POD_SPEC, "trainer.node_selector": _POD_SPEC, "trainer.tolerations": _POD_SPEC,
    "trainer.termination_grace_period_seconds": "the pod spec's; the trainer reads it from RFT_GRACE_SECONDS",
    "trainer.priority_class_name": _POD_SPEC, "trainer.scheduler_name": _POD_SPEC,
    "trainer.env": _SENSITIVE,
    "trainer.security_context": _POD_SPEC,
    "checkpoint.credentials_secret": "the pod spec's secretKeyRefs (objects.build_s3_env)",
    "inference.gpus_per_replica": _POD_SPEC, "inference.resources": _POD_SPEC, "inference.shm_size": _POD_SPEC,
    "inference.args": "the engine's command line (a flag such as vLLM's --api-key may be sensitive)",
    "inference.env": _SENSITIVE,
    "explorer.image": _POD_SPEC,
    "sync.fast_path": "rank 0's weights port and RFT_WEIGHTS_PEER_PORT (trainer_pods.build_weights_env)",
    "sync.transport": "RFT_WEIGHTS_TRANSPORT on trainer pods, --transport of the sync agents and vLLM's "
                      "--weight-transfer-config (rollout_pods)",
}

# Fields added to the config after version 1: (section path, field) -> the version that
# added it. Rendered only when set away from the default, so older images keep working.
ADDED: dict[tuple[str, ...], int] = {("model", "lora"): 1}


def reads_operator_only(rule: str) -> bool:
    """Whether a CEL rule of the spec reads a field pods never get: the pods' schema skips
    that rule (it would judge the field's default, not the job's value)."""
    return any(re.search(r"self" + "".join(rf"\.\??{to_camel(part)}" for part in path.split(".")) + r"\b", rule)
               for path in OPERATOR_ONLY)


def render(spec: BaseModel, job: dict[str, Any]) -> dict[str, Any]:
    """The config a job's pods load (`rft_contract.config.load_config`): the spec's
    `POD_CONFIG` fields, JSON-ready, plus who the job is (`job`)."""
    data = spec.model_dump(mode="json", include=_include(POD_CONFIG))
    for (*section, field), _version in ADDED.items():
        _drop_if_default(spec, data, section, field)
    data["job"] = dict(job)
    return data


def _include(tree: dict[str, Any]) -> dict[str, Any]:
    return {k: (True if v is True else _include(v)) for k, v in tree.items()}


def _drop_if_default(spec: BaseModel, data: dict[str, Any], section: list[str], field: str) -> None:
    model, out = spec, data
    for name in section:
        model, out = getattr(model, name, None), (out or {}).get(name)
        if model is None or out is None:
            return
    info = type(model).model_fields[field]
    if field in out and getattr(model, field) == info.get_default(call_default_factory=True):
        del out[field]
