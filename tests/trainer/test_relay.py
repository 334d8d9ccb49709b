"""The weight relay between sync agents (rft_contract.relay, weights.fetch), over real HTTP
on loopback: children stream each file from their parent while it still arrives, every
hop checks the manifest's sha256, a parent that is unreachable, absent, stalled, cut short
or corrupt sends the child to S3, and the server hands out nothing but the files a
verified (or in-progress) version's manifest lists. S3 here is an in-memory `Storage` that
counts what it serves (the integration test and bench/weightsync.py use a real server)."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from rft_contract.manifest import MANIFEST, file_entry
from rft_serving.engines import SyncError
from rft_contract.relay import CHUNK, MANIFEST_COPY, VERIFIED, Peer, PeerServer, Transfer, parent_index
from rft_serving.sync_agent import SyncAgent
from rft_serving.weights import fetch, version_dir

PART = CHUNK  # what S3 hands out at a time here, and what a relay moves at a time
URI = "s3://bucket/run/weights/step-00000003"
BIG, SMALL = "model.safetensors", "config.json"
TARGET = {"version": 3, "uri": URI, "id": "abc123"}


def wait_for(cond, timeout=20.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


class MemoryS3:
    """The Storage interface over a dict of s3:// URIs, in parts of PART bytes. Counts the bytes
    it serves per URI. `hold[uri]`: an Event the stream waits on after its first part;
    `cut[uri]`: the stream raises there instead (once the hold is released)."""

    def __init__(self, objects: dict[str, bytes]):
        self.objects = dict(objects)
        self.served: dict[str, int] = {}
        self.hold: dict[str, threading.Event] = {}
        self.cut: set[str] = set()

    def _count(self, uri: str, n: int) -> None:
        self.served[uri] = self.served.get(uri, 0) + n

    def list(self, prefix):
        return sorted(k for k in self.objects if k.startswith(prefix))

    def exists(self, uri):
        return uri in self.objects

    def read_bytes(self, uri):
        if uri not in self.objects:
            raise FileNotFoundError(uri)
        self._count(uri, len(self.objects[uri]))
        return self.objects[uri]

    def read_parts(self, uri, size=None):
        if uri not in self.objects:
            raise FileNotFoundError(uri)
        data = self.objects[uri]
        for i in range(0, len(data), PART):
            if i and uri in self.hold:
                assert self.hold[uri].wait(30), "test never released the hold"
                if uri in self.cut:
                    raise OSError("connection reset by S3")
            self._count(uri, len(data[i:i + PART]))
            yield data[i:i + PART]

    def write_bytes(self, uri, data):
        self.objects[uri] = bytes(data)

    def delete(self, uri):
        self.objects.pop(uri, None)

    def file_reads(self) -> dict[str, int]:
        """Bytes served per weights file (the manifest excluded)."""
        return {u.rsplit("/", 1)[1]: n for u, n in self.served.items() if not u.endswith(MANIFEST)}


@pytest.fixture
def export():
    """One exported version: a shard of 3 parts and a bit, and a small file, with its manifest."""
    files = {BIG: os.urandom(3 * PART + 123), SMALL: b'{"model_type": "qwen2"}'}
    manifest = {"id": "abc123", "files": {n: file_entry(d) for n, d in files.items()}}
    objects = {f"{URI}/{n}": d for n, d in files.items()}
    objects[f"{URI}/{MANIFEST}"] = json.dumps(manifest).encode()
    return files, manifest, objects


@pytest.fixture
def servers():
    started = []

    def make(dest: Path, **kw) -> PeerServer:
        s = PeerServer(dest, host="127.0.0.1", **kw).start()
        started.append(s)
        return s

    yield make
    for s in started:
        s.stop()


def peer(server: PeerServer, pod: str) -> Peer:
    return Peer(pod, f"http://127.0.0.1:{server.port}")


def in_thread(fn, *args, **kw):
    out: dict = {}

    def run():
        try:
            out["result"] = fn(*args, **kw)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def assert_files(path: Path, files: dict[str, bytes]) -> None:
    assert {n: (path / n).read_bytes() for n in files} == files


def progress(server: PeerServer, name: str, file: str) -> int:
    t = server._transfers.get(name)
    return t.written.get(file, 0) if t is not None else 0


def test_a_chain_streams_each_file_while_the_parent_still_receives_it(tmp_path, export, servers):
    files, _, objects = export
    s3 = MemoryS3(objects)
    s3.hold[f"{URI}/{BIG}"] = threading.Event()  # replica 0's S3 stream pauses after one part
    name = version_dir(tmp_path, TARGET).name
    dests = [tmp_path / f"r{i}" for i in range(3)]
    srv = [servers(d) for d in dests]
    # Started leaf first: a child that asks before its parent began waits for it.
    leaf, leaf_out = in_thread(fetch, TARGET, dests[2], s3, peer(srv[1], "r1"), srv[2])
    mid, mid_out = in_thread(fetch, TARGET, dests[1], s3, peer(srv[0], "r0"), srv[1])
    root, root_out = in_thread(fetch, TARGET, dests[0], s3, None, srv[0])

    # While replica 0 has one part of the shard, the shard is flowing down the chain.
    wait_for(lambda: progress(srv[2], name, BIG) >= PART, what="the grandchild streaming the shard")
    assert progress(srv[0], name, BIG) == PART and root.is_alive()
    assert progress(srv[1], name, BIG) < len(files[BIG])
    s3.hold[f"{URI}/{BIG}"].set()
    for t in (root, mid, leaf):
        t.join(30)
    got = [out["result"] for out in (root_out, mid_out, leaf_out)]
    assert [g.source for g in got] == ["s3", "peer r0", "peer r1"]
    for g in got:
        assert_files(g.path, files)
        assert (g.path / VERIFIED).exists() and not (g.path.parent / f".tmp-{name}").exists()
    # Each file left S3 once; every replica read the manifest itself.
    assert s3.file_reads() == {n: len(d) for n, d in files.items()}
    assert s3.served[f"{URI}/{MANIFEST}"] == 3 * len(objects[f"{URI}/{MANIFEST}"])
    assert [g.s3_bytes for g in got] == [sum(map(len, files.values())), 0, 0]


def test_a_parent_holds_back_the_last_byte_until_its_check_passed(tmp_path):
    t = Transfer("v00000003-abc123", {"files": {BIG: {"size": 10, "sha256": "x"}}}, tmp_path)
    t.wrote(BIG, 10)
    assert t.available(BIG) == 9
    t.verified(BIG)
    assert t.available(BIG) == 10


def write_verified(dest: Path, files: dict[str, bytes], manifest: dict, corrupt: str | None = None) -> Path:
    """A version directory as an agent leaves it (files, manifest copy, .verified)."""
    d = version_dir(dest, TARGET)
    d.mkdir(parents=True)
    for n, data in files.items():
        # Flip the first byte (random data starts with b"X" once in 256 runs: no corruption).
        (d / n).write_bytes(data if n != corrupt else bytes([data[0] ^ 0xFF]) + data[1:])
    (d / MANIFEST_COPY).write_text(json.dumps(manifest))
    (d / VERIFIED).write_text(json.dumps(TARGET))
    return d


def test_a_corrupt_parent_is_caught_and_the_rest_comes_from_s3(tmp_path, export, servers):
    files, manifest, objects = export
    parent = tmp_path / "parent"
    write_verified(parent, files, manifest, corrupt=BIG)
    s3 = MemoryS3(objects)
    got = fetch(TARGET, tmp_path / "child", s3, peer(servers(parent), "p"))
    assert got.source == "peer p, then s3"
    assert_files(got.path, files)
    # config.json (first in order) came from the parent; the corrupt shard from S3.
    assert s3.file_reads() == {BIG: len(files[BIG])}


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_parent_sends_the_child_to_s3(tmp_path, export):
    files, _, objects = export
    s3 = MemoryS3(objects)
    got = fetch(TARGET, tmp_path / "child", s3, Peer("p", f"http://127.0.0.1:{closed_port()}"), peer_timeout=5)
    assert got.source == "peer p, then s3" and got.peer_bytes == 0
    assert_files(got.path, files)
    assert s3.file_reads() == {n: len(d) for n, d in files.items()}


def test_a_parent_that_never_starts_the_version_answers_404_and_the_child_reads_s3(tmp_path, export, servers):
    files, _, objects = export
    s3 = MemoryS3(objects)
    idle = servers(tmp_path / "parent", wait_seconds=0.2)
    got = fetch(TARGET, tmp_path / "child", s3, peer(idle, "p"), peer_timeout=5)
    assert got.source == "peer p, then s3" and got.s3_bytes == sum(map(len, files.values()))
    assert_files(got.path, files)


def test_a_parent_that_stalls_is_left_after_the_peer_timeout(tmp_path, export, servers):
    files, manifest, objects = export
    stalled = servers(tmp_path / "parent", stall_seconds=60)
    name = version_dir(tmp_path, TARGET).name
    t = Transfer(name, manifest, tmp_path / "parent" / f".tmp-{name}")
    t.path.mkdir(parents=True)
    (t.path / SMALL).write_bytes(b"")
    t.wrote(SMALL, 0)  # started, and never a byte more
    stalled.publish(t)
    got = fetch(TARGET, tmp_path / "child", MemoryS3(objects), peer(stalled, "p"), peer_timeout=0.5)
    assert got.source == "peer p, then s3"
    assert_files(got.path, files)


def test_a_parent_whose_own_download_breaks_ends_the_childs_stream_short(tmp_path, export, servers):
    files, _, objects = export
    broken = MemoryS3(objects)
    broken.hold[f"{URI}/{BIG}"] = threading.Event()
    broken.cut.add(f"{URI}/{BIG}")  # S3 resets replica 0's stream after one part
    name = version_dir(tmp_path, TARGET).name
    # Replica 0 never retries here, so the child's second ask finds nothing after 2 s.
    srv = [servers(tmp_path / "r0", wait_seconds=2), servers(tmp_path / "r1")]
    root, root_out = in_thread(fetch, TARGET, tmp_path / "r0", broken, None, srv[0])
    healthy = MemoryS3(objects)
    child, child_out = in_thread(fetch, TARGET, tmp_path / "r1", healthy, peer(srv[0], "r0"), srv[1])
    wait_for(lambda: progress(srv[1], name, BIG) >= PART, what="the child streaming the shard")
    broken.hold[f"{URI}/{BIG}"].set()
    root.join(30)
    child.join(30)
    assert isinstance(root_out.get("error"), SyncError) and "OSError" in str(root_out["error"])
    assert not (tmp_path / "r0" / name).exists()
    got = child_out["result"]
    assert got.source == "peer r0, then s3"
    assert_files(got.path, files)
    assert healthy.file_reads() == {BIG: len(files[BIG])}


def test_a_child_whose_parent_restarts_a_file_asks_again_instead_of_going_to_s3(tmp_path, export, servers):
    """r0 -> r1 -> r2, and r0 hands out a corrupt shard: r1 catches it and reads the shard
    from S3; r2, cut off mid-shard when r1 restarts it, asks r1 again and gets S3's bytes
    through r1. S3 serves the shard once (to r1), not once per replica below the fault."""
    files, manifest, objects = export
    s3 = MemoryS3(objects)
    name = version_dir(tmp_path, TARGET).name
    srv = [servers(tmp_path / f"r{i}") for i in range(3)]
    bad = Transfer(name, manifest, tmp_path / "r0" / f".tmp-{name}")  # r0's download, driven here
    bad.path.mkdir(parents=True)
    (bad.path / SMALL).write_bytes(files[SMALL])
    bad.wrote(SMALL, len(files[SMALL]))
    bad.verified(SMALL)
    corrupt = bytes([files[BIG][0] ^ 0xFF]) + files[BIG][1:]  # (b"X" + ... is no change 1 in 256)
    with open(bad.path / BIG, "wb") as f:
        f.write(corrupt[:PART])
    bad.wrote(BIG, PART)
    srv[0].publish(bad)
    r1, r1_out = in_thread(fetch, TARGET, tmp_path / "r1", s3, peer(srv[0], "r0"), srv[1])
    r2, r2_out = in_thread(fetch, TARGET, tmp_path / "r2", s3, peer(srv[1], "r1"), srv[2])
    wait_for(lambda: progress(srv[2], name, BIG) >= PART, what="r2 streaming the shard from r1")
    with open(bad.path / BIG, "ab") as f:
        f.write(corrupt[PART:])
    bad.wrote(BIG, len(corrupt))
    bad.verified(BIG)  # r0 claims it checked the shard: r1 does not take its word
    r1.join(30)
    r2.join(30)
    assert (r1_out["result"].source, r2_out["result"].source) == ("peer r0, then s3", "peer r1")
    for out in (r1_out, r2_out):
        assert_files(out["result"].path, files)
    assert s3.file_reads() == {BIG: len(files[BIG])}


def get(server: PeerServer, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}{path}", timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_the_server_serves_only_files_the_manifest_of_a_verified_version_lists(tmp_path, export, servers):
    files, manifest, _ = export
    dest = tmp_path / "dest"
    d = write_verified(dest, files, manifest)
    (d / "notes.txt").write_text("not in the manifest")
    (dest / "secret.txt").write_text("beside the versions")
    unlisted = dest / "v00000002-def456"  # verified by an old agent: no manifest copy kept
    unlisted.mkdir()
    (unlisted / VERIFIED).write_text("{}")
    (unlisted / SMALL).write_text("{}")
    (dest / f".tmp-{d.name}").mkdir()
    server = servers(dest, wait_seconds=0)
    assert get(server, f"/weights/{d.name}/{SMALL}") == (200, files[SMALL])
    assert get(server, f"/weights/{d.name}/{BIG}") == (200, files[BIG])
    for path in [f"/weights/{d.name}/notes.txt", f"/weights/{d.name}/{VERIFIED}",
                 f"/weights/{d.name}/{MANIFEST_COPY}", f"/weights/{d.name}/..%2F..%2Fsecret.txt",
                 f"/weights/{d.name}/../secret.txt", "/weights/../secret.txt", "/weights/..%2Fsecret.txt/x",
                 f"/weights/{unlisted.name}/{SMALL}", f"/weights/.tmp-{d.name}/{SMALL}", "/secret.txt",
                 f"/weights/{d.name}%2F..%2F/secret.txt"]:
        status, body = get(server, path)
        assert status == 404 and b"beside" not in body and b"not in the manifest" not in body, path


def test_a_manifest_naming_a_path_outside_the_version_is_refused_before_any_download(tmp_path, export):
    _, manifest, objects = export
    bad = {**manifest, "files": {**manifest["files"], "../../escape": file_entry(b"x")}}
    objects = {**objects, f"{URI}/{MANIFEST}": json.dumps(bad).encode()}
    s3 = MemoryS3(objects)
    with pytest.raises(SyncError, match="not a plain file name"):
        fetch(TARGET, tmp_path / "dest", s3)
    assert s3.file_reads() == {} and not (tmp_path / "escape").exists()


def test_a_re_exported_version_is_refused_before_any_download(tmp_path, export):
    s3 = MemoryS3(export[2])
    with pytest.raises(SyncError, match="re-exported"):
        fetch({**TARGET, "id": "other"}, tmp_path / "dest", s3)
    assert s3.file_reads() == {}


@pytest.mark.parametrize("index, fanout, parent", [
    (0, 2, None), (1, 2, 0), (2, 2, 0), (3, 2, 1), (6, 2, 2), (7, 2, 3), (5, 1, 4), (8, 8, 0), (9, 8, 1),
])
def test_parent_index(index, fanout, parent):
    assert parent_index(index, fanout) == parent


# ------------------------------------------------------------------ the agents


class SharedStatus:
    """The job's status for several agents: each patch is merged and fed to every agent,
    as their watches would."""

    def __init__(self, target: dict):
        self.status = {"weightSync": {"target": target, "replicas": {}}}
        self.agents: list[SyncAgent] = []
        self.lock = threading.Lock()

    def patch_namespaced_custom_object_status(self, group, version, ns, plural, name, body, **kw):
        from rft_contract.jobapi import merge

        with self.lock:
            merge(self.status, json.loads(json.dumps(body["status"])))
            for a in self.agents:
                a._update({"status": json.loads(json.dumps(self.status))})


class Engine:
    def __init__(self):
        self.version, self.loads = None, []

    def served(self):
        return self.version

    def load(self, path, version, probe=None, tolerance=None, previous=None):
        self.loads.append(path)
        self.version = version

    def restarts(self):
        return None  # no supervisor


def test_agents_find_their_parent_in_the_status_and_report_the_source(tmp_path, export, servers):
    files, _, objects = export
    s3 = MemoryS3(objects)
    api = SharedStatus(TARGET)
    agents = []
    for i in range(3):
        server = servers(tmp_path / f"r{i}")
        agents.append(SyncAgent("job", "ns", f"job-inference-{i}", Engine(), tmp_path / f"r{i}", api=api,
                                storage=s3, peer_server=server, peer_url=f"http://127.0.0.1:{server.port}",
                                fanout=1))
    api.agents = agents
    for a in agents:
        a._patch({"peer": a.peer_url})  # what run() advertises first
    assert agents[0].parent() is None
    assert agents[2].parent() == Peer("job-inference-1", agents[1].peer_url)
    threads = [threading.Thread(target=a.converge, args=(TARGET,)) for a in agents]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    entries = api.status["weightSync"]["replicas"]
    assert [entries[f"job-inference-{i}"]["source"] for i in range(3)] == \
        ["s3", "peer job-inference-0", "peer job-inference-1"]
    assert all(entries[a.pod]["version"] == 3 and entries[a.pod]["peer"] == a.peer_url for a in agents)
    for a in agents:
        assert_files(Path(a.engine.loads[-1]), files)
    assert s3.file_reads() == {n: len(d) for n, d in files.items()}


def test_an_agent_without_fanout_or_a_parent_url_reads_s3(tmp_path):
    api = SharedStatus(TARGET)
    agent = SyncAgent("job", "ns", "job-inference-3", Engine(), tmp_path, api=api, fanout=0)
    api.status["weightSync"]["replicas"]["job-inference-1"] = {"peer": "http://10.0.0.1:8471"}
    agent._update({"status": api.status})
    assert agent.parent() is None
    agent.fanout = 2
    assert agent.parent() == Peer("job-inference-1", "http://10.0.0.1:8471")
    api.status["weightSync"]["replicas"]["job-inference-1"] = {"version": 2}  # no server advertised
    agent._update({"status": api.status})
    assert agent.parent() is None
