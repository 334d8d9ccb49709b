"""Weights relayed between sync agents, so S3 serves each version about once, not once per
replica. The replicas of a job form a tree by index (`parent_index`): replica 0 reads S3,
replica i reads replica (i - 1) // fanout. A child streams each file while its parent is
still receiving it, so the tree's depth costs a few chunks of latency, not a download per
level.

    S3 -> replica 0 -> replicas 1, 2 -> replicas 3, 4, 5, 6 -> ...      (fanout 2)

On the fast path (rft_trainer.export.FastPath) the root is the trainer's rank 0, which
serves a fresh version while it is still uploading it to S3:

    trainer -> replica 0 -> replicas 1, 2 -> ...       (S3: the upload, beside it)

Trust: the manifest comes from S3 (the export's commit), or, on the fast path, from a peer
(`GET /manifest/<version dir>`: the trainer's weights server for replica 0, its parent for
the others) only if its digest is the one the target names (rft_contract.manifest.
manifest_digest, announced by the trainer through the job's status). Every hop hashes each
file as it arrives and keeps it only if size and sha256 match the manifest. A
parent also holds back the last byte of each file until its own check passed: a child whose
stream ends short (a parent that found corruption, died or stalled) fails the file and
reads it, and the rest of the version, from S3. So no peer can make a replica load bytes
the export did not write (committed, or announced by its manifest's digest); at worst it costs the S3 read the relay meant to save.

`PeerServer` (in the sync agent, `GET /weights/<version dir>/<file>`) serves only version
directories it knows the manifest of (a download in progress it published, or a `.verified`
directory with its `.manifest.json`), and only files that manifest lists by plain name: no
other path on the pod's disk is reachable. A request for a version not here yet waits up to
`wait_seconds` for the agent to start on it (the parent notices the same target at about
the same time), then answers 404 and the child goes to S3.

The same server answers `GET /record` with the agent's record of what its engine serves
(`SyncAgent.record`), which explorers read around each request instead of the API server.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import struct
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import BinaryIO, Callable
from urllib.parse import unquote, urlsplit

log = logging.getLogger("rft_contract.relay")

MANIFEST_COPY = ".manifest.json"  # the S3 manifest, kept beside a verified local copy
VERIFIED = ".verified"
_DIR_NAME = re.compile(r"v\d{8,}-[A-Za-z0-9_-]+\Z")  # weights.version_dir's names
CHUNK = 8 << 20  # bytes per read, write, hash and progress step of a relayed file
MAX_MANIFEST_BYTES = 16 << 20  # a manifest lists files: far less than this
MAX_REQUEST_BYTES = 1 << 20  # a POST body of `PeerServer.routes`: small JSON objects


class RouteError(Exception):
    """What a route of `PeerServer.routes` answers instead of 200: `status` and a message."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class PeerError(Exception):
    """The peer could not deliver a file (unreachable, 404, stalled, cut short, corrupt).
    `retry`: the stream was cut mid-body while bytes flowed, as when the parent restarts
    the file from another source; asking again then gets the restarted stream."""

    def __init__(self, message: str, retry: bool = False, answered: bool = False):
        super().__init__(message)
        self.retry = retry
        self.answered = answered  # the peer answered (an HTTP error): it is reachable


def version_dir_name(version: int, export_id: str | None) -> str:
    """The directory a version's files live in, on every pod that holds or serves them."""
    return f"v{version:08d}-{export_id or 'base'}"


