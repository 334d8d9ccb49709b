"""Names shared by the operator, the trainer and the tests: one place for every key."""

GROUP = "rft.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "RFTJob"
PLURAL = "rftjobs"
SINGULAR = "rftjob"
SHORT_NAME = "rft"
CATEGORY = "rft"

# Labels on every child object.
LABEL_JOB = "rft.dev/job"
LABEL_ROLE = "rft.dev/role"
LABEL_ATTEMPT = "rft.dev/attempt"
LABEL_RANK = "rft.dev/rank"
LABEL_REPLICA = "rft.dev/replica"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "rftjob-operator"
# Pod Security Admission's enforce label: job pods run only in namespaces that carry it
# with baseline or restricted (the operator's admission policy; the API server's
# PodSecurity plugin then checks every field of that standard).
PSA_ENFORCE_LABEL = "pod-security.kubernetes.io/enforce"

ROLE_TRAINER = "trainer"
ROLE_INFERENCE = "inference"
ROLE_EXPLORER = "explorer"

# Annotation on child objects: a hash of the spec they were rendered from.
ANNOTATION_SPEC_HASH = "rft.dev/spec-hash"

# Phases.
PENDING = "Pending"
RUNNING = "Running"
RESTARTING = "Restarting"
SUSPENDED = "Suspended"
SUCCEEDED = "Succeeded"
FAILED = "Failed"
PHASES = (PENDING, RUNNING, RESTARTING, SUSPENDED, SUCCEEDED, FAILED)
TERMINAL_PHASES = (SUCCEEDED, FAILED)

# Condition types.
COND_RUNNING = "Running"
COND_SUSPENDED = "Suspended"
COND_SUCCEEDED = "Succeeded"
COND_FAILED = "Failed"
COND_CHECKPOINTED = "Checkpointed"
COND_WEIGHTS_SYNCED = "WeightsSynced"
COND_PROGRESSING = "Progressing"
COND_ADMITTED = "Admitted"  # by Kueue, for a job labelled kueue.x-k8s.io/queue-name
# kstatus' standard conditions (Flux's health checks, cli-utils, `kubectl wait`): abnormal-true
# Reconciling and Stalled, and Ready.
COND_READY = "Ready"
COND_RECONCILING = "Reconciling"
COND_STALLED = "Stalled"

# Condition / event reasons.
REASON_CREATED = "Created"
REASON_PODS_PENDING = "PodsPending"
REASON_ALL_RUNNING = "AllPodsRunning"
REASON_POD_FAILED = "PodFailed"
REASON_POD_DELETED = "PodDeleted"
REASON_RESTARTING = "Restarting"
REASON_RESTARTED = "Restarted"
REASON_SUSPENDED = "Suspended"
REASON_RESUMED = "Resumed"
REASON_SUCCEEDED = "Succeeded"
REASON_FATAL_EXIT = "FatalExitCode"
REASON_BACKOFF_LIMIT = "RestartLimitExceeded"
REASON_INVALID_SPEC = "InvalidSpec"
REASON_NOT_SUSPENDED = "NotSuspended"
REASON_CHECKPOINT_SAVED = "CheckpointSaved"
REASON_NO_CHECKPOINT = "NoCheckpointYet"
REASON_SYNCED = "AllReplicasSynced"
REASON_SYNCING = "Syncing"
REASON_SYNC_ERROR = "SyncError"
REASON_PIN_MISSING = "PinnedVersionNotFound"
REASON_NO_REPLICAS = "NoInferenceReplicas"
REASON_STEPPING = "Stepping"
REASON_PROGRESS_DEADLINE = "ProgressDeadlineExceeded"
REASON_QUEUED = "Queued"  # waiting for Kueue to admit the job's Workload
REASON_EVICTED = "EvictedByKueue"  # preempted or deactivated: the gang stops, the job waits again
REASON_POD_DISRUPTED = "PodDisrupted"  # evicted, preempted, drained: restarts without using maxRestarts
REASON_CHILD_CONFLICT = "ChildConflict"  # a child's name is taken by an object this job does not control
REASON_STUCK_TERMINATING = "PodStuckTerminating"  # an old pod outlived its grace period (forced or reported)
# Why the trainer waits (status.trainer.waiting.reason, copied into Progressing=False).
WAIT_DATA = "WaitingForExperiences"
WAIT_STALE = "ExperiencesStale"
WAIT_PREPARING = "Preparing"  # loading the model, resuming: no step yet

# Environment given to trainer containers.
ENV_JOB_NAME = "RFT_JOB_NAME"
ENV_JOB_NAMESPACE = "RFT_JOB_NAMESPACE"
ENV_JOB_UID = "RFT_JOB_UID"
ENV_ATTEMPT = "RFT_ATTEMPT"
ENV_CONFIG = "RFT_CONFIG"
ENV_POD_NAME = "RFT_POD_NAME"

