"""Data leases with a real `diloco-syncer` and real `diloco-learner` processes.

Each learner logs every batch it trains (`event=data_batch epoch shard position`, at DEBUG), so
the test sees exactly what each unit read: two learners train, a third joins later, and no
(epoch, shard, batch) is read by two units; a learner SIGKILLed and restarted resumes at the
position it reported, also after the syncer itself was SIGKILLed and restarted from its
checkpoint and lease journal.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest
import yaml
from diloco_trainer.auth import unit_token
from diloco_trainer.syncer.checkpoint import CheckpointStore
from processes import syncer_argv

pytestmark = pytest.mark.slow

TOKEN = "lease-token"
BATCH = re.compile(r"event=data_batch epoch=(\d+) shard=(\d+) position=(\d+)")
SHARD = re.compile(r"event=data_shard epoch=(\d+) shard=(\d+) position=(\d+)")
Read = tuple[int, int, int]  # (epoch, shard, batch position)


class Run:
    def __init__(self, tmp: Path) -> None:
        self.tmp, self.ckpt = tmp, tmp / "ckpt"
        config = {
            "model": {"preset": "tiny", "dModel": 16, "nLayers": 1, "nHeads": 2, "seqLen": 8},
            # 64 KiB of text in 16 shards: ~100 batches each, a few shards per learner here.
            "data": {"batchSize": 4, "maxBytes": 65536, "shards": 16},
            "innerSteps": 10,
            "fragments": 2,
            "quorum": 1,
            "totalSteps": 10**6,
            "heartbeatSeconds": 0.3,
            "eval": {"everySeconds": None},
            "checkpoint": {"everySeconds": 0.3},
        }
        self.config = tmp / "run.yaml"
        self.config.write_text(yaml.safe_dump(config))
        self.env = dict(os.environ, JAX_PLATFORMS="cpu", DILOCO_TOKEN=TOKEN)
        self.env.setdefault("DILOCO_CACHE_DIR", str(Path.home() / ".cache/diloco"))
        self.procs: list[subprocess.Popen[bytes]] = []
        # A port chosen here, so the first learners can start with the syncer (they wait for it
        # with backoff, as pods do) instead of after it: their imports overlap its own.
        self.port, self.syncer_log_offset = _free_port(), 0
        self.syncer = self.start_syncer()

    def start_syncer(self) -> subprocess.Popen[bytes]:
        """Start the syncer on `self.port` (the same address across restarts, so the learners
        reconnect); `wait_listening` waits for it."""
        log = self.tmp / "syncer.log"
        self.syncer_log_offset = log.stat().st_size if log.exists() else 0
        proc = subprocess.Popen(
            [
                *syncer_argv(str(self.config), str(self.port)),
                "--checkpoint-dir",
                str(self.ckpt),
            ],
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=log.open("ab"),
        )
        self.procs.append(proc)
        return proc

    def wait_listening(self) -> None:
        log, deadline = self.tmp / "syncer.log", time.monotonic() + 60
        while f"event=listening host=127.0.0.1 port={self.port} " not in _tail(
            log, self.syncer_log_offset
        ):
            alive = self.syncer.poll() is None
            assert alive and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)

    def start_learner(self, unit: int, attempt: int = 0) -> subprocess.Popen[bytes]:
        env = dict(
            self.env,
            DILOCO_SYNCER_ADDR=f"http://127.0.0.1:{self.port}",
            DILOCO_UNIT=str(unit),
            DILOCO_NUM_UNITS="2",  # what the first units were told; the third is told 3
            DILOCO_ATTEMPT=str(attempt),
            DILOCO_TOKEN=unit_token(TOKEN, f"unit-{unit}"),
        )
        if unit >= 2:
            env["DILOCO_NUM_UNITS"] = str(unit + 1)
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "diloco_trainer.learner.main",
                "--config",
                str(self.config),
                "--log-level",
                "DEBUG",
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=self.log(unit, attempt).open("wb"),
        )
        self.procs.append(proc)
        return proc

    def log(self, unit: int, attempt: int) -> Path:
        return self.tmp / f"learner-{unit}-{attempt}.log"

    def reads(self, unit: int, attempt: int) -> list[Read]:
        text = self.log(unit, attempt).read_text(errors="replace")
        return [(int(e), int(s), int(p)) for e, s, p in BATCH.findall(text)]

    def wait_reads(self, unit: int, attempt: int, count: int, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while len(self.reads(unit, attempt)) < count:
            assert time.monotonic() < deadline, self.log(unit, attempt).read_text()[-3000:]
            time.sleep(0.1)

    def kill_mid_shard(self, unit: int, attempt: int, proc: subprocess.Popen[bytes]) -> Read:
        """SIGKILL the learner once it read 40 more batches and is 20..60 batches into a shard
        of ~100 (its pushes since the shard began reported a position above 0, and it is far
        from claiming the next); returns its last read."""
        target = len(self.reads(unit, attempt)) + 40
        deadline = time.monotonic() + 180
        while not (
            len(reads := self.reads(unit, attempt)) >= target
            and 20 <= reads[-1][2] <= 60
            # ... and the syncer has a position on this shard from an accepted push (after a
            # syncer restart the first pushes may be refused while the learner catches up).
            and self.reported_on(f"unit-{unit}", reads[-1])
        ):
            assert time.monotonic() < deadline, self.log(unit, attempt).read_text()[-3000:]
            time.sleep(0.05)
        self.kill(proc)
        return self.reads(unit, attempt)[-1]

    def reported_on(self, unit: str, read: Read) -> bool:
        snap = CheckpointStore(self.ckpt).load_latest(remove_stray=False)
        held = snap.extra.get("dataLeases", {}).get("held", {}).get(unit) if snap else None
        return bool(held) and (held["epoch"], held["shard"]) == read[:2] and held["position"] > 0

    def first_shard(self, unit: int, attempt: int, timeout: float = 180) -> Read:
        deadline = time.monotonic() + timeout
        while not (found := SHARD.findall(self.log(unit, attempt).read_text(errors="replace"))):
            assert time.monotonic() < deadline, self.log(unit, attempt).read_text()[-3000:]
            time.sleep(0.1)
        e, s, p = found[0]
        return int(e), int(s), int(p)

    def checkpointed_lease(self, unit: str, after: float) -> Read:
        """The unit's lease in the first checkpoint written after `after` (monotonic)."""
        while time.monotonic() < after + 1.0:  # checkpoints every 0.3 s
            time.sleep(0.1)
        snap = CheckpointStore(self.ckpt).load_latest(remove_stray=False)
        assert snap is not None
        held = snap.extra["dataLeases"]["held"][unit]
        return held["epoch"], held["shard"], held["position"]

    def kill(self, proc: subprocess.Popen[bytes]) -> None:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

    def close(self) -> None:
        for proc in reversed(self.procs):  # learners first
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _tail(path: Path, offset: int) -> str:
    with path.open("rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")


