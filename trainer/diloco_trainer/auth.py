"""Per-unit credentials: each learner unit's bearer token is derived from the run secret.

    unit_token(secret, unit) = hex(HMAC-SHA256(key=secret, msg="diloco-unit/1:" + unit))

The syncer holds the run secret and recomputes a unit's token for each request, so it keeps no
table of tokens and a unit can never act under another unit's name: a learner's token is only
good together with its own unit name (`X-Diloco-Unit`). Whoever creates the units (the operator,
the local runtime) derives each one's token with this function and hands the learner only that.
See docs/protocol.md, "Authentication".
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

# Versioned domain label: a token minted for a unit is never also valid as some other HMAC of
# the same secret.
DOMAIN = b"diloco-unit/1:"
UNIT_HEADER = "X-Diloco-Unit"


def unit_token(secret: str, unit: str) -> str:
    """The bearer token of learner unit `unit` in the run whose secret is `secret`."""
    if not secret:
        raise ValueError("run secret: must not be empty")
    if not unit:
        raise ValueError("unit name: must not be empty")
    return hmac.new(secret.encode(), DOMAIN + unit.encode(), hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class Caller:
    """Who sent a request: a learner unit (`unit` set) or the run's operator (`unit` None)."""

    unit: str | None

    @property
    def operator(self) -> bool:
        return self.unit is None


def identify(secret: str, authorization: str, unit_header: str | None) -> Caller | None:
    """The caller of a request with these `Authorization` and `X-Diloco-Unit` headers, or None
    when they prove nothing. The run secret itself identifies the operator (whatever the unit
    header says); a unit token is good only with its own unit's name. Header values that are not
    ASCII (aiohttp hands undecodable bytes over as surrogates) are refused, not encoded."""
    given = authorization[7:] if authorization.startswith("Bearer ") else ""
    if not given or not given.isascii():
        return None
    if hmac.compare_digest(given.encode(), secret.encode()):
        return Caller(None)
    if not unit_header or not unit_header.isascii():
        return None
    if hmac.compare_digest(given.encode(), unit_token(secret, unit_header).encode()):
        return Caller(unit_header)
    return None
