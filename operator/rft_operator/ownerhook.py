"""The owner webhook: what the operator's identity creates must belong to an RFTJob that exists.

    python -m rft_operator.ownerhook install [--namespace rftjob-system] | kubectl apply --server-side -f -

`rftjob-operator-owner` (a ValidatingAdmissionPolicy) checks a new child of the operator
against each RFTJob of its namespace, one at a time: a uid that is not its job's, a Secret
or claim that job's spec does not name, anything in a namespace without an RFTJob. What no
policy can see is that *no* RFTJob of the namespace has the name an object claims: beside
a real job `demo`, a made-up job `ghost` passes every evaluation, and a leaked operator
token could start a pod for it that reads any Secret of the namespace.

This webhook closes that gap: for a CREATE by the operator's ServiceAccount of an object
labelled as the operator's, it GETs the RFTJob the object's job label names and refuses
unless that RFTJob exists and every owner reference (an Event's object) carries its uid.
The policy then checks the rest against that very job. The webhook is registered only for
that identity and those labels (a matchCondition and an objectSelector), so nothing else in
the cluster waits on it; it fails closed (an operator that cannot answer creates nothing,
and its own writes are retried).

The operator serves it (`--webhook-port`, `--webhook-cert-dir` holding tls.crt and tls.key,
re-read when they change, so a rotated Secret needs no restart); `install` prints a
self-signed CA's serving Secret and the ValidatingWebhookConfiguration that trusts it.
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import json
import logging
import ssl
import sys
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml

from rft_contract import names

log = logging.getLogger("rft_operator.ownerhook")

WEBHOOK_NAME = "rftjob-operator-owner"
SERVICE_NAME = "rftjob-operator-webhook"
TLS_SECRET = "rftjob-operator-webhook-tls"
OPERATOR_NAMESPACE = "rftjob-system"
PATH = "/validate-owner"
DEFAULT_PORT = 9443
# An AdmissionReview of the biggest pod the operator renders is a few KiB; anything this
# large is not one (the port is reachable from the pod network, unauthenticated).
MAX_BODY = 2 << 20
MAX_CONCURRENT = 16  # requests answered at once; the API server retries a refused connection
CERT_DIR = "/etc/rftjob-operator/webhook"
# Kinds the operator creates for a job (plural resource -> API group).
RESOURCES = {"pods": "", "services": "", "configmaps": "", "serviceaccounts": "", "events": "",
             "roles": "rbac.authorization.k8s.io", "rolebindings": "rbac.authorization.k8s.io"}
EVENTS_V1 = "events.k8s.io"

# (namespace, name) -> the RFTJob as a dict, or None when there is none.
GetJob = Callable[[str, str], "dict[str, Any] | None"]


def claims(obj: dict[str, Any], resource: str) -> tuple[str, list[str]]:
    """The job an object claims to belong to (its job label) and the uids it claims for it:
    its owner references', or an Event's object's (core `involvedObject`, events.k8s.io
    `regarding`)."""
    meta = obj.get("metadata") or {}
    job = (meta.get("labels") or {}).get(names.LABEL_JOB, "")
    if resource == "events":
        about = obj.get("involvedObject") or obj.get("regarding") or {}
        return job, [about.get("uid") or ""]
    return job, [r.get("uid") or "" for r in meta.get("ownerReferences") or []]


def check(namespace: str, obj: dict[str, Any], resource: str, get_job: GetJob) -> str | None:
    """Why the object may not be created (None: it may). `get_job` raising is not an answer:
    the caller refuses with what it raised."""
    job, uids = claims(obj, resource)
    if not job:
        return f"the rftjob-operator's objects carry the label {names.LABEL_JOB}"
    found = get_job(namespace, job)
    if found is None:
        return (f"the rftjob-operator's objects belong to an RFTJob that exists: there is no RFTJob "
                f"{namespace}/{job}")
    uid = (found.get("metadata") or {}).get("uid")
    if not uids or any(u != uid for u in uids):
        # (Not the uid itself: anyone on the pod network can ask this server.)
        return (f"the rftjob-operator's objects belong to an RFTJob that exists: the uid the object claims "
                f"({', '.join(u or '(none)' for u in uids) or 'no owner'}) is not RFTJob {namespace}/{job}'s")
    return None


def review(body: dict[str, Any], get_job: GetJob) -> dict[str, Any]:
    """An AdmissionReview answered: allowed, or refused with a message that says why."""
    request = body.get("request") or {}
    response: dict[str, Any] = {"uid": request.get("uid", ""), "allowed": True}
    if request.get("operation") == "CREATE":
        resource = (request.get("resource") or {}).get("resource", "")
        try:
            reason = check(request.get("namespace") or "", request.get("object") or {}, resource, get_job)
        except Exception as e:  # noqa: BLE001 - fail closed, and say why
            reason = f"cannot look the RFTJob up: {type(e).__name__}: {e}"
            log.warning("owner webhook: %s", reason)
        if reason is not None:
            response = {"uid": response["uid"], "allowed": False,
                        "status": {"code": 403, "reason": "Forbidden", "message": reason}}
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response}


def api_get_job(api_client: Any) -> GetJob:
    """`GetJob` over the API server, with the operator's own credentials."""
    import kubernetes

    custom = kubernetes.client.CustomObjectsApi(api_client)

    def get(namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return custom.get_namespaced_custom_object(names.GROUP, names.VERSION, namespace, names.PLURAL, name,
                                                       _request_timeout=(3, 5))
        except kubernetes.client.ApiException as e:
            if e.status == 404:
                return None
            raise

    return get


class _Certificates:
    """The serving certificate, loaded again when its files change (a rotated Secret)."""

    def __init__(self, cert_dir: Path):
        self.cert, self.key = cert_dir / "tls.crt", cert_dir / "tls.key"
        self._lock = threading.Lock()
        self._stamp: tuple[float, float] | None = None
        self.context = self._load()

    def _stamp_now(self) -> tuple[float, float]:
        return self.cert.stat().st_mtime, self.key.stat().st_mtime

    def _load(self) -> ssl.SSLContext:
        stamp = self._stamp_now()  # before reading: a change while loading is seen next time
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self.cert, self.key)
        context.sni_callback = self._fresh
        self._stamp = stamp
        return context

    def _fresh(self, sock: ssl.SSLSocket, _server_name: str | None, _context: ssl.SSLContext) -> None:
        try:
            stamp = self._stamp_now()
            with self._lock:
                if stamp != self._stamp:
                    self.context = self._load()
                    log.info("owner webhook: loaded the rotated certificate from %s", self.cert.parent)
            sock.context = self.context
        except (OSError, ssl.SSLError) as e:  # half-written files: keep the old pair
            log.warning("owner webhook: keeping the loaded certificate (%s)", e)


