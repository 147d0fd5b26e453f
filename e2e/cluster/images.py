"""The project's images (trainer, operator) for the real node: built by e2e/node/images.sh
(content-hashed: a warm call builds nothing), saved as docker-save archives in the cache."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from binaries import HERE, cache_root
from procs import ClusterError


def images_dir() -> Path:
    return cache_root() / "images"


def build_images() -> dict[str, str]:
    """The project's images (e2e/node/images.sh: content-hashed, a warm call builds nothing),
    as {"trainer": ref, "operator": ref}; their docker-save archives go to images_dir()."""
    r = subprocess.run(
        ["bash", str(HERE.parent / "node" / "images.sh"), "--save", str(images_dir())],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        raise ClusterError(f"e2e/node/images.sh failed ({r.returncode}):\n{r.stderr[-3000:]}")
    sys.stderr.write(r.stderr)
    return dict(line.split("=", 1) for line in r.stdout.split() if "=" in line)


def image_tar(image: str) -> Path:
    return images_dir() / (image.replace(":", "_").replace("/", "_") + ".tar")
