"""The real node `local` (e2e/node.py): containerd + runc + bridge CNI, the kubelet,
kube-proxy and CoreDNS, running pods from this repository's images pulled from the local
registry under the restricted Pod Security profile.

These tests check what the project relies on from the node (registration, images by
digest, the in-cluster API through the `kubernetes` Service, headless-Service DNS for the
trainer rendezvous, host services through the bridge gateway, logs and exec through the
API server, graceful deletion), and that stopping the node leaves the host as it was.
Waits poll the API with timeouts; nothing sleeps to synchronise.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
import threading
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import NameOID

from e2e import node as real_node
from tests.conftest import wait_for

pytestmark = pytest.mark.e2e


# --------------------------------------------------------------------------- helpers


def restricted(container: dict) -> dict:
    """The restricted profile, as the operator renders it for its pods."""
    container.setdefault("securityContext", {
        "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]}})
    return container


def pod_manifest(name: str, image: str, script: str, **spec) -> dict:
    container = restricted({"name": "main", "image": image, "imagePullPolicy": "IfNotPresent",
                            "command": ["python3", "-c", textwrap.dedent(script)]})
    container.update(spec.pop("container", {}))
    labels = spec.pop("labels", {})
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 5,
            "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000,
                                "seccompProfile": {"type": "RuntimeDefault"}},
            "nodeSelector": {real_node.LOCAL_NODE_LABEL: "true"},
            "tolerations": [{"key": real_node.LOCAL_TAINT["key"], "operator": "Exists",
                             "effect": "NoSchedule"}],
            "containers": [container],
            **spec,
        },
    }


def create(kubectl, namespace: str, *objects: dict) -> None:
    kubectl("create", "-n", namespace, "-f", "-",
            input=json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objects)}))


def wait_phase(kubectl_json, namespace: str, name: str, phases: tuple[str, ...], timeout: float = 60) -> dict:
    def done():
        pod = kubectl_json("get", "pod", name, "-n", namespace)
        return pod if pod.get("status", {}).get("phase") in phases else None
    return wait_for(done, timeout, f"pod {namespace}/{name} in phase {phases}")


def logs(kubectl, namespace: str, name: str) -> str:
    return kubectl("logs", name, "-n", namespace, check=False).stdout


def last_json_line(text: str) -> dict:
    return json.loads([line for line in text.splitlines() if line.startswith("{")][-1])


# --------------------------------------------------------------------------- the node


def test_node_registers_with_labels_taint_gpus_and_the_runtime(node, kubectl_json):
    obj = kubectl_json("get", "node", real_node.NODE_NAME)
    assert obj["metadata"]["labels"][real_node.LOCAL_NODE_LABEL] == "true"
    assert real_node.LOCAL_TAINT in obj["spec"]["taints"]
    status = obj["status"]
    assert status["capacity"][real_node.GPU_RESOURCE] == "8"  # an extended resource, no device
    assert status["nodeInfo"]["containerRuntimeVersion"].startswith("containerd://")
    assert status["nodeInfo"]["kubeletVersion"].startswith("v1.")
    lease = wait_for(lambda: kubectl_json("get", "lease", real_node.NODE_NAME, "-n", "kube-node-lease"),
                     60, "the kubelet's node lease")
    assert lease["spec"]["holderIdentity"] == real_node.NODE_NAME


IN_POD = """
    import json, os, socket, urllib.request
    from kubernetes import client, config
    from kubernetes.client.exceptions import ApiException
    config.load_incluster_config()          # https://kubernetes.default.svc via kube-proxy
    v1 = client.CoreV1Api()
    ns = open("/var/run/secrets/kubernetes.io/serviceaccount/namespace").read()
    me = v1.read_namespaced_pod(os.environ["POD_NAME"], ns)
    try:
        v1.list_namespaced_secret(ns)
        forbidden = None
    except ApiException as e:
        forbidden = e.status
    try:
        open("/written-to-the-root-fs", "w")
        root_writable = True
    except OSError:
        root_writable = False
    host = urllib.request.urlopen(os.environ["HOST_URL"], timeout=10).read().decode()
    print(json.dumps({"uid": me.metadata.uid, "forbidden": forbidden, "root_writable": root_writable,
                      "euid": os.geteuid(), "host": host,
                      "api": socket.gethostbyname("kubernetes.default.svc")}), flush=True)
