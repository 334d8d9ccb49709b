"""The NCCL transport (spec.sync.transport: nccl) against vLLM 0.32.0's own code, on CPU.

What runs for real: trainer rank 0's weights server with its NCCL routes
(rft_trainer.nccl_sender on export.FastPath), the agent's link and our vLLM client
(rft_serving.nccl_link, engines.VLLMEngine.receive), vLLM's RL router with its request
models, its NCCLWeightTransferInitInfo / NCCLWeightTransferUpdateInfo, its packing
(pack_tensors) and unpacking (unpack_tensor) (tests/fixtures/vllm_nccl_standin.py, in the
vLLM environment of e2e/vllm_env.py).

What cannot run here and is stood in for: NCCL itself and GPUs. Rank 0's collectives are
a TCP stream (`TcpCollectives`: the "unique id" carries its address), and the engine
client under vLLM's router receives from that stream, cut as vLLM's packed consumer cuts
its broadcasts. So these tests say that the requests, the rendezvous fields, the order and
the bytes are what vLLM 0.32.0 takes, not that NCCL moves them (docs/rl-loop.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
from pathlib import Path

import pytest
import requests
import torch
from safetensors.torch import load_file, save_file

from e2e import vllm_env
from rft_contract import nccl
from rft_contract.fingerprint import FINGERPRINT_FILE, Fingerprint, export_stats
from rft_contract.manifest import MANIFEST, manifest_digest
from rft_contract.relay import PeerServer, version_dir_name
from rft_serving.engines import SyncError, VLLMEngine
from rft_serving.sync_agent import SyncAgent
from rft_serving.nccl_link import NcclLink, NcclUnavailable
from rft_trainer.export import FastPath
from rft_trainer.nccl_sender import NcclSender
from tests.conftest import wait_for
from tests.fixtures.vllm_server import free_port

REPO = Path(__file__).resolve().parents[2]
STANDIN = REPO / "tests" / "fixtures" / "vllm_nccl_standin.py"
BUFFER = 64 << 10  # small: three chunks, the first a tensor larger than a chunk alone


class TcpCollectives:
    """Rank 0's collectives over a TCP stream instead of NCCL (see the module doc)."""

    def __init__(self, version=(2, 29, 7)):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(60)
        self._version = list(version)

    def version(self) -> list[int]:
        return self._version

    def unique_id(self) -> bytes:
        return f"127.0.0.1:{self.listener.getsockname()[1]}".encode().ljust(nccl.UNIQUE_ID_BYTES, b"\0")

    def connect(self, world_size: int, unique_id: bytes):
        conn, _ = self.listener.accept()
        return conn

    def send(self, comm, chunks, timeout) -> None:
        for chunk in chunks:
            for f, offset, n in chunk:
                comm.sendall(os.pread(f.fileno(), n, offset))


