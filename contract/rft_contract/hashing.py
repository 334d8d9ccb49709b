"""sha256 of local files, in one pass where an uploader reads them anyway (the storage
backends in storage.py and s3.py share these)."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

CHUNK = 1 << 20


@dataclass(frozen=True)
class Fetched:
    """A transferred file: its size and sha256 (a manifest entry)."""
    size: int
    sha256: str
    reused: bool = False  # already on disk with the expected size and sha256: not downloaded


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


class HashingReader:
    """A read-only view of an open binary file that sha256-hashes its bytes as they are
    read, so an uploader's own reads give the checksum (one pass over the file).

    Uploaders seek: boto3 measures the size with seek/tell and rewinds a request body to
    retry it or to compute its CRC32 first. Bytes are hashed only the first time the
    reads reach them in order, so a rewind and re-read does not count them twice; a read
    that skips ahead leaves a gap, and `sha256()` then reads the file again."""

    def __init__(self, f):
        self._f, self._h, self._hashed, self._gap = f, hashlib.sha256(), 0, False

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._f.tell()

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return self._f.seek(offset, whence)

    def close(self) -> None:
        """A no-op: uploaders close their body when sent; the file belongs to the caller."""

    def read(self, n: int | None = -1) -> bytes:
        start = self._f.tell()
        data = self._f.read(n)
        end = start + len(data)
        if start <= self._hashed < end:
            self._h.update(memoryview(data)[self._hashed - start:])
            self._hashed = end
        elif start > self._hashed:
            self._gap = True
        return data

    def sha256(self) -> tuple[int, str]:
        """(size, sha256) of the whole file; hashes what the reads did not reach."""
        size = os.fstat(self._f.fileno()).st_size
        if self._gap or self._hashed != size:
            return size, sha256_file(self._f.name)
        return size, self._h.hexdigest()
