"""What goes into each image, and the keys that name its stages: the pure half of the
image build (e2e/images.py builds them).

Each stage's tag is a hash of everything it is built from (compute_hash of a key):

    base   BASE_RECIPE and the architecture
    deps   the image's requirements from pyproject.toml (build_dependency_list), the host's
           versions of them and what they need (build_host_pins), the base's digest, and
           pip's target options (build_pip_target_args)
    app    the sources of the image's packages, the deps' digest, and the image config
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

from packaging.requirements import Requirement

from .cluster import REPO_ROOT

PYPROJECT = REPO_ROOT / "pyproject.toml"
PYTHON_VERSION = "3.11"  # Debian bookworm's python3
SITE_PACKAGES = f"/usr/local/lib/python{PYTHON_VERSION}/dist-packages"
WORKDIR = "/opt/rft"
HOME = "/home/rft"
USER = "1000:1000"
BOOKWORM_GLIBC = (2, 36)
DEBIAN_ARCH = {"x86_64": "amd64", "aarch64": "arm64"}

# Everything the base image is made from; its hash is the base's tag. Bump `format` for
# changes to the steps (ImageBuilder._build_base) that these fields do not describe.
BASE_RECIPE: dict[str, Any] = {
    "format": 1,
    "suite": "bookworm",
    "variant": "minbase",
    # python-is-python3: the operator's pod commands run `python -m ...`.
    "include": ["python3", "python-is-python3", "ca-certificates"],
    "trim": ["var/cache/apt/archives/*.deb", "var/lib/apt/lists/*", "var/log/*", "usr/share/man/*",
             "usr/share/info/*", "usr/share/locale/*", "var/cache/debconf/*-old", "dev/*",
             "etc/hostname", "etc/resolv.conf"],
    "user": {"name": "rft", "uid": 1000, "gid": 1000, "home": HOME},
    "dirs": [SITE_PACKAGES, WORKDIR],
    "env": {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"},
}
# Bump to rebuild every deps / application image (a change to how they are built).
# Deps format 2: zstd-compressed layers (LAYER_COMPRESSION).
DEPS_FORMAT = 2
APP_FORMAT = 1
TAG_LENGTH = 20
# The deps and application layers: zstd compresses the trainer's 6.2 GB on all cores and
# decompresses several times faster than gzip when containerd pulls it (containerd >= 1.5,
# CRI-O and Docker >= 23 read it). The base image keeps gzip.
LAYER_COMPRESSION = "zstd"


@dataclass(frozen=True)
class ImageSpec:
    """One image: its dependencies (pyproject extras), packages, config and smoke check."""

    name: str
    extras: tuple[str, ...]
    packages: tuple[str, ...]  # package directories, relative to the repository root
    entrypoint: tuple[str, ...]
    cmd: tuple[str, ...]
    smoke: str  # Python run in the image (as the image's user) before it is pushed
    ports: tuple[int, ...] = ()
    # Dependencies copied from a prepared environment instead of pip-installed from
    # pyproject.toml: "vllm-env" (e2e/vllm_env.py, which pip cannot install in one go).
    deps_from: str | None = None
    # Debian packages the dependencies need beyond the base (unpacked into the deps layer).
    apt: tuple[str, ...] = ()

    @property
    def repository(self) -> str:
        return f"rftjob/{self.name}"

    @property
    def deps_repository(self) -> str:
        return f"rftjob/{self.name}-deps"

    def config(self) -> dict[str, Any]:
        return {"user": USER, "workdir": WORKDIR, "env": {"PYTHONUNBUFFERED": "1", "HOME": HOME},
                "entrypoint": list(self.entrypoint), "cmd": list(self.cmd), "ports": list(self.ports)}


NO_TORCH = "import importlib.util; assert importlib.util.find_spec('torch') is None, 'torch in a slim image'\n"
# The vLLM image's smoke check: vLLM loads its kernel library the way its engine does
# (CpuPlatform.import_kernels: the one this CPU runs, of the wheel's three), which must be
# sys.argv[1] (the library rft_serving.cpu_isa chose for the build machine's flags, or
# "-" where the build has no table), and one of its kernels (RMSNorm) computes what
# torch does. Never `import vllm._C` by hand: that is the AVX-512 library, an illegal
# instruction on a CPU without AVX-512.
VLLM_SMOKE = """\
import sys, torch, vllm
from vllm.platforms import current_platform
current_platform.import_kernels()
maps = open('/proc/self/maps').read().splitlines()
loaded = sorted({line.rsplit('/vllm/', 1)[1] for line in maps if '/vllm/_C' in line})
expected = sys.argv[1] if len(sys.argv) > 1 else '-'
assert expected == '-' or loaded == [expected.split('/', 1)[1]], f'vLLM loaded {loaded}, not {expected}'
x, w = torch.randn(4, 64), torch.rand(64) + 0.5
out = torch.empty_like(x)
torch.ops._C.rms_norm(out, x, w, 1e-6)
ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
assert torch.allclose(out, ref, atol=1e-5), float((out - ref).abs().max())
from vllm.entrypoints.openai import api_server
print('vLLM kernels:', *loaded)
"""
IMAGES: dict[str, ImageSpec] = {spec.name: spec for spec in (
    ImageSpec("operator", (), ("contract/rft_contract", "operator/rft_operator"),
              entrypoint=("python3", "-m", "rft_operator"),
              cmd=("--liveness=http://0.0.0.0:8080/healthz", "--log-format=json"),
              smoke=NO_TORCH + "import rft_operator.__main__", ports=(8080,)),
    ImageSpec("sidecar", ("sidecar",), ("contract/rft_contract", "trainer_image/rft_serving"),
              entrypoint=("python3", "-m", "rft_serving.sync_agent"), cmd=(),
              smoke=NO_TORCH + "import rft_serving.sync_agent"),
    # The operator gives each pod its command (rft_trainer.launch, rft_rollout.explorer,
    # rft_serving.serve, rft_serving.sync_agent); no entrypoint, as in the Dockerfile.
    ImageSpec("trainer", ("trainer",), ("contract/rft_contract", "trainer_image/rft_trainer",
                                        "trainer_image/rft_rollout", "trainer_image/rft_serving"),
              entrypoint=(), cmd=("python3", "-m", "rft_trainer", "--help"),
              smoke="import torch, transformers, rft_trainer.launch, rft_rollout.explorer, "
                    "rft_serving.serve, rft_serving.sync_agent"),
    # vLLM's CPU build (trainer_image/Dockerfile.vllm with VLLM_BUILD=cpu builds the same;
    # VLLM_BUILD=gpu the regular vllm package). No code of ours, only the kernel record
    # (images.py): the inference pod's init container copies the engine's helpers in
    # (rft_operator.rollout_pods).
    ImageSpec("vllm", (), (), entrypoint=(), cmd=("python3", "-m", "vllm.entrypoints.openai.api_server", "--help"),
              smoke=VLLM_SMOKE, deps_from="vllm-env", apt=("libnuma1",)),  # vllm's kernels link libnuma
)}
# What `make demo` builds: the images its sample job runs (no vLLM).
DEMO_IMAGES = ("operator", "sidecar", "trainer")


def compute_hash(key: Any) -> str:
    """A short, stable hash of a JSON-able key (dict order does not matter)."""
    blob = json.dumps(key, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:TAG_LENGTH]


def build_dependency_list(pyproject: dict[str, Any], extras: Sequence[str]) -> list[str]:
    """[project].dependencies plus those of each extra, without duplicates, in order."""
    project = pyproject["project"]
    deps = list(project.get("dependencies", []))
    optional = project.get("optional-dependencies", {})
    for extra in extras:
        if extra not in optional:
            raise ValueError(f"pyproject.toml: [project.optional-dependencies] has no {extra!r}")
        deps += optional[extra]
    return list(dict.fromkeys(d.strip() for d in deps))


def normalize_name(name: str) -> str:
    """PEP 503: `Foo.Bar_baz` -> `foo-bar-baz`."""
    return re.sub(r"[-_.]+", "-", name).lower()


def build_host_pins(requirements: Sequence[str],
                    installed: dict[str, tuple[str, list[str]]]) -> dict[str, str]:
    """name -> version for what `requirements` need, transitively, as installed on the host.

    `installed` maps normalized names to (version, Requires-Dist). Markers are evaluated
    for this interpreter (the image's is the same minor version on the same platform),
    with the extras each requirement asks for. Local version labels are dropped
    (`2.15.0+cu130` -> `2.15.0`).
    """
    pins: dict[str, str] = {}
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = [(Requirement(r), frozenset([""])) for r in requirements]
    while todo:
        req, parent_extras = todo.pop()
        name = normalize_name(req.name)
        if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in parent_extras):
            continue
        if (name, frozenset(req.extras)) in seen or name not in installed:
            continue
        seen.add((name, frozenset(req.extras)))
        version, requires = installed[name]
        pins[name] = version.split("+", 1)[0]
        todo += [(Requirement(r), frozenset(req.extras | {""})) for r in requires]
    return dict(sorted(pins.items()))


def read_installed() -> dict[str, tuple[str, list[str]]]:
    """The host environment's distributions (the first of a name on sys.path wins)."""
    installed: dict[str, tuple[str, list[str]]] = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            installed.setdefault(normalize_name(name), (dist.version, dist.requires or []))
    return installed


def build_pip_target_args(python_version: str = PYTHON_VERSION, glibc: tuple[int, int] = BOOKWORM_GLIBC,
                          arch: str = "x86_64") -> list[str]:
    """pip options that pick wheels for the image's interpreter, whatever the host's:
    CPython `python_version`, binary wheels only, every manylinux tag that glibc runs."""
    platforms = []
    for minor in range(glibc[1], 4, -1):
        platforms.append(f"manylinux_{glibc[0]}_{minor}_{arch}")
        # pip does not map the legacy names to the PEP 600 ones given as --platform.
        legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}.get(minor)
        if legacy and (minor == 17 or arch in ("x86_64", "i686")):
            platforms.append(f"{legacy}_{arch}")
    abi = "cp" + python_version.replace(".", "")
    return ["--python-version", python_version, "--implementation", "cp", "--abi", abi,
            "--only-binary=:all:", *(f"--platform={p}" for p in platforms)]


