"""Bad specs are refused by the API server itself (OpenAPI schema + CEL), with a message
that names the field. No operator runs here: admission alone must catch these. The
adversarial corpus (test_admission_corpus.py) covers the formats; these cases cover
updates (immutable fields) and the classic mistakes, created for real."""

from __future__ import annotations

import copy
import json

import kubernetes
import pytest
from kubernetes.client.rest import ApiException

from rft_contract import names

from .operator_fixtures import job_manifest

pytestmark = pytest.mark.integration


def _set(manifest: dict, path: str, value) -> dict:
    m = copy.deepcopy(manifest)
    node = m
    keys = path.split(".")
    for k in keys[:-1]:
        node = node.setdefault(k, {})
    if value is _DELETE:
        node.pop(keys[-1], None)
    else:
        node[keys[-1]] = value
    return m


_DELETE = object()
BASE = job_manifest("valid")

# (case id, path, value, expected fragment of the API server's message)
INVALID = [
    ("no-spec", "spec", _DELETE, "spec: Required value"),
    ("no-model", "spec.model", _DELETE, "spec.model: Required value"),
    ("empty-model-path", "spec.model.path", "", "spec.model.path"),
    ("no-algorithm", "spec.algorithm", _DELETE, "spec.algorithm: Required value"),
    ("unknown-algorithm", "spec.algorithm.name", "dpo", 'spec.algorithm.name: Unsupported value: "dpo"'),
    ("negative-lr", "spec.algorithm.learningRate", -0.1, "spec.algorithm.learningRate"),
    ("clip-ratio-1", "spec.algorithm.clipRatio", 1.0, "spec.algorithm.clipRatio"),
    ("epochs-0", "spec.algorithm.epochs", 0, "spec.algorithm.epochs"),
    ("micro-gt-mini", "spec.algorithm", {"name": "grpo", "miniBatchSize": 2, "microBatchSize": 4},
     "microBatchSize must not exceed algorithm.miniBatchSize"),
    ("bad-kl-estimator", "spec.algorithm.klEstimator", "k9", "spec.algorithm.klEstimator"),
    ("no-image", "spec.trainer.image", _DELETE, "spec.trainer.image: Required value"),
    ("nodes-0", "spec.trainer.nodes", 0, "spec.trainer.nodes: Invalid value: 0"),
    ("gpus-17", "spec.trainer.gpusPerNode", 17, "spec.trainer.gpusPerNode"),
    ("gpus-negative", "spec.trainer.gpusPerNode", -1, "spec.trainer.gpusPerNode"),
    ("no-total-steps", "spec.trainer.totalSteps", _DELETE, "spec.trainer.totalSteps: Required value"),
    ("batch-0", "spec.trainer.batchSize", 0, "spec.trainer.batchSize"),
    ("gpu-in-limits", "spec.trainer.resources", {"limits": {"nvidia.com/gpu": 8}},
     "set trainer.gpusPerNode instead of trainer.resources.limits"),
    ("bad-grace", "spec.trainer.terminationGracePeriodSeconds", -5, "spec.trainer.terminationGracePeriodSeconds"),
    ("bad-sa-annotation-key", "spec.serviceAccountAnnotations", {"not a key": "x"},
     "spec.serviceAccountAnnotations: Invalid value: keys must be qualified names"),
    ("reserved-env", "spec.trainer.env", [{"name": "AWS_SECRET_ACCESS_KEY", "value": "x"}],
     "use checkpoint.endpoint, checkpoint.region and checkpoint.credentialsSecret"),
    ("batch-layout", "spec.trainer.batchSize", 24,
     "trainer.batchSize (24) must be divisible by the number of ranks, trainer.nodes * max(1, trainer.gpusPerNode) = 16"),
    ("bad-toleration-op", "spec.trainer.tolerations", [{"key": "a", "operator": "Maybe"}], "operator"),
    ("bad-shm", "spec.trainer.shmSize", "lots", "spec.trainer.shmSize"),
    ("not-s3", "spec.checkpoint.uri", "gs://bucket/x", 'spec.checkpoint.uri: Invalid value: "gs://bucket/x": must be an S3 URI'),
    ("s3-no-bucket", "spec.checkpoint.uri", "s3://", 'spec.checkpoint.uri: Invalid value: "s3://": the S3 bucket must be'),
    ("no-ckpt-uri", "spec.checkpoint.uri", _DELETE, "spec.checkpoint.uri: Required value"),
    ("interval-0", "spec.checkpoint.interval", 0, "spec.checkpoint.interval"),
    ("keep-0", "spec.checkpoint.keep", 0, "spec.checkpoint.keep"),
    ("bad-endpoint", "spec.checkpoint.endpoint", "minio:9000", "spec.checkpoint.endpoint"),
    ("negative-restarts", "spec.failurePolicy.maxRestarts", -1, "spec.failurePolicy.maxRestarts"),
    ("overlapping-codes", "spec.failurePolicy", {"fatalExitCodes": [1, 78], "retryableExitCodes": [1]},
     "fatalExitCodes and failurePolicy.retryableExitCodes must not overlap"),
    ("explorer-without-inference", "spec.explorer", {"tasksetUri": "s3://data/tasks.jsonl"},
     "spec.explorer needs spec.inference"),
    ("bad-engine", "spec.inference", {"engine": "tgi"}, "spec.inference.engine"),
    ("staleness-negative", "spec.buffer", {"maxStaleness": -1}, "spec.buffer.maxStaleness"),
    ("sync-interval-0", "spec.sync", {"interval": 0}, "spec.sync.interval"),
    ("clip-high-10", "spec.algorithm.clipRatioHigh", 10, "spec.algorithm.clipRatioHigh"),
    ("clip-low-0", "spec.algorithm.clipRatioLow", 0, "spec.algorithm.clipRatioLow"),
    ("dual-clip-1", "spec.algorithm.dualClipRatio", 1.0, "spec.algorithm.dualClipRatio"),
    ("kl-full", "spec.algorithm.klEstimator", "full", 'spec.algorithm.klEstimator: Unsupported value: "full"'),
    ("warmup-negative", "spec.optimizer.warmupSteps", -1, "spec.optimizer.warmupSteps"),
    ("schedule-linear", "spec.optimizer.lrSchedule", "linear", "spec.optimizer.lrSchedule"),
    ("min-lr-ratio-2", "spec.optimizer.minLrRatio", 2, "spec.optimizer.minLrRatio"),
    ("betas-one", "spec.optimizer.betas", [0.9, 1.0], "spec.optimizer.betas[1]"),
    ("betas-three", "spec.optimizer.betas", [0.9, 0.99, 0.999], "spec.optimizer.betas"),
    ("seed-negative", "spec.trainer.seed", -1, "spec.trainer.seed"),
    ("dtype-fp8", "spec.model.dtype", "fp8", "spec.model.dtype"),
    ("prompt-format-xml", "spec.explorer", {"tasksetUri": "s3://data/t.jsonl", "promptFormat": "xml"},
     "spec.explorer.promptFormat"),
    ("buffer-local-path", "spec.buffer.uri", "/data/buffer", 'spec.buffer.uri: Invalid value: "/data/buffer": must be an S3 URI'),
    ("endpoint-credentials", "spec.checkpoint.endpoint", "http://KEY:SECRET@minio:9000",
     "spec.checkpoint.endpoint: Invalid value: checkpoint.endpoint must not carry credentials"),
    ("long-name", "metadata.name", "a" * 41, "metadata.name must be at most 40 characters"),
    ("name-starts-with-digit", "metadata.name", "1job", "metadata.name must start with a letter"),
]


