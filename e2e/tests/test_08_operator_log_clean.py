"""After the modules before it in file order (runs, chaos, scaling, a SIGKILL and restart, HA,
refused children, retained checkpoints): the operator never hit an RBAC denial with the chart's
ServiceAccount, never failed a reconcile pass and never crashed a handler. What the modules after
it make the operator do (real workload, suspend and Kueue) is not covered."""

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
    ]  # (test_06_refused_children provokes a quota refusal on purpose: that 403 is no RBAC gap)
    assert not bad, "\n".join(bad[:20])