def build_deps_key(requirements: Sequence[str], pins: dict[str, str], base_digest: str,
                   pip_args: Sequence[str]) -> dict[str, Any]:
    return {"format": DEPS_FORMAT, "requirements": sorted(requirements), "pins": pins,
            "base": base_digest, "pip": list(pip_args)}


def build_env_deps_key(recipe: dict[str, str], base_digest: str, apt: Sequence[str] = (),
                       record: dict[str, Any] | None = None) -> dict[str, Any]:
    """The deps key of an image whose dependencies are a prepared environment's; `record`:
    the engine build's kernel table it carries (ENGINE_BUILD_RECORD), if any."""
    key = {"format": DEPS_FORMAT, "environment": recipe, "base": base_digest, "apt": sorted(apt)}
    if record is not None:
        key["engine_build"] = record
    return key


def build_app_key(spec: ImageSpec, sources_hash: str, deps_digest: str) -> dict[str, Any]:
    return {"format": APP_FORMAT, "sources": sources_hash, "deps": deps_digest,
            "packages": list(spec.packages), "config": spec.config()}


def iter_source_files(root: Path, package_dirs: Sequence[str]) -> Iterator[Path]:
    """The files an image gets from each package directory, sorted (no bytecode)."""
    for package_dir in package_dirs:
        for path in sorted((root / package_dir).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                yield path


def compute_sources_hash(root: Path, package_dirs: Sequence[str]) -> str:
    digest = hashlib.sha256()
    for path in iter_source_files(root, package_dirs):
        digest.update(str(path.relative_to(root)).encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def parse_apt_mirror(sources: Sequence[tuple[str, str]], suite: str) -> str:
    """The URI of the first enabled `deb` source for `suite` (exactly, not -security or
    -updates), from (filename, text) pairs in deb822 (*.sources) or one-line format."""
    for filename, text in sources:
        entries = _deb822_entries(text) if filename.endswith(".sources") else _one_line_entries(text)
        for types, uris, suites in entries:
            if "deb" in types and suite in suites and uris:
                return uris[0]
    raise ValueError(f"no enabled apt source for {suite!r} in {[name for name, _ in sources]}")


def _deb822_entries(text: str) -> Iterator[tuple[list[str], list[str], list[str]]]:
    for stanza in text.split("\n\n"):
        fields: dict[str, str] = {}
        for line in stanza.splitlines():
            if line.startswith("#") or line[:1].isspace() or ":" not in line:
                continue  # comments, continuation lines (e.g. an inline Signed-By key)
            key, value = line.split(":", 1)
            fields[key.strip().lower()] = value.strip()
        if fields.get("enabled", "yes").lower() != "no":
            yield fields.get("types", "").split(), fields.get("uris", "").split(), fields.get("suites", "").split()


def _one_line_entries(text: str) -> Iterator[tuple[list[str], list[str], list[str]]]:
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith(("deb ", "deb-src ")):
            kind, rest = line.split(None, 1)
            if rest.startswith("["):
                rest = rest.split("]", 1)[1]
            words = rest.split()
            if len(words) >= 2:
                yield [kind], [words[0]], [words[1]]


def read_apt_sources(apt_dir: Path = Path("/etc/apt")) -> list[tuple[str, str]]:
    """The host's apt sources, as apt reads them: sources.list, then sources.list.d/ in
    name order (only *.list and *.sources; apt ignores other files there)."""
    paths = [apt_dir / "sources.list"] + sorted(
        p for p in (apt_dir / "sources.list.d").glob("*") if p.suffix in (".list", ".sources"))
    return [(p.name, p.read_text()) for p in paths if p.is_file()]


@dataclass(frozen=True)
class ImageRef:
    repository: str
    tag: str
    digest: str


def build_images_json(refs: dict[str, ImageRef]) -> dict[str, dict[str, str]]:
    return {name: {"repository": r.repository, "tag": r.tag, "digest": r.digest}
            for name, r in sorted(refs.items())}


def format_size(num_bytes: int | None) -> str:
    if num_bytes is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if num_bytes < 1000 or unit == "GB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1000
    raise AssertionError
