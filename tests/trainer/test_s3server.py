"""The S3 server the tests, the demo and the benchmarks run (e2e/s3server.py: SeaweedFS):
data survives a restart, signatures are checked, servers started together do not share a
port, and a server is stopped from its record only when the PID is still that server."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import boto3
import psutil
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError

from e2e.s3server import CONFIG_FILE, RECORD_FILE, S3Server, S3ServerError, weed_binary

ROOT = Path(__file__).resolve().parents[2]
CREDS = {"alice": "alice-secret-1", "bob": "bob-secret-2"}


def client(endpoint: str, key: str, secret: str):
    return boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=key, aws_secret_access_key=secret,
                        region_name="us-east-1", config=Config(retries={"max_attempts": 1}))


def error_of(call) -> tuple[str, int]:
    with pytest.raises(ClientError) as info:
        call()
    err = info.value.response
    return err["Error"]["Code"], err["ResponseMetadata"]["HTTPStatusCode"]


def test_restart_with_the_same_data_dir_keeps_objects(tmp_path):
    data, log = tmp_path / "s3", tmp_path / "logs" / "s3.log"
    big = os.urandom(12 * 2**20)
    with S3Server(data, log_file=log, credentials=CREDS) as first:
        s3 = client(first.endpoint, "alice", CREDS["alice"])
        s3.create_bucket(Bucket="keep")
        s3.put_object(Bucket="keep", Key="a/small.txt", Body=b"hello")
        s3.upload_fileobj(io.BytesIO(big), "keep", "a/big.bin")  # multipart
        first_ports = dict(first.ports)
        cmdline = " ".join(psutil.Process(first.pid).cmdline())
    assert not (data / RECORD_FILE).exists()
    with S3Server(data, log_file=log, credentials=CREDS) as second:
        assert second.ports != first_ports  # a real restart, on new ports
        s3 = client(second.endpoint, "bob", CREDS["bob"])
        assert [b["Name"] for b in s3.list_buckets()["Buckets"]] == ["keep"]
        keys = [o["Key"] for o in s3.list_objects_v2(Bucket="keep")["Contents"]]
        assert keys == ["a/big.bin", "a/small.txt"]
        assert s3.get_object(Bucket="keep", Key="a/small.txt")["Body"].read() == b"hello"
        assert s3.get_object(Bucket="keep", Key="a/big.bin")["Body"].read() == big
        # Still writable, also in a new bucket: a new collection, for which the master
        # must grow a volume (it refuses to after losing its state).
        s3.put_object(Bucket="keep", Key="b", Body=b"after")
        s3.create_bucket(Bucket="fresh")
        s3.put_object(Bucket="fresh", Key="c", Body=b"new")
        assert s3.get_object(Bucket="fresh", Key="c")["Body"].read() == b"new"
    # The secrets reach weed only through its config file, which only we can read.
    assert (data / CONFIG_FILE).stat().st_mode & 0o777 == 0o600
    text = log.read_text()
    assert text.count("--- starting weed server") == 2  # both runs logged here
    for secret in CREDS.values():
        assert secret not in cmdline and secret not in text


def test_signatures_are_checked(s3_server):
    right = client(s3_server, "test", "test-secret")
    right.list_buckets()
    assert error_of(client(s3_server, "test", "wrong-secret").list_buckets) == ("SignatureDoesNotMatch", 403)
    assert error_of(client(s3_server, "nobody", "test-secret").list_buckets) == ("InvalidAccessKeyId", 403)
    with pytest.raises(urllib.error.HTTPError) as anonymous:  # unsigned
        urllib.request.build_opener(urllib.request.ProxyHandler({})).open(s3_server + "/", timeout=10)
    assert anonymous.value.code == 403


def test_servers_started_together_get_different_ports(tmp_path):
    servers = [S3Server(tmp_path / f"s3-{i}", credentials=CREDS) for i in range(2)]
    errors: list[BaseException] = []

    def start(server: S3Server) -> None:
        try:
            server.start()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=start, args=(s,)) for s in servers]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        a, b = servers
        assert not set(a.ports.values()) & set(b.ports.values())
        assert len(set(a.ports.values())) == len(a.ports) == 8  # HTTP + gRPC of 4 components
        client(a.endpoint, "alice", CREDS["alice"]).create_bucket(Bucket="only-in-a")
        assert client(b.endpoint, "alice", CREDS["alice"]).list_buckets()["Buckets"] == []
    finally:
        for s in servers:
            s.stop()


def stop_recorded_elsewhere(data_dir: Path) -> bool:
    """S3Server.stop_recorded from another process (as `demo down` runs it)."""
    code = "import sys; from e2e.s3server import S3Server; print(S3Server.stop_recorded(sys.argv[1]))"
    out = subprocess.run([sys.executable, "-c", code, str(data_dir)], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, check=True).stdout
    return out.strip() == "True"


def test_stop_recorded_stops_a_server_started_elsewhere(tmp_path):
    server = S3Server(tmp_path / "s3", credentials=CREDS).start()
    try:
        pid = server.pid
        assert S3Server.recorded_endpoint(tmp_path / "s3") == server.endpoint
        with pytest.raises(S3ServerError, match="already runs"):
            S3Server(tmp_path / "s3", credentials=CREDS).start()  # not two servers on one dir
        assert stop_recorded_elsewhere(tmp_path / "s3")
        # Exited: only the zombie is left until its parent, this process, reaps it.
        try:
            assert psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            pass
        server.stop()
        assert not psutil.pid_exists(pid)  # reaped
        assert S3Server.recorded_endpoint(tmp_path / "s3") is None
        assert not (tmp_path / "s3" / RECORD_FILE).exists()
        assert not stop_recorded_elsewhere(tmp_path / "s3")  # nothing left to stop
    finally:
        server.stop()


def test_stop_recorded_leaves_an_unrelated_pid_alone(tmp_path):
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        info = psutil.Process(other.pid)
        records = [
            # A recycled PID: another program.
            {"name": "weed", "pid": other.pid, "create_time": info.create_time(), "exe": info.exe()},
            # The weed binary named, but the PID runs something else.
            {"name": "weed", "pid": other.pid, "create_time": info.create_time(),
             "exe": os.path.realpath(weed_binary())},
            # The right program, but started at another time.
            {"name": "weed", "pid": other.pid, "create_time": info.create_time() - 60, "exe": info.exe()},
        ]
        for record in records:
            (tmp_path / RECORD_FILE).write_text(json.dumps({**record, "endpoint": "http://127.0.0.1:1"}))
            assert not stop_recorded_elsewhere(tmp_path)
            assert other.poll() is None, record
    finally:
        other.kill()
        other.wait()
