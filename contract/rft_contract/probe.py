"""The weight-sync probe: proof that an engine serves the weights the trainer exported.

The trainer writes `probe.json` into every weights export (listed in its manifest, so it
is hashed and fetched like the weights): a short token sequence (a prompt and the
policy's continuation from the last training batch) and the log-prob of each token given
its prefix, computed by the trainer with the exported weights (the master weights rounded
to the export dtype, forward in fp32). After a reload the sync agent has the engine score
the same tokens and compares (`compare`); only a match lets the replica report the version.

    {"format": "rft.probe/v1", "token_ids": [t0, ..., tn], "logprobs": [lp1, ..., lpn],
     "dtype": "bf16", "step": N}

`logprobs[i]` is log p(token_ids[i + 1] | token_ids[:i + 1]). The statistic is the mean
absolute difference over the n tokens (robust to a single near-tie flipping in low
precision); the default tolerance depends on the export dtype, since an engine computes in
it unless told otherwise (`DEFAULT_TOLERANCE`, measured on vLLM's CPU build, in docs/rl-loop.md).
A stale or wrong layer moves log-probs by far more: vLLM's stale tied `lm_head` by ~10
nats per token on SmolLM2 with perturbed embeddings.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROBE_FILE = "probe.json"
FORMAT = "rft.probe/v1"
# Mean |served - trained| log-prob per token that still counts as the same weights.
DEFAULT_TOLERANCE = {"fp32": 2e-3, "bf16": 0.25, "fp16": 0.1}
MAX_TOKENS = 64


@dataclass(frozen=True)
class Probe:
    token_ids: list[int]
    logprobs: list[float]
    dtype: str = "bf16"
    step: int | None = None

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "token_ids": self.token_ids, "logprobs": self.logprobs,
                           "dtype": self.dtype, "step": self.step})

    @property
    def tolerance(self) -> float:
        return DEFAULT_TOLERANCE.get(self.dtype, DEFAULT_TOLERANCE["bf16"])


@dataclass(frozen=True)
class Verdict:
    ok: bool
    mean_diff: float
    max_diff: float
    tokens: int
    tolerance: float

    def describe(self) -> str:
        return (f"mean |served - trained| log-prob {self.mean_diff:.3g} over {self.tokens} tokens "
                f"(max {self.max_diff:.3g}; tolerance {self.tolerance:g})")

    def record(self) -> dict[str, Any]:
        """For the replica's status entry."""
        return {"meanDiff": float(f"{self.mean_diff:.3g}"), "maxDiff": float(f"{self.max_diff:.3g}"),
                "tokens": self.tokens, "tolerance": self.tolerance}


def parse_probe(data: Any) -> Probe:
    """A probe from its JSON object; ValueError naming what is wrong."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{PROBE_FILE}: not a {FORMAT} document")
    ids, lps = data.get("token_ids"), data.get("logprobs")
    if not (isinstance(ids, list) and len(ids) >= 2 and all(isinstance(t, int) and not isinstance(t, bool)
                                                           and t >= 0 for t in ids)):
        raise ValueError(f"{PROBE_FILE}: token_ids must be a list of at least 2 token ids")
    if not (isinstance(lps, list) and len(lps) == len(ids) - 1
            and all(isinstance(x, (int, float)) and math.isfinite(x) for x in lps)):
        raise ValueError(f"{PROBE_FILE}: logprobs must hold one finite number per token after the first")
    dtype = data.get("dtype") if isinstance(data.get("dtype"), str) else "bf16"
    step = data.get("step") if isinstance(data.get("step"), int) else None
    return Probe(list(ids), [float(x) for x in lps], dtype, step)


def read_probe(directory: str | Path) -> Probe | None:
    """The probe of a local weights directory; None when the export has none (the base
    model as uploaded, or an export from before probes)."""
    path = Path(directory) / PROBE_FILE
    if not path.exists():
        return None
    return parse_probe(json.loads(path.read_text()))


def compare(served: list[float], probe: Probe, tolerance: float | None = None) -> Verdict:
    """The engine's log-probs for `probe.token_ids[1:]` against the trainer's."""
    tol = probe.tolerance if tolerance is None else tolerance
    if len(served) != len(probe.logprobs):
        return Verdict(False, math.inf, math.inf, len(served), tol)
    diffs = [abs(a - b) if a is not None and math.isfinite(a) else math.inf
             for a, b in zip(served, probe.logprobs)]
    mean = sum(diffs) / len(diffs)
    return Verdict(mean <= tol, mean, max(diffs), len(diffs), tol)
