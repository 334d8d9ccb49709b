"""`python -m rft_operator` / `rftjob-operator`: run the operator.

    rftjob-operator [--namespace NS ...] [--liveness http://0.0.0.0:8080/healthz]
                    [--metrics-port 9090]

Without --namespace it watches the whole cluster. Credentials: in a pod, its
ServiceAccount; elsewhere $KUBECONFIG. With --leader-elect, replicas elect one leader
through a Lease (`leader.py`); only it runs the handlers, the others wait. Prometheus metrics are served at
http://0.0.0.0:<metrics-port>/metrics (0 disables them). With --webhook-port, the owner
webhook (`ownerhook.py`) is served over HTTPS there with the pair in --webhook-cert-dir.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from urllib.parse import urlsplit

import kopf

from . import handlers  # noqa: F401  (registers the kopf handlers)
from . import leader, metrics, ownerhook
from .kube import load_config

# Not 8080: the image's default --liveness endpoint already listens there.
DEFAULT_METRICS_PORT = 9090


class RetryIsAWarning(logging.Filter):
    """kopf logs each failed API request it will retry ("Request attempt #1/9 failed; will
    retry", a 429 while the API server starts) at error level: a warning here, so that an
    error line always means something needs a person. The last attempt ("escalating")
    stays an error."""

    RETRIED = ("failed; will retry", "will re-authenticate")

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.ERROR and record.name.startswith("kopf") \
                and any(r in record.getMessage() for r in self.RETRIED):
            record.levelno, record.levelname = logging.WARNING, logging.getLevelName(logging.WARNING)
        return True


def _stop_waiting(signum: int, frame: object) -> None:
    logging.getLogger(__name__).info("stopping: SIGTERM while waiting for the leader lease")
    raise SystemExit(0)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="rftjob-operator", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--namespace", "-n", action="append", default=[],
                    help="watch only this namespace (repeatable); default: all")
    ap.add_argument("--liveness", default=None,
                    help="serve liveness probes here, e.g. http://0.0.0.0:8080/healthz")
    ap.add_argument("--metrics-port", type=int, default=DEFAULT_METRICS_PORT,
                    help=f"serve Prometheus /metrics on this port (default {DEFAULT_METRICS_PORT}; 0 disables)")
    ap.add_argument("--webhook-port", type=int, default=0,
                    help=f"serve the owner webhook on this port (0, the default: not at all; "
                         f"the install uses {ownerhook.DEFAULT_PORT})")
    ap.add_argument("--webhook-cert-dir", default=ownerhook.CERT_DIR,
                    help="the webhook's tls.crt and tls.key (default %(default)s)")
    ap.add_argument("--leader-elect", action="store_true",
                    help="run as one of several replicas: only the holder of the Lease acts")
    ap.add_argument("--leader-elect-namespace", default=None,
                    help="the Lease's namespace (default: $POD_NAMESPACE, else the ServiceAccount's)")
    ap.add_argument("--leader-elect-lease-name", default=leader.LEASE_NAME)
    timing = leader.Timing()
    ap.add_argument("--leader-elect-lease-duration", type=float, default=timing.lease_duration,
                    help="seconds a waiting replica waits for a renewal before it takes over (%(default)s)")
    ap.add_argument("--leader-elect-renew-deadline", type=float, default=timing.renew_deadline,
                    help="seconds without a renewal after which the leader exits; less than the "
                         "lease duration (%(default)s)")
    ap.add_argument("--leader-elect-retry-period", type=float, default=timing.retry_period,
                    help="seconds between tries to take or renew the Lease (%(default)s)")
    ap.add_argument("--log-format", choices=["plain", "json"], default="plain")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)
    if args.metrics_port and args.liveness and urlsplit(args.liveness).port == args.metrics_port:
        ap.error(f"--metrics-port {args.metrics_port} is the --liveness port; pick another")
    elector = None
    if args.leader_elect:
        try:
            timing = leader.Timing(args.leader_elect_lease_duration, args.leader_elect_renew_deadline,
                                   args.leader_elect_retry_period)
            namespace = leader.own_namespace(args.leader_elect_namespace)
        except leader.LeaderElectionError as e:
            ap.error(str(e))

    kopf.configure(
        verbose=args.verbose,
        log_format=kopf.LogFormat.JSON if args.log_format == "json" else kopf.LogFormat.PLAIN,
    )
    if not args.verbose:  # one line per handled event is noise at hundreds of pods
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    for handler in logging.getLogger().handlers:
        handler.addFilter(RetryIsAWarning())
    try:
        tunables = handlers.settings_from_env(os.environ)  # RFT_RESYNC_SECONDS, RFT_WORKERS: read once
    except ValueError as e:
        ap.error(str(e))
    memo = handlers.Memo(namespaces=list(args.namespace), **tunables)
    if args.metrics_port:
        metrics.serve(args.metrics_port, lambda: getattr(memo.controller, "metrics", None))
    if args.webhook_port or args.leader_elect:
        load_config()
    if args.webhook_port:  # on every replica: the API server calls whichever the Service picks
        import kubernetes

        ownerhook.OwnerWebhook(args.webhook_port, args.webhook_cert_dir,
                               ownerhook.api_get_job(kubernetes.client.ApiClient()))
    if args.leader_elect:
        elector = leader.Elector(leader.LeaseClient(namespace, args.leader_elect_lease_name,
                                                    timing.request_timeout), leader.identity(), timing)
        # As PID 1 in its container the process ignores SIGTERM until kopf handles it: a
        # waiting replica would hold every rollout and drain for the grace period.
        signal.signal(signal.SIGTERM, _stop_waiting)
        health = leader.FollowerHealth(args.liveness, elector.waiting_healthy) if args.liveness else None
        leading = elector.acquire()  # blocks while another replica leads
        if health is not None:
            health.close()
        if not leading:
            return
        elector.keep()  # exits the process if leadership is lost
    try:
        asyncio.run(kopf.operator(
            clusterwide=not args.namespace,
            namespaces=args.namespace,
            standalone=True,
            liveness_endpoint=args.liveness,
            memo=memo,
        ))
    finally:
        if elector is not None:
            elector.release()


if __name__ == "__main__":
    main()
