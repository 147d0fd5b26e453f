"""The supervisor's view of the syncer: /v1/status over loopback HTTP.

Stdlib only (urllib) and short timeouts: the supervisor's tick must not stall when the syncer is
down, which under chaos it regularly is.
"""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request

from diloco_trainer.status import SyncerStatus


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the syncer binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


class SyncerClient:
    def __init__(self, base_url: str, token: str, timeout: float = 1.0) -> None:
        self.base_url = base_url.rstrip("/")
        self._token = token
        self._timeout = timeout

    def status(self) -> SyncerStatus | None:
        """The syncer's status (docs/contracts.md), or None when it cannot be reached."""
        req = urllib.request.Request(
            f"{self.base_url}/v1/status", headers={"Authorization": f"Bearer {self._token}"}
        )
        try:
            with urllib.request.urlopen(req, timeout=self._timeout) as resp:
                body = json.loads(resp.read())
        except (OSError, urllib.error.URLError, ValueError):
            return None
        return SyncerStatus.from_json(body) if isinstance(body, dict) else None
