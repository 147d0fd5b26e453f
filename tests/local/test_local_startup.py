"""A start that takes too long names its phase: the runtime follows the syncer's log
(local/startup.py), gives up when no new start-up phase came for the start timeout (or the start
ran past its limit) and says which phase it was stuck in.

The runtime tests use a stand-in syncer (a few lines of Python logging phases through the real
helper, no JAX: a second each); the last test runs the real syncer and a real learner on a data
source that blocks in its index build until the test lets it go.
"""

from __future__ import annotations

import io
import os
import re
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml
from diloco_operator.local.manifest import load_manifest
from diloco_operator.local.processes import ProcessTable
from diloco_operator.local.programs import LEARNER_ARGV, SYNCER_ARGV, child_env
from diloco_operator.local.recorder import Recorder
from diloco_operator.local.runtime import LocalRuntime, RunAborted, RunOptions
from diloco_operator.local.startup import StartupWatch
from diloco_operator.local.syncer_process import SyncerProcess, default_start_limit
from diloco_trainer.auth import unit_token
from diloco_trainer.phases import read_phase_line
from rich.console import Console

from tests.local.test_local_run import manifest, processes_of

# ------------------------------------------------------------------ following a log


def _watch(tmp_path: Path, text: str = "") -> tuple[Path, StartupWatch]:
    path = tmp_path / "child.log"
    path.write_text(text)
    return path, StartupWatch.from_end(path, now=0.0)


def _append(path: Path, text: str) -> None:
    with path.open("a") as f:
        f.write(text)


def test_the_watch_keeps_the_open_phases_innermost_last(tmp_path: Path) -> None:
    path, watch = _watch(tmp_path)
    _append(
        path,
        "x level=INFO event=phase_started phase=initial_params\n"
        "x level=INFO event=phase_started phase=workload_check\n"
        "x level=INFO event=phase_started phase=model_build\n"
        "x level=INFO event=phase_done phase=model_build seconds=0.50\n"
        "some other line\n"
        '{"severity": "INFO", "message": "event=phase_started phase=data_index"}\n',
    )
    watch.poll(now=10.0)
    assert [p.name for p in watch.open] == ["initial_params", "workload_check", "data_index"]
    assert watch.last_change == 10.0 and watch.last_done == "model_build"
    assert watch.describe(now=105.0) == (
        "still in phase 'data_index' since 95s (within initial_params > workload_check)"
    )
    _append(path, "event=phase_done phase=data_index seconds=1\n")
    watch.poll(now=11.0)
    assert watch.current is not None and watch.current.name == "workload_check"
    assert watch.current.since == 10.0


def test_the_watch_reads_only_this_attempt_and_whole_lines(tmp_path: Path) -> None:
    # An earlier attempt's phase, still open in the appended log, is not this one's.
    path, watch = _watch(tmp_path, "event=phase_started phase=restore\n")
    assert watch.describe(now=1.0) == "no start-up phase logged yet"
    _append(path, "event=phase_started phase=com")
    watch.poll(now=2.0)
    assert watch.open == []
    _append(path, "pile\n")
    watch.poll(now=3.0)
    assert watch.current is not None and watch.current.name == "compile"
    _append(path, "event=phase_failed phase=compile seconds=0.1 error=MemoryError\n")
    watch.poll(now=4.0)
    assert watch.describe(now=5.0) == "after phase 'compile', no phase open"


def test_a_missing_log_is_no_progress(tmp_path: Path) -> None:
    watch = StartupWatch.from_end(tmp_path / "absent.log", now=0.0)
    watch.poll(now=1.0)
    assert watch.offset == 0 and watch.current is None


def test_the_limit_grows_with_a_raised_timeout() -> None:
    assert default_start_limit(120.0) == 900.0
    assert default_start_limit(600.0) == 3000.0


# ------------------------------------------------------------------ the runtime's start timeout

# Phases the way the syncer logs them; `steps` quick phases first (a start making progress),
# then the workload check's data index, which never ends.
STAND_IN = """
import logging, sys, time
from diloco_trainer.logfmt import configure_logging
from diloco_trainer.phases import phase
configure_logging("INFO", "text")
log = logging.getLogger("diloco.syncer")
with phase(log, "config"):
    pass
for i in range({steps}):
    with phase(log, f"step_{{i}}"):
        time.sleep({gap})
with phase(log, "initial_params"), phase(log, "workload_check"), phase(log, "data_index"):
    time.sleep(600)
"""


