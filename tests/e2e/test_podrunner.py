"""End-to-end tests of the pod runner (e2e/podrunner/) on the local control plane.

Every pod runs `python -c ...` as a real process on this host, tolerates the local node's
taint and selects it. Waits poll the API with timeouts; nothing sleeps to synchronise.
"""

from __future__ import annotations

import ipaddress
import json
import subprocess
import sys
import textwrap
import time
import uuid

import psutil
import pytest

from e2e.podrunner import PodRunner
from tests.integration.conftest import wait_for

pytestmark = pytest.mark.integration


# --------------------------------------------------------------------------- helpers


def pod_manifest(name: str, node: str, script: str, **spec: object) -> dict:
    """A pod running `python -c script` on the runner's node (restartPolicy Never)."""
    container = {"name": "main", "image": "python:3.11-slim",
                 "command": ["python", "-c", textwrap.dedent(script)]}
    container.update(spec.pop("container", {}))  # type: ignore[arg-type]
    labels = spec.pop("labels", {})
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 5,
            "nodeSelector": {"rft.dev/local-node": "true", "kubernetes.io/hostname": node},
            "tolerations": [{"key": "rft.dev/local", "operator": "Exists", "effect": "NoSchedule"}],
            "containers": [container],
            **spec,
        },
    }


def create(kubectl, namespace: str, *objects: dict) -> None:
    kubectl("create", "-n", namespace, "-f", "-",
            input=json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objects)}))


def get_pod(kubectl_json, namespace: str, name: str) -> dict:
    return kubectl_json("get", "pod", name, "-n", namespace)


def wait_phase(kubectl_json, namespace: str, name: str, phases: tuple[str, ...], timeout: float = 30) -> dict:
    def done():
        pod = get_pod(kubectl_json, namespace, name)
        return pod if pod.get("status", {}).get("phase") in phases else None
    return wait_for(done, timeout, f"pod {namespace}/{name} in phase {phases}")


def pod_gone(kubectl, namespace: str, name: str) -> bool:
    out = kubectl("get", "pod", name, "-n", namespace, "--ignore-not-found", "-o", "name").stdout
    return out.strip() == ""


def condition(pod: dict, ctype: str) -> str | None:
    for cond in pod.get("status", {}).get("conditions", []):
        if cond["type"] == ctype:
            return cond["status"]
    return None


def container_status(pod: dict, name: str = "main") -> dict:
    return next(s for s in pod["status"]["containerStatuses"] if s["name"] == name)


def log_text(runner: PodRunner, namespace: str, pod: str, container: str = "main") -> str:
    path = runner.log_path(namespace, pod, container)
    return path.read_text() if path else ""


def last_json_line(text: str) -> dict:
    return json.loads([line for line in text.splitlines() if line.startswith("{")][-1])


# --------------------------------------------------------------------------- node


def test_node_registered_with_labels_taint_and_lease(runner, kubectl_json):
    node = kubectl_json("get", "node", runner.node)
    labels = node["metadata"]["labels"]
    assert labels["kubernetes.io/hostname"] == runner.node
    assert labels["rft.dev/local-node"] == "true"
    assert labels["kubernetes.io/os"] == "linux"
    assert "kwok.x-k8s.io/node" not in node["metadata"].get("annotations", {})
    assert {"key": "rft.dev/local", "value": "true", "effect": "NoSchedule"} in node["spec"]["taints"]
    status = node["status"]
    assert status["capacity"]["nvidia.com/gpu"] == "0"
    assert status["capacity"]["pods"] == "110"
    assert status["daemonEndpoints"]["kubeletEndpoint"]["Port"] == runner.kubelet_port > 0
    addresses = {a["type"]: a["address"] for a in status["addresses"]}
    assert addresses == {"InternalIP": runner.node_ip, "Hostname": runner.node}
    lease = kubectl_json("get", "lease", runner.node, "-n", "kube-node-lease")
    assert lease["spec"]["holderIdentity"] == runner.node


# --------------------------------------------------------------------------- env, volumes, logs


