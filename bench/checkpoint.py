"""Checkpoint benchmark: ~1 GB of training state to a real S3-compatible server.

    python bench/checkpoint.py [--params-m 80] [--endpoint http://...]
                               [--resume-mb 512] [--resume-files 4] [--only-resume]

Without --endpoint it starts a SeaweedFS S3 server on loopback (e2e/s3server.py, the same
server the tests use; its data in a temp dir, removed at the end); pass a MinIO/AWS
endpoint (with AWS_* credentials in the environment) to measure another store. Reports,
each against a baseline measured in the same run:
  (a) training-loop stall per checkpoint: async save (returns after local staging) vs a
      synchronous save of the same state, as a ratio;
  (b) upload throughput of the commit (per-rank files + manifest) vs a raw boto3
      `upload_fileobj` of the same bytes to the same server, as a ratio;
  (c) resume time (find the newest verified step, download, verify, load);
  (d) the resume download on its own, for a synthetic step of --resume-mb in
      --resume-files files: our streamed download + sha256 check (`download_verified`,
      what each node's local rank 0 runs) vs boto3's `download_file` of the same objects
      (as S3Storage configures it, and with our part size and window), each in a fresh
      subprocess (its own GIL, apart from this one's), median of --repeat, as
      throughput ratios; and each one's peak RSS above its baseline (VmHWM), beside the
      checkpoint and part sizes: ours stays at read_window + 1 parts, whatever the
      checkpoint size.
Single process (world size 1); no thresholds.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rft_trainer.checkpoint import CheckpointManager  # noqa: E402
from rft_trainer.parallelize import Runtime  # noqa: E402
from rft_contract.s3 import S3Storage  # noqa: E402
from e2e.s3server import S3Server  # noqa: E402


class Role:
    """What the checkpointer saves for one model: model, optimizer, LR scheduler."""

    def __init__(self, params_m: int):
        width = 4096
        layers = max(1, params_m * 1_000_000 // (width * width))
        self.model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: 1.0)
        loss = self.model(torch.randn(2, width)).square().mean()  # creates the Adam state
        loss.backward()
        self.optimizer.step()

    def nbytes(self) -> int:
        per_param = sum(p.numel() for p in self.model.parameters())
        return per_param * 4 * 3  # weights + exp_avg + exp_avg_sq, fp32


def start_s3(stack: contextlib.ExitStack) -> str:
    """A SeaweedFS server in a temp dir for this run (stopped and removed by `stack`); the
    environment (ours and the download subprocesses') points at it."""
    data = tempfile.mkdtemp(prefix="rft-bench-s3-")
    stack.callback(shutil.rmtree, data, True)
    key, secret = "bench", "bench-secret"
    server = stack.enter_context(S3Server(data, credentials={key: secret}))
    os.environ.update({"AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret,
                       "AWS_REGION": "us-east-1", "AWS_DEFAULT_REGION": "us-east-1"})
    return server.endpoint


def peak_rss() -> int:
    """This process's peak RSS in bytes (VmHWM: unlike ru_maxrss, not inherited over exec)."""
    return int(re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text())[1]) * 1024


def child(mode: str, prefix: str, dest: str, part: str, window: str) -> None:
    """One resume download in this (fresh) process; prints seconds and RSS growth as JSON.
    mode "ours": `download_verified`; "raw": boto3 `download_file` of each object with
    `part`-byte parts and `window` threads."""
    from boto3.s3.transfer import TransferConfig

    from rft_contract.manifest import download_verified, read_manifest
    from rft_contract.s3 import split_uri

    storage = S3Storage()
    manifest = read_manifest(storage, prefix)  # also warms the client and its connection pool
    names = sorted(manifest["files"])
    if mode == "raw":
        config = TransferConfig(multipart_threshold=int(part), multipart_chunksize=int(part),
                                max_concurrency=int(window))
    base = peak_rss()
    t = time.perf_counter()
    if mode == "ours":
        got = download_verified(storage, prefix, Path(dest), manifest)
        assert got.files == len(names) and got.reused == 0
    else:
        for name in names:
            bucket, key = split_uri(f"{prefix}/{name}")
            storage.client.download_file(bucket, key, os.path.join(dest, name), Config=config)
    seconds = time.perf_counter() - t
    print(json.dumps({"seconds": seconds, "rss": peak_rss() - base}))


