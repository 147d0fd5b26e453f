"""An emulated WAN link on loopback: a toxiproxy-server process (github.com/Shopify/toxiproxy,
built from the Go module proxy by `e2e/cluster/build.sh toxiproxy` at the version pinned in
e2e/cluster/versions.env) and a TCP proxy through it, shaped with toxics over toxiproxy's HTTP
API: latency with jitter, a bandwidth limit, connection resets, and the link cut (the proxy
disabled: its listener closed and every connection through it dropped)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.lib.common import REPO
from bench.lib.live import free_port, stop

BUILD = REPO / "e2e" / "cluster" / "build.sh"
VERSIONS = REPO / "e2e" / "cluster" / "versions.env"
DIRECTIONS = ("upstream", "downstream")  # client -> server, server -> client


def _cache() -> Path:
    if env := os.environ.get("DILOCO_E2E_CACHE"):
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "diloco-e2e"


def version() -> str:
    """The toxiproxy version pinned in e2e/cluster/versions.env."""
    match = re.search(r"^TOXIPROXY_VERSION=(\S+)", VERSIONS.read_text(), re.MULTILINE)
    if match is None:
        raise RuntimeError(f"TOXIPROXY_VERSION missing from {VERSIONS}")
    return match.group(1)


def binary() -> Path:
    """The pinned toxiproxy-server, built now (a few minutes cold) if it is missing."""
    path = _cache() / f"toxiproxy-{version()}" / "bin" / "toxiproxy-server"
    if (path.parent / ".complete").exists() and path.exists():
        return path
    if shutil.which("go") is None:
        raise RuntimeError(f"{path} is missing and Go is not installed to build it")
    subprocess.run(["bash", str(BUILD), "toxiproxy"], check=True, stdout=subprocess.DEVNULL)
    return path


@dataclass(frozen=True)
class Shape:
    """What a link does to the traffic through it. `rtt_ms` is split evenly over the two
    directions, each with `jitter` of its latency either way; `rate_kb` is toxiproxy's
    bandwidth toxic (KB/s, per connection and direction; None: unlimited); `reset_share` is
    the reset_peer toxic's toxicity (the share of draws that reset a connection)."""

    rtt_ms: float = 0.0
    jitter: float = 0.1
    rate_kb: int | None = None
    reset_share: float = 0.0

    def toxics(self) -> list[dict[str, Any]]:
        """The toxics (toxiproxy's JSON) for this shape, in chain order."""
        found: list[dict[str, Any]] = []
        for stream in DIRECTIONS:
            if self.rtt_ms > 0:
                one_way = round(self.rtt_ms / 2)
                attributes = {"latency": one_way, "jitter": round(self.jitter * one_way)}
                found.append(_toxic(f"latency_{stream}", "latency", stream, attributes))
            if self.rate_kb is not None:
                attributes = {"rate": self.rate_kb}
                found.append(_toxic(f"bandwidth_{stream}", "bandwidth", stream, attributes))
        if self.reset_share > 0:  # on the responses: the request was served, its answer is lost
            attributes = {"timeout": 0}
            found.append(
                _toxic(RESET_TOXIC, "reset_peer", "downstream", attributes, self.reset_share)
            )
        return found


RESET_TOXIC = "reset_downstream"
# How often every open connection's reset is drawn again: more often than one connection carries
# responses, so that each response meets about one draw of its own.
REDRAW_SECONDS = 0.2


def _toxic(
    name: str, kind: str, stream: str, attributes: dict[str, Any], toxicity: float = 1.0
) -> dict[str, Any]:
    return {
        "name": name,
        "type": kind,
        "stream": stream,
        "toxicity": toxicity,
        "attributes": attributes,
    }


