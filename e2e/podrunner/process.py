"""Container processes: the unshare/mount wrapper, starts, exits, restarts with back-off, kills."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .common import CONFIG_RETRY_S, PodRunnerError, _ConfigError, _VolumeError, _kv, _now, _safe_rel, log
from .env import expand

BACKOFF_START_S = 1.0
BACKOFF_MAX_S = 30.0
BACKOFF_RESET_S = 600.0  # a container that ran this long starts over at 1 s back-off


def check_isolation() -> None:
    """Fails unless mount+UTS namespaces and bind mounts work (needs root/CAP_SYS_ADMIN)."""
    missing = [tool for tool in ("unshare", "mount", "hostname", "nsenter") if not shutil.which(tool)]
    if missing:
        raise PodRunnerError(
            f"the pod runner needs {', '.join(missing)} (util-linux) on PATH to isolate pods"
        )
    with tempfile.TemporaryDirectory(prefix="podrunner-check-") as tmp:
        src, dst = Path(tmp, "src"), Path(tmp, "dst")
        src.mkdir()
        dst.mkdir()
        script = (f"mount --bind {shlex.quote(str(src))} {shlex.quote(str(dst))}"
                  f" && mount -o remount,bind,ro {shlex.quote(str(dst))}"
                  " && hostname podrunner-check")
        try:
            proc = subprocess.run(
                ["unshare", "--mount", "--uts", "--propagation", "private", "--", "/bin/sh", "-c", script],
                capture_output=True, text=True, timeout=20,
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            proc = None
            detail = str(e)
        else:
            detail = (proc.stderr or proc.stdout).strip()
        if proc is None or proc.returncode != 0:
            raise PodRunnerError(
                "the pod runner isolates pods with Linux mount and UTS namespaces and bind "
                "mounts, which need CAP_SYS_ADMIN (run it as root, on a kernel/sandbox that "
                "allows unshare(CLONE_NEWNS|CLONE_NEWUTS) and mount(2)); the check "
                f"`unshare --mount --uts -- mount --bind ...; hostname ...` failed: {detail}"
            )


class _Container:
    """Runtime state of one (init) container of a pod."""

    def __init__(self, spec: dict, init: bool, waiting_reason: str):
        self.spec = spec
        self.name: str = spec["name"]
        self.init = init
        self.proc: subprocess.Popen | None = None
        self.pid: int | None = None
        self.restart_count = 0
        self.ever_started = False
        self.state: dict = {"waiting": {"reason": waiting_reason}}
        self.last_state: dict = {}
        self.started_at: str | None = None
        self.started_mono = 0.0
        self.ready = False
        self.done = False  # terminated and will not restart
        self.exit_code: int | None = None
        self.next_start = 0.0
        self.backoff = BACKOFF_START_S
        self.env: dict[str, str] = {}
        self.workdir = "/"
        # readiness probe
        self.probe_next = 0.0
        self.probe_successes = 0
        self.probe_failures = 0

    @property
    def running(self) -> bool:
        return self.proc is not None

    def status(self) -> dict:
        status = {
            "name": self.name,
            "image": self.spec.get("image", ""),
            "imageID": "",
            "ready": bool(self.ready),
            "restartCount": self.restart_count,
            "started": self.running,
            "state": self.state,
            "lastState": self.last_state,
        }
        if self.pid is not None:
            status["containerID"] = f"runner://{self.pid}"
        return status


class _ContainersMixin:
    """`_PodWorker`'s container processes: start, exit, restart policy, kill."""

    def _step_container(self, c: _Container, now: float) -> None:
        if c.proc is not None:
            rc = c.proc.poll()
            if rc is None:
                return
            self._on_exit(c, rc, now)
            return
        if c.done or now < c.next_start:
            return
        self._start_container(c, now)

    def _will_restart(self, c: _Container, rc: int) -> bool:
        if c.init:
            return rc != 0 and self.restart_policy != "Never"
        if self.restart_policy == "Always":
            return True
        if self.restart_policy == "OnFailure":
            return rc != 0
        return False

    def _on_exit(self, c: _Container, rc: int, now: float) -> None:
        code = rc if rc >= 0 else 128 - rc  # killed by signal N: 128+N
        terminated = {
            "exitCode": code,
            "reason": "Completed" if code == 0 else "Error",
            "startedAt": c.started_at,
            "finishedAt": _now(),
            "containerID": f"runner://{c.pid}",
        }
        c.proc = None
        c.ready = False
        c.exit_code = code
        c.probe_successes = c.probe_failures = 0
        log.info(_kv("container.exit", pod=f"{self.ns}/{self.pod_name}", container=c.name, code=code))
        if self._will_restart(c, code) and not self.stopping and self.delete_deadline is None:
            if now - c.started_mono >= BACKOFF_RESET_S:
                c.backoff = BACKOFF_START_S
            delay = c.backoff
            c.backoff = min(c.backoff * 2, BACKOFF_MAX_S)
            c.next_start = now + delay
            c.last_state = {"terminated": terminated}
            c.state = {"waiting": {
                "reason": "CrashLoopBackOff",
                "message": f"back-off {delay:g}s restarting failed container={c.name} pod={self.pod_name}",
            }}
        else:
            c.state = {"terminated": terminated}
            c.done = True

    def _start_container(self, c: _Container, now: float) -> None:
        try:
            env = self._resolve_env(c.spec)
        except _ConfigError as e:
            c.state = {"waiting": {"reason": "CreateContainerConfigError", "message": str(e)}}
            c.next_start = now + CONFIG_RETRY_S
            return
        except Exception as e:  # noqa: BLE001 - API trouble: same treatment
            c.state = {"waiting": {"reason": "CreateContainerConfigError", "message": f"{type(e).__name__}: {e}"}}
            c.next_start = now + CONFIG_RETRY_S
            return
        lookup = env.get
        command = [expand(a, lookup) for a in c.spec.get("command") or []]
        args = [expand(a, lookup) for a in c.spec.get("args") or []]
        argv = command + args
        if not argv:
            c.state = {"waiting": {"reason": "CreateContainerError",
                                   "message": "no command: the pod runner has no image entrypoint"}}
            c.next_start = now + CONFIG_RETRY_S
            return
        if argv[0] in ("python", "python3"):
            argv[0] = sys.executable
        full_env = {**self.runner._base_env, "HOSTNAME": self.hostname, **env}
        workdir = c.spec.get("workingDir") or str(self.dir)
        try:
            script = self._setup_script(c, workdir, full_env)
        except _VolumeError as e:
            c.state = {"waiting": {"reason": "CreateContainerConfigError", "message": str(e)}}
            c.next_start = now + CONFIG_RETRY_S
            return
        log_path = self.dir / f"{c.name}.log"
        try:
            with open(log_path, "ab") as logf:
                proc = subprocess.Popen(
                    ["unshare", "--mount", "--uts", "--propagation", "private", "--",
                     "/bin/sh", "-c", script, "sh", *argv],
                    stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                    cwd=self.dir, env=full_env, start_new_session=True,
                )
        except OSError as e:
            c.state = {"waiting": {"reason": "RunContainerError", "message": str(e)}}
            c.next_start = now + c.backoff
            c.backoff = min(c.backoff * 2, BACKOFF_MAX_S)
            return
        if c.ever_started:
            c.restart_count += 1
        c.ever_started = True
        c.proc, c.pid = proc, proc.pid
        c.env, c.workdir = full_env, workdir
        c.started_at = _now()
        c.started_mono = now
        c.state = {"running": {"startedAt": c.started_at}}
        c.exit_code = None
        probe = c.spec.get("readinessProbe")
        c.ready = probe is None
        c.probe_successes = c.probe_failures = 0
        if probe:
            c.probe_next = now + float(probe.get("initialDelaySeconds") or 0)
        log.info(_kv("container.start", pod=f"{self.ns}/{self.pod_name}", container=c.name,
                     pid=proc.pid, restarts=c.restart_count))

    def _setup_script(self, c: _Container, workdir: str, env: dict[str, str]) -> str:
        """The shell run inside the new namespaces before exec'ing the command."""
        q = shlex.quote
        lines = ["set -e"]
        mounts = []
        for m in c.spec.get("volumeMounts") or []:
            name = m["name"]
            if name not in self.volume_paths:
                raise _VolumeError(f"volumeMount {name!r}: no such volume")
            source = self.volume_paths[name]
            sub = m.get("subPath") or ""
            if m.get("subPathExpr"):
                sub = expand(m["subPathExpr"], env.get)
            if sub:
                source = source / _safe_rel(sub)
                if not source.exists():
                    source.mkdir(parents=True, exist_ok=True)
            target = m["mountPath"]
            if not target.startswith("/"):
                raise _VolumeError(f"volumeMount {name!r}: mountPath must be absolute")
            mounts.append((target, source, bool(m.get("readOnly"))))
        mounts.sort(key=lambda t: t[0].rstrip("/").count("/"))  # parents before children
        for target, source, _ in mounts:
            # Missing mount points are made here, after the parent mounts: a nested one
            # lands inside its parent volume, a top-level one on the host filesystem.
            if source.is_dir():
                lines.append(f"mkdir -p {q(target)}")
            else:
                lines.append(f"[ -e {q(target)} ] || {{ mkdir -p {q(str(Path(target).parent))} && : > {q(target)}; }}")
            lines.append(f"mount --bind {q(str(source))} {q(target)}")
        for target, _, read_only in mounts:
            if read_only:
                lines.append(f"mount -o remount,bind,ro {q(target)}")
        lines.append(f"mount --bind {q(str(self.hosts_path))} /etc/hosts")
        lines.append(f"hostname {q(self.hostname)}")
        lines.append(f"mkdir -p {q(workdir)} && cd {q(workdir)}")
        lines.append('exec "$@"')
        return "\n".join(lines)

    def _signal_all(self, sig: int, containers: list[_Container]) -> None:
        for c in containers:
            if c.pid is None:
                continue
            try:
                os.killpg(c.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def _kill_all(self, grace: float) -> None:
        """SIGTERM every running container's process group, SIGKILL after `grace` s."""
        running = [c for c in self.inits + self.mains if c.proc is not None]
        if not running:
            return
        if grace > 0:
            self._signal_all(signal.SIGTERM, running)
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline and any(c.proc.poll() is None for c in running):
                if self.delete_deadline is not None and self.delete_deadline < deadline:
                    deadline = self.delete_deadline  # deleted again with a shorter grace
                self.wake.wait(0.1)
                self.wake.clear()
        self._signal_all(signal.SIGKILL, running)
        now = time.monotonic()
        for c in running:
            try:
                c.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                log.warning(_kv("container.unkillable", pod=f"{self.ns}/{self.pod_name}", pid=c.pid))
                continue
            self._on_exit(c, c.proc.returncode, now)
