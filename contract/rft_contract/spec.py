"""The RFTJob spec: these pydantic models are the single source of truth.

`crds/rftjob.yaml` is generated from them (`rft_operator.crdgen`), the operator parses the
stored spec with them, and every pod validates the job config it mounts with the same
models (`rft_contract.config`), so a typo gives the same message everywhere. Two kinds
of rule live here:

* Field constraints (`ge`, `le`, `pattern`, `Literal`) become OpenAPI schema checks, and
  `Check`s (a CEL rule, the same test in Python, one message: `rft_contract.checks`,
  which also holds the formats) become CEL
  `x-kubernetes-validations`, so the API server refuses a bad spec at admission with a
  message naming the field, and pydantic refuses it in the same words. A few checks are
  admission-only (`ok=None`): the transition rules, the batch layout (the trainer checks
  it again against its real world size), and the S3-or-absolute-path requirements, since
  a config written by hand for a local trainer run may name local directories.
* Defaults live only in these models, never in the CRD schema: a schema default would be
  written back into the stored object and GitOps tools (Argo CD, Flux) would see drift.
  The operator parses the stored spec with `RFTJobSpec.model_validate`, which applies them.

Knobs only the trainer or the explorer reads (optimizer, seed, buffer polling, explorer
concurrency, ...) live here too: a component cannot accept a setting the RFTJob cannot
carry. A few fields the RFTJob requires are optional in Python (`admission_required`):
the CRD lists them as required, while a config written by hand for a local trainer run
may leave them out.

Every string a CEL rule reads has a maxLength, every list a maxItems and every map a
maxProperties: the API server refuses rules whose worst-case cost it cannot bound.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_serializer, model_validator
from pydantic.alias_generators import to_camel

from .algorithms import (ALGORITHM_NAMES, ALGORITHMS, GROUP_ALGORITHMS, LOSS_AGGREGATIONS, ROLLOUT_IS_LEVELS,
                         ROLLOUT_RS_OPTIONS)
from .checks import (BASELINE_CAPABILITIES, BUILTIN_REWARDS, DNS_SUBDOMAIN, ENDPOINT_CHECKS, MAX_ID,
                     QUALIFIED_KEYS, Capability, Check, EnvName, ExitCode, Image, ImagePath, LabelValue,
                     Quantity, Reward, S3Uri, ShmSize, Size, cel, cel_rules, checked, immutable, is_qualified_name,
                     matching, on_field, parse_quantity, run_checks, search_regex, unique_list)
from .engines import (ENGINE_ENV, ENGINE_NAMES, ENGINES, LORA_ENGINES, LORA_UNSERVED, NCCL_ENGINES,
                      TRAINER_IMAGE_ENGINES)
from .errors import describe
from .layout import ALL_LINEAR, picks_module
from .staleness import KEEP, STALE_SAMPLES
from .trackers import DEFAULT_ROLLOUT_SAMPLES, MAX_SAMPLE_CHARS

# Child names are `<job>-trainer-<attempt>-<rank>`; they double as pod hostnames, which
# must be DNS labels (<= 63 chars). 40 leaves room for the suffixes.
MAX_NAME_LENGTH = 40
DNS_LABEL = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
# Marks a field the RFTJob requires (the CRD lists it) but a hand-written config may omit.
ADMISSION_REQUIRED = "x-rft-admission-required"


def admission_required(**kw: Any) -> Any:
    return Field(default=None, json_schema_extra={ADMISSION_REQUIRED: True}, **kw)


# ------------------------------------------------------------------ models

def _object_rules(schema: dict[str, Any], cls: type) -> None:
    if rules := getattr(cls, "rules", ()):
        schema["rules"] = cel_rules(rules)


class Model(BaseModel):
    """camelCase on the wire, snake_case in Python (both accepted); unknown fields are an
    error; types are strict (no "3" for 3, no 1.5 for an integer). Frozen: a parsed spec
    is a value, changed only with `model_copy(update=...)`. `rules`: checks on the whole
    object (CEL `self` is the object, `ok` gets the parsed model)."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", strict=True, frozen=True,
        json_schema_extra=_object_rules,
    )
    rules: ClassVar[tuple[Check, ...]] = ()

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__}.{name}: the config is frozen")

    @model_validator(mode="after")
    def _check_rules(self) -> Any:
        return run_checks(type(self).rules, self)



class OmitUnset(Model):
    """A spec object with `omit_unset`: optional fields added after jobs already ran, left
    out of the serialized spec while unset, so a running job's config (and its hash) stays
    what it was before the field existed (no drift) and an older trainer image meets no
    unknown key."""

    omit_unset: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler: Any) -> Any:
        data = handler(self)
        if isinstance(data, dict):
            for name in type(self).omit_unset:
                if getattr(self, name) is None:
                    data.pop(name, None)
                    data.pop(to_camel(name), None)
        return data


def no_gpu_resources(owner: str, instead: str) -> tuple[Check, ...]:
    """GPUs are counted by a field of their own (`instead`), which the operator turns into
    both the request and the limit, and the scheduler's gang accounting reads."""
    return tuple(
        Check(f"!has(self.resources) || !has(self.resources.{kind}) || !('nvidia.com/gpu' in self.resources.{kind})",
              lambda o, kind=kind: "nvidia.com/gpu" not in getattr(o.resources, kind),
              f"set {owner}.{instead} instead of {owner}.resources.{kind}['nvidia.com/gpu']", ".resources")
        for kind in ("limits", "requests"))


def _is_quantity(x: str) -> str:
    return f"(type({x}) == int || isQuantity({x}))"


def _as_quantity(x: str) -> str:
    return f"(type({x}) == int ? quantity(string({x})) : quantity({x}))"


def _within_limits(r: Resources) -> bool:
    return all(parse_quantity(v) <= parse_quantity(r.limits[k]) for k, v in r.requests.items() if k in r.limits)


class Resources(Model):
    """Container resources passed through to the pods (minus GPUs: see gpusPerNode)."""

    rules = (Check(
        f"!has(self.requests) || !has(self.limits) || self.requests.all(k, !(k in self.limits) || "
        f"!{_is_quantity('self.requests[k]')} || !{_is_quantity('self.limits[k]')} || "
        f"!{_as_quantity('self.requests[k]')}.isGreaterThan({_as_quantity('self.limits[k]')}))",
        _within_limits, "resources.requests must not exceed resources.limits for the same resource",
        ".requests"),)

    requests: checked(dict[str, Quantity], QUALIFIED_KEYS) = Field(default_factory=dict, max_length=16)
    limits: checked(dict[str, Quantity], QUALIFIED_KEYS) = Field(default_factory=dict, max_length=16)


