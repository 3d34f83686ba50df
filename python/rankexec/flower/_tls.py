"""Certificates and node keys for a local Flower deployment with TLS and SuperNode
authentication, made on the spot (``rankexec.flower.deployment``, the tests).

Why: a production SuperLink runs with TLS (``--ssl-ca-certfile``, ``--ssl-certfile``,
``--ssl-keyfile``; nodes and ``flwr`` trust the CA through ``--root-certificates`` /
``root-certificates``) and often with SuperNode authentication
(``--enable-supernode-auth``: each SuperNode signs its requests with its own EC key,
``--auth-supernode-private-key``, whose public half is registered with ``flwr supernode
register``). The tests run that shape offline with a CA made for them.

Caveats: for tests only: a one-day CA and server certificate for ``127.0.0.1`` and
``localhost``, unencrypted keys (mode 0600), made with ``cryptography`` (a dependency
of flwr).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["NodeKey", "TlsFiles", "make_node_key", "make_tls"]


@dataclass(frozen=True)
class TlsFiles:
    """The CA's certificate and the SuperLink's certificate and key (PEM files)."""

    ca_cert: Path
    server_cert: Path
    server_key: Path


@dataclass(frozen=True)
class NodeKey:
    """A SuperNode's key pair: OpenSSH EC private key and public key files."""

    private: Path
    public: Path


def _write(path: Path, data: bytes, mode: int = 0o644) -> Path:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return path


def make_tls(directory: Path, host: str = "127.0.0.1") -> TlsFiles:
    """A CA and a server certificate for ``host`` (and ``localhost``) under ``directory``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=1)

    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "rankexec test CA")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )

    key = ec.generate_private_key(ec.SECP384R1())
    names: list[x509.GeneralName] = [x509.DNSName("localhost")]
    try:
        names.append(x509.IPAddress(ipaddress.ip_address(host)))
    except ValueError:
        names.append(x509.DNSName(host))
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    return TlsFiles(
        ca_cert=_write(directory / "ca.crt", ca_cert.public_bytes(pem)),
        server_cert=_write(directory / "server.pem", cert.public_bytes(pem)),
        server_key=_write(
            directory / "server.key",
            key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
            0o600,
        ),
    )


def make_node_key(directory: Path, name: str) -> NodeKey:
    """An EC key pair for a SuperNode, in OpenSSH format (``ssh-keygen -t ecdsa``)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    directory.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP384R1())
    private = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.OpenSSH,
        serialization.NoEncryption(),
    )
    public = key.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    )
    return NodeKey(
        private=_write(directory / name, private, 0o600),
        public=_write(directory / f"{name}.pub", public + b"\n"),
    )
