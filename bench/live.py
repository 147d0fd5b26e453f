"""Real pieces for the benchmarks: a `diloco-syncer` process on a loopback port, and
in-process learner runs against it (`run_learner`, real HTTP) with their progress records."""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from diloco_trainer.config import TrainingConfig
from diloco_trainer.status import SyncerStatus

TOKEN = "bench-token"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class SyncerProc:
    url: str
    proc: subprocess.Popen[bytes]
    workdir: Path

    def status(self) -> SyncerStatus:
        import json

        req = urllib.request.Request(
            f"{self.url}/v1/status", headers={"Authorization": f"Bearer {TOKEN}"}
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            return SyncerStatus.from_json(json.loads(resp.read()))


@contextmanager
def syncer(cfg: TrainingConfig, nice: int = 0) -> Iterator[SyncerProc]:
    """Start `diloco-syncer` for `cfg` on 127.0.0.1, wait for /healthz, stop it with SIGTERM."""
    with tempfile.TemporaryDirectory(prefix="diloco-bench-") as tmp:
        work = Path(tmp)
        config = work / "run.yaml"
        # Not to_wire(): it drops None values, and None is meaningful here (eval.everySeconds:
        # null disables the syncer's evaluation, which would otherwise compete for the CPU).
        config.write_text(yaml.safe_dump(cfg.model_dump(mode="json", by_alias=True)))
        port = free_port()
        log_file = (work / "syncer.log").open("wb")
        cmd = [sys.executable, "-m", "diloco_trainer.syncer.main", "--config", str(config)]
        cmd += ["--host", "127.0.0.1", "--port", str(port), "--token", TOKEN]
        cmd += ["--checkpoint-dir", str(work / "ckpt"), "--log-level", "WARNING"]
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        proc = subprocess.Popen(
            ["nice", "-n", str(nice), *cmd] if nice else cmd,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=env,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_healthy(url, proc, work / "syncer.log")
            yield SyncerProc(url, proc, work)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log_file.close()


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], log_path: Path) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"syncer exited with {proc.returncode}: {log_path.read_text()[-2000:]}"
            )
        try:
            with urllib.request.urlopen(f"{url}/healthz", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise RuntimeError("syncer did not become healthy within 120 s")


_PROGRESS = re.compile(r"event=progress .*?step=(\d+) ")


class ProgressRecorder(logging.Handler):
    """Collects (wall time, step) from the learner's `event=progress` log records."""

    def __init__(self) -> None:
        super().__init__(level=logging.INFO)
        self.points: list[tuple[float, int]] = []
        self._lock2 = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        m = _PROGRESS.search(record.getMessage())
        if m:
            with self._lock2:
                self.points.append((record.created, int(m.group(1))))

    def steady_steps_per_sec(self, skip: int = 2) -> float:
        """Steps/s between the `skip`-th progress record and the last (compile and the first
        syncs excluded)."""
        pts = self.points[skip:]
        if len(pts) < 2:
            raise RuntimeError(f"too few progress records ({len(self.points)}) to time the learner")
        (t0, s0), (t1, s1) = pts[0], pts[-1]
        return (s1 - s0) / (t1 - t0)


@contextmanager
def recording() -> Iterator[ProgressRecorder]:
    rec = ProgressRecorder()
    logger = logging.getLogger("diloco_trainer.learner.report")
    old_level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(rec)
    try:
        yield rec
    finally:
        logger.removeHandler(rec)
        logger.setLevel(old_level)


@contextmanager
def local_run(
    doc: dict[str, Any],
    max_seconds: float,
    spares: int,
    chaos: bool = False,
    extra_args: Sequence[str] = (),
    alongside: Callable[[Path], AbstractContextManager[None]] | None = None,
) -> Iterator[tuple[Path, int]]:
    """Run the manifest `doc` with `diloco local run` (no live display) in a temporary folder;
    yield its report folder and exit code while the folder still exists. `alongside(report)`,
    if given, is entered just before the run starts and left when it has ended (the soak's
    faults that the runtime's chaos cannot deliver)."""
    with tempfile.TemporaryDirectory(prefix="bench-local-") as tmp:
        path = Path(tmp) / "run.yaml"
        path.write_text(yaml.safe_dump(doc))
        report = Path(tmp) / "report"
        cmd = [sys.executable, "-m", "diloco_operator.cli", "local", "run", str(path)]
        cmd += ["--report-dir", str(report), "--no-live", "--max-seconds", str(max_seconds)]
        cmd += ["--spares", str(spares)] + (["--chaos"] if chaos else []) + list(extra_args)
        with alongside(report) if alongside is not None else nullcontext():
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max_seconds + 300)
        keep = os.environ.get("DILOCO_BENCH_KEEP")
        if keep:  # a folder to copy each run's report (logs, events) into, for a look later
            kept = Path(keep) / f"{doc['metadata']['name']}-{time.strftime('%H%M%S')}"
            shutil.copytree(report, kept, dirs_exist_ok=True)
            print(f"[bench] report kept in {kept}", file=sys.stderr, flush=True)
        if not (report / "summary.json").exists():
            raise RuntimeError(f"local run failed ({proc.returncode}): {proc.stderr[-1500:]}")
        yield report, proc.returncode