def run_child(mode: str, prefix: str, part: int = 0, window: int = 0) -> dict:
    dest = tempfile.mkdtemp(prefix=f"rft-bench-resume-{mode}-")
    try:
        res = subprocess.run([sys.executable, __file__, "--child", mode, prefix, dest, str(part), str(window)],
                             capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
        if res.returncode:
            raise RuntimeError(f"{mode} child failed: {res.stderr[-2000:]}")
        return json.loads(res.stdout.splitlines()[-1])
    finally:
        shutil.rmtree(dest, ignore_errors=True)


def bench_resume_download(storage: S3Storage, bucket: str, total_mb: int, num_files: int, repeat: int) -> None:
    """(d): a synthetic checkpoint step (random bytes + manifest), downloaded three ways:
    ours; boto3's download_file as S3Storage configures it (64 MiB parts, 16 threads);
    and download_file with our part size and window (the same requests as ours, so the
    ratio is our cost: ordering + sha256)."""
    from rft_contract.manifest import file_entry, write_manifest

    prefix = f"s3://{bucket}/resume/ckpt/step-00000001"
    per_file = total_mb * 2**20 // num_files
    files = {}
    for i in range(num_files):
        data = os.urandom(per_file)
        storage.write_bytes(f"{prefix}/__{i}_0.distcp", data)
        files[f"__{i}_0.distcp"] = file_entry(data)
        del data
    write_manifest(storage, prefix, {"step": 1, "files": files})
    nbytes, mib = per_file * num_files, 2**20
    part, window = storage.read_part_size, storage.read_window
    t = storage.transfer
    ways = {"raw": ("raw", t.multipart_chunksize, t.max_request_concurrency), "same": ("raw", part, window),
            "ours": ("ours", 0, 0)}
    runs: dict[str, list[dict]] = {k: [] for k in ways}
    for _ in range(repeat):  # interleaved, so a noisy moment hits every way alike
        for k, way in ways.items():
            runs[k].append(run_child(way[0], prefix, *way[1:]))
    # Median time and the largest peak over the repeats.
    raw, same, ours = ({"seconds": statistics.median(r["seconds"] for r in runs[k]),
                        "rss": max(r["rss"] for r in runs[k])} for k in ways)
    mbps = {k: nbytes / v["seconds"] / 1e6 for k, v in (("raw", raw), ("same", same), ("ours", ours))}
    print(f"(d) resume download of a {nbytes / mib:.0f} MiB step in {num_files} files, each way in a fresh process, "
          f"median of {repeat}:")
    print(f"    ours (streamed, sha256-verified, {part / mib:.0f} MiB parts x {window} in flight): "
          f"{mbps['ours']:.0f} MB/s, peak RSS +{ours['rss'] / mib:.0f} MiB")
    print(f"    raw boto3 download_file ({t.multipart_chunksize / mib:.0f} MiB x {t.max_request_concurrency}): "
          f"{mbps['raw']:.0f} MB/s, peak RSS +{raw['rss'] / mib:.0f} MiB -> ratio {mbps['ours'] / mbps['raw']:.2f}")
    print(f"    raw boto3 download_file ({part / mib:.0f} MiB x {window}, our requests): {mbps['same']:.0f} MB/s, "
          f"peak RSS +{same['rss'] / mib:.0f} MiB -> ratio {mbps['ours'] / mbps['same']:.2f}")
    print(f"    checkpoint {nbytes / mib:.0f} MiB, part {part / mib:.0f} MiB: our peak RSS is "
          f"{ours['rss'] / part:.1f} parts, {ours['rss'] / nbytes:.2f} of the checkpoint")


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        return child(*sys.argv[2:7])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params-m", type=int, default=80, help="model parameters in millions (x12 bytes of state)")
    ap.add_argument("--endpoint", default=None)
    ap.add_argument("--bucket", default=f"rft-bench-{os.getpid()}")
    ap.add_argument("--resume-mb", type=int, default=512, help="size of the synthetic step for (d)")
    ap.add_argument("--resume-files", type=int, default=4, help="files of that step")
    ap.add_argument("--repeat", type=int, default=2, help="runs of each download in (d)")
    ap.add_argument("--only-resume", action="store_true", help="run (d) only")
    args = ap.parse_args()
    with contextlib.ExitStack() as stack:
        os.environ["AWS_ENDPOINT_URL"] = args.endpoint or start_s3(stack)
        run(args)


def run(args: argparse.Namespace) -> None:
    storage = S3Storage()
    storage.client.create_bucket(Bucket=args.bucket)
    if args.only_resume:
        return bench_resume_download(storage, args.bucket, args.resume_mb, args.resume_files, args.repeat)
    uri = f"s3://{args.bucket}/run"
    rt = Runtime(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    role = Role(args.params_m)
    state_gb = role.nbytes() / 1e9
    staging = tempfile.mkdtemp(prefix="rft-bench-ckpt-")
    mgr = CheckpointManager(storage, uri, rt, keep=2, interval=1, roles={"actor": role}, staging_dir=staging)
    print(f"state: {state_gb:.2f} GB ({args.params_m}M params + AdamW state), server {os.environ['AWS_ENDPOINT_URL']}")

    t = time.perf_counter()
    mgr.save(1, {"buffer": {}}, block=True)
    sync_stall = time.perf_counter() - t
    t = time.perf_counter()
    mgr.save(2, {"buffer": {}}, block=False)
    async_stall = time.perf_counter() - t
    mgr.wait()
    commit_total = time.perf_counter() - t
    nbytes = mgr.last_commit_bytes
    upload_s = commit_total - async_stall
    print(f"(a) stall per checkpoint: sync {sync_stall:.2f} s, async {async_stall:.2f} s "
          f"-> async stalls {sync_stall / async_stall:.1f}x less")

    blob = os.urandom(min(nbytes, 256 << 20))
    reps = max(1, nbytes // len(blob))
    t = time.perf_counter()
    for i in range(reps):
        storage.client.upload_fileobj(io.BytesIO(blob), args.bucket, f"raw/{i}")
    raw_s = time.perf_counter() - t
    raw_bps, ours_bps = reps * len(blob) / raw_s, nbytes / upload_s
    print(f"(b) upload: ours {ours_bps / 1e6:.0f} MB/s ({nbytes / 1e9:.2f} GB in {upload_s:.2f} s, incl. sha256 + "
          f"manifest) vs raw boto3 {raw_bps / 1e6:.0f} MB/s -> ratio {ours_bps / raw_bps:.2f}")

    fresh = CheckpointManager(storage, uri, rt, keep=2, interval=1, roles={"actor": Role(args.params_m)},
                              staging_dir=staging)
    t = time.perf_counter()
    step = fresh.resume()
    resume_s = time.perf_counter() - t
    same = all(torch.equal(a, b) for a, b in zip(role.model.parameters(), fresh.app.roles["actor"].model.parameters()))
    print(f"(c) resume of step {step}: {resume_s:.2f} s ({nbytes / 1e6 / resume_s:.0f} MB/s); state identical: {same}")
    bench_resume_download(storage, args.bucket, args.resume_mb, args.resume_files, args.repeat)


if __name__ == "__main__":
    main()
