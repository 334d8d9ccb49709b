"""A local OCI registry (CNCF distribution v3) on loopback, for the project's images.

One `registry` process per state dir, listening on 127.0.0.1 at a port picked when it
starts. Its storage lives in the build cache (``$RFT_CACHE/registry``, default
``~/.cache/rftjob/registry``), outside any state dir, so pushed layers survive restarts
and `make clean`: the registry is the image build's cache (see e2e/images.py).

The binary comes from ``bash e2e/build-binaries.sh registry`` (version in
``e2e/versions.env``).

Public API::

    r = Registry(state_dir)
    r.ensure()            # starts it unless it is already up; returns r.address
    r.address             # "127.0.0.1:PORT"
    r.manifest_digest("rftjob/base", "tag")   # "sha256:..." or None
    r.running(); r.stop()

CLI: ``python -m e2e.registry up|down|status [--state-dir DIR]``.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import logging
import os
import secrets
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import psutil
import yaml

from .host import REPO_ROOT, ProcessRecord, cache_dir, cached_binary, free_port, log_tail, stop_processes

log = logging.getLogger("e2e.registry")

DEFAULT_STATE_DIR = REPO_ROOT / ".local" / "registry"

# What HEAD/GET on a manifest accept: single-platform images, OCI and Docker.
MANIFEST_TYPES = (
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
)


class RegistryError(RuntimeError):
    """The local registry could not be started, reached or stopped."""


def registry_binary() -> Path:
    """The pinned registry binary, or an error saying how to build it."""
    return cached_binary("registry", "REGISTRY_VERSION", "registry", "registry", RegistryError)


def storage_dir() -> Path:
    return cache_dir() / "registry"


def build_config(port: int, storage: Path, secret: str) -> dict[str, Any]:
    """The registry's configuration: plain HTTP on loopback, filesystem storage.

    No proxy (pull-through) section, no reporting, no debug/metrics listener; deletes are
    allowed so that old tags can be cleaned up with the API.
    """
    return {
        "version": 0.1,
        "log": {"level": "warn", "formatter": "text", "accesslog": {"disabled": True}},
        "storage": {
            "filesystem": {"rootdirectory": str(storage)},
            "delete": {"enabled": True},
        },
        "http": {"addr": f"127.0.0.1:{port}", "secret": secret},
    }


# distribution v3 exports OpenTelemetry traces to localhost:4318 by default (and logs an
# error for every failed export); there is no collector here.
PROCESS_ENV = {"OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "none",
               "OTEL_LOGS_EXPORTER": "none", "OTEL_SDK_DISABLED": "true"}


class Registry:
    """The registry of one state dir: config.yml, registry.json (its process), registry.log.

    `storage` (default: storage_dir(), shared by every state dir) is where blobs and
    manifests live; tests pass their own.
    """

    def __init__(self, state_dir: str | os.PathLike = DEFAULT_STATE_DIR, storage: Path | None = None):
        self.state_dir = Path(state_dir).resolve()
        self.storage = Path(storage).resolve() if storage else storage_dir()
        self.config_file = self.state_dir / "config.yml"
        self.record_file = self.state_dir / "registry.json"
        self.log_file = self.state_dir / "registry.log"
        # Never through a proxy: the registry is on loopback.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    # -- process

    @property
    def address(self) -> str:
        record = self._read_record()
        if record is None:
            raise RegistryError(f"no registry recorded in {self.record_file}; call ensure() first")
        return f"127.0.0.1:{record[1]}"

    def running(self) -> bool:
        """Whether the recorded process is alive (still the one started) and answers /v2/."""
        record = self._read_record()
        return record is not None and record[0].find() is not None and self._v2_ok(record[1])

    def ensure(self, timeout: float = 30) -> str:
        """Starts the registry unless it already runs; returns its address."""
        with self._lock():
            if self.running():
                return self.address
            self._stop_recorded()  # a recorded one that is dead or not answering
            binary = registry_binary()
            port = free_port()
            self.storage.mkdir(parents=True, exist_ok=True)
            self.config_file.write_text(yaml.safe_dump(build_config(port, self.storage, secrets.token_hex(16))))
            with open(self.log_file, "ab") as logf:
                proc = subprocess.Popen(
                    [str(binary), "serve", str(self.config_file)], stdin=subprocess.DEVNULL,
                    stdout=logf, stderr=subprocess.STDOUT, cwd=self.state_dir,
                    env={**os.environ, **PROCESS_ENV}, start_new_session=True,
                )
            record = ProcessRecord("registry", proc.pid, psutil.Process(proc.pid).create_time(),
                                   os.path.realpath(binary))
            self.record_file.write_text(json.dumps(
                {"pid": record.pid, "create_time": record.create_time, "exe": record.exe, "port": port}))
            try:
                self._wait_ready(record, port, timeout)
            except BaseException:
                self._stop_recorded()
                raise
            log.info("registry up at 127.0.0.1:%d (pid %d, storage %s)", port, proc.pid, self.storage)
            return self.address

    def stop(self) -> None:
        """Stops the recorded process, if it is still the one started (PIDs get reused)."""
        with self._lock():
            self._stop_recorded()

    # -- HTTP API

    def manifest_digest(self, repository: str, reference: str) -> str | None:
        """The digest of `repository:reference` as the registry reports it, or None."""
        try:
            with self._request("HEAD", f"/v2/{repository}/manifests/{reference}") as resp:
                return resp.headers["Docker-Content-Digest"]
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return None
            raise RegistryError(f"HEAD {repository}:{reference}: HTTP {e.code}") from None

    def manifest(self, repository: str, reference: str) -> dict[str, Any]:
        with self._request("GET", f"/v2/{repository}/manifests/{reference}") as resp:
            return json.loads(resp.read())

    def blob_sizes(self) -> dict[str, int]:
        """digest -> size of every blob in storage (read from the filesystem driver's
        layout), to see what a push really uploaded."""
        blobs = self.storage / "docker" / "registry" / "v2" / "blobs" / "sha256"
        return {f"sha256:{data.parent.name}": data.stat().st_size for data in blobs.glob("*/*/data")}

    def _request(self, method: str, path: str, timeout: float = 10):
        req = urllib.request.Request(f"http://{self.address}{path}", method=method,
                                     headers={"Accept": ", ".join(MANIFEST_TYPES)})
        return self._opener.open(req, timeout=timeout)

    # -- internals

    def _read_record(self) -> tuple[ProcessRecord, int] | None:
        try:
            data = json.loads(self.record_file.read_text())
            return ProcessRecord("registry", data["pid"], data["create_time"], data["exe"]), data["port"]
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _stop_recorded(self) -> None:
        record = self._read_record()
        if record is not None:
            stop_processes([record[0]])
            log.info("stopped the registry (pid %d)", record[0].pid)
        self.record_file.unlink(missing_ok=True)

    def _v2_ok(self, port: int) -> bool:
        try:
            with self._opener.open(f"http://127.0.0.1:{port}/v2/", timeout=2) as resp:
                return resp.status == 200
        except OSError:
            return False

    def _wait_ready(self, record: ProcessRecord, port: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self._v2_ok(port):
            if record.find() is None:
                raise RegistryError(f"the registry exited at startup; tail of {self.log_file}:\n"
                                    + log_tail(self.log_file))
            if time.monotonic() > deadline:
                raise RegistryError(f"the registry did not answer GET /v2/ on port {port} within "
                                    f"{timeout:.0f}s; tail of {self.log_file}:\n" + log_tail(self.log_file))
            time.sleep(0.1)

    @contextlib.contextmanager
    def _lock(self) -> Iterator[None]:
        """One start/stop at a time per state dir (two builds may call ensure() at once)."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        with open(self.state_dir / "registry.lock", "w") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            yield


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.registry", description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=["up", "down", "status"])
    parser.add_argument("--state-dir", default=DEFAULT_STATE_DIR,
                        help="where the registry keeps its config and PID (default: %(default)s)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[registry] %(message)s", stream=sys.stderr)
    registry = Registry(args.state_dir)
    try:
        if args.command == "up":
            print(registry.ensure())
        elif args.command == "down":
            registry.stop()
        else:
            running = registry.running()
            print(json.dumps({"running": running, "address": registry.address if running else None,
                              "storage": str(registry.storage)}))
            return 0 if running else 1
    except RegistryError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
