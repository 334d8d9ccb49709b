"""Builds the project's three images without Docker or a remote registry, into the local
registry (e2e/registry.py), which is also the build cache.

    python -m e2e.images build [--only operator|sidecar|trainer] [--state-dir DIR]

Each image is three layers. Each stage is pushed as its own image, tagged by a hash of
what it is built from (e2e/imagespec.py), and only rebuilt when that changes:

    rftjob/base:<hash>            debootstrap --variant=minbase bookworm: python3 (3.11),
                                  ca-certificates, user rft 1000:1000 (BASE_RECIPE)
    rftjob/<image>-deps:<hash>    + the image's dependencies from pyproject.toml, installed
                                  by the host's pip into /usr/local/lib/python3.11/dist-packages
    rftjob/<image>:<hash>         + the image's packages from this repository, and its config

A warm build only asks the registry for manifests (well under a second). When only
sources changed, the deps image is pulled back from the registry, one small layer is
added, and only that layer is uploaded. A deps image built in the same run is handed to
the application stage in local storage (no pull). Local storage is emptied after every
image: the registry's copy is the only one kept (the trainer's deps stage peaks at about
12 GB of disk: the installed tree and its committed copy). Deps and
application layers are zstd-compressed, the base image's gzip. pip and
debootstrap work on mounted root filesystems from the host; only the smoke checks run
containers (runc, no network).

pip installs the requirements constrained to the versions installed in the host's
environment, transitively (build_host_pins): the images get what `make setup` installed
and the tests ran, and pip's resolver never backtracks through hundreds of releases
(kubernetes 37.0.2 wants python-dateutil>=3, which botocore refuses). Upgrading a package
on the host rebuilds the deps images that contain it. Packages the host lacks are
resolved by pip.

Writes <state-dir>/images.json: {image: {"repository": "rftjob/<image>", "tag": ...,
"digest": "sha256:..."}}. operator/Dockerfile and trainer_image/Dockerfile{,.sidecar}
build the same layout with Docker (same interpreter and paths, user, workdir, commands).
"""

from __future__ import annotations

import argparse
import compileall
import contextlib
import fcntl
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

from rft_serving import cpu_isa

from . import vllm_env
from .buildah import BuildahSession, BuildError, remove_leftovers, run_logged, unmount_below
from .cluster import REPO_ROOT, cache_dir
from .imagespec import (
    BASE_RECIPE, DEBIAN_ARCH, IMAGES, LAYER_COMPRESSION, PYPROJECT, SITE_PACKAGES, USER, ImageRef, ImageSpec, build_app_key,
    build_dependency_list, build_deps_key, build_env_deps_key, build_host_pins, build_images_json, build_pip_target_args,
    compute_hash, compute_sources_hash, format_size, iter_source_files, parse_apt_mirror, read_apt_sources,
    read_installed,
)
from .registry import DEFAULT_STATE_DIR, Registry, RegistryError

log = logging.getLogger("e2e.images")


# --------------------------------------------------------------------------- build stages


@dataclass
class StageResult:
    """What one image (or the base) came to, for the summary table."""

    name: str
    ref: ImageRef
    built: list[str] = field(default_factory=list)  # stages built this run; empty: cached
    compressed: int | None = None
    uncompressed: int | None = None
    uploaded: int | None = None  # bytes of new blobs in the registry after the final push
    seconds: float = 0.0


