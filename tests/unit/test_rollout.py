"""The rollout concern on its own: (spec, gang phase, WeightsSynced, rollout pods, now) -> Rollouts."""

from datetime import timedelta

import pytest

from rft_contract import names
from rft_contract.spec import parse_spec
from rft_operator import rollout
from rft_operator.conditions import Cond
from rft_contract.names import WEIGHTS_PEER_PORT
from rft_operator.rollout_pods import WEIGHTS_FANOUT, build_inference_pod, build_rollout_pods

from .testing import LOOP, NOW, REF, rollout_pod, rollout_pods

ALL = ["demo-inference-0", "demo-inference-1", "demo-explorer-0"]
SYNCED = Cond(names.COND_WEIGHTS_SYNCED, True, names.REASON_SYNCED)
SYNCING = Cond(names.COND_WEIGHTS_SYNCED, False, names.REASON_SYNCING)
DONE_1M_AGO = "2026-11-30T11:59:00Z"
DONE_11M_AGO = "2026-11-30T11:49:00Z"


# id, spec (None: invalid), gang phase, completionTime, WeightsSynced, pods,
# expected: created names, deleted names, requeue_after
CASES = [
    ("invalid-spec-removes-all", None, names.FAILED, None, None, rollout_pods(), ([], ALL, None)),
    ("invalid-spec-removes-all-in-any-phase", None, names.RUNNING, None, None, rollout_pods(), ([], ALL, None)),
    ("suspended-removes-all", LOOP, names.SUSPENDED, None, SYNCED, rollout_pods(), ([], ALL, None)),
    ("failed-removes-all-but-the-deleting", LOOP, names.FAILED, None, SYNCED,
     rollout_pods(deleting=["demo-inference-1"]), ([], ["demo-inference-0", "demo-explorer-0"], None)),
    ("new-job-creates-all", LOOP, names.PENDING, None, SYNCING, [], (ALL, [], None)),
    ("steady-state", LOOP, names.RUNNING, None, SYNCED, rollout_pods(), ([], [], None)),
    ("restarting-keeps-them", LOOP, names.RESTARTING, None, SYNCED, rollout_pods(), ([], [], None)),
    ("missing-one-is-created", LOOP, names.RUNNING, None, SYNCED, rollout_pods(drop=["demo-inference-1"]),
     (["demo-inference-1"], [], None)),
    ("drifted-and-failed-are-deleted-not-yet-created", LOOP, names.RUNNING, None, SYNCED,
     rollout_pods(stale=["demo-explorer-0"], failed=["demo-inference-0"]),
     ([], ["demo-inference-0", "demo-explorer-0"], None)),
    ("unwanted-replica-is-deleted", LOOP, names.RUNNING, None, SYNCED, rollout_pods(extra=["demo-inference-2"]),
     ([], ["demo-inference-2"], None)),
    ("deleting-drifted-pod-is-left-alone", LOOP, names.RUNNING, None, SYNCED,
     rollout_pods(stale=["demo-explorer-0"], deleting=["demo-explorer-0"]), ([], [], None)),
    ("succeeded-and-synced-removes-all", LOOP, names.SUCCEEDED, DONE_1M_AGO, SYNCED, rollout_pods(),
     ([], ["demo-explorer-0", "demo-inference-0", "demo-inference-1"], None)),
    ("succeeded-train-only-removes-all", LOOP, names.SUCCEEDED, DONE_1M_AGO, None, rollout_pods(),
     ([], ["demo-explorer-0", "demo-inference-0", "demo-inference-1"], None)),
    ("succeeded-syncing-keeps-inference-in-grace", LOOP, names.SUCCEEDED, DONE_1M_AGO, SYNCING, rollout_pods(),
     ([], ["demo-explorer-0"], 540.0)),
    ("succeeded-syncing-grace-spent", LOOP, names.SUCCEEDED, DONE_11M_AGO, SYNCING, rollout_pods(),
     ([], ["demo-explorer-0", "demo-inference-0", "demo-inference-1"], None)),
]


@pytest.mark.parametrize("spec, phase, done, cond, observed, want", [x[1:] for x in CASES], ids=[x[0] for x in CASES])
def test_compute_rollouts(spec, phase, done, cond, observed, want):
    parsed = None if spec is None else parse_spec(spec)
    r = rollout.compute_rollouts(REF, parsed, {"phase": phase, "completionTime": done}, cond, observed, NOW)
    assert ([o["metadata"]["name"] for o in r.create], list(r.delete), r.requeue_after) == want


