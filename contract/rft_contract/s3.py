"""S3 behind the `Storage` interface (AWS S3, MinIO, any S3-compatible server).

Endpoint, region and credentials come from the environment the operator sets from the
job's Secret (`AWS_ENDPOINT_URL`, `AWS_REGION`, `AWS_ACCESS_KEY_ID`,
`AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`), through boto3's own resolution, so
nothing here is specific to one server. Retries (`DeadlineRetries`): what botocore's
standard mode counts as transient (5xx, SlowDown and other throttling, connection errors,
timeouts) is retried with capped, jittered backoff until `retry_seconds` (300, or
`RFT_S3_RETRY_SECONDS`, read by `podenv.PodEnv`) have passed since the request first
failed. botocore's own budget is 10 attempts and a client-wide quota of about 100
retries: during an outage a client with 16 threads in flight spends the quota in seconds,
then fails every request at once. (Its adaptive mode adds a client-side rate limiter that
made a 33%-SlowDown test 2.5x slower without saving a request.) Large objects go through
the TransferManager with 64 MiB parts (the 8 MiB default makes thousands of requests per
multi-GB shard) and CRC32 checksums that the server verifies. Local files
(`upload_file`: checkpoint and export shards) stream from disk through the same manager,
sha256-hashed as it reads them: at most `upload_window` parts in memory, one read of the
file.

Verified downloads (`read_parts`, used by `storage.download_to`) fetch 16 MiB ranges,
up to 8 in parallel, and hand them over in order so the caller hashes while it writes:
memory stays at (read_window + 1) parts per object, whatever its size.
"""

from __future__ import annotations

import io
import logging
import os
import random
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

from .hashing import Fetched, HashingReader
from .podenv import PodEnv

MiB = 1 << 20
log = logging.getLogger(__name__)


def split_uri(uri: str) -> tuple[str, str]:
    if not uri.startswith("s3://"):
        raise ValueError(f"{uri}: not an s3:// URI")
    bucket, _, key = uri[5:].partition("/")
    if not bucket:
        raise ValueError(f"{uri}: no bucket")
    return bucket, key


def _is_missing(error) -> bool:
    return error.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound")


class DeadlineRetries:
    """botocore's `needs-retry` handler for a client, in place of its standard one: the
    same test of what is transient (`StandardRetryConditions`), backoff of
    rand(0, 1) * min(2 ** (attempt - 1), `max_backoff`) seconds, and a time budget per
    request instead of an attempt count and a quota shared by every thread of the client.
    A request is retried while less than `seconds` have passed since its first failure;
    the last wait ends at the deadline. With a cap of 10 s, an outage's end is noticed
    within 10 s.

    Whole-object PUTs, part uploads, GETs, listings and HEADs are safe to repeat. A
    multipart upload's create and complete are not quite: a repeated
    CreateMultipartUpload whose first answer was lost leaves an unused upload behind (a
    bucket lifecycle rule, AbortIncompleteMultipartUpload, removes those), and a repeated
    CompleteMultipartUpload whose first 200 was lost fails with NoSuchUpload although the
    object was written; that upload then fails like any other and marks nothing complete.

    A certificate that does not verify is not transient: it fails at once."""

    def __init__(self, seconds: float, max_backoff: float = 10.0, rng=random.random, clock=time.monotonic):
        from botocore.retries import standard

        self.seconds, self.max_backoff, self._rng, self._clock = seconds, max_backoff, rng, clock
        self._adapter = standard.RetryEventAdapter()
        self._transient = standard.StandardRetryConditions(max_attempts=1 << 62)
        self._logged = float("-inf")

    def install(self, client) -> None:
        name = client.meta.service_model.service_id.hyphenize()
        events = client.meta.events
        events.unregister(f"needs-retry.{name}", unique_id=f"retry-config-{name}")
        events.register(f"needs-retry.{name}", self.needs_retry, unique_id=f"retry-config-{name}")

    def needs_retry(self, **kwargs) -> float | None:
        """Seconds to wait before the next attempt, or None: the failure stands."""
        context = self._adapter.create_retry_context(**kwargs)
        if not self._transient.is_retryable(context) or _untrusted(context.caught_exception):
            return None
        now = self._clock()
        first = context.request_context.setdefault("rft_first_failure", now)
        left = self.seconds - (now - first)
        if left <= 0:
            log.warning("S3 %s: still failing after %.0fs and %d attempts; giving up (RFT_S3_RETRY_SECONDS)",
                        kwargs["operation"].name, now - first, context.attempt_number)
            return None
        if context.attempt_number == 1 and now - self._logged >= 10:  # one line per 10 s, not per request
            self._logged = now
            log.info("S3 %s failed (%s); retrying for up to %.0fs", kwargs["operation"].name,
                     _failure(context), self.seconds)
        exponent = min(context.attempt_number - 1, 30)  # a budget of days must not overflow
        return min(left, self._rng() * min(2.0 ** exponent, self.max_backoff))


