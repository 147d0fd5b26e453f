"""CI runs every test: `.ci/run` loads `.ci/forbid_skips.py`, which fails a pytest run that
skipped anything: a skipped test in CI is a check that silently did not run. Checked on a throwaway suite."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

CI = Path(__file__).resolve().parents[1] / ".ci"


def _pytest(folder: Path, body: str) -> subprocess.CompletedProcess[str]:
    (folder / "test_sample.py").write_text(body)
    env = {**os.environ, "PYTHONPATH": str(CI), "PYTEST_ADDOPTS": "-p forbid_skips"}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(folder)],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_run_with_a_skip_fails_naming_the_test_and_the_reason(tmp_path: Path) -> None:
    body = (
        "import pytest\n\n"
        "def test_runs():\n    assert True\n\n"
        "@pytest.mark.skipif(True, reason='helm not built')\n"
        "def test_needs_helm():\n    assert True\n"
    )
    done = _pytest(tmp_path, body)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "test_sample.py::test_needs_helm skipped" in done.stdout
    assert "helm not built" in done.stdout and "1 skipped; CI runs every test" in done.stdout


def test_a_run_without_skips_passes(tmp_path: Path) -> None:
    done = _pytest(tmp_path, "def test_runs():\n    assert True\n")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "forbid_skips" not in done.stdout
