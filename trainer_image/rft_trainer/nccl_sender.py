"""Trainer rank 0's side of vLLM's NCCL weight transfer (`spec.sync.transport: nccl`;
the protocol and its sources: rft_contract.nccl).

Served on rank 0's weights server (the fast path's `PeerServer`, `routes`), one NCCL
communicator per engine, made when that engine's sync agent asks:

    POST /nccl/join {"world_size": 1 + the engine's workers}
        -> {"session": id, "init_info": {...}}: rank 0 makes a unique id and joins the
           communicator in a thread of its own; the agent hands `init_info` to vLLM's
           /init_weight_transfer_engine, whose workers join it
    GET  /nccl/plan/<version dir>
        -> {"update_info": {...}}: the names, dtypes and shapes of the version rank 0
           serves, for vLLM's /update_weights
    POST /nccl/send {"session": id, "version": <version dir>}
        -> {"bytes": n, "seconds": s} once rank 0 broadcast every byte of that version
           (while vLLM's /update_weights, which the agent called, receives them)

What is sent is read from the version's files as exported (the ones the manifest hashes,
which the fast path serves), not from the live parameters: training goes on meanwhile,
and the engine's fingerprint check compares what arrived with what the export recorded.
Rank 0 sends to one engine at a time, one chunk (`rft_contract.nccl.BUFFER_BYTES`) in GPU
memory, on a CUDA stream of its own. A communicator is replaced when the same agent joins
again (its engine restarted) and dropped with it.

NOT RUN HERE: this machine has no GPU and no NCCL. What the tests check is the protocol
against vLLM 0.32.0's own classes and packing (tests/trainer/test_nccl_protocol.py) and
these routes with a stand-in for the NCCL calls; the GPU path itself is untested
(docs/rl-loop.md, "Weights over NCCL").
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from rft_contract import nccl
from rft_contract.relay import RouteError

log = logging.getLogger("rft_trainer.nccl")

INIT_TIMEOUT_SECONDS = 300.0  # for the engine's workers to join a communicator
MAX_SESSIONS = 64  # engines with a communicator at once (each holds NCCL buffers)


class Collectives(Protocol):
    """The NCCL calls rank 0 makes (`TorchNccl` on a GPU)."""

    def unique_id(self) -> bytes: ...
    def connect(self, world_size: int, unique_id: bytes) -> Any: ...
    def send(self, comm: Any, chunks: list[list[tuple[Path, int, int]]]) -> None: ...


class TorchNccl:
    """`torch.cuda.nccl`: a communicator of rank 0 with the engine's workers, from a unique
    id (no TCP store: the workers take the id from `init_info`)."""

    def __init__(self, device):
        import torch

        self.torch, self.device = torch, device
        self.stream = torch.cuda.Stream(device=device)

    def unique_id(self) -> bytes:
        return self.torch.cuda.nccl.unique_id()

    def connect(self, world_size: int, unique_id: bytes) -> Any:
        torch = self.torch
        with torch.cuda.device(self.device):
            comm = torch.cuda.nccl.init_rank(world_size, unique_id, 0)  # blocks until every rank joined
            warm = torch.zeros(1, dtype=torch.float32, device=self.device)  # the workers' warm-up all-reduce
            torch.cuda.nccl.all_reduce([warm], streams=[self.stream], comms=[comm])
            self.stream.synchronize()
        return comm

    def send(self, comm: Any, chunks: list[list[tuple[Path, int, int]]]) -> None:
        """Each chunk's byte ranges (file, offset, length), concatenated into one uint8
        buffer on the GPU and broadcast from rank 0."""
        torch = self.torch
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            for chunk in chunks:
                buf = torch.empty(sum(n for _, _, n in chunk), dtype=torch.uint8, device=self.device)
                at = 0
                for path, offset, n in chunk:
                    host = torch.from_file(str(path), size=offset + n, dtype=torch.uint8)[offset:]
                    buf[at:at + n].copy_(host, non_blocking=False)
                    at += n
                torch.cuda.nccl.broadcast([buf], root=0, streams=[self.stream], comms=[comm])
                self.stream.synchronize()  # before the buffer is freed and the next one filled


@dataclass
class Session:
    id: str
    world_size: int
    ready: threading.Event = field(default_factory=threading.Event)
    comm: Any = None
    error: str = ""


class NcclSender:
    """The routes above on `fast.server`. `collectives`: TorchNccl on rank 0's GPU."""

    def __init__(self, fast, collectives: Collectives, buffer_bytes: int = nccl.BUFFER_BYTES,
                 init_timeout: float = INIT_TIMEOUT_SECONDS):
        self.fast, self.collectives = fast, collectives
        self.buffer_bytes, self.init_timeout = buffer_bytes, init_timeout
        self.sessions: dict[str, Session] = {}
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()  # one engine at a time: one chunk in GPU memory
        fast.server.routes[("POST", "nccl")] = self._post
        fast.server.routes[("GET", "nccl")] = self._get

    @classmethod
    def attach(cls, fast, device) -> "NcclSender | None":
        """On a CUDA device with NCCL: the sender on `fast`'s server; else None, with the
        reason logged (the agents then load each version from its files)."""
        import torch

        if device is None or getattr(device, "type", None) != "cuda" or not torch.cuda.is_available():
            log.warning("sync.transport nccl: rank 0 has no GPU; the engines load each version from its files")
            return None
        return cls(fast, TorchNccl(device))

    # -- routes ---------------------------------------------------------------------------
    def _post(self, rest: str, body: dict | None) -> dict:
        if rest == "join":
            return self.join(body or {})
        if rest == "send":
            return self.send(body or {})
        raise RouteError(404, f"no route /nccl/{rest}")

    def _get(self, rest: str, body: dict | None) -> dict:
        what, _, name = rest.partition("/")
        if what != "plan" or not name:
            raise RouteError(404, f"no route /nccl/{rest}")
        return {"update_info": nccl.update_info(self._tensors(name))}

    def join(self, body: dict) -> dict:
        try:
            world_size = nccl.check_world_size(body.get("world_size"))
        except ValueError as e:
            raise RouteError(400, str(e)) from None
        unique_id = self.collectives.unique_id()
        session = Session(uuid.uuid4().hex, world_size)
        with self._lock:
            replaced = body.get("replaces")
            if isinstance(replaced, str):
                self.sessions.pop(replaced, None)  # its engine restarted: the communicator goes
            if len(self.sessions) >= MAX_SESSIONS:
                self.sessions.pop(next(iter(self.sessions)))  # the oldest
            self.sessions[session.id] = session
        threading.Thread(target=self._connect, args=(session, unique_id), name=f"nccl-join-{session.id[:8]}",
                         daemon=True).start()
        return {"session": session.id, "init_info": nccl.init_info(unique_id, world_size, self.buffer_bytes)}

    def _connect(self, session: Session, unique_id: bytes) -> None:
        try:
            session.comm = self.collectives.connect(session.world_size, unique_id)
            log.info("NCCL communicator %s up: rank 0 and %d engine workers", session.id[:8], session.world_size - 1)
        except Exception as e:  # noqa: BLE001 - said to the agent on its next send
            session.error = f"{type(e).__name__}: {e}"[:500]
            log.warning("NCCL communicator %s failed: %s", session.id[:8], session.error)
        finally:
            session.ready.set()

    def send(self, body: dict) -> dict:
        with self._lock:
            session = self.sessions.get(body.get("session"))  # type: ignore[arg-type]
        if session is None:
            raise RouteError(404, "no such NCCL session (rank 0 restarted, or it was replaced): join again")
        name = body.get("version")
        if not isinstance(name, str):
            raise RouteError(400, "version must name a version directory")
        if not session.ready.wait(self.init_timeout):
            raise RouteError(504, f"the engine's workers did not join within {self.init_timeout:.0f}s")
        if session.comm is None:
            raise RouteError(503, f"the NCCL communicator failed: {session.error}")
        tensors = self._tensors(name)
        directory = self._directory(name)
        # Every file opened before the first byte is sent: the next export removes this
        # directory, and an open file keeps its bytes until the send ends.
        handles = {t.file: open(directory / t.file, "rb") for t in tensors}
        try:
            plan = nccl.chunk_plan([t.nbytes for t in tensors], self.buffer_bytes)
            chunks = [[(Path(f"/proc/self/fd/{handles[tensors[i].file].fileno()}"), tensors[i].offset,
                        tensors[i].nbytes) for i in chunk] for chunk in plan]
            start = time.perf_counter()
            with self._send_lock:
                self.collectives.send(session.comm, chunks)
            seconds = time.perf_counter() - start
        except Exception as e:  # noqa: BLE001 - the communicator is unusable after a failed collective
            with self._lock:
                self.sessions.pop(session.id, None)
            raise RouteError(503, f"sending {name} over NCCL failed: {type(e).__name__}: {e}"[:1000]) from None
        finally:
            for f in handles.values():
                f.close()
        total = sum(t.nbytes for t in tensors)
        log.info("%s: %d bytes to engine %s over NCCL in %.2fs", name, total, session.id[:8], seconds)
        return {"bytes": total, "seconds": round(seconds, 4)}

    def _directory(self, name: str) -> Path:
        serving = self.fast.serving
        if serving is None or serving.name != name:
            raise RouteError(404, f"{name}: not the version rank 0 serves (a newer one replaced it)")
        return serving

    def _tensors(self, name: str) -> list[nccl.TensorMeta]:
        directory = self._directory(name)
        manifest = self.fast.manifest
        try:
            return nccl.version_tensors(directory, (manifest or {}).get("files") or {})
        except (OSError, ValueError) as e:
            raise RouteError(404, f"{name}: {e}") from None
