"""Suite-wide setup: a persistent XLA compilation cache for every JAX program the tests run.

Most of a warm run's JAX time is compiling the same small train steps, merges and evaluations
again (seconds each on CPU; the Flax models' train steps alone took ~10 s a run). JAX persists
compiled programs, keyed by the program, the XLA flags and the jax/jaxlib versions, when
JAX_COMPILATION_CACHE_DIR is set: set here, before any test imports JAX, it covers the pytest
process and, inherited, every syncer, learner and worker script the tests start. It is the
directory and threshold the learner and the syncer use on their own (diloco_trainer.workload.compile_cache.
enable_compilation_cache: <DILOCO_CACHE_DIR or ~/.cache/diloco>/jax, programs that took 0.5 s
or more), so learners and syncers behave as before and the other programs now share it. A first (cold) run
compiles everything as before; what a test checks is unchanged, only the compile is skipped.
A value already in the environment wins.
"""

from __future__ import annotations

import os
from pathlib import Path


def _cache_root() -> Path:
    return Path(os.environ.get("DILOCO_CACHE_DIR") or Path.home() / ".cache" / "diloco")


os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(_cache_root() / "jax"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
