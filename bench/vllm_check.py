"""vLLM in the loop, for bench/gpu_check.sh on a GPU machine with vLLM installed (it is
not on CPU machines, so CI never runs this): start `vllm serve` the way the operator's
inference pod does (VLLM_SERVER_DEV_MODE=1), reload a weights directory through the sync
agent's adapter, then check that vLLM reports the version and that a completion carries
it per choice (`return_weight_versions`). UNTESTED so far (no GPU was lent)."""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "contract"), str(ROOT / "trainer_image"), str(ROOT)]

import requests  # noqa: E402

from rft_rollout.rollouts import engine_versions  # noqa: E402
from rft_serving.engines import VLLMEngine  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"vllm serve exited with {proc.returncode}")
        try:
            if requests.get(url + "/health", timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(2)
    raise SystemExit(f"vllm serve not healthy after {timeout:.0f}s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    args = ap.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(["vllm", "serve", args.model, "--served-model-name", "policy", "--port", str(port),
                             "--gpu-memory-utilization", "0.3"], env={**os.environ, "VLLM_SERVER_DEV_MODE": "1"})
    try:
        wait_ready(url, proc)
        engine = VLLMEngine(url)
        before = engine.served()
        start = time.perf_counter()
        engine.load(str(Path(args.model).resolve()), 7)
        reload_s = time.perf_counter() - start
        body = requests.post(url + "/v1/completions", timeout=120, json={
            "model": "policy", "prompt": "2 + 3 =", "max_tokens": 4, "n": 2, "temperature": 1.0,
            "return_weight_versions": True}).json()
        out = {"served_before": before, "served_after": engine.served(), "reload_seconds": round(reload_s, 2),
               "choice_versions": engine_versions(body)}
        print(json.dumps(out), flush=True)
        ok = out["served_after"] == 7 and out["choice_versions"] == [7, 7]
        sys.exit(0 if ok else 1)
    finally:
        proc.terminate()
        proc.wait(60)


if __name__ == "__main__":
    main()
