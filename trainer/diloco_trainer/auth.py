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
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from diloco_trainer.config import ConfigError

# Versioned domain label: a token minted for a unit is never also valid as some other HMAC of
# the same secret.
DOMAIN = b"diloco-unit/1:"
UNIT_HEADER = "X-Diloco-Unit"
# A warm spare's credential is a unit token minted for "spare:<name>": unit names are DNS labels
# with no ':', so a spare can never speak as a unit, nor a unit as a spare.
SPARE_PREFIX = "spare:"


def spare_token(secret: str, spare: str) -> str:
    """The bearer token of warm spare `spare` (sent with `X-Diloco-Unit: spare:<spare>`)."""
    return unit_token(secret, SPARE_PREFIX + spare)


def unit_token(secret: str, unit: str) -> str:
    """The bearer token of learner unit `unit` in the run whose secret is `secret`."""
    if not secret:
        raise ValueError("run secret: must not be empty")
    if not unit:
        raise ValueError("unit name: must not be empty")
    return hmac.new(secret.encode(), DOMAIN + unit.encode(), hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class Caller:
    """Who sent a request: a learner unit (`unit` set) or the run's operator (`unit` None).
    `credential`: the id of the join credential a unit of an away cluster proved itself with
    (join_credentials.py); None for a home unit's token. `observer`: the away operator under
    its credential (join_credentials.OBSERVER), which may only read the run's status."""

    unit: str | None
    credential: str | None = None
    observer: bool = False

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


def resolve_token(flag: str | None, env: Mapping[str, str], file_flag: str | None = None) -> str:
    """A bearer token: the flag, else the file named by --token-file, else DILOCO_TOKEN, else
    the file named by DILOCO_TOKEN_FILE (a mounted Secret). For the syncer it is the run secret;
    for a learner, its unit's token (auth.unit_token). Both resolve it the same way."""
    if flag:
        return flag
    if file_flag:
        return _read_token_file(file_flag, "--token-file")
    if env.get("DILOCO_TOKEN"):
        return env["DILOCO_TOKEN"]
    token_file = env.get("DILOCO_TOKEN_FILE")
    if token_file:
        return _read_token_file(token_file, "DILOCO_TOKEN_FILE")
    raise ConfigError("--token (or DILOCO_TOKEN / DILOCO_TOKEN_FILE) is required")


def _read_token_file(path: str, source: str) -> str:
    try:
        token = Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise ConfigError(f"{source}: cannot read {path}: {reason}") from exc
    if not token:
        raise ConfigError(f"{source}: {path} is empty")
    return token
