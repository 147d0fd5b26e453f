"""pytest plugin for CI (`-p forbid_skips`, `.ci/run` loads it): a skipped test fails the run.

Tests skip where a machine lacks what they need (root for the real node, a Go checker not built).
On a developer's machine that is a convenience; in CI it would hide a whole part of the suite
behind a green run, so there every skip is an error naming the test and its reason.
"""

from __future__ import annotations

import pytest


def pytest_sessionfinish(session: pytest.Session) -> None:
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter is not None else []
    if not skipped:
        return
    for report in skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        reporter.write_line(f"forbid_skips: {report.nodeid} skipped: {reason}", red=True)
    reporter.write_line(f"forbid_skips: {len(skipped)} skipped; CI runs every test", red=True)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
