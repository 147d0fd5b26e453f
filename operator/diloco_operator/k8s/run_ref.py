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
    def token_secret(self) -> str:
        return f"{self.name}-token"

    @property
    def config_map(self) -> str:
        return f"{self.name}-config"

    @property
    def checkpoint_claim(self) -> str:
        path = self.spec.syncer.checkpoint.path
        return path if path and not path.startswith("gs://") else f"{self.name}-checkpoints"

    @property
    def syncer_address(self) -> str:
        """Where the run's learners reach the syncer: the home syncer's address for an away run,
        else the syncer Service by cluster DNS (https when it serves TLS)."""
        external = self.spec.syncer.external
        if external is not None:
            return external.address
        scheme = "https" if self.spec.syncer.tls is not None else "http"
        return f"{scheme}://{self.syncer_name}.{self.namespace}.svc:{self.spec.syncer.port}"
