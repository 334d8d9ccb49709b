"""vLLM in the loop, for bench/gpu_check.sh on a GPU machine with the regular vLLM
installed (CI runs vLLM's CPU build instead: tests/trainer/test_vllm.py): start vLLM the
way the operator's inference pod does (the API server module, VLLM_SERVER_DEV_MODE=1, our
worker extension), reload a weights directory through the sync agent's adapter, then check
that vLLM reports the version and that a completion runs (and carries the version per
choice where that vLLM honours `return_weight_versions`; 0.32.0 does not). UNTESTED on a
GPU so far (no GPU was lent)."""

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
            raise SystemExit(f"vLLM exited with {proc.returncode}")
        try:
            if requests.get(url + "/health", timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(2)
    raise SystemExit(f"vLLM not healthy after {timeout:.0f}s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    args = ap.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # The operator's command line (rft_operator.rollout_pods), with our worker extension.
    proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model,
                             "--served-model-name", "policy", "--port", str(port), "--gpu-memory-utilization", "0.3",
                             "--worker-extension-cls", "rft_serving.vllm_worker.RFTWorkerExtension"],
                            env={**os.environ, "VLLM_SERVER_DEV_MODE": "1",
                                 "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "trainer_image")})
    try:
        wait_ready(url, proc)
        engine = VLLMEngine(url)
        before = engine.served()
        start = time.perf_counter()
        engine.load(str(Path(args.model).resolve()), 7, None)
        reload_s = time.perf_counter() - start
        body = requests.post(url + "/v1/completions", timeout=120, json={
            "model": "policy", "prompt": "2 + 3 =", "max_tokens": 4, "n": 2, "temperature": 1.0,
            "return_weight_versions": True}).json()
        out = {"served_before": before, "served_after": engine.served(), "reload_seconds": round(reload_s, 2),
               "choice_versions": engine_versions(body)}
        print(json.dumps(out), flush=True)
        # vLLM 0.32.0 ignores return_weight_versions (choice_versions None); later ones report 7.
        ok = out["served_after"] == 7 and out["choice_versions"] in (None, [7, 7])
        sys.exit(0 if ok else 1)
    finally:
        proc.terminate()
        proc.wait(60)


if __name__ == "__main__":
    main()
