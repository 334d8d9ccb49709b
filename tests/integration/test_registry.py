"""The local registry (e2e/registry.py): a real `registry` process, its lifecycle and
its storage surviving restarts (the image build relies on it as its cache)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import time
import urllib.request

import psutil
import pytest

from e2e.registry import Registry

pytestmark = pytest.mark.integration

OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def push_blob(address: str, repository: str, data: bytes) -> str:
    """A monolithic blob upload: POST for an upload URL, then PUT with the digest."""
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    post = urllib.request.Request(f"http://{address}/v2/{repository}/blobs/uploads/", method="POST")
    with OPENER.open(post, timeout=10) as resp:
        assert resp.status == 202
        location = resp.headers["Location"]
    if location.startswith("/"):
        location = f"http://{address}{location}"
    sep = "&" if "?" in location else "?"
    put = urllib.request.Request(f"{location}{sep}digest={digest}", data=data, method="PUT",
                                 headers={"Content-Type": "application/octet-stream"})
    with OPENER.open(put, timeout=10) as resp:
        assert resp.status == 201
    return digest


def get_blob(address: str, repository: str, digest: str) -> bytes:
    with OPENER.open(f"http://{address}/v2/{repository}/blobs/{digest}", timeout=10) as resp:
        return resp.read()


@pytest.fixture
def registry(tmp_path):
    reg = Registry(tmp_path / "state", storage=tmp_path / "storage")
    yield reg
    reg.stop()


def recorded_pid(reg: Registry) -> int:
    return json.loads(reg.record_file.read_text())["pid"]


def test_restart_keeps_pushed_blobs(registry, tmp_path):
    address = registry.ensure()
    assert address.startswith("127.0.0.1:") and registry.running()
    assert registry.ensure() == address  # already up: the same process
    record = json.loads(registry.record_file.read_text())
    assert set(record) == {"pid", "create_time", "exe", "port"}
    assert registry.manifest_digest("test/blob", "missing") is None

    data = os.urandom(4096)
    digest = push_blob(address, "test/blob", data)
    assert registry.blob_sizes()[digest] == len(data)
    assert str(tmp_path / "storage") in (registry.state_dir / "config.yml").read_text()

    pid = recorded_pid(registry)
    registry.stop()
    assert not registry.running() and not registry.record_file.exists()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE

    address = registry.ensure()
    assert get_blob(address, "test/blob", digest) == data


def test_ensure_replaces_a_killed_registry(registry):
    registry.ensure()
    pid = recorded_pid(registry)
    os.kill(pid, signal.SIGKILL)
    psutil.Process(pid).wait(timeout=10)
    assert not registry.running()
    registry.ensure()
    assert registry.running() and recorded_pid(registry) != pid


def test_stop_leaves_a_process_that_reused_the_pid_alone(registry):
    """A record whose PID now belongs to another process (create time differs)."""
    other = subprocess.Popen(["sleep", "30"])
    try:
        registry.state_dir.mkdir(parents=True)
        registry.record_file.write_text(json.dumps({
            "pid": other.pid, "create_time": psutil.Process(other.pid).create_time() - 100,
            "exe": "/usr/bin/sleep", "port": 1}))
        assert not registry.running()
        registry.stop()
        time.sleep(0.2)
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()
