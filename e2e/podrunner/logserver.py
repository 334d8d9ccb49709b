"""Container logs: finding a container's log file, and the kubelet's HTTPS log endpoint."""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import re
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

from .common import _kv, log

if TYPE_CHECKING:
    from .runner import PodRunner


def find_log(state_dir: str | os.PathLike, namespace: str, pod: str, container: str | None = None) -> Path | None:
    """`<state>/pods/<ns>_<pod>_<uid>/<container>.log` of the newest such pod dir.

    Without a container name, the only container's log (None when there are several).
    """
    dirs = sorted(Path(state_dir, "pods").glob(f"{glob_escape(namespace)}_{glob_escape(pod)}_*"),
                  key=lambda p: p.stat().st_mtime, reverse=True)
    for d in dirs:
        if d.name.count("_") != 2:
            continue
        if container:
            path = d / f"{container}.log"
            if path.exists():
                return path
            continue
        logs = sorted(d.glob("*.log"))
        if len(logs) == 1:
            return logs[0]
    return None


def glob_escape(text: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", text)


def _self_signed(cert_path: Path, key_path: Path, node: str, ip: str) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{node}@podrunner")])
    now = dt.datetime.now(dt.timezone.utc)
    sans = [x509.DNSName(node), x509.IPAddress(ipaddress.ip_address(ip))]
    if ip != "127.0.0.1":
        sans.append(x509.IPAddress(ipaddress.ip_address("127.0.0.1")))
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=365))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .sign(key, hashes.SHA256()))
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


class _LogHandler(BaseHTTPRequestHandler):
    """The kubelet's /containerLogs endpoint (what `kubectl logs` reaches via the API server)."""

    runner: PodRunner
    server_version = "podrunner"

    def setup(self) -> None:
        self.request.settimeout(30)
        self.request.do_handshake()
        super().setup()

    def log_message(self, fmt: str, *args: Any) -> None:  # quiet
        log.debug("kubelet-server " + fmt, *args)

    def _reply(self, code: int, text: str) -> None:
        data = text.encode()
        self.send_response(code)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 - http.server API
        url = urlsplit(self.path)
        parts = [p for p in url.path.split("/") if p]
        if parts == ["healthz"]:
            return self._reply(200, "ok")
        if len(parts) != 4 or parts[0] != "containerLogs":
            return self._reply(404, "not found")
        _, ns, pod, container = parts
        q = parse_qs(url.query)
        path = self.runner.log_path(ns, pod, container)
        if path is None:
            return self._reply(404, f"no logs for container {container!r} of pod {ns}/{pod} on this node")
        try:
            tail = int(q.get("tailLines", ["-1"])[0])
            limit = int(q.get("limitBytes", ["-1"])[0])
        except ValueError:
            return self._reply(400, "bad tailLines/limitBytes")
        follow = q.get("follow", ["false"])[0] in ("true", "1")
        try:
            data = path.read_bytes()
        except OSError:
            return self._reply(404, "log gone")
        if tail >= 0:
            lines = data.splitlines(keepends=True)
            data = b"".join(lines[-tail:]) if tail else b""
        if limit >= 0:
            data = data[:limit]
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.end_headers()
        try:
            self.wfile.write(data)
            self.wfile.flush()
            if not follow:
                return
            sent = len(data)
            offset = path.stat().st_size
            stop = self.runner._stop
            while not stop.is_set() and (limit < 0 or sent < limit):
                try:
                    size = path.stat().st_size
                except OSError:
                    return
                if size > offset:
                    with open(path, "rb") as f:
                        f.seek(offset)
                        chunk = f.read(size - offset)
                    offset = size
                    if limit >= 0:
                        chunk = chunk[:limit - sent]
                    self.wfile.write(chunk)
                    self.wfile.flush()
                    sent += len(chunk)
                elif not self.runner._container_running(ns, pod, container):
                    return
                else:
                    stop.wait(0.2)
        except (BrokenPipeError, ConnectionResetError, ssl.SSLError):
            return


class _LogServerMixin:
    """`PodRunner`'s kubelet log endpoint on the node's InternalIP and kubelet port."""

    def _start_log_server(self) -> None:
        cert, key = self.state_dir / "kubelet.crt", self.state_dir / "kubelet.key"
        _self_signed(cert, key, self.node, self.node_ip)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(cert, key)
        runner = self

        class Handler(_LogHandler):
            pass

        Handler.runner = runner
        try:
            server = ThreadingHTTPServer((self.node_ip, 0), Handler)
        except OSError as e:
            log.warning(_kv("kubelet_server.unavailable", error=e))
            return
        server.daemon_threads = True
        server.handle_error = lambda request, address: log.debug(_kv("kubelet_server.error", peer=address))
        # Handshakes happen in the handler threads, not in the accept loop.
        server.socket = ctx.wrap_socket(server.socket, server_side=True, do_handshake_on_connect=False)
        self.kubelet_port = server.server_address[1]
        self._log_server = server
        t = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.5},
                             name="podrunner-kubelet-server", daemon=True)
        t.start()

    def _stop_log_server(self) -> None:
        if self._log_server is not None:
            self._log_server.shutdown()
            self._log_server.server_close()
            self._log_server = None
