"""The release this code belongs to: pyproject.toml's version, as the installed package records it.

One number for the Python package, the images (`make images` tags them with it), the chart
(version and appVersion) and the CRD's `diloco.dev/version` annotation; tests/test_release.py
holds them together.
"""

from __future__ import annotations

import functools
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as installed_version

DISTRIBUTION = "elastic-diloco"


@functools.cache
def release() -> str:
    try:
        return installed_version(DISTRIBUTION)
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "0+unknown"