class ImageBuilder:
    """Builds (or finds in the registry) the base, deps and app stages of each image."""

    def __init__(self, registry: Registry, state_dir: Path):
        self.registry = registry
        self.address = registry.address
        self.logs = state_dir / "logs"
        self.pyproject = tomllib.loads(PYPROJECT.read_text())
        self.arch = platform.machine()
        self.pip_args = build_pip_target_args(arch=self.arch)
        self.installed = read_installed()

    def ensure_base(self) -> StageResult:
        started = time.monotonic()
        tag = compute_hash({**BASE_RECIPE, "arch": self.arch})
        result = StageResult("base", ImageRef("rftjob/base", tag, ""))
        digest = self.registry.manifest_digest("rftjob/base", tag)
        if digest is None:
            self._build_base(f"rftjob/base:{tag}")
            result.built.append("base")
            digest = self._pushed_digest("rftjob/base", tag)
        result.ref = ImageRef("rftjob/base", tag, digest)
        result.compressed = self._compressed_size("rftjob/base", digest)
        result.seconds = time.monotonic() - started
        return result

    def _build_base(self, repository_tag: str) -> None:
        mirror = parse_apt_mirror(read_apt_sources(), BASE_RECIPE["suite"])
        log.info("base: debootstrap %s from %s (about a minute)", BASE_RECIPE["suite"], mirror)
        with BuildahSession(self.address, self.logs / "base.log") as b:
            container = b.from_image(None)
            rootfs = b.mount(container)
            try:
                run_logged(["debootstrap", f"--variant={BASE_RECIPE['variant']}",
                            f"--include={','.join(BASE_RECIPE['include'])}",
                            f"--arch={DEBIAN_ARCH.get(self.arch, self.arch)}",
                            BASE_RECIPE["suite"], str(rootfs), mirror], b.log_file, what="debootstrap")
            finally:
                unmount_below(rootfs)
            self._finish_rootfs(rootfs, b.log_file)
            b.config(container, *(f"--env={k}={v}" for k, v in BASE_RECIPE["env"].items()),
                     f"--created-by=debootstrap --variant={BASE_RECIPE['variant']} {BASE_RECIPE['suite']}")
            b.commit_to_registry(container, repository_tag)

    def _finish_rootfs(self, rootfs: Path, log_file: Path) -> None:
        """Adds the user and directories, then drops what a container never needs."""
        user = BASE_RECIPE["user"]
        run_logged(["chroot", str(rootfs), "groupadd", "--gid", str(user["gid"]), user["name"]], log_file)
        run_logged(["chroot", str(rootfs), "useradd", "--uid", str(user["uid"]), "--gid", str(user["gid"]),
                    "--create-home", "--home-dir", user["home"], "--shell", "/bin/sh", user["name"]], log_file)
        for pattern in BASE_RECIPE["trim"]:
            for path in rootfs.glob(pattern):
                _remove(path)
        for path in (rootfs / "usr/share/doc").glob("*/*"):  # keep only the copyright notices
            if path.name != "copyright":
                _remove(path)
        for directory in BASE_RECIPE["dirs"]:
            (rootfs / directory.lstrip("/")).mkdir(parents=True, exist_ok=True)

    def ensure_image(self, spec: ImageSpec, base: ImageRef) -> StageResult:
        started = time.monotonic()
        if spec.deps_from == "vllm-env":
            requirements, pins = [], {}
            deps_tag = compute_hash(build_env_deps_key(vllm_env.recipe(), base.digest, spec.apt, _engine_record()))
        else:
            requirements = build_dependency_list(self.pyproject, spec.extras)
            pins = build_host_pins(requirements, self.installed)
            deps_tag = compute_hash(build_deps_key(requirements, pins, base.digest, self.pip_args))
        result = StageResult(spec.name, ImageRef(spec.repository, "", ""))
        # A deps image built in this run stays in local storage for the application stage,
        # which then starts from it instead of pulling it back and decompressing it (for
        # the trainer, 6.2 GB); the session removes it at the end.
        with BuildahSession(self.address, self.logs / f"{spec.name}-deps.log") as deps_session:
            local_deps = None
            deps_digest = self.registry.manifest_digest(spec.deps_repository, deps_tag)
            if deps_digest is None:
                local_deps = self._build_deps(deps_session, spec, requirements, pins, base, deps_tag)
                result.built.append("deps")
                deps_digest = self._pushed_digest(spec.deps_repository, deps_tag)
            tag = compute_hash(build_app_key(spec, compute_sources_hash(REPO_ROOT, spec.packages), deps_digest))
            digest = self.registry.manifest_digest(spec.repository, tag)
            if digest is None:
                digest = self._build_app(spec, f"{spec.deps_repository}:{deps_tag}", local_deps, tag, result)
                result.built.append("app")
        result.ref = ImageRef(spec.repository, tag, digest)
        result.compressed = self._compressed_size(spec.repository, digest)
        result.seconds = time.monotonic() - started
        return result

    def _build_deps(self, b: BuildahSession, spec: ImageSpec, requirements: list[str],
                    pins: dict[str, str], base: ImageRef, tag: str) -> str:
        """Installs the requirements on the base image, commits the result to local storage
        and pushes it; returns the local image's name."""
        if spec.deps_from is None:
            log.info("%s: installing %d requirements with pip, %d pinned to the host's versions (log: %s)",
                     spec.name, len(requirements), len(pins), b.log_file)
        container = b.from_image(f"{base.repository}:{base.tag}")
        rootfs = b.mount(container)
        if spec.apt:
            install_debs(spec.apt, rootfs, b.log_file)
        if spec.deps_from == "vllm-env":
            source = vllm_env.site_packages(vllm_env.ensure().parents[1])
            log.info("%s: copying %s (vLLM's CPU build and its torch)", spec.name, source)
            copy_environment(source, rootfs / SITE_PACKAGES.lstrip("/"))
            labels = []
            record = _engine_record()
            if record is not None:  # the kernels it holds, for the engine's CPU check (rft_serving.cpu_isa)
                dest = rootfs / cpu_isa.ENGINE_BUILD_RECORD.lstrip("/")
                dest.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
                dest.write_text(json.dumps(record, indent=2) + "\n")
                dest.chmod(0o644)
                kernels = ",".join(Path(k["library"]).name.split(".")[0] for k in record["kernels"])
                labels = [f"--label={cpu_isa.LABEL_ENGINE_BUILD}={record['build']}",
                          f"--label={cpu_isa.LABEL_CPU_KERNELS}={kernels}"]
            b.config(container, *labels, f"--created-by=copy of e2e/vllm_env.py's environment {vllm_env.recipe()}")
        else:
            install_requirements(requirements, pins, rootfs, self.pip_args, b.log_file)
            b.config(container, f"--created-by=pip install --target {SITE_PACKAGES} "
                                f"{' '.join(requirements)}")
        local = f"localhost/{spec.deps_repository}:{tag}"
        log.info("%s: committing the deps layer, pushing it to the registry (%s)", spec.name, LAYER_COMPRESSION)
        b.commit(container, local)
        b.remove_container(container)
        b.push(local, f"{spec.deps_repository}:{tag}", compression=LAYER_COMPRESSION)
        return local

    def _build_app(self, spec: ImageSpec, deps: str, local_deps: str | None, tag: str,
                   result: StageResult) -> str:
        log_file = self.logs / f"{spec.name}.log"
        log.info("%s: adding the application layer to %s", spec.name, deps)
        with BuildahSession(self.address, log_file) as b:
            container = b.from_local(local_deps) if local_deps else b.from_image(deps)
            copy_packages(REPO_ROOT, spec.packages, b.mount(container) / SITE_PACKAGES.lstrip("/"))
            config = spec.config()
            b.config(container, f"--user={config['user']}", f"--workingdir={config['workdir']}",
                     *(f"--env={k}={v}" for k, v in config["env"].items()),
                     f"--entrypoint={json.dumps(config['entrypoint'])}", f"--cmd={json.dumps(config['cmd'])}",
                     *(f"--port={p}" for p in config["ports"]),
                     f"--created-by=copy {' '.join(spec.packages)} to {SITE_PACKAGES}")
            args = _smoke_args(spec)
            log.info("%s: smoke check: %s %s", spec.name, spec.smoke.splitlines()[-1], " ".join(args))
            out = b.run(container, ["python3", "-c", spec.smoke, *args], user=USER)
            if out.strip():
                log.info("%s: %s", spec.name, out.strip().splitlines()[-1])
            local = f"localhost/{spec.repository}:{tag}"
            manifest = b.commit(container, local)
            result.uncompressed = sum(layer["size"] for layer in manifest["layers"])
            before = self.registry.blob_sizes()
            digest = b.push(local, f"{spec.repository}:{tag}", compression=LAYER_COMPRESSION)
            after = self.registry.blob_sizes()
            result.uploaded = sum(size for blob, size in after.items() if blob not in before)
            return digest

    def _pushed_digest(self, repository: str, tag: str) -> str:
        digest = self.registry.manifest_digest(repository, tag)
        if digest is None:
            raise BuildError(f"{repository}:{tag} was pushed but the registry does not have it")
        return digest

    def _compressed_size(self, repository: str, digest: str) -> int:
        manifest = self.registry.manifest(repository, digest)
        return manifest["config"]["size"] + sum(layer["size"] for layer in manifest["layers"])


