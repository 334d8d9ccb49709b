"""The pod runner's logger, defaults, errors and small helpers shared by its modules."""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

log = logging.getLogger("e2e.podrunner")

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
DEFAULT_STATE_DIR = REPO_ROOT / ".local" / "podrunner"
DEFAULT_NODE = "local"

CONFIG_RETRY_S = 2.0  # CreateContainerConfigError / volume setup retry
TERMINAL = ("Succeeded", "Failed")


class PodRunnerError(RuntimeError):
    """The pod runner cannot run here (missing capability, bad kubeconfig, ...)."""


class _ConfigError(Exception):
    """A container's configuration refers to something missing (retried)."""


class _VolumeError(Exception):
    """A volume cannot be set up (yet)."""


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _now_micro() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _g(obj: Any, *keys: str, default: Any = None) -> Any:
    """obj[k1][k2]... or default when any level is missing or None."""
    for key in keys:
        if not isinstance(obj, dict) or obj.get(key) is None:
            return default
        obj = obj[key]
    return obj


def _kv(event: str, **fields: Any) -> str:
    """A structured log line: `event key=value ...`."""
    parts = [event]
    for key, value in fields.items():
        text = str(value)
        parts.append(f"{key}={json.dumps(text) if (not text or ' ' in text or '=' in text) else text}")
    return " ".join(parts)


def _write_file(path: Path, data: bytes, mode: int) -> None:
    """Writes `data` atomically (temp file + rename in the same directory)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _write_in_place(path: Path, data: bytes, create: bool = False) -> None:
    """Rewrites a file keeping its inode (bind mounts of it see the new content)."""
    flags = os.O_WRONLY | (os.O_CREAT if create else 0)
    fd = os.open(path, flags, 0o644)
    try:
        os.write(fd, data)
        os.ftruncate(fd, len(data))
    finally:
        os.close(fd)


def _safe_rel(path: str) -> str:
    """A relative path inside a volume (no absolute paths, no `..`)."""
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if not parts or ".." in parts or path.startswith("/"):
        raise _VolumeError(f"invalid path {path!r}")
    return "/".join(parts)
