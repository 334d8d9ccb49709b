"""`python -m rft_operator` / `rftjob-operator`: run the operator.

    rftjob-operator [--namespace NS ...] [--liveness http://0.0.0.0:8080/healthz]

Without --namespace it watches the whole cluster. Credentials: in a pod, its
ServiceAccount; elsewhere $KUBECONFIG.
"""

from __future__ import annotations

import argparse
import asyncio
import logging

import kopf

from . import handlers  # noqa: F401  (registers the kopf handlers)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="rftjob-operator", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--namespace", "-n", action="append", default=[],
                    help="watch only this namespace (repeatable); default: all")
    ap.add_argument("--liveness", default=None,
                    help="serve liveness probes here, e.g. http://0.0.0.0:8080/healthz")
    ap.add_argument("--log-format", choices=["plain", "json"], default="plain")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)

    kopf.configure(
        verbose=args.verbose,
        log_format=kopf.LogFormat.JSON if args.log_format == "json" else kopf.LogFormat.PLAIN,
    )
    if not args.verbose:  # one line per handled event is noise at hundreds of pods
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    asyncio.run(kopf.operator(
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        standalone=True,
        liveness_endpoint=args.liveness,
    ))


if __name__ == "__main__":
    main()
