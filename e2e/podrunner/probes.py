"""Readiness probes: httpGet, tcpSocket and exec (inside the container's namespaces)."""

from __future__ import annotations

import http.client
import socket
import ssl
import subprocess
import sys
from typing import Any

from .common import _kv, log
from .process import _Container


class _ProbesMixin:
    """`_PodWorker`'s readiness probing of its running containers."""

    def _probe(self, c: _Container, now: float) -> None:
        probe = c.spec.get("readinessProbe")
        if not probe or c.proc is None or now < c.probe_next:
            return
        c.probe_next = now + float(probe.get("periodSeconds") or 10)
        ok = self._run_probe(c, probe)
        if ok:
            c.probe_failures = 0
            c.probe_successes += 1
            if not c.ready and c.probe_successes >= int(probe.get("successThreshold") or 1):
                c.ready = True
                log.info(_kv("container.ready", pod=f"{self.ns}/{self.pod_name}", container=c.name))
        else:
            c.probe_successes = 0
            c.probe_failures += 1
            if c.ready and c.probe_failures >= int(probe.get("failureThreshold") or 3):
                c.ready = False
                log.info(_kv("container.unready", pod=f"{self.ns}/{self.pod_name}", container=c.name))

    def _port(self, c: _Container, port: Any) -> int:
        if isinstance(port, int) or (isinstance(port, str) and port.isdigit()):
            return int(port)
        for p in c.spec.get("ports") or []:
            if p.get("name") == port:
                return int(p["containerPort"])
        raise ValueError(f"no port named {port!r}")

    def _run_probe(self, c: _Container, probe: dict) -> bool:
        timeout = float(probe.get("timeoutSeconds") or 1)
        try:
            if "httpGet" in probe:
                h = probe["httpGet"]
                host = h.get("host") or self.ip
                port = self._port(c, h.get("port"))
                if (h.get("scheme") or "HTTP").upper() == "HTTPS":
                    ctx = ssl._create_unverified_context()  # noqa: S323 - kubelet does not verify either
                    conn = http.client.HTTPSConnection(host, port, timeout=timeout, context=ctx)
                else:
                    conn = http.client.HTTPConnection(host, port, timeout=timeout)
                try:
                    headers = {x["name"]: x["value"] for x in h.get("httpHeaders") or []}
                    headers.setdefault("User-Agent", "kube-probe/podrunner")
                    conn.request("GET", h.get("path") or "/", headers=headers)
                    return 200 <= conn.getresponse().status < 400
                finally:
                    conn.close()
            if "tcpSocket" in probe:
                t = probe["tcpSocket"]
                with socket.create_connection((t.get("host") or self.ip, self._port(c, t.get("port"))),
                                              timeout=timeout):
                    return True
            if "exec" in probe:
                argv = list(probe["exec"].get("command") or [])
                if argv and argv[0] in ("python", "python3"):
                    argv[0] = sys.executable
                result = subprocess.run(
                    ["nsenter", f"--target={c.pid}", "--mount", "--uts", f"--wd={c.workdir}", "--", *argv],
                    env=c.env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL, timeout=timeout,
                )
                return result.returncode == 0
        except Exception:  # noqa: BLE001 - any failure is a failed probe
            return False
        return False
