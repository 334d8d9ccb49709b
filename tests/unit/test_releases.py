"""The previous release's installs vendored under e2e/releases/ (for the upgrade tests in
tests/e2e/test_helm.py) are that release as shipped: its chart and its kustomize install
render the same objects (as this release's do, tests/unit/test_chart.py), and they hold the
previous owner check (the policy with `paramRef.selector: {}`) and no owner webhook, which
is what the upgrade has to replace."""

from __future__ import annotations

import subprocess

from e2e import releases
from tests.unit.test_chart import assert_same, objects, run_helm

PREVIOUS_OWNER = ("ValidatingAdmissionPolicyBinding", "", "rftjob-operator-owner")


def previous_chart(*args: str) -> dict:
    return objects(run_helm("template", "rftjob-operator", str(releases.chart()), "--namespace", "rftjob-system",
                            "--set", "namespace.create=true", *args).stdout)


def previous_kustomize() -> dict:
    return objects(subprocess.run(["kubectl", "kustomize", str(releases.manifests())], capture_output=True,
                                  text=True, timeout=60, check=True).stdout)


def test_the_previous_chart_and_kustomize_install_are_the_same_objects():
    kustomize = previous_kustomize()
    assert kustomize.pop(("CustomResourceDefinition", "", "rftjobs.rft.dev"))  # the snapshot's chart has no crds/
    assert_same(previous_chart(), kustomize)


def test_the_previous_release_has_the_owner_policy_and_no_webhook():
    for install in (previous_chart(), previous_kustomize()):
        assert install[PREVIOUS_OWNER]["spec"]["paramRef"]["selector"] == {}
        assert not [k for k in install if k[0] in ("ValidatingWebhookConfiguration", "Job")]
        deployment = install[("Deployment", "rftjob-system", "rftjob-operator")]
        assert not [a for a in deployment["spec"]["template"]["spec"]["containers"][0]["args"] if "webhook" in a]
