"""Identities: the per-job ServiceAccount may patch its own RFTJob's status and nothing
else; the manifests install cleanly (server-side dry run)."""

from __future__ import annotations

from pathlib import Path

import kubernetes
import pytest
from kubernetes.client.rest import ApiException

from rft_contract import names as c

from .operator_fixtures import (  # noqa: F401
    api, create_job, get_job, installed, job_manifest, namespace, operator, wait_phase,
)

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def can_i(kubectl, namespace, sa, *args) -> bool:
    out = kubectl("auth", "can-i", *args, "-n", namespace,
                  f"--as=system:serviceaccount:{namespace}:{sa}", check=False)
    return out.stdout.strip() == "yes"


def test_job_identity_can_patch_only_its_own_status(operator, api, namespace, kubectl, cluster, tmp_path):
    create_job(api, namespace, job_manifest("alpha"))
    create_job(api, namespace, job_manifest("beta"))
    wait_phase(api, namespace, "alpha", c.RUNNING, 90)
    sa = "alpha-rftjob"
    assert can_i(kubectl, namespace, sa, "patch", "rftjobs.rft.dev/alpha", "--subresource=status")
    assert can_i(kubectl, namespace, sa, "get", "rftjobs.rft.dev/alpha", "--subresource=status")
    assert not can_i(kubectl, namespace, sa, "patch", "rftjobs.rft.dev/beta", "--subresource=status")
    assert not can_i(kubectl, namespace, sa, "patch", "rftjobs.rft.dev/alpha")  # not the spec
    assert not can_i(kubectl, namespace, sa, "delete", "rftjobs.rft.dev/alpha")
    assert not can_i(kubectl, namespace, sa, "list", "rftjobs.rft.dev")
    assert not can_i(kubectl, namespace, sa, "get", "pods")
    assert not can_i(kubectl, namespace, sa, "get", "secrets")

    # And for real, with a token of that ServiceAccount (what the trainer will use).
    kc = cluster.service_account_kubeconfig(namespace, sa, tmp_path / "job.kubeconfig")
    as_job = kubernetes.client.CustomObjectsApi(kubernetes.config.new_client_from_config(str(kc)))
    as_job.patch_namespaced_custom_object_status(
        c.GROUP, c.VERSION, namespace, c.PLURAL, "alpha",
        {"status": {"trainer": {"step": 7, "progress": "7/100"}}})
    assert get_job(api, namespace, "alpha")["status"]["trainer"]["step"] == 7
    with pytest.raises(ApiException) as e:
        as_job.patch_namespaced_custom_object_status(
            c.GROUP, c.VERSION, namespace, c.PLURAL, "beta", {"status": {"trainer": {"step": 7}}})
    assert e.value.status == 403
    with pytest.raises(ApiException) as e:
        as_job.patch_namespaced_custom_object(
            c.GROUP, c.VERSION, namespace, c.PLURAL, "alpha", {"spec": {"suspend": True}})
    assert e.value.status == 403


def test_operator_identity_is_not_cluster_admin(installed, kubectl):
    op = "system:serviceaccount:rftjob-system:rftjob-operator"
    yes = lambda *a: kubectl("auth", "can-i", *a, f"--as={op}", check=False).stdout.strip() == "yes"  # noqa: E731
    assert yes("create", "pods", "-A") and yes("patch", "rftjobs.rft.dev", "--subresource=status", "-A")
    assert not yes("get", "secrets", "-A")
    assert not yes("patch", "rftjobs.rft.dev", "-A")  # the spec belongs to the user
    assert not yes("create", "clusterrolebindings")


def test_manifests_pass_server_side_dry_run(installed, kubectl):
    out = kubectl("apply", "-k", str(ROOT / "manifests"), "--dry-run=server")
    assert "customresourcedefinition.apiextensions.k8s.io/rftjobs.rft.dev" in out.stdout
    assert "deployment.apps/rftjob-operator" in out.stdout
    samples = kubectl("apply", "-k", str(ROOT / "manifests" / "samples"), "--dry-run=server")
    assert "rftjob.rft.dev/demo" in samples.stdout
