"""Weight sync, operator side: which weights the inference replicas should serve, how
many do, and the WeightsSynced condition (docs/design.md, "Weight sync"). Pure, no I/O:
functions over the status subtrees the trainer and the sync agents write.

    status.trainer.latestWeights   {version, uri, id, peer, manifest}   trainer rank 0, after
                                   each export (peer, manifest: announced on the fast path)
    status.trainer.weightVersions  [v, ...]             trainer: committed, retained exports
    status.weightSync.replicas     {pod: {version, id, error, ...}}   one sync agent per pod
    status.weightSync.target       {version, uri, id, peer, manifest}   the operator (this module)

Version 0 is the base model (`spec.model.path`): replicas serve it until the first
export, and `spec.sync.pinnedVersion: 0` rolls back to it. `pinnedVersion: best` follows
the version spec.evaluation scored best (`status.trainer.evaluation.best.version`).
"""

from __future__ import annotations

from dataclasses import dataclass

from rft_contract import names
from rft_contract.layout import weights_uri
from rft_contract.spec import PIN_BEST, RFTJobSpec

from .conditions import Cond
from .model import Event, Obj



# A target's keys. `peer` and `manifest` come with a fresh export on the fast path: the
# trainer's weights server and the digest a manifest from it must match (status.WeightsRef).
TARGET_KEYS = ("version", "uri", "id", "peer", "manifest")


def base_target(spec: RFTJobSpec) -> Obj:
    return _ref({"version": 0, "uri": spec.model.path})


def _ref(weights: Obj) -> Obj:
    """A target with every key present: the status is merge-patched, so a key left out
    would keep the old target's value (`id: None` deletes it)."""
    return {key: weights.get(key) for key in TARGET_KEYS}


def same_target(a: Obj | None, b: Obj | None) -> bool:
    strip = lambda d: {k: v for k, v in (d or {}).items() if v is not None}  # noqa: E731
    return strip(a) == strip(b)


@dataclass(frozen=True)
class Target:
    target: Obj
    problem: str | None = None  # why the wanted version cannot be served (pin missing)


def compute_target(spec: RFTJobSpec, trainer: Obj, old_target: Obj | None) -> Target:
    """The pinned version if it was exported and is still kept, else the newest export,
    else the base model. A missing pin keeps the current target: nothing breaks."""
    latest = trainer.get("latestWeights") or {}
    pinned = spec.sync.pinned_version
    if pinned == PIN_BEST:
        pinned = ((trainer.get("evaluation") or {}).get("best") or {}).get("version")
        if not isinstance(pinned, int) or isinstance(pinned, bool):
            return Target(_ref(old_target) if old_target else base_target(spec),
                          f"spec.sync.pinnedVersion={PIN_BEST}: no version scored yet (status.trainer.evaluation."
                          f"best); still serving version {(old_target or base_target(spec))['version']}")
    if pinned is None:
        if latest.get("version") is None:
            return Target(base_target(spec))
        return Target(_ref(latest))
    if pinned == 0:
        return Target(base_target(spec))
    if pinned == latest.get("version"):
        return Target(_ref(latest))
    available = sorted(trainer.get("weightVersions") or [])
    if pinned in available:
        return Target(_ref({"version": pinned, "uri": weights_uri(spec.checkpoint.uri, pinned)}))
    have = ", ".join(map(str, available)) or "none yet"
    return Target(_ref(old_target) if old_target else base_target(spec),
                  f"spec.sync.pinnedVersion={pinned} is not an exported version "
                  f"(available: 0 (base model), {have}); still serving version "
                  f"{(old_target or base_target(spec))['version']}")


def is_synced(entry: Obj | None, target: Obj) -> bool:
    if not entry or entry.get("version") != target.get("version"):
        return False
    # Two exports of one version (a resumed attempt replays steps) differ by id.
    return target.get("id") is None or entry.get("id") in (None, target.get("id"))


@dataclass(frozen=True)
class SyncCount:
    desired: int
    synced: int
    lag_steps: int | None
    errors: list[str]


def count_synced(replicas: Obj, desired_pods: list[str], target: Obj, trainer_step: int | None) -> SyncCount:
    entries = [replicas.get(name) or {} for name in desired_pods]
    synced = sum(1 for e in entries if is_synced(e, target))
    served = [e["version"] for e in entries if e.get("version") is not None]
    lag = None
    if served and trainer_step is not None:
        lag = max(0, trainer_step - min(served))
    errors = [f"{name}: {e['error']}" for name, e in zip(desired_pods, entries)
              if e.get("error") and not is_synced(e, target)]
    return SyncCount(len(desired_pods), synced, lag, errors)


