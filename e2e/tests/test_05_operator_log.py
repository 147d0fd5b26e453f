"""After everything above (runs, chaos, scaling, a SIGKILL and restart): the operator never hit an
RBAC denial with the chart's ServiceAccount, never failed a reconcile pass and never crashed a
handler. Runs last (file order) so it covers the whole session."""

from __future__ import annotations

import pytest
from conftest import Operator


def test_operator_log_is_clean(operator: Operator) -> None:
    if operator.mode != "local":
        pytest.skip("the full log is only kept for the local operator process")
    log = operator.log_path.read_text(errors="replace")
    assert operator.starts >= 1 and "---- start 0 ----" in log
    bad = [
        line
        for line in log.splitlines()
        if ("forbidden" in line.lower() and "exceeded quota" not in line)
        or "reconcile failed" in line
        or "Traceback" in line
    ]  # (test_04_refused_children provokes a quota refusal on purpose: that 403 is no RBAC gap)
    assert not bad, "\n".join(bad[:20])