@pytest.fixture
def run(tmp_path: Path) -> Run:
    started = Run(tmp_path)
    yield started  # type: ignore[misc]
    started.close()


def assert_disjoint(readers: dict[Read, set[int]]) -> None:
    shared = {read: units for read, units in readers.items() if len(units) > 1}
    assert not shared, f"read by several units: {sorted(shared.items())[:10]}"


def test_scaled_units_read_disjoint_data(run: Run) -> None:
    first = [run.start_learner(0), run.start_learner(1)]
    run.wait_listening()
    run.wait_reads(0, 0, 150)
    run.wait_reads(1, 0, 150)
    run.start_learner(2)  # `kubectl scale` to 3 units
    run.wait_reads(2, 0, 150)
    for proc in first:
        assert proc.poll() is None
    run.close()
    readers: dict[Read, set[int]] = defaultdict(set)
    for unit in range(3):
        reads = run.reads(unit, 0)
        assert len(reads) == len(set(reads)), f"unit {unit} read a batch twice"
        for read in reads:
            readers[read].add(unit)
    assert_disjoint(readers)
    shards = {(e, s) for e, s, _ in readers}
    assert len(shards) >= 4  # the units moved on through several shards


def test_restarted_learners_resume_where_they_reported(run: Run) -> None:
    learners = {0: run.start_learner(0), 1: run.start_learner(1)}
    run.wait_listening()
    # SIGKILL: whatever it read after its last push is not reported.
    last = run.kill_mid_shard(1, 0, learners[1])
    reported = run.checkpointed_lease("unit-1", time.monotonic())
    assert reported[:2] == last[:2] and 0 < reported[2] <= last[2] + 1
    learners[1] = run.start_learner(1, attempt=1)
    assert run.first_shard(1, 1) == reported  # back on its shard where it reported

    run.wait_reads(0, 0, 80)
    run.kill(run.syncer)  # the syncer too: it comes back from checkpoint and lease journal
    run.syncer = run.start_syncer()
    run.wait_listening()
    last = run.kill_mid_shard(0, 0, learners[0])  # after training on against the new syncer
    reported = run.checkpointed_lease("unit-0", time.monotonic())
    assert reported[:2] == last[:2] and 0 < reported[2] <= last[2] + 1
    learners[0] = run.start_learner(0, attempt=1)
    assert run.first_shard(0, 1) == reported
    run.wait_reads(0, 1, 20)
    run.close()

    readers: dict[Read, set[int]] = defaultdict(set)
    for unit in (0, 1):
        for attempt in (0, 1):
            for read in run.reads(unit, attempt):
                readers[read].add(unit)
    assert_disjoint(readers)  # a unit may re-read after its restart; two units never share
