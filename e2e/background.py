"""Long-running helper processes of the local setup (operator, pod runner, S3 server),
started in their own sessions so they outlive the command that started them, tracked by
pid files in the cluster's state directory, and stopped only if the pid still runs the
command we started (pids get reused)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from .cluster import REPO_ROOT


class Background:
    def __init__(self, name: str, state_dir: Path, argv: list[str], marker: str,
                 env: dict[str, str] | None = None):
        """`marker`: a string in the command line that identifies our process."""
        self.name, self.state_dir, self.argv, self.marker = name, Path(state_dir), argv, marker
        self.env = env or {}
        self.pid_file = self.state_dir / f"{name}.pid"
        self.log_path = self.state_dir / "logs" / f"{name}.log"

    def process(self) -> psutil.Process | None:
        try:
            proc = psutil.Process(int(self.pid_file.read_text()))
            return proc if self.marker in " ".join(proc.cmdline()) else None
        except (FileNotFoundError, ValueError, psutil.NoSuchProcess, psutil.AccessDenied):
            return None

    def start(self) -> int:
        if (proc := self.process()) is not None:
            return proc.pid
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            proc = subprocess.Popen(self.argv, env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env},
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                    cwd=REPO_ROOT)
        self.pid_file.write_text(str(proc.pid))
        return proc.pid

    def stop(self, timeout: float = 30.0) -> None:
        proc = self.process()
        if proc is not None:
            try:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout)
            except psutil.TimeoutExpired:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        self.pid_file.unlink(missing_ok=True)

    def alive(self) -> bool:
        return self.process() is not None

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except FileNotFoundError:
            return ""


def python(*args: str) -> list[str]:
    return [sys.executable, *args]


def wait_until(predicate, timeout: float, what: str, poll: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (value := predicate()):
            return value
        time.sleep(poll)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
