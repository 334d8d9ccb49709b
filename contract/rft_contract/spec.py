"""The RFTJob spec: these pydantic models are the single source of truth.

`crds/rftjob.yaml` is generated from them (`rft_operator.crdgen`), the operator parses the
stored spec with them, and every pod validates the job config it mounts with the same
models (`rft_contract.config`), so a typo gives the same message everywhere. Two kinds
of rule live here:

* Field constraints (`ge`, `le`, `pattern`, `Literal`) become OpenAPI schema checks, and
  `rules=[...]` in `json_schema_extra` becomes CEL `x-kubernetes-validations`, so the API
  server refuses a bad spec at admission with a message naming the field.
* Defaults live only in these models, never in the CRD schema: a schema default would be
  written back into the stored object and GitOps tools (Argo CD, Flux) would see drift.
  The operator parses the stored spec with `RFTJobSpec.model_validate`, which applies them.

Knobs only the trainer or the explorer reads (optimizer, seed, buffer polling, explorer
concurrency, ...) live here too: a component cannot accept a setting the RFTJob cannot
carry. A few fields the RFTJob requires are optional in Python (`admission_required`):
the CRD lists them as required, while a config written by hand for a local trainer run
may leave them out.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel

from .errors import describe

# Child names are `<job>-trainer-<attempt>-<rank>`; they double as pod hostnames, which
# must be DNS labels (<= 63 chars). 40 leaves room for the suffixes.
MAX_NAME_LENGTH = 40
DNS_LABEL = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
S3_URI = r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/.*)?$"
K8S_NAME = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"


def cel(rule: str, message: str, field_path: str | None = None) -> dict[str, str]:
    """One CEL validation rule (`x-kubernetes-validations` entry)."""
    out = {"rule": rule, "message": message}
    if field_path:
        out["fieldPath"] = field_path
    return out


def immutable(field: str, path: str) -> dict[str, str]:
    """A transition rule that forbids changing, adding or removing an optional field."""
    return cel(
        f"has(self.{field}) == has(oldSelf.{field}) && (!has(self.{field}) || self.{field} == oldSelf.{field})",
        f"{path} is immutable: create a new RFTJob to change it",
        f".{field}",
    )


# Marks a field the RFTJob requires (the CRD lists it) but a hand-written config may omit.
ADMISSION_REQUIRED = "x-rft-admission-required"


def admission_required(**kw: Any) -> Any:
    return Field(default=None, json_schema_extra={ADMISSION_REQUIRED: True}, **kw)


class Model(BaseModel):
    """camelCase on the wire, snake_case in Python (both accepted); unknown fields are an
    error; types are strict (no "3" for 3, no 1.5 for an integer). Frozen: a parsed spec
    is a value, changed only with `model_copy(update=...)`."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", strict=True, frozen=True
    )

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__}.{name}: the config is frozen")


Quantity = int | str  # a Kubernetes resource quantity: 4, "500m", "16Gi"


class Resources(Model):
    """Container resources passed through to the pods (minus GPUs: see gpusPerNode)."""

    requests: dict[str, Quantity] = Field(default_factory=dict, max_length=16)
    limits: dict[str, Quantity] = Field(default_factory=dict, max_length=16)


