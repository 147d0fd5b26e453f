"""Join credentials: what a user copies to an away cluster so that its units can join a run
whose syncer lives in another cluster, without the run secret ever leaving home.

    public     = {"run", "group", "expires" (unix seconds), "id"}
    key        = hex(HMAC-SHA256(key=run secret, msg="diloco-join/1:" + run + "\\n" + group
                                 + "\\n" + expires + "\\n" + id))
    credential = "dj1." + base64url(JSON public) + "." + key

The away operator keeps the whole credential and derives each of its units' tokens from the key
exactly as home units' tokens come from the run secret: `unit_token(key, unit)` (auth.py). A
learner holds only its own token and the public part, `dj1.<base64url(JSON public)>`, which it
sends in `X-Diloco-Join`. The syncer recomputes the key from the public part and the run secret,
so it keeps no table of credentials, and a credential is good only for its run, for units of
its group (the roster says which), until it expires, and until its id is revoked (the roster's
`revokedCredentials`). See docs/protocol.md, "Join credentials".
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import re
import secrets
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from diloco_trainer.auth import unit_token

PREFIX = "dj1"
# Versioned domain label, distinct from auth.DOMAIN: no credential key is ever also a unit token
# of the run secret, nor the other way round.
DOMAIN = b"diloco-join/1:"
JOIN_HEADER = "X-Diloco-Join"
# Only the syncer's clock decides expiry; this covers the clock of the machine that minted the
# credential (docs/design.md, "Across clusters: TLS and join credentials").
CLOCK_SKEW_SECONDS = 60
MAX_EXPIRES = 2**53 - 1
MAX_PUBLIC_CHARS = 1024
ID_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")
_KEY = re.compile(r"[0-9a-f]{64}")
# The away operator's own name under its credential: with the token the key makes for it, it
# reads the home syncer's status (GET /v1/status, nothing else) to report on its units. No unit
# is named so: unit names are Kubernetes names, which hold no ':'.
OBSERVER = ":observer"
_FIELDS = ("expires", "group", "id", "run")


@dataclass(frozen=True)
class JoinCredential:
    run: str
    group: str
    expires: int
    id: str
    key: str = field(default="", repr=False)  # hex; "" when only the public part is known

    @property
    def public(self) -> str:
        """The part a learner sends in X-Diloco-Join (never the key)."""
        doc = {"expires": self.expires, "group": self.group, "id": self.id, "run": self.run}
        raw = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
        return f"{PREFIX}.{base64.urlsafe_b64encode(raw).rstrip(b'=').decode()}"

    def serialise(self) -> str:
        if not self.key:
            raise ValueError("join credential: no key (only the public part is known)")
        return f"{self.public}.{self.key}"


def credential_key(run_secret: str, run: str, group: str, expires: int, id: str) -> str:
    """The credential's key: only the run secret can make it, and any change of a public field
    changes it. The fields are checked first, so the newline-joined message is unambiguous."""
    _check_fields(run, group, expires, id)
    if not run_secret:
        raise ValueError("run secret: must not be empty")
    msg = DOMAIN + f"{run}\n{group}\n{expires}\n{id}".encode()
    return hmac.new(run_secret.encode(), msg, hashlib.sha256).hexdigest()


def mint_join_credential(
    run_secret: str, run: str, group: str, expires: int, id: str | None = None
) -> str:
    """A credential for units of `group` in `run`, good until `expires` (unix seconds); `id`
    (what revokes it) is random unless given."""
    id = secrets.token_hex(16) if id is None else id
    key = credential_key(run_secret, run, group, expires, id)
    return JoinCredential(run, group, expires, id, key).serialise()


def parse_join_credential(text: str) -> JoinCredential:
    """The whole credential (`dj1.<public>.<key>`); ValueError naming what is wrong (never
    quoting the key)."""
    parts = text.strip().split(".")
    if len(parts) != 3:
        raise ValueError(
            f"join credential: expected {PREFIX}.<public>.<key> (3 parts), got {len(parts)} parts"
        )
    public = _parse_public(parts[0], parts[1], "join credential")
    if not _KEY.fullmatch(parts[2]):
        raise ValueError("join credential: key must be 64 lowercase hex digits")
    return JoinCredential(public.run, public.group, public.expires, public.id, parts[2])


def parse_join_public(text: str) -> JoinCredential:
    """The public part (`dj1.<public>`, what X-Diloco-Join carries), without a key."""
    if len(text) > MAX_PUBLIC_CHARS:
        raise ValueError(f"{JOIN_HEADER}: longer than {MAX_PUBLIC_CHARS} characters")
    parts = text.strip().split(".")
    if len(parts) == 3:
        raise ValueError(
            f"{JOIN_HEADER}: this is a whole credential, key included; a learner gets only its "
            f"public part ({PREFIX}.<public>), the away operator keeps the key"
        )
    if len(parts) != 2:
        raise ValueError(f"{JOIN_HEADER}: expected {PREFIX}.<public>, got {len(parts)} parts")
    return _parse_public(parts[0], parts[1], JOIN_HEADER)


def unit_token_from_credential(credential: str | JoinCredential, unit: str) -> str:
    """The bearer token of `unit`, derived from the credential's key as home units' tokens are
    from the run secret (auth.unit_token)."""
    parsed = parse_join_credential(credential) if isinstance(credential, str) else credential
    if not parsed.key:
        raise ValueError("join credential: no key (only the public part is known)")
    return unit_token(parsed.key, unit)


def _parse_public(prefix: str, encoded: str, where: str) -> JoinCredential:
    if prefix != PREFIX:
        raise ValueError(f"{where}: unknown format {prefix[:8]!r} (expected {PREFIX!r})")
    try:
        raw = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4))
        doc = json.loads(raw)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"{where}: public part is not base64url JSON: {exc}") from None
    if not isinstance(doc, dict) or sorted(doc) != sorted(_FIELDS):
        got = sorted(doc) if isinstance(doc, dict) else type(doc).__name__
        # A field the key does not cover could be changed by anyone: none is accepted.
        raise ValueError(f"{where}: public part must hold exactly {list(_FIELDS)}, got {got}")
    run, group, expires, id = doc["run"], doc["group"], doc["expires"], doc["id"]
    if not all(isinstance(v, str) for v in (run, group, id)):
        raise ValueError(f"{where}: run, group and id must be strings")
    if not isinstance(expires, int) or isinstance(expires, bool):
        raise ValueError(f"{where}: expires must be an integer (unix seconds), got {expires!r}")
    try:
        _check_fields(run, group, expires, id)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    return JoinCredential(run, group, expires, id)


def _check_fields(run: str, group: str, expires: int, id: str) -> None:
    for name, value, longest in (("run", run, 253), ("group", group, 63)):
        if not value or len(value) > longest:
            raise ValueError(f"{name}: 1 to {longest} characters, got {len(value)}")
        if any(ord(c) < 32 or ord(c) == 127 for c in value):
            raise ValueError(f"{name}: control characters are not allowed")
    if not 0 < expires <= MAX_EXPIRES:
        raise ValueError(f"expires: unix seconds in 1..{MAX_EXPIRES}, got {expires}")
    if not ID_PATTERN.fullmatch(id):
        raise ValueError(f"id: 1 to 64 of A-Z a-z 0-9 _ -, got {id[:70]!r}")


# ---------------------------------------------------------------- the syncer's check


@dataclass(frozen=True)
class Refusal:
    status: int
    reason: str
    message: str


def check_join(
    run_secret: str,
    run: str,
    header: str,
    token: str,
    unit: str,
    now: float,
    revoked: Collection[str],
    groups: Mapping[str, str] | None,
) -> JoinCredential | Refusal:
    """The credential a request with `X-Diloco-Join: header`, bearer `token` and unit `unit`
    proves, or why it is refused. Checked in this order: the header parses; it is this run's
    (a credential of another run could never verify here: saying so is the useful answer); the
    token is the unit's token under the credential's key (which any change of a public field
    breaks); then, for a proven credential only, expiry by the syncer's clock, revocation, and
    the unit's group by the roster. A unit not on the roster passes here and is refused by the
    roster itself (unknown_unit); the OBSERVER is no unit of a group, and what it may do is the
    caller's to limit."""
    try:
        cred = parse_join_public(header)
    except ValueError as exc:
        return Refusal(401, "credential_malformed", str(exc))
    if cred.run != run:
        return Refusal(
            403,
            "credential_foreign_run",
            f"join credential {cred.id} is for run {cred.run!r}, not this syncer's",
        )
    key = credential_key(run_secret, cred.run, cred.group, cred.expires, cred.id)
    if not unit or not hmac.compare_digest(token.encode(), unit_token(key, unit).encode()):
        return Refusal(
            401,
            "bad_token",
            f"not unit {unit!r}'s token under join credential {cred.id} (or its public part "
            "was changed: that changes its key)",
        )
    if now > cred.expires + CLOCK_SKEW_SECONDS:
        return Refusal(
            403,
            "credential_expired",
            f"join credential {cred.id} expired {int(now - cred.expires)} s ago",
        )
    if cred.id in revoked:
        return Refusal(403, "credential_revoked", f"join credential {cred.id} is revoked")
    if unit == OBSERVER:
        return cred
    if groups is None:
        return Refusal(
            403,
            "credential_wrong_group",
            "this syncer has no roster, so it cannot tell a unit's group: join credentials "
            "need one",
        )
    known = groups.get(unit)
    if known is not None and known != cred.group:
        return Refusal(
            403,
            "credential_wrong_group",
            f"join credential {cred.id} is for group {cred.group!r}; unit {unit!r} is in {known!r}",
        )
    return cred
