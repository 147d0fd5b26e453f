"""The join credential's format and derivations (join_credentials.py), as pure functions."""

from __future__ import annotations

import base64
import json

import pytest
from diloco_trainer.auth import unit_token
from diloco_trainer.join_credentials import (
    CLOCK_SKEW_SECONDS,
    OBSERVER,
    JoinCredential,
    Refusal,
    check_join,
    credential_key,
    mint_join_credential,
    parse_join_credential,
    parse_join_public,
    unit_token_from_credential,
)

SECRET = "run-secret-0123"
EXPIRES = 2_000_000_000
GROUPS = {"eu-0": "gpu-eu", "eu-1": "gpu-eu", "home-0": "tpu"}


def mint(**overrides: object) -> str:
    fields: dict[str, object] = {
        "run_secret": SECRET,
        "run": "big-run",
        "group": "gpu-eu",
        "expires": EXPIRES,
        "id": "cred1",
    }
    fields.update(overrides)
    return mint_join_credential(**fields)  # type: ignore[arg-type]


def test_a_credential_round_trips_and_its_public_part_hides_the_key() -> None:
    text = mint()
    cred = parse_join_credential(text)
    assert (cred.run, cred.group, cred.expires, cred.id) == ("big-run", "gpu-eu", EXPIRES, "cred1")
    assert cred.serialise() == text and text.startswith("dj1.")
    assert cred.key == credential_key(SECRET, "big-run", "gpu-eu", EXPIRES, "cred1")
    assert cred.key not in cred.public and SECRET not in text
    assert cred.key not in repr(cred)  # never in a log line by accident
    public = parse_join_public(cred.public)
    assert public == JoinCredential("big-run", "gpu-eu", EXPIRES, "cred1")
    doc = json.loads(base64.urlsafe_b64decode(cred.public.split(".")[1] + "=="))
    assert doc == {"run": "big-run", "group": "gpu-eu", "expires": EXPIRES, "id": "cred1"}


def test_ids_are_random_unless_given() -> None:
    a, b = parse_join_credential(mint(id=None)), parse_join_credential(mint(id=None))
    assert a.id != b.id and len(a.id) == 32
    assert a.key != b.key


def test_a_units_token_is_unit_token_keyed_by_the_credential_key() -> None:
    text = mint()
    key = parse_join_credential(text).key
    assert unit_token_from_credential(text, "eu-0") == unit_token(key, "eu-0")
    assert unit_token_from_credential(parse_join_credential(text), "eu-0") == unit_token(
        key, "eu-0"
    )
    assert unit_token_from_credential(text, "eu-0") != unit_token(SECRET, "eu-0")
    assert unit_token_from_credential(text, "eu-0") != unit_token_from_credential(text, "eu-1")
    with pytest.raises(ValueError, match="no key"):
        unit_token_from_credential(parse_join_public(parse_join_credential(text).public), "eu-0")


def test_every_public_field_and_the_secret_go_into_the_key() -> None:
    base = parse_join_credential(mint()).key
    for change in ({"run": "other"}, {"group": "tpu"}, {"expires": EXPIRES + 1}, {"id": "cred2"}):
        assert parse_join_credential(mint(**change)).key != base, change
    assert parse_join_credential(mint(run_secret="another-secret")).key != base
    # Fields joined by newlines cannot run into each other: none may hold one.
    with pytest.raises(ValueError, match="run: control characters"):
        mint(run="big\nrun")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("dj1.abc", r"expected dj1.<public>.<key> \(3 parts\), got 2"),
        ("dj9.e30." + "0" * 64, r"unknown format 'dj9'"),
        ("dj1.!!!." + "0" * 64, "not base64url JSON"),
        ("dj1.e30." + "0" * 64, r"exactly \['expires', 'group', 'id', 'run'\], got \[\]"),
    ],
)
def test_a_malformed_credential_is_refused_naming_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_join_credential(text)


def test_a_bad_key_is_refused_without_quoting_it() -> None:
    text = mint()[:-1] + "X"
    with pytest.raises(ValueError, match="key must be 64 lowercase hex digits") as refused:
        parse_join_credential(text)
    assert text.rsplit(".", 1)[1][:-1] not in str(refused.value)


