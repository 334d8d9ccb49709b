"""Container environment: env/envFrom, the downward API, Secret/ConfigMap reads, `$(VAR)`."""

from __future__ import annotations

import base64
import json
import math
import re
from typing import Any, Callable

from .api import _status_code
from .common import _ConfigError, _g


def expand(text: str, mapping: Callable[[str], str | None]) -> str:
    """Kubernetes `$(VAR)` expansion (k8s.io/kubernetes third_party/forked/golang/expansion).

    `$(VAR)` becomes the variable's value when defined and stays as written otherwise;
    `$$` is an escaped `$`; any other `$` (or an unterminated `$(`) is kept literally.
    """
    out: list[str] = []
    checkpoint = 0
    cursor = 0
    n = len(text)
    while cursor < n:
        if text[cursor] == "$" and cursor + 1 < n:
            out.append(text[checkpoint:cursor])
            nxt = text[cursor + 1]
            if nxt == "$":
                out.append("$")
                advance = 1
            elif nxt == "(":
                close = text.find(")", cursor + 2)
                if close == -1:
                    out.append("$(")
                    advance = 1
                else:
                    name = text[cursor + 2:close]
                    value = mapping(name)
                    out.append(value if value is not None else f"$({name})")
                    advance = close - cursor
            else:
                out.append("$" + nxt)
                advance = 1
            cursor += advance
            checkpoint = cursor + 1
        cursor += 1
    out.append(text[checkpoint:])
    return "".join(out)


_LABEL_REF = re.compile(r"""metadata\.(labels|annotations)\[['"](.+)['"]\]""")


def _format_map(values: dict[str, str]) -> str:
    """The downward API's `key="value"` lines for labels/annotations."""
    return "\n".join(f"{k}={json.dumps(v)}" for k, v in sorted(values.items()))


def field_value(pod: dict, path: str, pod_ip: str | None = None, host_ip: str | None = None) -> str:
    """The value of a downward-API fieldRef on `pod` (pod/host IP overridable)."""
    meta = pod.get("metadata") or {}
    m = _LABEL_REF.fullmatch(path)
    if m:
        return (meta.get(m.group(1)) or {}).get(m.group(2), "")
    pod_ip = pod_ip if pod_ip is not None else _g(pod, "status", "podIP", default="")
    host_ip = host_ip if host_ip is not None else _g(pod, "status", "hostIP", default="")
    simple = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""),
        "metadata.labels": _format_map(meta.get("labels") or {}),
        "metadata.annotations": _format_map(meta.get("annotations") or {}),
        "spec.nodeName": _g(pod, "spec", "nodeName", default=""),
        "spec.serviceAccountName": _g(pod, "spec", "serviceAccountName", default=""),
        "status.podIP": pod_ip,
        "status.podIPs": pod_ip,
        "status.hostIP": host_ip,
        "status.hostIPs": host_ip,
    }
    if path not in simple:
        raise _ConfigError(f"unsupported fieldRef fieldPath {path!r}")
    return simple[path]


def _parse_quantity(value: Any):
    from kubernetes.utils import parse_quantity  # Decimal

    return parse_quantity(str(value))


def resource_value(container: dict, ref: dict, node_allocatable: dict[str, str]) -> str:
    """A resourceFieldRef (limits.cpu, requests.memory, ...) like the kubelet renders it."""
    resource = ref["resource"]
    kind, _, name = resource.partition(".")
    value = _g(container, "resources", kind, name)
    if value is None and kind == "limits":
        value = node_allocatable.get(name)
    if value is None:
        value = "0"
    divisor = _parse_quantity(ref.get("divisor") or "1")
    if divisor == 0:
        divisor = _parse_quantity("1")
    return str(math.ceil(_parse_quantity(value) / divisor))


class _EnvMixin:
    """`_PodWorker`'s environment resolution and Secret/ConfigMap reads (also used by volumes)."""

    def _resolve_env(self, spec: dict) -> dict[str, str]:
        env: dict[str, str] = {}
        for src in spec.get("envFrom") or []:
            prefix = src.get("prefix") or ""
            if "configMapRef" in src:
                ref = src["configMapRef"]
                data = self._config_map(ref["name"], bool(ref.get("optional")), _ConfigError)
            elif "secretRef" in src:
                ref = src["secretRef"]
                data = self._secret(ref["name"], bool(ref.get("optional")), _ConfigError)
            else:
                continue
            for key, value in (data or {}).items():
                env[prefix + key] = value.decode(errors="replace")
        for item in spec.get("env") or []:
            name = item["name"]
            if "valueFrom" in item:
                value = self._value_from(item["valueFrom"], spec)
                if value is None:  # optional and missing
                    continue
            else:
                value = expand(item.get("value") or "", env.get)
            env[name] = value
        return env

    def _value_from(self, src: dict, container: dict) -> str | None:
        if "fieldRef" in src:
            return field_value(self.pod, src["fieldRef"]["fieldPath"], self.ip, self.runner.node_ip)
        if "resourceFieldRef" in src:
            return resource_value(container, src["resourceFieldRef"], self.runner.allocatable)
        for kind, getter in (("secretKeyRef", self._secret), ("configMapKeyRef", self._config_map)):
            if kind in src:
                ref = src[kind]
                optional = bool(ref.get("optional"))
                data = getter(ref["name"], optional, _ConfigError)
                if data is None:
                    return None
                if ref["key"] not in data:
                    if optional:
                        return None
                    what = "secret" if kind == "secretKeyRef" else "configmap"
                    raise _ConfigError(f"couldn't find key {ref['key']} in {what} {self.ns}/{ref['name']}")
                return data[ref["key"]].decode(errors="replace")
        raise _ConfigError(f"unsupported valueFrom {sorted(src)}")

    def _secret(self, name: str, optional: bool, error: type) -> dict[str, bytes] | None:
        obj = self._read("secrets", "secret", name, optional, error)
        return None if obj is None else {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}

    def _config_map(self, name: str, optional: bool, error: type) -> dict[str, bytes] | None:
        obj = self._read("configmaps", "configmap", name, optional, error)
        if obj is None:
            return None
        data = {k: v.encode() for k, v in (obj.get("data") or {}).items()}
        data.update({k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()})
        return data

    def _read(self, plural: str, what: str, name: str, optional: bool, error: type) -> dict | None:
        """The object, or None when it is missing and optional (else `error`)."""
        try:
            return self.api.get(f"/api/v1/namespaces/{self.ns}/{plural}/{name}")
        except Exception as e:  # noqa: BLE001
            if _status_code(e) == 404:
                if optional:
                    return None
                raise error(f'{what} "{name}" not found') from None
            raise
