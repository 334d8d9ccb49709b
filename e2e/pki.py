"""Certificates, keys and kubeconfigs for the local control plane (no openssl CLI)."""

from __future__ import annotations

import base64
import datetime as dt
import ipaddress
from pathlib import Path

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from .host import write_private

SERVICE_IP = "10.96.0.1"  # first address of the service CIDR: the `kubernetes` Service


def _new_key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def _key_pem(key: rsa.RSAPrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.TraditionalOpenSSL,
        serialization.NoEncryption(),
    )


def _cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _certificate(subject: str, key, issuer_cert, issuer_key, *, ca: bool, sans=(),
                 client_org: str | None = None) -> x509.Certificate:
    """Signs a certificate valid for a year with the extensions strict verifiers require.

    With `client_org` it is a client certificate (Kubernetes reads O as the group; an
    empty one means no group)."""
    now = dt.datetime.now(dt.timezone.utc)
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, subject)]
    if client_org:
        attrs.insert(0, x509.NameAttribute(NameOID.ORGANIZATION_NAME, client_org))
    name = x509.Name(attrs)
    issuer_name = issuer_cert.subject if issuer_cert is not None else name
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=365))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()), critical=False
        )
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, key_encipherment=not ca, key_cert_sign=ca, crl_sign=ca,
                content_commitment=False, data_encipherment=False, key_agreement=False,
                encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
    )
    if client_org is not None:
        builder = builder.add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
    elif not ca:
        builder = builder.add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False
        ).add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def write_pki(pki: Path, advertise_ip: str) -> None:
    """Creates the cluster CA, the API server's serving cert, the SA signing key and a
    request-header CA."""
    pki.mkdir(parents=True, exist_ok=True)
    ca_key = _new_key()
    ca_cert = _certificate("rftjob-local-ca", ca_key, None, ca_key, ca=True)
    sans = [x509.DNSName(n) for n in (
        "localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
        "kubernetes.default.svc.cluster.local",
    )] + [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ("127.0.0.1", SERVICE_IP, advertise_ip)]
    server_key = _new_key()
    server_cert = _certificate("kube-apiserver", server_key, ca_cert, ca_key, ca=False, sans=sans)
    sa_key = _new_key()
    # Its private key is thrown away: nothing here may act as an aggregation front proxy.
    front_proxy_key = _new_key()
    front_proxy_ca = _certificate("rftjob-front-proxy-ca", front_proxy_key, None, front_proxy_key, ca=True)

    (pki / "front-proxy-ca.crt").write_bytes(_cert_pem(front_proxy_ca))
    (pki / "ca.crt").write_bytes(_cert_pem(ca_cert))
    write_private(pki / "ca.key", _key_pem(ca_key))
    (pki / "apiserver.crt").write_bytes(_cert_pem(server_cert))
    write_private(pki / "apiserver.key", _key_pem(server_key))
    write_private(pki / "sa.key", _key_pem(sa_key))
    (pki / "sa.pub").write_bytes(
        sa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )


def write_client_cert(pki: Path, name: str, user: str, group: str) -> tuple[Path, Path]:
    """Signs a client certificate for `user` in `group` ("": none) with the cluster CA; returns the
    (cert, key) paths `pki/<name>.crt` and `pki/<name>.key`."""
    ca_cert = x509.load_pem_x509_certificate((pki / "ca.crt").read_bytes())
    ca_key = serialization.load_pem_private_key((pki / "ca.key").read_bytes(), password=None)
    key = _new_key()
    cert = _certificate(user, key, ca_cert, ca_key, ca=False, client_org=group)
    (pki / f"{name}.crt").write_bytes(_cert_pem(cert))
    write_private(pki / f"{name}.key", _key_pem(key))
    return pki / f"{name}.crt", pki / f"{name}.key"


def write_kubeconfig(path: Path, server: str, ca_pem: bytes, user: str, token: str) -> Path:
    """Writes a self-contained (CA embedded) token kubeconfig, readable by the owner only."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "rftjob-local", "cluster": {
            "server": server,
            "certificate-authority-data": base64.b64encode(ca_pem).decode(),
        }}],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": "rftjob-local", "context": {"cluster": "rftjob-local", "user": user}}],
        "current-context": "rftjob-local",
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    write_private(path, yaml.safe_dump(config, sort_keys=False).encode())
    return path


def write_serving_pair(directory: Path, hosts: list[str]) -> Path:
    """A new CA and a serving certificate it signs for `hosts` (IP addresses or DNS names),
    for a host-process webhook the API server calls by `url:` (e2e/kueue.py): writes
    `directory/{ca.crt,tls.crt,tls.key}` (the layout controller-runtime's webhook server
    reads) and returns `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key = _new_key()
    ca_cert = _certificate(f"{hosts[0]}-ca", ca_key, None, ca_key, ca=True)
    sans = []
    for host in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            sans.append(x509.DNSName(host))
    key = _new_key()
    cert = _certificate(hosts[0], key, ca_cert, ca_key, ca=False, sans=sans)
    (directory / "ca.crt").write_bytes(_cert_pem(ca_cert))
    (directory / "tls.crt").write_bytes(_cert_pem(cert))
    write_private(directory / "tls.key", _key_pem(key))
    return directory
