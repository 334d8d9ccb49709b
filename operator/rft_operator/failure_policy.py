"""The failure policy: what ends an attempt of the trainer gang (`compute_failure`), and
whether the job restarts (retryable, a disruption) or fails (fatal exit code, budget spent).

Across the gang: one rank's failure usually takes the others down with it (NCCL errors,
torchrun's own shutdown), so the rank that ended first is the root cause (a deleted pod
ended when its delete was requested), except that a code in `fatalExitCodes` on any rank
fails the job. A pod the cluster disrupted (condition DisruptionTarget: evicted,
preempted, tainted away, garbage-collected) restarts the gang without using
`maxRestarts`, counted in `status.disruptions`, if it is the root cause; a node-pressure
eviction by the kubelet uses the budget like a crash. Pure, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime, timezone

from rft_contract import names
from rft_contract.failures import DISRUPTED, FATAL, RETRYABLE
from rft_contract.spec import FailurePolicy
from rft_contract.times import format_time

from .logtail import last_line, log_tail, redact
from .model import Obj, PodView

# The verdicts are the failure-action catalogue's names (rft_contract.failures); the gang
# acts on each through its handler (gang.ACTIONS). DISRUPTED: the cluster stopped the pod,
# restart without using the budget.

# DisruptionTarget reasons say the cluster stopped the pod for reasons of its own:
# EvictionByEvictionAPI (drain, descheduler), PreemptionByScheduler, DeletionByTaintManager
# (node not ready or unreachable), DeletionByPodGC (node gone). TerminationByKubelet is the
# exception: the kubelet's node-pressure eviction is often the job's own memory use.
TERMINATION_BY_KUBELET = "TerminationByKubelet"
# The kubelet also uses TerminationByKubelet for a graceful node shutdown, and then sets the
# pod's status.reason to this ("Shutdown" before Kubernetes 1.27); node pressure sets "Evicted".
NODE_SHUTDOWN_REASONS = ("Terminated", "Shutdown")

_NEVER = datetime.min.replace(tzinfo=timezone.utc)  # sorts pods that ended at no known time


@dataclass(frozen=True)
class Failure:
    """What ends an attempt: the root-cause pod (None for the progress deadline), what
    `lastFailure` records of it, and the failure policy's verdict (`FATAL`, `RETRYABLE`,
    `DISRUPTED`). `ended_at` and `rank` order the candidates."""

    pod: str | None
    exit_code: int | None
    reason: str
    message: str
    verdict: str = RETRYABLE
    ended_at: datetime | None = None
    rank: int = -1
    log: str = ""  # the failed container's last lines (`log_tail`)

    def record(self, attempt: int, now: datetime) -> Obj:
        """`status.lastFailure`."""
        out = {"attempt": attempt, "pod": self.pod, "exitCode": self.exit_code, "reason": self.reason,
               "message": self.message, "time": format_time(now)}
        if self.log:
            out["log"] = self.log
        return out


def compute_failure(job: str, old: Obj, attempt: int, gang: dict[int, PodView], nodes: int,
                    fp: FailurePolicy) -> Failure | None:
    """The failure that ends this attempt; None while the gang is healthy.

    Every rank that ended is a candidate: a failed pod, a lost (`Unknown`) or deleted one,
    a disrupted one, and, once the whole gang had been running, a missing one (a pod
    missing before the gang ever ran is simply recreated). The root cause is
      1. the first candidate with a code in `fatalExitCodes`: it fails the job, whatever
         ended first (the program said a restart cannot help, and a peer's crash does not
         make a rank say that);
      2. else the first to end: `PodView.ended_at` (when it was disrupted or its delete
         requested, else when its trainer container exited), pods without a time after
         those with one, rank breaking ties, missing pods last. Its verdict decides: a
         code outside `retryableExitCodes` fails the job only here, as the root cause
         (ranks that die after a peer exit with whatever NCCL or torchrun make of it); a
         disrupted root cause restarts without using the budget; a crash that came first
         does use it, even if another rank was disrupted later.
    """
    ended = sorted((_pod_failure(x, fp) for x in gang.values() if x.phase in ("Failed", "Unknown") or x.deleting),
                   key=lambda f: (f.ended_at is None, f.ended_at or _NEVER, f.rank))
    if old.get("phase") == names.RUNNING and old.get("attempt") == attempt:
        # The whole gang was running; a vanished pod breaks the rendezvous. Nothing is
        # known of it, so it comes after every pod that is still there to tell.
        for rank in range(nodes):
            if rank not in gang:
                name = names.pod_name(job, attempt, rank)
                ended.append(Failure(name, None, names.REASON_POD_DELETED, f"pod {name} disappeared", rank=rank))
    if not ended:
        return None
    root = next((f for f in ended if f.verdict == FATAL and f.exit_code in fp.fatal_exit_codes), ended[0])
    if len(ended) > 1:
        others = len(ended) - 1
        root = replace(root, message=f"{root.message} ({others} other rank{'s' if others > 1 else ''} "
                                     f"also ended)")
    return root


def _pod_failure(x: PodView, fp: FailurePolicy) -> Failure:
    verdict = classify_failure(x.exit_code, x.disruption, fp, x.status_reason)
    if x.disruption:
        reason, message = names.REASON_POD_DISRUPTED, f"pod {x.name} was disrupted ({x.disruption})"
        if verdict != DISRUPTED:  # node pressure: say which resource ran out
            message = (f"pod {x.name} was evicted by the kubelet for node pressure ({x.disruption}"
                       + (f": {x.disruption_message})" if x.disruption_message else ")"))
    elif x.stopped_by_deletion:  # its exit code answers the SIGTERM: not judged
        verdict = RETRYABLE
        reason, message = names.REASON_POD_DELETED, f"pod {x.name} was deleted"
    elif x.phase == "Failed":
        log = redact(x.termination_message)
        if x.exit_code is None:
            how, said = f" ({x.reason or 'no exit code'})", last_line(log)
        elif x.reason and x.reason not in ("Error", "Completed"):  # OOMKilled, ContainerCannotRun, ...
            # The kernel, not the program, ended it: its last line says nothing about why.
            how, said = f" with exit code {x.exit_code} ({x.reason})", ""
        else:
            how, said = f" with exit code {x.exit_code}", last_line(log)
        reason, message = names.REASON_POD_FAILED, f"pod {x.name} failed" + how + (f": {said}" if said else "")
        return Failure(x.name, x.exit_code, reason, message, verdict, x.ended_at, x.rank, log_tail(log))
    else:
        reason, message = names.REASON_POD_DELETED, f"pod {x.name} was deleted or lost its node"
    return Failure(x.name, x.exit_code, reason, message, verdict, x.ended_at, x.rank)


def classify_exit_code(code: int | None, policy: FailurePolicy) -> str:
    """Whether a failed trainer pod's exit code may be retried.

    No exit code (evicted, node lost, deleted) is always retryable: the program did not
    say it was broken. `fatalExitCodes` win; when `retryableExitCodes` is set it is an
    allow-list and anything else is fatal.
    """
    if code is None:
        return RETRYABLE
    if code in policy.fatal_exit_codes:
        return FATAL
    if policy.retryable_exit_codes is not None and code not in policy.retryable_exit_codes:
        return FATAL
    return RETRYABLE


def classify_failure(code: int | None, disruption: str | None, policy: FailurePolicy,
                     status_reason: str | None = None) -> str:
    """A pod the cluster disrupted (DisruptionTarget: evicted, preempted, tainted away,
    garbage-collected, its node shut down) ended for the cluster's reasons, not the
    program's: DISRUPTED, its exit code (usually 143, from SIGTERM) not judged. A pod the
    kubelet evicted for node pressure (`TerminationByKubelet`, status.reason "Evicted")
    is RETRYABLE: it uses the restart budget like a crash (the pressure is often the job's
    own memory), but its exit code is the kill's, not judged either. Any other pod is
    judged by its exit code."""
    if disruption == TERMINATION_BY_KUBELET and status_reason not in NODE_SHUTDOWN_REASONS:
        return RETRYABLE
    if disruption:
        return DISRUPTED
    return classify_exit_code(code, policy)


def should_restart(restarts: int, policy: FailurePolicy) -> bool:
    """True while the restart budget allows another attempt."""
    return restarts < policy.max_restarts


def backoff_remaining(failed_at: datetime | None, backoff_seconds: float, now: datetime) -> float:
    """Seconds left before the next attempt may start (0 when due)."""
    if failed_at is None:
        return 0.0
    elapsed = (now - failed_at).total_seconds()
    return max(0.0, backoff_seconds - elapsed)
