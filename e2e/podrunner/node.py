"""The node: registration, status heartbeats and the Lease in kube-node-lease."""

from __future__ import annotations

import os
import time
from pathlib import Path

from .api import _status_code
from .common import PodRunnerError, _g, _kv, _now, _now_micro, log

LOCAL_NODE_LABEL = "rft.dev/local-node"
LOCAL_TAINT = {"key": "rft.dev/local", "value": "true", "effect": "NoSchedule"}
LEASE_NAMESPACE = "kube-node-lease"
LEASE_DURATION_S = 40
LEASE_RENEW_S = 10
NODE_STATUS_S = 20


def _meminfo_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 1024**3


def node_address() -> str:
    """The node's InternalIP: the cluster's advertise address, else 127.0.0.1."""
    try:
        from ..cluster import advertise_address

        return advertise_address()
    except Exception:  # noqa: BLE001 - any failure: fall back to loopback
        return "127.0.0.1"


class _NodeMixin:
    """`PodRunner`'s node object: registered on start, kept Ready by the heartbeat thread."""

    def _node_status(self) -> dict:
        now = _now()
        resources = dict(self.allocatable)
        uname = os.uname()

        def cond(ctype: str, status: str, reason: str, message: str) -> dict:
            return {"type": ctype, "status": status, "reason": reason, "message": message,
                    "lastHeartbeatTime": now, "lastTransitionTime": self._cond_since}

        boot_id = ""
        try:
            boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        except OSError:
            pass
        machine_id = ""
        try:
            machine_id = Path("/etc/machine-id").read_text().strip()
        except OSError:
            pass
        return {
            "capacity": resources,
            "allocatable": resources,
            "addresses": [{"type": "InternalIP", "address": self.node_ip},
                          {"type": "Hostname", "address": self.node}],
            "conditions": [
                cond("MemoryPressure", "False", "KubeletHasSufficientMemory", "pod runner"),
                cond("DiskPressure", "False", "KubeletHasNoDiskPressure", "pod runner"),
                cond("PIDPressure", "False", "KubeletHasSufficientPID", "pod runner"),
                cond("Ready", "True", "KubeletReady", "pod runner is posting ready status"),
            ],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": self.kubelet_port}},
            "nodeInfo": {
                "machineID": machine_id, "systemUUID": machine_id, "bootID": boot_id,
                "kernelVersion": uname.release, "osImage": f"{uname.sysname} (pod runner)",
                "containerRuntimeVersion": "runner://0.1", "kubeletVersion": self._kube_version,
                "kubeProxyVersion": "", "operatingSystem": "linux",
                "architecture": {"x86_64": "amd64", "aarch64": "arm64"}.get(uname.machine, uname.machine),
            },
        }

    def _register_node(self) -> None:
        api = self._api
        try:
            self._kube_version = api.get("/version").get("gitVersion", "v0.0.0")
        except Exception as e:  # noqa: BLE001
            raise PodRunnerError(f"cannot reach the API server at {api.server}: {e}") from e
        self._cond_since = _now()
        labels = {"kubernetes.io/hostname": self.node, LOCAL_NODE_LABEL: "true",
                  "kubernetes.io/os": "linux", "kubernetes.io/arch": self._node_status()["nodeInfo"]["architecture"]}
        body = {"apiVersion": "v1", "kind": "Node",
                "metadata": {"name": self.node, "labels": labels},
                "spec": {"taints": [LOCAL_TAINT]},
                "status": self._node_status()}
        try:
            node = api.post("/api/v1/nodes", body)
            log.info(_kv("node.registered", node=self.node))
        except Exception as e:  # noqa: BLE001
            if _status_code(e) != 409:
                raise PodRunnerError(f"cannot register node {self.node}: {e}") from e
            node = api.get(f"/api/v1/nodes/{self.node}")
            annotations = _g(node, "metadata", "annotations", default={})
            if annotations.get("kwok.x-k8s.io/node"):
                raise PodRunnerError(f"node {self.node} is managed by KWOK; pick another --node name")
            taints = [t for t in _g(node, "spec", "taints", default=[])
                      if not t.get("key", "").startswith("node.kubernetes.io/")]
            if not any(t.get("key") == LOCAL_TAINT["key"] for t in taints):
                taints.append(LOCAL_TAINT)
            node = api.merge_patch(f"/api/v1/nodes/{self.node}",
                                   {"metadata": {"labels": labels}, "spec": {"taints": taints}})
            node = api.merge_patch(f"/api/v1/nodes/{self.node}/status", {"status": self._node_status()})
            log.info(_kv("node.reused", node=self.node))
        self._node_uid = node["metadata"]["uid"]
        self._renew_lease()

    def _renew_lease(self) -> None:
        api = self._api
        path = f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NAMESPACE}/leases/{self.node}"
        spec = {"holderIdentity": self.node, "leaseDurationSeconds": LEASE_DURATION_S,
                "renewTime": _now_micro()}
        try:
            api.merge_patch(path, {"spec": spec})
        except Exception as e:  # noqa: BLE001
            if _status_code(e) != 404:
                raise
            owner = [{"apiVersion": "v1", "kind": "Node", "name": self.node, "uid": self._node_uid}]
            api.post(f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NAMESPACE}/leases",
                     {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                      "metadata": {"name": self.node, "namespace": LEASE_NAMESPACE, "ownerReferences": owner},
                      "spec": spec})

    def _heartbeat_loop(self) -> None:
        next_status = time.monotonic() + NODE_STATUS_S
        while not self._stop.wait(LEASE_RENEW_S):
            try:
                self._renew_lease()
                if time.monotonic() >= next_status:
                    try:
                        self._api.merge_patch(f"/api/v1/nodes/{self.node}/status",
                                              {"status": self._node_status()})
                    except Exception as e:  # noqa: BLE001
                        if _status_code(e) != 404:
                            raise
                        log.warning(_kv("node.missing", node=self.node, action="re-register"))
                        self._register_node()
                    next_status = time.monotonic() + NODE_STATUS_S
            except Exception as e:  # noqa: BLE001
                if not self._stop.is_set():
                    log.warning(_kv("node.heartbeat_failed", node=self.node, error=f"{type(e).__name__}: {e}"))