ENV_SCRIPT = """
    import json, os, socket
    seen = {k: os.environ.get(k) for k in
            ("POD_IP", "POD_NAME", "NODE", "PASSWORD", "GREETING", "COMBINED", "MISSING_OK",
             "FROM_CM_greeting", "KUBECONFIG", "HOSTNAME")}
    seen["config"] = json.load(open("/etc/rft/config.json"))
    seen["secret"] = open("/etc/rft/creds/password").read()
    seen["labels"] = open("/etc/podinfo/labels").read()
    seen["podname"] = open("/etc/podinfo/name").read()
    seen["hostname"] = socket.gethostname()
    seen["own_ip"] = socket.gethostbyname(socket.gethostname())
    seen["cwd"] = os.getcwd()
    try:
        open("/etc/rft/creds/new", "w")
        seen["readonly"] = False
    except OSError:
        seen["readonly"] = True
    print("starting")
    print(json.dumps(seen), flush=True)
"""


def test_env_volumes_and_logs(runner, namespace, kubectl, kubectl_json):
    name = "env-check"
    kubectl("create", "secret", "generic", "creds", "-n", namespace, "--from-literal=password=s3cret")
    kubectl("create", "configmap", "settings", "-n", namespace, "--from-literal=greeting=hello",
            '--from-literal=config.json={"lr": 0.1}')
    pod = pod_manifest(
        name, runner.node, ENV_SCRIPT, labels={"app": "env-check"},
        container={
            "workingDir": "/tmp",
            "env": [
                {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
                {"name": "PASSWORD", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "password"}}},
                {"name": "GREETING", "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "greeting"}}},
                {"name": "MISSING_OK", "valueFrom": {"secretKeyRef": {"name": "nope", "key": "x", "optional": True}}},
                {"name": "COMBINED", "value": "$(GREETING)-$(POD_NAME)-$$(GREETING)-$(UNDEFINED)"},
            ],
            "envFrom": [{"prefix": "FROM_CM_", "configMapRef": {"name": "settings"}}],
            "volumeMounts": [
                {"name": "config", "mountPath": "/etc/rft"},
                {"name": "creds", "mountPath": "/etc/rft/creds", "readOnly": True},
                {"name": "podinfo", "mountPath": "/etc/podinfo"},
            ],
        },
        volumes=[
            {"name": "config", "configMap": {"name": "settings", "items": [{"key": "config.json", "path": "config.json"}]}},
            {"name": "creds", "secret": {"secretName": "creds", "defaultMode": 0o400}},
            {"name": "podinfo", "downwardAPI": {"items": [
                {"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}},
                {"path": "name", "fieldRef": {"fieldPath": "metadata.name"}},
            ]}},
        ],
    )
    create(kubectl, namespace, pod)
    done = wait_phase(kubectl_json, namespace, name, ("Succeeded", "Failed"))
    log = log_text(runner, namespace, name)
    assert done["status"]["phase"] == "Succeeded", log
    terminated = container_status(done)["state"]["terminated"]
    assert terminated["exitCode"] == 0 and terminated["reason"] == "Completed"
    pod_ip = done["status"]["podIP"]
    assert ipaddress.ip_address(pod_ip) in ipaddress.ip_network("127.0.0.0/8") and pod_ip != "127.0.0.1"
    assert done["status"]["hostIP"] == runner.node_ip

    seen = last_json_line(log)
    assert seen["POD_IP"] == pod_ip
    assert seen["POD_NAME"] == name
    assert seen["NODE"] == runner.node
    assert seen["PASSWORD"] == "s3cret"
    assert seen["GREETING"] == "hello"
    assert seen["FROM_CM_greeting"] == "hello"
    assert seen["COMBINED"] == f"hello-{name}-$(GREETING)-$(UNDEFINED)"
    assert seen["MISSING_OK"] is None
    assert seen["KUBECONFIG"] is None  # the runner's credentials do not leak into pods
    assert seen["HOSTNAME"] == name and seen["hostname"] == name
    assert seen["own_ip"] == pod_ip
    assert seen["config"] == {"lr": 0.1}
    assert seen["secret"] == "s3cret"
    assert seen["labels"] == 'app="env-check"'
    assert seen["podname"] == name
    assert seen["cwd"] == "/tmp"
    assert seen["readonly"] is True

    # The logs helper CLI and `kubectl logs` (through the runner's kubelet endpoint).
    cli = subprocess.run([sys.executable, "-m", "e2e.podrunner", "logs", f"{namespace}/{name}",
                          "--state-dir", str(runner.state_dir)], capture_output=True, text=True, timeout=30)
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout == log
    assert kubectl("logs", name, "-n", namespace).stdout == log
    assert kubectl("logs", name, "-n", namespace, "--tail=1").stdout == log.splitlines(keepends=True)[-1]


def test_missing_secret_is_create_container_config_error_until_created(runner, namespace, kubectl, kubectl_json):
    name = "late-secret"
    pod = pod_manifest(name, runner.node, "import os; print(os.environ['TOKEN'])", container={
        "env": [{"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "late", "key": "token"}}}],
    })
    create(kubectl, namespace, pod)

    def waiting_reason():
        statuses = get_pod(kubectl_json, namespace, name).get("status", {}).get("containerStatuses") or []
        return statuses and statuses[0]["state"].get("waiting", {}).get("reason") == "CreateContainerConfigError"
    wait_for(waiting_reason, 30, "CreateContainerConfigError")
    kubectl("create", "secret", "generic", "late", "-n", namespace, "--from-literal=token=abc")
    done = wait_phase(kubectl_json, namespace, name, ("Succeeded", "Failed"))
    assert done["status"]["phase"] == "Succeeded"
    assert log_text(runner, namespace, name).strip() == "abc"


# --------------------------------------------------------------------------- in-cluster client


IN_CLUSTER_SCRIPT = """
    import json, os
    from kubernetes import client, config
    from kubernetes.client.exceptions import ApiException
    config.load_incluster_config()
    v1 = client.CoreV1Api()
    ns = open("/var/run/secrets/kubernetes.io/serviceaccount/namespace").read()
    me = v1.read_namespaced_pod(os.environ["POD_NAME"], ns)
    try:
        v1.list_namespaced_secret(ns)
        forbidden = None
    except ApiException as e:
        forbidden = e.status
    print(json.dumps({"uid": me.metadata.uid, "ns": ns, "forbidden": forbidden}), flush=True)
"""


def test_in_cluster_client_with_service_account_rbac(runner, namespace, kubectl, kubectl_json):
    name = "in-cluster"
    create(
        kubectl, namespace,
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "reader"}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": "read-self"},
         "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get"], "resourceNames": [name]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": {"name": "read-self"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "read-self"},
         "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": namespace}]},
    )
    pod = pod_manifest(name, runner.node, IN_CLUSTER_SCRIPT, serviceAccountName="reader", container={
        "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
    })
    create(kubectl, namespace, pod)
    done = wait_phase(kubectl_json, namespace, name, ("Succeeded", "Failed"), timeout=45)
    log = log_text(runner, namespace, name)
    assert done["status"]["phase"] == "Succeeded", log
    # The API server injected kube-api-access-*; the runner materialised it.
    assert any(v["name"].startswith("kube-api-access-") for v in done["spec"]["volumes"])
    seen = last_json_line(log)
    assert seen == {"uid": done["metadata"]["uid"], "ns": namespace, "forbidden": 403}


