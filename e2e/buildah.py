"""A thin wrapper around the `buildah` CLI for e2e/images.py.

A `BuildahSession` removes every container it created and every image it pulled or
committed when it closes, so buildah's local storage holds nothing between builds: the
local registry's compressed copy is the only one kept. Registries are reached over plain
HTTP on loopback (``--tls-verify=false``).

Containers run (only for smoke checks) with runc: crun refuses this host's hybrid cgroup
layout (docs: real-node notes, pitfalls).
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import subprocess
import uuid
from pathlib import Path
from typing import Any, Sequence

log = logging.getLogger("e2e.images")

CONTAINER_PREFIX = "rftjob-build-"
# Image names this build creates locally: committed (localhost/rftjob/...) or pulled
# from the local registry (127.0.0.1:PORT/rftjob/...).
OWN_IMAGE = re.compile(r"^(localhost|127\.0\.0\.1:\d+)/rftjob/")
# Lower than the host's hard limit: raising a hard rlimit needs CAP_SYS_RESOURCE.
ULIMITS = ("nofile=20000:20000", "nproc=32768:32768")


class BuildError(RuntimeError):
    """A build step failed."""


def run_logged(argv: Sequence[str], log_file: Path, env: dict[str, str] | None = None,
               what: str | None = None, cwd: Path | str | None = None) -> None:
    """Runs a long command with its output appended to `log_file`; on failure the error
    names the command and quotes the log's tail."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "ab") as f:
        f.write(f"\n$ {' '.join(argv)}\n".encode())
        f.flush()
        rc = subprocess.run(list(argv), stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                            env=env, cwd=cwd).returncode
    if rc != 0:
        tail = "\n".join(log_file.read_text(errors="replace").splitlines()[-25:])
        raise BuildError(f"{what or argv[0]} failed (exit {rc}): {' '.join(argv)}\n"
                         f"tail of {log_file}:\n{tail}")


class BuildahSession:
    """Containers and images of one build stage; `close()` removes them all."""

    def __init__(self, registry: str, log_file: Path):
        self.registry = registry  # host:port of the local registry
        self.log_file = log_file
        self.runtime = shutil.which("runc")
        self._containers: list[str] = []
        self._images: list[str] = []

    def __enter__(self) -> "BuildahSession":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- containers and images

    def from_image(self, repository_tag: str | None) -> str:
        """A working container from `repository:tag` in the local registry (pulled), or
        from scratch when None. Returns the container's name."""
        if repository_tag is None:
            return self._from("scratch")
        self._images.append(f"{self.registry}/{repository_tag}")
        return self._from(f"docker://{self.registry}/{repository_tag}", "--tls-verify=false")

    def from_local(self, name: str) -> str:
        """A working container from an image in local storage (never pulled)."""
        return self._from(name, "--pull=never")

    def _from(self, source: str, *flags: str) -> str:
        container = CONTAINER_PREFIX + uuid.uuid4().hex[:8]
        self._containers.append(container)
        _buildah("from", "--quiet", *flags, "--name", container, *(f"--ulimit={u}" for u in ULIMITS), source)
        return container

    def remove_container(self, container: str) -> None:
        """Removes a working container before the session ends (frees its disk)."""
        _remove_container(container)
        self._containers.remove(container)

    def mount(self, container: str) -> Path:
        return Path(_buildah("mount", container).strip())

    def config(self, container: str, *args: str) -> None:
        _buildah("config", *args, container)

    def run(self, container: str, argv: Sequence[str], user: str) -> str:
        """Runs `argv` in the container, without network; returns its output."""
        if self.runtime is None:
            raise BuildError("runc is not installed (apt-get install runc)")
        return _buildah("run", "--runtime", self.runtime, "--network", "none", "--user", user,
                        container, "--", *argv)

    def commit_to_registry(self, container: str, repository_tag: str) -> None:
        """Commits straight into the registry, gzip-compressed, never into local storage.

        For a container whose base layers came from the registry, buildah 1.28 exports
        and compresses them again (the registry then finds it has the blob); that is cheap
        for the small base image only, so this is for the base image.
        """
        run_logged(["buildah", "commit", "--disable-compression=false", "--tls-verify=false",
                    container, f"docker://{self.registry}/{repository_tag}"],
                   self.log_file, what="buildah commit")

    def commit(self, container: str, name: str) -> dict[str, Any]:
        """Commits to local storage (only the container's own layer is written); returns
        the local image's OCI manifest, whose layer sizes are uncompressed sizes."""
        self._images.append(name)
        _buildah("commit", "--quiet", container, name)
        return json.loads(json.loads(_buildah("inspect", "--type", "image", name))["Manifest"])

    def push(self, name: str, repository_tag: str, compression: str = "gzip") -> str:
        """Pushes a local image, its new layers compressed with `compression`; returns the
        manifest digest the registry reports.

        Layers the registry already has (those pulled from it) are not uploaded again:
        containers/image's blob-info cache maps their uncompressed digests to the
        registry's compressed blobs and mounts those across repositories.
        """
        digest_file = self.log_file.parent / f".digest-{uuid.uuid4().hex[:8]}"
        try:
            run_logged(["buildah", "push", "--tls-verify=false", f"--compression-format={compression}",
                        f"--digestfile={digest_file}", name, f"docker://{self.registry}/{repository_tag}"],
                       self.log_file, what="buildah push")
            return digest_file.read_text().strip()
        finally:
            digest_file.unlink(missing_ok=True)

    # -- cleanup

    def close(self) -> None:
        """Removes this session's containers, then its images (best effort, logged)."""
        for container in reversed(self._containers):
            _remove_container(container)
        for image in reversed(self._images):
            _remove_image(image)
        self._containers.clear()
        self._images.clear()


