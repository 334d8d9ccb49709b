"""The rollout pods' lifecycle: inference replicas and explorers. Pure, no I/O.

They live across trainer attempts (a gang restart does not touch them) and go with
suspend and failure. After success the explorers stop at once, and the inference pods
once they serve the final weights, bounded by FINAL_SYNC_GRACE_SECONDS after completion,
so whoever evaluates the result finds the final policy being served. While the job runs,
a missing pod is created, and a failed, lost or drifted one (spec hash) is deleted and
created again by a later pass, once its name is free.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from rft_contract import names
from rft_contract.times import parse_time
from rft_contract.spec import RFTJobSpec

from . import failure_policy
from .conditions import Cond
from .model import Obj, PodView, compute_deletions
from .objects import JobRef
from .rollout_pods import build_rollout_pods


@dataclass(frozen=True)
class Rollouts:
    create: tuple[Obj, ...] = ()
    delete: tuple[str, ...] = ()
    requeue_after: float | None = None  # while the final sync grace runs


def compute_rollouts(ref: JobRef, spec: RFTJobSpec | None, gang_status: Obj, sync_cond: Cond | None,
                     pods: list[PodView], now: datetime, hold: bool = False) -> Rollouts:
    """What to do with the rollout pods, given the gang's phase and completion time from
    this pass and the WeightsSynced condition (None for train-only jobs). `hold`: Kueue has
    not admitted the job (or evicted it): no pods, as when suspended."""
    phase = gang_status.get("phase")
    if spec is None or phase in (names.SUSPENDED, names.FAILED) or (hold and phase not in names.TERMINAL_PHASES):
        return Rollouts(delete=compute_deletions((), [x for x in pods if x.active]))
    if phase == names.SUCCEEDED:
        delete = compute_deletions((), [x for x in pods if x.active and x.role == names.ROLE_EXPLORER])
        wait = compute_final_sync_wait(sync_cond, gang_status.get("completionTime"), now)
        if wait > 0:
            return Rollouts(delete=delete, requeue_after=wait)
        return Rollouts(delete=compute_deletions(delete, [x for x in pods if x.active]))
    return _keep_desired(ref, spec, pods)


def describe_explorers(spec: RFTJobSpec | None, pods: list[PodView]) -> str:
    """Explorer pods that are not running, for the progress deadline's message ("" when
    all run): a trainer waiting for experiences often waits on them. Their throttle is not
    visible here: an explorer waits on what it wrote minus what the trainer consumed
    (`status.trainer.buffer.consumed`, which the trainer's own waiting message lists), and
    what it wrote lives only in the buffer."""
    if spec is None or spec.explorer is None:
        return ""
    want = spec.explorer.replicas
    explorers = sorted((x for x in pods if x.role == names.ROLE_EXPLORER), key=lambda x: x.name)
    running = [x for x in explorers if x.phase == "Running" and not x.deleting]
    if len(running) >= want:
        return ""
    others = [f"{x.name} {'deleting' if x.deleting else x.phase}" for x in explorers if x not in running]
    return f"{len(running)}/{want} explorer pods running" + (f" ({', '.join(others[:3])})" if others else "")


def compute_final_sync_wait(sync_cond: Cond | None, completion_time: str | None, now: datetime) -> float:
    """Seconds the inference pods of a succeeded job still wait for the final weights:
    0 once every replica is synced (or nothing syncs), or once the grace is spent."""
    if sync_cond is None or sync_cond.status:
        return 0.0
    done_at = parse_time(completion_time)
    return failure_policy.backoff_remaining(done_at, names.FINAL_SYNC_GRACE_SECONDS, now)


def _keep_desired(ref: JobRef, spec: RFTJobSpec, pods: list[PodView]) -> Rollouts:
    """Create missing pods; delete unwanted, drifted, failed or lost ones. A deleted pod's
    name is taken until it is gone, so its replacement comes in a later pass."""
    desired = {obj["metadata"]["name"]: obj for obj in build_rollout_pods(ref, spec)}
    doomed = [x for x in pods if should_replace(x, desired.get(x.name))]
    seen = {x.name for x in pods}
    return Rollouts(create=tuple(obj for name, obj in desired.items() if name not in seen),
                    delete=compute_deletions((), doomed))


def should_replace(pod: PodView, want: Obj | None) -> bool:
    """Not desired any more, rendered from an older spec, or ended (Failed/Unknown)."""
    drifted = want is not None and pod.spec_hash != want["metadata"]["annotations"][names.ANNOTATION_SPEC_HASH]
    return want is None or drifted or pod.phase in ("Failed", "Unknown")