def _engine_record() -> dict | None:
    build = vllm_env.engine_build()
    return build.to_record() if build is not None else None


def _smoke_args(spec: ImageSpec) -> list[str]:
    """The vLLM image's smoke check is told which kernel library this CPU should get (the
    build machine runs it); the other images' take no arguments."""
    if spec.deps_from != "vllm-env":
        return []
    build = vllm_env.engine_build()
    return [cpu_isa.compute_kernels(build, cpu_isa.cpu_flags()).library if build else "-"]


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def install_requirements(requirements: Sequence[str], pins: dict[str, str], rootfs: Path,
                         pip_args: Sequence[str], log_file: Path) -> None:
    """The host's pip installs wheels for the image's Python into the mounted rootfs,
    constrained to `pins`.

    pip's temporary files (downloads, unpacked wheels) go inside the rootfs, so moving
    them into place is a rename on the same filesystem, and the host's /tmp is not
    charged with gigabytes. Scripts land in /usr/local/bin with the image's python3.
    """
    site = rootfs / SITE_PACKAGES.lstrip("/")
    tmp = rootfs / "tmp" / "rftjob-pip"
    tmp.mkdir(parents=True, exist_ok=True)
    constraints = tmp / "constraints.txt"
    constraints.write_text("".join(f"{name}=={version}\n" for name, version in pins.items()))
    try:
        run_logged([sys.executable, "-m", "pip", "install", "--no-cache-dir", "--no-input",
                    "--disable-pip-version-check", "--root-user-action=ignore", "--progress-bar=off",
                    "--target", str(site), "--constraint", str(constraints), *pip_args, *requirements],
                   log_file, env={**os.environ, "TMPDIR": str(tmp)}, what="pip install")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    scripts = site / "bin"
    if scripts.is_dir():
        for script in scripts.iterdir():
            if not script.is_file():  # __pycache__ of scripts named *.py
                continue
            content = script.read_bytes()
            if content.startswith(b"#!") and b"python" in content.split(b"\n", 1)[0]:
                content = b"#!/usr/bin/python3\n" + content.split(b"\n", 1)[1]
            target = rootfs / "usr/local/bin" / script.name
            target.write_bytes(content)
            target.chmod(0o755)
        shutil.rmtree(scripts)


