"""The processes of a local cluster: each one spawned in its own session, its output in
state_dir/logs/<name>.log and its pid (with the binary it runs) in state_dir/pids/<name>.pid;
found again by that record or by a /proc scan, waited for, and stopped with SIGTERM, then SIGKILL.

Also what every component module needs: ClusterError, the log line, free ports, a checked
subprocess call, and the state dir's reset.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

STATE_MARKER = ".diloco-e2e-state"


class ClusterError(RuntimeError):
    """The cluster could not be built, started, reached or stopped (message says why)."""


def log(msg: str) -> None:
    print(f"[e2e-cluster {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(argv: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(argv, capture_output=True, text=True, **kw)
    if r.returncode != 0:
        raise ClusterError(
            f"{' '.join(map(str, argv))} failed ({r.returncode}): {r.stderr.strip()}"
        )
    return r


def tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def proc_alive(pid: int) -> bool:
    """True while the process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError):
        return False


def proc_cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def http_ok(url: str, expect: bytes, insecure: bool = False) -> bool:
    """GET url answers 200 with `expect` in the body."""
    ctx = None
    if url.startswith("https"):
        ctx = ssl.create_default_context()
        if insecure:  # kcm / scheduler serve with self-signed certs on loopback
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
    try:
        with urllib.request.urlopen(url, context=ctx, timeout=3) as r:
            return r.status == 200 and expect in r.read()
    except urllib.error.HTTPError:
        return False


def reset_state_dir(st: Path) -> None:
    """An empty state dir with logs/, pids/ and pki/; refuses to wipe a dir that is not one."""
    if st.exists() and any(st.iterdir()) and not (st / STATE_MARKER).exists():
        raise ClusterError(f"{st} is not empty and not a diloco-e2e state dir; refusing to wipe")
    if st.exists():
        shutil.rmtree(st)
    for sub in ("logs", "pids", "pki"):
        (st / sub).mkdir(parents=True, exist_ok=True)
    (st / STATE_MARKER).write_text("state dir of e2e/cluster/harness.py; wiped on start\n")


def signal_group(pid: int, sig: int) -> None:
    # each component leads its own process group (start_new_session): signal the group
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


