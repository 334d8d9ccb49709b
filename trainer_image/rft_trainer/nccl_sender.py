"""Trainer rank 0's side of vLLM's NCCL weight transfer (`spec.sync.transport: nccl`;
the protocol and its sources: rft_contract.nccl).

Served on rank 0's weights server (the fast path's `PeerServer`, `routes`), one NCCL
communicator per engine, made when that engine's sync agent asks:

    POST /nccl/join {"world_size": 1 + the engine's workers, "nccl_version": [2, 29, 7]}
        -> {"session": id, "init_info": {...}}: rank 0 makes a unique id and joins the
           communicator on a thread of its own; the agent hands `init_info` to vLLM's
           /init_weight_transfer_engine, whose workers join it. An engine whose NCCL is not
           rank 0's is refused (409): NCCL does not make a communicator of mixed versions.
    POST /nccl/plan {"session": id, "version": <version dir>}
        -> {"ticket": id, "update_info": {...}}: the names, dtypes and shapes of the version
           rank 0 serves, for vLLM's /update_weights. The ticket holds the version's files
           open: a newer export that replaces the directory meanwhile cannot make the send
           that follows refuse, once the engine waits for it.
    POST /nccl/send {"session": id, "ticket": id}
        -> {"bytes": n, "seconds": s} once rank 0 broadcast every byte of that version
           (while vLLM's /update_weights, which the agent called, receives them)

What is sent is read from the version's files as exported (the ones the manifest hashes,
which the fast path serves), not from the live parameters: training goes on meanwhile,
and the engine's fingerprint check compares what arrived with what the export recorded.
Rank 0 sends to one engine at a time on that communicator's CUDA stream, through one
buffer of the largest chunk (`rft_contract.nccl.BUFFER_BYTES`, or one tensor larger than
that), freed after the send. Each chunk must complete within `send_timeout`: torch has no
way to abort an NCCL communicator, so a send whose engine went away is given up (504), its
communicator dropped (its kernel may stay queued on that stream until rank 0 exits), and
the agent restarts its engine.

Bounds, since the port is reachable from the pod network without authentication (like the
files it serves; a NetworkPolicy should admit the job's inference pods only, docs/rl-loop.md):
at most MAX_SESSIONS communicators and MAX_PENDING joins not yet complete (503 beyond).

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
from typing import Any, BinaryIO, Protocol

from rft_contract import nccl
from rft_contract.relay import RouteError

log = logging.getLogger("rft_trainer.nccl")

INIT_TIMEOUT_SECONDS = 300.0  # for the engine's workers to join a communicator
SEND_TIMEOUT_SECONDS = 300.0  # for one chunk's broadcast to complete
MAX_SESSIONS = 64  # engines with a communicator at once (each holds NCCL buffers)
MAX_PENDING = 8  # joins whose communicator is not up yet


class Collectives(Protocol):
    """The NCCL calls rank 0 makes (`TorchNccl` on a GPU)."""

    def version(self) -> list[int]: ...
    def unique_id(self) -> bytes: ...
    def connect(self, world_size: int, unique_id: bytes) -> Any: ...
    def send(self, comm: Any, chunks: list[list[tuple[BinaryIO, int, int]]], timeout: float) -> None: ...


class TorchNccl:
    """`torch.cuda.nccl`: a communicator of rank 0 with the engine's workers, from a unique
    id (no TCP store: the workers take the id from `init_info`), with a CUDA stream of its own."""

    def __init__(self, device):
        import torch

        self.torch, self.device = torch, device

    def version(self) -> list[int]:
        return list(self.torch.cuda.nccl.version())

    def unique_id(self) -> bytes:
        return self.torch.cuda.nccl.unique_id()

    def connect(self, world_size: int, unique_id: bytes) -> Any:
        torch = self.torch
        with torch.cuda.device(self.device):
            stream = torch.cuda.Stream(device=self.device)
            comm = torch.cuda.nccl.init_rank(world_size, unique_id, 0)  # blocks until every rank joined
            warm = torch.zeros(1, dtype=torch.float32, device=self.device)  # the workers' warm-up all-reduce
            torch.cuda.nccl.all_reduce([warm], streams=[stream], comms=[comm])
            stream.synchronize()
        return (comm, stream)

    def send(self, comm: Any, chunks: list[list[tuple[BinaryIO, int, int]]], timeout: float) -> None:
        """Each chunk's byte ranges (open file, offset, length), copied into one uint8 buffer
        on the GPU and broadcast from rank 0; each broadcast must end within `timeout`."""
        torch = self.torch
        nccl_comm, stream = comm
        size = max(sum(n for _, _, n in chunk) for chunk in chunks)
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            buf = torch.empty(size, dtype=torch.uint8, device=self.device)
            try:
                for chunk in chunks:
                    at = 0
                    for f, offset, n in chunk:
                        host = torch.from_file(f"/proc/self/fd/{f.fileno()}", size=offset + n,
                                               dtype=torch.uint8)[offset:]
                        buf[at:at + n].copy_(host)
                        at += n
                    torch.cuda.nccl.broadcast([buf[:at]], root=0, streams=[stream], comms=[nccl_comm])
                    deadline = time.monotonic() + timeout
                    while not stream.query():  # before the buffer is filled again
                        if time.monotonic() > deadline:
                            raise TimeoutError(f"a broadcast did not complete within {timeout:.0f}s")
                        time.sleep(0.005)
            finally:
                del buf


@dataclass
class Ticket:
    id: str
    name: str
    tensors: list[nccl.TensorMeta]
    files: dict[str, BinaryIO]

    def close(self) -> None:
        for f in self.files.values():
            f.close()


@dataclass
class Session:
    id: str
    world_size: int
    ready: threading.Event = field(default_factory=threading.Event)
    comm: Any = None
    error: str = ""
    ticket: Ticket | None = None


class NcclSender:
    """The routes above on `fast.server`. `collectives`: TorchNccl on rank 0's GPU."""

    def __init__(self, fast, collectives: Collectives, buffer_bytes: int = nccl.BUFFER_BYTES,
                 init_timeout: float = INIT_TIMEOUT_SECONDS, send_timeout: float = SEND_TIMEOUT_SECONDS):
        self.fast, self.collectives = fast, collectives
        self.buffer_bytes, self.init_timeout, self.send_timeout = buffer_bytes, init_timeout, send_timeout
        self.sessions: dict[str, Session] = {}
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()  # one engine at a time: one buffer in GPU memory
        fast.server.routes[("POST", "nccl")] = self._post

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
        body = body or {}
        if rest == "join":
            return self.join(body)
        if rest == "plan":
            return self.plan(body)
        if rest == "send":
            return self.send(body)
        raise RouteError(404, f"no route /nccl/{rest}")

    def join(self, body: dict) -> dict:
        try:
            world_size = nccl.check_world_size(body.get("world_size"))
        except ValueError as e:
            raise RouteError(400, str(e)) from None
        ours, theirs = self.collectives.version(), body.get("nccl_version")
        if isinstance(theirs, list) and list(theirs) != list(ours):
            raise RouteError(409, f"NCCL {_dotted(theirs)} in the engine, {_dotted(ours)} on trainer rank 0: NCCL makes "
                                  "no communicator of mixed versions (use a trainer image and an engine image "
                                  "with the same NCCL)")
        with self._lock:
            replaced = self.sessions.pop(body["replaces"], None) if isinstance(body.get("replaces"), str) else None
            if replaced is not None and replaced.ticket is not None:
                replaced.ticket.close()
            if len(self.sessions) >= MAX_SESSIONS:
                raise RouteError(503, f"rank 0 holds {MAX_SESSIONS} NCCL communicators already")
            if sum(not s.ready.is_set() for s in self.sessions.values()) >= MAX_PENDING:
                raise RouteError(503, f"{MAX_PENDING} NCCL communicators are being made already; try again")
            unique_id = self.collectives.unique_id()
            session = Session(uuid.uuid4().hex, world_size)
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

    def plan(self, body: dict) -> dict:
        """The version's update_info, and a ticket that holds its files open for the send."""
        session = self._session(body)
        name = body.get("version")
        if not isinstance(name, str):
            raise RouteError(400, "version must name a version directory")
        serving = self.fast.serving
        if serving is None or serving.name != name:
            raise RouteError(404, f"{name}: not the version rank 0 serves (a newer one replaced it)")
        try:
            tensors = nccl.version_tensors(serving, (self.fast.manifest or {}).get("files") or {})
            files = {t.file: open(serving / t.file, "rb") for t in tensors}  # noqa: SIM115 - closed with the ticket
        except (OSError, ValueError) as e:
            raise RouteError(404, f"{name}: {e}") from None
        ticket = Ticket(uuid.uuid4().hex, name, tensors, files)
        with self._lock:
            old, session.ticket = session.ticket, ticket
        if old is not None:
            old.close()
        return {"ticket": ticket.id, "update_info": nccl.update_info(tensors)}

    def send(self, body: dict) -> dict:
        session = self._session(body)
        with self._lock:
            ticket = session.ticket
            if ticket is None or ticket.id != body.get("ticket"):
                raise RouteError(404, "no such ticket: ask for the plan again")
            session.ticket = None
        try:
            if not session.ready.wait(self.init_timeout):
                raise RouteError(504, f"the engine's workers did not join within {self.init_timeout:.0f}s")
            if session.comm is None:
                raise RouteError(503, f"the NCCL communicator failed: {session.error}")
            tensors = ticket.tensors
            plan = nccl.chunk_plan([t.nbytes for t in tensors], self.buffer_bytes)
            chunks = [[(ticket.files[tensors[i].file], tensors[i].offset, tensors[i].nbytes) for i in chunk]
                      for chunk in plan]
            start = time.perf_counter()
            with self._send_lock:
                self.collectives.send(session.comm, chunks, self.send_timeout)
            seconds = time.perf_counter() - start
        except RouteError:
            self._drop(session)
            raise
        except Exception as e:  # noqa: BLE001 - after a failed collective the communicator is unusable
            self._drop(session)
            raise RouteError(503 if not isinstance(e, TimeoutError) else 504,
                             f"sending {ticket.name} over NCCL failed: {type(e).__name__}: {e}"[:1000]) from None
        finally:
            ticket.close()
        total = sum(t.nbytes for t in tensors)
        log.info("%s: %d bytes to engine %s over NCCL in %.2fs", ticket.name, total, session.id[:8], seconds)
        return {"bytes": total, "seconds": round(seconds, 4)}

    def _session(self, body: dict) -> Session:
        with self._lock:
            session = self.sessions.get(body.get("session"))  # type: ignore[arg-type]
        if session is None:
            raise RouteError(404, "no such NCCL session (rank 0 restarted, or it was replaced): join again")
        return session

    def _drop(self, session: Session) -> None:
        with self._lock:
            self.sessions.pop(session.id, None)


def _dotted(version: Any) -> str:
    return ".".join(str(x) for x in version) if isinstance(version, (list, tuple)) else str(version)
