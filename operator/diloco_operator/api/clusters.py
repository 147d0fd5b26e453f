"""One run across clusters: the syncer's transport security and exposure at home, and the
syncer an away run joins (docs/multi-cluster.md).

Every cluster's DilocoRun describes the whole run, with the same unit groups in the same order;
each runs the groups it does not mark `remote`. The home run (no `syncer.external`) runs the
syncer and admits every group's units; an away run names the home syncer's address, the CA that
signed its certificate and a join credential for its one group. Describing the whole run on
both sides keeps every unit's global index and the run's unit count (which sizes the learners'
schedules) the same wherever the unit runs.
"""

from __future__ import annotations

from typing import Annotated, Literal

from diloco_trainer.config import Strict
from pydantic import Field, model_validator

from diloco_operator.api.kubesyntax import DNS_LABEL, DNS_SUBDOMAIN, ENV_NAME

# https://host[:port], no path: the learners add the protocol's paths.
SYNCER_ADDRESS = r"^https://[A-Za-z0-9]([-A-Za-z0-9.]*[A-Za-z0-9])?(:[0-9]{1,5})?$"
CIDR = r"^[0-9a-fA-F:.]+/[0-9]{1,3}$"
# A join credential's id (the trainer's join_credentials.ID_PATTERN).
CredentialId = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$", max_length=64)]
Cidr = Annotated[str, Field(pattern=CIDR, max_length=43)]
DnsName = Annotated[str, Field(pattern=DNS_SUBDOMAIN, max_length=253)]
IpAddress = Annotated[str, Field(pattern=r"^[0-9a-fA-F:.]+$", max_length=39)]
INTERNAL_LB_ANNOTATION = "networking.gke.io/load-balancer-type"
# The CA bundle's key in the syncer's kubernetes.io/tls Secret and in an away run's CA Secret.
CA_KEY = "ca.crt"
CREDENTIAL_KEY = "credential"


class SecretKey(Strict):
    """One key of a Secret in the run's namespace."""

    name: str = Field(max_length=253, pattern=DNS_SUBDOMAIN, description="Secret name.")
    key: str = Field(max_length=253, pattern=ENV_NAME, description="Key within the Secret.")


class ExternalSyncer(Strict):
    """The syncer of a run whose home is another cluster. This run creates no syncer; its units
    join the home syncer over HTTPS with a credential scoped to this run's one local group."""

    address: str = Field(
        max_length=300,
        pattern=SYNCER_ADDRESS,
        description="https://HOST[:PORT] of the home syncer (its internal load balancer or "
        "Gateway route); the certificate must name HOST.",
    )
    ca: SecretKey = Field(
        description="The CA bundle that signed the home syncer's certificate (PEM); a bundle of "
        "the old and the new CA rotates it without restarting learners."
    )
    credential: SecretKey = Field(
        description="The join credential minted at home (`diloco join-credential`): good for "
        "one run and one unit group until it expires or is revoked there."
    )


class GatewayParent(Strict):
    """The Gateway (and listener) a route attaches to: the user's, installed and run by their
    Gateway API implementation."""

    name: str = Field(max_length=253, pattern=DNS_SUBDOMAIN, description="Gateway name.")
    namespace: str | None = Field(
        None,
        max_length=63,
        pattern=DNS_LABEL,
        description="The Gateway's namespace (default: the run's); the Gateway's listener must "
        "allow routes from the run's namespace.",
    )
    section_name: str | None = Field(
        None,
        max_length=253,
        pattern=DNS_SUBDOMAIN,
        description="The listener to attach to (default: every listener the route fits).",
    )


class GatewayRoute(Strict):
    """The syncer behind a Gateway API route. TLSRoute (the default) passes TLS through by SNI:
    the learners' connection ends at the syncer, which serves its own certificate, so trust is
    what it is with a load balancer. HTTPRoute ends TLS at the Gateway (learners verify the
    Gateway's certificate) and the Gateway speaks HTTPS to the syncer."""

    parent_ref: GatewayParent = Field(description="The Gateway the route attaches to.")
    hostname: DnsName = Field(
        description="The name away learners dial (their syncer.external.address is "
        "https://HOSTNAME[:PORT]); a TLSRoute matches it by SNI, so the syncer's certificate "
        "must name it (the operator-made one does)."
    )
    kind: Literal["TLSRoute", "HTTPRoute"] = Field(
        "TLSRoute", description="TLSRoute: TLS passthrough; HTTPRoute: TLS ends at the Gateway."
    )
    source_ranges: list[Cidr] | None = Field(
        None,
        max_length=32,
        description="CIDRs the Gateway's proxies connect from (a proxy-only subnet, the "
        "gateway pods' range): the NetworkPolicy admits only these. Unset: any source (the "
        "Gateway is the gate).",
    )


