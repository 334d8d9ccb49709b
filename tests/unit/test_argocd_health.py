"""The Argo CD health check (manifests/argocd/health.lua), run in a real Lua interpreter
the way Argo CD runs it: the live object as the global table `obj`, the script returning
`{status=..., message=...}`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from .testing import make_job

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "manifests" / "argocd" / "health.lua"
PATCH = ROOT / "manifests" / "argocd" / "argocd-cm-patch.yaml"
KEY = "resource.customizations.health.rft.dev_RFTJob"

try:  # Argo CD embeds gopher-lua, a Lua 5.1
    from lupa.lua51 import LuaRuntime
except ImportError:
    from lupa import LuaRuntime


def to_lua(lua, value: Any) -> Any:
    """Dicts and lists become tables (lists 1-based, as Argo CD converts JSON arrays)."""
    if isinstance(value, dict):
        return lua.table_from({k: to_lua(lua, v) for k, v in value.items()})
    if isinstance(value, list):
        return lua.table_from([to_lua(lua, v) for v in value])
    return value


def health(obj: dict) -> tuple[str, str]:
    lua = LuaRuntime(unpack_returned_tuples=True)
    lua.globals().obj = to_lua(lua, obj)
    hs = lua.execute(SCRIPT.read_text())
    return hs["status"], hs["message"]


def job(spec: dict | None = None, **status: Any) -> dict:
    obj = make_job(status=status)
    if not status:
        del obj["status"]
    obj["spec"].update(spec or {})
    return obj


INFERENCE = {"inference": {"replicas": 2, "engine": "vllm"}}


def synced(ok: bool, message: str) -> list[dict]:
    return [{"type": "Running", "status": "True", "reason": "AllPodsRunning", "message": "all pods running"},
            {"type": "WeightsSynced", "status": "True" if ok else "False",
             "reason": "Synced" if ok else "Syncing", "message": message}]


@pytest.mark.parametrize("obj, want", [
    (job(), ("Progressing", "waiting for the operator")),
    (job(spec={"suspend": True}), ("Progressing", "waiting for the operator")),
    (job(trainer={"step": 3}), ("Progressing", "waiting for the operator")),  # no phase yet
    (job(spec={"suspend": True}, phase="Running", message="2/2 pods running"),
     ("Suspended", "2/2 pods running")),
    (job(phase="Suspended"), ("Suspended", "spec.suspend is true")),
    (job(phase="Suspended", message="suspended at step 40"), ("Suspended", "suspended at step 40")),
    (job(phase="Failed", message="trainer-0 exited 1; restart budget exhausted"),
     ("Degraded", "trainer-0 exited 1; restart budget exhausted")),
    (job(spec={"suspend": True}, phase="Failed", message="OOMKilled"), ("Degraded", "OOMKilled")),
    (job(phase="Succeeded", message="trained 100 steps"), ("Healthy", "trained 100 steps")),
    (job(phase="Succeeded"), ("Healthy", "Succeeded")),
    (job(phase="Running", message="2/2 pods running"), ("Healthy", "2/2 pods running")),  # train-only
    (job(spec=INFERENCE, phase="Running", conditions=synced(True, "2/2 replicas serve version 40")),
     ("Healthy", "2/2 replicas serve version 40")),
    (job(spec=INFERENCE, phase="Running", conditions=synced(False, "1/2 replicas serve version 40")),
     ("Progressing", "1/2 replicas serve version 40")),
    (job(spec=INFERENCE, phase="Running", conditions=synced(True, "x")[:1]),
     ("Progressing", "waiting for the inference replicas to load the first weights")),
    (job(spec={"inference": {"replicas": 0}}, phase="Running", message="1/1 pods running"),
     ("Healthy", "1/1 pods running")),
    (job(phase="Pending", message="waiting for 2 pods to be scheduled"),
     ("Progressing", "waiting for 2 pods to be scheduled")),
    (job(phase="Restarting", message="restart 1/3 after trainer-1 exited 137"),
     ("Progressing", "restart 1/3 after trainer-1 exited 137")),
    (job(phase="Restarting"), ("Progressing", "Restarting")),
])
def test_health(obj, want):
    assert health(obj) == want


def test_argocd_cm_patch_embeds_the_script_verbatim():
    cm = yaml.safe_load(PATCH.read_text())
    assert cm["kind"] == "ConfigMap" and cm["metadata"]["name"] == "argocd-cm"
    assert cm["data"][KEY] == SCRIPT.read_text()
