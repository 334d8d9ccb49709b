"""The weights fingerprint: an exact check that an engine holds every tensor of an export.

The probe (probe.py) compares log-probs, so it catches weights that are grossly wrong, but
at the learning rates RL fine-tuning runs at (1e-6 in bf16) a layer left stale by a reload
moves the probe's log-probs by far less than the engine's own numerical noise. The
fingerprint does not depend on numerics: for every exported tensor the trainer records

    [sum of its values, sum of their squares]    (float64, of the values as exported)

in `fingerprint.json` (listed in the manifest, hashed and fetched like the weights), and
the engine computes the same of each parameter it holds after loading. Both statistics add
up over concatenation and ignore zero padding, so an engine that fuses tensors (vLLM's
`qkv_proj` = q_proj, k_proj, v_proj; `gate_up_proj`) or pads the vocabulary compares the
sum of its sources (`expected_for`). A bf16 value converted to fp32 or fp64 is exact, so an
engine computing in another dtype than the export's gives the same sums. Only the
summation order differs: the tolerance (`RELATIVE`, against the tensor's own scale) is
many orders of magnitude above float64 rounding and far below what a stale tensor moves at
lr 1e-6 in bf16 (about one element in a hundred changes by one bf16 step).

    {"format": "rft.fingerprint/v1", "dtype": "bf16", "step": N,
     "params": {"model.layers.0.mlp.up_proj.weight": [sum, sum_sq], ...},
     "tied": {"lm_head.weight": "model.embed_tokens.weight"}}

`tied`: names the export leaves out because they are another tensor (a tied output layer);
an engine that holds one as a parameter of its own (an untied copy) is held to the source's
statistics. `compare` names every parameter that differs, and every exported tensor the
engine did not account for.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

FINGERPRINT_FILE = "fingerprint.json"
FORMAT = "rft.fingerprint/v1"
# |engine - export| per statistic, relative to the tensor's scale: float64 summation in
# another order differs by ~1e-15 of it; a stale tensor at lr 1e-6 in bf16 by ~1e-5 or more.
RELATIVE = 1e-9

Stats = Sequence[float]  # [sum, sum of squares]


@dataclass(frozen=True)
class Fingerprint:
    params: dict[str, tuple[float, float]]
    dtype: str = "bf16"
    step: int | None = None
    tied: dict[str, str] = field(default_factory=dict)  # alias -> the exported name it shares

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "dtype": self.dtype, "step": self.step,
                           "params": {k: list(v) for k, v in self.params.items()}, "tied": self.tied})


@dataclass(frozen=True)
class FingerprintVerdict:
    ok: bool
    params: int  # parameters compared
    mismatched: list[str] = field(default_factory=list)  # "name: why", the worst first
    missing: list[str] = field(default_factory=list)  # exported tensors the engine did not hold

    def describe(self) -> str:
        if self.ok:
            return f"all {self.params} parameters match the export"
        parts = []
        if self.mismatched:
            parts.append(f"{len(self.mismatched)} of {self.params} parameters differ from the export "
                         f"(stale or partly loaded): {'; '.join(self.mismatched[:5])}"
                         + (" ..." if len(self.mismatched) > 5 else ""))
        if self.missing:
            parts.append(f"{len(self.missing)} exported tensors not held by the engine: "
                         f"{', '.join(self.missing[:5])}" + (" ..." if len(self.missing) > 5 else ""))
        return "; ".join(parts)

    def record(self) -> dict[str, Any]:
        """For the replica's status entry."""
        out: dict[str, Any] = {"params": self.params}
        if self.mismatched:
            out["mismatched"] = self.mismatched[:5]
        if self.missing:
            out["missing"] = self.missing[:5]
        return out