# --------------------------------------------------------------------------- DNS


SERVER_SCRIPT = """
    import os, socket
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((os.environ["POD_IP"], 7000))
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

CLIENT_SCRIPT = """
    import json, os, socket, time
    ns = os.environ["NS"]
    deadline = time.monotonic() + 60
    while True:  # the server may not be up (or ready, for the Service name) yet
        try:
            srv_ip = socket.gethostbyname(f"srv.grp.{ns}.svc")
            svc_ip = socket.gethostbyname(f"grp.{ns}.svc.cluster.local")
            conn = socket.create_connection((f"srv.grp.{ns}.svc", 7000), timeout=5)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    conn.sendall(b"ping")
    reply = conn.recv(100).decode()
    print(json.dumps({"srv_ip": srv_ip, "svc_ip": svc_ip, "reply": reply,
                      "short": socket.gethostbyname("srv.grp"),
                      "fqdn": socket.getfqdn()}), flush=True)
"""


def test_headless_service_dns_between_pods(runner, namespace, kubectl, kubectl_json):
    env = [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
           {"name": "NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}]
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "grp"},
               "spec": {"clusterIP": "None", "selector": {"app": "grp-server"},
                        "ports": [{"name": "tcp", "port": 7000}]}}
    server = pod_manifest("server", runner.node, SERVER_SCRIPT, hostname="srv", subdomain="grp",
                          labels={"app": "grp-server"}, container={
                              "env": env, "ports": [{"name": "tcp", "containerPort": 7000}],
                              "readinessProbe": {"tcpSocket": {"port": "tcp"}, "periodSeconds": 1},
                          })
    client = pod_manifest("client", runner.node, CLIENT_SCRIPT, hostname="cli", subdomain="grp",
                          container={"env": env})
    create(kubectl, namespace, service, server, client)
    client_done = wait_phase(kubectl_json, namespace, "client", ("Succeeded", "Failed"), timeout=60)
    client_log = log_text(runner, namespace, "client")
    assert client_done["status"]["phase"] == "Succeeded", client_log
    server_done = wait_phase(kubectl_json, namespace, "server", ("Succeeded", "Failed"))
    assert server_done["status"]["phase"] == "Succeeded", log_text(runner, namespace, "server")
    seen = last_json_line(client_log)
    server_ip = server_done["status"]["podIP"]
    assert seen["reply"] == "pong:ping"
    assert seen["srv_ip"] == server_ip == seen["svc_ip"] == seen["short"]
    assert seen["fqdn"] == f"cli.grp.{namespace}.svc.cluster.local"


# --------------------------------------------------------------------------- exit codes, restarts


def test_exit_code_with_restart_policy_never_fails_pod(runner, namespace, kubectl, kubectl_json):
    create(kubectl, namespace, pod_manifest("exit3", runner.node, "import sys; sys.exit(3)"))
    done = wait_phase(kubectl_json, namespace, "exit3", ("Succeeded", "Failed"))
    assert done["status"]["phase"] == "Failed"
    status = container_status(done)
    assert status["state"]["terminated"]["exitCode"] == 3
    assert status["state"]["terminated"]["reason"] == "Error"
    assert status["restartCount"] == 0
    assert condition(done, "Ready") == "False"


COUNTER_SCRIPT = """
    import pathlib, sys
    counter = pathlib.Path("/work/runs")
    runs = int(counter.read_text()) + 1 if counter.exists() else 1
    counter.write_text(str(runs))
    print("run", runs, flush=True)
    sys.exit(0 if runs >= 3 else 1)