@pytest.mark.parametrize("cond, done, after, want", [
    (None, DONE_1M_AGO, 0, 0.0),             # nothing syncs: nothing to wait for
    (SYNCED, DONE_1M_AGO, 0, 0.0),
    (SYNCING, DONE_1M_AGO, 0, 540.0),
    (SYNCING, DONE_1M_AGO, 540, 0.0),
    (SYNCING, None, 0, 0.0),                 # no completion time: no grace
])
def test_compute_final_sync_wait(cond, done, after, want):
    assert rollout.compute_final_sync_wait(cond, done, NOW + timedelta(seconds=after)) == want


@pytest.mark.parametrize("phase, h, wanted, want", [
    ("Running", "h", True, False),
    ("Pending", "h", True, False),
    ("Succeeded", "h", True, False),  # an explorer that finished stays until the job does
    ("Failed", "h", True, True),
    ("Unknown", "h", True, True),
    ("Running", "old", True, True),
    ("Running", "h", False, True),
])
def test_should_replace(phase, h, wanted, want):
    want_obj = {"metadata": {"annotations": {names.ANNOTATION_SPEC_HASH: "h"}}} if wanted else None
    assert rollout.should_replace(rollout_pod("p", phase, spec_hash=h), want_obj) is want


# ------------------------------------------------------------------ the weight relay


def _agents(spec_overrides=None, engine="reference"):
    spec = parse_spec({**LOOP, "inference": {**LOOP["inference"], "engine": engine,
                                             **({"image": f"{engine}:1"} if engine != "reference" else {}),
                                             **(spec_overrides or {})}})
    pod = build_inference_pod(REF, spec, 1)
    agent = next(x for x in pod["spec"]["containers"] if x["name"] == "sync-agent")
    return pod, agent


def _arg(container, flag):
    args = container["args"]
    return args[args.index(flag) + 1] if flag in args else None


def test_the_sync_agent_serves_its_children_on_a_named_port_and_reads_its_parent():
    pod, agent = _agents()
    assert _arg(agent, "--peer-port") == str(WEIGHTS_PEER_PORT) and _arg(agent, "--fanout") == str(WEIGHTS_FANOUT)
    assert agent["ports"][0] == {"name": "weights", "containerPort": WEIGHTS_PEER_PORT}  # then `metrics`
    env = {e["name"]: e for e in agent["env"]}
    # The agent advertises http://$RFT_POD_IP:<port> in its status entry.
    assert env[names.ENV_POD_IP]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    engine_ports = {p["containerPort"] for ct in pod["spec"]["containers"] if ct["name"] != "sync-agent"
                    for p in ct.get("ports", [])}
    assert WEIGHTS_PEER_PORT not in engine_ports


def test_the_relay_port_moves_aside_for_an_engine_on_it():
    pod, agent = _agents({"port": WEIGHTS_PEER_PORT})
    ports = [p["containerPort"] for ct in pod["spec"]["containers"] for p in ct.get("ports", [])]
    assert len(ports) == len(set(ports)) == 3 and _arg(agent, "--peer-port") == str(WEIGHTS_PEER_PORT + 1)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_the_init_container_reads_from_the_parent_but_serves_nothing(engine):
    pod, agent = _agents(engine=engine)
    (fetch,) = pod["spec"]["initContainers"]
    assert _arg(fetch, "--fanout") == str(WEIGHTS_FANOUT) and "--peer-port" not in fetch["args"]
    assert "ports" not in fetch and _arg(agent, "--peer-port") == str(WEIGHTS_PEER_PORT)


def _before_termination_messages_and_metrics(container):
    out = {k: v for k, v in container.items() if k != "terminationMessagePolicy"}
    ports = [p for p in out.pop("ports", []) if p["name"] != "metrics"]
    return {**out, "ports": ports} if ports else out


def test_a_pod_from_an_operator_before_termination_messages_is_not_replaced():
    # An upgrade that only adds terminationMessagePolicy (or the /metrics port) leaves
    # running pods be; their hash is the one the pod would have without it.
    from rft_operator.objects import spec_hash

    for obj in build_rollout_pods(REF, parse_spec(LOOP)):
        spec = obj["spec"]
        containers = spec.get("initContainers", []) + spec["containers"]
        assert all(x["terminationMessagePolicy"] == "FallbackToLogsOnError" for x in containers)
        before = {**spec, **{kind: [_before_termination_messages_and_metrics(x) for x in spec[kind]]
                             for kind in ("initContainers", "containers") if kind in spec}}
        old = rollout_pod(obj["metadata"]["name"], spec_hash=spec_hash(before))
        assert not rollout.should_replace(old, obj)