class EnvVar(Model):
    name: str = Field(pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$", max_length=253)
    value: str = Field(default="", max_length=32768)


class Toleration(Model):
    key: str | None = Field(default=None, max_length=316)
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = Field(default=None, max_length=63)
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


class SecurityContext(Model):
    """Explicit relaxations of the restricted default (non-root, no escalation,
    all capabilities dropped, RuntimeDefault seccomp). Unset fields keep the default."""

    run_as_user: int | None = Field(default=None, ge=0)
    run_as_group: int | None = Field(default=None, ge=0)
    fs_group: int | None = Field(default=None, ge=0)
    run_as_non_root: bool | None = None
    allow_privilege_escalation: bool | None = None
    add_capabilities: list[str] = Field(default_factory=list, max_length=16)
    seccomp_profile: Literal["RuntimeDefault", "Unconfined"] | None = None


QUANTITY = r"^[0-9]+(Ki|Mi|Gi|Ti|Pi|K|M|G|T|P)?$"


class ModelCacheSpec(Model):
    """Where trainer pods keep the downloaded base model (one download per node: local
    rank 0 fetches, the other ranks read the same directory). The default emptyDir lives
    as long as the pod; a hostPath or a PersistentVolumeClaim keeps the files across gang
    attempts on the same node (a file is reused only when its size and checksum match)."""

    model_config = ConfigDict(
        json_schema_extra={
            "rules": [
                cel(
                    "!(has(self.hostPath) && has(self.persistentVolumeClaim))",
                    "model.cache: set at most one of hostPath and persistentVolumeClaim",
                )
            ]
        }
    )

    host_path: str | None = Field(default=None, min_length=2, max_length=1024, pattern=r"^/.*[^/]$",
                                  description="A node directory (type DirectoryOrCreate).")
    persistent_volume_claim: str | None = Field(default=None, max_length=253, pattern=K8S_NAME,
                                                description="An existing PVC (ReadWriteMany for several nodes).")
    size_limit: str | None = Field(default=None, pattern=QUANTITY,
                                   description="sizeLimit of the default emptyDir.")
    download_timeout_seconds: int = Field(
        default=3600, ge=60, le=86400,
        description="How long the other ranks wait for local rank 0 to download the model.")


class ModelSpec(Model):
    path: str = Field(
        min_length=1,
        max_length=1024,
        description="HF-format model directory: an s3:// URI or a path inside the image.",
    )
    tokenizer_path: str | None = Field(default=None, max_length=1024)
    # fp32 master weights by default: FSDP's MixedPrecisionPolicy already computes in
    # bf16, while an lr of 1e-6 applied to bf16 weights (8 mantissa bits) rounds to nothing.
    dtype: Literal["fp32", "bf16"] = Field(default="fp32", description="Master weights dtype.")
    cache: ModelCacheSpec = Field(default_factory=ModelCacheSpec)


class AlgorithmSpec(Model):
    model_config = ConfigDict(
        json_schema_extra={
            "rules": [
                cel(
                    "!has(self.miniBatchSize) || !has(self.microBatchSize) || self.miniBatchSize >= self.microBatchSize",
                    "algorithm.microBatchSize must not exceed algorithm.miniBatchSize",
                ),
            ]
        }
    )

    name: Literal["grpo", "ppo"]
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
    mini_batch_size: int | None = Field(default=None, ge=1)
    micro_batch_size: int = Field(default=1, ge=1)
    grad_clip: float = Field(default=1.0, gt=0)
    loss_aggregation: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = (
        "token-mean"
    )
    gamma: float = Field(default=1.0, ge=0, le=1)
    lam: float = Field(default=1.0, ge=0, le=1)
    norm_adv_by_std: bool = True
    cliprange_value: float = Field(default=0.5, gt=0, description="PPO value clip.")
    use_kl_loss: bool = Field(
        default=True,
        description="KL as a loss term (GRPO style) rather than folded into the reward (classic PPO).",
    )


Beta = Annotated[float, Field(ge=0, lt=1)]


class OptimizerSpec(Model):
    """AdamW and its learning-rate schedule (for the actor and the critic alike)."""

    betas: tuple[Beta, Beta] = Field(default=(0.9, 0.999), strict=False)
    weight_decay: float = Field(default=0.01, ge=0)
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
    model_config = ConfigDict(
        json_schema_extra={
            "rules": [
                immutable("nodes", "trainer.nodes"),
                immutable("gpusPerNode", "trainer.gpusPerNode"),
                cel(
                    "!has(self.resources) || !has(self.resources.limits) || !('nvidia.com/gpu' in self.resources.limits)",
                    "set trainer.gpusPerNode instead of trainer.resources.limits['nvidia.com/gpu']",
                    ".resources",
                ),
                cel(
                    "!has(self.resources) || !has(self.resources.requests) || !('nvidia.com/gpu' in self.resources.requests)",
                    "set trainer.gpusPerNode instead of trainer.resources.requests['nvidia.com/gpu']",
                    ".resources",
                ),
            ]
        }
    )

    image: str | None = admission_required(min_length=1, max_length=512)
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = None
    nodes: int = Field(default=1, ge=1, le=1024)
    gpus_per_node: int = Field(default=1, ge=0, le=16)
    total_steps: int = Field(ge=1, le=100_000_000)
    batch_size: int = Field(ge=1, le=1_000_000)
    seed: int = Field(default=0, ge=0)
    resources: Resources = Field(default_factory=Resources)
    fsdp: FSDPSpec = Field(default_factory=FSDPSpec)
    env: list[EnvVar] = Field(default_factory=list, max_length=64)
    master_port: int = Field(default=29500, ge=1024, le=65535)
    shm_size: str = Field(default="1Gi", pattern=r"^[0-9]+(Ki|Mi|Gi|Ti)?$")
    termination_grace_period_seconds: int = Field(default=300, ge=0, le=86400)
    node_selector: dict[str, str] = Field(default_factory=dict, max_length=32)
    tolerations: list[Toleration] = Field(default_factory=list, max_length=32)
    priority_class_name: str | None = Field(default=None, max_length=253, pattern=K8S_NAME)
    scheduler_name: str | None = Field(default=None, max_length=253, pattern=K8S_NAME)
    service_account_name: str | None = Field(
        default=None,
        max_length=253,
        pattern=K8S_NAME,
        description=(
            "Run trainer pods as this existing ServiceAccount (e.g. one mapped to a cloud "
            "IAM role for S3). The operator binds the per-job status Role to it."
        ),
    )
    security_context: SecurityContext = Field(default_factory=SecurityContext)


class CheckpointSpec(Model):
    uri: str = Field(
        min_length=1,
        max_length=1024,
        json_schema_extra={
            "rules": [
                cel(
                    f"self.matches('{S3_URI}')",
                    "checkpoint.uri must be an S3 URI of the form s3://<bucket>/<prefix>",
                )
            ]
        },
    )
    interval: int = Field(default=100, ge=1)
    keep: int = Field(default=3, ge=1, le=1000)
    credentials_secret: str | None = Field(
        default=None,
        max_length=253,
        pattern=K8S_NAME,
        description="Secret with AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (optional AWS_SESSION_TOKEN).",
    )
    endpoint: str | None = Field(
        default=None,
        max_length=1024,
        pattern=r"^https?://[^\s/]+(/.*)?$",
        description="S3-compatible endpoint URL, e.g. http://minio.storage:9000. Empty means AWS.",
    )
    region: str | None = Field(default=None, max_length=64)
    staging_size_limit: str | None = Field(
        default=None, pattern=QUANTITY,
        description=(
            "sizeLimit of the emptyDir a resuming trainer pod downloads the checkpoint into "
            "(one copy per node, read by every rank there). Unset: no limit. Size it above "
            "the largest checkpoint (model + optimizer state)."),
    )


class FailurePolicy(Model):
    model_config = ConfigDict(
        json_schema_extra={
            "rules": [
                cel(
                    "!has(self.fatalExitCodes) || !has(self.retryableExitCodes) || "
                    "self.fatalExitCodes.all(c, !(c in self.retryableExitCodes))",
                    "failurePolicy.fatalExitCodes and failurePolicy.retryableExitCodes must not overlap",
                )
            ]
        }
    )

    max_restarts: int = Field(default=3, ge=0, le=10_000)
    backoff_seconds: int = Field(default=10, ge=0, le=3600)
    fatal_exit_codes: list[int] = Field(
        default_factory=lambda: [78],
        max_length=64,
        description="Exit codes that fail the job at once. Default [78] (EX_CONFIG).",
    )
    retryable_exit_codes: list[int] | None = Field(
        default=None,
        max_length=64,
        description="If set, only these exit codes restart the gang; any other fails the job.",
    )
    progress_deadline_seconds: int = Field(
        default=1800, ge=0, le=7 * 86400,
        description=(
            "Restart the gang (counting against maxRestarts) when status.trainer.step has not "
            "moved for this long while the job runs; the Progressing condition says why. "
            "0 turns the deadline off. Set it a few minutes above the slowest expected step "
            "(the first step includes the model download)."),
    )


class InferenceSpec(Model):
    model_config = ConfigDict(
        json_schema_extra={
            "rules": [
                cel(
                    "!has(self.engine) || self.engine == 'reference' || has(self.image)",
                    "spec.inference.image is required for the vllm and sglang engines "
                    "(the reference engine runs in the trainer image)",
                    ".image",
                ),
            ]
        }
    )

    replicas: int = Field(default=1, ge=0, le=1024)
    image: str | None = Field(
        default=None, max_length=512,
        description="Engine image; default: spec.trainer.image (reference engine only).",
    )
    engine: Literal["reference", "vllm", "sglang"] = "reference"
    gpus_per_replica: int = Field(default=1, ge=0, le=16)
    port: int = Field(default=8000, ge=1024, le=65535)
    resources: Resources = Field(default_factory=Resources)


class SamplingSpec(Model):
    temperature: float = Field(default=1.0, ge=0, le=10)
    top_p: float = Field(default=1.0, gt=0, le=1)
    max_tokens: int = Field(default=256, ge=1, le=1_000_000)


class ExplorerSpec(Model):
    replicas: int = Field(default=1, ge=0, le=1024)
    image: str | None = Field(default=None, max_length=512)
    taskset_uri: str = Field(min_length=1, max_length=1024)
    rollouts_per_task: int = Field(default=8, ge=1, le=1024)
    sampling: SamplingSpec = Field(default_factory=SamplingSpec)
    reward: str = Field(default="math_accuracy", min_length=1, max_length=256)
    prompt_format: Literal["chat", "raw"] | None = Field(
        default=None,
        description="chat: the task goes through the tokenizer's chat template as a user message; "
                    "raw: the task text is the prompt. Default chat when the tokenizer has a template.",
    )
    tasks_per_shard: int | None = Field(
        default=None, ge=1, description="Tasks per experience shard; default max(1, batchSize / rolloutsPerTask).")
    request_timeout: float = Field(default=300.0, gt=0, description="Seconds per inference request.")
    concurrency: int | None = Field(
        default=None, ge=1, description="Requests in flight; default one per inference replica.")
    max_n: int = Field(default=64, ge=1, description="Rollouts per request (the reference server caps n at 64).")
    poll_interval: float = Field(default=5.0, gt=0, description="Seconds between trainer-progress checks.")


class BufferSpec(Model):
    uri: str | None = Field(
        default=None, max_length=1024,
        description="Experience buffer; default <checkpoint.uri>/buffer.",
        # A CEL rule, not a pattern: admission requires S3, while a local trainer run
        # (a hand-written config) may read a directory.
        json_schema_extra={"rules": [cel(f"self.matches('{S3_URI}')",
                                         "buffer.uri must be an S3 URI of the form s3://<bucket>/<prefix>")]},
    )
    max_staleness: int = Field(default=1, ge=0, le=1000)
    wait: bool | None = Field(
        default=None,
        description="Wait for explorers when the buffer runs dry; default: iff spec.explorer is set.")
    poll_seconds: float = Field(
        default=2.0, gt=0, le=60,
        description="Seconds between buffer listings while waiting (the other ranks wait in a "
                    "collective meanwhile, so it stays well under the process group's timeout).")


class SyncSpec(Model):
    interval: int = Field(default=1, ge=1, description="Export weights every N trainer steps.")
    pinned_version: int | None = Field(
        default=None, ge=0,
        description="Serve this exported version (0 = the base model) instead of the newest.",
    )
    keep: int = Field(default=5, ge=1, le=1000, description="Exported versions kept in S3 "
                      "(a pinned version is kept in addition).")


class RFTJobSpec(Model):
    model_config = ConfigDict(
        json_schema_extra={
            "rules": [
                immutable("model", "spec.model"),
                cel(
                    "self.algorithm.name == oldSelf.algorithm.name",
                    "spec.algorithm.name is immutable: create a new RFTJob to change it",
                    ".algorithm.name",
                ),
                cel(
                    "self.checkpoint.uri == oldSelf.checkpoint.uri",
                    "spec.checkpoint.uri is immutable: resume needs the same location",
                    ".checkpoint.uri",
                ),
                cel(
                    "!has(self.explorer) || has(self.inference)",
                    "spec.explorer needs spec.inference: explorers generate rollouts against the inference pods",
                    ".explorer",
                ),
            ]
        }
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
