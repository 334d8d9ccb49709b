"""Storage behind a tiny interface, so local disk and S3 are interchangeable.

Everything is addressed by `str` URIs: a plain path, `file:///abs/path`, or (with the
S3Storage in s3.py) `s3://bucket/key`. The interface mirrors what an object store offers,
because that is the weakest backend we must support: no directories, no rename, no
append; `write_bytes` replaces a whole object atomically (a reader sees the old object,
the new one, or none, never half of one); `list(prefix)` is a plain string-prefix match
over object URIs, recursive.

Large objects are read as a stream of parts (`read_parts`, optional: both backends here
have it), so a multi-GB checkpoint shard is never whole in memory: `download_to` writes
the parts to disk and hashes them in the same pass. Local files go up the same way
(`upload_file`, optional too): streamed from disk and hashed while they are read for the
upload, so a checkpoint or export shard is read once and never whole in memory.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any, BinaryIO, Iterable, Iterator, Protocol, runtime_checkable

from .hashing import CHUNK, Fetched, HashingReader, sha256_file  # noqa: F401 (re-exported)
from .podenv import PodEnv

@runtime_checkable
class Storage(Protocol):
    def list(self, prefix: str) -> list[str]:
        """URIs of all objects whose URI starts with `prefix`, sorted."""

    def exists(self, uri: str) -> bool: ...

    def read_bytes(self, uri: str) -> bytes:
        """The object's bytes; FileNotFoundError if it does not exist."""

    def write_bytes(self, uri: str, data: bytes) -> None:
        """Create or atomically replace the object."""

    def delete(self, uri: str) -> None:
        """Remove the object; a missing one is not an error (as on S3)."""


def join(uri: str, *parts: str) -> str:
    """`join("s3://b/x/", "ckpt", "a.json") == "s3://b/x/ckpt/a.json"`."""
    out = uri.rstrip("/")
    for part in parts:
        out = f"{out}/{part.strip('/')}"
    return out


class LocalStorage:
    """Local files addressed by plain paths or `file://` URIs.

    Listed URIs keep the caller's spelling (`file://` in, `file://` out; `./buf/` in,
    `./buf/...` out) so they can be compared with URIs built by `join` from the same root.
    """

    SCHEME = "file://"

    def _path(self, uri: str) -> Path:
        if uri.startswith(self.SCHEME):
            uri = uri[len(self.SCHEME):]
        elif "://" in uri:
            raise ValueError(f"{uri}: LocalStorage handles plain paths and file:// URIs only")
        return Path(uri)

    def list(self, prefix: str) -> list[str]:
        scheme = self.SCHEME if prefix.startswith(self.SCHEME) else ""
        raw = prefix[len(scheme):]
        # S3 semantics: "buf/" lists inside buf, while "buf/shard-00" also matches
        # "buf/shard-001.json"; so without a trailing "/" walk the parent and filter.
        root = raw if raw.endswith("/") else os.path.dirname(raw)
        if not os.path.isdir(root or "."):
            return []
        out = []
        for dirpath, _, files in os.walk(root or "."):
            for name in files:
                path = os.path.join(dirpath, name)
                path = path if root else os.path.normpath(path)
                # .tmp- files are writes in flight (see write_bytes): not objects yet.
                if path.startswith(raw) and not name.startswith(".tmp-"):
                    out.append(scheme + path)
        return sorted(out)

    def exists(self, uri: str) -> bool:
        return self._path(uri).is_file()

    def read_bytes(self, uri: str) -> bytes:
        return self._path(uri).read_bytes()

    def read_parts(self, uri: str, size: int | None = None) -> Iterator[bytes]:
        """The file's bytes in order, 1 MiB at a time (`size`, the expected one, is for
        backends that plan their reads with it)."""
        with open(self._path(uri), "rb") as f:
            yield from iter(lambda: f.read(CHUNK), b"")

    def write_bytes(self, uri: str, data: bytes) -> None:
        with atomic_write(self._path(uri), fsync=True) as f:
            f.write(data)

    def delete(self, uri: str) -> None:
        self._path(uri).unlink(missing_ok=True)

    def upload_file(self, path: str | os.PathLike, uri: str) -> "Fetched":
        """Copy a local file to `uri` atomically (as `write_bytes`), 1 MiB at a time,
        hashing what it copies."""
        with open(path, "rb") as src, atomic_write(self._path(uri), fsync=True) as f:
            return copy_hashed(iter(lambda: src.read(CHUNK), b""), f)


