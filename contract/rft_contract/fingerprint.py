"""The weights fingerprint: an exact check that an engine holds every tensor of an export.

The probe (probe.py) compares log-probs, so it catches weights that are grossly wrong, but
at the learning rates RL fine-tuning runs at (1e-6 in bf16) a layer left stale by a reload
moves the probe's log-probs by far less than the engine's own numerical noise. The
fingerprint does not depend on numerics: for every exported parameter the trainer records

    [sum of its values, sum of their squares, number of values]  (float64, as exported)

in `fingerprint.json` (listed in the manifest, hashed and fetched like the weights), and
the engine computes the same of each parameter it holds after loading. Both statistics add
up over concatenation and ignore zero padding, so an engine that fuses tensors (vLLM's
`qkv_proj` = q_proj, k_proj, v_proj; `gate_up_proj`) or pads the vocabulary compares the
sum of its sources (`expected_for`). A bf16 value converted to fp32 or fp64 is exact, so an
engine computing in another dtype than the export's gives the same sums. Only the
summation order differs: the tolerance (`RELATIVE`, against the tensor's own scale: its sum
of squares, and sqrt(n * sum of squares) >= sum |x| for the sum) is many orders of magnitude
above float64 rounding and far below what a stale tensor moves at lr 1e-6 in bf16 (about one
element in a hundred changes by one bf16 step, which moves the sum of squares by ~1e-6 of
itself on a 576 x 576 matrix). What it cannot see: values moved between places (swapped
rows or shards), and a change too small to flip any value in the export dtype (then the
engine serves the same numbers).

    {"format": "rft.fingerprint/v1", "dtype": "bf16", "step": N,
     "params": {"model.layers.0.mlp.up_proj.weight": [sum, sum_sq, n], ...},
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
# another order differs by ~1e-13 of it; a stale tensor at lr 1e-6 in bf16 by ~1e-6 or more.
RELATIVE = 1e-9

Stats = Sequence[float]  # [sum, sum of squares] (an engine's), [sum, sum of squares, n] (the export's)


@dataclass(frozen=True)
class Fingerprint:
    params: dict[str, tuple[float, float, float]]  # name -> (sum, sum of squares, n)
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
        raise ValueError(f"{FINGERPRINT_FILE}: params must map each tensor name to [sum, sum of squares, n]")
    out = {}
    for name, stats in params.items():
        if not (isinstance(stats, list) and len(stats) == 3
                and all(isinstance(x, (int, float)) and math.isfinite(x) for x in stats) and stats[2] >= 1):
            raise ValueError(f"{FINGERPRINT_FILE}: params[{name!r}] must be [sum, sum of squares, n]")
        out[name] = (float(stats[0]), float(stats[1]), float(stats[2]))
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


def expected_for(name: str, exported: Mapping[str, tuple[float, float, float]],
                 packed: Mapping[str, Sequence[str]] | None = None
                 ) -> tuple[list[str], tuple[float, float, float]] | None:
    """The export's tensors an engine parameter `name` holds, and their summed statistics:
    the tensor of that name, else (for a fused parameter) its sources, named by replacing
    the fused module's name with each of `packed[fused]` (vLLM's `packed_modules_mapping`,
    e.g. {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}). None when nothing exported matches."""
    if name in exported:
        return [name], exported[name]
    prefix, _, leaf = name.rpartition(".")
    module_path, _, module = prefix.rpartition(".")
    source_names = (packed or {}).get(module)
    if not source_names:
        return None
    sources = [f"{module_path}.{s}.{leaf}" if module_path else f"{s}.{leaf}" for s in source_names]
    if not all(s in exported for s in sources):
        return None
    return sources, tuple(sum(exported[s][i] for s in sources) for i in range(3))


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
        sources, (want_sum, want_sq, n) = found
        covered.update(sources)
        compared += 1
        got_sum, got_sq = float(stats[0]), float(stats[1])
        scale_sq = max(abs(want_sq), 1e-30)
        scale_sum = max(math.sqrt(n * scale_sq), 1e-30)  # >= sum |x|
        err = max(abs(got_sq - want_sq) / scale_sq, abs(got_sum - want_sum) / scale_sum)
        if not err <= RELATIVE:
            mismatched.append((err, f"{name} (sum {got_sum:.9g} vs {want_sum:.9g}, "
                                    f"sum of squares {got_sq:.9g} vs {want_sq:.9g})"))
    missing = sorted(set(exported) - covered)
    mismatched.sort(key=lambda m: -m[0] if math.isfinite(m[0]) else -math.inf)
    return FingerprintVerdict(not mismatched and not missing, compared, [m for _, m in mismatched], missing)


CHUNK = 1 << 20  # elements converted to float64 at a time (8 MiB: fast, and never a second model)


def tensor_stats(tensor: Any) -> tuple[float, float]:
    """(sum, sum of squares) of a torch tensor's values in float64 (duck-typed: no torch
    import here), CHUNK elements at a time. The sum of squares is the squared 2-norm
    (`vector_norm`, one pass without a squared copy: several times faster than
    `square().sum()`, equal to ~1e-13). A DTensor must be made whole first (`full_tensor()`)."""
    flat = tensor.detach().reshape(-1)
    total = squares = 0.0
    for start in range(0, flat.numel(), CHUNK):
        part = flat[start:start + CHUNK].double()
        total += part.sum().item()
        squares += part.norm().item() ** 2
    return total, squares


def export_stats(tensor: Any) -> tuple[float, float, float]:
    """What the export records of a tensor: `tensor_stats` and its number of values."""
    return (*tensor_stats(tensor), float(tensor.numel()))


def model_stats(named_tensors: Any) -> dict[str, tuple[float, float]]:
    """`tensor_stats` of each floating tensor of `named_tensors` ((name, tensor) pairs, e.g.
    `model.named_parameters()`)."""
    return {name: tensor_stats(t) for name, t in named_tensors if t.is_floating_point()}
