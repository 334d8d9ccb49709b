"""A sync agent's side of the NCCL transport (`spec.sync.transport: nccl`; the protocol:
rft_contract.nccl; rank 0's side: rft_trainer.nccl_sender).

`NcclLink` keeps one vLLM engine's communicator with trainer rank 0: made on first use
(rank 0's `POST /nccl/join` with the engine's NCCL version, then vLLM's
/init_weight_transfer_engine, which returns once both sides are in it) and made again when
the engine restarted (its supervisor's count; the agent also `forget`s it when it sees the
engine lost its weights) or the trainer moved. `prepare` runs before the engine pauses and
ends with rank 0's plan for the version (a ticket that keeps its files open for the send).
A trainer without a GPU, an engine without the NCCL backend, NCCL versions that differ, or
a version rank 0 no longer serves raise `NcclUnavailable`: the engine is untouched, and the
agent loads the version from its files. A join that failed is not tried again for the same
engine process for JOIN_RETRY_SECONDS (a refused join costs rank 0 a thread).
Once the engine paused, `VLLMEngine.receive` does the transfer, and a failure there is
EngineBroken (a half-received model is never served: the agent restarts the engine).

NOT RUN HERE: no GPU, no NCCL on this machine. tests/trainer/test_nccl_protocol.py runs
these requests against vLLM 0.32.0's own router and request classes, with the NCCL calls
below it stood in for.
"""

from __future__ import annotations

import logging
import time
from typing import Any, NamedTuple

import requests

from .engines import SyncError

log = logging.getLogger("rft_serving.nccl")


JOIN_RETRY_SECONDS = 600.0


class NcclUnavailable(SyncError):
    """This version cannot come over NCCL; nothing in the engine changed."""


class Incoming(NamedTuple):
    """A version ready to come over NCCL: the link, rank 0's version directory, and
    vLLM's update_info for it."""

    link: "NcclLink"
    name: str
    update_info: dict
    ticket: str


class NcclLink:
    def __init__(self, timeout: float = 600.0):
        self.timeout = timeout
        self.peer: str | None = None  # rank 0's weights server the session belongs to
        self.session: str | None = None
        self.restarts: int | None = None  # the engine's restart count when it joined
        # The last join that failed: (peer, restart count, monotonic time, why).
        self.failed: tuple[str, int | None, float, str] | None = None

    def prepare(self, engine, peer: str, name: str) -> Incoming:
        """The communicator (joined if there is none for this engine process and this
        trainer) and rank 0's plan for the version."""
        restarts = engine.restarts()
        restarted = restarts is not None and restarts != self.restarts  # None: the supervisor did not say
        if self.session is None or self.peer != peer or restarted:
            if self.failed is not None and self.failed[:2] == (peer, restarts) \
                    and time.monotonic() - self.failed[2] < JOIN_RETRY_SECONDS:
                raise NcclUnavailable(self.failed[3])
            try:
                self._join(engine, peer)
            except NcclUnavailable as e:
                self.failed = (peer, restarts, time.monotonic(), str(e))
                raise
            self.failed, self.restarts = None, restarts
        plan = self._call("POST", "/nccl/plan", {"session": self.session, "version": name})
        if not isinstance(plan.get("update_info"), dict) or not isinstance(plan.get("ticket"), str):
            raise NcclUnavailable(f"rank 0's plan for {name} has no update_info and ticket")
        return Incoming(self, name, plan["update_info"], plan["ticket"])

    def _join(self, engine, peer: str) -> None:
        try:
            workers, version = engine.world_size(), engine.nccl_version()
        except SyncError as e:
            raise NcclUnavailable(f"the engine did not say its workers and NCCL version: {e}") from None
        old, self.session, self.peer = self.session, None, peer
        answer = self._call("POST", "/nccl/join", {"world_size": 1 + workers, "replaces": old,
                                                   "nccl_version": version})
        if not isinstance(answer.get("init_info"), dict) or not isinstance(answer.get("session"), str):
            raise NcclUnavailable(f"rank 0 answered /nccl/join without a session: {str(answer)[:200]}")
        try:
            engine.init_transfer(answer["init_info"])  # returns once the communicator is up
        except SyncError as e:
            raise NcclUnavailable(f"vLLM did not join rank 0's NCCL communicator: {e}") from None
        self.session = answer["session"]
        log.info("NCCL communicator with trainer rank 0 up (%d engine workers)", workers)

    def send(self, incoming: Incoming) -> dict:
        """Rank 0 broadcasts the planned version (while the engine's /update_weights receives)."""
        return self._call("POST", "/nccl/send", {"session": self.session, "ticket": incoming.ticket})

    def forget(self) -> None:
        """The engine restarts, or a transfer failed: join again next time."""
        self.session = None

    def _call(self, method: str, path: str, body: dict | None = None) -> Any:
        try:
            r = requests.request(method, self.peer + path, json=body, timeout=self.timeout)
        except requests.RequestException as e:
            raise NcclUnavailable(f"trainer rank 0 {path}: {type(e).__name__}") from None
        if r.status_code == 404 and r.text == "not found":
            raise NcclUnavailable("trainer rank 0 does not send over NCCL (no GPU there, or an older trainer image)")
        if r.status_code >= 400:
            raise NcclUnavailable(f"trainer rank 0 {path}: HTTP {r.status_code} {r.text[:300]}")
        try:
            out = r.json()
        except ValueError:
            raise NcclUnavailable(f"trainer rank 0 {path}: not JSON") from None
        if not isinstance(out, dict):
            raise NcclUnavailable(f"trainer rank 0 {path}: not a JSON object")
        return out
