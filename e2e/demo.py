"""`make demo`: a real RFTJob on this machine, end to end, no Docker and no GPU.

    python -m e2e.demo up      # registry, cluster + real node, S3, the operator, the sample job
    python -m e2e.demo down    # stops everything it started and undoes its host changes

What runs (`make demo` first builds the images with `make images`):
  * the local registry (e2e/registry.py) holding this repository's images (e2e/images.py);
  * the local control plane (e2e/cluster.py) with the real node `local` (e2e/node.py:
    containerd, runc, bridge CNI, kubelet, kube-proxy, CoreDNS), which pulls the images
    from the registry under the name registry.rft.local;
  * SeaweedFS' S3 gateway (e2e/s3server.py) on the node's bridge gateway 10.244.0.1, at a
    port picked free at start and recorded in the state directory, its data on disk;
  * the operator as its Deployment (manifests/, the image set by a kustomize override);
  * the sample RFTJob (manifests/samples/, its image and endpoint set the same way): a tiny
    random Qwen2 trained with GRPO on an arithmetic taskset: 2 trainer pods, 2 inference
    replicas, 1 explorer, all under the restricted Pod Security profile.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import shutil
import sys
import tempfile
import time
from pathlib import Path

import yaml

from .cluster import DEFAULT_STATE_DIR, REPO_ROOT, Cluster, ClusterError
from .node import GATEWAY, LOCAL_NODE_LABEL, LOCAL_TAINT, REGISTRY_HOST
from .registry import DEFAULT_STATE_DIR as REGISTRY_STATE_DIR
from .registry import Registry
from .s3server import S3Server

JOB, NAMESPACE, BUCKET = "demo", "default", "rft-demo"
CREDS = {"AWS_ACCESS_KEY_ID": "rftdemo", "AWS_SECRET_ACCESS_KEY": "rftdemo-secret-change-me",
         "AWS_REGION": "us-east-1", "AWS_DEFAULT_REGION": "us-east-1"}
OPERATOR_IMAGE = "ghcr.io/rft-dev/rftjob-operator"  # as manifests/base/deployment.yaml names it


def wait_until(predicate, timeout: float, what: str, poll: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (value := predicate()):
            return value
        time.sleep(poll)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")


def kubectl(cluster: Cluster, *args: str, check: bool = True, input: str | None = None) -> str:
    out = subprocess.run(["kubectl", f"--kubeconfig={cluster.kubeconfig}", *args],
                         capture_output=True, text=True, input=input)
    if check and out.returncode != 0:
        raise ClusterError(f"kubectl {' '.join(args)}: {out.stderr.strip()}")
    return out.stdout


# ------------------------------------------------------------------ the helper processes


def s3_server(cluster: Cluster) -> S3Server:
    """SeaweedFS on the bridge gateway, where both this host and the node's pods reach it."""
    return S3Server(cluster.state_dir / "s3", log_file=cluster.logs_dir / "s3.log", host=GATEWAY,
                    credentials={CREDS["AWS_ACCESS_KEY_ID"]: CREDS["AWS_SECRET_ACCESS_KEY"]})


def image_refs(state_dir: Path = REGISTRY_STATE_DIR) -> dict[str, str]:
    """image -> reference by digest under the registry's stable name, from `make images`."""
    path = Path(state_dir) / "images.json"
    if not path.exists():
        raise ClusterError(f"{path} is missing: build the images first with `make images`")
    return {name: f"{REGISTRY_HOST}/{ref['repository']}@{ref['digest']}"
            for name, ref in json.loads(path.read_text()).items()}


def _on_local_node() -> dict:
    """A pod template patch that puts a pod on the real node (KWOK's nodes run nothing)."""
    return {"nodeSelector": {LOCAL_NODE_LABEL: "true"},
            "tolerations": [{"key": LOCAL_TAINT["key"], "operator": "Exists", "effect": "NoSchedule"}]}


def write_overlay(directory: Path, base: Path, images: list[dict] | None = None,
                  patches: list[dict] | None = None, components: list[Path] = ()) -> Path:
    """A kustomization in `directory` over `base` (a directory of the repository)."""
    directory.mkdir(parents=True, exist_ok=True)
    kustomization = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                     "resources": [os.path.relpath(base, directory)]}
    if components:
        kustomization["components"] = [os.path.relpath(c, directory) for c in components]
    if images:
        kustomization["images"] = images
    if patches:
        kustomization["patches"] = patches
    (directory / "kustomization.yaml").write_text(yaml.safe_dump(kustomization, sort_keys=False))
    return directory