def _version(tmp: Path, step: int = 3, export_id: str = "abc123") -> tuple[Path, dict]:
    """A bf16 export of two safetensors files, as rank 0 serves it."""
    torch.manual_seed(step)
    d = tmp / version_dir_name(step, export_id)
    d.mkdir(parents=True)
    first = {"model.embed_tokens.weight": torch.randn(300, 128), "model.norm.weight": torch.randn(128)}
    second = {f"model.layers.{i}.mlp.down_proj.weight": torch.randn(64, 96) for i in range(3)}
    second["lm_head.weight"] = torch.randn(300, 128)
    save_file({k: v.to(torch.bfloat16) for k, v in first.items()}, str(d / "model-00001-of-00002.safetensors"))
    save_file({k: v.to(torch.bfloat16) for k, v in second.items()}, str(d / "model-00002-of-00002.safetensors"))
    (d / "config.json").write_text("{}")
    exported = {k: v.to(torch.bfloat16) for k, v in {**first, **second}.items()}
    (d / FINGERPRINT_FILE).write_text(Fingerprint({k: export_stats(v) for k, v in exported.items()}, "bf16",
                                                  step).to_json())
    files = {p.name: {"size": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
             for p in d.iterdir()}
    manifest = {"files": files, "id": export_id}
    (d / MANIFEST).write_text(json.dumps(manifest))
    return d, manifest


def _standin_env(**extra: str) -> dict:
    return {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1",
            "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "PYTHONPATH": str(REPO / "contract"), **extra}


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    runs, why = vllm_env.compute_cpu_fit()
    if not runs:
        pytest.skip(f"vLLM's CPU build does not run here: {why}")
    return vllm_env.ensure()


@pytest.fixture
def nccl_version() -> tuple[int, ...]:
    return (2, 29, 7)  # rank 0's: the stand-in engine's by default (parametrized indirectly)


@pytest.fixture
def rank0(tmp_path, nccl_version):
    directory, manifest = _version(tmp_path / "staging")
    server = PeerServer(tmp_path / "staging").start()
    fast = FastPath(tmp_path / "staging", server, f"http://127.0.0.1:{server.port}")
    fast.serve(directory, manifest)
    sender = NcclSender(fast, TcpCollectives(nccl_version), buffer_bytes=BUFFER)
    yield fast, sender, directory
    server.stop()


@pytest.fixture
def corrupt() -> str:
    return ""  # a tensor the stand-in damages on the way (parametrized indirectly)


@pytest.fixture
def standin(vllm_python, tmp_path, corrupt):
    port, out = free_port(), tmp_path / "received.safetensors"
    proc = subprocess.Popen([str(vllm_python), str(STANDIN), "serve", str(port), str(out)],
                            env=_standin_env(STANDIN_CORRUPT=corrupt),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return requests.get(url + "/standin", timeout=2).ok
        except requests.RequestException:
            assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
            return False

    wait_for(up, timeout=180, message="vLLM's router with the stand-in engine client")
    yield url, out
    proc.kill()
    proc.wait()


@pytest.mark.timeout(300)
def test_a_version_reaches_vllms_router_and_request_classes_byte_for_byte(rank0, standin):
    """The agent's link joins rank 0 and vLLM's /init_weight_transfer_engine; /update_weights
    receives what rank 0 sends, cut into vLLM's chunks and unpacked by vLLM's unpack_tensor,
    and it equals the export's tensors exactly (bf16, both files, in the manifest's order)."""
    fast, sender, directory = rank0
    url, out = standin
    engine, link = VLLMEngine(url, timeout=120), NcclLink(timeout=120)
    incoming = link.prepare(engine, fast.url, directory.name)
    assert incoming.update_info["names"][:2] == ["model.embed_tokens.weight", "model.norm.weight"]
    assert set(incoming.update_info["dtype_names"]) == {"bfloat16"}
    engine.receive(incoming)

    seen = requests.get(url + "/standin", timeout=10).json()
    assert seen["init"] == {"rank_offset": 1, "world_size": 2, "packed": True, "packed_buffer_size_bytes": BUFFER,
                            "packed_num_buffers": nccl.NUM_BUFFERS}
    assert seen["calls"] == ["init", "start", "update", "finish"]
    sizes = [t.nbytes for t in nccl.version_tensors(directory, fast.manifest["files"])]
    assert seen["chunks"] == [sum(sizes[i] for i in c) for c in nccl.chunk_plan(sizes, BUFFER)]
    assert len(seen["chunks"]) > 2
    got = load_file(str(out))
    want = {**load_file(str(directory / "model-00001-of-00002.safetensors")),
            **load_file(str(directory / "model-00002-of-00002.safetensors"))}
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert got[name].dtype == torch.bfloat16 and torch.equal(got[name], tensor), name

    # Again over the same communicator (no second join), while a newer export removes the
    # directory between the plan and the send: the plan's ticket holds the files.
    incoming = link.prepare(engine, fast.url, directory.name)
    fast.drop(directory)
    assert not directory.exists()
    engine.receive(incoming)
    assert requests.get(url + "/standin", timeout=10).json()["calls"].count("init") == 1
    assert all(torch.equal(load_file(str(out))[k], v) for k, v in want.items())


@pytest.mark.timeout(300)
def test_our_chunks_are_vllms_pack_tensors_chunks(rank0, vllm_python):
    """rft_contract.nccl's plan and byte ranges against vLLM's own pack_tensors over the same
    files: the same names in each chunk, the same bytes (sha256)."""
    fast, _, directory = rank0
    out = subprocess.run([str(vllm_python), str(STANDIN), "pack", str(directory), str(BUFFER)],
                         env=_standin_env(), capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    theirs = json.loads(out.stdout.strip().splitlines()[-1])
    tensors = nccl.version_tensors(directory, fast.manifest["files"])
    ours = []
    for chunk in nccl.chunk_plan([t.nbytes for t in tensors], BUFFER):
        h = hashlib.sha256()
        for i in chunk:
            with open(directory / tensors[i].file, "rb") as f:
                f.seek(tensors[i].offset)
                h.update(f.read(tensors[i].nbytes))
        ours.append({"names": [tensors[i].name for i in chunk], "sha256": h.hexdigest()})
    assert ours == theirs


def test_without_the_sender_the_link_says_why_and_nothing_is_asked_of_the_engine(tmp_path):
    """A trainer that does not send over NCCL (no GPU, an older image): NcclUnavailable
    before the engine is touched, so the agent loads the version from its files."""
    directory, manifest = _version(tmp_path / "staging")
    server = PeerServer(tmp_path / "staging").start()
    fast = FastPath(tmp_path / "staging", server, f"http://127.0.0.1:{server.port}")
    fast.serve(directory, manifest)

    class Untouchable:
        def restarts(self):
            return None

        def world_size(self):
            return 1

        def init_transfer(self, info):
            raise AssertionError("the engine was asked to join")

        def nccl_version(self):
            return None

    link = NcclLink(timeout=10)
    try:
        with pytest.raises(NcclUnavailable, match="does not send over NCCL"):
            link.prepare(Untouchable(), fast.url, directory.name)
        server.stop()  # the failed join is remembered: not asked again for this engine process
        with pytest.raises(NcclUnavailable, match="does not send over NCCL"):
            link.prepare(Untouchable(), fast.url, directory.name)
    finally:
        server.stop()


def test_rank0_refuses_what_it_cannot_send_by_name(rank0):
    fast, sender, directory = rank0
    r = requests.post(f"{fast.url}/nccl/join", json={"world_size": 1}, timeout=10)
    assert r.status_code == 400 and "world_size" in r.text
    r = requests.post(f"{fast.url}/nccl/join", json={"world_size": 2, "nccl_version": [2, 30, 7]}, timeout=10)
    assert r.status_code == 409 and "NCCL 2.30.7 in the engine, 2.29.7 on trainer rank 0" in r.text
    r = requests.post(f"{fast.url}/nccl/plan", json={"session": "nope", "version": directory.name}, timeout=10)
    assert r.status_code == 404 and "join again" in r.text
    session = requests.post(f"{fast.url}/nccl/join", json={"world_size": 2}, timeout=10).json()["session"]
    r = requests.post(f"{fast.url}/nccl/plan", json={"session": session, "version": version_dir_name(2, "old")},
                      timeout=10)
    assert r.status_code == 404 and "not the version rank 0 serves" in r.text
    r = requests.post(f"{fast.url}/nccl/send", json={"session": session, "ticket": "nope"}, timeout=10)
    assert r.status_code == 404 and "ticket" in r.text


def _agent(url: str, tmp_path, target: dict | None = None):
    """Replica 0's sync agent with `--transport nccl` on the stand-in engine at `url`, told
    `target` as its watch would."""
    from tests.trainer.test_engines import FakeJobApi

    api, engine = FakeJobApi(), VLLMEngine(url, timeout=120)
    agent = SyncAgent("job", "ns", "job-inference-0", engine, tmp_path / "dest", api=api, transport="nccl",
                      fanout=2)  # as pods run it: replica 0 reads the files from rank 0
    api.agent = agent
    if target is not None:
        api.status = {"weightSync": {"target": target}}
        agent._update({"status": api.status})
    return agent, api, engine


def _target(fast, manifest) -> dict:
    # Rank 0 serves it and the upload has not committed: no S3 read may happen.
    return {"version": 3, "id": "abc123", "uri": "s3://nowhere/weights/step-3", "peer": fast.url,
            "manifest": manifest_digest(manifest)}


@pytest.mark.timeout(300)
def test_the_agent_serves_a_version_that_came_over_nccl_only_after_its_fingerprint_passed(rank0, standin, tmp_path):
    """The sync agent with `--transport nccl` (replica 0, rank 0 serving an uncommitted
    version): the small files from rank 0, the weights through vLLM's routes, the fingerprint
    of what arrived checked while paused, then labelled and reported; then the version's
    files, for restarts and going back (the start-up copy `good`)."""
    fast, _, directory = rank0
    url, _ = standin
    target = _target(fast, fast.manifest)
    agent, api, engine = _agent(url, tmp_path, target)
    assert agent.converge(target)
    assert engine.served() == 3
    calls = requests.get(url + "/standin", timeout=10).json()["calls"]
    assert calls == ["init", "pause:wait", "start", "update", "finish", "resume"]
    entry = api.status["weightSync"]["replicas"]["job-inference-0"]
    assert entry["version"] == 3 and entry["source"] == "nccl trainer" and entry["error"] is None
    assert entry["fingerprint"] == {"params": 6}  # every tensor placed, none mismatched
    good = agent.good[1]
    assert good.name == directory.name and (good / "model-00002-of-00002.safetensors").is_file()
    assert not (tmp_path / "dest" / f"{directory.name}.head").exists()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("corrupt", ["model.layers.1.mlp.down_proj.weight@2"])
def test_a_tensor_damaged_on_the_way_is_named_and_the_previous_version_serves_again(rank0, standin, tmp_path,
                                                                                   corrupt):
    """Version 3 over NCCL, then version 4 with one value of one tensor changed in transit:
    the fingerprint names that tensor while the engine is still paused, the engine goes back
    to version 3 from its files in place, and version 4 is never labelled nor reported."""
    fast, _, first = rank0
    url, _ = standin
    agent, api, engine = _agent(url, tmp_path)
    for step, export_id in ((3, "abc123"), (4, "def456")):
        if step == 4:
            directory, manifest = _version(fast.root, step, export_id)
            fast.serve(directory, manifest)
        target = {**_target(fast, fast.manifest), "version": step, "id": export_id}
        api.status = {**api.status, "weightSync": {**api.status.get("weightSync", {}), "target": target}}
        agent._update({"status": api.status})
        if step == 3:
            assert agent.converge(target) and engine.served() == 3
            continue
        with pytest.raises(SyncError, match=corrupt.split("@")[0].replace(".", r"\.")):
            agent.converge(target)
    assert engine.served() == 3
    assert requests.get(url + "/standin", timeout=10).json()["calls"][-3:] == ["finish", "reload", "resume"]
    assert all(p.get("version") != 4 for p in api.patches)
    assert "serving version 3 again" in agent.broken_reason


@pytest.mark.timeout(300)
@pytest.mark.parametrize("nccl_version", [(2, 30, 7)])
def test_an_engine_whose_nccl_differs_from_rank_0s_loads_the_version_from_its_files(rank0, standin, tmp_path,
                                                                                    caplog):
    """NCCL makes no communicator of mixed versions: rank 0 refuses the join by versions, the
    engine is never asked to join, and the version comes from rank 0's files instead."""
    fast, _, directory = rank0
    url, _ = standin
    target = _target(fast, fast.manifest)
    agent, api, engine = _agent(url, tmp_path, target)
    assert agent.converge(target) and engine.served() == 3
    calls = requests.get(url + "/standin", timeout=10).json()["calls"]
    assert "init" not in calls and "update" not in calls and "reload" in calls
    assert api.status["weightSync"]["replicas"]["job-inference-0"]["source"] == "peer trainer"
    assert "NCCL 2.29.7 in the engine, 2.30.7 on trainer rank 0" in caplog.text
