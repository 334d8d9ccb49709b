"""What the local cluster's parts share, below all of them: the repository's paths, the
pinned versions, the build cache, free ports, and host processes recognised and stopped."""

from __future__ import annotations

import os
import subprocess
import signal
import socket
from dataclasses import dataclass
from pathlib import Path

import psutil

E2E_DIR = Path(__file__).resolve().parent
REPO_ROOT = E2E_DIR.parent
VERSIONS_FILE = E2E_DIR / "versions.env"


class ClusterError(RuntimeError):
    """The local control plane could not be started, reached or stopped."""


def read_versions(path: Path = VERSIONS_FILE) -> dict[str, str]:
    """Parses the KEY=VALUE pins shared with e2e/build-binaries.sh."""
    versions = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            key, value = line.split("=", 1)
            versions[key.strip()] = value.strip()
    return versions


def cache_dir() -> Path:
    """Where build-binaries.sh caches its output (same default as the script)."""
    return Path(os.environ.get("RFT_CACHE") or Path.home() / ".cache" / "rftjob")


def cached_binary(name: str, version_key: str, binary: str, build: str, error: type[Exception]) -> Path:
    """The pinned `binary` that `bash e2e/build-binaries.sh <build>` caches under
    `<cache>/bin/<name>-<version>/` (version from versions.env's `version_key`), or `error`
    saying how to get it."""
    version = read_versions()[version_key]
    path = cache_dir() / "bin" / f"{name}-{version}" / binary
    if not os.access(path, os.X_OK):
        raise error(f"{name} {version} missing at {path}; get it with `bash e2e/build-binaries.sh {build}`")
    return path


def free_port() -> int:
    """A currently free TCP port on 127.0.0.1 (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ProcessRecord:
    """Enough about a started process to recognise it later (PIDs get reused)."""

    name: str
    pid: int
    create_time: float
    exe: str

    def find(self) -> psutil.Process | None:
        """The live process if it is still the one we started, else None."""
        try:
            proc = psutil.Process(self.pid)
            if abs(proc.create_time() - self.create_time) > 0.5:
                return None
            if proc.status() == psutil.STATUS_ZOMBIE:
                reap(proc)
                return None
            # exe, not cmdline: /proc/<pid>/cmdline reads empty while exec is loading a
            # big binary, and a PID can be recycled by anything.
            if os.path.realpath(proc.exe()) != self.exe:
                return None
            return proc
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            return None


def reap(proc: psutil.Process) -> None:
    """Collects a dead child of this process, so it does not linger as a zombie."""
    try:
        proc.wait(timeout=0)
    except (psutil.TimeoutExpired, psutil.Error, ChildProcessError):
        pass  # not our child: its parent (or init) reaps it


def log_tail(path: Path, lines: int = 30, offset: int = 0) -> str:
    """The last `lines` lines of a log file (from byte `offset` on)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
        return "\n".join(text.splitlines()[-lines:])
    except OSError:
        return "(no log)"


def stop_processes(records: list[ProcessRecord], grace: float = 10.0) -> None:
    """SIGTERM, wait up to `grace` seconds, then SIGKILL; only verified processes."""
    procs = [p for p in (r.find() for r in records) if p is not None]
    for proc in procs:
        try:
            proc.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass
    # psutil.wait_procs also reaps the ones that are our children (no zombies left).
    _, alive = psutil.wait_procs(procs, timeout=grace)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    _, still = psutil.wait_procs(alive, timeout=5)
    if still:
        raise ClusterError(f"could not stop processes {[p.pid for p in still]}")


def stop_group(proc: "subprocess.Popen | None", grace: float = 10.0) -> None:
    """Stop a server started with `start_new_session=True`: SIGTERM to its process group,
    SIGKILL after `grace` seconds. Nothing when it is not running."""
    if proc is None or proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def write_private(path: Path, data: bytes) -> None:
    """Writes a secret (key, token) readable by the owner only."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, 0o600)  # O_CREAT's mode does not apply to an existing file
