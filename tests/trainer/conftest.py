"""Fixtures for in-process trainer tests."""

from __future__ import annotations

import socket

import pytest
import torch

from rft_trainer.parallelize import init_distributed


@pytest.fixture
def world_of_one(monkeypatch):
    """A one-process gloo group (fully_shard needs a process group); its Runtime."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0",
                 "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(k, v)
    yield init_distributed()
    torch.distributed.destroy_process_group()
