"""The Secrets of a run's children: the run secret (home only), the syncer's certificate when the
operator makes it, and each unit's own token.

The operator may create and read Secrets, never update or delete them (least privilege, the
chart's RBAC): a Secret is made once under its name, and what must change makes a new name. So
an away unit's token Secret is named after the join credential it derives from: a replaced
credential gives the units created after it new Secrets, and the old ones go with the run."""

from __future__ import annotations

import datetime
import secrets
from typing import Any

from diloco_trainer.join_credentials import parse_join_credential

from diloco_operator.api import LABEL_UNIT
from diloco_operator.api.pod_security import TOKEN_KEY
from diloco_operator.k8s import private_ca
from diloco_operator.k8s.cross_cluster import unit_secret_data
from diloco_operator.k8s.object_meta import LEARNER, SYNCER, child_meta
from diloco_operator.k8s.run_ref import Run


def token_secret(run: Run, token: str | None = None) -> dict[str, Any]:
    """Created once per run (a create conflict keeps the existing token)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": child_meta(run, run.token_secret, "token"),
        "stringData": {TOKEN_KEY: token or secrets.token_urlsafe(32)},
    }


def syncer_tls_secret(run: Run) -> dict[str, Any] | None:
    """The syncer's certificate Secret when the operator makes it (`syncer.tls` without
    `secretName`): signed by a private CA of the run's own (private_ca.py), naming the Service
    (every shard's, one certificate for all), a Gateway route's hostname and
    `syncer.tls.dnsNames` / `ipAddresses`.
    Created once (a conflict keeps the existing)."""
    tls = run.spec.syncer.tls
    if tls is None or not tls.operator_made:
        return None
    names = []
    for name in run.shard_names:
        service = f"{name}.{run.namespace}"
        names += [name, service, f"{service}.svc", f"{service}.svc.cluster.local"]
    exposure = run.spec.syncer.expose
    if exposure is not None and exposure.gateway is not None:
        names.append(exposure.gateway.hostname)  # a TLSRoute's SNI: what away learners dial
    pem = private_ca.syncer_certificate(
        run.name,
        names + list(tls.dns_names or []),
        list(tls.ip_addresses or []),
        datetime.datetime.now(datetime.UTC),
    )
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "kubernetes.io/tls",
        "metadata": child_meta(run, tls.secret(run.name), SYNCER),
        "stringData": pem,
    }


def unit_token_secret_name(run: Run, unit: str, run_token: str) -> str:
    """`<unit>-token` at home; away, `<unit>-token-<credential id>` (see the module's doc)."""
    if run.spec.syncer.external is None:
        return f"{unit}-token"
    return f"{unit}-token-{parse_join_credential(run_token).id[:12]}"


def unit_token_secret(run: Run, unit: str, run_token: str) -> dict[str, Any]:
    """The unit's own credential (HMAC of the run secret and its name, docs/protocol.md; in an
    away run, of the join credential's key): a learner pod holds this, never the run secret or
    the credential, so it can speak only as its own unit."""
    name = unit_token_secret_name(run, unit, run_token)
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": child_meta(run, name, LEARNER, **{LABEL_UNIT: unit}),
        "stringData": unit_secret_data(run, unit, run_token, TOKEN_KEY),
    }