class SecretKeySelector(Model):
    name: str = Field(max_length=253, pattern=DNS_SUBDOMAIN, description="A Secret in the job's namespace.")
    key: str = Field(min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$")
    optional: bool | None = None


class EnvVarSource(Model):
    secret_key_ref: SecretKeySelector


class EnvVar(Model):
    """A literal `value`, or a Secret's key (`valueFrom.secretKeyRef`) for what must not sit
    in the RFTJob (HF_TOKEN, WANDB_API_KEY): the pod gets a reference, never the value."""

    rules = (Check("!(has(self.value) && has(self.valueFrom))",
                   lambda e: e.value is None or e.value_from is None,
                   "set value or valueFrom, not both", ".valueFrom"),)

    name: EnvName
    value: str | None = Field(default=None, max_length=32768)
    value_from: EnvVarSource | None = None


def _toleration_key(key: str) -> bool:
    return key == "" or is_qualified_name(key)


class Toleration(Model):
    """A pod toleration, with the consistency rules the API server applies to pods."""

    rules = (
        Check("!(self.?operator.orValue('Equal') == 'Exists' && self.?value.orValue('') != '')",
              lambda t: not (t.operator == "Exists" and t.value), "value must be empty when operator is Exists",
              ".value"),
        Check("self.?key.orValue('') != '' || self.?operator.orValue('Equal') == 'Exists'",
              lambda t: bool(t.key) or t.operator == "Exists",
              "operator must be Exists when key is empty (which tolerates every taint)", ".operator"),
        Check("!has(self.tolerationSeconds) || self.?effect.orValue('') == 'NoExecute'",
              lambda t: t.toleration_seconds is None or t.effect == "NoExecute",
              "tolerationSeconds needs effect NoExecute", ".tolerationSeconds"),
    )

    key: checked(str, Check("self == '' || !format.qualifiedName().validate(self).hasValue()", _toleration_key,
                            "must be a qualified name (a label key)")) | None = Field(default=None, max_length=316)
    operator: Literal["Exists", "Equal"] | None = None
    value: LabelValue | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


class SecurityContext(Model):
    """Explicit relaxations of the restricted default (non-root, no escalation, all
    capabilities dropped, RuntimeDefault seccomp, read-only root filesystem), for every
    container of the job's pods. Unset fields keep the default. Without `allowPrivileged`,
    relaxations stop at what the Pod Security baseline profile allows."""

    rules = (
        Check("!(self.?runAsNonRoot.orValue(false) && self.?runAsUser.orValue(-1) == 0)",
              lambda s: not (s.run_as_non_root and s.run_as_user == 0),
              "securityContext.runAsNonRoot: true contradicts runAsUser: 0 (the kubelet would "
              "refuse to start the container)", ".runAsNonRoot"),
        Check("self.?allowPrivileged.orValue(false) || self.?seccompProfile.orValue('') != 'Unconfined'",
              lambda s: s.allow_privileged or s.seccomp_profile != "Unconfined",
              "securityContext.seccompProfile Unconfined is beyond the Pod Security baseline "
              "profile: set securityContext.allowPrivileged: true to opt in", ".seccompProfile"),
        Check(f"self.?allowPrivileged.orValue(false) || !has(self.addCapabilities) || "
              f"self.addCapabilities.all(c, c in {list(BASELINE_CAPABILITIES)})",
              lambda s: s.allow_privileged or set(s.add_capabilities) <= set(BASELINE_CAPABILITIES),
              f"securityContext.addCapabilities beyond the Pod Security baseline list "
              f"({', '.join(BASELINE_CAPABILITIES)}) need securityContext.allowPrivileged: true",
              ".addCapabilities"),
    )

    run_as_user: int | None = Field(default=None, ge=0, le=MAX_ID)
    run_as_group: int | None = Field(default=None, ge=0, le=MAX_ID)
    fs_group: int | None = Field(default=None, ge=0, le=MAX_ID)
    run_as_non_root: bool | None = None
    allow_privilege_escalation: bool | None = None
    add_capabilities: unique_list(Capability) = Field(default_factory=list, max_length=16)
    seccomp_profile: Literal["RuntimeDefault", "Unconfined"] | None = None
    read_only_root_filesystem: bool = Field(
        default=True,
        description="Mount every container's root filesystem read-only. The pods write only to their "
                    "volumes, among them an emptyDir at /tmp that HOME points to unless trainer.env sets "
                    "it (caches of Hugging Face, torch, triton, pip). false for an image that must write "
                    "elsewhere.")
    allow_privileged: bool = Field(
        default=False,
        description="Opt in to relaxations beyond the Pod Security baseline profile (seccompProfile "
                    "Unconfined, capabilities outside baseline's list, model.cache.hostPath). The "
                    "namespace's Pod Security admission must allow them too.")


class ModelCacheSpec(Model):
    """Where trainer pods keep the downloaded base model (one download per node: local
    rank 0 fetches, the other ranks read the same directory). The default emptyDir lives
    as long as the pod; a hostPath or a PersistentVolumeClaim keeps the files across gang
    attempts on the same node (a file is reused only when its size and checksum match)."""

    rules = (Check("!(has(self.hostPath) && has(self.persistentVolumeClaim))",
                   lambda m: m.host_path is None or m.persistent_volume_claim is None,
                   "model.cache: set at most one of hostPath and persistentVolumeClaim"),)

    host_path: checked(
        str, matching(r"^/(.*[^/])?$", "must be an absolute directory path without a trailing '/'"),
        Check(r"!self.matches(r'/\.\.?(/|$)')", lambda p: not search_regex(r"/\.\.?(/|$)")(p),
              "must not contain '.' or '..' segments"),
        min_length=2, max_length=1024,
    ) | None = Field(default=None, description="A node directory (type DirectoryOrCreate). The Pod Security "
                     "baseline profile forbids hostPath volumes: needs trainer.securityContext.allowPrivileged.")
    persistent_volume_claim: str | None = Field(default=None, max_length=253, pattern=DNS_SUBDOMAIN,
                                                description="An existing PVC (ReadWriteMany for several nodes).")
    size_limit: Size | None = Field(default=None, description="sizeLimit of the default emptyDir.")
    download_timeout_seconds: int = Field(
        default=3600, ge=60, le=86400,
        description="How long the other ranks wait for local rank 0 to download the model.")


def _named_cel(modules: tuple[str, ...]) -> str:
    """Whether a LoRA target `t` names one of `modules` (`layout.picks_module(m, t)`), in CEL."""
    return " || ".join(f"t == '{m}' || t.endsWith('.{m}')" for m in modules)


class LoraSpec(OmitUnset):
    """Low-rank adapters (PEFT's LoRA) on the policy: the base weights stay frozen, only the
    adapters train. The trainer checks that the target modules exist in the model."""

    omit_unset = ("adapter_path",)

    rules = (Check(f"!has(self.targetModules) || !('{ALL_LINEAR}' in self.targetModules) || size(self.targetModules) == 1",
                   lambda s: ALL_LINEAR not in s.target_modules or len(s.target_modules) == 1,
                   f"spec.model.lora.targetModules: '{ALL_LINEAR}' stands alone (it names every linear layer)",
                   ".targetModules"),)

    rank: int = Field(ge=1, le=512, description="The adapters' rank (LoRA's r).")
    alpha: float | None = Field(default=None, gt=0, le=65536, description=(
        "LoRA's alpha: the adapters' output is scaled by alpha / rank. Default: rank (scale 1)."))
    dropout: float = Field(default=0.0, ge=0, lt=1, description="Dropout on the adapters' input while training.")
    target_modules: unique_list(Annotated[str, Field(min_length=1, max_length=128,
                                                     pattern=r"^([A-Za-z_][A-Za-z0-9_.]*|all-linear)$")]) = Field(
        default_factory=lambda: [ALL_LINEAR], min_length=1, max_length=64, description=(
            f"Module names to adapt (a name matches a module whose name ends with it, e.g. q_proj), or "
            f"'{ALL_LINEAR}': every linear layer except the output head."))
    adapter_path: ImagePath | None = Field(default=None, description=(
        "A LoRA adapter to start from (PEFT's saved format: adapter_config.json and "
        "adapter_model.safetensors): an s3:// URI or an absolute path inside the image. Its rank "
        "and target modules must be these; a new job's adapters start as it is, not as zero."))

class ModelSpec(OmitUnset):
    omit_unset = ("lora",)
    path: ImagePath = Field(description="HF-format model directory: an s3:// URI or an absolute path inside the image.")
    tokenizer_path: ImagePath | None = Field(default=None, description="Default: path.")
    # fp32 master weights by default: FSDP's MixedPrecisionPolicy already computes in
    # bf16, while an lr of 1e-6 applied to bf16 weights (8 mantissa bits) rounds to nothing.
    dtype: Literal["fp32", "bf16"] = Field(default="fp32", description="Master weights dtype.")
    cache: ModelCacheSpec = Field(default_factory=ModelCacheSpec)
    lora: LoraSpec | None = Field(default=None, description=(
        "Train LoRA adapters instead of every weight (immutable). Checkpoints hold the adapters "
        "and their optimizer state; each weight version is the adapter alone where the engine loads "
        f"adapters ({', '.join(LORA_ENGINES)}), else the base with the adapters merged."))


_ROLLOUT_RS = "algorithm.rolloutCorrection.rolloutRs"


class RolloutRejection(Model):
    """One of verl's rejection options with its bounds (verl's `rollout_rs: "token_k1,seq_max_k3"`
    with `rollout_rs_threshold: "0.5_2.0,0.01"` is two of them)."""

    rules = (Check("!has(self.thresholdLower) || self.name.endsWith('_k1')",
                   lambda r: r.threshold_lower is None or r.name.endswith("_k1"),
                   f"{_ROLLOUT_RS}: thresholdLower is for the k1 options only", ".thresholdLower"),
             Check("!has(self.thresholdLower) || self.thresholdLower < self.threshold",
                   lambda r: r.threshold_lower is None or r.threshold_lower < r.threshold,
                   f"{_ROLLOUT_RS}: thresholdLower must be below threshold", ".thresholdLower"),
             Check("!self.name.endsWith('_k1') || has(self.thresholdLower) || self.threshold > 1.0",
                   lambda r: not r.name.endswith("_k1") or r.threshold_lower is not None or r.threshold > 1,
                   f"{_ROLLOUT_RS}: a k1 threshold of 1 or less needs thresholdLower (its default, "
                   "1 / threshold, would reject every token)", ".threshold"))

    name: Literal[ROLLOUT_RS_OPTIONS] = Field(description=(
        "token_kN: per token; seq_sum_kN, seq_mean_kN, seq_max_kN: over the sequence's response tokens, "
        "the decision for all of them. k1 = log(pi_rollout / pi_old), kept within "
        "[log thresholdLower, log threshold]; k2 = half the squared log-ratio and k3 = exp(r) - 1 - r, "
        "kept at or below threshold."))
    threshold: float = Field(gt=0, description="Upper bound (k1: of the ratio; k2, k3: of the statistic).")
    threshold_lower: float | None = Field(default=None, gt=0, description="k1 only; default 1 / threshold.")


class RolloutCorrectionSpec(OmitUnset):
    """verl's rollout correction (`algorithm.rollout_correction`, decoupled mode) between the
    trainer's log-probs before the update and the engine's that sampled each response."""

    omit_unset = ("rollout_is",)
    rollout_is: Literal[ROLLOUT_IS_LEVELS] | None = Field(default=None, description=(
        "Truncated importance sampling: each token's policy loss times min(pi_old / pi_rollout, "
        "rolloutIsThreshold), the ratio of the token (token) or of the whole response (sequence). "
        "Unset: no weights."))
    rollout_is_threshold: float = Field(default=2.0, gt=0, description="The weights' upper bound.")
    rollout_is_batch_normalize: bool = Field(default=False, description="Divide the weights by their batch mean.")
    rollout_rs: unique_list(RolloutRejection, "name") = Field(default_factory=list, max_length=len(ROLLOUT_RS_OPTIONS),
                                                            description=(
        "Rejection sampling: response tokens (or whole responses) outside any option's bounds leave the loss."))


class AlgorithmSpec(OmitUnset):
    omit_unset = ("rollout_correction",)
    rules = (Check(
        "!has(self.miniBatchSize) || !has(self.microBatchSize) || self.miniBatchSize >= self.microBatchSize",
        None, "algorithm.microBatchSize must not exceed algorithm.miniBatchSize"),)  # config.py says it in Python

    name: Literal[ALGORITHM_NAMES] = Field(  # the catalogue's (algorithms.py)
        description="; ".join(f"{p.name}: {p.summary}" for p in ALGORITHMS.values()) + ".")
    learning_rate: float = Field(default=1e-6, gt=0, le=1)
    critic_learning_rate: float = Field(default=1e-5, gt=0, le=1)
    kl_coef: float = Field(default=0.001, ge=0)
    kl_estimator: Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"] = Field(
        default="low_var_kl",
        description="verl's names: kl (= k1), abs, mse (= k2), low_var_kl (= k3).",
    )
    clip_ratio: float = Field(default=0.2, gt=0, lt=1, description="PPO clip range, both sides.")
    clip_ratio_low: float | None = Field(
        default=None, gt=0, lt=1, description="Lower clip range (1 - low); default clipRatio.")
    clip_ratio_high: float | None = Field(
        default=None, gt=0, lt=10,
        description="Upper clip range (1 + high); default clipRatio. DAPO's clip-higher sets it above clipRatioLow.")
    dual_clip_ratio: float | None = Field(
        default=3.0, gt=1,
        description="Dual clip c (verl's clip_ratio_c): caps the loss of negative-advantage tokens at "
                    "-A * c. null disables it.",
        json_schema_extra={"nullable": True},
    )
    entropy_coef: float = Field(default=0.0, ge=0)
    epochs: int = Field(default=1, ge=1, le=100)
    mini_batch_size: int | None = Field(default=None, ge=1, le=1_000_000)
    micro_batch_size: int = Field(default=1, ge=1, le=1_000_000)
    grad_clip: float = Field(default=1.0, gt=0)
    loss_aggregation: Literal[LOSS_AGGREGATIONS] = "token-mean"
    gamma: float = Field(default=1.0, ge=0, le=1)
    lam: float = Field(default=1.0, ge=0, le=1)
    norm_adv_by_std: bool = True
    cliprange_value: float = Field(default=0.5, gt=0, description="PPO value clip.")
    use_kl_loss: bool = Field(
        default=True,
        description="KL as a loss term (GRPO style) rather than folded into the reward (classic PPO).",
    )
    rollout_correction: RolloutCorrectionSpec | None = Field(default=None, description=(
        "Correct for the gap between the engine that sampled and the trainer's policy (verl's rollout "
        "correction): importance weights, rejection, and the rollout_corr/ metrics. Unset: the metrics "
        "are still reported, nothing is corrected."))