def install_api(cluster: Cluster) -> None:
    """The CRD, RBAC and admission policies from manifests/, without the Deployment: for
    tests and benchmarks that run the operator as a host process with its identity."""
    for f in ("manifests/base/namespace.yaml", "crds/rftjob.yaml", "manifests/base/rbac.yaml",
              "manifests/base/admission-policies.yaml"):
        kubectl(cluster, "apply", "--server-side", "--force-conflicts", "-f", str(REPO_ROOT / f))
    kubectl(cluster, "wait", "--for=condition=Established", "crd/rftjobs.rft.dev", "--timeout=60s")
    uninstall_webhook(cluster)  # one left by an in-cluster install would refuse a host operator's creates


CERTS_JOB = "rftjob-operator-webhook-certs"  # manifests/base/owner-webhook.yaml


def install(cluster: Cluster, operator_ref: str, timeout: float = 180,
            extra_args: tuple[str, ...] = (), env: dict[str, str] | None = None,
            replicas: int | None = None, manifests: Path = REPO_ROOT / "manifests") -> None:
    """manifests/ as a user installs it (CRD, RBAC, admission policies, the owner webhook
    and the Job that makes its serving pair, the Deployment), with the operator image from
    the local registry and its pods placed on the real node; `extra_args` and `env` go to
    the operator container (the tests log at debug level); `replicas` overrides the
    Deployment's two (the tests that kill "the" operator run one). `manifests` is another
    install to apply the same way: a previous release's (`e2e.releases.manifests()`), which
    has no certificate Job."""
    name, digest = operator_ref.split("@")
    pod_spec = _on_local_node()
    if env:
        pod_spec["containers"] = [{"name": "operator", "env": [{"name": k, "value": v} for k, v in env.items()]}]
    template = {"apiVersion": "apps/v1", "kind": "Deployment",
                "metadata": {"name": "rftjob-operator", "namespace": "rftjob-system"},
                "spec": {"template": {"spec": pod_spec}}}
    if replicas is not None:
        template["spec"]["replicas"] = replicas
    certs_job = {"apiVersion": "batch/v1", "kind": "Job",
                 "metadata": {"name": CERTS_JOB, "namespace": "rftjob-system"},
                 "spec": {"template": {"spec": _on_local_node()}}}
    patches = [{"patch": yaml.safe_dump(template)}]
    if manifests == REPO_ROOT / "manifests":
        patches.append({"patch": yaml.safe_dump(certs_job)})
    if extra_args:  # appended, so that the install's arguments stay
        patches.append({"target": {"kind": "Deployment", "name": "rftjob-operator"}, "patch": json.dumps(
            [{"op": "add", "path": "/spec/template/spec/containers/0/args/-", "value": a} for a in extra_args])})
    overlay = write_overlay(cluster.state_dir / "overlays" / "operator", manifests,
                            images=[{"name": OPERATOR_IMAGE, "newName": name, "digest": digest}], patches=patches)
    # A Job's template cannot change: one left from an install with another image goes first.
    kubectl(cluster, "delete", "job", CERTS_JOB, "-n", "rftjob-system", "--ignore-not-found")
    kubectl(cluster, "apply", "--server-side", "--force-conflicts", "-k", str(overlay))
    kubectl(cluster, "wait", "--for=condition=Established", "crd/rftjobs.rft.dev", "--timeout=60s")
    try:
        kubectl(cluster, "rollout", "status", "deployment/rftjob-operator", "-n", "rftjob-system",
                f"--timeout={int(timeout)}s")
    except ClusterError as e:  # the pods wait for the Secret the Job writes: say what the Job did
        job_log = kubectl(cluster, "logs", "-n", "rftjob-system", f"job/{CERTS_JOB}", "--tail=20",
                          check=False)
        raise ClusterError(f"{e}\nthe webhook certificate Job's log:\n{job_log}") from e


def uninstall_webhook(cluster: Cluster) -> None:
    """The owner webhook's configuration, Secret and certificate Job removed (the next
    install makes new ones): for tests that stop the in-cluster operator and hand its identity to host
    processes, whose creates would otherwise wait on a webhook nobody serves."""
    from rft_operator import ownerhook

    kubectl(cluster, "delete", "validatingwebhookconfiguration", ownerhook.WEBHOOK_NAME, "--ignore-not-found")
    kubectl(cluster, "delete", "secret", ownerhook.TLS_SECRET, "-n", ownerhook.OPERATOR_NAMESPACE, "--ignore-not-found")
    # And the Job that made them, so that the next install's runs (a finished one is kept for
    # ten minutes, and an install that finds it does not run it again).
    kubectl(cluster, "delete", "job", CERTS_JOB, "-n", ownerhook.OPERATOR_NAMESPACE, "--ignore-not-found")