class OwnerWebhook:
    """The HTTPS server, on daemon threads; `stop()` ends it."""

    def __init__(self, port: int, cert_dir: str | Path, get_job: GetJob, addr: str = "0.0.0.0"):
        certificates = _Certificates(Path(cert_dir))

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                if self.path.split("?", 1)[0] != PATH:
                    self.send_error(404)
                    return
                try:
                    length = int(self.headers.get("Content-Length") or 0)
                except ValueError:
                    length = -1
                if not 0 < length <= MAX_BODY:
                    self.send_error(413 if length > MAX_BODY else 400, "not an AdmissionReview")
                    return
                try:
                    body = json.loads(self.rfile.read(length))
                except ValueError:
                    self.send_error(400, "not an AdmissionReview")
                    return
                if not isinstance(body, dict):
                    self.send_error(400, "not an AdmissionReview")
                    return
                out = json.dumps(review(body, get_job)).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, fmt: str, *args: Any) -> None:
                log.debug("owner webhook: " + fmt, *args)

        slots = threading.BoundedSemaphore(MAX_CONCURRENT)

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def get_request(self):
                sock, address = super().get_request()
                return certificates.context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False), address

            def process_request(self, request, client_address) -> None:
                if not slots.acquire(blocking=False):  # busy: close rather than queue threads
                    self.shutdown_request(request)
                    return
                try:
                    super().process_request(request, client_address)
                except BaseException:
                    slots.release()
                    raise

            def process_request_thread(self, request, client_address) -> None:
                try:
                    super().process_request_thread(request, client_address)
                finally:
                    slots.release()

            def finish_request(self, request, client_address) -> None:
                try:
                    request.settimeout(10)
                    request.do_handshake()
                except (OSError, ssl.SSLError) as e:
                    log.debug("owner webhook: handshake with %s failed: %s", client_address, e)
                    return
                super().finish_request(request, client_address)

        self.server = Server((addr, port), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, name="owner-webhook", daemon=True).start()
        log.info("serving the owner webhook on %s:%d%s", addr, self.port, PATH)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# ---------------------------------------------------------------- what an installer applies


