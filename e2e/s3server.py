"""SeaweedFS as the S3-compatible server of the tests, the demo and the benchmarks.

One `weed server` process runs the master, a volume server, the filer and the S3 gateway,
all listening on one IPv4 address: loopback by default, or `host`. Every port (HTTP and
gRPC of each component) is picked free at start and passed explicitly, so nothing lands
on a port SeaweedFS would derive (gRPC = HTTP + 10000) or on its fixed defaults. Data
lives under `data_dir`: a restart with the same directory keeps every bucket and object.
Requests are authenticated with real SigV4 against the identities given (access key ->
secret key), which reach the server through an S3 config file readable by the owner
only, never on a command line or in a log.

    with S3Server(tmp / "s3", credentials={"test": "test-secret"}) as s3:
        boto3.client("s3", endpoint_url=s3.endpoint, ...)

    server = S3Server(state / "s3", log_file=state / "logs" / "s3.log", credentials=creds)
    server.start()                       # runs on after this process exits
    S3Server.recorded_endpoint(state / "s3")   # "http://127.0.0.1:PORT" while it runs
    S3Server.stop_recorded(state / "s3")       # from any process, e.g. `demo down`

The binary comes from `bash e2e/build-binaries.sh seaweedfs` (version in versions.env).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import psutil

from .host import ProcessRecord, cached_binary, log_tail, write_private

RECORD_FILE = "server.json"
CONFIG_FILE = "s3.json"
PROBE_BUCKET = "rft-s3server-ready-probe"  # created and deleted by every start
# The components of `weed server`; each gets an HTTP and a gRPC port.
COMPONENTS = ("master", "volume", "filer", "s3")
# Each bucket is its own collection, and the master grows 7 volumes per new collection
# by default: with many small test buckets that exhausts the volume slots. One at a time.
WEED_ENV = {"WEED_MASTER_VOLUME_GROWTH_COPY_1": "1"}
# Small volumes (without preallocation a volume only takes the disk its data needs), and
# enough slots for a test session's few hundred buckets; -volume.minFreeSpace (1% by
# default) still stops writes before the disk fills.
VOLUME_SIZE_LIMIT_MB = 128
MAX_VOLUMES = 1000


class S3ServerError(RuntimeError):
    """The S3 server could not be found, started or stopped."""


def weed_binary() -> Path:
    """The pinned `weed` binary in the build cache, or an error naming the build command."""
    return cached_binary("seaweedfs", "SEAWEEDFS_VERSION", "weed", "seaweedfs", S3ServerError)


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct TCP ports free on `host` now (held together while picked, so the
    kernel cannot hand out one twice)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]


def build_identities(credentials: dict[str, str]) -> dict:
    """The S3 config (`-s3.config`): one identity with full rights per access key."""
    if not credentials:
        raise ValueError("credentials: at least one access key -> secret key is required")
    return {"identities": [
        {"name": f"rft-{access_key}", "credentials": [{"accessKey": access_key, "secretKey": secret}],
         "actions": ["Admin", "Read", "List", "Tagging", "Write"]}
        for access_key, secret in credentials.items()]}


def build_command(binary: Path, data_dir: Path, ports: dict[str, int], host: str = "127.0.0.1") -> list[str]:
    """`weed server` listening on `host` only, with every port explicit."""
    p = ports
    return [
        str(binary), "-logtostderr=true", "server",
        f"-ip={host}", f"-ip.bind={host}",
        f"-dir={data_dir / 'volume'}", f"-master.dir={data_dir / 'master'}",
        "-master.peers=none",  # single master: no election wait
        f"-master.port={p['master']}", f"-master.port.grpc={p['master_grpc']}",
        f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume_grpc']}",
        f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer_grpc']}",
        "-s3", f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3_grpc']}",
        "-s3.port.iceberg=0", "-s3.port.lance=0",  # catalogs on fixed ports otherwise
        f"-s3.config={data_dir / CONFIG_FILE}",
        # Its local sockets in data_dir, not /tmp/seaweedfs-<svc>-<port>.sock, which another
        # server on another address could share by port.
        f"-filer.localSocket={data_dir / 'filer.sock'}", f"-s3.localSocket={data_dir / 's3.sock'}",
        f"-master.volumeSizeLimitMB={VOLUME_SIZE_LIMIT_MB}", "-master.volumePreallocate=false",
        f"-volume.max={MAX_VOLUMES}",
        "-volume.preStopSeconds=0",  # stops at once instead of 10 s after SIGTERM
        "-master.telemetry=false",
    ]


def _clean_env(data_dir: Path) -> dict[str, str]:
    """Our environment minus AWS_* (weed would take them as an admin identity) and
    WEED_* (its configuration), with HOME in data_dir so no ~/.seaweedfs config applies."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "WEED_"))}
    return {**env, **WEED_ENV, "HOME": str(data_dir)}