"""


def test_a_restricted_pod_from_the_registry_reaches_the_api_and_host_services(
        node, images, host_http, namespace, kubectl, kubectl_json):
    create(
        kubectl, namespace,
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "reader"}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": "read-pods"},
         "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": {"name": "read-pods"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "read-pods"},
         "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": namespace}]},
    )
    pod = pod_manifest("in-pod", images["sidecar"], IN_POD, serviceAccountName="reader", container={
        "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                {"name": "HOST_URL", "value": host_http}]})
    create(kubectl, namespace, pod)
    done = wait_phase(kubectl_json, namespace, "in-pod", ("Succeeded", "Failed"), timeout=120)
    out = logs(kubectl, namespace, "in-pod")
    assert done["status"]["phase"] == "Succeeded", out
    status = done["status"]["containerStatuses"][0]
    # Pulled from the registry by digest, under the registry's stable name.
    assert status["imageID"].endswith(images["sidecar"].split("@")[1])
    seen = last_json_line(out)
    assert seen["uid"] == done["metadata"]["uid"]
    assert seen["forbidden"] == 403
    assert seen["root_writable"] is False and seen["euid"] == 1000
    assert seen["host"] == "host says hi"
    assert seen["api"] == kubectl_json("get", "service", "kubernetes", "-n", "default")["spec"]["clusterIP"]


SERVER = """
    import os, socket
    s = socket.socket()
    s.bind(("0.0.0.0", 7000))
    s.listen()
    print("listening", flush=True)
    while True:  # readiness probes connect and send nothing
        conn, _ = s.accept()
        data = conn.recv(100)
        if data:
            conn.sendall(b"pong:" + data)
            conn.close()
            break
        conn.close()
"""

CLIENT = """
    import json, os, socket, time
    ns = os.environ["NS"]
    deadline = time.monotonic() + 60
    while True:  # the server may not be ready (published in DNS) yet
        try:
            conn = socket.create_connection((f"srv.grp.{ns}.svc", 7000), timeout=5)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    conn.sendall(b"ping")
    print(json.dumps({"reply": conn.recv(100).decode(), "srv": socket.gethostbyname("srv.grp"),
                      "fqdn": socket.getfqdn()}), flush=True)
"""


def test_headless_service_dns_between_pods(node, images, namespace, kubectl, kubectl_json):
    """What torchrun's rendezvous uses: `<hostname>.<subdomain>` of a headless Service."""
    env = [{"name": "NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}]
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "grp"},
               "spec": {"clusterIP": "None", "selector": {"app": "grp-server"},
                        "ports": [{"name": "tcp", "port": 7000}]}}
    server = pod_manifest("server", images["sidecar"], SERVER, hostname="srv", subdomain="grp",
                          labels={"app": "grp-server"}, container={
                              "ports": [{"name": "tcp", "containerPort": 7000}],
                              "readinessProbe": {"tcpSocket": {"port": "tcp"}, "periodSeconds": 1}})
    client = pod_manifest("client", images["sidecar"], CLIENT, hostname="cli", subdomain="grp",
                          container={"env": env})
    create(kubectl, namespace, service, server, client)
    done = wait_phase(kubectl_json, namespace, "client", ("Succeeded", "Failed"), timeout=90)
    out = logs(kubectl, namespace, "client")
    assert done["status"]["phase"] == "Succeeded", out
    server_ip = wait_phase(kubectl_json, namespace, "server", ("Succeeded",))["status"]["podIP"]
    seen = last_json_line(out)
    assert seen == {"reply": "pong:ping", "srv": server_ip,
                    "fqdn": f"cli.grp.{namespace}.svc.cluster.local"}


TRAP = """
    import signal, sys, time
    def on_term(*_):
        print("got SIGTERM", flush=True)
        time.sleep(1)
        sys.exit(0)
    signal.signal(signal.SIGTERM, on_term)
    print("armed", flush=True)
    while True:
        time.sleep(1)
"""


def test_exec_logs_and_graceful_delete_through_the_api_server(cluster, node, images, namespace, kubectl,
                                                             kubectl_json, kubeconfig):
    create(kubectl, namespace, pod_manifest("trap", images["sidecar"], TRAP))
    wait_for(lambda: "armed" in logs(kubectl, namespace, "trap"), 90, "the handler installed")
    # exec goes API server -> kubelet (client certificate) -> containerd. The certificate
    # names no group (not system:masters): the kubelet lets it in through the binding to
    # system:kubelet-api-admin alone.
    cert = x509.load_pem_x509_certificate((cluster.state_dir / "pki" / "apiserver-kubelet-client.crt").read_bytes())
    assert not cert.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME), cert.subject
    out = kubectl("exec", "trap", "-n", namespace, "--", "python3", "-c", "import os; print(os.getuid())")
    assert out.stdout.strip() == "1000"
    container_id = kubectl_json("get", "pod", "trap", "-n", namespace)["status"]["containerStatuses"][0]["containerID"]
    assert container_id.startswith("containerd://")
    # Follow the log while deleting (once the follow is attached): the handler's line shows
    # SIGTERM came first.
    follow = subprocess.Popen(["kubectl", f"--kubeconfig={kubeconfig}", "logs", "-f",
                               "trap", "-n", namespace], stdout=subprocess.PIPE, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(follow.stdout), daemon=True)
    reader.start()
    try:
        wait_for(lambda: "armed\n" in lines, 30, "the log followed")
        kubectl("delete", "pod", "trap", "-n", namespace, "--wait=true", "--timeout=60s")
        reader.join(30)
        assert "got SIGTERM\n" in lines, lines
    finally:
        follow.kill()


