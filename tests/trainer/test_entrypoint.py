"""`python -m rft_trainer` as the operator runs it: torchrun, a config file, experiences
in a buffer directory. Exit codes carry the gang semantics (0 done, 78 fatal, 143 after
SIGTERM)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rft_trainer.experience import write_shard
from tests.fixtures.models import save_tiny_model
from tests.fixtures.batches import synthetic_batch

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    d = tmp_path_factory.mktemp("job")
    model = save_tiny_model(d / "model")
    buffer = d / "buffer"
    buffer.mkdir()
    for i in range(6):
        write_shard(str(buffer), f"shard-{i:04d}", synthetic_batch(8, 4, 6, vocab=24, seed=i))
    config = {
        "model": {"path": str(model)},
        "algorithm": {"name": "grpo", "learning_rate": 1e-4, "micro_batch_size": 2},
        "trainer": {"image": "ignored:by-trainer", "nodes": 1, "gpus_per_node": 0,
                    "total_steps": 3, "batch_size": 8, "fsdp": {"mixed_precision": "fp32"}},
        "checkpoint": {"uri": "per-run", "interval": 2, "keep": 2},
        "buffer": {"uri": str(buffer)},
        "job": {"name": "t", "namespace": "default", "uid": "u"},
    }
    return d, config


def torchrun(config_path: Path, nproc: int = 2, **kw) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "rft_trainer.launch", f"--nproc-per-node={nproc}",
           "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0", "-m", "rft_trainer",
           "--config", str(config_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RFT_JOB_NAME": "t"}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, **kw)


def write(d: Path, name: str, config: dict) -> Path:
    """Each run gets its own checkpoint directory unless the config names one."""
    config = {**config, "checkpoint": {**config["checkpoint"]}}
    if config["checkpoint"]["uri"] == "per-run":
        config["checkpoint"]["uri"] = str(d / f"ckpt-{Path(name).stem}")
    p = d / name
    p.write_text(json.dumps(config))
    return p


def test_trains_to_total_steps_with_two_ranks(job):
    d, config = job
    proc = torchrun(write(d, "ok.json", config))
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]
    steps = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [s["step"] for s in steps] == [1, 2, 3]  # rank 0 only reports
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/lr",
                "perf/throughput", "response_length/mean", "critic/advantages/mean", "time/step"):
        assert key in steps[-1], key


def test_a_restarted_run_resumes_from_its_last_checkpoint(job):
    d, config = job
    proc = torchrun(write(d, "resume.json", config))
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]
    ckpt = d / "ckpt-resume" / "ckpt"
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-00000002", "step-00000003"]  # keep=2
    manifest = json.loads((ckpt / "step-00000003" / "manifest.json").read_text())
    assert manifest["step"] == 3 and manifest["world_size"] == 2 and len(manifest["config_hash"]) == 16
    more = {**config, "trainer": {**config["trainer"], "total_steps": 5}}
    # Same checkpoint directory: this is the gang's next attempt.
    more["checkpoint"] = {**config["checkpoint"], "uri": str(d / "ckpt-resume")}
    proc = torchrun(write(d, "resume2.json", more))
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]
    steps = [json.loads(line)["step"] for line in out.splitlines() if line.startswith("{")]
    assert steps == [4, 5]  # steps 1-3 were not trained again


def test_weights_are_exported_every_sync_interval_and_at_the_end(job):
    from rft_trainer.export import committed_versions, verify
    from rft_contract.storage import LocalStorage

    d, config = job
    cfg = {**config, "trainer": {**config["trainer"], "total_steps": 5}, "sync": {"interval": 2, "keep": 2}}
    proc = torchrun(write(d, "sync.json", cfg))
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]
    root = str(d / "ckpt-sync")
    # Exported at 2 and 4 (interval) and 5 (the end); keep=2 dropped version 2.
    assert committed_versions(LocalStorage(), root) == [4, 5]
    assert "weights retention: deleted version 2" in err
    manifest = verify(LocalStorage(), f"{root}/weights/step-00000005")
    assert manifest["step"] == 5 and len(manifest["id"]) == 16 and "config.json" in manifest["files"]


def test_config_typo_exits_78_naming_the_key(job):
    d, config = job
    bad = {**config, "algorithm": {**config["algorithm"], "lerning_rate": 1e-4}}
    proc = torchrun(write(d, "typo.json", bad), nproc=1)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 78, err[-2000:]  # EX_CONFIG: the operator's default fatal code
    assert "algorithm.lerning_rate: unknown key (did you mean learning_rate?)" in err


def test_indivisible_batch_is_fatal_not_a_hang(job):
    d, config = job
    bad = {**config, "trainer": {**config["trainer"], "batch_size": 7}}
    proc = torchrun(write(d, "layout.json", bad), nproc=2)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 78, err[-2000:]
    assert "trainer.batch_size=7 must be divisible" in err


def test_malformed_shard_brings_every_rank_down(job, tmp_path):
    d, config = job
    buffer = tmp_path / "buffer"
    buffer.mkdir()
    write_shard(str(buffer), "shard-0000", synthetic_batch(8, 4, 6, vocab=24, seed=0))
    (buffer / "shard-0000.safetensors").write_bytes(b"not a safetensors file")
    proc = torchrun(write(d, "corrupt.json", {**config, "buffer": {"uri": str(buffer)}}), nproc=2)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode != 0
    # The pod's last log line, which the operator quotes in lastFailure, names the worker's
    # error in one short line, inside what the kubelet keeps of a failed container's log.
    kept = err.encode()[-2048:].decode(errors="replace")
    last = kept.strip().splitlines()[-1]
    assert "rank" in last and "exited with code 1:" in last and "shard-0000" in last, err[-3000:]
    assert "Error" in last and "Traceback" not in last and "extraInfo" not in last and len(last) < 400, last


def test_sigterm_stops_after_the_step_and_exits_nonzero(job, tmp_path):
    d, config = job
    long = {**config, "trainer": {**config["trainer"], "total_steps": 10_000}}
    # Endless data: the same shards over and over are enough to keep it busy.
    buffer = tmp_path / "buffer"
    buffer.mkdir()
    for i in range(200):
        write_shard(str(buffer), f"shard-{i:04d}", synthetic_batch(8, 4, 6, vocab=24, seed=i))
    proc = torchrun(write(d, "long.json", {**long, "buffer": {"uri": str(buffer)}}), nproc=1)
    deadline = time.monotonic() + 180
    first = proc.stdout.readline()  # blocks until step 1 is reported
    assert first.startswith("{"), first
    assert time.monotonic() < deadline
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-2000:]
    assert "SIGTERM: stopping after the current step" in err
    assert "stopping at step" in err  # the save-on-stop decision is logged with its reason


def test_launcher_gives_workers_the_grace_period_not_torchruns_30s():
    from torch.distributed.run import get_args_parser

    from rft_trainer.launch import SHUTDOWN_ENV, set_shutdown_timeout

    args = lambda *a: get_args_parser().parse_args([*a, "--nproc-per-node=1", "x.py"])  # noqa: E731
    env = {"RFT_TERMINATION_GRACE_SECONDS": "300"}
    assert set_shutdown_timeout(args(), env) == 295 and env[SHUTDOWN_ENV] == "295"
    env = {"RFT_TERMINATION_GRACE_SECONDS": "300", SHUTDOWN_ENV: "100"}  # explicit wins
    assert set_shutdown_timeout(args(), env) == 100
    env = {"RFT_TERMINATION_GRACE_SECONDS": "300"}
    assert set_shutdown_timeout(args("--shutdown-timeout=60"), env) == 60 and env[SHUTDOWN_ENV] == "60"
    assert set_shutdown_timeout(args(), {}) is None  # outside a pod: torchrun's default


def test_the_launchers_last_line_is_the_workers_exception_in_one_short_line(tmp_path):
    from types import SimpleNamespace

    from rft_trainer.launch import SAID_CHARS, said_by

    error_file = tmp_path / "error.json"
    error_file.write_text("{}")
    # What torch hands over from the error file `@record` wrote: the exception and its traceback.
    raised = SimpleNamespace(exitcode=1, error_file=str(error_file), message={
        "message": "ValueError: bad shard\n" + "x" * 1000,
        "extraInfo": {"py_callstack": "Traceback (most recent call last): ...", "timestamp": "1"}})
    line = said_by(raised)
    assert line.startswith("ValueError: bad shard xxx") and line.endswith("...") and len(line) == SAID_CHARS
    killed = SimpleNamespace(exitcode=-9, error_file=None, message="Signal 9 (SIGKILL) received by PID 7")
    assert said_by(killed) == "Signal 9 (SIGKILL) received by PID 7"
    silent = SimpleNamespace(exitcode=3, error_file=str(tmp_path / "none.json"), message="To enable traceback see: ...")
    assert said_by(silent) == "its log is above"


def test_an_unsupported_model_exits_78_and_the_last_line_names_it(job, tmp_path):
    """An encoder-only model (BERT) cannot be trained: every rank refuses it at start
    (models.check_supported), and the pod's last line, which the operator quotes in
    status.lastFailure.message, names the model_type, the class and why."""
    from tests.fixtures.architectures import save_tiny

    d, config = job
    bert = save_tiny("bert", tmp_path / "bert")
    proc = torchrun(write(d, "bert.json", {**config, "model": {"path": str(bert)}}), nproc=2)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 78, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert "exited with code 78: unsupported model: model_type 'bert': encoder-only" in last[:200], last
    assert last.endswith("(BertLMHeadModel)") and len(last) < 300, last