ENV_POD_IP = "RFT_POD_IP"
# Trainer pods: the port rank 0 serves each exported version on (the fast path; podenv).
ENV_WEIGHTS_PEER_PORT = "RFT_WEIGHTS_PEER_PORT"
# Trainer pods: "nccl" when rank 0 also sends each version over NCCL (spec.sync.transport; podenv).
ENV_WEIGHTS_TRANSPORT = "RFT_WEIGHTS_TRANSPORT"
ENV_INFERENCE_PORT = "RFT_INFERENCE_PORT"
ENV_INFERENCE_ENDPOINTS = "RFT_INFERENCE_ENDPOINTS"
ENV_EXPLORER_INDEX = "RFT_EXPLORER_INDEX"
ENV_EXPLORER_REPLICAS = "RFT_EXPLORER_REPLICAS"

CONFIG_MOUNT = "/etc/rft"
WEIGHTS_MOUNT = "/var/lib/rft/weights"
# The `model` name inference replicas answer to (explorers send it, as OpenAI clients do).
SERVED_MODEL_NAME = "policy"
# An engine that serves a LoRA job's policy as an adapter named SERVED_MODEL_NAME (vLLM:
# an adapter cannot take the base's name) serves the base model alone under this name.
BASE_MODEL_NAME = "policy-base"
MODEL_CACHE_MOUNT = "/var/cache/rft/models"
# A resuming pod downloads the checkpoint here once (local rank 0); every rank loads it.
STAGING_MOUNT = "/var/lib/rft/staging"
# Every container's writable scratch (an emptyDir; the root filesystem is read-only) and HOME.
SCRATCH_MOUNT = "/tmp"
ENV_STAGING_DIR = "RFT_STAGING_DIR"
ENV_GRACE_SECONDS = "RFT_TERMINATION_GRACE_SECONDS"
# Inference pods stay after success until they serve the final weights, at most this long.
FINAL_SYNC_GRACE_SECONDS = 600
CONFIG_FILE = "config.json"

# Exit code the trainer uses for errors that a restart cannot fix (sysexits EX_CONFIG).
EXIT_CONFIG_ERROR = 78

# KWOK test hook: a Running pod with this annotation ends with the given exit code.
KWOK_EXIT_ANNOTATION = "rft.dev/kwok-exit-code"


# ------------------------------------------------------------------ child names
# Deterministic, so "create what is missing by name" is the idempotency mechanism.


def service_name(job: str) -> str:
    return f"{job}-trainer"


def pod_name(job: str, attempt: int, rank: int) -> str:
    return f"{job}-trainer-{attempt}-{rank}"


def configmap_name(job: str) -> str:
    return f"{job}-config"


def status_role_name(job: str) -> str:
    """The Role that lets the trainer and the sync agents patch this job's status."""
    return f"{job}-status-writer"


def status_reader_role_name(job: str) -> str:
    """The Role that lets explorers read this job (and nothing else)."""
    return f"{job}-status-reader"


# Each pod role runs as its own ServiceAccount `<job>-rft-<role>`, so the admission
# policies (manifests/base/admission-policies.yaml) can tell the trainer, a sync agent and an
# explorer apart by the request's username alone.
SA_INFIX = "-rft-"


def service_account_name(job: str, role: str) -> str:
    return f"{job}{SA_INFIX}{role}"


def inference_service_name(job: str) -> str:
    return f"{job}-inference"


def inference_pod_name(job: str, index: int) -> str:
    return f"{job}-inference-{index}"


def explorer_pod_name(job: str, index: int) -> str:
    return f"{job}-explorer-{index}"


def master_addr(job: str, attempt: int, namespace: str) -> str:
    """Stable DNS name of rank 0 through the headless Service."""
    return f"{pod_name(job, attempt, 0)}.{service_name(job)}.{namespace}.svc"


# Annotation on static children: the label and annotation keys outside rft.dev/* that the
# operator rendered (JSON, e.g. {"annotations": ["eks.amazonaws.com/role-arn"]}), so a key
# dropped from the spec is removed from the live object, and keys others added are not.
ANNOTATION_MANAGED_KEYS = "rft.dev/managed-keys"


# The sync agent's server in each inference pod (rft_contract.relay.PeerServer): weights for
# its children in the relay tree, and its record of what the engine serves for explorers.
WEIGHTS_PEER_PORT = 8471


def agent_port(inference_port: int) -> int:
    """The sync agent's server port: a fixed one, unless the engine took it."""
    return WEIGHTS_PEER_PORT + (inference_port == WEIGHTS_PEER_PORT)
