"""S3 behind the `Storage` interface (AWS S3, MinIO, any S3-compatible server).

Endpoint, region and credentials come from the environment the operator sets from the
job's Secret (`AWS_ENDPOINT_URL`, `AWS_REGION`, `AWS_ACCESS_KEY_ID`,
`AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`), through boto3's own resolution, so
nothing here is specific to one server. Retries: botocore's standard mode backs off with
jitter on 5xx and SlowDown, 10 attempts (its adaptive mode adds a client-side rate limiter
that made a 33%-SlowDown test 2.5x slower without saving a request). Large objects go
through the TransferManager with 64 MiB parts (the 8 MiB default makes thousands of
requests per multi-GB shard) and CRC32 checksums that the server verifies.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

MiB = 1 << 20


def split_uri(uri: str) -> tuple[str, str]:
    if not uri.startswith("s3://"):
        raise ValueError(f"{uri}: not an s3:// URI")
    bucket, _, key = uri[5:].partition("/")
    if not bucket:
        raise ValueError(f"{uri}: no bucket")
    return bucket, key


class S3Storage:
    def __init__(self, client=None, part_size: int = 64 * MiB, concurrency: int = 16):
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        self.client = client or boto3.client(
            "s3", config=Config(retries={"max_attempts": 10, "mode": "standard"},
                                s3={"addressing_style": os.environ.get("RFT_S3_ADDRESSING", "auto")}))
        self.transfer = TransferConfig(multipart_threshold=part_size, multipart_chunksize=part_size,
                                       max_concurrency=concurrency, use_threads=True)

    def list(self, prefix: str) -> list[str]:
        bucket, key = split_uri(prefix)
        out = []
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=key):
            out += [f"s3://{bucket}/{o['Key']}" for o in page.get("Contents", [])]
        return sorted(out)

    def exists(self, uri: str) -> bool:
        from botocore.exceptions import ClientError

        bucket, key = split_uri(uri)
        try:
            self.client.head_object(Bucket=bucket, Key=key)
            return True
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return False
            raise

    def read_bytes(self, uri: str) -> bytes:
        from botocore.exceptions import ClientError

        bucket, key = split_uri(uri)
        buf = io.BytesIO()
        try:
            self.client.download_fileobj(bucket, key, buf, Config=self.transfer)
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                raise FileNotFoundError(uri) from None
            raise
        return buf.getvalue()

    def write_bytes(self, uri: str, data: bytes) -> None:
        """One PUT (or multipart upload) per object: S3 makes it visible atomically."""
        bucket, key = split_uri(uri)
        self.client.upload_fileobj(io.BytesIO(data), bucket, key, Config=self.transfer,
                                   ExtraArgs={"ChecksumAlgorithm": "CRC32"})

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
