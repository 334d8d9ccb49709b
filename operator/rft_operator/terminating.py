"""Old trainer pods stuck terminating: which are stuck (`stuck_nodes`, `compute_stuck`), and
the force-delete rule that decides whether the next gang may go on without them.

Old pods that outlive their grace period by `FORCE_DELETE_MARGIN_SECONDS` are
force-deleted only when their node is known to run nothing (Node deleted or tainted
out-of-service); otherwise the gang keeps waiting and says, once, what an admin can do.
Pure, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from rft_contract import names

from .model import Event, PodView

# How long past its deletion deadline (deletionTimestamp = request + grace period) a pod may
# stay terminating before it is force-deleted: a kubelet that is alive confirms well within.
FORCE_DELETE_MARGIN_SECONDS = 60.0

# What the operator knows of the Node of a pod stuck terminating (`classify_node`).
NODE_GONE = "gone"  # 404: its pods run nowhere
NODE_OUT_OF_SERVICE = "out-of-service"  # an admin says it is down (the taint below)
NODE_UP = "up"  # it exists and nobody said it is down: it may still run the pod
NODE_UNREADABLE = "unreadable"  # the operator may not read it (a namespaced install: 403)
OUT_OF_SERVICE_TAINT = "node.kubernetes.io/out-of-service"


def force_delete_remaining(deletion_deadline: datetime | None, now: datetime,
                           margin: float = FORCE_DELETE_MARGIN_SECONDS) -> float | None:
    """Seconds until a terminating pod counts as stuck (<= 0: it is); None for a pod that
    is not being deleted. The deadline already includes the pod's grace period (the API
    server sets deletionTimestamp to request time + grace)."""
    if deletion_deadline is None:
        return None
    return margin - (now - deletion_deadline).total_seconds()


def classify_node(node: dict[str, Any] | None) -> str:
    """A Node object as read (None: 404). Kubernetes' rule for force-deleting a pod whose
    kubelet never confirms: only once the node is known to run nothing, i.e. its Node
    object is gone or carries the `out-of-service` taint (the admin's statement that it
    is shut down). NotReady is not enough: a partitioned node still runs its pods."""
    if node is None:
        return NODE_GONE
    if any(t.get("key") == OUT_OF_SERVICE_TAINT for t in (node.get("spec") or {}).get("taints") or []):
        return NODE_OUT_OF_SERVICE
    return NODE_UP


def may_force_delete(node_name: str, nodes: dict[str, str]) -> bool:
    """Whether a pod stuck terminating on `node_name` may be force-deleted: its node is
    gone or out of service, or it never had one (nothing runs it). Unknown: no."""
    return not node_name or nodes.get(node_name) in (NODE_GONE, NODE_OUT_OF_SERVICE)


def stuck_nodes(pods: list[PodView], now: datetime) -> set[str]:
    """The nodes of pods stuck terminating (past their deadline and margin, not forced
    yet), whose state `compute_stuck` needs: the controller reads only these Nodes."""
    return {x.node_name for x in pods if x.node_name and (left := _stuck_for(x, now)) is not None and left <= 0}


def _stuck_for(x: PodView, now: datetime) -> float | None:
    """Seconds until `x` counts as stuck terminating (<= 0: it does); None: it never will."""
    return None if x.force_deleted else force_delete_remaining(x.deletion_deadline, now)


@dataclass(frozen=True)
class Stuck:
    """What to do about the old pods the next gang waits for (`compute_stuck`)."""

    force_delete: tuple[str, ...] = ()  # delete with grace period 0
    events: tuple[Event, ...] = ()  # the Warning that says so
    held: str = ""  # stuck pods that may not be forced: why the gang waits, what to do
    requeue_after: float | None = None  # when the first not yet stuck would be


def compute_stuck(pods: list[PodView], now: datetime, nodes: dict[str, str], namespace: str) -> Stuck:
    """Old pods the next gang waits for, still terminating `FORCE_DELETE_MARGIN_SECONDS`
    after their grace period ended. A pod whose node is gone or out of service (or that
    never had one) is force-deleted (grace period 0) with one Warning event: nothing runs
    it. Any other may still run on a node cut off from the API server (holding its GPUs,
    writing the same checkpoints), so it is not forced: `held` says why the gang waits
    and what an admin can do. Until the first is due, come back then: no event will."""
    due, waits = [], []
    for x in pods:
        left = _stuck_for(x, now)
        if left is not None and left <= 0:
            due.append(x)
        elif left is not None:
            waits.append(left)
    requeue_after = min(waits) if waits else None
    forced = [x for x in due if may_force_delete(x.node_name, nodes)]
    held = [x for x in due if x not in forced]
    message = build_stuck_message(held, nodes, namespace) if held else ""
    if not forced:
        return Stuck(held=message, requeue_after=requeue_after)
    margin = int(FORCE_DELETE_MARGIN_SECONDS)
    warning = (f"{_pods_on_nodes(forced, nodes)} still terminating {margin}s after the grace period ended, "
               "and nothing runs them any more: force-deleting (grace period 0) so the next gang can start")
    return Stuck(tuple(x.name for x in forced), (Event("Warning", names.REASON_STUCK_TERMINATING, warning),),
                 message, requeue_after)


_NODE_WORDS = {NODE_GONE: "deleted", NODE_OUT_OF_SERVICE: "out of service",
               NODE_UNREADABLE: "the operator may not read it", NODE_UP: ""}


def _pods_on_nodes(pods: list[PodView], nodes: dict[str, str]) -> str:
    """"pod a (node n1, deleted), b (node n2)": each pod with its node and what is known of it."""
    def one(x: PodView) -> str:
        if not x.node_name:
            return f"{x.name} (never scheduled)"
        words = _NODE_WORDS.get(nodes.get(x.node_name, ""), "")
        return f"{x.name} (node {x.node_name}{', ' + words if words else ''})"
    return f"pod{'s' if len(pods) > 1 else ''} " + ", ".join(one(x) for x in pods)


def build_stuck_message(pods: list[PodView], nodes: dict[str, str], namespace: str) -> str:
    """Why the gang waits for pods stuck terminating on nodes that may still run them, and
    what an admin can do. Steady (no clock in it): it is the status message while waiting,
    and the Warning event goes out when the message first says it."""
    node_names = sorted({x.node_name for x in pods})
    node = node_names[0] if len(node_names) == 1 else "<node>"
    pod = pods[0].name if len(pods) == 1 else "<pod>"
    return (f"waiting for {_pods_on_nodes(pods, nodes)}, still terminating "
            f"{int(FORCE_DELETE_MARGIN_SECONDS)}s after the grace period ended: the node has not "
            "confirmed that the containers stopped, and a node cut off from the cluster may still run them, "
            "so the operator does not force-delete them. If the node is down: kubectl delete node "
            f"{' '.join(node_names)}, or kubectl taint node {node} "
            f"{OUT_OF_SERVICE_TAINT}=nodeshutdown:NoExecute; if you know the pods no longer run: "
            f"kubectl delete pod -n {namespace} {pod} --force --grace-period=0. The job goes on by itself "
            "once they are gone")
