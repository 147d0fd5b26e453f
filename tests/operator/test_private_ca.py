"""The operator-made syncer certificate (`syncer.tls` without `secretName`): a real TLS handshake
with it, names that learners and away clusters dial, and a CA whose key is nowhere."""

from __future__ import annotations

import datetime
import socket
import ssl
import threading
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from diloco_operator.api import parse_spec
from diloco_operator.k8s import builders, private_ca, run_secrets
from diloco_operator.k8s.cross_cluster import ca_source

NOW = datetime.datetime(2026, 12, 5, tzinfo=datetime.UTC)


def run_with(tls: dict[str, object]) -> builders.Run:
    spec = parse_spec(
        {
            "image": "t",
            "replicas": 1,
            "unitGroups": [{"name": "v6e"}, {"name": "v5p", "replicas": 1, "remote": True}],
            "training": {"totalSteps": 10},
            "syncer": {"tls": tls},
        }
    )
    return builders.Run("r", "ml", "uid", spec)


def handshake(pem: dict[str, str], server_name: str, tmp: Path) -> str:
    """Serve with tls.crt/tls.key, connect trusting ca.crt only and asking for `server_name`;
    returns the subject the client saw (raises ssl.SSLCertVerificationError otherwise)."""
    (tmp / "tls.crt").write_text(pem["tls.crt"])
    (tmp / "tls.key").write_text(pem["tls.key"])
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(tmp / "tls.crt", tmp / "tls.key")
    client = ssl.create_default_context(cadata=pem["ca.crt"])
    a, b = socket.socketpair()
    failure: list[BaseException] = []

    def serve() -> None:
        try:
            with server.wrap_socket(a, server_side=True) as s:
                s.recv(1)
        except (ssl.SSLError, OSError) as exc:
            failure.append(exc)

    t = threading.Thread(target=serve)
    t.start()
    try:
        with client.wrap_socket(b, server_hostname=server_name) as c:
            subject = dict(x[0] for x in c.getpeercert()["subject"])["commonName"]
            c.send(b"x")
    finally:
        t.join(5)
    return str(subject)


def test_learners_verify_the_operator_made_certificate_by_the_service_name(
    tmp_path: Path,
) -> None:
    run = run_with({"ipAddresses": ["10.245.0.1"], "dnsNames": ["r-syncer.home.example"]})
    secret = run_secrets.syncer_tls_secret(run)
    assert secret is not None and secret["type"] == "kubernetes.io/tls"
    assert secret["metadata"]["name"] == "r-syncer-tls"
    pem = secret["stringData"]
    assert set(pem) == {"tls.crt", "tls.key", "ca.crt"}
    host = run.syncer_address.split("//")[1].split(":")[0]
    for name in (host, "r-syncer.home.example", "10.245.0.1"):
        assert handshake(pem, name, tmp_path) == "r-syncer"
    with pytest.raises(ssl.SSLCertVerificationError):
        handshake(pem, "elsewhere.example", tmp_path)
    # the learners' CA and the syncer's serving pair are that Secret's
    assert ca_source(run) == ("r-syncer-tls", "ca.crt")
    pod = builders.syncer_deployment(run)["spec"]["template"]["spec"]
    served = next(v for v in pod["volumes"] if v["name"] == "syncer-tls")["secret"]
    assert served["secretName"] == "r-syncer-tls"
    made = [o["metadata"]["name"] for o in builders.run_objects(run) if o["kind"] == "Secret"]
    assert made == ["r-token", "r-syncer-tls"]


def test_the_private_cas_key_is_in_no_output_and_signs_nothing_else() -> None:
    one = private_ca.syncer_certificate("r", ["r-syncer.ml.svc"], [], NOW)
    two = private_ca.syncer_certificate("r", ["r-syncer.ml.svc"], [], NOW)
    assert one["ca.crt"] != two["ca.crt"]  # a CA per Secret made
    ca = x509.load_pem_x509_certificate(one["ca.crt"].encode())
    leaf = x509.load_pem_x509_certificate(one["tls.crt"].encode())
    leaf.verify_directly_issued_by(ca)
    with pytest.raises(InvalidSignature):
        leaf.verify_directly_issued_by(x509.load_pem_x509_certificate(two["ca.crt"].encode()))
    assert one["tls.key"].count("PRIVATE KEY-----") == 2  # the serving key alone
    assert leaf.not_valid_after_utc - NOW == datetime.timedelta(days=private_ca.SERVING_DAYS)


def test_a_given_secret_is_used_as_it_is() -> None:
    run = run_with({"secretName": "mine"})
    assert run_secrets.syncer_tls_secret(run) is None
    assert ca_source(run) == ("mine", "ca.crt")
    with pytest.raises(ValueError, match=r"syncer\.tls\.dnsNames"):
        run_with({"secretName": "mine", "dnsNames": ["x.example"]})
