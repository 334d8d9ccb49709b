"""What happens to a sample by its version lag: the trainer's policy version minus the
weights version that generated it (0: fresh).

`spec.buffer.staleSamples` says what becomes of samples staler than `buffer.maxStaleness`
(drop or keep); every sample ends in one OUTCOME:

- trained: in the loss as drawn (no rollout importance weights);
- corrected: in the loss with rollout correction's importance weights;
- masked: rollout correction rejected every response token, so the sample left the loss;
- dropped: staler than maxStaleness with staleSamples drop, never read into a batch.

The trainer counts them per (lag label, outcome) in its tracker metrics
(`staleness/<outcome>_lag_<label>`) and in `rft_trainer_samples_total{lag, outcome}`.
Lags of LAG_CAP and more share one label (`8plus`), so the series stay few.
"""

from __future__ import annotations

from typing import Iterable, Mapping

DROP, KEEP = "drop", "keep"
STALE_SAMPLES = (DROP, KEEP)
TRAINED, CORRECTED, MASKED, DROPPED = OUTCOMES = ("trained", "corrected", "masked", "dropped")
LAG_CAP = 8
METRIC_PREFIX = "staleness/"


def lag_label(lag: int) -> str:
    """"0" .. "7", then "8plus" (a name every tracker accepts: MLflow refuses "+"). A
    negative lag, a sample from a version the trainer has not reached, cannot happen with
    versions it exported; it counts as 0."""
    return f"{LAG_CAP}plus" if lag >= LAG_CAP else str(max(0, lag))


def is_count_metric(name: str) -> bool:
    """A per-lag count (`metric_names`): present only in the steps that had such samples,
    so a gauge of its last value would go stale (rft_trainer_samples_total counts them)."""
    return name.startswith(METRIC_PREFIX) and "_lag_" in name


def count(pairs: Iterable[tuple[int, str]]) -> dict[tuple[str, str], int]:
    """(lag, outcome) per sample -> {(lag label, outcome): samples}."""
    out: dict[tuple[str, str], int] = {}
    for lag, outcome in pairs:
        _check(outcome)
        key = (lag_label(lag), outcome)
        out[key] = out.get(key, 0) + 1
    return out


def tally(lags: Mapping[int, int], outcome: str) -> dict[tuple[str, str], int]:
    """{lag: samples} of one outcome -> {(lag label, outcome): samples}."""
    _check(outcome)
    out: dict[tuple[str, str], int] = {}
    for lag, n in lags.items():  # lags of 8 and more share a label
        out[(lag_label(lag), outcome)] = out.get((lag_label(lag), outcome), 0) + n
    return {k: n for k, n in out.items() if n}


def metric_names(counts: Mapping[tuple[str, str], int]) -> dict[str, float]:
    """The tracker metrics of one step's counts: staleness/<outcome>_lag_<label>."""
    return {f"{METRIC_PREFIX}{outcome}_lag_{label}": float(n) for (label, outcome), n in sorted(counts.items())}


def merge(*counts: Mapping[tuple[str, str], int]) -> dict[tuple[str, str], int]:
    out: dict[tuple[str, str], int] = {}
    for c in counts:
        for k, n in c.items():
            out[k] = out.get(k, 0) + n
    return out


def _check(outcome: str) -> None:
    if outcome not in OUTCOMES:
        raise ValueError(f"sample outcome {outcome!r}: one of {', '.join(OUTCOMES)}")
