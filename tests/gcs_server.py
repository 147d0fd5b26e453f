"""A real GCS-compatible server on loopback for the gs:// tests: fsouza/fake-gcs-server, built
from the Go module proxy by `e2e/cluster/build.sh fakegcs` (part of `make e2e-deps`) at the
version pinned in e2e/cluster/versions.env. A test that needs it builds it when missing; only a
machine without Go skips."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "e2e" / "cluster" / "build.sh"


def _cache() -> Path:
    if env := os.environ.get("DILOCO_E2E_CACHE"):
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "diloco-e2e"


def fake_gcs_binary() -> Path | None:
    """The pinned fake-gcs-server (built now if missing), or None when Go is not installed."""
    versions = (ROOT / "e2e" / "cluster" / "versions.env").read_text()
    match = re.search(r"^FAKE_GCS_VERSION=(\S+)", versions, re.MULTILINE)
    assert match, "FAKE_GCS_VERSION missing from e2e/cluster/versions.env"
    binary = _cache() / f"fake-gcs-server-{match.group(1)}" / "bin" / "fake-gcs-server"
    if (binary.parent / ".complete").exists() and binary.exists():
        return binary
    if shutil.which("go") is None:
        return None
    subprocess.run(["bash", str(BUILD), "fakegcs"], check=True, stdout=subprocess.DEVNULL)
    return binary


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class FakeGcs:
    url: str  # what STORAGE_EMULATOR_HOST should be
    process: subprocess.Popen[bytes]

    def _get(self, path: str) -> dict[str, object]:
        with urllib.request.urlopen(f"{self.url}{path}", timeout=10) as r:
            return dict(json.load(r))

    def create_bucket(self, name: str) -> None:
        req = urllib.request.Request(
            f"{self.url}/storage/v1/b?project=test",
            data=json.dumps({"name": name}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(req, timeout=10):
            pass

    def objects(self, bucket: str, prefix: str = "") -> dict[str, int]:
        """Object name -> size, under `prefix`."""
        found: dict[str, int] = {}
        token = ""
        while True:
            query = urllib.parse.urlencode({"prefix": prefix, "pageToken": token})
            page = self._get(f"/storage/v1/b/{bucket}/o?{query}")
            for item in page.get("items") or []:  # type: ignore[attr-defined]
                found[item["name"]] = int(item["size"])
            token = str(page.get("nextPageToken") or "")
            if not token:
                return found


@contextmanager
def fake_gcs_server(binary: Path, log: Path, buckets: tuple[str, ...] = ()) -> Iterator[FakeGcs]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                str(binary),
                "-scheme",
                "http",
                "-host",
                "127.0.0.1",
                "-port",
                str(port),
                "-backend",
                "memory",
                "-external-url",
                url,
                "-log-level",
                "warn",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    server = FakeGcs(url, proc)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                server._get("/storage/v1/b?project=test")
                break
            except (urllib.error.URLError, ConnectionError) as exc:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"fake-gcs-server did not start: {log.read_text()}") from exc
                time.sleep(0.1)
        for bucket in buckets:
            server.create_bucket(bucket)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