def _start_stand_in(
    tmp_path: Path, timeout: float, limit: float | None = None, steps: int = 0, gap: float = 0.0
) -> tuple[str, float]:
    """Run a local run whose syncer is the stand-in; the abort message and how long it took."""
    run = load_manifest(manifest(tmp_path))
    opts = RunOptions(
        report_dir=tmp_path / "r",
        live=False,
        spare_learners=0,
        syncer_start_timeout=timeout,
        syncer_start_limit=limit,
        tick_seconds=0.1,
        syncer_argv=(sys.executable, "-c", STAND_IN.format(steps=steps, gap=gap)),
        learner_argv=(sys.executable, "-c", "import time; time.sleep(60)"),
    )
    started = time.monotonic()
    with pytest.raises(RunAborted) as aborted:
        LocalRuntime(run, opts, console=Console(file=io.StringIO())).execute()
    assert processes_of(tmp_path) == []
    return str(aborted.value), time.monotonic() - started


def test_a_stalled_syncer_start_names_its_phase(tmp_path: Path) -> None:
    message, _ = _start_stand_in(tmp_path, timeout=1.0)
    log = tmp_path / "r" / "logs" / "syncer.log"
    first = message.splitlines()[0]
    assert re.fullmatch(
        r"the syncer did not serve /v1/status within \d+s: still in phase 'data_index' since \d+s "
        r"\(within initial_params > workload_check\); no new start-up phase for \d+s "
        rf"\(log: {re.escape(str(log))}\); its last lines:",
        first,
    ), first
    phases = [read_phase_line(line) for line in log.read_text().splitlines()]
    assert [(p.event, p.name) for p in phases if p is not None] == [
        ("started", "config"),
        ("done", "config"),
        ("started", "initial_params"),
        ("started", "workload_check"),
        ("started", "data_index"),
    ]
    assert "event=phase_started phase=data_index" in message  # the log's tail


def test_a_start_that_logs_new_phases_gets_past_the_timeout(tmp_path: Path) -> None:
    # 6 phases of 0.25 s with a 1.2 s timeout: measured from the process start (as before), the
    # wait would have ended in step_4; measured from the last phase line, it ends in the data
    # index, which begins only after the timeout and makes no progress.
    message, _ = _start_stand_in(tmp_path, timeout=1.2, steps=6, gap=0.25)
    assert "still in phase 'data_index'" in message, message


def test_a_progressing_start_still_ends_at_the_limit(tmp_path: Path) -> None:
    message, took = _start_stand_in(tmp_path, timeout=1.5, limit=2.0, steps=50, gap=0.3)
    assert re.search(r"still in phase 'step_\d+' since \d+s; the start-up limit is 2s ", message)
    assert took < 20


# ------------------------------------------------------------------ the real programs

SLOW_DATA = """
import os, time

import jax.numpy as jnp
import numpy as np


class Line:
    def init(self, rng):
        return {"w": jnp.zeros((4, 1))}

    def loss(self, params, batch, rng):
        return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2), {}


def build():
    return Line()


def source(shard, num_shards, *, seed, batch_size, split, position, gate):
    deadline = time.monotonic() + 300
    while not os.path.exists(gate) and time.monotonic() < deadline:  # "building the index"
        time.sleep(0.05)
    rng = np.random.default_rng([seed, shard, split == "eval"])
    while True:
        x = rng.normal(size=(batch_size, 4)).astype(np.float32)
        yield {"x": x, "y": x[:, :1]}
"""

# In the order they start; `initial_params` of the syncer may hold the workload check (when it
# is the first to need the model) or come after it.
SYNCER_PHASES = [
    "config",
    "checkpoint_load",
    "imports",
    "workload_check",
    "model_build",
    "data_index",
    "journal_replay",
    "server_start",
    "compile",
    "first_checkpoint",
]
LEARNER_PHASES = [
    "imports",
    "jax_init",
    "workload_check",
    "model_build",
    "data_index",
    "initial_params",
    "join",
    "pull",
    "first_batch",
    "compile",
    "first_step",
]


