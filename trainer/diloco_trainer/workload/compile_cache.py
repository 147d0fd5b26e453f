"""The persistent XLA compilation cache, shared by learners and the syncer."""

from __future__ import annotations

import os
from collections.abc import Mapping

import jax

from diloco_trainer.data.corpus import cache_dir


def enable_compilation_cache(env: Mapping[str, str] | None = None) -> None:
    """Persist compiled XLA programs (~/.cache/diloco/jax unless JAX_COMPILATION_CACHE_DIR is
    set): a restarted learner or syncer (a warm standby too), or the next of several learners of one
    model, skips compiling."""
    env = os.environ if env is None else env
    if env.get("JAX_COMPILATION_CACHE_DIR"):
        return  # JAX reads it itself
    jax.config.update("jax_compilation_cache_dir", str(cache_dir() / "jax"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
