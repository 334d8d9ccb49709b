"""Experiences: the typed batch the trainer consumes, and the shard format it is stored in.

A batch holds B samples of T tokens (prompt + response, right-padded):

    tokens            (B, T) int64     prompt then response token ids; padding value is
                                       irrelevant (masked out), 0 by convention
    attention_mask    (B, T) bool|int64  real tokens
    action_mask       (B, T) bool      response tokens the policy generated (the loss mask;
                                       False on the prompt and on tool/env output)
    prompt_lengths    (B,)   int64
    rewards           (B,)   float     scalar reward per sample, finite
    group_ids         (B,)   int64     GRPO groups: samples of one prompt share an id
    rollout_logprobs  (B, T) float     optional: logprobs under the sampling engine
    advantages        (B, T) float     optional: precomputed advantages
    returns           (B, T) float     optional: precomputed returns
    weights_version   (B,)   int64     optional: policy version that generated each sample
    info              list[dict]       B free-form JSON objects (task id, reward details)

On-disk format "rft.experiences/v1"
-----------------------------------
A shard is two objects side by side in a buffer directory (local path, file:// or S3):

    <name>.safetensors   the tensors above keyed by field name; only present optional
                         fields are stored; dtypes and shapes as in the table.
    <name>.json          metadata, UTF-8 JSON, written LAST:
        {"format": "rft.experiences/v1",
         "num_samples": B,                                  (>= 1)
         "fields": {"tokens": {"dtype": "int64", "shape": [B, T]}, ...},  (every stored tensor)
         "tensors": {"file": "<name>.safetensors", "bytes": N, "sha256": "<hex>"},
         "info": [{...}, ...],                              (exactly B objects)
         "weights_version_min": int|null, "weights_version_max": int|null,
         "weights_versions": {"<version>": samples, ...}|null,  (optional)
         "created": "2026-01-01T00:00:00Z"}

The JSON is the commit marker: readers ignore a shard until it exists (a crash between
the two writes leaves an orphan .safetensors, never a half shard), and the size and
checksum catch a tensors file replaced or truncated afterwards. `name` is
[A-Za-z0-9][A-Za-z0-9._-]*. Name shards `<seq>-<writer>` with a zero-padded sequence
number per writer (the explorers write `0000000005-e001`): the reader keeps one position
per writer and reads each writer's shards in name order, never going back, so each writer
must name its shards in commit order. Names of another form all belong to a single
stream read in name order. Shards are immutable once committed.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import re
import time
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Iterator, Sequence

import safetensors.torch
import torch

from rft_contract.storage import Storage, get_storage, join
from rft_contract.times import now_text

FORMAT = "rft.experiences/v1"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
# field -> (per token?, dtype rule); per token means (B, T), else (B,).
_SPEC: dict[str, tuple[bool, str]] = {
    "tokens": (True, "int64"), "attention_mask": (True, "bool|int64"),
    "action_mask": (True, "bool"), "prompt_lengths": (False, "int64"),
    "rewards": (False, "float"), "group_ids": (False, "int64"),
    "rollout_logprobs": (True, "float"), "advantages": (True, "float"),
    "returns": (True, "float"), "weights_version": (False, "int64"),
}
_DTYPE_OK: dict[str, Callable[[torch.dtype], bool]] = {
    "int64": lambda d: d == torch.int64,
    "bool": lambda d: d == torch.bool,
    "bool|int64": lambda d: d in (torch.bool, torch.int64),
    "float": lambda d: d.is_floating_point,
}


@dataclass
class Experiences:
    tokens: torch.Tensor
    attention_mask: torch.Tensor
    action_mask: torch.Tensor
    prompt_lengths: torch.Tensor
    rewards: torch.Tensor
    group_ids: torch.Tensor
    rollout_logprobs: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    weights_version: torch.Tensor | None = None
    info: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.info and self.tokens.dim() >= 1:
            self.info = [{} for _ in range(self.tokens.shape[0])]

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def tensors(self) -> dict[str, torch.Tensor]:
        """The present tensor fields by name."""
        return {k: getattr(self, k) for k in _SPEC if getattr(self, k) is not None}

    def validate(self) -> "Experiences":
        """Check shapes, dtypes and masks; ValueError naming the field. Returns self."""
        if self.tokens.dim() != 2:
            raise ValueError(f"tokens: expected shape (B, T), got {tuple(self.tokens.shape)}")
        B, T = self.tokens.shape
        for name, t in self.tensors().items():
            per_token, rule = _SPEC[name]
            want = (B, T) if per_token else (B,)
            if tuple(t.shape) != want:
                raise ValueError(
                    f"{name}: expected shape {want} (tokens is {(B, T)}), got {tuple(t.shape)}"
                )
            if not _DTYPE_OK[rule](t.dtype):
                raise ValueError(f"{name}: expected dtype {rule}, got {t.dtype}")
        if len(self.info) != B:
            raise ValueError(f"info: expected {B} entries, got {len(self.info)}")
        if ((self.prompt_lengths < 0) | (self.prompt_lengths > T)).any():
            raise ValueError(f"prompt_lengths: values must lie in [0, {T}]")
        outside = self.action_mask & ~self.attention_mask.bool()
        if outside.any():
            raise ValueError(f"action_mask: True outside attention_mask in samples {_rows(outside)}")
        positions = torch.arange(T, device=self.tokens.device)
        in_prompt = self.action_mask & (positions < self.prompt_lengths[:, None])
        if in_prompt.any():
            raise ValueError(f"action_mask: True inside the prompt in samples {_rows(in_prompt)}")
        if not torch.isfinite(self.rewards).all():
            raise ValueError(f"rewards: not finite in samples {_rows(~torch.isfinite(self.rewards))}")
        return self

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor], info: list[dict]) -> "Experiences":
        return Experiences(**{k: fn(t) for k, t in self.tensors().items()}, info=info)

    def select(self, indices: Sequence[int] | torch.Tensor) -> "Experiences":
        """The samples at `indices` (any order, repeats allowed)."""
        idx = torch.as_tensor(indices, dtype=torch.long).reshape(-1)
        return self._map(lambda t: t[idx.to(t.device)], [self.info[i] for i in idx.tolist()])

    def split(self, size: int) -> list["Experiences"]:
        """Consecutive batches of `size` samples (the last may be smaller), e.g. mini-batches."""
        if size < 1:
            raise ValueError(f"split size must be >= 1, got {size}")
        return [
            self._map(lambda t, s=s: t[s : s + size], self.info[s : s + size])
            for s in range(0, len(self), size)
        ]

    def to(self, device: torch.device | str) -> "Experiences":
        return self._map(lambda t: t.to(device), list(self.info))

    @classmethod
    def concat(cls, batches: Sequence["Experiences"]) -> "Experiences":
        """One batch of all samples; (B, T) fields are right-padded to the longest T."""
        if not batches:
            raise ValueError("concat: no batches")
        names = set(batches[0].tensors())
        for b in batches[1:]:
            if set(b.tensors()) != names:
                raise ValueError(
                    f"concat: optional fields differ: {sorted(names)} vs {sorted(b.tensors())}"
                )
        T = max(b.tokens.shape[1] for b in batches)
        out = {}
        for name in names:
            parts = [getattr(b, name) for b in batches]
            out[name] = torch.cat([_pad(p, T) for p in parts] if _SPEC[name][0] else parts)
        return cls(**out, info=[i for b in batches for i in b.info])


def _pad(t: torch.Tensor, T: int) -> torch.Tensor:
    """Right-pad a (B, t) tensor to (B, T) with zeros/False (always masked out)."""
    if t.shape[1] == T:
        return t
    out = t.new_zeros((t.shape[0], T))
    out[:, : t.shape[1]] = t
    return out


def _rows(mask: torch.Tensor) -> list[int]:
    rows = mask.reshape(mask.shape[0], -1).any(dim=1).nonzero().flatten().tolist()
    return rows[:10]


# ------------------------------------------------------------------ shards


def write_shard(directory: str, name: str, exp: Experiences, storage: Storage | None = None) -> str:
    """Write one shard (tensors first, then the JSON commit marker); returns the JSON URI."""
    if not _NAME.match(name):
        raise ValueError(f"shard name {name!r}: must match {_NAME.pattern}")
    if len(exp) == 0:
        raise ValueError(f"shard {name}: no samples to write")
    exp.validate()
    storage = storage or get_storage(directory)
    tensors = {k: t.detach().contiguous().cpu() for k, t in exp.tensors().items()}
    blob = safetensors.torch.save(tensors)
    storage.write_bytes(join(directory, f"{name}.safetensors"), blob)
    versions = exp.weights_version
    meta = {
        "format": FORMAT,
        "num_samples": len(exp),
        "fields": {k: {"dtype": _dtype_name(t), "shape": list(t.shape)} for k, t in tensors.items()},
        "tensors": {"file": f"{name}.safetensors", "bytes": len(blob),
                    "sha256": hashlib.sha256(blob).hexdigest()},
        "info": exp.info,
        "weights_version_min": None if versions is None else int(versions.min()),
        "weights_version_max": None if versions is None else int(versions.max()),
        # samples per version, so a reader that skips the shard as stale counts them by lag
        "weights_versions": None if versions is None else {
            str(v): int(k) for v, k in zip(*(t.tolist() for t in versions.unique(return_counts=True)))},
        "created": now_text(),
    }
    uri = join(directory, f"{name}.json")
    storage.write_bytes(uri, json.dumps(meta, separators=(",", ":")).encode())
    return uri


def read_shard_meta(uri: str, storage: Storage | None = None) -> dict[str, Any]:
    """The validated metadata of a shard (`uri` of its .json)."""
    storage = storage or get_storage(uri)
    try:
        meta = json.loads(storage.read_bytes(uri))
    except ValueError as e:
        raise ValueError(f"{uri}: not valid JSON: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        got = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise ValueError(f"{uri}: format is {got!r}, expected {FORMAT!r}")
    n = meta.get("num_samples")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"{uri}: num_samples must be a positive integer, got {n!r}")
    if not isinstance(meta.get("fields"), dict) or not isinstance(meta.get("tensors"), dict):
        raise ValueError(f"{uri}: 'fields' and 'tensors' must be objects")
    info = meta.get("info")
    if not isinstance(info, list) or len(info) != n:
        raise ValueError(f"{uri}: info must be a list of num_samples={n} objects")
    for key in ("weights_version_min", "weights_version_max"):
        if meta.get(key) is not None and not isinstance(meta[key], int):
            raise ValueError(f"{uri}: {key} must be an integer or null, got {meta[key]!r}")
    counts = meta.get("weights_versions")
    if counts is not None and not (isinstance(counts, dict) and all(
            k.lstrip("-").isdigit() and isinstance(v, int) and not isinstance(v, bool) for k, v in counts.items())):
        raise ValueError(f"{uri}: weights_versions must map versions to sample counts, got {counts!r}")
    if counts is not None and sum(counts.values()) != n:
        raise ValueError(f"{uri}: weights_versions counts {sum(counts.values())} samples, num_samples is {n}")
    return meta


def read_shard(path: str, storage: Storage | None = None) -> Experiences:
    """Read a shard given its .json, its .safetensors or its name without suffix."""
    stem = re.sub(r"\.(json|safetensors)$", "", path)
    storage = storage or get_storage(path)
    meta_uri = f"{stem}.json"
    meta = read_shard_meta(meta_uri, storage)
    uri = f"{stem}.safetensors"
    try:
        blob = storage.read_bytes(uri)
    except FileNotFoundError:
        raise ValueError(f"{uri}: missing (committed by {meta_uri})") from None
    want = meta["tensors"]
    if want.get("bytes") not in (None, len(blob)) or want.get("sha256") not in (
        None, hashlib.sha256(blob).hexdigest()
    ):
        raise ValueError(f"{uri}: size or sha256 differs from {meta_uri} (truncated or replaced?)")
    try:
        tensors = safetensors.torch.load(blob)
    except Exception as e:  # safetensors raises its own SafetensorError (not exported)
        raise ValueError(f"{uri}: not a valid safetensors file: {e}") from None
    if set(tensors) != set(meta["fields"]):
        raise ValueError(f"{uri}: holds {sorted(tensors)}, {meta_uri} lists {sorted(meta['fields'])}")
    for k in tensors:
        if k not in _SPEC:
            raise ValueError(f"{uri}: unknown field {k!r}")
    missing = [k for k in _REQUIRED if k not in tensors]
    if missing:
        raise ValueError(f"{uri}: missing required fields {missing}")
    try:
        exp = Experiences(**tensors, info=meta["info"]).validate()
    except ValueError as e:
        raise ValueError(f"{uri}: {e}") from None
    if len(exp) != meta["num_samples"]:
        raise ValueError(f"{uri}: {len(exp)} samples, {meta_uri} says {meta['num_samples']}")
    return exp


_REQUIRED = [f.name for f in fields(Experiences) if f.name in _SPEC and f.default is not None]


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


# ------------------------------------------------------------------ reader


def stream_of(name: str) -> str:
    """The writer a shard belongs to: `<seq>-<writer>` names (the explorers' `0000000005-e001`)
    form one stream per writer; any other name belongs to the single stream ""."""
    m = _STREAM.match(name)
    return m.group(1) if m else ""


_STREAM = re.compile(r"^[0-9]+-(.+)$")


class BufferReader:
    """Batches of exactly `batch_size` samples from the shards under `uri`.

    Shards form streams, one per writer (`stream_of`); each stream is read in name order
    and never goes back, and a batch takes the unread shard with the smallest name among
    the streams' heads. So a slow writer's shard committed after a faster writer's later
    ones is still read (a single name-order position would skip it), and the order is a
    function of what is listed: the trainer's rank 0 reads and broadcasts the batch, so
    every rank trains on the same samples.

    The position is per stream (last shard touched, samples of it consumed), plus the
    samples consumed per stream (trained or dropped as stale); `state_dict()` saves it so
    a resumed trainer continues with the very next sample. A batch may span shards and
    streams. With `max_staleness`, `next_batch(current_version)` drops samples whose
    weights_version is below `current_version - max_staleness` (samples without a
    version are never stale); `take_dropped()` gives them by version lag.
    """

    def __init__(self, uri: str, batch_size: int, max_staleness: int | None = None,
                 storage: Storage | None = None, poll_interval: float = 5.0):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.uri, self.batch_size, self.max_staleness = uri, batch_size, max_staleness
        self.storage = storage or get_storage(uri)
        self.poll_interval = poll_interval
        self.stats = {"batches": 0, "samples": 0, "dropped_stale": 0, "shards": 0}
        self._pos: dict[str, tuple[str, int]] = {}  # stream -> (shard touched last, offset)
        self.consumed: dict[str, int] = {}  # stream -> samples consumed (kept or dropped)
        self._floor: str | None = None  # v1 states: names below it were consumed
        self._streams: dict[str, list[str]] | None = None  # committed names per stream, sorted
        self._metas: dict[str, dict] = {}
        self._loaded: tuple[str, Experiences] | None = None  # the shard we are inside
        self.pending_stale: dict[str, int] = {}  # stale samples an incomplete batch passed
        self._dropped_lags: dict[int, int] = {}  # lag -> samples dropped since take_dropped()

    def state_dict(self) -> dict[str, Any]:
        return {"streams": {k: {"shard": n, "offset": o} for k, (n, o) in sorted(self._pos.items())},
                "consumed": dict(sorted(self.consumed.items())), "floor": self._floor,
                "stats": dict(self.stats)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "streams" in state:
            self._pos = {k: (v["shard"], int(v["offset"])) for k, v in state["streams"].items()}
            self._floor = state.get("floor")
        else:  # a single name-order position (checkpoints before per-stream positions)
            self._pos, self._floor = {}, state.get("shard")
            if state.get("shard") is not None:
                self._pos[stream_of(state["shard"])] = (state["shard"], int(state["offset"]))
        self.consumed = {k: int(v) for k, v in state.get("consumed", {}).items()}
        self.pending_stale = {}
        self.stats = {**self.stats, **state.get("stats", {})}
        self._streams, self._metas, self._loaded = None, {}, None

    def __iter__(self) -> Iterator[Experiences]:
        while (batch := self.next_batch()) is not None:
            yield batch

    def next_batch(self, current_version: int | None = None, wait: bool = False,
                   timeout: float | None = None) -> Experiences | None:
        """The next full batch, or None once the data runs out (after `timeout` seconds
        of polling with `wait=True`). An incomplete batch consumes nothing (stale samples
        passed over are counted in `pending_stale`)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        min_version = None
        if self.max_staleness is not None and current_version is not None:
            min_version = current_version - self.max_staleness
        while True:
            batch = self._try_batch(min_version, current_version)
            if batch is not None or not wait:
                return batch
            if deadline is not None and time.monotonic() >= deadline:
                return None
            time.sleep(self.poll_interval if deadline is None
                       else max(0.0, min(self.poll_interval, deadline - time.monotonic())))

    def _try_batch(self, min_version: int | None, current: int | None = None) -> Experiences | None:
        if self._streams is None:
            self._streams = self._list()
            if self._floor is not None and not self.consumed:
                self.consumed = self._consumed_below_floor()
        pos = dict(self._pos)
        consumed = dict(self.consumed)
        pieces, need, dropped, relisted, shards = [], self.batch_size, 0, False, 0
        drops: dict[str, int] = {}
        lags: dict[int, int] = {}
        while need > 0:
            head = self._head(pos)
            if head is None and not relisted:  # new shards may have been committed
                self._streams, relisted = self._list(), True
                head = self._head(pos)
            if head is None:  # not enough fresh samples yet: consume nothing
                self.pending_stale = drops
                return None
            name, start, fresh_start = head
            taken, end, num_dropped = self._take(name, start, need, min_version, current, lags)
            if fresh_start:
                shards += 1
            if taken is not None:
                pieces.append(taken)
                need -= len(taken)
            stream = stream_of(name)
            pos[stream] = (name, end)
            consumed[stream] = consumed.get(stream, 0) + (end - start)
            dropped += num_dropped
            if num_dropped:
                drops[stream] = drops.get(stream, 0) + num_dropped
        self._pos, self.consumed, self.pending_stale = pos, consumed, {}
        for lag, n in lags.items():
            self._dropped_lags[lag] = self._dropped_lags.get(lag, 0) + n
        # Keep the metadata of shards not passed yet, per stream (a stalled writer must
        # not pin every other writer's shards in memory).
        self._metas = {k: v for k, v in self._metas.items()
                       if stream_of(k) not in pos or k >= pos[stream_of(k)][0]}
        self.stats["batches"] += 1
        self.stats["samples"] += self.batch_size
        self.stats["dropped_stale"] += dropped
        self.stats["shards"] += shards
        return Experiences.concat(pieces)

    def _consumed_below_floor(self) -> dict[str, int]:
        """For a single-position state (older checkpoints): the samples per stream it had
        consumed, i.e. those of every shard named before the position plus the offset
        into it, so explorers throttled on the count see what was really consumed."""
        out: dict[str, int] = {}
        for stream, names in (self._streams or {}).items():
            for name in names[: bisect.bisect_left(names, self._floor)]:
                out[stream] = out.get(stream, 0) + self._meta(name)["num_samples"]
        shard, offset = self._pos.get(stream_of(self._floor), (None, 0))
        if shard == self._floor:
            out[stream_of(shard)] = out.get(stream_of(shard), 0) + offset
        return out

    def consumed_counts(self) -> dict[str, int]:
        """Samples per stream the trainer is done with: consumed, plus the stale samples
        an incomplete batch has passed over (they can never become fresh, so writers
        throttled on this count may replace them; without them a buffer full of stale
        samples would hold every writer back: a deadlock)."""
        out = dict(self.consumed)
        for k, v in self.pending_stale.items():
            out[k] = out.get(k, 0) + v
        return out

    def _head(self, pos: dict[str, tuple[str, int]]) -> tuple[str, int, bool] | None:
        """The unread shard with the smallest name over all streams: (name, offset in it,
        whether it is a shard not touched before)."""
        best = None
        for stream, names in (self._streams or {}).items():
            shard, offset = pos.get(stream, (None, 0))
            # A shard gone since (retention) counts as consumed.
            if shard is not None and _contains(names, shard) and offset < self._meta(shard)["num_samples"]:
                cand = (shard, offset, False)
            else:
                i = 0 if shard is None else bisect.bisect_right(names, shard)
                if shard is None and self._floor is not None:
                    i = bisect.bisect_right(names, self._floor)
                if i >= len(names):
                    continue
                cand = (names[i], 0, True)
            if best is None or cand[0] < best[0]:
                best = cand
        return best

    def take_dropped(self) -> dict[int, int]:
        """Samples dropped as stale since the last call, by version lag (the version the
        batch was read for minus the sample's): what the batches read since then passed
        over, each at its own lag: a stale shard not entered yet is skipped unread when its
        metadata says its samples per version (`weights_versions`, or one version in all),
        else read to count them."""
        out, self._dropped_lags = self._dropped_lags, {}
        return out

    def _take(self, name: str, start: int, need: int, min_version: int | None,
              current: int | None = None, lags: dict[int, int] | None = None):
        """Up to `need` fresh samples of shard `name` from `start`:
        (samples or None, offset after the last one looked at, number dropped); the
        dropped ones are added to `lags` by version lag behind `current`."""
        meta = self._meta(name)
        n, newest = meta["num_samples"], meta.get("weights_version_max")
        lags = {} if lags is None else lags
        if min_version is not None and newest is not None and newest < min_version and start == 0:
            counts = meta.get("weights_versions")
            if counts is None and meta.get("weights_version_min") == newest:
                counts = {newest: n}  # a shard written before the counts, of one version
            if counts is not None:
                for v, k in counts.items():
                    lags[current - int(v)] = lags.get(current - int(v), 0) + k
                return None, n, n  # all stale: skip without reading the tensors
        exp = self._load(name)
        pos = torch.arange(start, n)
        if min_version is not None and exp.weights_version is not None:
            fresh = exp.weights_version[start:] >= min_version
            pos = pos[fresh]
        chosen = pos[:need]
        end = int(chosen[-1]) + 1 if len(chosen) == need else n
        if min_version is not None and exp.weights_version is not None and end > start:
            for v in exp.weights_version[start:end][~fresh[: end - start]].tolist():
                lags[current - v] = lags.get(current - v, 0) + 1
        return (exp.select(chosen) if len(chosen) else None), end, (end - start) - len(chosen)

    def _list(self) -> dict[str, list[str]]:
        prefix = self.uri.rstrip("/") + "/"
        streams: dict[str, list[str]] = {}
        for uri in self.storage.list(prefix):
            rel = uri[len(prefix):]
            if "/" not in rel and rel.endswith(".json"):  # only committed, top-level shards
                name = rel[: -len(".json")]
                streams.setdefault(stream_of(name), []).append(name)
        return {k: sorted(v) for k, v in streams.items()}

    def _meta(self, name: str) -> dict[str, Any]:
        if name not in self._metas:
            self._metas[name] = read_shard_meta(join(self.uri, f"{name}.json"), self.storage)
        return self._metas[name]

    def _load(self, name: str) -> Experiences:
        if self._loaded is None or self._loaded[0] != name:
            self._loaded = (name, read_shard(join(self.uri, name), self.storage))
        return self._loaded[1]


def _contains(names: list[str], name: str) -> bool:
    i = bisect.bisect_left(names, name)
    return i < len(names) and names[i] == name