Beta = Annotated[float, Field(ge=0, lt=1)]


class OptimizerSpec(Model):
    """AdamW and its learning-rate schedule (for the actor and the critic alike)."""

    betas: tuple[Beta, Beta] = Field(default=(0.9, 0.999), strict=False)
    weight_decay: float = Field(default=0.01, ge=0)
    weight_decay_all: bool = Field(
        default=False,
        description="Decay every parameter (verl's and torchtitan's AdamW). Default: no weight decay on "
                    "biases and normalisation weights (HF Trainer's and OpenRLHF's convention).")
    warmup_steps: int = Field(default=0, ge=0, description="Linear warmup from 0.")
    lr_schedule: Literal["constant", "cosine"] = "constant"
    min_lr_ratio: float = Field(
        default=0.0, ge=0, le=1,
        description="cosine: the rate decays to learningRate * minLrRatio at totalSteps.",
    )


class ReportingSpec(Model):
    log_every: int = Field(default=1, ge=1, description="Print a metrics line every N steps.")


class FSDPSpec(Model):
    reshard_after_forward: bool = True
    activation_checkpointing: bool = False
    cpu_offload: bool = False
    mixed_precision: Literal["bf16", "fp32"] = "bf16"


class TrainerSpec(Model):
    rules = (
        immutable("nodes", "trainer.nodes"),
        immutable("gpusPerNode", "trainer.gpusPerNode"),
        *no_gpu_resources("trainer", "gpusPerNode"),
    )

    image: Image | None = admission_required()
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = None
    nodes: int = Field(default=1, ge=1, le=1024)
    gpus_per_node: int = Field(default=1, ge=0, le=16)
    total_steps: int = Field(ge=1, le=100_000_000)
    batch_size: int = Field(ge=1, le=1_000_000)
    seed: int = Field(default=0, ge=0, le=2**32 - 1)
    resources: Resources = Field(default_factory=Resources)
    fsdp: FSDPSpec = Field(default_factory=FSDPSpec)
    env: unique_list(EnvVar, "name") = Field(default_factory=list, max_length=64)
    master_port: int = Field(default=29500, ge=1024, le=65535)
    shm_size: ShmSize = Field(default="1Gi", description="/dev/shm of each trainer pod (a memory-backed emptyDir, "
                                                         "NCCL's shared memory); \"0\" for none")
    termination_grace_period_seconds: int = Field(default=300, ge=0, le=86400)
    node_selector: checked(dict[str, LabelValue], QUALIFIED_KEYS) = Field(default_factory=dict, max_length=32)
    tolerations: list[Toleration] = Field(default_factory=list, max_length=32)
    priority_class_name: str | None = Field(default=None, max_length=253, pattern=DNS_SUBDOMAIN)
    scheduler_name: str | None = Field(default=None, max_length=253, pattern=DNS_SUBDOMAIN)
    security_context: SecurityContext = Field(default_factory=SecurityContext)