def test_a_public_part_with_an_extra_or_mistyped_field_is_refused() -> None:
    def encoded(doc: dict[str, object]) -> str:
        raw = json.dumps(doc).encode()
        return "dj1." + base64.urlsafe_b64encode(raw).rstrip(b"=").decode()

    good = {"run": "r", "group": "g", "expires": EXPIRES, "id": "i"}
    assert parse_join_public(encoded(good)).run == "r"
    with pytest.raises(ValueError, match="exactly"):
        parse_join_public(encoded({**good, "admin": True}))  # a field no key covers
    with pytest.raises(ValueError, match="expires must be an integer"):
        parse_join_public(encoded({**good, "expires": "soon"}))
    with pytest.raises(ValueError, match="id: 1 to 64"):
        parse_join_public(encoded({**good, "id": "a b"}))
    with pytest.raises(ValueError, match="whole credential, key included"):
        parse_join_public(mint())


def check(header: str, token: str, unit: str = "eu-0", **kw: object) -> JoinCredential | Refusal:
    args: dict[str, object] = {
        "run_secret": SECRET,
        "run": "big-run",
        "header": header,
        "token": token,
        "unit": unit,
        "now": EXPIRES - 3600.0,
        "revoked": frozenset(),
        "groups": GROUPS,
    }
    args.update(kw)
    return check_join(**args)  # type: ignore[arg-type]


def reason(verdict: JoinCredential | Refusal) -> str:
    return verdict.reason if isinstance(verdict, Refusal) else "accepted"


def test_the_syncer_check_accepts_a_good_credential_and_names_each_refusal() -> None:
    text = mint()
    cred = parse_join_credential(text)
    token = unit_token_from_credential(text, "eu-0")
    assert check(cred.public, token) == JoinCredential("big-run", "gpu-eu", EXPIRES, "cred1")
    assert reason(check(cred.public, token, now=EXPIRES + CLOCK_SKEW_SECONDS)) == "accepted"
    assert reason(check(cred.public, token, now=EXPIRES + CLOCK_SKEW_SECONDS + 1)) == (
        "credential_expired"
    )
    assert reason(check(cred.public, token, revoked={"cred1"})) == "credential_revoked"
    assert reason(check(cred.public, token, run="another-run")) == "credential_foreign_run"
    assert reason(check(cred.public, "0" * 64)) == "bad_token"
    assert reason(check("dj1.%%%", token)) == "credential_malformed"
    assert reason(check(cred.public, token, groups=None)) == "credential_wrong_group"
    # Unit names the roster does not know pass here: the roster refuses them (unknown_unit).
    stranger = unit_token_from_credential(text, "nobody")
    assert reason(check(cred.public, stranger, unit="nobody")) == "accepted"
    # The away operator's observer is of no group; what it may do, the syncer limits.
    watcher = unit_token_from_credential(text, OBSERVER)
    assert reason(check(cred.public, watcher, unit=OBSERVER, groups=None)) == "accepted"
    assert reason(check(cred.public, watcher, unit=OBSERVER, revoked={"cred1"})) == (
        "credential_revoked"
    )


def test_a_credential_cannot_act_as_a_unit_of_another_group_or_run() -> None:
    text = mint()
    public = parse_join_credential(text).public
    # A unit of the home group, with a token the credential's key makes for it.
    home = check(public, unit_token_from_credential(text, "home-0"), unit="home-0")
    assert isinstance(home, Refusal) and home.reason == "credential_wrong_group"
    assert "'gpu-eu'" in home.message and "'tpu'" in home.message
    # A credential of another run (another secret) is of no use here.
    foreign = mint(run="run-b", run_secret="secret-b")
    fp = parse_join_credential(foreign).public
    assert (
        reason(check(fp, unit_token_from_credential(foreign, "eu-0"))) == "credential_foreign_run"
    )
    # Nor is one whose public part was edited: its group, to reach the home unit...
    cred = parse_join_credential(text)
    edited = JoinCredential(cred.run, "tpu", cred.expires, cred.id).public
    assert reason(check(edited, unit_token_from_credential(text, "home-0"), unit="home-0")) == (
        "bad_token"
    )
    # ... or its expiry, to live longer.
    later = JoinCredential(cred.run, cred.group, cred.expires + 10**6, cred.id).public
    token = unit_token_from_credential(text, "eu-0")
    assert reason(check(later, token, now=EXPIRES + 3600.0)) == "bad_token"
    # A home unit's token is no credential token, and the other way round.
    assert reason(check(public, unit_token(SECRET, "eu-0"))) == "bad_token"
