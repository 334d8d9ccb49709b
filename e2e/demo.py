"""`make demo`: a real RFTJob on this machine, end to end, no Docker and no GPU.

    python -m e2e.demo up      # cluster + S3 + pod runner + operator + sample job, until Succeeded
    python -m e2e.demo down    # stop everything it started

What runs: the local control plane (e2e/cluster.py), an S3-compatible server (moto) on
127.0.0.1:$RFT_DEMO_S3_PORT (default 39000), the pod runner (e2e/podrunner/: the
kubelet of node `local`, running pods as host processes), and the operator as a host
process with the identity of its Deployment (the `rftjob-operator` ServiceAccount from
manifests/base/rbac.yaml). The sample RFTJob (manifests/samples/) trains a tiny random Qwen2
with GRPO on an arithmetic taskset: 2 trainer pods, 2 inference replicas, 1 explorer.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .background import Background, python, wait_until
from .cluster import DEFAULT_STATE_DIR, REPO_ROOT, Cluster, ClusterError

JOB, NAMESPACE, BUCKET = "demo", "default", "rft-demo"
S3_PORT = int(os.environ.get("RFT_DEMO_S3_PORT", "39000"))
ENDPOINT = f"http://127.0.0.1:{S3_PORT}"
CREDS = {"AWS_ACCESS_KEY_ID": "rftdemo", "AWS_SECRET_ACCESS_KEY": "rftdemo-secret-change-me",
         "AWS_REGION": "us-east-1", "AWS_DEFAULT_REGION": "us-east-1"}


def kubectl(cluster: Cluster, *args: str, check: bool = True, input: str | None = None) -> str:
    out = subprocess.run(["kubectl", f"--kubeconfig={cluster.kubeconfig}", *args],
                         capture_output=True, text=True, input=input)
    if check and out.returncode != 0:
        raise ClusterError(f"kubectl {' '.join(args)}: {out.stderr.strip()}")
    return out.stdout


# ------------------------------------------------------------------ the helper processes


def s3_server(cluster: Cluster, port: int = S3_PORT) -> Background:
    return Background("s3", cluster.state_dir, python("-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)),
                      marker="moto.server")


def pod_runner(cluster: Cluster) -> Background:
    return Background("podrunner", cluster.state_dir,
                      python("-m", "e2e.podrunner", "--kubeconfig", str(cluster.kubeconfig),
                             "--state-dir", str(cluster.state_dir / "podrunner")), marker="e2e.podrunner")


def operator(cluster: Cluster) -> Background:
    kc = cluster.state_dir / "operator.kubeconfig"  # written by up() (needs a running cluster)
    return Background("operator", cluster.state_dir, python("-m", "rft_operator", "--log-format=json"),
                      marker="rft_operator", env={"KUBECONFIG": str(kc)})


def install(cluster: Cluster) -> None:
    """CRD, RBAC and admission policies from the real manifests (the Deployment is replaced by a
    host process)."""
    for f in ("manifests/base/namespace.yaml", "crds/rftjob.yaml", "manifests/base/rbac.yaml",
              "manifests/base/admission-policies.yaml"):
        kubectl(cluster, "apply", "--server-side", "-f", str(REPO_ROOT / f))
    kubectl(cluster, "wait", "--for=condition=Established", "crd/rftjobs.rft.dev", "--timeout=60s")


def s3_client(endpoint: str = ENDPOINT):
    import boto3

    return boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=CREDS["AWS_ACCESS_KEY_ID"],
                        aws_secret_access_key=CREDS["AWS_SECRET_ACCESS_KEY"], region_name="us-east-1")


def prepare_data(endpoint: str = ENDPOINT, bucket: str = BUCKET, num_tasks: int = 256) -> None:
    """The tiny model and the taskset the sample job reads, created here (no downloads)."""
    from rft_rollout.tasksets import arithmetic
    from tests.fixtures.models import save_tiny_model

    s3 = s3_client(endpoint)
    wait_until(lambda: _reachable(s3), 30, f"the S3 server at {endpoint}")
    if bucket not in [b["Name"] for b in s3.list_buckets().get("Buckets", [])]:
        s3.create_bucket(Bucket=bucket)
    with tempfile.TemporaryDirectory() as tmp:
        model = save_tiny_model(Path(tmp) / "tiny", seed=0)
        for f in sorted(model.iterdir()):
            s3.upload_file(str(f), bucket, f"models/tiny/{f.name}")
    lines = "".join(json.dumps(t) + "\n" for t in arithmetic(num_tasks, seed=0))
    s3.put_object(Bucket=bucket, Key="data/arith.jsonl", Body=lines.encode())


def clear_run(endpoint: str = ENDPOINT, bucket: str = BUCKET, prefix: str = "runs/demo/") -> None:
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
    raise ClusterError(f"{JOB} did not reach {until} within {timeout:.0f}s; "
                       f"see {cluster.logs_dir}/operator.log and {cluster.state_dir}/podrunner/")


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
    cluster.up()
    print(f"[demo] control plane ready in {time.monotonic() - t0:.1f}s", flush=True)
    install(cluster)
    s3 = s3_server(cluster)
    s3.start()
    prepare_data()
    print(f"[demo] S3 server at {ENDPOINT}: tiny model and arithmetic taskset uploaded", flush=True)
    cluster.service_account_kubeconfig("rftjob-system", "rftjob-operator",
                                       cluster.state_dir / "operator.kubeconfig")
    for proc in (pod_runner(cluster), operator(cluster)):
        proc.start()
    wait_until(lambda: kubectl(cluster, "get", "node", "local", check=False), 60, "node `local`")
    if kubectl(cluster, "get", "rftjob", JOB, "-n", NAMESPACE, "--ignore-not-found", check=False).strip():
        print(f"[demo] deleting the previous {JOB} run", flush=True)
        kubectl(cluster, "delete", "rftjob", JOB, "-n", NAMESPACE, "--wait=true")
    clear_run()
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig)}
    print(subprocess.run(["kubectl", "apply", "-k", str(REPO_ROOT / "manifests" / "samples")],
                         env=env, capture_output=True, text=True, check=True).stdout.rstrip(), flush=True)
    st = watch(cluster, "Succeeded", timeout)
    elapsed = time.monotonic() - t0
    trainer, ws = st.get("trainer") or {}, st.get("weightSync") or {}
    uri = f"s3://{BUCKET}/runs/demo"
    print(f"\n[demo] {JOB} Succeeded in {elapsed:.0f}s (from a cold `up`)")
    print(f"[demo] checkpoints: {uri}/ckpt/  last: step {(trainer.get('lastCheckpoint') or {}).get('step')}")
    print(f"[demo] weights:     {uri}/weights/  versions {trainer.get('weightVersions')}, "
          f"served by {ws.get('synced')} replicas at version {(ws.get('target') or {}).get('version')}")
    os.environ.update({"AWS_ENDPOINT_URL": ENDPOINT, **CREDS})
    png = write_curves(uri, cluster.state_dir.parent / "demo" / "curves.png")
    if png:
        print(f"[demo] reward/loss curves: {png}")
    print(f"\n  export KUBECONFIG={cluster.kubeconfig}")
    print(f"  kubectl get rftjob {JOB} -o yaml       # the whole status")
    print(f"  python -m e2e.podrunner logs {NAMESPACE}/{JOB}-trainer-1-0   # a pod's log")
    print("  make down")


def down(cluster: Cluster) -> None:
    for proc in (operator(cluster), pod_runner(cluster), s3_server(cluster)):
        proc.stop()
    cluster.down()


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
