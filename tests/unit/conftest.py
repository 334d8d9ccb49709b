from __future__ import annotations

import copy
from datetime import datetime, timezone

import pytest

NOW = datetime(2026, 11, 30, 12, 0, 0, tzinfo=timezone.utc)

SPEC = {
    "model": {"path": "s3://models/tiny-qwen"},
    "algorithm": {"name": "grpo", "learningRate": 1e-6},
    "trainer": {
        "image": "ghcr.io/rft-dev/trainer:0.1.0",
        "nodes": 2,
        "gpusPerNode": 8,
        "totalSteps": 100,
        "batchSize": 64,
        "resources": {"requests": {"cpu": "8", "memory": "64Gi"}},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    },
    "checkpoint": {
        "uri": "s3://ckpts/demo",
        "interval": 10,
        "credentialsSecret": "s3-creds",
        "endpoint": "http://minio.storage:9000",
    },
    "failurePolicy": {"maxRestarts": 2, "backoffSeconds": 30},
}


def make_job(spec: dict | None = None, status: dict | None = None, generation: int = 1) -> dict:
    return {
        "apiVersion": "rft.dev/v1alpha1",
        "kind": "RFTJob",
        "metadata": {
            "name": "demo",
            "namespace": "team-a",
            "uid": "0000-1111",
            "generation": generation,
            "resourceVersion": "42",
        },
        "spec": copy.deepcopy(spec if spec is not None else SPEC),
        "status": status or {},
    }


@pytest.fixture
def job():
    return make_job()
