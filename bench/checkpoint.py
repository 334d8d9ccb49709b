"""Checkpoint benchmark: ~1 GB of training state to a real S3-compatible server.

    python bench/checkpoint.py [--params-m 80] [--endpoint http://...]

Without --endpoint it starts moto's S3 server on loopback (the same server the tests
use); pass a MinIO/AWS endpoint (with AWS_* credentials in the environment) to measure a
real store. Reports, each against a baseline measured in the same run:
  (a) training-loop stall per checkpoint: async save (returns after local staging) vs a
      synchronous save of the same state, as a ratio;
  (b) upload throughput of the commit (per-rank files + manifest) vs a raw boto3
      `upload_fileobj` of the same bytes to the same server, as a ratio;
  (c) resume time (find the newest verified step, download, verify, load).
Single process (world size 1); no thresholds.
"""

from __future__ import annotations

import argparse
import io
import os
import socket
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


def start_moto() -> str:
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request otherwise

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ThreadedMotoServer(ip_address="127.0.0.1", port=port).start()
    os.environ.update({"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                       "AWS_REGION": "us-east-1", "AWS_DEFAULT_REGION": "us-east-1"})
    return f"http://127.0.0.1:{port}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params-m", type=int, default=80, help="model parameters in millions (x12 bytes of state)")
    ap.add_argument("--endpoint", default=None)
    ap.add_argument("--bucket", default=f"rft-bench-{os.getpid()}")
    args = ap.parse_args()

    os.environ["AWS_ENDPOINT_URL"] = args.endpoint or start_moto()
    storage = S3Storage()
    storage.client.create_bucket(Bucket=args.bucket)
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


if __name__ == "__main__":
    main()
