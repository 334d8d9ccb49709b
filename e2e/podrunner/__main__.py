"""The pod runner's command line: `python -m e2e.podrunner [run] ...` and `... logs ...`."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

from . import __doc__ as PACKAGE_DOC
from .common import DEFAULT_NODE, DEFAULT_STATE_DIR, PodRunnerError, _kv, log
from .logserver import find_log, glob_escape
from .runner import PodRunner


def _logs_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.podrunner logs",
                                     description="Print a container's log of a pod run by the pod runner.")
    parser.add_argument("pod", help="NAMESPACE/POD")
    parser.add_argument("container", nargs="?", help="container (default: the only one)")
    parser.add_argument("-f", "--follow", action="store_true", help="keep printing new output")
    parser.add_argument("--state-dir", default=os.environ.get("RFT_PODRUNNER_STATE_DIR", DEFAULT_STATE_DIR))
    args = parser.parse_args(argv)
    if "/" not in args.pod:
        parser.error("pod must be NAMESPACE/POD")
    ns, name = args.pod.split("/", 1)
    path = find_log(args.state_dir, ns, name, args.container)
    if path is None:
        pod_dirs = list(Path(args.state_dir, "pods").glob(f"{glob_escape(ns)}_{glob_escape(name)}_*"))
        containers = sorted({p.stem for d in pod_dirs for p in d.glob("*.log")})
        hint = f" (containers: {', '.join(containers)})" if containers else ""
        print(f"error: no log for {args.pod}{' container ' + args.container if args.container else ''}"
              f" under {Path(args.state_dir) / 'pods'}{hint}", file=sys.stderr)
        return 1
    out = sys.stdout.buffer
    with open(path, "rb") as f:
        while True:
            chunk = f.read(65536)
            if chunk:
                out.write(chunk)
                out.flush()
            elif args.follow:
                time.sleep(0.3)
            else:
                return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "logs":
        return _logs_main(argv[1:])
    if argv and argv[0] == "run":
        argv = argv[1:]
    parser = argparse.ArgumentParser(prog="python -m e2e.podrunner",
                                     description=PACKAGE_DOC.split("\n")[0],
                                     epilog="Also: python -m e2e.podrunner logs NAMESPACE/POD [CONTAINER]")
    parser.add_argument("--kubeconfig", default=os.environ.get("KUBECONFIG"),
                        help="admin kubeconfig of the cluster (default: $KUBECONFIG)")
    parser.add_argument("--node", default=DEFAULT_NODE, help="node name (default: %(default)s)")
    parser.add_argument("--state-dir", default=os.environ.get("RFT_PODRUNNER_STATE_DIR", DEFAULT_STATE_DIR),
                        help="pod directories, logs and the runner's log (default: %(default)s)")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    args = parser.parse_args(argv)
    if not args.kubeconfig:
        parser.error("--kubeconfig (or $KUBECONFIG) is required")
    stderr = logging.StreamHandler(sys.stderr)
    stderr.setFormatter(logging.Formatter("[podrunner] %(levelname)s %(message)s"))
    log.addHandler(stderr)
    log.setLevel(logging.DEBUG if args.verbose else logging.INFO)
    log.propagate = False

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    runner = PodRunner(args.kubeconfig, node=args.node, state_dir=args.state_dir)
    try:
        runner.start()
    except PodRunnerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    log.info(_kv("runner.ready", logs=runner.state_dir / "pods", hint="python -m e2e.podrunner logs NS/POD"))
    try:
        stop.wait()
    finally:
        runner.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