def sample_overlay(cluster: Cluster, trainer_ref: str, endpoint: str) -> Path:
    """manifests/samples/ with this cluster's trainer image and S3 endpoint."""
    ops = [{"op": "replace", "path": "/spec/trainer/image", "value": trainer_ref},
           {"op": "replace", "path": "/spec/checkpoint/endpoint", "value": endpoint}]
    return write_overlay(cluster.state_dir / "overlays" / "sample", REPO_ROOT / "manifests" / "samples",
                         patches=[{"target": {"kind": "RFTJob", "name": JOB}, "patch": json.dumps(ops)}])


def s3_client(endpoint: str):
    import boto3

    return boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=CREDS["AWS_ACCESS_KEY_ID"],
                        aws_secret_access_key=CREDS["AWS_SECRET_ACCESS_KEY"], region_name="us-east-1")


def prepare_data(endpoint: str, bucket: str = BUCKET, num_tasks: int = 256) -> None:
    """The tiny model and the taskset the sample job reads, created here (no downloads)."""
    from rft_rollout.tasksets import arithmetic

    s3 = s3_client(endpoint)
    wait_until(lambda: _reachable(s3), 30, f"the S3 server at {endpoint}")
    if bucket not in [b["Name"] for b in s3.list_buckets().get("Buckets", [])]:
        s3.create_bucket(Bucket=bucket)
    upload_tiny_model(s3, bucket, "models/tiny")
    lines = "".join(json.dumps(t) + "\n" for t in arithmetic(num_tasks, seed=0))
    s3.put_object(Bucket=bucket, Key="data/arith.jsonl", Body=lines.encode())


def upload_tiny_model(s3, bucket: str, prefix: str, **shape) -> None:
    """The sample's tiny random Qwen2 (seed 0; `shape`: save_tiny_model's other arguments)
    written to s3://`bucket`/`prefix`/."""
    from tests.fixtures.models import save_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = save_tiny_model(Path(tmp) / "tiny", seed=0, **shape)
        for f in sorted(model.iterdir()):
            s3.upload_file(str(f), bucket, f"{prefix}/{f.name}")


def clear_run(endpoint: str, bucket: str = BUCKET, prefix: str = "runs/demo/") -> None:
    s3 = s3_client(endpoint)
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            s3.delete_object(Bucket=bucket, Key=obj["Key"])


def _reachable(s3) -> bool:
    try:
        s3.list_buckets()
        return True
    except Exception:  # noqa: BLE001 - not up yet
        return False


# ------------------------------------------------------------------ showing progress


def status(cluster: Cluster) -> dict:
    out = kubectl(cluster, "get", "rftjob", JOB, "-n", NAMESPACE, "-o", "json", check=False)
    return (json.loads(out).get("status") or {}) if out else {}


def watch(cluster: Cluster, until: str, timeout: float) -> dict:
    """`kubectl get rftjobs -w`, printed when the row changes, until the phase is reached."""
    deadline, last = time.monotonic() + timeout, ""
    header_shown = False
    while time.monotonic() < deadline:
        lines = kubectl(cluster, "get", "rftjobs", "-n", NAMESPACE, check=False).splitlines()
        row = lines[1].rsplit(None, 1)[0] if len(lines) > 1 else ""  # without AGE
        if row and row != last:
            if not header_shown:
                print(lines[0], flush=True)
                header_shown = True
            print(lines[1], flush=True)
            last = row
        st = status(cluster)
        if st.get("phase") == until:
            return st
        if st.get("phase") == "Failed":
            raise ClusterError(f"{JOB} failed: {st.get('message')}")
        time.sleep(1)  # a display refresh, not synchronisation
    raise ClusterError(f"{JOB} did not reach {until} within {timeout:.0f}s; see "
                       "`kubectl logs -n rftjob-system deploy/rftjob-operator` and the pods' logs")


def fetch_tensorboard(checkpoint_uri: str, dest: Path) -> Path | None:
    """The job's TensorBoard event files (spec.tracking.tensorboard), copied to `dest` for
    `tensorboard --logdir`; None when it wrote none."""
    from rft_contract.s3 import S3Storage

    storage = S3Storage()
    prefix = f"{checkpoint_uri}/tensorboard/"
    if not storage.list(prefix):
        return None
    shutil.rmtree(dest, ignore_errors=True)
    return storage.download_prefix(prefix, dest)