def _untrusted(error: BaseException | None) -> bool:
    from botocore.exceptions import SSLError

    return isinstance(error, SSLError) and "CERTIFICATE_VERIFY_FAILED" in str(error)


def _failure(context) -> str:
    if context.caught_exception is not None:
        return type(context.caught_exception).__name__
    error = (context.parsed_response or {}).get("Error", {})
    status = context.http_response.status_code if context.http_response is not None else "?"
    return f"{status} {error.get('Code', '')}".strip()


class S3Storage:
    def __init__(self, client=None, part_size: int = 64 * MiB, concurrency: int = 16,
                 read_part_size: int = 16 * MiB, read_window: int = 8, upload_window: int = 6,
                 retry_seconds: float | None = None, env: PodEnv | None = None):
        """`retry_seconds`: how long a request that keeps failing transiently is retried
        (`DeadlineRetries`); None: `env.s3_retry_seconds`. `env`: the pod's knobs (its
        config's `env`); None: read from the process environment. Both apply to the client
        made here; a `client` passed in keeps its own settings."""
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        if client is None:
            env = PodEnv.read() if env is None else env
            client = boto3.client("s3", config=Config(retries={"mode": "standard"},
                                                      s3={"addressing_style": env.s3_addressing}))
            DeadlineRetries(env.s3_retry_seconds if retry_seconds is None else retry_seconds).install(client)
        self.client = client
        self.transfer = TransferConfig(multipart_threshold=part_size, multipart_chunksize=part_size,
                                       max_concurrency=concurrency, use_threads=True)
        # s3transfer's own setting (boto3's constructor does not take it): parts read ahead
        # from a file object and held in memory, 10 by default.
        self.transfer.max_in_memory_upload_chunks = max(1, upload_window)
        self.read_part_size, self.read_window = read_part_size, max(1, read_window)

    def list(self, prefix: str) -> list[str]:
        bucket, key = split_uri(prefix)
        out = []
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=key):
            out += [f"s3://{bucket}/{o['Key']}" for o in page.get("Contents", [])]
        return sorted(out)

    def list_objects(self, prefix: str) -> dict[str, dict]:
        """uri -> {"size", "etag"} of every object under `prefix` (one listing)."""
        bucket, key = split_uri(prefix)
        out = {}
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=key):
            for o in page.get("Contents", []):
                out[f"s3://{bucket}/{o['Key']}"] = {"size": o["Size"], "etag": o["ETag"]}
        return out

    def exists(self, uri: str) -> bool:
        from botocore.exceptions import ClientError

        bucket, key = split_uri(uri)
        try:
            self.client.head_object(Bucket=bucket, Key=key)
            return True
        except ClientError as e:
            if _is_missing(e):
                return False
            raise

    def read_bytes(self, uri: str) -> bytes:
        from botocore.exceptions import ClientError

        bucket, key = split_uri(uri)
        buf = io.BytesIO()
        try:
            self.client.download_fileobj(bucket, key, buf, Config=self.transfer)
        except ClientError as e:
            if _is_missing(e):
                raise FileNotFoundError(uri) from None
            raise
        return buf.getvalue()

    def read_parts(self, uri: str, size: int | None = None) -> Iterator[memoryview]:
        """The object's bytes in order, as `read_part_size` ranges fetched by up to
        `read_window` parallel GETs; the next ranges download while the caller handles
        this one. With the expected `size` (a manifest's) the first ranges start at once;
        without, or when it proves wrong, the first GET tells the size. Parts of two
        versions (the object replaced meanwhile) raise OSError."""
        bucket, key = split_uri(uri)
        step = self.read_part_size
        if size:
            first, total, etag = None, size, None
        else:
            first, total, etag = self._get_range(bucket, key, 0, step - 1)
        ranges = iter([(start, min(start + step, total) - 1)
                       for start in range(len(first) if first is not None else 0, total, step)])
        pool = ThreadPoolExecutor(self.read_window, thread_name_prefix="s3-read")
        try:
            pending = deque((r, pool.submit(self._get_range, bucket, key, *r))
                            for _, r in zip(range(self.read_window), ranges))
            if first:
                yield memoryview(first)
            del first
            while pending:
                (start, end), future = pending.popleft()
                part, part_total, part_etag = future.result()
                if start == 0 and part_total != total:  # the expected size was not the object's
                    pool.shutdown(wait=False, cancel_futures=True)
                    yield from self.read_parts(uri)
                    return
                if part_total != total or (etag is not None and part_etag != etag):
                    raise OSError(f"{uri}: replaced during the download (size {total} then {part_total}, "
                                  f"ETag {etag} then {part_etag})")
                if len(part) != end - start + 1:
                    raise OSError(f"{uri}: asked for bytes {start}-{end}, got {len(part)} bytes")
                etag = part_etag
                if (r := next(ranges, None)) is not None:
                    pending.append((r, pool.submit(self._get_range, bucket, key, *r)))
                yield memoryview(part)
                del part
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def _get_range(self, bucket: str, key: str, start: int, end: int,
                   attempts: int = 5) -> tuple[bytearray, int, str]:
        """Bytes [start, end] (fewer at the end of the object) in one preallocated buffer,
        with the object's total size and ETag. botocore retries the request; a stream cut
        mid-body is retried here, as boto3's own downloader does."""
        from botocore.exceptions import ClientError
        from s3transfer.utils import S3_RETRYABLE_DOWNLOAD_ERRORS

        args = {"Bucket": bucket, "Key": key, "Range": f"bytes={start}-{end}"}
        for attempt in range(attempts):
            try:
                try:
                    resp = self.client.get_object(**args)
                except ClientError as e:
                    if _is_missing(e):
                        raise FileNotFoundError(f"s3://{bucket}/{key}") from None
                    if start == 0 and e.response.get("Error", {}).get("Code") == "InvalidRange":
                        return bytearray(), 0, ""  # an empty object has no byte 0
                    raise
                n = resp["ContentLength"]
                # "bytes 0-16777215/123456789"; a server that ignores Range sends it all.
                total = int(resp["ContentRange"].rpartition("/")[2]) if resp.get("ContentRange") else n
                buf, pos = bytearray(n), 0
                view = memoryview(buf)
                for chunk in resp["Body"].iter_chunks(1 << 20):
                    view[pos:pos + len(chunk)] = chunk
                    pos += len(chunk)
                if pos != n:
                    raise ConnectionError(f"s3://{bucket}/{key}: got {pos} of {n} bytes at offset {start}")
                return buf, total, resp["ETag"]
            except S3_RETRYABLE_DOWNLOAD_ERRORS:
                if attempt == attempts - 1:
                    raise
        raise AssertionError("unreachable")

    def write_bytes(self, uri: str, data: bytes) -> None:
        """One PUT (or multipart upload) per object: S3 makes it visible atomically."""
        bucket, key = split_uri(uri)
        self.client.upload_fileobj(io.BytesIO(data), bucket, key, Config=self.transfer,
                                   ExtraArgs={"ChecksumAlgorithm": "CRC32"})

    def upload_file(self, path: str | os.PathLike, uri: str) -> Fetched:
        """Stream a local file to `uri` (multipart above `part_size`); returns its size and
        sha256, computed from the reads that feed the upload. The manager reads the parts
        in order and keeps at most `upload_window` of them in memory."""
        bucket, key = split_uri(uri)
        with open(path, "rb") as f:
            reader = HashingReader(f)
            self.client.upload_fileobj(reader, bucket, key, Config=self.transfer,
                                       ExtraArgs={"ChecksumAlgorithm": "CRC32"})
            size, digest = reader.sha256()
        return Fetched(size, digest)

    def delete(self, uri: str) -> None:
        bucket, key = split_uri(uri)
        self.client.delete_object(Bucket=bucket, Key=key)

    def download_file(self, uri: str, path: str | os.PathLike) -> None:
        """Stream one object to a local file (multipart, parallel ranges): multi-GB
        shards never sit in memory."""
        bucket, key = split_uri(uri)
        self.client.download_file(bucket, key, str(path), Config=self.transfer)

    def download_prefix(self, prefix: str, dest: str | os.PathLike) -> Path:
        """Copy every object under `prefix` into `dest`, keeping relative paths."""
        dest = Path(dest)
        base = prefix.rstrip("/") + "/"
        for uri in self.list(base):
            rel = uri[len(base):]
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            bucket, key = split_uri(uri)
            tmp = target.with_name(f".tmp-{target.name}")
            self.client.download_file(bucket, key, str(tmp), Config=self.transfer)
            tmp.replace(target)
        return dest
