"""One thread per pod: volumes, then init containers, then containers; phase; deletion."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from .common import CONFIG_RETRY_S, TERMINAL, _ConfigError, _VolumeError, _g, _kv, _now, _write_in_place, log
from .env import _EnvMixin
from .probes import _ProbesMixin
from .process import _Container, _ContainersMixin
from .status import _StatusMixin
from .volumes import _VolumesMixin

if TYPE_CHECKING:
    from .runner import PodRunner

TICK_S = 0.2
STOP_GRACE_S = 2.0  # runner stop: SIGTERM, this long, SIGKILL


class _PodWorker(_ContainersMixin, _EnvMixin, _VolumesMixin, _ProbesMixin, _StatusMixin,
                 threading.Thread):
    """Runs one pod: volumes, containers, probes, status, termination (facets in the mixins)."""

    def __init__(self, runner: "PodRunner", pod: dict, ip: str):
        meta = pod["metadata"]
        super().__init__(name=f"pod-{meta['namespace']}/{meta['name']}", daemon=True)
        self.runner = runner
        self.api = runner._api
        self.pod = pod
        self.uid: str = meta["uid"]
        self.ns: str = meta["namespace"]
        self.pod_name: str = meta["name"]
        self.ip = ip
        self.dir = runner.pods_dir / f"{self.ns}_{self.pod_name}_{self.uid}"
        self.hosts_path = self.dir / "etc-hosts"
        spec = pod.get("spec") or {}
        self.hostname = (spec.get("hostname") or self.pod_name)[:63].rstrip("-.")
        self.subdomain = spec.get("subdomain") or ""
        self.restart_policy = spec.get("restartPolicy") or "Always"
        has_init = bool(spec.get("initContainers"))
        self.inits = [_Container(c, True, "PodInitializing") for c in spec.get("initContainers") or []]
        self.mains = [_Container(c, False, "PodInitializing" if has_init else "ContainerCreating")
                      for c in spec.get("containers") or []]
        if has_init:
            self.inits[0].state = {"waiting": {"reason": "PodInitializing"}}
        self.start_time = _now()
        self.volume_paths: dict[str, Path] = {}
        self.volumes_ready = False
        self.volume_error: str | None = None
        self.next_volume_try = 0.0
        self.shm_dirs: list[Path] = []
        self.tokens: list[dict] = []
        self.init_idx = 0
        self.initialized = not has_init
        self.init_failed = False
        self.phase = "Pending"
        self.terminal = False
        self.ready = False
        self.cond_times: dict[str, tuple[str, str]] = {}
        self.last_published: dict | None = None
        self.next_publish_try = 0.0
        self.wake = threading.Event()
        self.delete_deadline: float | None = None  # set when the API deletes the pod
        self.removed = False  # pod object gone without our final delete
        self.stopping = False  # runner stops
        self.finished = threading.Event()  # thread done
        self._hosts_content: bytes | None = None

    # -- control (called from other threads)

    def update(self, pod: dict) -> None:
        self.pod = pod
        meta = pod.get("metadata") or {}
        if meta.get("deletionTimestamp"):
            grace = meta.get("deletionGracePeriodSeconds")
            if grace is None:
                grace = _g(pod, "spec", "terminationGracePeriodSeconds", default=30)
            deadline = time.monotonic() + max(0, int(grace))
            if self.delete_deadline is None or deadline < self.delete_deadline:
                self.delete_deadline = deadline
        self.wake.set()

    def remove(self) -> None:
        self.removed = True
        self.wake.set()

    def stop(self) -> None:
        self.stopping = True
        self.wake.set()

    @property
    def live(self) -> bool:
        """Holds an IP and appears in DNS."""
        return not self.terminal and not self.finished.is_set() and self.delete_deadline is None

    def write_hosts(self, content: str) -> None:
        data = content.encode()
        if data == self._hosts_content:
            return
        try:
            _write_in_place(self.hosts_path, data, create=True)
            self._hosts_content = data
        except OSError:
            pass  # being cleaned up

    # -- main loop

    def run(self) -> None:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self.runner._refresh_hosts()  # creates this pod's hosts file
            log.info(_kv("pod.start", pod=f"{self.ns}/{self.pod_name}", ip=self.ip, uid=self.uid))
            while True:
                self.wake.clear()
                if self.stopping:
                    self._kill_all(STOP_GRACE_S)
                    self._remove_shm()
                    return
                if self.removed:
                    self._kill_all(0)
                    self._cleanup()
                    log.info(_kv("pod.removed", pod=f"{self.ns}/{self.pod_name}"))
                    return
                if self.delete_deadline is not None:
                    self._terminate_and_delete()
                    return
                if not self.terminal:
                    self._step()
                self._publish()
                self.wake.wait(1.0 if self.terminal else TICK_S)
        except Exception:  # noqa: BLE001
            log.exception(_kv("pod.worker_crashed", pod=f"{self.ns}/{self.pod_name}"))
            self._kill_all(0)
        finally:
            self.finished.set()
            self.runner._worker_done(self)

    def _step(self) -> None:
        now = time.monotonic()
        if not self.volumes_ready:
            if now < self.next_volume_try:
                return
            try:
                self._setup_volumes()
                self.volumes_ready = True
                self.volume_error = None
            except (_VolumeError, _ConfigError) as e:
                self._volume_failed(str(e), now)
                return
            except Exception as e:  # noqa: BLE001 - API errors etc.: retry
                self._volume_failed(f"{type(e).__name__}: {e}", now)
                return
        self._refresh_tokens()
        if not self.initialized:
            c = self.inits[self.init_idx]
            self._step_container(c, now)
            if c.done:
                if c.exit_code == 0:
                    self.init_idx += 1
                    if self.init_idx == len(self.inits):
                        self.initialized = True
                        for m in self.mains:
                            m.state = {"waiting": {"reason": "ContainerCreating"}}
                    else:
                        self.inits[self.init_idx].state = {"waiting": {"reason": "PodInitializing"}}
                else:
                    self.init_failed = True
            if not self.initialized:
                self._update_phase()
                return
        for c in self.mains:
            self._step_container(c, now)
        for c in self.mains:
            self._probe(c, now)
        self._update_phase()

    def _volume_failed(self, message: str, now: float) -> None:
        if message != self.volume_error:
            log.warning(_kv("pod.volume_setup_failed", pod=f"{self.ns}/{self.pod_name}", error=message))
        self.volume_error = message
        self.next_volume_try = now + CONFIG_RETRY_S
        for c in (self.inits[:1] if self.inits else self.mains):
            c.state = {"waiting": {"reason": "ContainerCreating", "message": message}}

    def _update_phase(self) -> None:
        old_ready = self.ready
        if self.init_failed:
            phase = "Failed"
        elif not self.initialized:
            phase = "Pending"
        elif self.mains and all(c.done for c in self.mains):
            phase = "Succeeded" if all(c.exit_code == 0 for c in self.mains) else "Failed"
        elif any(c.ever_started for c in self.mains):
            phase = "Running"
        else:
            phase = "Pending"
        if phase != self.phase:
            log.info(_kv("pod.phase", pod=f"{self.ns}/{self.pod_name}", phase=phase))
        self.phase = phase
        self.ready = phase == "Running" and all(c.ready for c in self.mains)
        if phase in TERMINAL:
            self.terminal = True
            self.ready = False
            for c in self.inits + self.mains:  # containers that never ran
                if not c.done and c.proc is None and "waiting" in c.state:
                    c.done = True
            self._remove_shm()
            self.runner._release_ip(self)
        if self.ready != old_ready or self.terminal:
            self.runner._refresh_hosts()

    # -- termination

    def _terminate_and_delete(self) -> None:
        grace = max(0.0, self.delete_deadline - time.monotonic())
        log.info(_kv("pod.terminate", pod=f"{self.ns}/{self.pod_name}", grace=f"{grace:.0f}s"))
        self.ready = False
        self.runner._release_ip(self)
        self.runner._refresh_hosts()
        self._kill_all(grace)
        self._update_phase_after_kill()
        self._publish(force=True)
        self._cleanup()
        self.runner._final_delete(self.ns, self.pod_name, self.uid)

    def _update_phase_after_kill(self) -> None:
        if self.phase in TERMINAL or not self.mains:
            return
        if all(c.done for c in self.mains):
            self.phase = "Succeeded" if all(c.exit_code == 0 for c in self.mains) else "Failed"
        self.terminal = True

    def _remove_shm(self) -> None:
        for d in self.shm_dirs:
            shutil.rmtree(d, ignore_errors=True)

    def _cleanup(self) -> None:
        self._remove_shm()
        self.runner._release_ip(self)
        shutil.rmtree(self.dir, ignore_errors=True)
        self.runner._refresh_hosts()
