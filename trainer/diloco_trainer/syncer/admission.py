"""Who a request comes from and whether it may join: bearer tokens (home units and the
operator), join credentials (units of away clusters), and the layout a unit joins with. The
HTTP layer (http_api.py) calls these; each refusal is a Reject it answers and logs. See
docs/protocol.md, "Authentication", "Join credentials" and "Layout check at join".
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from diloco_trainer.auth import UNIT_HEADER, Caller, identify
from diloco_trainer.join_credentials import JOIN_HEADER, OBSERVER, JoinCredential, check_join
from diloco_trainer.layout_plan import difference, fingerprint, plan_of, read_announcement
from diloco_trainer.syncer.fragment import Reject

if TYPE_CHECKING:
    from diloco_trainer.syncer.core import Syncer

log = logging.getLogger("diloco.syncer")


def authenticate(s: Syncer, headers: Mapping[str, str]) -> Caller:
    """The caller the request's headers prove: the run secret is the operator's (whatever else
    comes with it); with `X-Diloco-Join`, a unit of an away cluster proven by a join credential
    and nothing else; otherwise a home unit's token with its name. Reject (401/403) if none."""
    authorization = headers.get("Authorization", "")
    unit = headers.get(UNIT_HEADER)
    join = headers.get(JOIN_HEADER)
    caller = identify(s.token, authorization, None if join is not None else unit)
    if caller is not None and (caller.operator or join is None):
        return caller
    if join is None:
        raise Reject(401, "unauthorized", "missing or wrong bearer token")
    return _by_credential(s, authorization, unit or "", join)


def _by_credential(s: Syncer, authorization: str, unit: str, join: str) -> Caller:
    token = authorization[7:] if authorization.startswith("Bearer ") else ""
    if not (token.isascii() and unit.isascii() and join.isascii()):
        s.metrics.credential_refusals.labels("credential_malformed").inc()
        raise Reject(401, "credential_malformed", "non-ASCII credential headers")
    roster = s.gate.roster
    verdict = check_join(
        s.token,
        s.run,
        join,
        token,
        unit,
        time.time(),
        roster.revoked if roster is not None else frozenset(),
        roster.units if roster is not None else None,
    )
    if not isinstance(verdict, JoinCredential):
        s.metrics.credential_refusals.labels(verdict.reason).inc()
        raise Reject(verdict.status, verdict.reason, verdict.message)
    return Caller(unit, credential=verdict.id, observer=unit == OBSERVER)


def check_layout(s: Syncer, data: dict[str, Any], unit: str) -> None:
    """Refuse (409 layout_mismatch, naming the first difference) a join whose fragment plan
    is not the run's. A learner that sends none (older than the field) is taken at its word."""
    raw = data.get("layout")
    if raw is None:
        return
    try:
        theirs, plan = read_announcement(raw)
    except ValueError as exc:
        raise Reject(400, "bad_request", str(exc)) from exc
    dtypes = {n: "float32" for n in s.shapes}  # the syncer keeps every fragment as float32
    ours = plan_of([f.names for f in s.frags], s.shapes, dtypes)
    if theirs == fingerprint(ours):
        return
    what = difference(plan, ours) if plan is not None else None
    raise Reject(
        409,
        "layout_mismatch",
        f"unit {unit!r} has another model or fragment layout than the run: "
        + (what or f"layout fingerprint {theirs[:12]} is not the run's {fingerprint(ours)[:12]}"),
    )
