"""Real pieces for the benchmarks: a `diloco-syncer` process on a loopback port, in-process
learner runs against it (`run_learner`, real HTTP) with their progress records, and whole runs of
a manifest on the local runtime (`diloco local run`) with what their report folder says."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
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
from typing import IO, Any

import yaml
from diloco_trainer.auth import unit_token
from diloco_trainer.config import TrainingConfig
from diloco_trainer.learner.options import LearnerOptions
from diloco_trainer.status import SyncerStatus

from bench.lib.common import log
from bench.lib.syncer_logs import fields

TOKEN = "bench-token"
IMAGE = "elastic-diloco-trainer:cpu"  # a manifest's image; the local runtime runs no container


def learner_config(scheme: str = "int4", inner_steps: int = 50) -> TrainingConfig:
    """The tiny model, batch 16, for one learner against a live syncer until the bench stops it
    (the learner-speed and traffic sections)."""
    return TrainingConfig.model_validate(
        {
            "model": {"preset": "tiny"},
            "data": {"batchSize": 16, "maxBytes": 4_000_000},
            "innerSteps": inner_steps,
            "fragments": 4,
            "compression": {"scheme": scheme},
            "totalSteps": 10_000_000,  # never reached: the benchmark stops the learner
            "eval": {"everySeconds": None},
            "checkpoint": {"everySeconds": 600},
            "heartbeatSeconds": 1.0,
        }
    )


def only_learner(url: str, **options: Any) -> LearnerOptions:
    """The options of unit 0, the run's only learner, against the syncer at `url`."""
    token = unit_token(TOKEN, "unit-0")
    return LearnerOptions(syncer=url, token=token, unit=0, num_units=1, **options)


def stop(proc: subprocess.Popen[bytes], timeout: float) -> None:
    """SIGTERM, then SIGKILL if the process has not exited within `timeout` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


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
        req = urllib.request.Request(
            f"{self.url}/v1/status", headers={"Authorization": f"Bearer {TOKEN}"}
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            return SyncerStatus.from_json(json.loads(resp.read()))


@contextmanager
def syncer(cfg: TrainingConfig, nice: int = 0, log_level: str = "WARNING") -> Iterator[SyncerProc]:
    """Start `diloco-syncer` for `cfg` on 127.0.0.1, wait for /healthz, stop it with SIGTERM. Its
    log is `workdir/syncer.log` (INFO has a line per accepted push)."""
    with syncer_shards(cfg, 1, nice, log_level) as shards:
        yield shards[0]


@contextmanager
def syncer_shards(
    cfg: TrainingConfig, count: int, nice: int = 0, log_level: str = "WARNING"
) -> Iterator[list[SyncerProc]]:
    """`count` syncer processes serving the shards of one run (one: the unsharded syncer), in
    one workdir and checkpoint path, started together and stopped with SIGTERM. Shard i logs to
    `workdir/syncer.log` (shard 0) or `workdir/syncer-<i>.log`."""
    with tempfile.TemporaryDirectory(prefix="diloco-bench-") as tmp:
        work = Path(tmp)
        config = work / "run.yaml"
        # Not to_wire(): it drops None values, and None is meaningful here (eval.everySeconds:
        # null disables the syncer's evaluation, which would otherwise compete for the CPU).
        config.write_text(yaml.safe_dump(cfg.model_dump(mode="json", by_alias=True)))
        ports = [free_port() for _ in range(count)]
        urls = [f"http://127.0.0.1:{port}" for port in ports]
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        started: list[tuple[SyncerProc, Path, IO[bytes]]] = []
        try:
            for index, port in enumerate(ports):
                log_path = work / ("syncer.log" if index == 0 else f"syncer-{index}.log")
                cmd = [sys.executable, "-m", "diloco_trainer.syncer.main", "--config", str(config)]
                cmd += ["--host", "127.0.0.1", "--port", str(port), "--token", TOKEN]
                cmd += ["--checkpoint-dir", str(work / "ckpt"), "--log-level", log_level]
                if count > 1:
                    cmd += ["--shard", f"{index}/{count}", "--peers", ",".join(urls)]
                log_file = log_path.open("wb")
                proc = subprocess.Popen(
                    ["nice", "-n", str(nice), *cmd] if nice else cmd,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    env=env,
                )
                started.append((SyncerProc(urls[index], proc, work), log_path, log_file))
            for shard, log_path, _ in started:
                _wait_healthy(shard.url, shard.proc, log_path)
            yield [shard for shard, _, _ in started]
        finally:
            for shard, _, out in started:
                stop(shard.proc, 30)
                out.close()


def learner_process(
    config: Path,
    url: str,
    unit: int,
    num_units: int,
    log_path: Path,
    name: str = "",
    group: str = "default",
    max_steps: int | None = None,
) -> subprocess.Popen[bytes]:
    """A `diloco-learner` process: unit `unit` of `num_units` (named `name`, else unit-N, with
    its token), against the syncer at `url`, until `max_steps` or the run's budget; it logs at
    INFO (~100 lines a run; the exit line has its counters) into `log_path`."""
    name = name or f"unit-{unit}"
    cmd = [sys.executable, "-m", "diloco_trainer.learner.main", "--config", str(config)]
    cmd += ["--syncer", url, "--token", unit_token(TOKEN, name), "--unit-name", name]
    cmd += ["--unit", str(unit), "--num-units", str(num_units), "--group", group]
    cmd += ["--log-level", "INFO"]
    if max_steps is not None:
        cmd += ["--max-steps", str(max_steps)]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    with log_path.open("wb") as out:  # the child keeps its own descriptor
        return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=out)


def exit_fields(learner_log: str) -> dict[str, str]:
    """The key=value fields of a learner's `event=exit` line (its steps, tokens, bytes, link
    counters)."""
    found = re.search(r"event=exit (.*)$", learner_log, re.MULTILINE)
    if found is None:
        raise RuntimeError(f"no exit line in the learner log: {learner_log[-500:]}")
    return fields(found.group(1))


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
            log(f"report kept in {kept}")
        if not (report / "summary.json").exists():
            raise RuntimeError(f"local run failed ({proc.returncode}): {proc.stderr[-1500:]}")
        yield report, proc.returncode


def local_training(tokens: int, checkpoint_seconds: float, eval_seconds: float) -> dict[str, Any]:
    """The `training` block of the local runs: tiny model, batch 8 from the stdlib corpus, H=20,
    P=4, quorum 1, seed 0, `tokens` to train, checkpoints and evaluations (4 batches) every so
    many seconds."""
    return {
        "model": {"preset": "tiny"},
        "data": {"source": "stdlib", "batchSize": 8, "maxBytes": 4_000_000},
        "innerSteps": 20,
        "fragments": 4,
        "quorum": 1,
        "totalTokens": tokens,
        "seed": 0,
        "heartbeatSeconds": 1,
        "checkpoint": {"everySeconds": checkpoint_seconds},
        "eval": {"everySeconds": eval_seconds, "batches": 4},
    }


def run_document(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    """A DilocoRun manifest named `name` with `spec`."""
    return {
        "apiVersion": "diloco.dev/v1alpha1",
        "kind": "DilocoRun",
        "metadata": {"name": name},
        "spec": spec,
    }


def read_summary(report: Path) -> dict[str, Any]:
    """A local run's summary.json."""
    summary: dict[str, Any] = json.loads((report / "summary.json").read_text())
    return summary


def read_events(report: Path) -> list[dict[str, Any]]:
    """A local run's events.jsonl, one dict per event, in order."""
    return [json.loads(x) for x in (report / "events.jsonl").read_text().splitlines()]