def url_host(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip  # IPv6 pod IPs


def parent_index(index: int, fanout: int) -> int | None:
    """The replica that replica `index` reads from; None for replica 0 (it reads S3)."""
    return None if index <= 0 else (index - 1) // max(1, fanout)


def is_safe_file_name(name: str) -> bool:
    """A flat file name (what exports write): no directories, no dot-files, no traversal."""
    return bool(name) and "/" not in name and "\\" not in name and "\0" not in name and not name.startswith(".")


# ------------------------------------------------------------------ one download, published


class Transfer:
    """A version directory being filled, file by file, that children may read as it grows.

    Written by the fetching thread (`wrote`, `verified`, `restart`, `moved`, `fail`); read
    by the server's handlers (`wait`), under one condition variable."""

    def __init__(self, name: str, manifest: dict, path: Path, complete: bool = False):
        self.name, self.manifest, self.path = name, manifest, Path(path)
        self.files: dict[str, dict] = manifest.get("files", {})
        self.cond = threading.Condition()
        self.written: dict[str, int] = {}  # file -> bytes on disk (absent: not started)
        self.generation: dict[str, int] = {}  # bumped when a file restarts from another source
        self.done: set[str] = set(self.files) if complete else set()
        self.failed = False

    def wrote(self, file: str, total: int) -> None:
        with self.cond:
            self.written[file] = total
            self.cond.notify_all()

    def restart(self, file: str) -> None:
        """The file starts over (its source failed): streams of the old bytes end."""
        with self.cond:
            self.generation[file] = self.generation.get(file, 0) + 1
            self.written[file] = 0
            self.cond.notify_all()

    def verified(self, file: str) -> None:
        with self.cond:
            self.done.add(file)
            self.cond.notify_all()

    def moved(self, path: Path, rename: Callable[[], None]) -> None:
        """Rename the directory (complete) while no handler is opening a file in it."""
        with self.cond:
            rename()
            self.path = Path(path)
            self.cond.notify_all()

    def fail(self) -> None:
        with self.cond:
            self.failed = True
            self.cond.notify_all()

    def available(self, file: str) -> int:
        """Bytes of `file` a child may have now: all once verified, else all but the last."""
        if file in self.done:
            return self.files[file]["size"]
        return max(0, min(self.written.get(file, 0), self.files[file]["size"] - 1))


# ------------------------------------------------------------------ serving


class PeerServer:
    """The agent's weights server for its children in the tree."""

    def __init__(self, dest: Path, host: str = "0.0.0.0", port: int = 0,
                 wait_seconds: float = 10.0, stall_seconds: float = 30.0):
        self.dest, self.wait_seconds, self.stall_seconds = Path(dest), wait_seconds, stall_seconds
        self._transfers: dict[str, Transfer] = {}
        self._cond = threading.Condition()
        self._httpd = ThreadingHTTPServer((host, port), _handler(self))
        self._httpd.daemon_threads = True
        self._thread: threading.Thread | None = None
        # The agent's record for explorers (`GET /record`, SyncAgent.record); None: 404.
        self.record: Callable[[], dict] | None = None
        # Routes of the process that serves (rank 0's NCCL sender: rft_trainer.nccl_sender):
        # ("POST", first path segment) -> handler(the rest of the path, the JSON body),
        # which answers a JSON object or raises RouteError.
        self.routes: dict[tuple[str, str], Callable[[str, dict], dict]] = {}

    @property
    def port(self) -> int:
        return self._httpd.server_address[1]

    def start(self) -> "PeerServer":
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="weights-peer", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def publish(self, transfer: Transfer) -> None:
        with self._cond:
            self._transfers[transfer.name] = transfer
            self._cond.notify_all()

    def forget(self, name: str, transfer: Transfer | None = None) -> None:
        """Stop serving `name` (only if it is still `transfer`, when given)."""
        with self._cond:
            if transfer is None or self._transfers.get(name) is transfer:
                self._transfers.pop(name, None)

    def find(self, name: str, wait: float) -> Transfer | None:
        """The published transfer (or verified directory) called `name`, waiting up to
        `wait` seconds for the agent to start on it."""
        if not _DIR_NAME.match(name):
            return None
        deadline = time.monotonic() + wait
        with self._cond:
            while True:
                t = self._transfers.get(name)
                if t is not None and not t.failed:
                    return t
                if (on_disk := self._from_disk(name)) is not None:
                    return on_disk
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(min(left, 1.0))

    def _from_disk(self, name: str) -> Transfer | None:
        """A verified directory left by an earlier agent process (or the init container)."""
        path = self.dest / name
        try:
            if (path / VERIFIED).is_file():
                return Transfer(name, json.loads((path / MANIFEST_COPY).read_text()), path, complete=True)
        except (OSError, ValueError):
            pass  # no manifest kept with it: not servable (children read S3)
        return None


def _handler(server: PeerServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        timeout = server.stall_seconds  # a child that stops reading frees the thread

        def log_message(self, fmt, *args):  # noqa: D401 - quiet: the agent logs what matters
            log.debug("%s " + fmt, self.client_address[0], *args)

        def do_GET(self):  # noqa: N802 - http.server's name
            if urlsplit(self.path).path == "/record" and server.record is not None:
                return self._json(server.record())
            parts = urlsplit(self.path).path.split("/")
            if len(parts) == 3 and parts[1] == "manifest":  # what a child checks the files against
                transfer = server.find(unquote(parts[2]), server.wait_seconds)
                if transfer is None:
                    return self._error(404, f"{unquote(parts[2])}: not here")
                return self._json(transfer.manifest)
            if len(parts) != 4 or parts[:2] != ["", "weights"]:
                return self._error(404, "not found")
            name, file = unquote(parts[2]), unquote(parts[3])
            transfer = server.find(name, server.wait_seconds)
            if transfer is None:
                return self._error(404, f"{name}: not here")
            if not is_safe_file_name(file) or file not in transfer.files:
                return self._error(404, f"{file}: not listed in the manifest of {name}")
            try:
                self._stream(transfer, file)
            except OSError as e:  # the child went away or stopped reading
                log.info("%s/%s to %s: %s", name, file, self.client_address[0], type(e).__name__)

        def do_POST(self):  # noqa: N802 - http.server's name
            parts = urlsplit(self.path).path.split("/")
            if ("POST", parts[1]) not in server.routes:
                return self._error(404, "not found")
            try:
                size = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                size = -1
            if not 0 <= size <= MAX_REQUEST_BYTES:
                return self._error(413, f"a request body of at most {MAX_REQUEST_BYTES} bytes, with its length")
            try:
                body = json.loads(self.rfile.read(size) or b"{}")
            except ValueError:
                return self._error(400, "the body is not JSON")
            if not isinstance(body, dict):
                return self._error(400, "the body must be a JSON object")
            return self._route("POST", parts, body)

        def _route(self, method: str, parts: list[str], body: dict) -> None:
            try:
                answer = server.routes[(method, parts[1])]("/".join(unquote(p) for p in parts[2:]), body)
            except RouteError as e:
                return self._error(e.status, str(e))
            except Exception as e:  # noqa: BLE001 - the caller gets a 500 that says what failed
                log.exception("%s %s failed", method, self.path)
                return self._error(500, f"{type(e).__name__}: {e}"[:1000])
            self._json(answer)

        def _send(self, f, offset: int, count: int) -> int:
            """`count` bytes of `f` from `offset`, in one blocking sendfile where the kernel
            takes them (a send timeout bounds a child that stopped reading)."""
            sock = self.connection
            if sock.gettimeout() is not None:
                sock.settimeout(None)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(server.stall_seconds))
            done = 0
            while done < count:
                n = os.sendfile(sock.fileno(), f.fileno(), offset + done, count - done)
                if n == 0:
                    break  # the file is shorter than announced (restarted): the caller ends
                done += n
            return done

        def _json(self, doc: dict) -> None:
            body = json.dumps(doc).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _error(self, code: int, message: str) -> None:
            body = message.encode()
            self.send_response(code)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _stream(self, t: Transfer, file: str) -> None:
            """Send the file's bytes as they land on disk; close early (the child sees a
            short body) if the transfer fails, restarts the file or stalls."""
            size = t.files[file]["size"]
            with t.cond:
                started = t.cond.wait_for(lambda: t.failed or file in t.written or file in t.done,
                                          server.stall_seconds) and not t.failed
                if started:
                    gen = t.generation.get(file, 0)
                    try:
                        f = open(t.path / file, "rb")
                    except OSError:  # deleted meanwhile (an old version cleaned up)
                        started = False
            if not started:
                return self._error(503, f"{file}: not available")
            with f:
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(size))
                self.end_headers()
                sent = 0
                while sent < size:
                    with t.cond:
                        moving = lambda: t.failed or t.generation.get(file, 0) != gen \
                            or t.available(file) > sent  # noqa: E731
                        if not t.cond.wait_for(moving, server.stall_seconds):
                            log.warning("%s/%s: no progress for %.0fs; ending the stream to %s",
                                        t.name, file, server.stall_seconds, self.client_address[0])
                            return
                        if t.failed or t.generation.get(file, 0) != gen:
                            return  # short body: the child reads this file from S3
                        upto = t.available(file)
                    n = self._send(f, sent, upto - sent)
                    if n < upto - sent:
                        return  # short body: the file was restarted under us
                    sent += n

    return Handler


