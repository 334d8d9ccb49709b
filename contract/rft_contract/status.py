"""The RFTJob status: who writes which subtree (docs/design.md, "Status contract").

    phase, message, attempt, restarts, conditions, ...   the operator
    trainer                                             the trainer's rank 0 (the operator seeds progress)
    weightSync.target, counts                           the operator
    weightSync.replicas[<pod>]                          that pod's sync agent

`trainer`, each `weightSync.replicas[<pod>]` entry and the records inside allow unknown
fields, so older and newer writers do not break each other; the top level and `weightSync`
itself do not, so the status admission policy (`rft_operator.policygen`) can check every
field a writer must leave alone.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field

from .spec import Model


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
    peer: str | None = Field(default=None, description=(
        "The trainer's weights server (the fast path): replicas stream the version from it while "
        "the trainer uploads it to S3"))
    manifest: str | None = Field(default=None, description=(
        "sha256 of the export's manifest (rft_contract.manifest.manifest_digest): a manifest from "
        "a peer is used only if it matches"))


class BufferStatus(Model):
    """What the trainer has taken from the buffer: explorers throttle on it."""

    model_config = ConfigDict(extra="allow")
    consumed: dict[str, int] | None = Field(
        default=None, description="Samples consumed (trained or dropped as stale) per writer, e.g. e000")
    dropped_stale: int | None = None
    samples: int | None = Field(default=None, description="Samples trained")


class WaitStatus(Model):
    """Why the trainer is not stepping (absent while it steps)."""

    model_config = ConfigDict(extra="allow")
    reason: str
    message: str = ""
    since: str | None = None
    seconds: float | None = None
    attempt: int | None = Field(default=None, description="The gang attempt that is waiting")


class ResumeRef(Model):
    """Where a gang attempt's trainer started: the checkpoint it resumed from, or none."""

    attempt: int | None = None
    step: int
    checkpoint: str | None = Field(default=None, description="The checkpoint's URI; null: a fresh start")
    time: str | None = None


class TrackerStatus(Model):
    """How one experiment tracker (spec.tracking) fares; it never stops training."""

    model_config = ConfigDict(extra="allow")
    ok: bool | None = Field(default=None, description="The last call to the tracker succeeded")
    error: str | None = Field(default=None, description="Why the last call failed (type and message; never a "
                                                        "credential); null once a call succeeds")
    dropped: int | None = Field(default=None, description="Reports dropped: the buffer was full while the "
                                                          "tracker was down, or the tracker refused them")
    last_step: int | None = Field(default=None, description="The last step the tracker acknowledged")


class EvaluationRecord(Model):
    """One version's score on spec.evaluation's taskset."""

    model_config = ConfigDict(extra="allow")
    version: int
    uri: str | None = Field(default=None, description="The version's weights (the base model's path for 0)")
    step: int | None = Field(default=None, description="The trainer's step when the score came in")
    accuracy: float = Field(description="Mean reward over every sample of every task")
    pass_at_k: dict[str, float] | None = Field(default=None, description="k -> pass@k")
    tasks: int | None = None
    samples: int | None = None
    seconds: float | None = None
    time: str | None = None


class EvaluationStatus(Model):
    """Written by the trainer's rank 0 (spec.evaluation)."""

    model_config = ConfigDict(extra="allow")
    last: EvaluationRecord | None = None
    best: EvaluationRecord | None = Field(default=None, description=(
        "The version with the highest accuracy (the earliest on a tie); kept in S3 past sync.keep (its checkpoint, if one was taken at that step, past checkpoint.keep), and "
        "served with spec.sync.pinnedVersion: best"))
    summary: str | None = Field(default=None, description="For kubectl: accuracy@version, and the best")
    evaluated: int | None = Field(default=None, description="Versions evaluated")
    skipped: int | None = Field(default=None, description="Versions not evaluated within timeoutSeconds")
    error: str | None = Field(default=None, description="Why the last evaluation failed; null once one succeeds")


class TrainerStatus(Model):
    """Written by the trainer's rank 0 (the operator only seeds totalSteps/progress)."""

    model_config = ConfigDict(extra="allow")
    step: int | None = None
    total_steps: int | None = None
    attempt: int | None = Field(default=None, description="The gang attempt that reported `step`")
    progress: str | None = Field(default=None, description="step/totalSteps, for kubectl")
    last_checkpoint: CheckpointRef | None = None
    latest_weights: WeightsRef | None = None
    merged_weights: WeightsRef | None = Field(default=None, description=(
        "A LoRA job whose versions are adapters, once finished: the base with the final adapter merged, "
        "a plain HF model for serving elsewhere"))
    weight_versions: list[int] | None = Field(default=None, description="Committed, retained exports")
    metrics: dict[str, Any] | None = Field(
        default=None, json_schema_extra={"x-kubernetes-preserve-unknown-fields": True}
    )
    buffer: BufferStatus | None = None
    waiting: WaitStatus | None = None
    resumed_from: ResumeRef | None = None
    evaluation: EvaluationStatus | None = None
    tracking: dict[str, TrackerStatus] | None = Field(
        default=None, max_length=8, description="Per tracker (tensorboard, mlflow, wandb): ok, error, dropped, "
                                                "lastStep")


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
    source: str | None = Field(default=None, description="where the last fetch came from: s3, peer <pod>, "
                                                        "peer <pod>, then s3, or local")
    peer: str | None = Field(default=None, description="URL of this replica's weight relay")
    probe: dict[str, Any] | None = Field(
        default=None, description="The weight-sync probe of the version reported: meanDiff, maxDiff "
                                  "(log-prob, served vs trained), tokens, tolerance")
    fingerprint: dict[str, Any] | None = Field(
        default=None, description="The exact weights check of the version reported: params (parameters "
                                  "compared with the export's fingerprint, all equal); missing (vLLM only: exported "
                                  "tensors its parameter names did not place, left to the probe)")
    engine_restarts: int | None = Field(default=None, description="Restarts of the engine by its sync agent")
    last_restart: str | None = Field(default=None, description="When and why the sync agent last restarted "
                                                               "the engine")


