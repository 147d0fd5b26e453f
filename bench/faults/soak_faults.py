"""The soak's faults that the local runtime's chaos cannot deliver, delivered by the bench while
the run goes: a full checkpoint disk for a while, and a learner that sends garbage.

Disk full: the run's checkpoint directory is a small tmpfs (`checkpoint_disk`); a ballast file
fills it for the fault's duration, then is deleted. Garbage: with the run secret read from the
serving syncer's environment (what an insider on the syncer's host could read), a real unit's
token is derived and hostile requests are sent under it; every answer is counted, and any 2xx to
garbage is a failure.
"""

from __future__ import annotations

import contextlib
import json
import math
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from diloco_trainer.auth import UNIT_HEADER, unit_token
from diloco_trainer.syncer.standby import serving_pid
from diloco_trainer.wire import PushHeader, encode_push

from bench.lib.common import log

BALLAST = "ballast.bin"
GARBAGE_WAIT = 60.0  # seconds a garbage burst waits for a serving syncer


@dataclass(frozen=True)
class BenchFault:
    """One fault the bench delivers: `disk-full` for `seconds`, or a `garbage` burst."""

    at: float  # seconds after the run started
    kind: str
    seconds: float = 0.0


@dataclass
class Tally:
    """What the bench delivered and what the syncer answered to the garbage."""

    delivered: Counter[str] = field(default_factory=Counter)
    skipped: Counter[str] = field(default_factory=Counter)  # why a fault could not be delivered
    answers: Counter[str] = field(default_factory=Counter)  # "<request kind> <status>"
    accepted_garbage: list[str] = field(default_factory=list)  # 2xx answers to garbage
    disk_full_seconds: float = 0.0


