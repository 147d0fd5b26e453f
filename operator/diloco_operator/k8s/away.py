"""An away run's status: the home syncer as this cluster sees it (reachable, last contact, the
last error naming the address, the latest merge), and a SyncerReachable condition whose reason
names a refused credential or certificate when that is why (docs/multi-cluster.md)."""

from __future__ import annotations

import json
import re

from diloco_trainer.status import SyncerStatus

from diloco_operator.api import DilocoRunStatus
from diloco_operator.api.status import SyncerReach
from diloco_operator.k8s.state import Reach
from diloco_operator.planner.conditions import set_condition
from diloco_operator.planner.timefmt import at

CONDITION = "SyncerReachable"


def unreachable_reason(error: str) -> str:
    """A condition reason for why the home syncer did not answer: the syncer's own refusal
    reason (credential_expired -> CredentialExpired), a certificate that did not verify, or
    Unreachable."""
    body = error.partition("HTTP ")[2]
    match = re.search(r"\{.*\}", body)
    if match:
        try:
            reason = json.loads(match.group(0)).get("reason")
        except ValueError:
            reason = None
        if isinstance(reason, str) and reason:
            return "".join(part.capitalize() for part in reason.split("_"))
    if "CERTIFICATE_VERIFY_FAILED" in error or "certificate verify failed" in error:
        return "CertificateNotVerified"
    return "Unreachable"


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
    reason = "Reachable" if reach.reachable else unreachable_reason(reach.error or "")
    message = f"{reach.address} answered" if reach.reachable else reach.error or ""
    conditions = set_condition(
        list(status.conditions),
        CONDITION,
        reach.reachable,
        reason,
        message,
        now,
        status.observed_generation,
    )
    return status.model_copy(
        update={"syncer": view, "conditions": sorted(conditions, key=lambda c: c.type)}
    )
