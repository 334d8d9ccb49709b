"""Storage behind a tiny interface, so local disk and S3 are interchangeable.

Everything is addressed by `str` URIs: a plain path, `file:///abs/path`, or (with the
S3Storage in s3.py) `s3://bucket/key`. The interface mirrors what an object store offers,
because that is the weakest backend we must support: no directories, no rename, no
append; `write_bytes` replaces a whole object atomically (a reader sees the old object,
the new one, or none, never half of one); `list(prefix)` is a plain string-prefix match
over object URIs, recursive.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Protocol, runtime_checkable


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

    def write_bytes(self, uri: str, data: bytes) -> None:
        path = self._path(uri)
        path.parent.mkdir(parents=True, exist_ok=True)
        # Write a temp file in the same directory, fsync, then rename over the target:
        # rename is atomic on POSIX, so a crash never leaves a truncated object.
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def delete(self, uri: str) -> None:
        self._path(uri).unlink(missing_ok=True)


def download_to(storage: Storage, uri: str, path: Path) -> None:
    """Copy one object to a local file, streamed when the backend can (S3's multipart
    download); never more than one part in memory there."""
    path.parent.mkdir(parents=True, exist_ok=True)
    stream = getattr(storage, "download_file", None)
    if stream is not None:
        stream(uri, path)
    else:
        path.write_bytes(storage.read_bytes(uri))


def get_storage(uri: str) -> Storage:
    """The backend for a URI's scheme."""
    if uri.startswith("s3://"):
        from .s3 import S3Storage

        return S3Storage()
    return LocalStorage()