def test_stopping_the_node_leaves_the_host_as_it_was(cluster, registry_address, images):
    """Sysctls, iptables (every table, both families), mounts, links, cgroups and
    processes: compared before the node starts and after it stops, with a pod run between."""
    if getattr(cluster, "state_dir", None) is None:
        pytest.skip("needs a cluster this session started (RFT_KUBECONFIG reuses another)")
    cluster.stop_node()
    before = host_state()
    cluster.start_node(registry=registry_address)
    try:
        kc = f"--kubeconfig={cluster.kubeconfig}"
        pod = pod_manifest("touch", images["sidecar"], "print('ran')")
        pod["metadata"]["namespace"] = "default"
        subprocess.run(["kubectl", kc, "create", "-f", "-"], input=json.dumps(pod), text=True, check=True)

        def phase():
            out = subprocess.run(["kubectl", kc, "get", "pod", "touch", "-o", "jsonpath={.status.phase}"],
                                 capture_output=True, text=True).stdout
            return out == "Succeeded"
        wait_for(phase, 120, "the pod to run on the real node")
        during = host_state()
        assert during != before  # the node did change the host (else this test proves nothing)
    finally:
        cluster.stop_node()
    after = host_state()
    for key in before:
        assert after[key] == before[key], f"{key} differs after the node stopped"


# --------------------------------------------------------------------------- host state


VOLATILE_SYSCTLS = ("kernel/random/", "fs/dentry-state", "fs/file-nr", "fs/inode-", "kernel/ns_last_pid",
                    "net/netfilter/nf_conntrack_count", "kernel/pty/nr", "fs/quota/", "kernel/tainted",
                    "vm/stat_refresh", "fs/binfmt_misc/", "net/ipv4/route/flush", "net/ipv6/route/flush",
                    "kernel/sched_domain", "net/ipv4/neigh/", "net/ipv6/neigh/", "net/ipv4/conf/veth",
                    "net/ipv6/conf/veth", "fs/aio-nr", "kernel/perf_event", "vm/drop_caches",
                    "net/netfilter/nf_log", "fs/pipe-user-pages", "kernel/keys/gc_delay")


def host_state() -> dict:
    """The host as the node could change it, read independently of e2e/node.py."""
    sysctls = {}
    for dirpath, _, files in os.walk("/proc/sys"):
        for f in files:
            path = os.path.join(dirpath, f)
            key = path[len("/proc/sys/"):]
            if key.startswith(VOLATILE_SYSCTLS):
                continue
            try:
                sysctls[key] = Path(path).read_text()
            except OSError:
                pass
    rules = {}
    for binary in ("iptables-save", "ip6tables-save"):
        out = subprocess.run([binary], capture_output=True, text=True).stdout
        rules[binary] = sorted(line.split(" [")[0] for line in out.splitlines()
                               if line.startswith((":", "-A", "*")))
    mounts = sorted(line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines())
    cgroups = sorted(str(p) for top in ("kubepods", "k8s.io")
                     for p in (*Path("/sys/fs/cgroup").glob(f"*/{top}"), Path("/sys/fs/cgroup") / top)
                     if p.exists())
    procs = sorted(p.name for p in Path("/proc").iterdir() if p.name.isdigit()
                   and _exe(p).startswith(("containerd", "kubelet", "kube-proxy", "coredns", "pause")))
    return {"sysctls": sysctls, "iptables": rules, "mounts": mounts, "links": sorted(os.listdir("/sys/class/net")),
            "cgroups": cgroups, "processes": procs,
            "paths": [p for p in ("/var/lib/rftjob-node", "/run/rftjob-node", "/var/log/containers",
                                  "/run/netns", "/var/lib/cni", "/var/lib/kubelet", "/run/containerd",
                                  "/opt/containerd") if os.path.lexists(p)]}


def _exe(proc_dir: Path) -> str:
    try:
        return os.path.basename(os.readlink(proc_dir / "exe"))
    except OSError:
        return ""
