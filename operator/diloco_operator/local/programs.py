"""The two programs a local run starts (syncer and learner): their argv, environment, exit codes
and logs, as the supervisor needs to start them and to explain how they ended."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

LEARNER_ARGV = (sys.executable, "-m", "diloco_trainer.learner.main")
SYNCER_ARGV = (sys.executable, "-m", "diloco_trainer.syncer.main")
# Exit code of both programs for a config error (docs/contracts.md): restarting cannot help.
CONFIG_ERROR_EXIT = 2


def exit_description(code: int) -> str:
    """How a child ended, in words: `exit code 1`, `killed by SIGKILL`."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.rstrip().splitlines()[-lines:])


def headline(path: Path, prefix: str) -> str:
    """The last line of a log starting with `prefix` (a program's own error summary)."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    found = [line for line in lines if line.startswith(prefix)]
    return found[-1] if found else "(no error line in its log)"


def child_env(base: dict[str, str]) -> dict[str, str]:
    """Environment of every child: JAX on CPU with one intra-op thread unless the user chose
    otherwise, so N learners on a small machine share cores instead of fighting over them."""
    env = dict(base)
    env.setdefault("JAX_PLATFORMS", "cpu")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    xla = env.get("XLA_FLAGS", "")
    if "intra_op_parallelism_threads" not in xla:
        env["XLA_FLAGS"] = (
            xla + " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
        ).strip()
    return env