# ------------------------------------------------------------------ fetching from a peer


@dataclass(frozen=True)
class Peer:
    """The parent an agent reads from: its pod name (for messages) and its server's URL."""

    pod: str
    url: str


def read_manifest_from_peer(peer: Peer, name: str, timeout: float) -> dict:
    """The manifest the peer has for version directory `name` (`GET /manifest/<name>`).
    Not trusted by itself: the caller compares its digest with the one the target names.
    PeerError when the peer does not deliver one."""
    u = urlsplit(peer.url)
    try:
        with socket.create_connection((u.hostname, u.port or 80), timeout=timeout) as sock:
            sock.sendall(f"GET /manifest/{name} HTTP/1.0\r\nHost: {u.netloc}\r\n\r\n".encode())
            status, length, body = _read_head(sock)
            while length is not None and len(body) < length:
                if len(body) > MAX_MANIFEST_BYTES:
                    raise ValueError("manifest too large")
                chunk = sock.recv(65536)
                if not chunk:
                    break
                body += chunk
    except (OSError, ValueError) as e:
        raise PeerError(f"{type(e).__name__}: {e}"[:200]) from None
    if status != 200:
        raise PeerError(f"HTTP {status} {bytes(body[:200]).decode(errors='replace')}", answered=True)
    try:
        manifest = json.loads(body)
    except ValueError:
        raise PeerError("the manifest it sent is not JSON") from None
    if not isinstance(manifest, dict):
        raise PeerError("the manifest it sent is not an object")
    return manifest