@dataclass
class Link:
    """One proxy of a running toxiproxy-server: clients connect to `url`, it forwards to its
    upstream through the shape's toxics."""

    api: str
    name: str
    url: str
    shape: Shape
    log_path: Path  # toxiproxy-server's log (level info: a line per accepted client)

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"{self.api}{path}", data=data, method=method)
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.loads(resp.read() or b"null")

    def set_enabled(self, enabled: bool) -> None:
        """Cut the link (False: the listener closes and every open connection is dropped, so
        clients see refused connections) or heal it."""
        self._call("POST", f"/proxies/{self.name}", {"enabled": enabled})

    def redraw_resets(self) -> None:
        """Draw again, for every open connection, whether the reset toxic applies to it (to its
        next response). toxiproxy draws once per connection, when the connection opens or the
        toxic changes, and clients keep their connections open (keep-alive): without new draws
        almost no connection would ever be reset."""
        body = {"toxicity": self.shape.reset_share}
        self._call("POST", f"/proxies/{self.name}/toxics/{RESET_TOXIC}", body)

    def _redraw_until(self, stopped: threading.Event) -> None:
        while not stopped.wait(REDRAW_SECONDS):
            with contextlib.suppress(OSError):  # a busy API server: the next draw comes soon
                self.redraw_resets()

    def connections_opened(self) -> int:
        """TCP connections clients have opened through the proxy so far."""
        return self.log_path.read_text(errors="replace").count('"Accepted client"')

    def bytes_received(self) -> dict[str, int]:
        """Bytes the proxy has read per direction (upstream: from its clients; downstream:
        from the server) over connections that have closed: toxiproxy counts a connection's
        bytes when it ends."""
        with urllib.request.urlopen(f"{self.api}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        found = dict.fromkeys(DIRECTIONS, 0)
        pattern = r'^toxiproxy_proxy_received_bytes_total\{direction="(\w+)",[^}]*proxy="(\w+)"'
        for line in text.splitlines():
            m = re.match(pattern + r"[^}]*\}\s+(\S+)", line)
            if m and m.group(2) == self.name:
                found[m.group(1)] = int(float(m.group(3)))
        return found


@contextmanager
def wan_link(
    upstream_port: int,
    shape: Shape,
    name: str = "wan",
    *,
    upstream_host: str = "127.0.0.1",
    listen_host: str = "127.0.0.1",
) -> Iterator[Link]:
    """A toxiproxy-server (its API on 127.0.0.1) with one proxy listening on `listen_host` and
    forwarding to `upstream_host`:`upstream_port`, shaped by `shape`; the toxics are in place before the first client connects (a reset toxic only
    works on connections that start after it was added), and with resets, every open
    connection's is drawn again every REDRAW_SECONDS (`redraw_resets`) until the link closes."""
    api_port, port = free_port(), free_port()
    with tempfile.TemporaryDirectory(prefix="bench-toxiproxy-") as tmp:
        log_path = Path(tmp) / "toxiproxy.log"
        log_file = log_path.open("wb")
        cmd = [str(binary()), "-host", "127.0.0.1", "-port", str(api_port), "-proxy-metrics"]
        env = {**os.environ, "LOG_LEVEL": "info"}  # not its API's access lines (debug)
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env)
        api = f"http://127.0.0.1:{api_port}"
        link = Link(api, name, f"http://{listen_host}:{port}", shape, log_path)
        stopped = threading.Event()
        try:
            _wait_api(api, proc)
            link._call(
                "POST",
                "/proxies",
                {
                    "name": name,
                    "listen": f"{listen_host}:{port}",
                    "upstream": f"{upstream_host}:{upstream_port}",
                    "enabled": True,
                },
            )
            for toxic in shape.toxics():
                link._call("POST", f"/proxies/{name}/toxics", toxic)
            if shape.reset_share > 0:
                args = (stopped,)
                threading.Thread(target=link._redraw_until, args=args, daemon=True).start()
            yield link
        finally:
            stopped.set()
            stop(proc, 10)
            log_file.close()


def _wait_api(api: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"toxiproxy-server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{api}/version", timeout=2):
                return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError("toxiproxy-server did not answer within 30 s")
