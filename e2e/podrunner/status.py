"""Pod status as a kubelet reports it, and the status of pods orphaned by a runner restart."""

from __future__ import annotations

import time

from .api import _Api, _status_code
from .common import _g, _kv, _now, log


class _StatusMixin:
    """`_PodWorker`'s status computation and (change-only) status patches."""

    def _condition(self, ctype: str, ok: bool, reason: str | None = None, message: str | None = None) -> dict:
        status = "True" if ok else "False"
        prev = self.cond_times.get(ctype)
        if prev is None or prev[0] != status:
            self.cond_times[ctype] = (status, _now())
        cond = {"type": ctype, "status": status, "lastTransitionTime": self.cond_times[ctype][1]}
        if not ok and reason:
            cond["reason"] = reason
            if message:
                cond["message"] = message
        return cond

    def _status(self) -> dict:
        current = _g(self.pod, "status", "conditions", default=[])
        scheduled = next((c for c in current if c.get("type") == "PodScheduled"), None)
        managed = {"PodReadyToStartContainers", "Initialized", "Ready", "ContainersReady", "PodScheduled"}
        others = [c for c in current if c.get("type") not in managed]  # e.g. DisruptionTarget
        unready = [c.name for c in self.mains if not c.ready]
        pending_init = [c.name for c in self.inits if not (c.done and c.exit_code == 0)]
        ready_reason = "PodCompleted" if self.terminal else "ContainersNotReady"
        ready_msg = None if self.terminal else f"containers with unready status: [{' '.join(unready)}]"
        conditions = [
            self._condition("PodReadyToStartContainers", self.volumes_ready),
            self._condition("Initialized", self.initialized, "ContainersNotInitialized",
                            f"containers with incomplete status: [{' '.join(pending_init)}]"),
            self._condition("Ready", self.ready, ready_reason, ready_msg),
            self._condition("ContainersReady", self.ready, ready_reason, ready_msg),
            scheduled or {"type": "PodScheduled", "status": "True", "lastTransitionTime": self.start_time},
            *others,
        ]
        status = {
            "phase": self.phase,
            "hostIP": self.runner.node_ip,
            "hostIPs": [{"ip": self.runner.node_ip}],
            "podIP": self.ip,
            "podIPs": [{"ip": self.ip}],
            "startTime": self.start_time,
            "conditions": conditions,
            "containerStatuses": [c.status() for c in self.mains],
        }
        if self.inits:
            status["initContainerStatuses"] = [c.status() for c in self.inits]
        return status

    def _publish(self, force: bool = False) -> None:
        status = self._status()
        if status == self.last_published:
            return
        now = time.monotonic()
        if now < self.next_publish_try and not force:
            return
        try:
            self.api.merge_patch(f"/api/v1/namespaces/{self.ns}/pods/{self.pod_name}/status",
                                 {"metadata": {"uid": self.uid}, "status": status})
            self.last_published = status
        except Exception as e:  # noqa: BLE001 - retried on a later tick
            code = _status_code(e)
            if code == 404:
                self.last_published = status  # gone; the watch will tell us
            else:
                log.warning(_kv("pod.status_patch_failed", pod=f"{self.ns}/{self.pod_name}",
                                error=code or f"{type(e).__name__}: {e}"))
                self.next_publish_try = now + 1.0


def mark_node_restart(api: _Api, pod: dict) -> None:
    """A pod this runner did not start but that was started here: its processes are gone."""
    meta = pod["metadata"]
    now = _now()
    message = "the pod runner restarted; the pod's processes are gone"
    spec = pod.get("spec") or {}
    existing = {s["name"]: s for s in _g(pod, "status", "containerStatuses", default=[])}
    statuses = []
    for c in spec.get("containers") or []:
        old = existing.get(c["name"], {})
        state = old.get("state") or {}
        if "terminated" in state:
            statuses.append({**old, "ready": False, "started": False})
            continue
        terminated = {"exitCode": 137, "reason": "NodeRestart", "message": message,
                      "startedAt": _g(state, "running", "startedAt", default=now), "finishedAt": now}
        if old.get("containerID"):
            terminated["containerID"] = old["containerID"]
        statuses.append({"name": c["name"], "image": c.get("image", ""), "imageID": "",
                         "ready": False, "started": False, "restartCount": old.get("restartCount", 0),
                         "state": {"terminated": terminated}, "lastState": old.get("lastState") or {},
                         **({"containerID": old["containerID"]} if old.get("containerID") else {})})
    conditions = []
    for cond in _g(pod, "status", "conditions", default=[]):
        if cond.get("type") in ("Ready", "ContainersReady") and cond.get("status") == "True":
            cond = {**cond, "status": "False", "reason": "PodFailed", "lastTransitionTime": now}
        conditions.append(cond)
    try:
        api.merge_patch(f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status",
                        {"metadata": {"uid": meta["uid"]},
                         "status": {"phase": "Failed", "reason": "NodeRestart", "message": message,
                                    "conditions": conditions, "containerStatuses": statuses}})
        log.info(_kv("pod.node_restart", pod=f"{meta['namespace']}/{meta['name']}"))
    except Exception as e:  # noqa: BLE001
        log.warning(_kv("pod.node_restart_failed", pod=f"{meta['namespace']}/{meta['name']}", error=e))