def remove_leftovers() -> None:
    """Removes containers and images that an interrupted build left behind (by name)."""
    for line in _buildah("containers", "--format", "{{.ContainerName}}").splitlines():
        if line.startswith(CONTAINER_PREFIX):
            _remove_container(line)
    for line in _buildah("images", "--format", "{{.Name}}:{{.Tag}}").splitlines():
        if OWN_IMAGE.match(line):
            _remove_image(line)


def _remove_container(name: str) -> None:
    mountpoint = _container_mountpoint(name)
    if mountpoint:
        unmount_below(mountpoint)
    try:
        _buildah("rm", name)
    except BuildError as e:
        if "container not known" not in str(e) and "no such container" not in str(e).lower():
            log.warning("could not remove container %s: %s", name, e)


def _remove_image(name: str) -> None:
    try:
        _buildah("rmi", name)
    except BuildError as e:
        if "image not known" not in str(e):
            log.warning("could not remove image %s: %s", name, e)


def _container_mountpoint(name: str) -> str | None:
    try:
        info = json.loads(_buildah("inspect", "--type", "container", name))
    except (BuildError, ValueError):
        return None
    return info.get("MountPoint") or None


def unmount_below(path: Path | str) -> None:
    """Unmounts whatever is mounted under `path` (debootstrap mounts /proc and /sys in
    its target and may leave them behind if it fails), deepest first."""
    root = str(path).rstrip("/") + "/"
    points = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mountpoint = line.split()[4].encode().decode("unicode_escape")
            if mountpoint.startswith(root):
                points.append(mountpoint)
    for mountpoint in sorted(points, key=len, reverse=True):
        subprocess.run(["umount", "-l", mountpoint], check=False)


def _buildah(*args: str) -> str:
    proc = subprocess.run(["buildah", *args], stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BuildError(f"buildah {' '.join(args[:2])} failed (exit {proc.returncode}): "
                         f"{' '.join(['buildah', *args])[:500]}\n{proc.stderr.strip()[-3000:]}")
    return proc.stdout
