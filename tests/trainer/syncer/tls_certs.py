"""Certificates for the TLS tests, made on the spot with `cryptography`: a CA, server
certificates it signs (names as SANs, a chosen serial), written as PEM files."""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

LOCAL_NAMES = ("localhost", "127.0.0.1")


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _pem_cert(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _window() -> tuple[datetime.datetime, datetime.datetime]:
    now = datetime.datetime.now(datetime.UTC)
    return now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=1)


@dataclass(frozen=True)
class Leaf:
    key: bytes
    cert: bytes
    serial: int

    def write(self, folder: Path, name: str = "server") -> tuple[Path, Path]:
        """The pair as `name.crt` and `name.key`, each replaced atomically (a new inode, as a
        Secret volume's update makes)."""
        paths = folder / f"{name}.crt", folder / f"{name}.key"
        for path, data in zip(paths, (self.cert, self.key), strict=True):
            tmp = path.with_suffix(path.suffix + ".tmp")
            tmp.write_bytes(data)
            os.replace(tmp, path)
        return paths


class Ca:
    def __init__(self, name: str = "diloco test CA") -> None:
        self.key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        start, end = _window()
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(self.key, hashes.SHA256())
        )

    @property
    def pem(self) -> bytes:
        return _pem_cert(self.cert)

    def issue(self, serial: int, names: tuple[str, ...] = LOCAL_NAMES) -> Leaf:
        key = ec.generate_private_key(ec.SECP256R1())
        sans: list[x509.GeneralName] = []
        for name in names:
            try:
                sans.append(x509.IPAddress(ipaddress.ip_address(name)))
            except ValueError:
                sans.append(x509.DNSName(name))
        start, end = _window()
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(serial)
            .not_valid_before(start)
            .not_valid_after(end)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .sign(self.key, hashes.SHA256())
        )
        return Leaf(_pem_key(key), _pem_cert(cert), serial)


def write_bundle(path: Path, *cas: Ca) -> Path:
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(b"".join(ca.pem for ca in cas))
    os.replace(tmp, path)
    return path


def served_serial(port: int, ca_file: Path, host: str = "127.0.0.1") -> int:
    """The serial of the certificate a new connection to host:port is shown (verified)."""
    ctx = ssl.create_default_context(cafile=str(ca_file))
    with (
        socket.create_connection((host, port), timeout=5) as sock,
        ctx.wrap_socket(sock, server_hostname=host) as tls,
    ):
        cert = tls.getpeercert()
    assert cert is not None
    return int(str(cert["serialNumber"]), 16)
