"""An away run's status: the home syncer as this cluster sees it (reachable, last contact, the
last error naming the address, the latest merge), and a SyncerReachable condition whose reason
names a refused credential or certificate when that is why (docs/multi-cluster.md)."""

from __future__ import annotations

import ssl

import aiohttp
from diloco_trainer.status import SyncerStatus

from diloco_operator.api import DilocoRunStatus
from diloco_operator.api.status import SyncerReach
from diloco_operator.k8s.state import Reach
from diloco_operator.planner.conditions import set_condition
from diloco_operator.planner.timefmt import at

CONDITION = "SyncerReachable"


def refusal_reason(code: object) -> str:
    """The condition reason for a syncer that answered with a refusal: its own reason code in
    CamelCase (credential_expired -> CredentialExpired), or Unreachable when it gave none (an
    answer that is not the syncer's: a proxy's error page, a 5xx)."""
    if isinstance(code, str) and code:
        return "".join(part.capitalize() for part in code.split("_"))
    return "Unreachable"


def error_reason(exc: BaseException) -> str:
    """The condition reason for a syncer that could not be asked: a certificate that did not
    verify, or Unreachable."""
    certificate = (aiohttp.ClientConnectorCertificateError, ssl.SSLCertVerificationError)
    return "CertificateNotVerified" if isinstance(exc, certificate) else "Unreachable"


def away_status(
    status: DilocoRunStatus, reach: Reach | None, report: SyncerStatus | None, now: float
) -> DilocoRunStatus:
    if reach is None:
        return status
    merges = [f.last_merge for f in (report.fragments if report else ()) if f.last_merge]
    before = status.syncer
    last_merge = at(max(merges)) if merges else (before.last_merge if before else None)
    view = SyncerReach(
        address=reach.address,
        reachable=reach.reachable,
        last_contact=at(reach.last_contact) if reach.last_contact else None,
        last_error=reach.error,
        last_merge=last_merge,
    )
    message = f"{reach.address} answered" if reach.reachable else reach.error or ""
    conditions = set_condition(
        list(status.conditions),
        CONDITION,
        reach.reachable,
        reach.reason,
        message,
        now,
        status.observed_generation,
    )
    return status.model_copy(
        update={"syncer": view, "conditions": sorted(conditions, key=lambda c: c.type)}
    )