def _create(api, namespace, manifest):
    return kubernetes.client.CustomObjectsApi(api).create_namespaced_custom_object(
        names.GROUP, names.VERSION, namespace, names.PLURAL, manifest)


def _patch(api, namespace, body):
    """A merge patch: no resourceVersion precondition, so an operator that happens to be
    writing the status meanwhile cannot turn the expected 422 into a 409."""
    return kubernetes.client.CustomObjectsApi(api).patch_namespaced_custom_object(
        names.GROUP, names.VERSION, namespace, names.PLURAL, "valid", body)


def _message(e: ApiException) -> str:
    try:
        return json.loads(e.body)["message"]
    except Exception:  # noqa: BLE001
        return str(e.body)


def test_at_least_twenty_cases():
    assert len(INVALID) >= 20


@pytest.mark.parametrize("path, value, expected", [x[1:] for x in INVALID], ids=[x[0] for x in INVALID])
def test_invalid_spec_is_refused_at_admission(installed, api, namespace, path, value, expected):
    manifest = _set(BASE, path, value)
    with pytest.raises(ApiException) as e:
        _create(api, namespace, manifest)
    assert e.value.status == 422, _message(e.value)
    assert expected in _message(e.value), _message(e.value)


def test_valid_minimal_spec_is_accepted_without_defaults_written(installed, api, namespace):
    created = _create(api, namespace, BASE)
    # No schema defaults: what the user applied is what is stored (no GitOps drift).
    assert created["spec"] == BASE["spec"]