class SyncerExposure(Strict):
    """How the syncer is reached: from inside the cluster only, or from other clusters."""

    type: Literal["ClusterIP", "LoadBalancer", "Gateway"] = Field(
        "ClusterIP",
        description="LoadBalancer or Gateway make the syncer reachable from other clusters "
        "(away runs): a Service of type LoadBalancer, or a route of a Gateway of yours.",
    )
    internal: bool = Field(
        True,
        description="An internal load balancer (GKE: reachable over the VPC and its peerings, "
        "not from the internet). Ignored for ClusterIP.",
    )
    load_balancer_source_ranges: list[Cidr] | None = Field(
        None,
        max_length=32,
        description="CIDRs allowed to reach the load balancer (the away clusters' pod ranges); "
        "the NetworkPolicy admits the same.",
    )
    annotations: dict[str, str] | None = Field(
        None, max_length=16, description="Extra annotations of the syncer Service."
    )
    gateway: GatewayRoute | None = Field(
        None, description="The route to the syncer; required with type Gateway, only with it."
    )

    @property
    def external(self) -> bool:
        """Reached from other clusters (by either way)."""
        return self.type != "ClusterIP"

    @property
    def source_ranges(self) -> list[str] | None:
        """Where other clusters' traffic arrives from (None: anywhere)."""
        if self.gateway is not None:
            return self.gateway.source_ranges
        return self.load_balancer_source_ranges

    @model_validator(mode="after")
    def _gateway_with_its_type(self) -> SyncerExposure:
        if (self.type == "Gateway") != (self.gateway is not None):
            raise ValueError("syncer.expose.gateway: required with type Gateway, and only with it")
        return self


class SyncerTls(Strict):
    """The syncer serves HTTPS with the certificate of a `kubernetes.io/tls` Secret (`tls.crt`,
    `tls.key`, and `ca.crt` for clients), kept current by cert-manager or by hand: the syncer
    and the learners pick up a renewed certificate without restarting."""

    secret_name: str | None = Field(
        None,
        max_length=253,
        pattern=DNS_SUBDOMAIN,
        description="Secret with tls.crt, tls.key and ca.crt; its certificate must name the "
        "syncer Service's DNS name and the load balancer's address when exposed. Omitted: the "
        "operator makes <run>-syncer-tls, signed by a private CA of the run's own whose key it "
        "does not keep (a convenience for runs in one cluster; give away clusters its ca.crt).",
    )
    dns_names: list[DnsName] | None = Field(
        None,
        max_length=16,
        description="More names for the operator-made certificate (what away clusters dial); "
        "only without secretName.",
    )
    ip_addresses: list[IpAddress] | None = Field(
        None,
        max_length=16,
        description="IP addresses for the operator-made certificate; only without secretName.",
    )

    def secret(self, run: str) -> str:
        """The Secret the syncer serves from: the user's, or the one the operator makes."""
        return self.secret_name or f"{run}-syncer-tls"

    @property
    def operator_made(self) -> bool:
        return self.secret_name is None

    @model_validator(mode="after")
    def _names_only_for_the_operators(self) -> SyncerTls:
        if self.secret_name is not None and (self.dns_names or self.ip_addresses):
            raise ValueError(
                "syncer.tls.dnsNames: names are for the operator-made certificate; a given "
                "secretName's certificate already has its own"
            )
        return self


def check_shards(
    shards: int, fragments: int, away: bool, exposed: bool, remote: list[bool]
) -> None:
    """`syncer.shards` against the fragments and the run's reach; ValueError naming the field.
    CEL mirrors (crd_rules.py)."""
    if shards > fragments:
        raise ValueError(
            f"syncer.shards: {shards} shards for training.fragments={fragments}; every shard "
            "holds at least one fragment"
        )
    if shards > 1 and (away or exposed or any(remote)):
        raise ValueError(
            "syncer.shards: a sharded syncer serves the units of its own cluster only "
            "(no syncer.expose, syncer.external or remote unit groups)"
        )


def check_cluster_fields(
    external: ExternalSyncer | None,
    expose: SyncerExposure | None,
    tls: SyncerTls | None,
    remote: list[bool],
) -> None:
    """The rules across fields; ValueError naming the field. CEL mirrors (crd_rules.py)."""
    local = remote.count(False)
    if external is not None:
        if expose is not None or tls is not None:
            raise ValueError(
                "syncer.external: a run that joins another cluster's syncer sets neither "
                "syncer.expose nor syncer.tls (the home run does)"
            )
        if local != 1:
            raise ValueError(
                "syncer.external: an away run runs exactly one unit group (the one its join "
                f"credential is for); mark the others remote: true (it runs {local})"
            )
        return
    crosses = any(remote) or (expose is not None and expose.external)
    if crosses and tls is None:
        raise ValueError(
            "syncer.tls: required when a unit group is remote or the syncer is exposed to "
            "other clusters (plain HTTP stays inside the cluster)"
        )
