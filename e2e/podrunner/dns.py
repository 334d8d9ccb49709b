"""DNS through /etc/hosts: each live pod's hosts file from pods and headless Services."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .common import _g

if TYPE_CHECKING:
    from .worker import _PodWorker


def build_hosts_files(workers: list[_PodWorker],
                      services: list[tuple[tuple[str, str], dict]]) -> list[tuple[_PodWorker, str]]:
    """The hosts file of each of `workers` (the live pods), given `((namespace, name), Service)` pairs."""
    entries: list[tuple[str, str, list[str], list[str]]] = []
    for w in workers:
        if w.subdomain:
            base = f"{w.hostname}.{w.subdomain}.{w.ns}"
            entries.append((w.ip, w.ns, [f"{base}.svc.cluster.local", f"{base}.svc", base],
                            [f"{w.hostname}.{w.subdomain}"]))
    for (ns, name), svc in sorted(services, key=lambda kv: kv[0]):
        spec = svc.get("spec") or {}
        selector = spec.get("selector") or {}
        if spec.get("clusterIP") != "None" or not selector:
            continue
        for w in workers:
            labels = _g(w.pod, "metadata", "labels", default={})
            if w.ns == ns and (w.ready or spec.get("publishNotReadyAddresses")) and all(
                    labels.get(k) == v for k, v in selector.items()):
                entries.append((w.ip, ns, [f"{name}.{ns}.svc.cluster.local", f"{name}.{ns}.svc",
                                           f"{name}.{ns}"], [name]))
    files = []
    for w in workers:
        lines = ["# Managed by the pod runner (e2e/podrunner/).",
                 "127.0.0.1\tlocalhost", "::1\tip6-localhost ip6-loopback"]
        own = [f"{w.hostname}.{w.subdomain}.{w.ns}.svc.cluster.local"] if w.subdomain else []
        lines.append(f"{w.ip}\t{' '.join(own + [w.hostname])}")
        for alias in _g(w.pod, "spec", "hostAliases", default=[]):
            if alias.get("ip") and alias.get("hostnames"):
                lines.append(f"{alias['ip']}\t{' '.join(alias['hostnames'])}")
        for ip, ns, names, short in entries:
            lines.append(f"{ip}\t{' '.join(names + (short if ns == w.ns else []))}")
        files.append((w, "\n".join(lines) + "\n"))
    return files