def webhook_configuration(ca_bundle: bytes, *, service: tuple[str, str] | None = (OPERATOR_NAMESPACE, SERVICE_NAME),
                          url: str | None = None, namespace_selector: dict | None = None) -> dict[str, Any]:
    """The ValidatingWebhookConfiguration: CREATE of the operator's labelled objects, by its
    identity only, answered by the operator (`service`) or at `url` (tests), failing closed."""
    from .policygen import OPERATOR_IDENTITY
    from .queueing import GROUP as KUEUE_GROUP, VERSION as KUEUE_VERSION

    client: dict[str, Any] = {"caBundle": base64.b64encode(ca_bundle).decode()}
    if url is not None:
        client["url"] = url + PATH
    else:
        client["service"] = {"namespace": service[0], "name": service[1], "path": PATH, "port": 443}
    rules = [{"apiGroups": [group], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": [plural],
              "scope": "Namespaced"} for plural, group in RESOURCES.items()]
    rules.append({"apiGroups": [EVENTS_V1], "apiVersions": ["v1"], "operations": ["CREATE"],
                  "resources": ["events"], "scope": "Namespaced"})
    rules.append({"apiGroups": [KUEUE_GROUP], "apiVersions": [KUEUE_VERSION], "operations": ["CREATE"],
                  "resources": ["workloads"], "scope": "Namespaced"})  # a queued job's (queueing.py)
    hook: dict[str, Any] = {
        "name": f"{WEBHOOK_NAME}.{names.GROUP}",
        "clientConfig": client,
        "rules": rules,
        "objectSelector": {"matchLabels": {names.LABEL_MANAGED_BY: names.MANAGED_BY}},
        "matchConditions": [OPERATOR_IDENTITY],
        "failurePolicy": "Fail",
        "sideEffects": "None",
        "timeoutSeconds": 10,
        "admissionReviewVersions": ["v1"],
    }
    if namespace_selector is not None:
        hook["namespaceSelector"] = namespace_selector
    return {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
            "metadata": {"name": WEBHOOK_NAME}, "webhooks": [hook]}


def serving_pair(hosts: list[str], days: int = 3650) -> tuple[bytes, bytes, bytes]:
    """A new CA and a serving certificate for `hosts` (DNS names or IP addresses) it signs:
    (ca.crt, tls.crt, tls.key), PEM."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = dt.datetime.now(dt.timezone.utc)

    def build(subject: str, key, issuer: x509.Name, signer, ca: bool):
        usage = dict(digital_signature=not ca, content_commitment=False, key_encipherment=False,
                     data_encipherment=False, key_agreement=False, key_cert_sign=ca, crl_sign=ca,
                     encipher_only=False, decipher_only=False)
        b = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
             .issuer_name(issuer).public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
             .add_extension(x509.KeyUsage(**usage), critical=True)
             .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
             .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(signer.public_key()), critical=False))
        if not ca:
            alt_names: list[x509.GeneralName] = []
            for h in hosts:
                try:
                    alt_names.append(x509.IPAddress(ipaddress.ip_address(h)))
                except ValueError:
                    alt_names.append(x509.DNSName(h))
            b = (b.add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
                 .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False))
        return b.sign(signer, hashes.SHA256())

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = build(f"{WEBHOOK_NAME}-ca", ca_key, x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{WEBHOOK_NAME}-ca")]),
               ca_key, ca=True)
    cert = build(hosts[0], key, ca.subject, ca_key, ca=False)
    pem = serialization.Encoding.PEM
    return (ca.public_bytes(pem), cert.public_bytes(pem),
            key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))


def install_manifests(namespace: str = OPERATOR_NAMESPACE) -> str:
    """The serving Secret and the webhook configuration, for `kubectl apply --server-side -f -`
    (server-side: a client-side apply would copy the key into an annotation)."""
    ca, cert, key = serving_pair([f"{SERVICE_NAME}.{namespace}.svc", f"{SERVICE_NAME}.{namespace}.svc.cluster.local"])
    secret = {"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
              "metadata": {"name": TLS_SECRET, "namespace": namespace},
              "data": {"tls.crt": base64.b64encode(cert).decode(), "tls.key": base64.b64encode(key).decode()}}
    return yaml.safe_dump_all([secret, webhook_configuration(ca, service=(namespace, SERVICE_NAME))],
                              sort_keys=False)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m rft_operator.ownerhook", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    install = sub.add_parser("install", help="print the serving Secret (a new self-signed CA) and the "
                                             "ValidatingWebhookConfiguration that trusts it")
    install.add_argument("--namespace", default=OPERATOR_NAMESPACE, help="the operator's namespace")
    args = ap.parse_args(argv)
    if args.command == "install":
        sys.stdout.write(install_manifests(args.namespace))


if __name__ == "__main__":
    main()
