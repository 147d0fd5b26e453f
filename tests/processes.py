"""How tests start the product's own programs as real processes."""

from __future__ import annotations

import sys
from pathlib import Path


def syncer_argv(config: Path, port: int | str, *extra: str) -> list[str]:
    """`diloco-syncer` on loopback with this config (port 0: the kernel picks one and the
    syncer logs it), run by this interpreter so the test's environment is the syncer's."""
    host = ["--host", "127.0.0.1", "--port", str(port)]
    return [
        sys.executable,
        "-m",
        "diloco_trainer.syncer.main",
        "--config",
        str(config),
        *host,
        *extra,
    ]
