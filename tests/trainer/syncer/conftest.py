"""Fixtures for the gs:// checkpoint tests: a fake-gcs-server per module, a bucket per test."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from gcs_server import FakeGcs, fake_gcs_binary, fake_gcs_server


@dataclass
class Bucket:
    server: FakeGcs
    name: str

    def url(self, prefix: str) -> str:
        return f"gs://{self.name}/{prefix}"

    def objects(self, prefix: str = "") -> dict[str, int]:
        return self.server.objects(self.name, prefix)

    def _blob(self, key: str) -> Any:
        from google.cloud import storage

        return storage.Client(project=None).bucket(self.name).blob(key)

    def put(self, key: str, data: bytes) -> None:
        """Write an object directly (what a crash, a bug or a person might leave)."""
        self._blob(key).upload_from_string(data)

    def get(self, key: str) -> bytes:
        return bytes(self._blob(key).download_as_bytes())


@pytest.fixture(scope="module")
def gcs_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeGcs]:
    binary = fake_gcs_binary()
    if binary is None:
        pytest.skip("go is not installed: fake-gcs-server cannot be built (make e2e-deps)")
    with fake_gcs_server(binary, tmp_path_factory.mktemp("gcs") / "server.log") as server:
        yield server


@pytest.fixture
def bucket(gcs_server: FakeGcs, monkeypatch: pytest.MonkeyPatch) -> Bucket:
    """A fresh bucket, with STORAGE_EMULATOR_HOST pointing this process (and the processes it
    starts) at the fake server: the client library then uses no credential."""
    name = f"ckpt-test-{uuid.uuid4().hex[:12]}"
    gcs_server.create_bucket(name)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_server.url)
    return Bucket(gcs_server, name)