class CheckpointSpec(Model):
    rules = (
        *(on_field(c, "endpoint", "endpoint", "checkpoint.endpoint") for c in ENDPOINT_CHECKS),
        immutable("endpoint", "spec.checkpoint.endpoint", "resume needs the same storage"),
    )

    uri: S3Uri
    interval: int = Field(default=100, ge=1, le=100_000_000)
    keep: int = Field(default=3, ge=1, le=1000)
    credentials_secret: str | None = Field(
        default=None,
        max_length=253,
        pattern=DNS_SUBDOMAIN,
        description="Secret with AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (optional AWS_SESSION_TOKEN).",
    )
    endpoint: str | None = Field(
        default=None, max_length=1024,
        description="S3-compatible endpoint URL, e.g. http://minio.storage:9000. Empty means AWS. "
                    "No credentials in it: use credentialsSecret.",
    )
    region: str | None = Field(default=None, max_length=32, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    staging_size_limit: Size | None = Field(
        default=None,
        description=(
            "sizeLimit of the emptyDir a resuming trainer pod downloads the checkpoint into "
            "(one copy per node, read by every rank there). Unset: no limit. Size it above "
            "the largest checkpoint (model + optimizer state), plus on rank 0's pod one weights "
            "export in sync.dtype while sync.fastPath is on (its files are served from there)."),
    )


class FailurePolicy(Model):
    rules = (Check(
        "!has(self.fatalExitCodes) || !has(self.retryableExitCodes) || "
        "self.fatalExitCodes.all(c, !(c in self.retryableExitCodes))",
        None,  # admission only: failure_policy.classify_exit_code still lets fatal win if both list a code
        "failurePolicy.fatalExitCodes and failurePolicy.retryableExitCodes must not overlap"),)

    max_restarts: int = Field(default=3, ge=0, le=10_000)
    backoff_seconds: int = Field(default=10, ge=0, le=3600)
    fatal_exit_codes: unique_list(ExitCode) = Field(
        default_factory=lambda: [78],
        max_length=64,
        description="Exit codes (1-255) that fail the job at once. Default [78] (EX_CONFIG).",
    )
    retryable_exit_codes: unique_list(ExitCode) | None = Field(
        default=None,
        max_length=64,
        description="If set, only these exit codes (1-255) restart the gang; any other fails the job.",
    )
    progress_deadline_seconds: int = Field(
        default=1800, ge=0, le=7 * 86400,
        description=(
            "Restart the gang (counting against maxRestarts) when status.trainer.step has not "
            "moved for this long while the job runs; the Progressing condition says why. "
            "0 turns the deadline off. Set it a few minutes above the slowest expected step "
            "(the first step includes the model download)."),
    )


_OWN_IMAGE = tuple(n for n in ENGINE_NAMES if n not in TRAINER_IMAGE_ENGINES)


def _listed(words: tuple[str, ...]) -> str:
    """'a', 'a and b', 'a, b and c'."""
    return " and ".join(filter(None, (", ".join(words[:-1]), words[-1])))


class InferenceSpec(Model):
    rules = (
        Check(f"!has(self.engine) || self.engine in {list(TRAINER_IMAGE_ENGINES)} || has(self.image)",
              lambda i: i.engine in TRAINER_IMAGE_ENGINES or i.image is not None,
              f"spec.inference.image is required for the {_listed(_OWN_IMAGE)} engines "
              f"(the {_listed(TRAINER_IMAGE_ENGINES)} engine runs in the trainer image)", ".image"),
        Check(f"!has(self.env) || !self.env.exists(e, e.name in {list(ENGINE_ENV)})",
              lambda i: not any(e.name in ENGINE_ENV for e in i.env),
              f"spec.inference.env must not set {', '.join(ENGINE_ENV)}: the operator sets them for the "
              "engine's helpers and weight-update routes", ".env"),
        *no_gpu_resources("inference", "gpusPerReplica"),
    )

    replicas: int = Field(default=1, ge=0, le=1024)
    image: Image | None = Field(
        default=None, description="Engine image; default: spec.trainer.image (reference engine only).")
    engine: Literal[ENGINE_NAMES] = Field(  # the catalogue's (engines.py)
        default="reference", description="; ".join(
            f"{p.name}: {'its own image' if p.own_image else 'the trainer image'}, readiness {p.readiness_path}"
            for p in ENGINES.values()) + ".")
    gpus_per_replica: int = Field(default=1, ge=0, le=16)
    port: int = Field(default=8000, ge=1024, le=65535)
    resources: Resources = Field(default_factory=Resources)
    shm_size: ShmSize = Field(
        default="1Gi", description="/dev/shm of the vLLM and SGLang engines (a memory-backed emptyDir): their "
                                   "processes exchange requests and weights through it; \"0\" for none.")
    args: list[Annotated[str, Field(max_length=4096)]] = Field(
        default_factory=list, max_length=64,
        description="Extra engine arguments, after the operator's (vLLM: --dtype, --max-model-len, "
                    "--gpu-memory-utilization, ...; a repeated flag overrides the operator's).")
    env: unique_list(EnvVar, "name") = Field(
        default_factory=list, max_length=64,
        description="Environment of the engine container (e.g. VLLM_CPU_KVCACHE_SPACE); secrets by secretKeyRef.")


class SamplingSpec(Model):
    temperature: float = Field(default=1.0, ge=0, le=10)
    top_p: float = Field(default=1.0, gt=0, le=1)
    max_tokens: int = Field(default=256, ge=1, le=1_000_000)


class ExplorerSpec(Model):
    replicas: int = Field(default=1, ge=0, le=1024)
    image: Image | None = None
    taskset_uri: S3Uri
    rollouts_per_task: int = Field(default=8, ge=1, le=1024)
    sampling: SamplingSpec = Field(default_factory=SamplingSpec)
    reward: Reward = Field(default="math_accuracy", description=(
        f"A built-in ({', '.join(BUILTIN_REWARDS)}) or 'package.module:function' importable in the explorer image."))
    prompt_format: Literal["chat", "raw"] | None = Field(
        default=None,
        description="chat: the task goes through the tokenizer's chat template as a user message; "
                    "raw: the task text is the prompt. Default chat when the tokenizer has a template.",
    )
    tasks_per_shard: int | None = Field(
        default=None, ge=1, le=1_000_000,
        description="Tasks per experience shard; default max(1, batchSize / rolloutsPerTask).")
    request_timeout: float = Field(default=300.0, gt=0, le=86400, description="Seconds per inference request.")
    concurrency: int | None = Field(
        default=None, ge=1, le=4096, description="Requests in flight; default one per inference replica.")
    max_n: int = Field(default=64, ge=1, le=1024,
                       description="Rollouts per request (the reference server caps n at 64).")
    poll_interval: float = Field(default=5.0, gt=0, le=3600, description="Seconds between trainer-progress checks.")


class EvaluationSpec(Model):
    """Held-out evaluation: trainer rank 0 scores exported versions on a taskset through the
    inference pods (the same engines the explorers use), every `interval` steps."""

    rules = (
        Check("self.?samplesPerTask.orValue(1) == 1 || self.?temperature.orValue(0.0) > 0.0",
              lambda s: s.samples_per_task == 1 or s.temperature > 0,
              "evaluation.samplesPerTask > 1 needs evaluation.temperature > 0: greedy samples of a task are "
              "all the same", ".samplesPerTask"),
        Check("!has(self.passAtK) || self.passAtK.all(k, k <= self.?samplesPerTask.orValue(1))",
              lambda s: all(k <= s.samples_per_task for k in s.pass_at_k),
              "evaluation.passAtK: each k must be at most evaluation.samplesPerTask (pass@k needs k samples "
              "of each task)", ".passAtK"),
    )

    taskset_uri: S3Uri = Field(description=(
        "The held-out tasks: JSONL, one {\"prompt\", \"answer\"} per line, as explorer.tasksetUri."))
    interval: int = Field(default=1, ge=1, le=100_000_000, description=(
        "Evaluate an exported version at least this many trainer steps after the last one evaluated; "
        "the base model (version 0) and the final version are always evaluated."))
    samples_per_task: int = Field(default=1, ge=1, le=64, description="Completions of each task.")
    temperature: float = Field(default=0.0, ge=0, le=10, description="0: greedy (the default).")
    top_p: float = Field(default=1.0, gt=0, le=1)
    max_tokens: int | None = Field(default=None, ge=1, le=1_000_000,
                                   description="Default explorer.sampling.maxTokens.")
    seed: int = Field(default=0, ge=0, le=2**31 - 1, description=(
        "Sampling seed: each version draws the same random numbers, so sampled scores of two versions "
        "differ by the models, not by luck."))
    pass_at_k: list[Annotated[int, Field(ge=1, le=64)]] = Field(
        default_factory=list, max_length=8, description=(
            "pass@k for each k (Chen et al.'s unbiased estimate; a sample passes with reward >= 1), besides "
            "accuracy, the mean reward."))
    reward: Reward | None = Field(default=None, description="Default explorer.reward.")
    timeout_seconds: float = Field(default=600.0, gt=0, le=86400, description=(
        "How long one evaluation may take (its requests and the wait for a replica to serve the "
        "version); a version not evaluated by then is skipped. Also how long the trainer waits at the "
        "end for the final version's score."))


class BufferSpec(OmitUnset):
    omit_unset = ("stale_samples",)
    # S3 is an admission rule (S3Uri): a local trainer run (a hand-written config) may
    # read a directory.
    uri: S3Uri | None = Field(default=None, description="Experience buffer; default <checkpoint.uri>/buffer.")
    max_staleness: int = Field(default=1, ge=0, le=1000, description=(
        "Versions a sample may lag the trainer's policy. Explorers pause (they never discard "
        "finished work) while they hold their share of maxStaleness + 1 batches the trainer has "
        "not consumed; samples that still arrive staler (a weight sync that lags) go by staleSamples."))
    stale_samples: Literal[STALE_SAMPLES] | None = Field(default=None, description=(
        "Samples staler than maxStaleness: drop (the default; skipped, counted in status.trainer.buffer.droppedStale) "
        "or keep (trained, corrected by spec.algorithm.rolloutCorrection, which must set rolloutIs or "
        "rolloutRs). Either way rft_trainer_samples_total{lag,outcome} counts them by version lag."))
    wait: bool | None = Field(
        default=None,
        description="Wait for explorers when the buffer runs dry; default: iff spec.explorer is set.")
    poll_seconds: float = Field(
        default=2.0, gt=0, le=60,
        description="Seconds between buffer listings while waiting (the other ranks wait in a "
                    "collective meanwhile, so it stays well under the process group's timeout).")


# sync.pinnedVersion: an exported version, or the best one spec.evaluation scored.
PIN_BEST = "best"
_PIN_CHECK = Check(f"type(self) == int ? self >= 0 : self == '{PIN_BEST}'",
                   lambda v: v >= 0 if isinstance(v, int) else v == PIN_BEST,
                   f"must be an exported version (an integer, 0 = the base model) or {PIN_BEST}")
PinnedVersion = Annotated[int | str, Field(json_schema_extra={"maxLength": 8, "rules": cel_rules((_PIN_CHECK,))}),
                          AfterValidator(lambda v: run_checks((_PIN_CHECK,), v))]


class SyncSpec(Model):
    interval: int = Field(default=1, ge=1, le=100_000_000, description="Export weights every N trainer steps.")
    pinned_version: PinnedVersion | None = Field(
        default=None,
        description=f"Serve this exported version (0 = the base model) instead of the newest; {PIN_BEST}: the "
                    "version spec.evaluation scored best (status.trainer.evaluation.best), followed as it changes.",
    )
    keep: int = Field(default=5, ge=1, le=1000, description="Exported versions kept in S3 "
                      "(a pinned version is kept in addition).")
    dtype: Literal["bf16", "fp16", "fp32"] = Field(
        default="bf16", description="dtype of the exported weights; vLLM and SGLang serve in it unless "
                                    "inference.args say otherwise.")
    probe_tolerance: float | None = Field(
        default=None, ge=0, le=100,
        description="Mean |served - trained| log-prob per probe token that still counts as the exported "
                    "weights after a reload; default by sync.dtype (fp32 0.002, fp16 0.1, bf16 0.25).")
    fast_path: bool = Field(
        default=True,
        description="Trainer rank 0 serves each exported version to the first replica (its `weights` port: "
                    "8471 unless the pod uses it) while it uploads it to S3, so replicas load it without waiting for the "
                    "upload; every file is still checked against the export's manifest. false: replicas "
                    "read each version from S3 once it is committed (a NetworkPolicy that keeps inference "
                    "pods from reaching trainer pods).")
    transport: Literal["files", "nccl"] = Field(
        default="files",
        description="How each version reaches the engines. files: the version's files, from the trainer "
                    "(fastPath) or S3, then the engine reloads them from disk. nccl: vLLM on GPUs takes the "
                    "weights from trainer rank 0's GPU over NCCL (vLLM's weight-transfer API; the engine is "
                    "started with its NCCL backend), checked against the export's fingerprint before it "
                    "serves; the files still follow, for restarts and going back. Needs inference.engine "
                    "vllm, GPUs on both sides and sync.fastPath.")


# The MLflow server's URL: the checkpoint endpoint's rules, with the Secret to name instead.
_TRACKING_URI_CHECKS = (
    ENDPOINT_CHECKS[0]._replace(message="must not carry credentials (user:password@host): put them in "
                                        "the Secret named by tracking.mlflow.credentialsSecret"),
    *ENDPOINT_CHECKS[1:],
)
# W&B refuses these characters in project and entity names.
WandbName = checked(str, matching(r"^[^/\\#?%:]+$", "must not contain any of / \\ # ? % :"),
                    min_length=1, max_length=128)


class TensorBoardSpec(Model):
    uri: S3Uri | None = Field(
        default=None, description="Where the event files go, one run per gang attempt (attempt-NNN/); "
                                  "default <checkpoint.uri>/tensorboard.")


class MLflowSpec(Model):
    """An MLflow tracking server. One run per job: a resumed attempt continues it (its id is
    kept in <checkpoint.uri>/tracking/mlflow-run.json)."""

    rules = tuple(on_field(c, "trackingUri", "tracking_uri", "tracking.mlflow.trackingUri")
                  for c in _TRACKING_URI_CHECKS)

    tracking_uri: str = Field(max_length=1024, description="http(s) URL of the MLflow tracking server.")
    experiment: str = Field(min_length=1, max_length=256, description="Experiment name; created if missing.")
    credentials_secret: str | None = Field(
        default=None, max_length=253, pattern=DNS_SUBDOMAIN,
        description="Secret with MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD, or "
                    "MLFLOW_TRACKING_TOKEN; each key present becomes that variable in the trainer pods.")


class WandbSpec(Model):
    project: WandbName
    entity: WandbName | None = None
    mode: Literal["online", "offline"] = Field(
        default="online", description="offline: files only, uploaded to <checkpoint.uri>/tracking/wandb/ "
                                      "for `wandb sync`.")
    api_key_secret: str | None = Field(
        default=None, max_length=253, pattern=DNS_SUBDOMAIN,
        description="Secret with WANDB_API_KEY, given to the trainer pods (online mode).")


class TrackingSpec(OmitUnset):
    """Experiment trackers that rank 0 of the trainer sends each step's metrics to. A tracker
    that is down never stops training: status.trainer.tracking says how each one fares."""

    omit_unset = ("rollout_samples",)
    non_tracker_fields: ClassVar[tuple[str, ...]] = ("rollout_samples",)
    tensorboard: TensorBoardSpec | None = None
    mlflow: MLflowSpec | None = None
    wandb: WandbSpec | None = None
    rollout_samples: int | None = Field(default=None, ge=0, le=64, description=(
        "Rollouts of each step's batch shown in every tracker (step, version, lag, reward, task, prompt, "
        f"response; texts scrubbed of credentials and cut at {MAX_SAMPLE_CHARS} characters): a W&B table, "
        f"an MLflow table artifact, TensorBoard text. Default {DEFAULT_ROLLOUT_SAMPLES}; 0: none."))


# The trainer's batch layout (rft_trainer.engine.check_batch_layout) in CEL, with the
# pod's world size: ranks = nodes * max(1, gpusPerNode). Each rule holds when the one
# before it fails, so a bad layout gets one message, with its numbers.
_RANKS = ("(self.trainer.?nodes.orValue(1) * (self.trainer.?gpusPerNode.orValue(1) > 1 ? "
          "self.trainer.?gpusPerNode.orValue(1) : 1))")
_BATCH, _MICRO = "self.trainer.?batchSize.orValue(0)", "self.algorithm.?microBatchSize.orValue(1)"
_MINI = f"self.algorithm.?miniBatchSize.orValue({_BATCH})"
# Out-of-range numbers are the schema's to report: no division by zero here.
_SANE = f"({_RANKS} >= 1 && {_BATCH} >= 1 && {_MINI} >= 1 && {_MICRO} >= 1)"
_RANKS_OK = f"(!{_SANE} || {_BATCH} % {_RANKS} == 0)"
_MINI_OK = f"(!{_SANE} || ({_BATCH} % {_MINI} == 0 && {_MINI} % {_RANKS} == 0))"
BATCH_LAYOUT = (
    Check(_RANKS_OK, None, "trainer.batchSize must be divisible by the number of ranks, "
          "trainer.nodes * max(1, trainer.gpusPerNode)", ".trainer.batchSize",
          "'trainer.batchSize (%d) must be divisible by the number of ranks, "
          f"trainer.nodes * max(1, trainer.gpusPerNode) = %d'.format([{_BATCH}, {_RANKS}])"),
    Check(f"!{_RANKS_OK} || {_MINI_OK}", None,
          "algorithm.miniBatchSize (default trainer.batchSize) must divide trainer.batchSize and be "
          "divisible by the number of ranks", ".algorithm.miniBatchSize",
          "'algorithm.miniBatchSize (%d) must divide trainer.batchSize (%d) and be divisible by the "
          f"number of ranks (%d)'.format([{_MINI}, {_BATCH}, {_RANKS}])"),
    Check(f"!{_SANE} || !{_RANKS_OK} || !{_MINI_OK} || ({_MINI} / {_RANKS}) % {_MICRO} == 0", None,
          "algorithm.microBatchSize must divide the per-rank mini-batch, algorithm.miniBatchSize / ranks",
          ".algorithm.microBatchSize",
          "'algorithm.microBatchSize (%d) must divide the per-rank mini-batch, algorithm.miniBatchSize "
          f"/ ranks = %d'.format([{_MICRO}, {_MINI} / {_RANKS}])"),
)


class RFTJobSpec(OmitUnset):
    omit_unset = ("tracking", "evaluation")
    rules = (
        # What the checkpoints were trained from; the cache settings may change.
        immutable("model.path", "spec.model.path"),
        immutable("model.tokenizerPath", "spec.model.tokenizerPath"),
        immutable("model.dtype", "spec.model.dtype"),
        immutable("model.lora", "spec.model.lora", "the checkpoints hold these adapters; create a new RFTJob"),
        immutable("algorithm.name", "spec.algorithm.name"),
        immutable("checkpoint.uri", "spec.checkpoint.uri", "resume needs the same location"),
        immutable("buffer.uri", "spec.buffer.uri", "resume needs the same buffer"),
        *BATCH_LAYOUT,
        Check("!has(self.explorer) || has(self.inference)",
              lambda s: s.explorer is None or s.inference is not None,
              "spec.explorer needs spec.inference: explorers generate rollouts against the inference pods",
              ".explorer"),
        Check("!has(self.explorer) || !has(self.inference) || self.explorer.?replicas.orValue(1) == 0 || "
              "self.inference.?replicas.orValue(1) >= 1",
              lambda s: s.explorer is None or s.inference is None or s.explorer.replicas == 0 or s.inference.replicas >= 1,
              "spec.explorer.replicas >= 1 needs spec.inference.replicas >= 1: explorers generate "
              "rollouts against the inference pods", ".inference.replicas"),
        Check(f"!(self.algorithm.name in {list(GROUP_ALGORITHMS)}) || !has(self.explorer) || "
              "self.explorer.?rolloutsPerTask.orValue(8) >= 2",
              lambda s: s.algorithm.name not in GROUP_ALGORITHMS or s.explorer is None or s.explorer.rollouts_per_task >= 2,
              f"{'/'.join(GROUP_ALGORITHMS)} needs spec.explorer.rolloutsPerTask >= 2: its advantage, reward "
              "minus the mean of the task's group, is zero for groups of one", ".explorer.rolloutsPerTask"),
        Check("self.?sync.?transport.orValue('files') != 'nccl' || (has(self.inference) && "
              f"self.inference.?engine.orValue('reference') in {list(NCCL_ENGINES)} && "
              "self.sync.?fastPath.orValue(true))",
              lambda s: s.sync.transport != "nccl" or (s.inference is not None and s.inference.engine in NCCL_ENGINES
                                                       and s.sync.fast_path),
              f"spec.sync.transport nccl needs spec.inference.engine {' or '.join(NCCL_ENGINES)} and "
              "spec.sync.fastPath true: trainer rank 0 sends each version to the engine's NCCL "
              "weight-transfer backend from its weights server", ".sync.transport"),
        Check("!has(self.model.lora) || self.?sync.?transport.orValue('files') != 'nccl' || !has(self.inference) || "
              f"!(self.inference.?engine.orValue('reference') in {list(LORA_ENGINES)})",
              lambda s: s.model.lora is None or s.sync.transport != "nccl" or s.inference is None
              or s.inference.engine not in LORA_ENGINES,
              "spec.sync.transport nccl with spec.model.lora: each version is the adapter alone (megabytes), "
              "which the engine loads from its files; NCCL carries whole models. Use transport files",
              ".sync.transport"),
        Check("!has(self.model.lora) || !has(self.model.lora.adapterPath) || !has(self.inference) || "
              f"self.inference.?engine.orValue('reference') in {list(LORA_ENGINES)}",
              lambda s: s.model.lora is None or s.model.lora.adapter_path is None or s.inference is None
              or s.inference.engine in LORA_ENGINES,
              f"spec.model.lora.adapterPath needs spec.inference.engine {' or '.join(LORA_ENGINES)}: the "
              "inference pods serve version 0 as the base with that adapter, which only an engine that "
              "loads adapters can", ".model.lora.adapterPath"),
        *(Check("!has(self.model.lora) || !has(self.model.lora.targetModules) || !has(self.inference) || "
                f"self.inference.?engine.orValue('reference') != '{engine}' || "
                f"!self.model.lora.targetModules.exists(t, {_named_cel(modules)})",
                lambda s, engine=engine, modules=modules: s.model.lora is None or s.inference is None
                or s.inference.engine != engine or not any(picks_module(m, t) for t in s.model.lora.target_modules for m in modules),
                f"spec.model.lora.targetModules: engine {engine} does not load adapters on {', '.join(modules)} "
                "(it would refuse every version); leave it out, or use engine reference",
                ".model.lora.targetModules")
          for engine, modules in LORA_UNSERVED.items()),
        Check("self.?buffer.?staleSamples.orValue('drop') != 'keep' || "
              "(has(self.algorithm.rolloutCorrection) && (has(self.algorithm.rolloutCorrection.rolloutIs) || "
              "self.algorithm.rolloutCorrection.?rolloutRs.orValue([]).size() > 0))",
              lambda s: s.buffer.stale_samples != KEEP or (
                  s.algorithm.rollout_correction is not None
                  and (s.algorithm.rollout_correction.rollout_is is not None
                       or bool(s.algorithm.rollout_correction.rollout_rs))),
              "spec.buffer.staleSamples keep needs spec.algorithm.rolloutCorrection with rolloutIs or rolloutRs: "
              "a stale sample was drawn from an older policy, and trained as if from the current one it "
              "biases the update", ".buffer.staleSamples"),
        Check("!has(self.evaluation) || (has(self.inference) && has(self.explorer))",
              lambda s: s.evaluation is None or (s.inference is not None and s.explorer is not None),
              "spec.evaluation needs spec.inference and spec.explorer: versions are scored through the "
              "inference pods, with the explorer's prompts and reward", ".evaluation"),
        Check(f"!has(self.sync) || !has(self.sync.pinnedVersion) || type(self.sync.pinnedVersion) == int || "
              "has(self.evaluation)",
              lambda s: s.sync.pinned_version != PIN_BEST or s.evaluation is not None,
              f"spec.sync.pinnedVersion {PIN_BEST} needs spec.evaluation: the best version is the one it scored "
              "best", ".sync.pinnedVersion"),
        Check("!has(self.model.cache) || !has(self.model.cache.hostPath) || "
              "self.trainer.?securityContext.?allowPrivileged.orValue(false)",
              lambda s: s.model.cache.host_path is None or s.trainer.security_context.allow_privileged,
              "spec.model.cache.hostPath needs spec.trainer.securityContext.allowPrivileged: true "
              "(the Pod Security baseline profile forbids hostPath volumes)", ".model.cache.hostPath"),
    )

    suspend: bool = False
    model: ModelSpec
    algorithm: AlgorithmSpec
    trainer: TrainerSpec
    checkpoint: CheckpointSpec
    failure_policy: FailurePolicy = Field(default_factory=FailurePolicy)
    inference: InferenceSpec | None = None
    explorer: ExplorerSpec | None = None
    buffer: BufferSpec = Field(default_factory=BufferSpec)
    sync: SyncSpec = Field(default_factory=SyncSpec)
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec)
    reporting: ReportingSpec = Field(default_factory=ReportingSpec)
    tracking: TrackingSpec | None = None
    evaluation: EvaluationSpec | None = None
    service_account_annotations: checked(
        dict[str, Annotated[str, Field(max_length=4096)]], QUALIFIED_KEYS,
    ) = Field(default_factory=dict, max_length=16, description=(
        "Annotations on the ServiceAccounts the operator creates for the job's pods, e.g. "
        "eks.amazonaws.com/role-arn for IRSA or iam.gke.io/gcp-service-account."))