def install_debs(packages: Sequence[str], rootfs: Path, log_file: Path) -> None:
    """Debian packages into the mounted rootfs: downloaded by the host's apt (the image's
    suite is the host's, bookworm) and unpacked, without maintainer scripts (shared
    libraries need none)."""
    with tempfile.TemporaryDirectory(prefix="rftjob-debs-") as tmp:
        download = ["apt-get", "download", "-q", *packages]
        if subprocess.run(download, cwd=tmp, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode:
            run_logged(["apt-get", "update", "-q"], log_file, what="apt-get update")
            run_logged(download, log_file, what="apt-get download", cwd=tmp)
        for deb in sorted(Path(tmp).glob("*.deb")):
            run_logged(["dpkg-deb", "-x", str(deb), str(rootfs)], log_file, what=f"dpkg-deb -x {deb.name}")


def copy_environment(source: Path, site: Path) -> None:
    """A prepared environment's site-packages into the image's (same Python minor version
    and platform), world-readable, without pip itself. The bytecode pip compiled comes
    along (valid for the image's 3.11: copies keep the sources' times), so an engine does
    not compile thousands of modules at every start as a user who cannot save them."""
    skip = shutil.ignore_patterns("pip", "pip-*.dist-info")
    shutil.copytree(source, site, symlinks=True, dirs_exist_ok=True, ignore=skip)
    for path in site.rglob("*"):
        if not path.is_symlink():
            path.chmod(0o755 if path.is_dir() or os.access(path, os.X_OK) else 0o644)


def copy_packages(root: Path, package_dirs: Sequence[str], site: Path) -> None:
    """Copies the package directories into site-packages (world-readable) and compiles
    them, so that imports as the unprivileged user need not write bytecode."""
    for package_dir in package_dirs:
        target = site / Path(package_dir).name
        for source in iter_source_files(root, [package_dir]):
            dest = target / source.relative_to(root / package_dir)
            dest.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
            shutil.copy2(source, dest)
            dest.chmod(0o755 if os.access(source, os.X_OK) else 0o644)
        if not compileall.compile_dir(target, quiet=1):
            raise BuildError(f"{package_dir}: byte-compilation failed")


# --------------------------------------------------------------------------- orchestration


def build_images(names: Sequence[str], state_dir: Path) -> list[StageResult]:
    """Builds (or finds) `names` and writes images.json; returns one result per stage."""
    for tool in ("buildah", "debootstrap", "runc"):
        if shutil.which(tool) is None:
            raise BuildError(f"{tool} is not installed (apt-get install buildah debootstrap runc)")
    if os.geteuid() != 0:
        raise BuildError("building images needs root (buildah mounts, debootstrap, chroot)")
    state_dir.mkdir(parents=True, exist_ok=True)
    registry = Registry(state_dir)
    registry.ensure()
    os.umask(0o022)  # what pip and the copies create must be readable by the image's user
    with _lock(cache_dir() / "images.lock"):
        remove_leftovers()
        builder = ImageBuilder(registry, state_dir)
        results = [builder.ensure_base()]
        for name in names:
            if IMAGES[name].deps_from == "vllm-env" and not (fits := vllm_env.compute_cpu_fit())[0]:
                # Its smoke check would die of an illegal instruction; the tests that need it skip.
                log.warning("%s: not built: this CPU cannot run it (%s)", name, fits[1])
                continue
            results.append(builder.ensure_image(IMAGES[name], results[0].ref))
            log.info("%s: %s", name, "built " + "+".join(results[-1].built) if results[-1].built else "cached")
        save_images_json(state_dir / "images.json", {r.name: r.ref for r in results[1:]})
    return results


def save_images_json(path: Path, refs: dict[str, ImageRef]) -> None:
    """Merges `refs` into images.json (a partial build keeps the other images' entries)."""
    try:
        current = json.loads(path.read_text())
    except (OSError, ValueError):
        current = {}
    current.update(build_images_json(refs))
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(dict(sorted(current.items())), indent=2) + "\n")
    tmp.replace(path)


def format_table(results: Sequence[StageResult]) -> str:
    rows = [("image", "reference", "compressed", "uncompressed", "uploaded", "built", "time")]
    for r in results:
        rows.append((r.name, f"{r.ref.repository}:{r.ref.tag}", format_size(r.compressed),
                     format_size(r.uncompressed), format_size(r.uploaded),
                     "+".join(r.built) or "cached", f"{r.seconds:.1f}s"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    """One build at a time: builds share buildah's storage, and each removes what an
    interrupted one left there."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.images", description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=["build"])
    parser.add_argument("--only", choices=sorted(IMAGES), action="append",
                        help="build only this image (repeatable; default: all)")
    parser.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR,
                        help="the registry's state dir; images.json and logs go here (default: %(default)s)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[images] %(message)s", stream=sys.stderr)
    started = time.monotonic()
    try:
        results = build_images(args.only or list(IMAGES), args.state_dir.resolve())
    except (BuildError, RegistryError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(format_table(results))
    print(f"registry {Registry(args.state_dir).address}; {args.state_dir / 'images.json'}; "
          f"{time.monotonic() - started:.1f}s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