def _keep_master_state(master_dir: Path, port: int) -> None:
    """The master keeps its state (topology id, volume id bound) in <master.dir>/m<port>.
    A restart gets fresh ports, so the previous directory is renamed to the new port:
    a master that lost its state would freeze volume growth on the topology mismatch."""
    target = master_dir / f"m{port}"
    previous = [d for d in master_dir.glob("m*") if d.is_dir() and re.fullmatch(r"m\d+", d.name)]
    if target.exists() or not previous:
        return
    if len(previous) > 1:
        raise S3ServerError(f"{master_dir}: several master state dirs {sorted(d.name for d in previous)}")
    previous[0].rename(target)


class S3Server:
    """One SeaweedFS server on data_dir; `credentials` maps access keys to secret keys."""

    def __init__(self, data_dir: str | os.PathLike, log_file: str | os.PathLike | None = None, *,
                 credentials: dict[str, str], start_timeout: float = 120.0, host: str = "127.0.0.1"):
        """`host`: the address it listens on (the demo uses the real node's bridge gateway,
        which both this host and the node's pods reach)."""
        self.host = host
        self.data_dir = Path(data_dir).resolve()
        self.log_file = Path(log_file).resolve() if log_file else self.data_dir / "weed.log"
        self.credentials = dict(credentials)
        build_identities(self.credentials)  # validates
        self.start_timeout = start_timeout
        self.ports: dict[str, int] = {}
        self._proc: subprocess.Popen | None = None
        self._log_offset = 0  # where this run's output starts in log_file

    @property
    def endpoint(self) -> str:
        if not self.ports:
            raise S3ServerError("the S3 server is not started")
        return f"http://{self.host}:{self.ports['s3']}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def start(self, attempts: int = 3) -> "S3Server":
        """Starts weed and returns once signed S3 calls succeed, writes included. Retries
        with new ports when one was taken between picking and binding."""
        if self._proc is not None:
            raise S3ServerError(f"already started (pid {self._proc.pid})")
        if (running := self.recorded_endpoint(self.data_dir)) is not None:
            raise S3ServerError(f"an S3 server already runs on {self.data_dir} at {running}; "
                                f"stop it first (S3Server.stop_recorded)")
        binary = weed_binary()
        for d in ("volume", "master"):
            (self.data_dir / d).mkdir(parents=True, exist_ok=True)
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        write_private(self.data_dir / CONFIG_FILE, json.dumps(build_identities(self.credentials)).encode())
        for attempt in range(attempts):
            try:
                self._launch(binary)
                self._wait_ready()
                return self
            except S3ServerError as e:
                self.stop()
                run_log = log_tail(self.log_file, lines=10_000, offset=self._log_offset)
                if "address already in use" not in run_log or attempt == attempts - 1:
                    raise S3ServerError(f"{e}\n--- {self.log_file} (last lines) ---\n"
                                        f"{log_tail(self.log_file, lines=40, offset=self._log_offset)}") from None
            except BaseException:  # Ctrl-C, or a failure to launch: leave nothing running
                self.stop()
                raise
        raise AssertionError("unreachable")

    def _launch(self, binary: Path) -> None:
        picked = free_ports(2 * len(COMPONENTS), self.host)
        self.ports = {}
        for i, name in enumerate(COMPONENTS):
            self.ports[name], self.ports[f"{name}_grpc"] = picked[2 * i], picked[2 * i + 1]
        _keep_master_state(self.data_dir / "master", self.ports["master"])
        with open(self.log_file, "ab") as log:
            self._log_offset = log.tell()
            log.write(f"--- starting weed server, S3 at {self.endpoint}\n".encode())
            log.flush()
            # Own session: survives Ctrl-C of a terminal that started it (the demo's `up`).
            self._proc = subprocess.Popen(
                build_command(binary, self.data_dir, self.ports, self.host), stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, cwd=self.data_dir, env=_clean_env(self.data_dir),
                start_new_session=True)
        try:
            create_time = psutil.Process(self._proc.pid).create_time()
        except psutil.NoSuchProcess:  # died at once; _wait_ready reports it with the log
            return
        record = {**vars(ProcessRecord("weed", self._proc.pid, create_time, os.path.realpath(binary))),
                  "endpoint": self.endpoint, "ports": self.ports}
        tmp = self.data_dir / f".{RECORD_FILE}.tmp"
        tmp.write_text(json.dumps(record, indent=2))
        tmp.replace(self.data_dir / RECORD_FILE)

    def _wait_ready(self) -> None:
        """Polls until ListBuckets answers, then writes and deletes a probe object in a
        probe bucket. Only then do writes work: for its first seconds the filer has not
        joined the cluster and S3 PUTs wait for its lock service (up to ~10 s after a
        restart), and the master must be able to grow a volume."""
        import boto3
        from botocore.config import Config
        from botocore.exceptions import ClientError

        access_key, secret = next(iter(self.credentials.items()))
        s3 = boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=access_key,
                          aws_secret_access_key=secret, region_name="us-east-1",
                          config=Config(connect_timeout=1, read_timeout=30, retries={"max_attempts": 1}))
        deadline = time.monotonic() + self.start_timeout
        last = "no answer yet"
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise S3ServerError(f"weed exited with code {self._proc.returncode} while starting")
            try:
                s3.list_buckets()
                try:
                    s3.create_bucket(Bucket=PROBE_BUCKET)
                except ClientError as e:  # left by a server killed while starting
                    if e.response["Error"]["Code"] != "BucketAlreadyOwnedByYou":
                        raise
                s3.put_object(Bucket=PROBE_BUCKET, Key="probe", Body=b"ok")
                s3.delete_object(Bucket=PROBE_BUCKET, Key="probe")
                s3.delete_bucket(Bucket=PROBE_BUCKET)
                return
            except Exception as e:  # noqa: BLE001 - not up yet; reported on timeout
                last = f"{type(e).__name__}: {e}"
            time.sleep(0.2)
        raise S3ServerError(f"S3 server at {self.endpoint} not ready after {self.start_timeout:.0f}s ({last})")

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM, wait up to `grace` seconds, SIGKILL; reaps the process."""
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(grace)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)
            _forget_record(self.data_dir, proc.pid)

    @classmethod
    def recorded(cls, data_dir: str | os.PathLike) -> tuple[psutil.Process, dict] | None:
        """The live weed process recorded in data_dir/server.json and that record, if the
        PID still runs that same process (start time and executable match)."""
        try:
            record = json.loads((Path(data_dir) / RECORD_FILE).read_text())
            proc = ProcessRecord("weed", record["pid"], record["create_time"], record["exe"]).find()
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if proc is None or Path(record["exe"]).name != "weed":  # a record naming another program
            return None
        return proc, record

    @classmethod
    def recorded_endpoint(cls, data_dir: str | os.PathLike) -> str | None:
        """The endpoint of the server recorded in data_dir, while it runs."""
        found = cls.recorded(data_dir)
        return found[1]["endpoint"] if found else None

    @classmethod
    def stop_recorded(cls, data_dir: str | os.PathLike, grace: float = 15.0) -> bool:
        """Stops the server that another S3Server (maybe in another process) started on
        data_dir. Only a PID that still runs that weed binary since the recorded time is
        signalled; returns whether one was stopped. The record is removed either way."""
        found = cls.recorded(data_dir)
        if found is not None:
            proc = found[0]
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.terminate()
            if not _wait_gone(proc, grace):
                with contextlib.suppress(psutil.NoSuchProcess):
                    proc.kill()
                if not _wait_gone(proc, 10):
                    raise S3ServerError(f"could not stop weed (pid {proc.pid})")
        (Path(data_dir) / RECORD_FILE).unlink(missing_ok=True)
        return found is not None

    def __enter__(self) -> "S3Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _forget_record(data_dir: Path, pid: int) -> None:
    """Removes server.json if it still names `pid` (not a newer server's record)."""
    path = data_dir / RECORD_FILE
    try:
        if json.loads(path.read_text()).get("pid") == pid:
            path.unlink()
    except (OSError, ValueError):
        pass


def _wait_gone(proc: psutil.Process, timeout: float) -> bool:
    """Waits until `proc` has exited: reaped if it is our child; a zombie of another
    parent (who reaps it) counts as gone."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            proc.wait(timeout=0.1)  # reaps our child; polls anyone else's
            return True
        except psutil.TimeoutExpired:
            with contextlib.suppress(psutil.Error):
                if proc.status() == psutil.STATUS_ZOMBIE:
                    return True
        except (psutil.NoSuchProcess, ChildProcessError):
            return True
        if time.monotonic() > deadline:
            return False
