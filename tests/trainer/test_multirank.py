"""Two trainer "pods" (separate launchers, as the operator starts them) x two processes,
on one machine: the ranks train on one batch decision, and stop together.

Explorers are threads here that write shards the way the explorer pods do
(`<seq:010d>-e<index:03d>`, tensors then JSON): the buffer protocol is what the trainer
meets; real explorers need inference pods (tests/trainer/test_explorer.py, tests/e2e).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from rft_trainer.experience import write_shard
from rft_rollout.explorer import shard_name
from tests.fixtures.batches import synthetic_batch
from tests.fixtures.models import save_tiny_model

ROOT = Path(__file__).resolve().parents[2]
BATCH, SHARD = 8, 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shard(explorer: int, seq: int):
    exp = synthetic_batch(SHARD, 4, 6, vocab=24, group_size=SHARD, seed=1000 * explorer + seq)
    exp.group_ids = torch.full((SHARD,), 1000 * explorer + seq)
    exp.info = [{"id": f"e{explorer}-{seq}-{k}"} for k in range(SHARD)]
    return exp


def config(d: Path, total_steps: int, buffer: Path, interval: int) -> Path:
    cfg = {
        "model": {"path": str(d / "model")},
        "algorithm": {"name": "grpo", "learning_rate": 1e-4, "micro_batch_size": 2},
        "trainer": {"image": "x", "nodes": 2, "gpus_per_node": 0, "total_steps": total_steps,
                    "batch_size": BATCH, "fsdp": {"mixed_precision": "fp32"}},
        "checkpoint": {"uri": str(d / "ckpt"), "interval": interval, "keep": 5},
        "buffer": {"uri": str(buffer), "wait": True, "poll_seconds": 0.2},
        "job": {"name": "t", "namespace": "default", "uid": "u"},
    }
    p = d / f"config-{total_steps}.json"
    p.write_text(json.dumps(cfg))
    return p


def launch(d: Path, cfg: Path, node: int, port: int, trace: Path, **env) -> subprocess.Popen:
    """One pod's launcher: `rft_trainer.launch` with the operator's static rendezvous."""
    cmd = [sys.executable, "-m", "rft_trainer.launch", "--nnodes=2", "--nproc-per-node=2",
           f"--node-rank={node}", "--master-addr=127.0.0.1", f"--master-port={port}",
           str(ROOT / "tests" / "trainer" / "loop_worker.py"), "--config", str(cfg)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), "RFT_TEST_TRACE_DIR": str(trace),
           "RFT_CKPT_STAGING": str(d / f"staging-{node}"), "RFT_STAGING_DIR": str(d / f"staging-{node}"),
           **env}
    env.pop("RFT_JOB_NAME", None)  # no status reporting
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=d, start_new_session=True)


def traces(trace: Path) -> dict[int, list[dict]]:
    return {r: traces_of(trace, r) for r in range(4)}


def finish(procs: list[subprocess.Popen], timeout: float) -> list[tuple[int, str, str]]:
    out = []
    try:
        for p in procs:
            o, e = p.communicate(timeout=timeout)
            out.append((p.returncode, o, e))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    return out


class Explorers:
    """Two writers in explorer naming; e001 always lags: it commits seq k only after the
    trainer trained e000's seq k+1, so its shards land behind the reader's position in
    name order (a single name-order position skips all of them)."""

    def __init__(self, buffer: Path, trace: Path, shards_each: int):
        self.buffer, self.trace, self.n = buffer, trace, shards_each
        self.stop = threading.Event()
        self.written: dict[int, list[str]] = {0: [], 1: []}
        self.threads = [threading.Thread(target=self._run, args=(e,), daemon=True) for e in (0, 1)]

    def _trained(self, sample_id: str) -> bool:
        return any(sample_id in t["ids"] for t in traces_of(self.trace, 0))

    def _run(self, explorer: int) -> None:
        for seq in range(self.n):
            while explorer == 1 and not self.stop.is_set() and not self._trained(f"e0-{min(seq + 1, self.n - 1)}-0"):
                self.stop.wait(0.05)
            if self.stop.is_set():
                return
            exp = shard(explorer, seq)
            write_shard(str(self.buffer), shard_name(seq, explorer), exp)
            self.written[explorer] += [i["id"] for i in exp.info]

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(10)


@pytest.fixture
def job(tmp_path):
    save_tiny_model(tmp_path / "model")
    buffer = tmp_path / "buffer"
    buffer.mkdir()
    trace = tmp_path / "trace"
    trace.mkdir()
    return tmp_path, buffer, trace


@pytest.mark.timeout(420)  # two runs of up to 150 s each; the launchers are killed on expiry
def test_two_explorers_two_pods_every_sample_trained_once_in_the_same_order_and_resumed(job):
    d, buffer, trace = job
    with Explorers(buffer, trace, shards_each=12) as explorers:
        port = free_port()
        procs = [launch(d, config(d, 6, buffer, interval=3), node, port, trace) for node in (0, 1)]
        results = finish(procs, timeout=150)
        for code, _, err in results:
            assert code == 0, err[-3000:]
        port = free_port()
        procs = [launch(d, config(d, 10, buffer, interval=3), node, port, trace) for node in (0, 1)]
        results = finish(procs, timeout=150)
        for code, _, err in results:
            assert code == 0, err[-3000:]
        written = {e: list(ids) for e, ids in explorers.written.items()}
    runs = traces(trace)
    assert [t["step"] for t in runs[0]] == list(range(1, 11))  # the resume continued at step 7
    for r in (1, 2, 3):
        assert runs[r] == runs[0], f"rank {r} trained other samples than rank 0"
    trained = [i for t in runs[0] for i in t["ids"]]
    assert len(trained) == len(set(trained)) == 10 * BATCH, "a sample was trained twice"
    for e in (0, 1):  # per explorer: a prefix of what it wrote, in its order (nothing skipped)
        mine = [i for i in trained if i.startswith(f"e{e}-")]
        assert mine == written[e][: len(mine)], f"explorer {e}'s samples skipped or reordered"
    assert {i.split("-")[0] for i in trained} == {"e0", "e1"}


def test_sigterm_seconds_apart_on_two_pods_stops_both_at_one_step_with_one_checkpoint(job):
    d, buffer, trace = job
    for seq in range(150):  # plenty of data: the trainer would run on for minutes
        for e in (0, 1):
            write_shard(str(buffer), shard_name(seq, e), shard(e, seq))
    port = free_port()
    cfg = config(d, 10_000, buffer, interval=10_000)  # no checkpoint but the one on stop
    procs = [launch(d, cfg, node, port, trace, RFT_TERMINATION_GRACE_SECONDS="120") for node in (0, 1)]
    try:
        deadline = time.monotonic() + 180
        while not (trace / "rank0.jsonl").exists() or len(traces_of(trace, 0)) < 2:
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "no step 2"
            time.sleep(0.1)
        procs[1].send_signal(signal.SIGTERM)  # the pod without rank 0 first
        time.sleep(2.0)  # the fault itself: the other pod's SIGTERM comes seconds later
        procs[0].send_signal(signal.SIGTERM)
        results = finish(procs, timeout=120)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    for code, _, err in results:
        # Terminated, the operator's gang semantics: the launcher exits 128 + 15, or, when the
        # late SIGTERM lands after torchrun's agent has put the default handler back (the
        # workers already stopped on the other pod's signal), dies of it: -15 here, exit code
        # 143 in the container's status either way.
        assert code in (143, -signal.SIGTERM), err[-3000:]
    steps = {r: [t["step"] for t in traces_of(trace, r)] for r in range(4)}
    last = steps[0][-1]
    assert all(s[-1] == last for s in steps.values()), steps
    ckpts = sorted(p.name for p in (d / "ckpt" / "ckpt").iterdir())
    assert ckpts == [f"step-{last:08d}"]
    manifest = json.loads((d / "ckpt" / "ckpt" / ckpts[0] / "manifest.json").read_text())
    assert manifest["world_size"] == 4 and manifest["step"] == last
    err = results[0][2] + results[1][2]
    assert "stop agreed after step" in err and "(on another rank)" in err
    assert "workers get 115s after SIGTERM (grace period 120s)" in err


def traces_of(trace: Path, rank: int) -> list[dict]:
    path = trace / f"rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
