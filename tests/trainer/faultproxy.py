"""A small fault-injecting HTTP proxy for S3 tests: forwards to a real S3-compatible
server, and answers a chosen fraction of requests (or every request during an outage
window) with `503 SlowDown`, as S3 does under load. Deterministic with a seed.

`TcpProxy` forwards raw TCP (so HTTPS passes through untouched, e.g. to the API server)
and can cut every connection for an outage."""

from __future__ import annotations

import http.client
import random
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
             b"<Message>Please reduce your request rate.</Message></Error>")


class FaultProxy:
    def __init__(self, upstream: str, fail_fraction: float = 0.0, seed: int = 0, host: str = "127.0.0.1"):
        """`host`: where it listens (the real node's pods reach the host at its bridge gateway)."""
        self.upstream = urlsplit(upstream)
        self.fail_fraction = fail_fraction
        self.rng = random.Random(seed)
        self.outage_until = 0.0
        self.requests = 0
        self.injected = 0
        self._lock = threading.Lock()
        self.host = host
        self._server = ThreadingHTTPServer((host, 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self._server.server_address[1]}"

    def start(self) -> "FaultProxy":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def outage(self, seconds: float) -> None:
        """Every request fails for the next `seconds`."""
        self.outage_until = time.monotonic() + seconds

    def _should_fail(self) -> bool:
        with self._lock:
            self.requests += 1
            fail = time.monotonic() < self.outage_until or self.rng.random() < self.fail_fraction
            self.injected += fail
            return fail

    def _handler(self):
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def _serve(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                if proxy._should_fail():
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(SLOW_DOWN)))
                    self.end_headers()
                    self.wfile.write(SLOW_DOWN)
                    return
                conn = http.client.HTTPConnection(proxy.upstream.hostname, proxy.upstream.port, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                self.send_response(resp.status, resp.reason)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _serve

        return Handler


class TcpProxy:
    """Forwards TCP connections on a loopback port to `host:port`, bytes untouched (TLS
    clients still verify the upstream's certificate, which must name 127.0.0.1).
    `down()` cuts every open connection and closes new ones at once until `up()`: to a
    client, the server is unreachable. `hang()` is the quieter partition: connections stay
    open, and nothing more crosses in either direction (new ones are accepted and held),
    so a client's requests wait until their own timeouts."""

    def __init__(self, host: str, port: int):
        self.upstream = (host, port)
        self.connections = 0  # forwarded
        self.refused = 0  # closed at once while down
        self._down = False
        self._hang = False
        self._held: list[socket.socket] = []  # accepted while hanging, never forwarded
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._thread = threading.Thread(target=self._accept_loop, daemon=True)

    @property
    def port(self) -> int:
        return self._listener.getsockname()[1]

    def start(self) -> "TcpProxy":
        self._thread.start()
        return self

    def down(self) -> None:
        with self._lock:
            self._down = True
            for s in self._open:
                _shutdown(s)

    def hang(self) -> None:
        with self._lock:
            self._hang = True

    def up(self) -> None:
        with self._lock:
            self._down = self._hang = False
            held, self._held = self._held, []
        for s in held:
            _shutdown(s)
            s.close()

    def stop(self) -> None:
        _shutdown(self._listener)
        self._listener.close()
        self.down()

    def _accept_loop(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # stopped
            with self._lock:
                if self._down:
                    self.refused += 1
                    client.close()
                    continue
                if self._hang:
                    self._held.append(client)
                    continue
            try:
                upstream = socket.create_connection(self.upstream, timeout=10)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                self.connections += 1
                self._open.update((client, upstream))
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                if not self._hang:  # hanging: read and drop, so neither side learns anything
                    dst.sendall(data)
        except OSError:
            pass
        finally:  # either side gone: end both, so the client sees the cut
            with self._lock:
                self._open.discard(src)
                self._open.discard(dst)
            _shutdown(src)
            _shutdown(dst)
            src.close()  # each socket is the source of exactly one pump


def _shutdown(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
