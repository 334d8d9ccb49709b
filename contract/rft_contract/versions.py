"""Weights versions on the wire. Our version is a trainer step (0 = the base model); the
sync agent labels an engine with it as a string (vLLM's `/update_weight_version`,
SGLang's `weight_version`), and engines report labels back (`/weight_info`,
`/model_info`, per-completion spans). Anything else an engine may report ("default", its
start-up label; the `reloading-<v>` label during a vLLM reload) is not one of ours."""

from __future__ import annotations

import re
from typing import Any

_DIGITS = re.compile(r"[0-9]+")


def parse_version(label: Any) -> int | None:
    """An engine's weight-version label -> our integer version, or None when it is not one."""
    if isinstance(label, bool):
        return None
    if isinstance(label, int):
        return label if label >= 0 else None
    if isinstance(label, str) and _DIGITS.fullmatch(label):
        return int(label)
    return None
