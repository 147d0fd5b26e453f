"""A run's own private CA, for a syncer that serves HTTPS without a certificate Secret of the
user's (`syncer.tls` without `secretName`): one CA and one serving certificate, made together.

The CA's key signs the syncer's certificate and is then dropped: it is in no Secret and in no
memory after this call, so nothing can mint another certificate this run's learners would
trust. What goes into the run's `kubernetes.io/tls` Secret: `tls.crt`, `tls.key` (the syncer's,
mounted in its containers only) and `ca.crt` (all learners get). Pure: keys from the OS's
randomness, times from the caller."""

from __future__ import annotations

import datetime
import ipaddress

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_DAYS = 3650
SERVING_DAYS = 825  # what browsers accept; renew by deleting the Secret with the syncer


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def syncer_certificate(
    run: str, dns_names: list[str], ip_addresses: list[str], now: datetime.datetime
) -> dict[str, str]:
    """{"tls.crt", "tls.key", "ca.crt"} (PEM) for a syncer reached by these names."""
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name(f"{run} syncer CA (diloco-operator)")
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    alt_names: list[x509.GeneralName] = [x509.DNSName(n) for n in dns_names]
    alt_names += [x509.IPAddress(ipaddress.ip_address(a)) for a in ip_addresses]
    serving = (
        x509.CertificateBuilder()
        .subject_name(_name(f"{run}-syncer"))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=SERVING_DAYS))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    return {
        "tls.crt": serving.public_bytes(pem).decode(),
        "tls.key": key.private_bytes(
            pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ).decode(),
        "ca.crt": ca.public_bytes(pem).decode(),
    }
