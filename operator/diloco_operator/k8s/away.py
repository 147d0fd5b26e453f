"""An away run's status: the home syncer as this cluster sees it (reachable, last contact, the
last error naming the address, the latest merge), and a SyncerReachable condition whose reason
names a refused credential or certificate when that is why (docs/multi-cluster.md)."""

from __future__ import annotations

import ssl
from dataclasses import replace

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


def heard_since_the_link_returned(
    report: SyncerStatus | None, reach: Reach | None, now: float
) -> SyncerStatus | None:
    """`report` with each learner's heartbeat age bounded by how long the home syncer has
    answered without a break. An away learner reaches the syncer over the same link as its
    operator: while the link was down it could not heartbeat, so silence that spans an outage
    says nothing about the unit (it kept training), and recreating it would throw away its
    work. Its first heartbeat after the heal comes within the learner's retry backoff (5 s)."""
    if report is None or reach is None or reach.since is None:
        return report
    bound = max(0.0, now - reach.since)
    learners = {
        name: replace(learner, age_seconds=min(learner.age_seconds, bound))
        if learner.age_seconds is not None
        else learner
        for name, learner in report.learners.items()
    }
    return replace(report, learners=learners)


def away_status(
    status: DilocoRunStatus, reach: Reach | None, report: SyncerStatus | None, now: float
) -> DilocoRunStatus:
    if reach is None:
        return status
    merges = [f.last_merge for f in (report.fragments if report else ()) if f.last_merge]
    before = status.syncer
    last_merge = at(max(merges)) if merges else (before.last_merge if before else None)
    own = {u.name for u in status.units}
    lags = [
        entry.version_lag
        for name, entry in (report.learners.items() if report else ())
        if name in own and entry.version_lag is not None
    ]
    view = SyncerReach(
        address=reach.address,
        reachable=reach.reachable,
        last_contact=at(reach.last_contact) if reach.last_contact else None,
        last_error=reach.error,
        last_merge=last_merge,
        version_lag=max(lags) if lags else (before.version_lag if before else None),
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
