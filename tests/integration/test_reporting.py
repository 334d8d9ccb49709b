"""The trainer's status reporter against the real API server, as the job's own
ServiceAccount: progress and the last checkpoint show up in `kubectl get rftjobs`, and
the operator turns the checkpoint into the Checkpointed condition."""

import kubernetes
import pytest

from rft_contract import names as c
from rft_trainer.reporting import StatusReporter

from .conftest import wait_for
from .operator_fixtures import (  # noqa: F401
    api, create_job, get_job, installed, job_manifest, namespace, operator, wait_phase, wait_status,
)

pytestmark = pytest.mark.integration


def test_trainer_reports_reach_kubectl_and_conditions(operator, api, namespace, kubectl, cluster, tmp_path):
    create_job(api, namespace, job_manifest("rep"))
    wait_phase(api, namespace, "rep", c.RUNNING, 90)
    kc = cluster.service_account_kubeconfig(namespace, "rep-rftjob", tmp_path / "job.kubeconfig")
    as_job = kubernetes.client.CustomObjectsApi(kubernetes.config.new_client_from_config(str(kc)))
    reporter = StatusReporter("rep", namespace, as_job, min_interval=0)
    reporter.report_step(10, 100, {"actor/pg_loss": 0.25})
    reporter.report_checkpoint(10, "s3://ckpts/run/ckpt/step-00000010", 1234, 0.5)
    reporter.report_weights(10, "s3://ckpts/run/weights/step-00000010")
    reporter.close()
    assert reporter.failures == 0

    status = wait_status(api, namespace, "rep", lambda s: any(
        x["type"] == c.COND_CHECKPOINTED and x["status"] == "True" for x in s.get("conditions", [])), 60)
    assert status["trainer"]["lastCheckpoint"]["bytes"] == 1234
    assert status["phase"] == c.RUNNING  # the operator kept its own fields

    def row():
        out = kubectl("get", "rftjob", "rep", "-n", namespace).stdout.splitlines()
        return out[1].split() if len(out) > 1 else None

    cols = wait_for(lambda: (r := row()) and r[2] == "10/100" and r, 30, "the progress column")
    assert cols[:5] == ["rep", "Running", "10/100", "10", "10"]  # name phase step checkpoint weights
