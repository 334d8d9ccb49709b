"""The RFTJob API: pydantic models are the single source of truth.

`crds/rftjob.yaml` is generated from these models (see `crdgen.py`). Two kinds of rule
live here:

* Field constraints (`ge`, `le`, `pattern`, `Literal`) become OpenAPI schema checks, and
  `rules=[...]` in `json_schema_extra` becomes CEL `x-kubernetes-validations`, so the API
  server refuses a bad spec at admission with a message naming the field.
* Defaults live only in these models, never in the CRD schema: a schema default would be
  written back into the stored object and GitOps tools (Argo CD, Flux) would see drift.
  The operator parses the stored spec with `RFTJobSpec.model_validate`, which applies them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

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


class Model(BaseModel):
    """camelCase on the wire, snake_case in Python; unknown fields are an error."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=False
    )


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


class ModelSpec(Model):
    path: str = Field(
        min_length=1,
        max_length=1024,
        description="HF-format model directory: an s3:// URI or a path inside the image.",
    )
    tokenizer_path: str | None = Field(default=None, max_length=1024)


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
    kl_estimator: Literal["k1", "k2", "k3", "low_var_kl"] = "low_var_kl"
    clip_ratio: float = Field(default=0.2, gt=0, lt=1)
    dual_clip_ratio: float | None = Field(default=None, gt=1)
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

    image: str = Field(min_length=1, max_length=512)
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = None
    nodes: int = Field(default=1, ge=1, le=1024)
    gpus_per_node: int = Field(default=1, ge=0, le=16)
    total_steps: int = Field(ge=1, le=100_000_000)
    batch_size: int = Field(ge=1, le=1_000_000)
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


class BufferSpec(Model):
    uri: str | None = Field(default=None, max_length=1024, pattern=S3_URI)
    max_staleness: int = Field(default=1, ge=0, le=1000)


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


# ---------------------------------------------------------------------------- status


class Condition(Model):
    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str = ""
    message: str = ""
    last_transition_time: str | None = None
    observed_generation: int | None = None


class CheckpointRef(Model):
    model_config = ConfigDict(extra="allow")
    step: int | None = None
    uri: str | None = None
    time: str | None = None
    bytes: int | None = None
    save_seconds: float | None = None


class WeightsRef(Model):
    model_config = ConfigDict(extra="allow")
    version: int | None = None
    uri: str | None = None
    time: str | None = None
    id: str | None = Field(default=None, description="Export id: tells re-exports of a version apart")


class TrainerStatus(Model):
    """Written by the trainer's rank 0 (the operator only seeds totalSteps/progress)."""

    model_config = ConfigDict(extra="allow")
    step: int | None = None
    total_steps: int | None = None
    attempt: int | None = Field(default=None, description="The gang attempt that reported `step`")
    progress: str | None = Field(default=None, description="step/totalSteps, for kubectl")
    last_checkpoint: CheckpointRef | None = None
    latest_weights: WeightsRef | None = None
    weight_versions: list[int] | None = Field(default=None, description="Committed, retained exports")
    metrics: dict[str, Any] | None = Field(
        default=None, json_schema_extra={"x-kubernetes-preserve-unknown-fields": True}
    )


class ReplicaSync(Model):
    """Written by the sync agent of one inference pod."""

    model_config = ConfigDict(extra="allow")
    version: int | None = None
    id: str | None = None
    time: str | None = None
    load_seconds: float | None = None
    download_seconds: float | None = None
    verify_seconds: float | None = None
    reload_seconds: float | None = None
    error: str | None = None
    error_time: str | None = None
    attempts: int | None = None


class WeightSyncStatus(Model):
    model_config = ConfigDict(extra="allow")
    target: WeightsRef | None = None
    replicas: dict[str, ReplicaSync] | None = None
    synced_replicas: int | None = None
    desired_replicas: int | None = None
    synced: str | None = Field(default=None, description="syncedReplicas/desiredReplicas")
    lag_steps: int | None = None


class FailureRecord(Model):
    attempt: int
    pod: str | None = None
    exit_code: int | None = None
    reason: str
    message: str = ""
    time: str


class RFTJobStatus(Model):
    model_config = ConfigDict(extra="allow")
    phase: Literal["Pending", "Running", "Restarting", "Suspended", "Succeeded", "Failed"] | None = None
    message: str | None = None
    observed_generation: int | None = None
    attempt: int | None = None
    restarts: int | None = None
    start_time: str | None = None
    completion_time: str | None = None
    last_failure: FailureRecord | None = None
    conditions: list[Condition] | None = None
    trainer: TrainerStatus | None = None
    weight_sync: WeightSyncStatus | None = None


# Printer columns for `kubectl get rftjobs` (jsonPath into the object).
PRINTER_COLUMNS = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Step", "type": "string", "jsonPath": ".status.trainer.progress"},
    {"name": "Checkpoint", "type": "integer", "jsonPath": ".status.trainer.lastCheckpoint.step"},
    {"name": "Weights", "type": "integer", "jsonPath": ".status.trainer.latestWeights.version"},
    {"name": "Synced", "type": "string", "jsonPath": ".status.weightSync.synced"},
    {"name": "Restarts", "type": "integer", "jsonPath": ".status.restarts", "priority": 1},
    {"name": "Attempt", "type": "integer", "jsonPath": ".status.attempt", "priority": 1},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]

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


def parse_spec(spec: dict[str, Any]) -> RFTJobSpec:
    """Parse a stored spec, applying defaults. Raises ValueError naming the bad field."""
    from pydantic import ValidationError

    try:
        return RFTJobSpec.model_validate(spec)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ValueError(f"spec.{where}: {first['msg']}") from None
