"""S3 faults between the trainer and the server: a proxy answers some requests (or all,
during an outage window) with 503 SlowDown. Writes and reads must succeed by retrying."""

import os
import threading
import time

import boto3
import pytest

from rft_contract.s3 import S3Storage

from .faultproxy import FaultProxy


@pytest.fixture
def proxy(s3_server):
    p = FaultProxy(s3_server, fail_fraction=0.0, seed=7).start()
    yield p
    p.stop()


@pytest.fixture
def faulty(proxy, bucket, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    return S3Storage(part_size=5 * 2**20)


def test_slowdown_on_a_third_of_requests_is_retried(faulty, proxy, bucket):
    proxy.fail_fraction = 0.33
    blob = os.urandom(12 * 2**20)  # multipart: several part uploads, each may be refused
    faulty.write_bytes(f"s3://{bucket}/ckpt/shard.bin", blob)
    for i in range(10):
        faulty.write_bytes(f"s3://{bucket}/small/{i}", b"x" * i)
    assert faulty.read_bytes(f"s3://{bucket}/ckpt/shard.bin") == blob
    assert len(faulty.list(f"s3://{bucket}/small/")) == 10
    assert proxy.injected >= 5, proxy.injected  # faults really happened


def test_an_outage_window_delays_but_does_not_fail_a_write(faulty, proxy, bucket):
    proxy.outage(4.0)
    start = time.monotonic()
    faulty.write_bytes(f"s3://{bucket}/during-outage", b"payload")
    assert time.monotonic() - start >= 3.5  # it waited the outage out
    direct = boto3.client("s3", endpoint_url=proxy.upstream.geturl())
    assert direct.get_object(Bucket=bucket, Key="during-outage")["Body"].read() == b"payload"


def test_an_outage_that_outlasts_botocores_retry_quota_fails_no_request(faulty, proxy, bucket):
    """40 requests in flight through a 6 s outage make ~200 retries. botocore's standard
    mode shares a quota of ~100 retries per client: it would fail most of them at once
    (the likely cause of a trainer rank that exited 1 in the e2e S3-outage test).
    Each request here has its own deadline instead."""
    proxy.outage(6.0)
    errors = []

    def put(i: int) -> None:
        try:
            faulty.write_bytes(f"s3://{bucket}/storm/{i}", b"x" * i)
        except Exception as e:  # noqa: BLE001 - collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=put, args=(i,)) for i in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, f"{len(errors)} of 40 failed: {errors[0]!r}"
    assert len(faulty.list(f"s3://{bucket}/storm/")) == 40
    assert proxy.injected >= 100, proxy.injected  # the quota's worth of retries really happened


def test_a_request_still_failing_at_its_deadline_raises_the_servers_error(proxy, bucket, monkeypatch):
    from botocore.exceptions import ClientError

    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    monkeypatch.setenv("RFT_S3_RETRY_SECONDS", "2")
    storage = S3Storage()
    proxy.outage(120.0)
    start = time.monotonic()
    with pytest.raises(ClientError, match="SlowDown"):
        storage.write_bytes(f"s3://{bucket}/never", b"payload")
    assert 2.0 <= time.monotonic() - start < 60  # gave up at its deadline, not at the outage's end


@pytest.mark.parametrize("raw", ["soon", "-1", "nan"])
def test_a_bad_retry_budget_in_the_environment_is_named(raw, monkeypatch):
    monkeypatch.setenv("RFT_S3_RETRY_SECONDS", raw)
    with pytest.raises(ValueError, match="RFT_S3_RETRY_SECONDS"):
        S3Storage()


def _attempt(retries, attempt, status=None, code="", error=None, context=None):
    """What botocore's `needs-retry` event passes after one failed attempt."""
    from types import SimpleNamespace

    import botocore.session

    operation = botocore.session.get_session().get_service_model("s3").operation_model("PutObject")
    response = None if status is None else (SimpleNamespace(status_code=status, headers={}),
                                            {"Error": {"Code": code}, "ResponseMetadata": {}})
    return retries.needs_retry(attempts=attempt, response=response, caught_exception=error,
                               operation=operation,
                               request_dict={"context": context if context is not None else {}})


def test_deadline_retries_wait_within_the_budget_and_not_for_what_cannot_pass():
    from botocore.exceptions import EndpointConnectionError, SSLError

    from rft_contract.s3 import DeadlineRetries

    now = [100.0]
    retries = DeadlineRetries(30.0, rng=lambda: 1.0, clock=lambda: now[0])
    context: dict = {}
    assert _attempt(retries, 1, 503, "SlowDown", context=context) == 1.0
    assert _attempt(retries, 4, 500, "InternalError", context=context) == 8.0
    assert _attempt(retries, 9, status=None, error=EndpointConnectionError(endpoint_url="http://s3"),
                    context=context) == 10.0  # the cap
    now[0] = 125.0
    assert _attempt(retries, 10, 503, context=context) == 5.0  # the last wait ends at the deadline
    now[0] = 130.0
    assert _attempt(retries, 11, 503, context=context) is None
    assert _attempt(retries, 5000, 503) == 10.0  # a budget of days: no overflow
    for status, code in ((403, "AccessDenied"), (404, "NoSuchKey"), (400, "InvalidArgument")):
        assert _attempt(retries, 1, status, code) is None, code
    untrusted = SSLError(endpoint_url="https://s3", error="[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed")
    assert _attempt(retries, 1, error=untrusted) is None
    reset = SSLError(endpoint_url="https://s3", error="EOF occurred in violation of protocol")
    assert _attempt(retries, 1, error=reset) == 1.0
