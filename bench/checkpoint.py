"""Checkpoint benchmark: ~1 GB of training state to a real S3-compatible server.

    python bench/checkpoint.py [--params-m 80] [--endpoint http://...]
                               [--resume-mb 512] [--resume-files 4] [--only-resume]

Without --endpoint it starts a SeaweedFS S3 server on loopback (e2e/s3server.py, the same
server the tests use; its data in a temp dir, removed at the end); pass a MinIO/AWS
endpoint (with AWS_* credentials in the environment) to measure another store. Reports,
each against a baseline measured in the same run:
  (a) training-loop stall per checkpoint: async save (returns once the state is copied
      in memory; goal <= 0.05x) vs a synchronous save of the same state, as a ratio;
  (b) upload of the same staged checkpoint files (one DCP save of the state), each way in a
      fresh subprocess, median of --repeat, interleaved: ours (`storage.upload_file`:
      streamed from disk, sha256 in the same pass, CRC32 checked by the server, at most
      `upload_window` parts in memory) vs raw boto3 `upload_file` of the same files with
      the same TransferConfig, as a throughput ratio (goal >= 0.9), and each one's peak
      RSS above its baseline beside the part size x upload window; plus the manager's own
      commit (upload + manifest + retention) in this process, for reference;
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


def upload_child(mode: str, src: str, prefix: str) -> None:
    """Upload every file of `src` under `prefix` in this (fresh) process; prints seconds and
    RSS growth as JSON. mode "ours": `upload_file` (streamed + sha256); "raw": boto3
    `upload_file` of the file names with S3Storage's TransferConfig."""
    from rft_contract.s3 import split_uri
    from rft_contract.storage import upload_file

    storage = S3Storage()
    paths = sorted(Path(src).iterdir())
    bucket, key = split_uri(prefix)
    storage.client.put_object(Bucket=bucket, Key=f"{key}/warm", Body=b"warm")  # client + connection pool
    base = peak_rss()
    t = time.perf_counter()
    for path in paths:
        if mode == "ours":
            upload_file(storage, path, f"{prefix}/{path.name}")
        else:
            storage.client.upload_file(str(path), bucket, f"{key}/{path.name}", Config=storage.transfer)
    seconds = time.perf_counter() - t
    print(json.dumps({"seconds": seconds, "rss": peak_rss() - base}))


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


def run_upload_child(mode: str, src: Path, prefix: str) -> dict:
    res = subprocess.run([sys.executable, __file__, "--upload-child", mode, str(src), prefix],
                         capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if res.returncode:
        raise RuntimeError(f"{mode} upload child failed: {res.stderr[-2000:]}")
    return json.loads(res.stdout.splitlines()[-1])


def bench_upload(storage: S3Storage, bucket: str, app, repeat: int) -> None:
    """(b): the files of one DCP save of `app`, uploaded by ours and by raw boto3."""
    import torch.distributed.checkpoint as dcp

    src = Path(tempfile.mkdtemp(prefix="rft-bench-staged-"))
    try:
        dcp.save({"app": app}, storage_writer=dcp.FileSystemWriter(str(src)), no_dist=True)
        nbytes = sum(f.stat().st_size for f in src.iterdir())
        runs: dict[str, list[dict]] = {"raw": [], "ours": []}
        for i in range(repeat):  # interleaved, so a noisy moment hits both alike
            for mode in runs:
                runs[mode].append(run_upload_child(mode, src, f"s3://{bucket}/upload-{mode}-{i}"))
    finally:
        shutil.rmtree(src, ignore_errors=True)
    mbps = {k: nbytes / statistics.median(r["seconds"] for r in v) / 1e6 for k, v in runs.items()}
    rss = {k: max(r["rss"] for r in v) for k, v in runs.items()}
    spread = {k: [round(nbytes / r["seconds"] / 1e6) for r in v] for k, v in runs.items()}
    mib, t = 2**20, storage.transfer
    part = t.multipart_chunksize
    print(f"(b) upload of {nbytes / 1e9:.2f} GB of staged checkpoint files ({len(list(spread['ours']))} runs each, "
          f"fresh processes, median):")
    print(f"    ours (streamed, sha256 in the same pass, CRC32): {mbps['ours']:.0f} MB/s {spread['ours']}, "
          f"peak RSS +{rss['ours'] / mib:.0f} MiB = {rss['ours'] / part:.1f} parts of {part / mib:.0f} MiB "
          f"(upload_window {t.max_in_memory_upload_chunks} parts read ahead, plus those being sent; "
          f"{rss['ours'] / nbytes:.2f} of the data)")
    print(f"    raw boto3 upload_file ({t.multipart_chunksize / mib:.0f} MiB x {t.max_concurrency}): "
          f"{mbps['raw']:.0f} MB/s {spread['raw']}, peak RSS +{rss['raw'] / mib:.0f} MiB "
          f"-> ratio {mbps['ours'] / mbps['raw']:.2f} (goal >= 0.9)")


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
    if sys.argv[1:2] == ["--upload-child"]:
        return upload_child(*sys.argv[2:5])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params-m", type=int, default=80, help="model parameters in millions (x12 bytes of state)")
    ap.add_argument("--endpoint", default=None)
    ap.add_argument("--bucket", default=f"rft-bench-{os.getpid()}")
    ap.add_argument("--resume-mb", type=int, default=512, help="size of the synthetic step for (d)")
    ap.add_argument("--resume-files", type=int, default=4, help="files of that step")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each upload in (b) and download in (d)")
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
    mgr.wait_on_save_thread()
    nbytes = mgr.last_commit_bytes
    print(f"(a) stall per checkpoint: sync {sync_stall:.2f} s, async {async_stall:.2f} s "
          f"-> ratio {async_stall / sync_stall:.3f} (goal <= 0.05)")
    print(f"    the manager's commit in this process (upload + manifest + retention): "
          f"{nbytes / mgr.last_upload_seconds / 1e6:.0f} MB/s")
    bench_upload(storage, args.bucket, mgr.app, args.repeat)

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
