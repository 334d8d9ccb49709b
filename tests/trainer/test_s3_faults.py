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
