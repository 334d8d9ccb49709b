"""Runs an inference engine as a child process that the sync agent can restart.

    python -m rft_serving.supervise --control-port 8472 -- python3 -m vllm.entrypoints... ARGS

A reload can leave an engine broken (vLLM after a failed `reload_weights`: layers left on
the meta device, every later reload fails too, the next request kills the server) or
serving wrong outputs (the probe check in sync_agent.py): the only cure is a fresh start
from the weights on disk. The engine container's command is this supervisor; the sync
agent, in the same pod, asks it on the pod's loopback for a restart, which is immediate
(no kubelet back-off) and leaves the container's restart count to real crashes.

- `POST /restart`: stop the engine's whole process group (SIGTERM, SIGKILL after
  `--stop-timeout`), start it again with the same command; answers once it started
  (not once it is ready: the agent polls the engine for that).
  `GET /status`: {"pid", "restarts", "started"}.
- The control server listens on 127.0.0.1 only: the containers of the pod share it,
  nothing outside the pod reaches it.
- An engine that exits on its own ends the supervisor with the engine's exit code, so a
  crash is still a container restart the kubelet counts and backs off.
- SIGTERM/SIGINT are passed to the engine's process group; the supervisor exits with
  the engine's code once it stopped.
- An engine image that records its build's CPU kernels (cpu_isa.ENGINE_BUILD_RECORD, as
  the `vllm` CPU image does) is not started on a CPU that lacks a flag they need: the
  supervisor exits with EXIT_CPU_UNSUPPORTED and a message naming the flags, in its log
  and in the container's termination message, where vLLM would die of SIGILL.

Standard library only: the module runs in the engine's image, whatever else it has
(the inference pod's init container copies the rft_serving package there).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from . import cpu_isa

log = logging.getLogger("rft_serving.supervise")

CONTROL_PORT = 8472
EXIT_CPU_UNSUPPORTED = 78  # sysexits' EX_CONFIG: the image does not fit the node's CPU
TERMINATION_LOG = "/dev/termination-log"  # the container's terminationMessagePath (the default)


class Supervisor:
    """One engine process (group) at a time; `restart` swaps it."""

    def __init__(self, command: list[str], stop_timeout: float = 30.0):
        self.command, self.stop_timeout = command, stop_timeout
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self.started = 0.0
        self._lock = threading.Lock()  # one start/stop at a time
        self._restarting = False
        self._stopping = False
        self.exited = threading.Event()
        self.exit_code = 0

    def start(self) -> None:
        # A process group of its own: the engine's helpers (vLLM's EngineCore, workers)
        # stop with it, and none is left holding the port or the memory.
        self.proc = subprocess.Popen(self.command, start_new_session=True)
        self.started = time.time()
        log.info("engine started (pid %d): %s", self.proc.pid, " ".join(redacted(self.command)))

    def restart(self, reason: str) -> dict:
        with self._lock:
            if self._stopping:  # the pod is shutting down: no new engine
                log.warning("not restarting the engine while stopping (%s)", reason)
                return self.status()
            self._restarting = True
            try:
                log.warning("restarting the engine: %s", reason)
                self._stop_group()
                self.restarts += 1
                self.start()
            finally:
                self._restarting = False
            return self.status()

    def status(self) -> dict:
        return {"pid": self.proc.pid if self.proc else None, "restarts": self.restarts,
                "started": self.started}

    def terminate(self) -> None:
        """SIGTERM to the supervisor: stop the engine, then leave with its code."""
        self._stopping = True
        threading.Thread(target=self._terminate, daemon=True).start()

    def _terminate(self) -> None:
        with self._lock:
            self._stop_group()

    def _stop_group(self) -> None:
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                log.warning("engine did not stop within %.0fs: SIGKILL", self.stop_timeout)
                _signal_group(proc.pid, signal.SIGKILL)
                try:
                    proc.wait(self.stop_timeout)
                except subprocess.TimeoutExpired:
                    log.error("engine (pid %d) still there after SIGKILL", proc.pid)
        # Helpers that outlived their parent (an EngineCore holding the port and memory),
        # also when the engine itself had already exited.
        _signal_group(proc.pid, signal.SIGKILL)

    def watch(self) -> int:
        """Block until the engine exits on its own (or after `terminate`); its exit code."""
        while True:
            proc = self.proc
            code = proc.wait()
            with self._lock:  # a restart in progress replaces the process first
                if self.proc is proc and not self._restarting:
                    if not self._stopping:
                        log.error("engine exited with code %d", code)
                    return code if code >= 0 else 128 - code  # killed by a signal: 128 + n


# Flags whose value is a credential (vLLM's --api-key, a hub token, ...): never logged.
_SECRET_WORDS = {"key", "token", "secret", "password", "credential", "credentials"}


def redacted(command: list[str]) -> list[str]:
    """`command` for the log: the value of any flag named like a credential replaced
    (`--api-key X` and `--api-key=X` alike)."""
    out, hide = [], False
    for arg in command:
        if hide:
            out.append("<redacted>")
            hide = False
            continue
        flag, eq, _ = arg.partition("=")
        words = set(flag.lower().lstrip("-").replace("_", "-").split("-"))
        secret = flag.startswith("-") and bool(words & _SECRET_WORDS)
        if secret and eq:
            out.append(f"{flag}=<redacted>")
        else:
            out.append(arg)
            hide = secret
    return out


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _handler(supervisor: Supervisor):
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            if self.path == "/status":
                self._reply(200, supervisor.status())
            else:
                self._reply(404, {"error": f"no route {self.path}"})

        def do_POST(self) -> None:  # noqa: N802
            if self.path.split("?")[0] != "/restart":
                self._reply(404, {"error": f"no route {self.path}"})
                return
            length = int(self.headers.get("Content-Length") or 0)
            try:
                body = json.loads(self.rfile.read(length) or b"{}")
            except ValueError:
                body = {}
            reason = str(body.get("reason", "asked by the sync agent"))[:300] if isinstance(body, dict) else ""
            self._reply(200, supervisor.restart(reason))

        def _reply(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, fmt: str, *args) -> None:
            log.info("control: " + fmt, *args)

    return Handler


def _termination_message(message: str, path: str = TERMINATION_LOG) -> None:
    """The container's termination message (`kubectl describe pod`, the pod's status), into
    the file the kubelet mounted there; outside a container there is none, and none is made."""
    try:
        with open(path, "r+") as f:  # never creates it
            f.truncate()
            f.write(message[-4096:])  # the kubelet keeps at most 4 KiB
    except OSError:
        pass


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print("usage: python -m rft_serving.supervise [--control-port N] -- ENGINE COMMAND...", file=sys.stderr)
        return 2
    split = argv.index("--")
    ap = argparse.ArgumentParser(prog="rft_serving.supervise")
    ap.add_argument("--control-port", type=int, default=CONTROL_PORT)
    ap.add_argument("--stop-timeout", type=float, default=30.0)
    ap.add_argument("--engine-build", default=cpu_isa.ENGINE_BUILD_RECORD, help=argparse.SUPPRESS)
    ap.add_argument("--cpuinfo", default=cpu_isa.CPUINFO, help=argparse.SUPPRESS)
    args = ap.parse_args(argv[:split])
    command = argv[split + 1:]
    if not command:
        print("no engine command after --", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        build = cpu_isa.read_record(args.engine_build)
    except (OSError, ValueError, KeyError, TypeError) as e:
        build, refused = None, f"the image's {args.engine_build} cannot be read ({type(e).__name__}: {e})"
    else:
        refused = None
    if build is not None:
        flags = cpu_isa.cpu_flags(args.cpuinfo)
        refused = cpu_isa.compute_refusal(build, flags)
        if not refused:
            log.info("CPU check: %s", cpu_isa.compute_summary(build, flags))
    if refused:
        log.error("not starting the engine: %s", refused)
        _termination_message(f"not starting the engine: {refused}")
        return EXIT_CPU_UNSUPPORTED
    supervisor = Supervisor(command, args.stop_timeout)
    server = ThreadingHTTPServer(("127.0.0.1", args.control_port), _handler(supervisor))
    threading.Thread(target=server.serve_forever, name="control", daemon=True).start()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: supervisor.terminate())
    supervisor.start()
    code = supervisor.watch()
    server.shutdown()
    return code


if __name__ == "__main__":
    sys.exit(main())