def _phases(log: Path) -> tuple[list[str], list[str]]:
    """The phases a log started and those it finished, in order."""
    found = [read_phase_line(line) for line in log.read_text().splitlines()]
    started = [p.name for p in found if p is not None and p.event == "started"]
    done = [p.name for p in found if p is not None and p.event == "done"]
    return started, done


def _current(watch: StartupWatch | None) -> str | None:
    if watch is None:
        return None
    watch.poll(time.monotonic())
    return watch.current.name if watch.current is not None else None


@pytest.mark.slow
def test_the_real_programs_log_their_phases_and_a_slow_data_index_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "slow_start_data.py").write_text(textwrap.dedent(SLOW_DATA))
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    )
    gate = tmp_path / "gate"
    training = {
        "model": {"entrypoint": "slow_start_data:build"},
        "data": {
            "entrypoint": "slow_start_data:source",
            "args": {"gate": str(gate)},
            "batchSize": 4,
        },
        "fragments": 1,
        "innerSteps": 1,
        "totalSteps": 1000,
        "eval": {"everySeconds": None},
    }
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(training))
    logs = tmp_path / "logs"
    procs = ProcessTable()
    syncer = SyncerProcess(
        procs,
        Recorder(time.time()),
        argv=SYNCER_ARGV,
        config=config,
        checkpoint_dir=tmp_path / "ckpt",
        logs_dir=logs,
        roster={"unit-0": "default"},
        max_restarts=0,
        start_timeout=300.0,
    )
    learner_log = logs / "unit-0.log"
    learner = StartupWatch.from_end(learner_log, time.monotonic())
    env = child_env(dict(os.environ))
    env.update(DILOCO_TOKEN=unit_token(syncer.token, "unit-0"), DILOCO_LOG_FORMAT="json")
    try:
        syncer.start(time.time())
        procs.spawn(
            "unit-0",
            [
                *LEARNER_ARGV,
                "--config",
                str(config),
                "--syncer",
                syncer.client.base_url,
                "--unit",
                "0",
                "--unit-name",
                "unit-0",
                "--max-steps",
                "2",
            ],
            env,
            learner_log,
        )
        deadline = time.monotonic() + 120
        while (_current(syncer.startup), _current(learner)) != ("data_index", "data_index"):
            assert procs.poll() == {}, (syncer.log_path.read_text(), learner_log.read_text())
            assert time.monotonic() < deadline, (
                syncer.log_path.read_text(),
                learner_log.read_text(),
            )
            syncer.poll(time.time())
            time.sleep(0.1)

        # Both block in the index build: with a short timeout the supervisor gives up on the
        # syncer and says where it was.
        syncer.start_timeout = 0.2
        time.sleep(0.3)
        with pytest.raises(RunAborted) as aborted:
            syncer.poll(time.time())
        first = str(aborted.value).splitlines()[0]
        assert "still in phase 'data_index' since" in first, first
        assert re.search(r"\(within (initial_params > )?workload_check\);", first), first
        assert f"log: {syncer.log_path}" in first, first

        # Let the index build finish: the syncer serves, the learner trains its 2 steps.
        syncer.start_timeout = 300.0
        gate.touch()
        exited: dict[str, int] = {}
        while "unit-0" not in exited:
            assert time.monotonic() < deadline + 60, learner_log.read_text()
            syncer.poll(time.time())
            exited.update(procs.poll())
            time.sleep(0.1)
        assert exited == {"unit-0": 0}, learner_log.read_text()
        assert syncer.ever_healthy
    finally:
        procs.stop_all(grace_seconds=5)
    assert procs.survivors() == []
    started, done = _phases(syncer.log_path)
    assert [name for name in started if name != "initial_params"] == SYNCER_PHASES, started
    assert (
        started.index("imports") < started.index("initial_params") < started.index("journal_replay")
    )
    assert sorted(done) == sorted([*SYNCER_PHASES, "initial_params"]), done
    started, done = _phases(learner_log)
    assert started == LEARNER_PHASES and sorted(done) == sorted(LEARNER_PHASES), started
