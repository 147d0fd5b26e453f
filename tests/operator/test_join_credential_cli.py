"""`diloco join-credential`: a Secret manifest for the away cluster whose credential the home
syncer would accept for that group only, and clear refusals of bad input."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml
from diloco_operator.cli import main
from diloco_trainer.join_credentials import (
    JoinCredential,
    check_join,
    parse_join_credential,
    unit_token_from_credential,
)


def test_the_printed_secret_holds_a_credential_home_accepts_for_its_group(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    secret_file = tmp_path / "run-secret"
    secret_file.write_text("s3cret\n")
    args = ["--group", "v5p", "--expires-in", "2h", "--run-secret-file", str(secret_file)]
    code = main(["join-credential", "r", *args])
    out = capsys.readouterr()
    assert code == 0
    doc = yaml.safe_load(out.out)
    assert doc["kind"] == "Secret" and doc["metadata"]["name"] == "r-v5p-join"
    cred = parse_join_credential(doc["stringData"]["credential"])
    assert (cred.run, cred.group) == ("r", "v5p")
    assert 7000 < cred.expires - time.time() <= 7200
    assert cred.id in out.err and "revokedCredentials" in out.err
    roster = {"r-v5p-0": "v5p", "r-v6e-0": "v6e"}

    def verdict(unit: str) -> object:
        token = unit_token_from_credential(cred, unit)
        return check_join("s3cret", "r", cred.public, token, unit, time.time(), (), roster)

    assert isinstance(verdict("r-v5p-0"), JoinCredential)
    assert getattr(verdict("r-v6e-0"), "reason", None) == "credential_wrong_group"


@pytest.mark.parametrize("expires", ["0h", "3 days", "-1d"])
def test_a_bad_duration_is_refused_naming_it(
    expires: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["join-credential", "r", "--group", "g", f"--expires-in={expires}"])
    assert exc.value.code == 2
    assert "duration" in capsys.readouterr().err


def test_an_empty_run_secret_file_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "empty"
    empty.write_text("")
    assert main(["join-credential", "r", "--group", "g", "--run-secret-file", str(empty)]) == 2
    assert "empty" in capsys.readouterr().err
