"""Pod volumes: emptyDir, hostPath, configMap, secret, downwardAPI, projected (SA tokens)."""

from __future__ import annotations

import datetime as dt
import time
from pathlib import Path

from .api import _status_code
from .common import _VolumeError, _g, _kv, _safe_rel, _write_file, log
from .env import field_value, resource_value

MIN_TOKEN_SECONDS = 600
SHM = Path("/dev/shm")


class _VolumesMixin:
    """`_PodWorker`'s volume materialisation under its pod directory and token refreshes."""

    def _setup_volumes(self) -> None:
        paths: dict[str, Path] = {}
        self.tokens = []
        for vol in (self.pod.get("spec") or {}).get("volumes") or []:
            paths[vol["name"]] = self._materialise(vol)
        self.volume_paths = paths

    def _materialise(self, vol: dict) -> Path:
        name = vol["name"]
        target = self.dir / "volumes" / name
        if "emptyDir" in vol:
            if (vol["emptyDir"] or {}).get("medium") == "Memory" and SHM.is_dir():
                target = SHM / "podrunner" / self.uid / name
                if target.parent not in self.shm_dirs:
                    self.shm_dirs.append(target.parent)
            target.mkdir(parents=True, exist_ok=True)
            return target
        if "hostPath" in vol:
            hp = vol["hostPath"]
            path = Path(hp["path"])
            kind = hp.get("type") or ""
            if kind == "DirectoryOrCreate":
                path.mkdir(parents=True, exist_ok=True)
            elif kind == "FileOrCreate" and not path.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                path.touch()
            if not path.exists():
                raise _VolumeError(f"hostPath {path} does not exist")
            return path
        target.mkdir(parents=True, exist_ok=True)
        if "configMap" in vol or "secret" in vol:
            self._write_source(target, vol, int(_g(vol, "configMap" if "configMap" in vol else "secret",
                                                    "defaultMode", default=0o644)))
            return target
        if "downwardAPI" in vol:
            self._write_downward(target, vol["downwardAPI"].get("items") or [],
                                 int(vol["downwardAPI"].get("defaultMode") or 0o644))
            return target
        if "projected" in vol:
            proj = vol["projected"]
            mode = int(proj.get("defaultMode") or 0o644)
            for src in proj.get("sources") or []:
                if "serviceAccountToken" in src:
                    tok = src["serviceAccountToken"]
                    entry = {"path": target / _safe_rel(tok["path"]), "mode": mode,
                             "audience": tok.get("audience") or "",
                             "seconds": max(MIN_TOKEN_SECONDS, int(tok.get("expirationSeconds") or 3600)),
                             "refresh_at": 0.0}
                    self._write_token(entry)
                    self.tokens.append(entry)
                elif "configMap" in src or "secret" in src:
                    self._write_source(target, src, mode)
                elif "downwardAPI" in src:
                    self._write_downward(target, src["downwardAPI"].get("items") or [], mode)
                else:
                    raise _VolumeError(f"volume {name}: unsupported projected source {sorted(src)}")
            return target
        kinds = sorted(k for k in vol if k != "name")
        raise _VolumeError(f"volume {name}: type {', '.join(kinds)} is not supported by the pod runner")

    def _write_source(self, target: Path, src: dict, default_mode: int) -> None:
        """A configMap or secret (volume or projected source) as files."""
        if "configMap" in src:
            ref = src["configMap"]
            data = self._config_map(ref["name"], bool(ref.get("optional")), _VolumeError)
        else:
            ref = src["secret"]
            data = self._secret(ref.get("secretName") or ref.get("name"), bool(ref.get("optional")),
                                _VolumeError)
        if data is None:
            return  # optional and absent: empty
        items = ref.get("items")
        if items is None:
            items = [{"key": k, "path": k} for k in data]
        for item in items:
            if item["key"] not in data:
                if ref.get("optional"):
                    continue
                raise _VolumeError(f"couldn't find key {item['key']} in {ref.get('name') or ref.get('secretName')}")
            _write_file(target / _safe_rel(item["path"]), data[item["key"]],
                        int(item.get("mode") or default_mode))

    def _write_downward(self, target: Path, items: list, default_mode: int) -> None:
        for item in items:
            if "fieldRef" in item:
                value = field_value(self.pod, item["fieldRef"]["fieldPath"], self.ip, self.runner.node_ip)
            elif "resourceFieldRef" in item:
                ref = item["resourceFieldRef"]
                container = next((c for c in (self.pod.get("spec") or {}).get("containers") or []
                                  if c["name"] == ref.get("containerName")), {})
                value = resource_value(container, ref, self.runner.allocatable)
            else:
                continue
            _write_file(target / _safe_rel(item["path"]), value.encode(), int(item.get("mode") or default_mode))

    def _write_token(self, entry: dict) -> None:
        spec = self.pod.get("spec") or {}
        sa = spec.get("serviceAccountName") or "default"
        body = {
            "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
            "spec": {
                "expirationSeconds": entry["seconds"],
                "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": self.pod_name, "uid": self.uid},
            },
        }
        if entry["audience"]:
            body["spec"]["audiences"] = [entry["audience"]]
        try:
            resp = self.api.post(f"/api/v1/namespaces/{self.ns}/serviceaccounts/{sa}/token", body)
        except Exception as e:  # noqa: BLE001
            raise _VolumeError(f"cannot get a token for ServiceAccount {self.ns}/{sa}: "
                               f"{_status_code(e) or type(e).__name__}") from None
        _write_file(entry["path"], resp["status"]["token"].encode(), entry["mode"])
        lifetime = entry["seconds"]
        try:
            expires = dt.datetime.fromisoformat(resp["status"]["expirationTimestamp"].replace("Z", "+00:00"))
            lifetime = max(60.0, (expires - dt.datetime.now(dt.timezone.utc)).total_seconds())
        except (KeyError, ValueError, TypeError):
            pass
        entry["refresh_at"] = time.monotonic() + 0.8 * lifetime

    def _refresh_tokens(self) -> None:
        now = time.monotonic()
        for entry in self.tokens:
            if now >= entry["refresh_at"]:
                try:
                    self._write_token(entry)
                    log.info(_kv("pod.token_refreshed", pod=f"{self.ns}/{self.pod_name}", path=entry["path"]))
                except _VolumeError as e:
                    log.warning(_kv("pod.token_refresh_failed", pod=f"{self.ns}/{self.pod_name}", error=e))
                    entry["refresh_at"] = now + 10