class Processes:
    """The processes of the cluster in state_dir. `names` are the programs that may run there
    (what a /proc scan looks for); `exe_root` is where their binaries live (the cache)."""

    def __init__(self, state_dir: Path, names: Iterable[str], exe_root: Path) -> None:
        self.state_dir = state_dir
        self.names = tuple(names)
        self.exe_root = exe_root
        self.popen: dict[str, subprocess.Popen[bytes]] = {}

    def log_path(self, name: str) -> Path:
        return self.state_dir / "logs" / f"{name}.log"

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        log_file = open(self.log_path(name), "ab")  # noqa: SIM115 - closed below once Popen has dup()ed it
        try:
            p = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                cwd=self.state_dir,
                env=env,
                start_new_session=True,
            )
        finally:
            log_file.close()
        self.popen[name] = p
        (self.state_dir / "pids" / f"{name}.pid").write_text(
            json.dumps({"pid": p.pid, "exe": argv[0], "argv": argv})
        )

    def recorded_pid(self, name: str) -> int | None:
        f = self.state_dir / "pids" / f"{name}.pid"
        try:
            rec = json.loads(f.read_text())
        except (OSError, ValueError):
            return None
        pid = int(rec["pid"])
        cmd = proc_cmdline(pid)
        # a recycled pid belongs to someone else: only ours if it still runs our binary
        return pid if cmd and cmd[0] == rec["exe"] else None

    def scan_leftovers(self) -> dict[int, str]:
        """pid -> program of every process of our binaries whose command line names this state
        dir (whether recorded or not)."""
        found: dict[int, str] = {}
        if not Path("/proc").is_dir():
            return found
        names = {Path(p).name for p in self.names}
        needle = str(self.state_dir).rstrip("/") + "/"  # not a sibling like state-smoke/
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            cmd = proc_cmdline(int(entry))
            if (
                cmd
                and Path(cmd[0]).name in names
                and str(self.exe_root) in cmd[0]
                and any(needle in a for a in cmd[1:])
                and proc_alive(int(entry))
            ):
                found[int(entry)] = Path(cmd[0]).name
        return found

    def alive(self, pid: int) -> bool:
        for p in self.popen.values():
            if p.pid == pid:
                return p.poll() is None
        return proc_alive(pid)

    def terminate(self, pids: list[int], names: dict[int, str], timeout: float) -> None:
        for pid in pids:
            signal_group(pid, signal.SIGTERM)
        end = time.monotonic() + timeout
        while time.monotonic() < end and any(self.alive(p) for p in pids):
            time.sleep(0.05)
        for pid in [p for p in pids if self.alive(p)]:
            log(f"{names[pid]} ({pid}) ignored SIGTERM for {timeout}s: SIGKILL")
            signal_group(pid, signal.SIGKILL)
        end = time.monotonic() + 10
        while time.monotonic() < end and any(self.alive(p) for p in pids):
            time.sleep(0.05)

    def terminate_named(self, names: list[str], timeout: float) -> None:
        """Stop the recorded processes of these programs and any leftover of them."""
        pids = {p: n for n in names if (p := self.recorded_pid(n)) is not None}
        pids.update({p: n for p, n in self.scan_leftovers().items() if n in names})
        self.terminate(list(pids), pids, timeout)

    def stop_all(self, names: Iterable[str], last: str, quiet: bool, timeout: float) -> None:
        """Stop the recorded processes of `names` and every leftover of this state dir (the
        program `last` after all others) and verify that none is left: ClusterError if one
        survives SIGKILL."""
        targets: dict[int, str] = {}
        for name in names:
            pid = self.recorded_pid(name)
            if pid is not None:
                targets[pid] = name
        for pid, name in self.scan_leftovers().items():
            targets.setdefault(pid, name)
        if not targets and not self.popen:
            if not quiet:
                log(f"nothing of {self.state_dir} is running")
            return
        if not quiet:
            log(f"stopping {', '.join(f'{n}({p})' for p, n in sorted(targets.items()))}")
        first = [p for p, n in targets.items() if n != last]
        final = [p for p, n in targets.items() if n == last]
        for group in (first, final):
            self.terminate(group, targets, timeout)
        for p in self.popen.values():
            with contextlib.suppress(Exception):
                p.wait(timeout=1)
        self.popen.clear()
        left = [f"{n}({p})" for p, n in targets.items() if self.alive(p)]
        left += [f"{n}({p})" for p, n in self.scan_leftovers().items() if p not in targets]
        if left:
            raise ClusterError(f"processes survived SIGKILL: {', '.join(left)}")
        pids = self.state_dir / "pids"
        if pids.is_dir():
            shutil.rmtree(pids)
        if not quiet:
            log("stopped; no process of this cluster is left")

    def forget(self, name: str) -> None:
        """Drop the record of a program stopped on its own (terminate_named)."""
        self.popen.pop(name, None)
        with contextlib.suppress(FileNotFoundError):
            (self.state_dir / "pids" / f"{name}.pid").unlink()

    def wait(
        self, name: str, check: Callable[[], object], deadline: float, what: str | None = None
    ) -> None:
        """Poll check() until it is truthy; ClusterError with the log tail of `name` when that
        process exits first or the deadline passes."""
        what = what or f"{name} ready"
        last_err: Exception | None = None
        while True:
            p = self.popen.get(name)
            if p is not None and p.poll() is not None:
                raise ClusterError(
                    f"{name} exited with code {p.returncode} while waiting for "
                    f"{what}; last log lines ({self.log_path(name)}):\n"
                    f"{tail(self.log_path(name))}"
                )
            try:
                if check():
                    return
            except (OSError, ssl.SSLError, ClusterError, ValueError) as e:
                last_err = e
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"timed out waiting for {what} (last error: {last_err}); "
                    f"last log lines ({self.log_path(name)}):\n"
                    f"{tail(self.log_path(name))}"
                )
            time.sleep(0.25)