"""


def test_on_failure_restarts_until_success(runner, namespace, kubectl, kubectl_json):
    pod = pod_manifest("flaky", runner.node, COUNTER_SCRIPT, restartPolicy="OnFailure",
                       volumes=[{"name": "work", "emptyDir": {}}],
                       container={"volumeMounts": [{"name": "work", "mountPath": "/work"}]})
    create(kubectl, namespace, pod)
    done = wait_phase(kubectl_json, namespace, "flaky", ("Succeeded", "Failed"), timeout=30)
    assert done["status"]["phase"] == "Succeeded"
    status = container_status(done)
    assert status["restartCount"] == 2
    assert status["lastState"]["terminated"]["exitCode"] == 1
    assert status["state"]["terminated"]["exitCode"] == 0
    assert log_text(runner, namespace, "flaky").split() == ["run", "1", "run", "2", "run", "3"]


def test_init_containers_run_first(runner, namespace, kubectl, kubectl_json):
    mount = [{"name": "shared", "mountPath": "/shared"}]
    pod = pod_manifest("with-init", runner.node, "print(open('/shared/msg').read())",
                       volumes=[{"name": "shared", "emptyDir": {"medium": "Memory"}}],
                       container={"volumeMounts": mount},
                       initContainers=[{"name": "prepare", "image": "python:3.11-slim", "volumeMounts": mount,
                                        "command": ["python", "-c", "open('/shared/msg', 'w').write('from init')"]}])
    create(kubectl, namespace, pod)
    done = wait_phase(kubectl_json, namespace, "with-init", ("Succeeded", "Failed"))
    assert done["status"]["phase"] == "Succeeded"
    init = done["status"]["initContainerStatuses"][0]
    assert init["name"] == "prepare" and init["state"]["terminated"]["exitCode"] == 0
    assert condition(done, "Initialized") == "True"
    assert log_text(runner, namespace, "with-init").strip() == "from init"


# --------------------------------------------------------------------------- readiness


PROBED_SERVER = """
    import http.server, os
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            ok = os.path.exists(os.environ["READY_FILE"])
            print("probe", self.path, ok, flush=True)
            self.send_response(200 if ok else 503)
            self.end_headers()
        def log_message(self, *a):
            pass
    http.server.HTTPServer((os.environ["POD_IP"], 8080), H).serve_forever()
