"""Fixtures for in-process trainer tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from rft_trainer.parallelize import init_distributed


@contextmanager
def one_process_group():
    """A one-process gloo group (fully_shard needs a process group); its Runtime."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.MonkeyPatch.context() as monkeypatch:
        for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0",
                     "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
            monkeypatch.setenv(k, v)
        try:
            yield init_distributed()
        finally:
            torch.distributed.destroy_process_group()


@pytest.fixture
def world_of_one():
    with one_process_group() as rt:
        yield rt


@pytest.fixture
def server():
    """A reference inference server (rft_serving.serve) on loopback, no weights loaded."""
    from rft_serving.serve import ReferenceServer

    s = ReferenceServer(max_concurrency=4)
    s.start()
    yield s
    s.stop()


@pytest.fixture(scope="session")
def lr1e6_exports(tmp_path_factory) -> tuple[Path, Path]:
    """Two versions of SmolLM2-135M (tied embeddings) one GRPO step apart at lr 1e-6, fp32
    master weights, exported in bf16 by the engine's own export_policy (weights, probe,
    fingerprint): tests/trainer/fingerprint_worker.py. About a minute on 2 cores."""
    from tests.fixtures.real_model import smollm2_dir

    here = Path(__file__).parent
    root = tmp_path_factory.mktemp("lr1e6")
    old, new = root / "v1", root / "v2"
    path = os.pathsep.join(p for p in (str(here.parents[1]), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONPATH": path}
    res = subprocess.run([sys.executable, str(here / "fingerprint_worker.py"), str(smollm2_dir()), str(old), str(new)],
                         capture_output=True, text=True, env=env, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    return old, new
