"""Fixtures for end-to-end tests: the integration tests' local cluster plus its real node
`local` (e2e/node.py: containerd, kubelet, kube-proxy, CoreDNS), which pulls this
repository's images (`make images`) from the local registry."""

from __future__ import annotations

import contextlib
import http.server
import json
import threading

import pytest

from e2e import demo
from e2e import node as real_node
from e2e.cluster import ExistingCluster, free_port
from e2e.registry import DEFAULT_STATE_DIR as IMAGES_STATE_DIR
from e2e.registry import Registry
from tests.trainer.faultproxy import FaultProxy


@pytest.fixture(scope="session")
def registry_address() -> str:
    """The local registry `make images` pushed to (started again if it was stopped)."""
    registry = Registry(IMAGES_STATE_DIR)
    registry.ensure()
    return registry.address


@pytest.fixture(scope="session")
def images(registry_address) -> dict[str, str]:
    """image -> reference by digest under the registry's stable name, from `make images`."""
    path = IMAGES_STATE_DIR / "images.json"
    if not path.exists():
        raise AssertionError(f"{path} is missing: build the images first with `make images`")
    built = json.loads(path.read_text())
    return {name: f"{real_node.REGISTRY_HOST}/{ref['repository']}@{ref['digest']}"
            for name, ref in built.items()}


@pytest.fixture(scope="module")
def node(cluster, registry_address):
    """The real node, Ready (started on first use; a module may have stopped it)."""
    if isinstance(cluster, ExistingCluster):
        pytest.skip("the real node is started with the cluster this session owns "
                    "(with RFT_KUBECONFIG, use a cluster that has node `local`)")
    cluster.start_node(registry=registry_address)
    return real_node.NODE_NAME


@pytest.fixture
def host_http(node):
    """An HTTP server on the host, at the bridge gateway where pods reach host services
    (as the demo's S3 server)."""
    class Hello(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = b"host says hi"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer((real_node.GATEWAY, free_port()), Hello)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://{real_node.GATEWAY}:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


@contextlib.contextmanager
def s3_for_pods(s3_server: str, bucket: str, num_tasks: int):
    """The session's S3 server behind a fault proxy on the node's bridge gateway, where
    pods reach it, with the tiny model and a taskset in `bucket`."""
    proxy = FaultProxy(s3_server, host=real_node.GATEWAY).start()
    try:
        demo.prepare_data(proxy.url, bucket=bucket, num_tasks=num_tasks)
        yield proxy
    finally:
        proxy.stop()
