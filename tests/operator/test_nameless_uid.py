"""The operator runs as uid 65532, which has no passwd entry in our images (nor in most minimal
ones). kopf names its peering identity with getpass.getuser(), which then raises: the in-cluster
operator crash-looped on its first real start (the real-workload e2e module starts it for real).
The chart and the images set USER; here the missing passwd entry is simulated."""

from __future__ import annotations

import pwd
import re
from pathlib import Path
from typing import NoReturn

import pytest
from kopf._core.engines import peering

ROOT = Path(__file__).resolve().parents[2]
NAME_VARS = ("LOGNAME", "USER", "LNAME", "USERNAME")


def _chart_env() -> dict[str, str]:
    text = (ROOT / "charts/diloco-operator/templates/deployment.yaml").read_text()
    return dict(re.findall(r"- name: (\w+)\n\s+value: (\S+)", text))


@pytest.fixture
def nameless_uid(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    def no_entry(uid: int) -> NoReturn:
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    monkeypatch.setattr(pwd, "getpwuid", no_entry)
    for var in NAME_VARS:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_without_a_user_name_kopf_cannot_name_itself(nameless_uid: pytest.MonkeyPatch) -> None:
    with pytest.raises(KeyError, match="getpwuid"):
        peering.detect_own_id(manual=False)


def test_the_charts_env_names_the_operator(nameless_uid: pytest.MonkeyPatch) -> None:
    env = _chart_env()
    assert "USER" in env, "the chart's operator Deployment must set USER"
    for key, value in env.items():
        nameless_uid.setenv(key, value)
    assert peering.detect_own_id(manual=False).startswith(env["USER"])


def test_images_name_their_user() -> None:
    for dockerfile in (ROOT / "docker").glob("*.Dockerfile"):
        text = dockerfile.read_text()
        assert re.search(r"^ENV .*\bUSER=\w+", text, re.M), dockerfile.name