# Validations on the whole object (only metadata.name/generateName are visible to CEL).
ROOT_RULES = [
    cel(
        f"self.metadata.name.size() <= {MAX_NAME_LENGTH}",
        f"metadata.name must be at most {MAX_NAME_LENGTH} characters: child pod names "
        "<name>-trainer-<attempt>-<rank> must stay valid DNS labels",
    ),
    cel(
        f"self.metadata.name.matches('{DNS_LABEL}')",
        "metadata.name must start with a letter and contain only lowercase letters, digits "
        "and '-' (it names the headless Service and pod hostnames)",
    ),
]


def missing_admission_fields(model: BaseModel, where: str = "spec") -> list[str]:
    """Dotted paths of `admission_required` fields left unset (the API server refuses
    those; a spec parsed outside admission, say in a test, is checked here)."""
    out = []
    for name, info in type(model).model_fields.items():
        value = getattr(model, name)
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        if extra.get(ADMISSION_REQUIRED) and value is None:
            out.append(f"{where}.{info.alias or name}")
        elif isinstance(value, BaseModel):
            out += missing_admission_fields(value, f"{where}.{info.alias or name}")
    return out


def parse_spec(spec: dict[str, Any]) -> RFTJobSpec:
    """Parse a stored spec (camelCase), applying defaults. Raises ValueError naming the
    bad field, in the same words every pod uses for its config."""
    try:
        parsed = RFTJobSpec.model_validate(spec)
    except ValidationError as e:
        raise ValueError(describe(e, RFTJobSpec, "spec")) from None
    if missing := missing_admission_fields(parsed):
        raise ValueError(f"{missing[0]}: required key is missing")
    return parsed
