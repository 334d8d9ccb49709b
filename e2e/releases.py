"""The previous release as a user has it installed, for the e2e tests that upgrade from it.

    python -m e2e.releases snapshot COMMIT   # writes e2e/releases/COMMIT/ from git history

A snapshot holds what a user installed from that commit, so that the tests need no git
history (CI's clone may have none) and read exactly what was shipped:
  * manifests/manifests.yaml: `kubectl kustomize manifests/` at that commit (the
    cluster-wide install, its CRD included), and a kustomization.yaml naming it, so that a
    test overlays the image and the node placement as it does for the current install
    (`demo.install(..., manifests=...)`);
  * chart/: charts/rftjob-operator at that commit without crds/ (the same CRD as the
    manifests', which `crd()` gives to apply first, as Helm did from crds/), tests/ and
    dashboards/ (read only when the Grafana dashboard is switched on);
  * pod-config/: what that release's pods load, run from its own code: `schema.json`, the
    JSON schema of its `JobConfig` (a trainer image of that release refuses a config this
    schema refuses), and `config.json`, the config its operator rendered for
    `pod-config-spec.yaml` (tests/unit/test_podconfig.py reads each against the other side).

The operator's image is this tree's: the previous release differs from it in its install
objects (the owner admission policy, no owner webhook) and not in the reconcile code
(`git diff 3ed90d1 -- operator/` touches only ownerhook.py, policygen.py and the CLI's
help), and the previous objects start the current image as they started theirs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from .cluster import REPO_ROOT

RELEASES = Path(__file__).resolve().parent / "releases"
# The last commit before the owner webhook was part of every install (stop 46 made it so):
# its installs refuse a ghost job with the policy rftjob-operator-owner, or not at all.
PREVIOUS = "3ed90d1"
CHART_LEFT_OUT = ("crds", "tests", "dashboards")


def manifests(release: str = PREVIOUS) -> Path:
    """The release's cluster-wide kustomize install (a kustomization directory)."""
    return _existing(RELEASES / release / "manifests")


def chart(release: str = PREVIOUS) -> Path:
    """The release's Helm chart (a chart directory)."""
    return _existing(RELEASES / release / "chart")


def crd(release: str = PREVIOUS) -> str:
    """The release's CRD (YAML), which its chart installed from crds/."""
    docs = yaml.safe_load_all((manifests(release) / "manifests.yaml").read_text())
    return yaml.safe_dump(next(d for d in docs if d and d["kind"] == "CustomResourceDefinition"), sort_keys=False)


def _existing(path: Path) -> Path:
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: write it with `python -m e2e.releases snapshot {path.parent.name}`")
    return path


def extract(commit: str, paths: list[str], dest: Path) -> None:
    """`paths` of the repository at `commit` into `dest` (git archive); a CalledProcessError
    when the commit is not in this clone's history."""
    archive = subprocess.run(["git", "-C", str(REPO_ROOT), "archive", commit, *paths], capture_output=True,
                             check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)


def snapshot(commit: str, root: Path = RELEASES) -> Path:
    """Writes root/COMMIT/ from the repository's history at `commit`."""
    out = root / commit
    with tempfile.TemporaryDirectory() as tmp:
        extract(commit, ["manifests", "crds", "charts/rftjob-operator"], Path(tmp))
        rendered = subprocess.run(["kubectl", "kustomize", f"{tmp}/manifests"], capture_output=True, text=True,
                                  check=True).stdout
        shutil.rmtree(out, ignore_errors=True)
        (out / "manifests").mkdir(parents=True)
        (out / "manifests" / "manifests.yaml").write_text(
            f"# `kubectl kustomize manifests/` at {commit} (e2e/releases.py)\n" + rendered)
        (out / "manifests" / "kustomization.yaml").write_text(yaml.safe_dump(
            {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
             "resources": ["manifests.yaml"]}, sort_keys=False))
        shutil.copytree(Path(tmp) / "charts/rftjob-operator", out / "chart",
                        ignore=lambda d, names: [n for n in names if Path(d).name == "rftjob-operator"
                                                 and n in CHART_LEFT_OUT])
        _snapshot_pod_config(commit, out / "pod-config")
    return out


POD_CONFIG_SPEC = RELEASES / "pod-config-spec.yaml"
_RENDER_POD_CONFIG = """
import json, sys, yaml
from rft_contract.config import JobConfig
from rft_contract.spec import parse_spec
from rft_operator.children import build_trainer_config
from rft_operator.objects import JobRef
spec = parse_spec(yaml.safe_load(open(sys.argv[1])))
print(json.dumps({"schema": JobConfig.model_json_schema(by_alias=False),  # the config is snake_case
                  "config": build_trainer_config(JobRef("demo", "team-a", "uid-1"), spec)}))
"""


def pod_config(release: str = PREVIOUS) -> tuple[dict, dict]:
    """The release's pods' config schema and the config it rendered for POD_CONFIG_SPEC."""
    d = _existing(RELEASES / release / "pod-config")
    return json.loads((d / "schema.json").read_text()), json.loads((d / "config.json").read_text())


def _snapshot_pod_config(commit: str, out: Path) -> None:
    """Runs the commit's contract and operator (from git history, in a subprocess of their
    own) on POD_CONFIG_SPEC."""
    with tempfile.TemporaryDirectory() as tmp:
        extract(commit, ["contract", "operator"], Path(tmp))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([f"{tmp}/contract", f"{tmp}/operator"])}
        got = json.loads(subprocess.run([sys.executable, "-c", _RENDER_POD_CONFIG, str(POD_CONFIG_SPEC)], env=env,
                                        cwd=tmp, capture_output=True, text=True, check=True).stdout)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("schema", "config"):
        (out / f"{name}.json").write_text(json.dumps(got[name], indent=1, sort_keys=True) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.releases", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    take = sub.add_parser("snapshot", help="write e2e/releases/COMMIT/ from git history")
    take.add_argument("commit")
    args = parser.parse_args(argv)
    print(snapshot(args.commit))
    return 0


if __name__ == "__main__":
    sys.exit(main())
