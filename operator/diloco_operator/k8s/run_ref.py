"""The identity of a DilocoRun as its children see it: names, owner, addresses."""

from __future__ import annotations

from collections.abc import Mapping

from diloco_operator.api import DilocoRunSpec


class Run:
    """Identity of the owning DilocoRun: what every child needs to name and own itself."""

    def __init__(
        self,
        name: str,
        namespace: str,
        uid: str,
        spec: DilocoRunSpec,
        labels: Mapping[str, str] | None = None,
    ) -> None:
        self.name = name
        self.namespace = namespace
        self.uid = uid
        self.spec = spec
        # The run's own labels: only Kueue's (queue name, priority class) reach its children.
        self.labels = dict(labels or {})

    @property
    def syncer_name(self) -> str:
        return f"{self.name}-syncer"

    @property
    def shards(self) -> int:
        """Syncer shards (spec.syncer.shards): each its own Deployment, Service and budget."""
        return self.spec.syncer.shards

    def shard_name(self, shard: int) -> str:
        """Shard `shard`'s Deployment, Service and PodDisruptionBudget: shard 0 keeps the name
        an unsharded syncer has (so a run of one shard is the run it always was); with the
        40-character run name, `-syncer-63` still fits a DNS label."""
        return self.syncer_name if shard == 0 else f"{self.syncer_name}-{shard}"

    @property
    def shard_names(self) -> list[str]:
        return [self.shard_name(i) for i in range(self.shards)]

    @property
    def token_secret(self) -> str:
        return f"{self.name}-token"

    @property
    def config_map(self) -> str:
        return f"{self.name}-config"

    @property
    def checkpoint_claim(self) -> str:
        path = self.spec.syncer.checkpoint.path
        return path if path and not path.startswith("gs://") else f"{self.name}-checkpoints"

    def shard_claim(self, shard: int) -> str:
        """The claim shard `shard` mounts: a claim the user names is every shard's (each writes
        its own folder in it); the operator makes one per shard (docs/operator.md, "Sharded
        syncer": a ReadWriteOnce claim cannot follow pods onto different nodes)."""
        ckpt = self.spec.syncer.checkpoint
        if shard == 0 or (ckpt.path and not ckpt.is_bucket):
            return self.checkpoint_claim
        return f"{self.checkpoint_claim}-{shard}"

    @property
    def syncer_address(self) -> str:
        """Where the run's learners reach the syncer (DILOCO_SYNCER_ADDR): the home syncer's
        address for an away run, else every shard's Service by cluster DNS, shard 0 first and
        comma-separated (one shard: the one URL it always was)."""
        return ",".join(self.syncer_addresses)

    @property
    def syncer_addresses(self) -> list[str]:
        """Each shard's in-cluster URL, shard 0 first (https when it serves TLS); an away run
        has the home syncer's address alone (a sharded syncer is never reached from away)."""
        external = self.spec.syncer.external
        if external is not None:
            return [external.address]
        scheme = "https" if self.spec.syncer.tls is not None else "http"
        port = self.spec.syncer.port
        return [f"{scheme}://{name}.{self.namespace}.svc:{port}" for name in self.shard_names]
