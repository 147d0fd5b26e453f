"""Chaos on Kubernetes (operator/diloco_operator/k8s/chaos.py): which fault hits what, fast-forward
after an operator restart, and the local runtime refusing faults it cannot deliver."""

from __future__ import annotations

from typing import Any

import pytest
from diloco_operator.api import parse_spec
from diloco_operator.k8s import builders, chaos
from diloco_operator.local.chaos import Fault
from diloco_operator.local.manifest import ManifestError, chaos_settings, check_chaos_units

SPEC: dict[str, Any] = {
    "image": "t:1",
    "replicas": 3,
    "training": {"totalSteps": 100},
    "chaos": {
        "seed": 1,
        "schedule": [
            {"atSeconds": 10, "action": "kill", "unit": 1},
            {"atSeconds": 20, "action": "killSyncer"},
            {"atSeconds": 30, "action": "nodeNotReady", "unit": 2},
            {"atSeconds": 40, "action": "pause", "unit": 0},
        ],
    },
}


def make_run(**over: Any) -> builders.Run:
    return builders.Run("r", "ns", "uid", parse_spec({**SPEC, **over}))


UNITS = {0: "r-default-0", 1: "r-default-1", 2: "r-default-2"}


def test_each_fault_becomes_its_delivery() -> None:
    run = make_run()
    state = chaos.new_run_chaos(run, created=1000.0, delivered_at=0.0)
    assert state is not None
    faults = chaos.due(state, 1000.0 + 45, sorted(UNITS))
    plans = [chaos.plan_delivery(run, f, UNITS) for f in faults]
    assert [(p.action, p.reason) for p in plans] == [
        ("kill-pods", "ChaosKill"),
        ("kill-pods", "ChaosKillSyncer"),
        ("mark-node", "ChaosNodeNotReady"),
        ("skip", "ChaosSkipped"),
    ]
    assert plans[0].selector == "diloco.dev/unit=r-default-1"
    assert plans[1].selector == "diloco.dev/run=r,app.kubernetes.io/component=syncer"
    assert plans[2].selector == "diloco.dev/unit=r-default-2"
    assert "local-runtime only" in plans[3].message
    assert (
        state.delivered_at == 45
    )  # run time of the delivery: a restart skips what was due by then


def test_unit_faults_wait_for_their_unit_to_be_online() -> None:
    run = make_run()
    state = chaos.new_run_chaos(run, created=0.0, delivered_at=0.0)
    assert state is not None
    assert chaos.due(state, 15, [0, 2]) == []  # unit 1 is not online: the kill waits
    (kill,) = chaos.due(state, 16, [0, 1, 2])
    assert (kill.kind, kill.unit) == ("kill", 1)


def test_a_restarted_operator_does_not_repeat_delivered_faults() -> None:
    run = make_run()
    state = chaos.new_run_chaos(run, created=0.0, delivered_at=20.0)
    assert state is not None
    kinds = [f.kind for f in chaos.due(state, 45, sorted(UNITS))]
    assert kinds == ["node-not-ready", "pause"]


def test_no_chaos_block_means_no_schedule() -> None:
    assert chaos.new_run_chaos(make_run(chaos=None), 0.0, 0.0) is None


def test_a_fault_for_a_missing_unit_is_skipped() -> None:
    fault = Fault(kind="kill", unit=7, at=1.0)
    assert chaos.plan_delivery(make_run(), fault, UNITS).action == "skip"


def test_local_runtime_refuses_node_not_ready() -> None:
    settings = chaos_settings(parse_spec(SPEC).chaos, enabled=True)
    with pytest.raises(ManifestError, match=r"spec\.chaos\.schedule\.2\.action: nodeNotReady"):
        check_chaos_units(settings, 3)