ENDPOINT, BUFFER = "http://minio.storage:9000", "s3://ckpts/run-buffer"
STORAGE = _set(_set(BASE, "spec.checkpoint.endpoint", ENDPOINT), "spec.buffer.uri", BUFFER)
LORA = _set(BASE, "spec.model.lora", {"rank": 8})

# (case id, object created, merge-patched path, value, expected fragment); None removes.
IMMUTABLE = [
    ("model.path", BASE, "spec.model.path", "s3://models/other", "spec.model.path is immutable"),
    ("model.dtype-added", BASE, "spec.model.dtype", "bf16", "spec.model.dtype is immutable"),
    ("algorithm.name", BASE, "spec.algorithm.name", "ppo", "spec.algorithm.name is immutable"),
    ("trainer.nodes", BASE, "spec.trainer.nodes", 4, "trainer.nodes is immutable"),
    ("trainer.gpusPerNode", BASE, "spec.trainer.gpusPerNode", 4, "trainer.gpusPerNode is immutable"),
    ("checkpoint.uri", BASE, "spec.checkpoint.uri", "s3://ckpts/elsewhere", "spec.checkpoint.uri is immutable"),
    ("checkpoint.endpoint-changed", STORAGE, "spec.checkpoint.endpoint", "http://minio.other:9000",
     "spec.checkpoint.endpoint is immutable"),
    ("checkpoint.endpoint-added", BASE, "spec.checkpoint.endpoint", ENDPOINT, "spec.checkpoint.endpoint is immutable"),
    ("checkpoint.endpoint-removed", STORAGE, "spec.checkpoint.endpoint", None, "spec.checkpoint.endpoint is immutable"),
    ("buffer.uri-changed", STORAGE, "spec.buffer.uri", "s3://ckpts/other-buffer", "spec.buffer.uri is immutable"),
    ("buffer.uri-added", BASE, "spec.buffer.uri", BUFFER, "spec.buffer.uri is immutable"),
    ("buffer.uri-removed", STORAGE, "spec.buffer.uri", None, "spec.buffer.uri is immutable"),
    ("model.lora-added", BASE, "spec.model.lora", {"rank": 8}, "spec.model.lora is immutable"),
    ("model.lora-changed", LORA, "spec.model.lora.rank", 16, "spec.model.lora is immutable"),
    ("model.lora-removed", LORA, "spec.model.lora", None, "spec.model.lora is immutable"),
]


@pytest.mark.parametrize("created, path, value, expected", [x[1:] for x in IMMUTABLE], ids=[x[0] for x in IMMUTABLE])
def test_immutable_fields_cannot_change(installed, api, namespace, created, path, value, expected):
    _create(api, namespace, created)
    with pytest.raises(ApiException) as e:
        _patch(api, namespace, _set({}, path, value))
    assert e.value.status == 422 and expected in _message(e.value), _message(e.value)


def test_verl_knobs_are_accepted_and_null_disables_dual_clip(installed, api, namespace):
    """verl's names pass admission, and `dualClipRatio: null` is stored as null (the
    field is nullable), which the operator parses as "dual clip off"."""
    from rft_contract.spec import parse_spec

    manifest = _set(BASE, "spec.algorithm", {
        "name": "grpo", "klEstimator": "abs", "clipRatioLow": 0.2, "clipRatioHigh": 0.28,
        "dualClipRatio": None, "useKlLoss": False})
    manifest = _set(manifest, "spec.optimizer", {"warmupSteps": 5, "lrSchedule": "cosine", "minLrRatio": 0.1})
    created = _create(api, namespace, manifest)
    assert created["spec"]["algorithm"]["dualClipRatio"] is None
    assert parse_spec(created["spec"]).algorithm.dual_clip_ratio is None
    assert parse_spec(BASE["spec"]).algorithm.dual_clip_ratio == 3.0


def test_mutable_fields_can_change(installed, api, namespace):
    _create(api, namespace, STORAGE)
    patched = _patch(api, namespace, {"spec": {"suspend": True, "trainer": {"totalSteps": 999},
                                               "checkpoint": {"endpoint": ENDPOINT}, "buffer": {"maxStaleness": 3}}})
    assert patched["spec"]["trainer"]["totalSteps"] == 999 and patched["spec"]["suspend"] is True
    assert patched["spec"]["checkpoint"]["endpoint"] == ENDPOINT and patched["spec"]["buffer"]["maxStaleness"] == 3