def read_from_peer(peer: Peer, name: str, file: str, size: int, out: BinaryIO,
                   on_chunk: Callable[[memoryview], None], timeout: float) -> None:
    """Stream `<peer>/weights/<name>/<file>` into `out`, calling `on_chunk` with each piece
    written (the caller hashes and publishes progress). PeerError on anything but the whole
    body; `timeout` bounds the connect and every wait for bytes. Each piece is a buffer
    of its own, never written again: the caller may hash it on another thread.

    A plain HTTP/1.0 GET on a blocking socket of our own (the kernel's receive timeout
    bounds each wait): the body is gathered CHUNK by CHUNK, each then written, hashed and
    published in one step, so children and the hash see few large pieces."""
    u = urlsplit(peer.url)
    try:
        sock = socket.create_connection((u.hostname, u.port or 80), timeout=timeout)
    except OSError as e:
        raise PeerError(f"{type(e).__name__}: {e}"[:200]) from None
    with sock:
        try:
            sock.sendall(f"GET /weights/{name}/{file} HTTP/1.0\r\nHost: {u.netloc}\r\n\r\n".encode())
            status, length, body = _read_head(sock)
        except (OSError, ValueError) as e:
            raise PeerError(f"{type(e).__name__}: {e}"[:200]) from None
        if status != 200:
            raise PeerError(f"HTTP {status} {bytes(body[:200]).decode(errors='replace')}")
        if length != size:
            raise PeerError(f"Content-Length {length}, the manifest says {size}")
        got = len(body)
        if body:
            write_all(out, memoryview(body))
            on_chunk(memoryview(body))
        sock.settimeout(None)  # blocking, with a kernel timeout per recv
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(timeout))
        while got < size:
            want = min(CHUNK - got % CHUNK, size - got)  # chunks aligned with the parent's steps
            buf = memoryview(bytearray(want))  # a fresh one: `on_chunk` may keep the last
            n = 0
            while n < want:  # (MSG_WAITALL instead stalled loopback streams for seconds)
                try:
                    k = sock.recv_into(buf[n:want])
                except BlockingIOError:  # SO_RCVTIMEO passed without a byte
                    raise PeerError(f"no bytes for {timeout:.0f}s after {got + n} of {size}") from None
                except OSError as e:
                    raise PeerError(f"stream cut after {got + n} of {size} bytes ({type(e).__name__})",
                                    retry=True) from None
                if not k:
                    raise PeerError(f"stream ended after {got + n} of {size} bytes", retry=True)
                n += k
            write_all(out, buf[:n])
            got += n
            on_chunk(buf[:n])


def _read_head(sock: socket.socket) -> tuple[int, int | None, bytes]:
    """(status, Content-Length, the body bytes read with the head)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk or len(data) > 65536:
            raise ValueError("no HTTP response head")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    length = None
    for line in lines[1:]:
        key, _, value = line.partition(":")
        if key.strip().lower() == "content-length":
            length = int(value.strip())
    return status, length, body


def _timeval(seconds: float) -> bytes:
    return struct.pack("ll", int(seconds), int((seconds % 1) * 1e6))


def write_all(out: BinaryIO, data: memoryview) -> None:
    """All of `data` into an unbuffered file (a raw write may take part of it)."""
    while data:
        n = out.write(data)
        data = data[n:]
