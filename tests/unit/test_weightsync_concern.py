"""The weight-sync concern on its own: (spec, trainer status, stored weightSync) -> WeightSync."""

import pytest

from rft_contract import names
from rft_contract.spec import parse_spec
from rft_operator import weightsync

from .testing import SPEC

LOOP = {**SPEC, "inference": {"replicas": 2, "port": 8000}}
W3 = {"version": 3, "uri": "s3://ckpts/demo/weights/step-00000003", "id": "abc"}
BASE = {"version": 0, "uri": "s3://models/tiny-qwen", "id": None}
BOTH_ON_3 = {"demo-inference-0": {"version": 3, "id": "abc"}, "demo-inference-1": {"version": 3, "id": "abc"}}
PATCH = sorted(["target", "desiredReplicas", "syncedReplicas", "synced", "lagSteps"])
COUNTS_2_OF_2 = {"desiredReplicas": 2, "syncedReplicas": 2, "synced": "2/2", "lagSteps": 1}

# id, spec, trainer, stored weightSync,
# expected: status patch keys (None: no patch), target version, condition (status, reason) or None, events
CASES = [
    ("invalid-spec", None, {}, {}, (None, None, None, [])),
    ("train-only", SPEC, {"latestWeights": W3}, {}, (None, None, None, [])),
    ("new-job-targets-base", LOOP, {}, {},
     (PATCH, 0, (False, names.REASON_SYNCING), ["WeightsTarget"])),
    ("export-promoted", LOOP, {"step": 4, "latestWeights": W3}, {"target": BASE},
     (PATCH, 3, (False, names.REASON_SYNCING), [])),  # routine: no event
    ("all-synced-nothing-new", LOOP, {"step": 4, "latestWeights": W3},
     {"target": W3, "replicas": BOTH_ON_3, **COUNTS_2_OF_2}, (None, 3, (True, names.REASON_SYNCED), [])),
    ("target-without-none-keys-is-the-same", LOOP, {"step": 0}, {"target": {"version": 0, "uri": BASE["uri"]},
     "replicas": {"demo-inference-0": {"version": 0}, "demo-inference-1": {"version": 0}}, **COUNTS_2_OF_2, "lagSteps": 0},
     (None, 0, (True, names.REASON_SYNCED), [])),
    ("counts-changed", LOOP, {"step": 4, "latestWeights": W3}, {"target": W3, "replicas": BOTH_ON_3},
     (PATCH, 3, (True, names.REASON_SYNCED), [])),
    ("removed-replica-pruned", LOOP, {"step": 4, "latestWeights": W3},
     {"target": W3, "replicas": {**BOTH_ON_3, "demo-inference-2": {"version": 3}}, **COUNTS_2_OF_2},
     (sorted(PATCH + ["replicas"]), 3, (True, names.REASON_SYNCED), [])),
    ("missing-pin-keeps-target", {**LOOP, "sync": {"pinnedVersion": 9}}, {"step": 4, "latestWeights": W3},
     {"target": W3, "replicas": BOTH_ON_3, **COUNTS_2_OF_2}, (None, 3, (False, names.REASON_PIN_MISSING), [])),
]


@pytest.mark.parametrize("spec, trainer, old, want", [x[1:] for x in CASES], ids=[x[0] for x in CASES])
def test_compute_weight_sync(spec, trainer, old, want):
    ws = weightsync.compute_weight_sync("demo", None if spec is None else parse_spec(spec), trainer, old)
    keys, version, cond, events = want
    assert (sorted(ws.status) if ws.status is not None else None) == keys
    if version is not None:
        assert (ws.status or old)["target"]["version"] == version
    assert ((ws.condition.status, ws.condition.reason) if ws.condition else None) == cond
    assert ws.condition is None or ws.condition.type == names.COND_WEIGHTS_SYNCED
    assert [e.reason for e in ws.events] == events


def test_pruned_entries_are_deleted_by_merge_patch():
    old = {"target": W3, "replicas": {**BOTH_ON_3, "demo-inference-2": {"version": 3}}}
    ws = weightsync.compute_weight_sync("demo", parse_spec(LOOP), {"step": 4, "latestWeights": W3}, old)
    assert ws.status["replicas"] == {"demo-inference-2": None}


@pytest.mark.parametrize("old, fields, want", [
    ({}, {"synced": "0/2"}, True),
    ({"synced": "0/2"}, {"synced": "0/2"}, False),
    ({"lagSteps": 1}, {"lagSteps": None}, True),
    ({"target": {"version": 3, "uri": "u"}}, {"target": {"version": 3, "uri": "u", "id": None}}, False),
    ({"target": {"version": 3, "uri": "u", "id": "a"}}, {"target": {"version": 3, "uri": "u", "id": "b"}}, True),
])
def test_is_sync_changed(old, fields, want):
    assert weightsync.is_sync_changed(old, fields) is want