def write_curves(checkpoint_uri: str, out: Path) -> Path | None:
    """Reward and loss per step from the trainer's metrics log (`<uri>/metrics/`)."""
    from rft_trainer.metrics import read_metrics

    rows = read_metrics(checkpoint_uri)
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    for ax, key, title in ((axes[0], "critic/rewards/mean", "reward (mean)"),
                           (axes[1], "actor/pg_loss", "policy loss")):
        ax.plot(steps, [r.get(key) for r in rows], marker="o")
        ax.set_title(title)
        ax.set_xlabel("trainer step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return out


# ------------------------------------------------------------------ commands


def up(cluster: Cluster, timeout: float = 900) -> None:
    t0 = time.monotonic()
    refs = image_refs()
    registry = Registry(REGISTRY_STATE_DIR).ensure()
    cluster.up(real_node=True, registry=registry)
    print(f"[demo] control plane and node `local` ready in {time.monotonic() - t0:.1f}s", flush=True)
    s3 = s3_server(cluster)
    endpoint = S3Server.recorded_endpoint(s3.data_dir) or s3.start().endpoint
    prepare_data(endpoint)
    print(f"[demo] S3 server at {endpoint}: tiny model and arithmetic taskset uploaded", flush=True)
    install(cluster, refs["operator"])
    print(f"[demo] operator Deployment ready ({refs['operator']})", flush=True)
    if kubectl(cluster, "get", "rftjob", JOB, "-n", NAMESPACE, "--ignore-not-found", check=False).strip():
        print(f"[demo] deleting the previous {JOB} run", flush=True)
        kubectl(cluster, "delete", "rftjob", JOB, "-n", NAMESPACE, "--wait=true")
    clear_run(endpoint)
    # Job pods run only where Pod Security is enforced (manifests/base/admission-policies.yaml).
    kubectl(cluster, "label", "namespace", NAMESPACE, "pod-security.kubernetes.io/enforce=baseline", "--overwrite")
    print(kubectl(cluster, "apply", "-k", str(sample_overlay(cluster, refs["trainer"], endpoint))).rstrip(),
          flush=True)
    st = watch(cluster, "Succeeded", timeout)
    elapsed = time.monotonic() - t0
    trainer, ws = st.get("trainer") or {}, st.get("weightSync") or {}
    uri = f"s3://{BUCKET}/runs/demo"
    print(f"\n[demo] {JOB} Succeeded in {elapsed:.0f}s (from `up`)")
    print(f"[demo] checkpoints: {uri}/ckpt/  last: step {(trainer.get('lastCheckpoint') or {}).get('step')}")
    print(f"[demo] weights:     {uri}/weights/  versions {trainer.get('weightVersions')}, "
          f"served by {ws.get('synced')} replicas at version {(ws.get('target') or {}).get('version')}")
    os.environ.update({"AWS_ENDPOINT_URL": endpoint, **CREDS})
    png = write_curves(uri, cluster.state_dir.parent / "demo" / "curves.png")
    if png:
        print(f"[demo] reward/loss curves: {png}")
    board = fetch_tensorboard(uri, cluster.state_dir.parent / "demo" / "tensorboard")
    if board:
        print(f"[demo] TensorBoard:  {uri}/tensorboard/, copied to {board}: tensorboard --logdir {board}")
    print(f"\n  export KUBECONFIG={cluster.kubeconfig}")
    print(f"  kubectl get rftjob {JOB} -o yaml                 # the whole status")
    print(f"  kubectl logs {JOB}-trainer-1-0                   # a pod's log")
    print("  kubectl logs -n rftjob-system deploy/rftjob-operator")
    print("  make down")


def down(cluster: Cluster) -> None:
    """Stops the cluster and its node (undoing the host changes), S3 and the registry."""
    cluster.down()
    S3Server.stop_recorded(cluster.state_dir / "s3")
    Registry(REGISTRY_STATE_DIR).stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m e2e.demo")
    ap.add_argument("command", choices=["up", "down"])
    ap.add_argument("--state-dir", default=os.environ.get("RFT_STATE_DIR", DEFAULT_STATE_DIR))
    ap.add_argument("--timeout", type=float, default=900, help="seconds to wait for Succeeded")
    args = ap.parse_args(argv)
    cluster = Cluster(args.state_dir)
    try:
        up(cluster, args.timeout) if args.command == "up" else down(cluster)
    except (ClusterError, TimeoutError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
