"""kstatus, the real library (sigs.k8s.io/cli-utils' `status.Compute`, what Flux's health
checks and `wait: true` compute; `bash e2e/build-binaries.sh kstatus`), on RFTJobs read from
the local API server as the operator leaves them in each phase. Argo CD's health check
(manifests/argocd/health.lua) agrees on the same objects, run by the same program the way
Argo CD runs it: in gopher-lua, the interpreter Argo CD embeds, with only the libraries
Argo CD opens for a resource customization (no `string`, no `os`).

Before the Ready/Reconciling/Stalled conditions kstatus called every one of them Current,
the failed job included."""

from __future__ import annotations

import copy
import json
import os
import subprocess

import pytest

from e2e.cluster import REPO_ROOT, cache_dir, read_versions
from rft_contract import names
from tests.unit.test_argocd_health import health

from .operator_fixtures import (
    create_job, end_pod, get_job, job_manifest, wait_phase,
)

pytestmark = pytest.mark.integration
# What Argo CD shows for what kstatus computes.
HEALTH_LUA = REPO_ROOT / "manifests" / "argocd" / "health.lua"
ARGO = {"Current": {"Healthy", "Suspended"}, "InProgress": {"Progressing"}, "Failed": {"Degraded"}}


def kstatus(objects: list[dict]) -> dict[str, dict]:
    """name -> {status, message, argo: {status, message}}, from the real libraries."""
    v = read_versions()
    binary = cache_dir() / "bin" / f"kstatus-{v['CLI_UTILS_VERSION']}-lua{v['GOPHER_LUA_VERSION']}" / "kstatus"
    if not os.access(binary, os.X_OK):
        subprocess.run(["bash", str(REPO_ROOT / "e2e" / "build-binaries.sh"), "kstatus"], check=True, timeout=900)
    out = subprocess.run([str(binary), "-argo-health", str(HEALTH_LUA)], input=json.dumps(objects),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return {d["name"]: d for d in map(json.loads, out.stdout.splitlines())}


def running(api, ns: str, name: str, **spec) -> None:
    create_job(api, ns, job_manifest(name, **spec))
    wait_phase(api, ns, name, names.RUNNING, 90)


@pytest.mark.timeout(600)
def test_kstatus_and_argo_cd_read_each_phase_right(operator, api, namespace):
    ns = namespace
    # Pending: a gang no node takes.
    create_job(api, ns, job_manifest("pending", trainer={**job_manifest("x")["spec"]["trainer"],
                                                         "nodeSelector": {"rft.dev/no-such-node": "x"}}))
    running(api, ns, "running")
    running(api, ns, "fatal")
    end_pod(api, ns, "fatal-trainer-1-0", 78)
    running(api, ns, "done")
    end_pod(api, ns, "done-trainer-1-0", 0)
    end_pod(api, ns, "done-trainer-1-1", 0)
    running(api, ns, "restarting", failurePolicy={"maxRestarts": 3, "backoffSeconds": 300})
    end_pod(api, ns, "restarting-trainer-1-1", 1)
    create_job(api, ns, job_manifest("suspended", suspend=True))
    wait_phase(api, ns, "pending", names.PENDING, 60)
    wait_phase(api, ns, "fatal", names.FAILED, 60)
    wait_phase(api, ns, "done", names.SUCCEEDED, 60)
    wait_phase(api, ns, "restarting", names.RESTARTING, 60)
    wait_phase(api, ns, "suspended", names.SUSPENDED, 60)
    job_names = ["pending", "running", "fatal", "done", "restarting", "suspended"]
    jobs = [get_job(api, ns, n) for n in job_names]
    # A spec edit the operator has not observed yet (its generation ahead of observedGeneration).
    edited = copy.deepcopy(jobs[1])
    edited["metadata"]["name"], edited["metadata"]["generation"] = "edited", edited["metadata"]["generation"] + 1
    got = kstatus(jobs + [edited])
    want = {"pending": "InProgress", "running": "Current", "fatal": "Failed", "done": "Current",
            "restarting": "InProgress", "suspended": "Current", "edited": "InProgress"}
    assert {n: d["status"] for n, d in got.items()} == want, got
    assert "exit code 78" in got["fatal"]["message"], got["fatal"]
    assert "exit code 78" in got["fatal"]["argo"]["message"], got["fatal"]
    for job in jobs:
        name = job["metadata"]["name"]
        argo = got[name]["argo"]
        assert argo["status"] in ARGO[want[name]], (name, got[name])
        # The unit tests' Lua (lupa, a C Lua 5.1) answers as Argo CD's own interpreter does.
        assert health(job) == (argo["status"], argo["message"]), (name, health(job), argo)
