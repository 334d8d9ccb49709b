"""The values the reconcile concerns exchange: what they observe and what they report.

`PodView` is the little the operator reads from a child pod; `Event` is a Kubernetes event
to emit. Both live here, not in `reconcile.py`, so the concern modules (`gang`, `rollout`,
`weightsync`) can use them without importing the composition that imports them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from rft_contract import names as c

Obj = dict[str, Any]


@dataclass(frozen=True)
class PodView:
    """What the operator needs to know about one child pod."""

    name: str
    attempt: int
    rank: int
    phase: str
    deleting: bool = False
    exit_code: int | None = None
    reason: str | None = None
    role: str = c.ROLE_TRAINER
    spec_hash: str = ""

    @classmethod
    def from_pod(cls, pod: Obj) -> "PodView":
        meta, status = pod["metadata"], pod.get("status") or {}
        lbls = meta.get("labels") or {}
        exit_code, reason = None, status.get("reason")
        for cs in status.get("containerStatuses") or []:
            term = (cs.get("state") or {}).get("terminated")
            if term and (cs.get("name") == "trainer" or exit_code is None):
                exit_code, reason = term.get("exitCode"), term.get("reason") or reason
        return cls(
            name=meta["name"],
            attempt=int(lbls.get(c.LABEL_ATTEMPT, -1)),
            rank=int(lbls.get(c.LABEL_RANK, -1)),
            phase=status.get("phase") or "Pending",
            deleting=bool(meta.get("deletionTimestamp")),
            exit_code=exit_code,
            reason=reason,
            role=lbls.get(c.LABEL_ROLE, c.ROLE_TRAINER),
            spec_hash=(meta.get("annotations") or {}).get(c.ANNOTATION_SPEC_HASH, ""),
        )

    @property
    def active(self) -> bool:
        return self.phase in ("Pending", "Running") and not self.deleting


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


def compute_deletions(already: tuple[str, ...], pods: Iterable[PodView]) -> tuple[str, ...]:
    """`already` plus the pods to delete, in order, each once. A pod already being deleted
    is skipped: deleting it again would only cost an API call."""
    out = list(already)
    for p in pods:
        if not p.deleting and p.name not in out:
            out.append(p.name)
    return tuple(out)
