"""End to end: the RL loop cannot deadlock. The sample job on the local cluster (fixtures
from test_rftjob.py: real processes, a real S3 server), with weight sync held back and
with trainer workers killed at the awkward moments, must still finish.
"""

from __future__ import annotations

import json
import signal

import pytest

from rft_contract import names
from rft_contract.layout import METRICS
from rft_contract.s3 import S3Storage
from rft_contract.storage import join
from tests.e2e.test_rftjob import (  # noqa: F401 - fixtures
    INTERVAL, RESULTS, STEPS, ckpt_step, job, s3, s3_client_env, stack, status, step, trainer_worker, wait_status,
)

pytestmark = pytest.mark.e2e
BATCH = 32  # the sample's trainer.batchSize


def trainer(s: dict) -> dict:
    return s.get("trainer") or {}


def attempt_steps(uri: str) -> dict[int, list[int]]:
    """Steps each attempt logged to <uri>/metrics/attempt-<n>.jsonl, in order."""
    storage, out = S3Storage(), {}
    for key in storage.list(join(uri, METRICS) + "/"):
        attempt = int(key.rsplit("attempt-", 1)[1].split(".")[0])
        out[attempt] = [json.loads(line)["step"] for line in storage.read_bytes(key).splitlines() if line]
    return out


@pytest.mark.timeout(1200)  # the waits below add up to more than the default 300 s
def test_weight_sync_held_back_the_trainer_says_why_and_the_job_finishes_once_released(job):
    """Operator down: nobody promotes new weights, the explorer's rollouts go stale, the
    trainer drops them and waits. The explorer must keep writing (stale samples release
    its budget) and the trainer must say why it waits; once the operator is back the job
    finishes. Before, both sides waited for each other for ever."""
    j = job()
    op = j["operator"]
    wait_status(j, lambda s: step(s) >= 1, 400, "training")
    op.kill()
    try:
        s = wait_status(j, lambda s: (trainer(s).get("waiting") or {}).get("reason") == names.WAIT_STALE, 400,
                        "the trainer waiting on stale experiences")
        held_at, dropped = step(s), (trainer(s).get("buffer") or {}).get("droppedStale") or 0
        assert "dropped as stale" in s["trainer"]["waiting"]["message"]
        # The explorer is not stuck: what it writes keeps being dropped while the step stays.
        s = wait_status(j, lambda s: ((trainer(s).get("buffer") or {}).get("droppedStale") or 0) >= dropped + BATCH,
                        300, "the explorer writing on while the trainer drops stale samples")
        assert step(s) == held_at
    finally:
        op.start()
    s = wait_status(j, lambda s: s.get("phase") == "Succeeded", 600, "Succeeded after weight sync resumed")
    assert step(s) == STEPS and s.get("restarts") == 0 and "waiting" not in trainer(s)
    RESULTS["weight_sync_held"] = {"held_at_step": held_at, "dropped_stale": trainer(s)["buffer"]["droppedStale"]}


@pytest.mark.timeout(1800)
def test_workers_killed_before_a_checkpoint_mid_interval_and_right_after_one(job):
    """SIGKILL a trainer worker three times, the explorer ahead each time: before the first
    checkpoint, mid-interval, and right after a checkpoint. Each attempt resumes at the last
    checkpoint and trains every later step exactly once; the job finishes."""
    j = job()
    points = [
        ("before the first checkpoint", lambda s: step(s) >= 1 and ckpt_step(s) == 0),
        ("mid-interval", lambda s: ckpt_step(s) >= INTERVAL and step(s) % INTERVAL == 1),
        ("right after a checkpoint", lambda s: ckpt_step(s) >= 2 * INTERVAL and ckpt_step(s) == step(s)),
    ]
    seen = []
    for attempt, (what, ready) in enumerate(points, start=1):
        s = wait_status(j, lambda s, a=attempt: s.get("attempt") == a and s.get("phase") == "Running"
                        and trainer(s).get("attempt") == a and ready(s), 400, f"attempt {attempt}: {what}")
        trainer_worker(j, rank=1).send_signal(signal.SIGKILL)
        seen.append((what, step(s), ckpt_step(s)))
        # Where the next attempt resumed, as its trainer reports it: the step in the status
        # may already have moved on by the time this poll sees the new attempt.
        s = wait_status(j, lambda s, a=attempt + 1: (trainer(s).get("resumedFrom") or {}).get("attempt") == a,
                        400, f"attempt {attempt + 1}")
        resumed = trainer(s)["resumedFrom"]["step"]
        assert seen[-1][2] <= resumed <= seen[-1][2] + INTERVAL, (what, seen[-1], resumed)
        seen[-1] += (resumed,)
    s = wait_status(j, lambda s: s.get("phase") == "Succeeded", 600, "Succeeded")
    assert step(s) == STEPS and (s["restarts"], s["attempt"]) == (3, 4)
    steps = attempt_steps(j["uri"])
    final = steps[4]
    resumed = seen[-1][3]
    assert final == list(range(resumed + 1, STEPS + 1)), f"attempt 4 trained {final} after resuming at {resumed}"
    assert trainer(s)["buffer"]["samples"] == STEPS * BATCH  # the buffer position resumed with the model
    RESULTS["kills"] = {"points": [dict(zip(("at", "step", "checkpoint", "resumed"), p)) for p in seen]}