@contextlib.contextmanager
def atomic_write(path: Path, fsync: bool = False) -> Iterator[BinaryIO]:
    """A temp file beside `path`, open for writing, that becomes `path` only if the block
    ends without an exception (rename: atomic on POSIX), and is removed otherwise: a crash
    or a failed check never leaves a truncated or unchecked file at `path`. `fsync`: the
    bytes reach the disk before the rename (a durable object, not just a complete one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def copy_hashed(chunks: Iterable[bytes], out: BinaryIO) -> Fetched:
    """Write `chunks` to `out`, hashing them on the way: the size and sha256 written."""
    h, size = hashlib.sha256(), 0
    for chunk in chunks:
        out.write(chunk)
        h.update(chunk)
        size += len(chunk)
    return Fetched(size, h.hexdigest())


class IntegrityError(Exception):
    """A downloaded object is not what its manifest entry says (size or sha256)."""


def upload_file(storage: Storage, path: str | os.PathLike, uri: str) -> Fetched:
    """Copy a local file to the object `uri`; returns the size and sha256 of the bytes
    sent (a manifest entry). Streamed and hashed in the same pass where the backend
    streams (both here do); otherwise the file is read whole and written."""
    upload = getattr(storage, "upload_file", None)
    if upload is not None:
        return upload(path, uri)
    data = Path(path).read_bytes()
    storage.write_bytes(uri, data)
    return Fetched(len(data), hashlib.sha256(data).hexdigest())


def read_parts(storage: Storage, uri: str, size: int | None = None) -> Iterator[bytes]:
    """An object's bytes in order, in parts when the backend streams (both here do).
    `size`: the expected size, if known (S3 then requests every part at once)."""
    stream = getattr(storage, "read_parts", None)
    if stream is not None:
        return stream(uri, size)
    return iter([storage.read_bytes(uri)])


def is_intact(path: Path, expected: dict[str, Any]) -> bool:
    """`path` is a file with the expected size and sha256 (read from disk once)."""
    return ("sha256" in expected and path.is_file() and path.stat().st_size == expected["size"]
            and sha256_file(path) == expected["sha256"])


def mismatch(size: int, digest: str, expected: dict[str, Any]) -> str | None:
    """Why (size, digest) is not the manifest entry `expected`, or None; an entry without
    "sha256" checks the size only."""
    if "size" in expected and size != expected["size"]:
        return f"size {size}, manifest.json says {expected['size']}"
    if "sha256" in expected and digest != expected["sha256"]:
        return "sha256 differs from manifest.json (corrupted object)"
    return None


def download_to(storage: Storage, uri: str, path: str | os.PathLike,
                expected: dict[str, Any] | None = None) -> Fetched:
    """Copy one object to a local file in one streamed pass: each part is written to a
    temp file beside `path` and hashed as it arrives (on S3, a few parts in memory at
    most, whatever the object's size; no second read to verify). The temp file becomes
    `path` only when it matches `expected` (a manifest entry, {"size", "sha256"}), else
    IntegrityError naming the object. A file already at `path` with the expected size and
    sha256 is kept without downloading (`reused`)."""
    path = Path(path)
    if expected is not None and is_intact(path, expected):
        return Fetched(expected["size"], expected["sha256"], reused=True)
    with atomic_write(path) as f:
        got = copy_hashed(read_parts(storage, uri, (expected or {}).get("size")), f)
        if expected is not None and (reason := mismatch(got.size, got.sha256, expected)):
            raise IntegrityError(f"{uri}: {reason}")
    return got


def get_storage(uri: str, env: PodEnv | None = None) -> Storage:
    """The backend for a URI's scheme; `env`: the pod's knobs (`JobConfig.env`) for an S3
    client (None: read from the process environment)."""
    if uri.startswith("s3://"):
        from .s3 import S3Storage

        return S3Storage(env=env)
    return LocalStorage()
