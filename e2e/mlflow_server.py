"""A real MLflow tracking server (`mlflow server`: sqlite backend, local artifacts) for the
tests: the trainer's tests on 127.0.0.1, the end-to-end tests on the real node's bridge
gateway, where pods reach host services. Started on a free port, ready once `/health`
answers, stopped with its process group."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from .host import free_port, stop_group

START_TIMEOUT = 120.0


class MLflowServer:
    def __init__(self, root: Path, host: str = "127.0.0.1", port: int | None = None):
        self.root, self.host, self.port = Path(root), host, port or free_port()
        self.url = f"http://{host}:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.started_in: float | None = None  # seconds from start to healthy

    def start(self) -> "MLflowServer":
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / "server.log", "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{self.root}/mlflow.db",
                 "--artifacts-destination", str(self.root / "artifacts"), "--host", self.host,
                 "--port", str(self.port), "--workers", "1"],
                cwd=self.root, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        began = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited {self.proc.returncode}:\n{self.tail()}")
            if self._healthy():
                self.started_in = time.monotonic() - began
                return self
            if time.monotonic() - began > START_TIMEOUT:
                self.stop()
                raise RuntimeError(f"mlflow server not healthy after {START_TIMEOUT:.0f}s:\n{self.tail()}")
            time.sleep(0.2)  # polling /health

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        stop_group(self.proc, 20)

    def tail(self, lines: int = 40) -> str:
        path = self.root / "server.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def __enter__(self) -> "MLflowServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ---------------------------------------------------------------- its REST API

    def get(self, path: str, **query: Any) -> dict:
        with urllib.request.urlopen(f"{self.url}/api/2.0/mlflow/{path}?{urllib.parse.urlencode(query)}",
                                    timeout=10) as r:
            return json.loads(r.read())

    def post(self, path: str, body: dict) -> dict:
        request = urllib.request.Request(f"{self.url}/api/2.0/mlflow/{path}", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(request, timeout=10) as r:
            return json.loads(r.read())

    def runs(self, experiment: str) -> list[dict]:
        """Every run of the experiment named `experiment`."""
        found = self.get("experiments/get-by-name", experiment_name=experiment)["experiment"]
        return self.post("runs/search", {"experiment_ids": [found["experiment_id"]]}).get("runs") or []

    def history(self, run_id: str, key: str) -> list[dict]:
        return self.get("metrics/get-history", run_id=run_id, metric_key=key).get("metrics") or []