"""


def test_readiness_probe_http_flips_ready(runner, namespace, kubectl, kubectl_json, tmp_path):
    ready_file = tmp_path / "ready"
    pod = pod_manifest("probed", runner.node, PROBED_SERVER, container={
        "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                {"name": "READY_FILE", "value": str(ready_file)}],
        "ports": [{"name": "http", "containerPort": 8080}],
        "readinessProbe": {"httpGet": {"path": "/healthz", "port": "http"},
                           "periodSeconds": 1, "failureThreshold": 1},
    })
    create(kubectl, namespace, pod)
    wait_for(lambda: log_text(runner, namespace, "probed").count("probe /healthz False") >= 2, 30,
             "two failed probes")
    pod = get_pod(kubectl_json, namespace, "probed")
    assert pod["status"]["phase"] == "Running"
    assert condition(pod, "Ready") == "False"
    assert container_status(pod)["ready"] is False

    ready_file.write_text("yes")
    wait_for(lambda: condition(get_pod(kubectl_json, namespace, "probed"), "Ready") == "True", 20, "Ready=True")
    ready_file.unlink()
    wait_for(lambda: condition(get_pod(kubectl_json, namespace, "probed"), "Ready") == "False", 20, "Ready=False")


# --------------------------------------------------------------------------- deletion


TRAP_SCRIPT = """
    import os, signal, sys, time
    def on_term(*_):
        open(os.environ["MARKER"], "w").write("terminated")
        sys.exit(0)
    signal.signal(signal.SIGTERM, on_term)
    print("armed", flush=True)
    while True:
        time.sleep(1)
"""


def test_delete_sends_sigterm_then_removes_pod(runner, namespace, kubectl, kubectl_json, tmp_path):
    marker = tmp_path / "marker"
    pod = pod_manifest("trap", runner.node, TRAP_SCRIPT, container={"env": [{"name": "MARKER", "value": str(marker)}]})
    create(kubectl, namespace, pod)
    wait_for(lambda: "armed" in log_text(runner, namespace, "trap"), 30, "handler installed")
    kubectl("delete", "pod", "trap", "-n", namespace, "--wait=false")
    wait_for(lambda: pod_gone(kubectl, namespace, "trap"), 20, "pod object removed")
    assert marker.read_text() == "terminated"
    assert runner.log_path(namespace, "trap", "main") is None  # pod dir cleaned up


IGNORE_SCRIPT = """
    import signal, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("armed", flush=True)
    while True:
        time.sleep(1)
"""


def test_delete_kills_process_ignoring_sigterm_after_grace(runner, namespace, kubectl, kubectl_json):
    pod = pod_manifest("stubborn", runner.node, IGNORE_SCRIPT, terminationGracePeriodSeconds=2)
    create(kubectl, namespace, pod)
    wait_for(lambda: "armed" in log_text(runner, namespace, "stubborn"), 30, "SIGTERM ignored")
    running = get_pod(kubectl_json, namespace, "stubborn")
    pid = int(container_status(running)["containerID"].removeprefix("runner://"))
    assert psutil.pid_exists(pid)
    started = time.monotonic()
    kubectl("delete", "pod", "stubborn", "-n", namespace, "--wait=false")
    wait_for(lambda: pod_gone(kubectl, namespace, "stubborn"), 20, "pod object removed")
    elapsed = time.monotonic() - started
    assert elapsed >= 1.5, f"removed after {elapsed:.1f}s: the grace period was not honoured"
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


# --------------------------------------------------------------------------- runner restart


def test_runner_restart_marks_orphaned_pods_failed(cluster, namespace, kubectl, kubectl_json, tmp_path):
    node = f"local-restart-{uuid.uuid4().hex[:6]}"
    state = tmp_path / "runner"
    first = PodRunner(cluster.kubeconfig, node=node, state_dir=state).start()
    try:
        pod = pod_manifest("orphan", node, "import time; time.sleep(600)")
        create(kubectl, namespace, pod)
        running = wait_phase(kubectl_json, namespace, "orphan", ("Running",))
        pid = int(container_status(running)["containerID"].removeprefix("runner://"))
        first.stop()
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        second = PodRunner(cluster.kubeconfig, node=node, state_dir=state).start()
        try:
            failed = wait_phase(kubectl_json, namespace, "orphan", ("Failed",), timeout=20)
            assert failed["status"]["reason"] == "NodeRestart"
            assert container_status(failed)["state"]["terminated"]["exitCode"] == 137
        finally:
            second.stop()
    finally:
        first.stop()
        kubectl("delete", "node", node, "--wait=false", check=False)