def sync_condition(count: SyncCount, target: Obj, problem: str | None) -> tuple[bool, str, str]:
    """(status, reason, message) of the WeightsSynced condition."""
    v = target.get("version")
    if problem:
        return False, names.REASON_PIN_MISSING, problem
    if count.desired == 0:
        return False, names.REASON_NO_REPLICAS, "spec.inference.replicas is 0"
    if count.synced == count.desired:
        return True, names.REASON_SYNCED, f"{count.synced}/{count.desired} replicas serve version {v}"
    msg = f"{count.synced}/{count.desired} replicas serve version {v}"
    if count.errors:
        return False, names.REASON_SYNC_ERROR, msg + "; " + "; ".join(count.errors[:3])
    return False, names.REASON_SYNCING, msg


def describe_lag(count: SyncCount, target: Obj, replicas: Obj, desired_pods: list[str]) -> str:
    """The replicas not serving the target, in words, for the progress deadline's message
    ("" when all are): replicas on old weights make explorers' samples stale, and the
    trainer drops stale samples."""
    if count.desired == 0 or count.synced == count.desired:
        return ""
    behind = []
    for name in desired_pods:
        entry = replicas.get(name) or {}
        if not is_synced(entry, target):
            served = entry.get("version")
            behind.append(f"{name} serves {'nothing yet' if served is None else f'version {served}'}")
    out = (f"weight sync {count.synced}/{count.desired} replicas at target version {target.get('version')} "
           f"({', '.join(behind[:3])}{', ...' if len(behind) > 3 else ''})")
    if count.lag_steps:
        out += f", oldest served version {count.lag_steps} steps behind the trainer"
    return out + ("; " + "; ".join(count.errors[:3]) if count.errors else "")


def stale_replica_entries(replicas: Obj, desired_pods: list[str]) -> list[str]:
    """Entries of pods that are not (or no longer) desired replicas, to prune."""
    return sorted(set(replicas) - set(desired_pods))


# ------------------------------------------------------------------ the concern


@dataclass(frozen=True)
class WeightSync:
    """This pass's weight-sync result. `status` is the `status.weightSync` merge patch,
    None when it would change nothing (or the job serves no inference)."""

    status: Obj | None = None
    condition: Cond | None = None  # WeightsSynced; None for train-only jobs
    events: tuple[Event, ...] = ()
    lag: str = ""  # replicas behind the target, in words ("" when none): `describe_lag`


def compute_weight_sync(job: str, spec: RFTJobSpec | None, trainer: Obj, old_sync: Obj) -> WeightSync:
    """Promote the trainer's export (or the pin) to the target and count the replicas.

    Runs in every phase, terminal ones included: after success the inference pods stay
    until they serve the final export (`rollout.py` waits on this condition)."""
    if spec is None or spec.inference is None:
        return WeightSync()
    t = compute_target(spec, trainer, old_sync.get("target"))
    pods = [names.inference_pod_name(job, i) for i in range(spec.inference.replicas)]
    replicas = old_sync.get("replicas") or {}
    n = count_synced(replicas, pods, t.target, trainer.get("step"))
    fields = {"target": t.target, "desiredReplicas": n.desired, "syncedReplicas": n.synced,
              "synced": f"{n.synced}/{n.desired}", "lagSteps": n.lag_steps}
    prune = stale_replica_entries(replicas, pods)
    if prune:
        fields["replicas"] = {name: None for name in prune}  # merge patch: delete
    # An event for a transition only: the first target and one a pin chose. Each routine
    # promotion of the trainer's export is in status and metrics (16 events for a 16-step
    # job drowned the lifecycle in `kubectl describe`).
    events: tuple[Event, ...] = ()
    old_target = old_sync.get("target")
    if not same_target(t.target, old_target) and (old_target is None or spec.sync.pinned_version is not None):
        uri = f" ({t.target.get('uri')})" if t.target.get("uri") else ""
        why = "pinned by spec.sync.pinnedVersion" if spec.sync.pinned_version is not None else "the first"
        events = (Event("Normal", "WeightsTarget",
                        f"serving target is now version {t.target['version']}{uri} ({why})"),)
    status, reason, message = sync_condition(n, t.target, t.problem)
    cond = Cond(names.COND_WEIGHTS_SYNCED, status, reason, message)
    return WeightSync(fields if is_sync_changed(old_sync, fields) else None, cond, events,
                      describe_lag(n, t.target, replicas, pods))


def is_sync_changed(old_sync: Obj, fields: Obj) -> bool:
    """Whether writing `fields` would change the stored weightSync (targets compare
    without their None keys, as a merge patch would store them)."""
    return any(not same_target(old_sync.get(k), v) if k == "target" else old_sync.get(k) != v
               for k, v in fields.items())
