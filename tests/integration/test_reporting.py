"""The trainer's status reporter against the real API server, as the job's own
ServiceAccount: progress and the last checkpoint show up in `kubectl get rftjobs`, the
operator turns the checkpoint into the Checkpointed condition, and the final status
survives an API server outage."""

import logging
import threading
from urllib.parse import urlsplit

import kubernetes
import pytest
import yaml

from rft_contract import names
from rft_trainer.reporting import StatusReporter
from tests.trainer.faultproxy import TcpProxy

from .conftest import wait_for
from .operator_fixtures import create_job, get_job, job_manifest, wait_phase, wait_status

pytestmark = pytest.mark.integration


def test_trainer_reports_reach_kubectl_and_conditions(operator, api, namespace, kubectl, cluster, tmp_path):
    create_job(api, namespace, job_manifest("rep"))
    wait_phase(api, namespace, "rep", names.RUNNING, 90)
    kc = cluster.service_account_kubeconfig(namespace, "rep-rft-trainer", tmp_path / "job.kubeconfig")
    as_job = kubernetes.client.CustomObjectsApi(kubernetes.config.new_client_from_config(str(kc)))
    reporter = StatusReporter("rep", namespace, as_job, min_interval=0)
    reporter.report_step(10, 100, {"actor/pg_loss": 0.25})
    reporter.report_checkpoint(10, "s3://ckpts/run/ckpt/step-00000010", 1234, 0.5)
    reporter.report_weights(10, "s3://ckpts/run/weights/step-00000010")
    reporter.close()
    assert reporter.failures == 0

    status = wait_status(api, namespace, "rep", lambda s: any(
        x["type"] == names.COND_CHECKPOINTED and x["status"] == "True" for x in s.get("conditions", [])), 60)
    assert status["trainer"]["lastCheckpoint"]["bytes"] == 1234
    assert status["phase"] == names.RUNNING  # the operator kept its own fields

    def row():
        out = kubectl("get", "rftjob", "rep", "-n", namespace).stdout.splitlines()
        return out[1].split() if len(out) > 1 else None

    cols = wait_for(lambda: (r := row()) and r[2] == "10/100" and r, 30, "the progress column")
    assert cols[:5] == ["rep", "Running", "10/100", "10", "10"]  # name phase step checkpoint weights


def test_final_weights_land_after_an_api_server_outage(operator, api, namespace, cluster, tmp_path, caplog):
    """The API server is unreachable while the trainer reports its last step and final
    weights, and still when it exits: close() keeps retrying, and once the server is back
    the final status lands (a reporter that gave up would leave inference on old weights)."""
    caplog.set_level(logging.INFO, logger="rft_trainer.reporting")
    create_job(api, namespace, job_manifest("out"))
    wait_phase(api, namespace, "out", names.RUNNING, 90)
    kc = cluster.service_account_kubeconfig(namespace, "out-rft-trainer", tmp_path / "job.kubeconfig")
    config = yaml.safe_load(kc.read_text())
    server = config["clusters"][0]["cluster"]
    upstream = urlsplit(server["server"])
    proxy = TcpProxy(upstream.hostname, upstream.port).start()
    server["server"] = f"https://127.0.0.1:{proxy.port}"  # the job reaches the server through it
    kc.write_text(yaml.safe_dump(config))
    as_job = kubernetes.client.CustomObjectsApi(kubernetes.config.new_client_from_config(str(kc)))
    reporter = StatusReporter("out", namespace, as_job, min_interval=0,
                              backoff=lambda failures: min(1.0, 0.1 * 2 ** failures))
    try:
        reporter.report_step(90, 100, {"actor/pg_loss": 0.5})
        reporter.report_waiting(names.WAIT_DATA, "no experiences yet", "2024-01-01T00:00:00Z", 3.0)
        wait_status(api, namespace, "out", lambda s: (s.get("trainer") or {}).get("waiting"), 30, "waiting")

        proxy.down()
        reporter.report_step(99, 100, {"actor/pg_loss": 0.2})  # clears waiting
        reporter.report_checkpoint(100, "s3://ckpts/run/ckpt/step-00000100", 4321, 0.5)
        reporter.report_weights(100, "s3://ckpts/run/weights/step-00000100", "id-100", [90, 100])
        reporter.report_step(100, 100, {"actor/pg_loss": 0.1})
        wait_for(lambda: reporter.failures >= 3, 30, "failed patches during the outage")
        assert get_job(api, namespace, "out")["status"]["trainer"]["step"] == 90  # nothing got through

        # The trainer exits while the server is still unreachable; it comes back during close().
        before = reporter.failures
        closed = threading.Thread(target=reporter.close, kwargs={"timeout": 60})
        closed.start()
        wait_for(lambda: reporter.failures >= before + 2, 30, "close() retrying")
        proxy.up()
        closed.join(60)
        assert not closed.is_alive()
    finally:
        reporter.close(timeout=0)  # no-op once closed; stops the thread if the test failed early
        proxy.stop()

    trainer = get_job(api, namespace, "out")["status"]["trainer"]
    assert trainer["latestWeights"]["version"] == 100 and trainer["latestWeights"]["id"] == "id-100"
    assert trainer["weightVersions"] == [90, 100]
    assert trainer["step"] == 100 and trainer["progress"] == "100/100"
    assert trainer["lastCheckpoint"]["step"] == 100 and trainer["lastCheckpoint"]["bytes"] == 4321
    assert "waiting" not in trainer  # the null in the merge patch deleted it
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert any("status delivered again" in r.getMessage() for r in caplog.records)