# No unknown fields at this level and at the top (the CRD prunes them): the status
# admission policy can then compare every field a writer must leave alone, while each
# replica's entry and `trainer` stay open.
class WeightSyncStatus(Model):
    target: WeightsRef | None = None
    replicas: dict[str, ReplicaSync] | None = None
    synced_replicas: int | None = None
    desired_replicas: int | None = None
    synced: str | None = Field(default=None, description="syncedReplicas/desiredReplicas")
    lag_steps: int | None = None


class ResumeStart(Model):
    step: int
    checkpoint: str | None = Field(default=None, description="The checkpoint's URI; absent: a fresh start")


class ProgressStatus(Model):
    """The operator's record for the progress deadline."""

    model_config = ConfigDict(extra="allow")
    step: int | None = None
    attempt: int | None = None
    since: str | None = Field(default=None, description="When step (or the attempt) last changed")
    resumed_from: ResumeStart | None = Field(default=None, description="Where this attempt's trainer started")


class FailureRecord(Model):
    attempt: int
    pod: str | None = None
    exit_code: int | None = None
    reason: str
    message: str = ""
    time: str
    log: str | None = Field(
        default=None, description="The failed container's last log lines (at most 1 KiB; the kubelet keeps "
        "them as its termination message), when it failed rather than being deleted or disrupted")


class AttemptRecord(Model):
    """One gang attempt, for the person on call: where it started and ended, and why."""

    attempt: int
    start_step: int | None = Field(default=None, description="The step it resumed from (0: from scratch); "
                                                              "null until its trainer reports")
    checkpoint: str | None = Field(default=None, description="The checkpoint it resumed from")
    end_step: int | None = Field(default=None, description="The last step its trainer reported")
    reason: str | None = Field(default=None, description="Why it ended (lastFailure's reason, Succeeded, "
                                                         "Suspended); null while it runs")
    ended: str | None = None


class QueueStatus(Model):
    """Where Kueue has the job (a job labelled kueue.x-k8s.io/queue-name)."""

    name: str = Field(description="The LocalQueue")
    state: Literal["Queued", "Admitted", "Evicted"]
    workload: str = Field(default="", description="The job's Kueue Workload")
    cluster_queue: str | None = Field(default=None, description="The ClusterQueue that admitted it")
    suspended: bool | None = Field(default=None, description="The operator deactivated the Workload for "
                                   "spec.suspend and has not seen it active again")


class RFTJobStatus(Model):  # no unknown fields either: see WeightSyncStatus
    phase: Literal["Pending", "Running", "Restarting", "Suspended", "Succeeded", "Failed"] | None = None
    message: str | None = None
    observed_generation: int | None = None
    attempt: int | None = None
    restarts: int | None = None
    disruptions: int | None = Field(
        default=None, description="Gang restarts caused by pod disruptions (eviction, preemption, drain); "
        "they do not count against spec.failurePolicy.maxRestarts")
    start_time: str | None = None
    completion_time: str | None = None
    last_failure: FailureRecord | None = None
    conditions: list[Condition] | None = None
    trainer: TrainerStatus | None = None
    weight_sync: WeightSyncStatus | None = None
    progress: ProgressStatus | None = None
    attempts: list[AttemptRecord] | None = Field(
        default=None, description="The last few gang attempts (oldest first): start and end step, why each ended")
    queue: QueueStatus | None = Field(default=None, description="Kueue's decision, for a job it queues")


# Printer columns for `kubectl get rftjobs` (jsonPath into the object).
PRINTER_COLUMNS = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Step", "type": "string", "jsonPath": ".status.trainer.progress"},
    {"name": "Checkpoint", "type": "integer", "jsonPath": ".status.trainer.lastCheckpoint.step"},
    {"name": "Weights", "type": "integer", "jsonPath": ".status.trainer.latestWeights.version"},
    {"name": "Synced", "type": "string", "jsonPath": ".status.weightSync.synced"},
    {"name": "Eval", "type": "string", "jsonPath": ".status.trainer.evaluation.summary"},
    {"name": "Queue", "type": "string", "jsonPath": ".status.queue.state"},
    {"name": "Restarts", "type": "integer", "jsonPath": ".status.restarts", "priority": 1},
    {"name": "Attempt", "type": "integer", "jsonPath": ".status.attempt", "priority": 1},
    {"name": "Last-Failure", "type": "string", "jsonPath": ".status.lastFailure.reason", "priority": 1},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]