def parse_fingerprint(data: Any) -> Fingerprint:
    """A fingerprint from its JSON object; ValueError naming what is wrong."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{FINGERPRINT_FILE}: not a {FORMAT} document")
    params = data.get("params")
    if not isinstance(params, dict) or not params:
        raise ValueError(f"{FINGERPRINT_FILE}: params must map each tensor name to [sum, sum of squares]")
    out = {}
    for name, stats in params.items():
        if not (isinstance(stats, list) and len(stats) == 2
                and all(isinstance(x, (int, float)) and math.isfinite(x) for x in stats)):
            raise ValueError(f"{FINGERPRINT_FILE}: params[{name!r}] must be [sum, sum of squares]")
        out[name] = (float(stats[0]), float(stats[1]))
    tied = data.get("tied") or {}
    if not (isinstance(tied, dict) and all(isinstance(k, str) and v in out for k, v in tied.items())):
        raise ValueError(f"{FINGERPRINT_FILE}: tied must map a name to an exported tensor's name")
    dtype = data.get("dtype") if isinstance(data.get("dtype"), str) else "bf16"
    step = data.get("step") if isinstance(data.get("step"), int) else None
    return Fingerprint(out, dtype, step, dict(tied))


def read_fingerprint(directory: str | Path) -> Fingerprint | None:
    """The fingerprint of a local weights directory; None when the export has none (the
    base model as uploaded, or an export from before fingerprints)."""
    path = Path(directory) / FINGERPRINT_FILE
    if not path.exists():
        return None
    return parse_fingerprint(json.loads(path.read_text()))


def expected_for(name: str, exported: Mapping[str, tuple[float, float]],
                 packed: Mapping[str, Sequence[str]] | None = None) -> tuple[list[str], tuple[float, float]] | None:
    """The export's tensors an engine parameter `name` holds, and their summed statistics:
    the tensor of that name, else (for a fused parameter) its sources, named by replacing
    the fused module's name with each of `packed[fused]` (vLLM's `packed_modules_mapping`,
    e.g. {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}). None when nothing exported matches."""
    if name in exported:
        return [name], exported[name]
    prefix, _, leaf = name.rpartition(".")
    module_path, _, module = prefix.rpartition(".")
    for source_names in ([(packed or {}).get(module)] if packed else []):
        if not source_names:
            continue
        sources = [f"{module_path}.{s}.{leaf}" if module_path else f"{s}.{leaf}" for s in source_names]
        if all(s in exported for s in sources):
            return sources, (sum(exported[s][0] for s in sources), sum(exported[s][1] for s in sources))
    return None


def compare(held: Mapping[str, Stats], fingerprint: Fingerprint,
            packed: Mapping[str, Sequence[str]] | None = None) -> FingerprintVerdict:
    """The engine's `held` {parameter name: [sum, sum of squares]} against the export's.
    Every exported tensor must be accounted for by some held parameter; a held parameter
    named in `tied` is held to its source's statistics; one the export does not name at all
    is the engine's own (rotary caches, say) and is not compared."""
    exported = fingerprint.params
    mismatched: list[tuple[float, str]] = []
    covered: set[str] = set()
    compared = 0
    for name, stats in held.items():
        source = fingerprint.tied.get(name)
        found = ([source], exported[source]) if source is not None else expected_for(name, exported, packed)
        if found is None:
            continue
        sources, (want_sum, want_sq) = found
        covered.update(sources)
        compared += 1
        got_sum, got_sq = float(stats[0]), float(stats[1])
        # The tensor's scale: sum|x| <= sqrt(n * sum x^2); n is not known here, so the
        # sum's tolerance uses sqrt(sum x^2) times a generous 1e6 (n up to 1e12).
        scale_sq = max(abs(want_sq), 1e-30)
        scale_sum = max(1e6 * math.sqrt(scale_sq), abs(want_sum), 1e-30)
        err = max(abs(got_sq - want_sq) / scale_sq, abs(got_sum - want_sum) / scale_sum)
        if not err <= RELATIVE:
            mismatched.append((err, f"{name} (sum {got_sum:.9g} vs {want_sum:.9g}, "
                                    f"sum of squares {got_sq:.9g} vs {want_sq:.9g})"))
    missing = sorted(set(exported) - covered)
    mismatched.sort(key=lambda m: -m[0] if math.isfinite(m[0]) else -math.inf)
    return FingerprintVerdict(not mismatched and not missing, compared, [m for _, m in mismatched], missing)


CHUNK = 1 << 24  # elements converted to float64 at a time


def tensor_stats(tensor: Any) -> tuple[float, float]:
    """[sum, sum of squares] of a torch tensor's values in float64 (duck-typed: no torch
    import here), converted CHUNK elements at a time so a large embedding never doubles in
    memory. A DTensor must be made whole first (`full_tensor()`)."""
    flat = tensor.detach().reshape(-1)
    total = squares = 0.0
    for start in range(0, flat.numel(), CHUNK):
        part = flat[start:start + CHUNK].double()
        total += part.sum().item()
        squares += part.square().sum().item()
    return total, squares


def model_stats(named_tensors: Any) -> dict[str, tuple[float, float]]:
    """`tensor_stats` of each floating tensor of `named_tensors` ((name, tensor) pairs, e.g.
    `model.named_parameters()`)."""
    return {name: tensor_stats(t) for name, t in named_tensors if t.is_floating_point()}