@contextlib.contextmanager
def checkpoint_disk(size_mib: int) -> Iterator[Path | None]:
    """A fresh tmpfs of `size_mib`, unmounted afterwards; None when this machine cannot mount
    one (not root, no CAP_SYS_ADMIN). The checkpoints go in a folder on it and the ballast
    beside that folder, as another writer's file would fill a disk (a syncer refuses a
    checkpoint folder holding files it does not know)."""
    with tempfile.TemporaryDirectory(prefix="bench-soak-disk-") as tmp:
        mount = Path(tmp) / "ckpt"
        mount.mkdir()
        cmd = ["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(mount)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            log(f"soak: cannot mount a tmpfs ({done.stderr.strip()}); no disk-full faults")
            yield None
            return
        try:
            yield mount
        finally:
            subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def fill(disk: Path) -> int:
    """Write a ballast file until the disk refuses more; returns its size."""
    written = 0
    chunk = b"\0" * (1 << 20)
    with (disk / BALLAST).open("wb", buffering=0) as out:
        while True:
            try:
                written += out.write(chunk)
            except OSError:
                break
    return written


class BenchFaults:
    """Delivers `faults` (sorted by time) against the local run whose report folder is
    `report`, on its own thread, until `stop` is set."""

    def __init__(self, faults: list[BenchFault], disk: Path | None) -> None:
        self.faults = sorted(faults, key=lambda f: f.at)
        self.disk = disk
        self.tally = Tally()
        self.stop = threading.Event()
        self._rng = np.random.default_rng(0)

    def run(self, report: Path) -> None:
        started = _wait_started(report, self.stop)
        if started is None:
            return
        for i, fault in enumerate(self.faults):
            if self.stop.wait(max(0.0, started + fault.at - time.time())):
                for late in self.faults[i:]:
                    self.tally.skipped[f"{late.kind}: run over"] += 1
                break
            try:
                if fault.kind == "disk-full":
                    self._disk_full(fault.seconds)
                else:
                    self._garbage(report)
            except Exception as exc:  # a bench fault must never end the run's bench
                self.tally.skipped[f"{fault.kind}: {type(exc).__name__}"] += 1
                log(f"soak: {fault.kind} at {fault.at:.0f}s failed: {exc!r}")

    def _disk_full(self, seconds: float) -> None:
        if self.disk is None:
            self.tally.skipped["disk-full: no tmpfs"] += 1
            return
        began = time.monotonic()
        size = fill(self.disk)
        self.tally.delivered["disk-full"] += 1
        log(f"soak: checkpoint disk full ({size >> 20} MiB ballast) for {seconds:.0f}s")
        self.stop.wait(seconds)
        (self.disk / BALLAST).unlink(missing_ok=True)
        self.tally.disk_full_seconds += time.monotonic() - began

    def _garbage(self, report: Path) -> None:
        """One burst, once a syncer serves and the join succeeds: between a syncer kill and its
        successor's take-over none does, so wait up to GARBAGE_WAIT seconds for one."""
        waited, problem = time.monotonic(), "no serving syncer"
        while True:
            target = serving_syncer(report)
            if target is not None:
                sender = GarbageSender(target[0], target[1], self._rng)
                joined = sender.join()
                if joined is None:
                    break
                problem = f"join failed: {joined}"
            if time.monotonic() - waited > GARBAGE_WAIT or self.stop.wait(1.0):
                self.tally.skipped[f"garbage: {problem}"] += 1
                return
        self.tally.delivered["garbage"] += 1
        for kind, status in sender.burst():
            self.tally.answers[f"{kind} {status}"] += 1
            if 200 <= status < 300:
                self.tally.accepted_garbage.append(f"{kind} {status}")


def _wait_started(report: Path, stop: threading.Event) -> float | None:
    """Wall time of the run's start (its first event), once its syncer has served: a fault
    before that would end the run as a syncer that cannot start (the runtime's rule), which
    is not what the soak is for. Faults due meanwhile come late."""
    events = report / "events.jsonl"
    while not stop.is_set():
        text = events.read_text() if events.exists() else ""
        if '"kind": "syncer-ready"' in text:
            return float(json.loads(text.split("\n", 1)[0])["time"])
        stop.wait(0.2)
    return None


def serving_syncer(report: Path) -> tuple[str, str] | None:
    """(base URL, run secret) of the syncer serving now: its pid from the serving lock (the
    standby protocol's), its port from the run's events, its secret from its environment."""
    pid = serving_pid(report / "logs" / "syncer.lock")
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if pid else []
    except OSError:
        return None
    env = dict(item.decode().split("=", 1) for item in environ if b"=" in item)
    ports = [
        line.split("syncer on port ")[1].split('"')[0]
        for line in (report / "events.jsonl").read_text().splitlines()
        if "syncer on port " in line
    ]
    if "DILOCO_TOKEN" not in env or not ports:
        return None
    return f"http://127.0.0.1:{ports[-1]}", env["DILOCO_TOKEN"]


class GarbageSender:
    """A learner that holds a real unit's token and sends hostile pushes and heartbeats."""

    def __init__(self, url: str, secret: str, rng: np.random.Generator) -> None:
        self.url, self.secret, self.rng = url, secret, rng
        self.unit, self.attempt, self.group = "", 0, "default"
        self.layout: list[list[str]] = []
        self.shapes: dict[str, list[int]] = {}
        self.versions: list[int] = []

    def _send(
        self, path: str, body: bytes, token: str, unit: str | None, kind: str = "json"
    ) -> tuple[int, bytes]:
        headers = {"Authorization": f"Bearer {token}"}
        headers["Content-Type"] = "application/json" if kind == "json" else kind
        if unit is not None:
            headers[UNIT_HEADER] = unit
        req = urllib.request.Request(f"{self.url}{path}", body, headers, method="POST")
        if not body:
            req = urllib.request.Request(f"{self.url}{path}", headers=headers, method="GET")
        try:
            with urllib.request.urlopen(req, timeout=15) as resp:
                return int(resp.status), resp.read()
        except urllib.error.HTTPError as exc:
            return int(exc.code), exc.read()

    def join(self) -> str | None:
        """Join as a real unit under its current attempt (picked from the syncer's status, read
        with the run secret), so that pushes get past the join check to their content. None
        when joined, else why not."""
        try:
            _, raw = self._send("/v1/status", b"", self.secret, None)
            learners = json.loads(raw).get("learners") or {}
            if not learners:
                return "no learner in the status"
            self.unit = sorted(learners)[int(self.rng.integers(len(learners)))]
            self.attempt = int(learners[self.unit].get("attempt") or 0)
            self.group = str(learners[self.unit].get("group") or "default")
            body = {"unit": self.unit, "attempt": self.attempt, "group": self.group}
            status, raw = self._send("/v1/join", json.dumps(body).encode(), self.token, self.unit)
        except (OSError, ValueError) as exc:
            return type(exc).__name__
        if status != 200:
            return f"{status} {raw[:80]!r}"
        reply = json.loads(raw)
        self.layout, self.shapes = reply["layout"], reply["shapes"]
        self.versions = [int(v) for v in reply["versions"]]
        return None

    @property
    def token(self) -> str:
        return unit_token(self.secret, self.unit)

    def burst(self) -> list[tuple[str, int]]:
        """One round of every kind of garbage: (kind, HTTP status; 0: no answer)."""
        answers = []
        for kind, path, body, ctype in self._pushes() + self._heartbeats():
            try:
                status, _ = self._send(path, body, self.token, self.unit, ctype)
            except OSError:
                status = 0  # the syncer went away meanwhile (a kill): no answer, not a 2xx
            answers.append((kind, status))
        return answers

    def _delta(self, p: int, fill_value: float | None, scale: float = 0.0) -> dict[str, Any]:
        out = {}
        for name in self.layout[p]:
            shape = tuple(self.shapes[name])
            arr = self.rng.standard_normal(shape).astype(np.float32) * np.float32(scale)
            if fill_value is not None:
                arr.flat[0] = fill_value
            out[name] = arr
        return out

    def _push(self, p: int, delta: dict[str, Any], fragment: int | None = None) -> bytes:
        step = int(self.rng.integers(10**6, 10**9))  # a key no real push of this unit uses
        header = PushHeader(
            p if fragment is None else fragment,
            self.versions[p],
            20,
            2560,
            "none",
            self.unit,
            self.attempt,
            step=step,
        )
        return encode_push(header, delta, 32)[0]

    def _pushes(self) -> list[tuple[str, str, bytes, str]]:
        p = int(self.rng.integers(len(self.layout)))
        path, octet = f"/v1/fragments/{p}/push", "application/octet-stream"
        wrong = {n: np.zeros((3, 5), np.float32) for n in self.layout[p]}
        whole = self._push(p, self._delta(p, None, 0.01))
        other = (p + 1) % len(self.layout)
        return [
            ("push NaN", path, self._push(p, self._delta(p, math.nan, 0.01)), octet),
            ("push Inf", path, self._push(p, self._delta(p, math.inf, 0.01)), octet),
            ("push huge norm", path, self._push(p, self._delta(p, None, 1e17)), octet),
            ("push wrong shapes", path, self._push(p, wrong), octet),
            ("push truncated", path, whole[: len(whole) // 2], octet),
            ("push random bytes", path, self.rng.bytes(4096), octet),
            ("push other fragment", path, self._push(other, self._delta(other, None)), octet),
        ]

    def _heartbeats(self) -> list[tuple[str, str, bytes, str]]:
        me = {"unit": self.unit, "attempt": self.attempt, "group": self.group}

        def beat(**fields: Any) -> bytes:
            return json.dumps({**me, "step": 1, "tokens": 1, **fields}).encode()

        return [
            ("heartbeat huge tokens", "/v1/heartbeat", beat(tokens=10**400), "json"),
            ("heartbeat negative step", "/v1/heartbeat", beat(step=-5), "json"),
            ("heartbeat string loss", "/v1/heartbeat", beat(loss="NaN"), "json"),
            ("heartbeat other unit", "/v1/heartbeat", beat(unit=self.unit + "x"), "json"),
            ("heartbeat not JSON", "/v1/heartbeat", b"{unit: 1", "json"),
            ("heartbeat deep JSON", "/v1/heartbeat", b"[" * 100_000 + b"]" * 100_000, "json"),
        ]


def alongside(faults: BenchFaults) -> Callable[[Path], AbstractContextManager[None]]:
    """The hook for `bench.lib.live.local_run`: run `faults` on a thread while the run goes."""

    @contextlib.contextmanager
    def hook(report: Path) -> Iterator[None]:
        thread = threading.Thread(target=faults.run, args=(report,), daemon=True)
        thread.start()
        try:
            yield
        finally:
            faults.stop.set()
            thread.join(timeout=60)
            if faults.disk is not None:
                (faults.disk / BALLAST).unlink(missing_ok=True)

    return hook


__all__ = ["BenchFault", "BenchFaults", "Tally", "alongside", "checkpoint_disk"]
