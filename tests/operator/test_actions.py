"""The action table: every kind of action the planner emits has one applier, and a plan's
actions reach the cluster in the plan's order."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from diloco_operator.api import DilocoRunStatus, parse_spec
from diloco_operator.k8s import actions, builders, kube
from diloco_operator.planner import DeleteUnit, Plan, ScaleSyncer, SuspendUnit


def test_every_kind_of_action_has_an_applier() -> None:
    assert actions.kinds_without_applier() == set()
    assert len(actions.APPLIERS) >= 6


def test_a_plan_is_applied_in_order_and_reports_nothing_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple[Any, ...]] = []

    async def delete_unit(namespace: str, name: str) -> None:
        calls.append(("delete", namespace, name))

    async def suspend_job(namespace: str, name: str, suspend: bool) -> None:
        calls.append(("suspend", namespace, name, suspend))

    async def scale_deployment(namespace: str, name: str, replicas: int) -> None:
        calls.append(("scale", namespace, name, replicas))

    monkeypatch.setattr(kube, "delete_unit", delete_unit)
    monkeypatch.setattr(kube, "suspend_job", suspend_job)
    monkeypatch.setattr(kube, "scale_deployment", scale_deployment)
    spec = parse_spec({"image": "t", "training": {"totalSteps": 5}})
    run = builders.Run("r", "ns", "uid", spec)
    the_plan = Plan(
        actions=(
            SuspendUnit("r-a-0", True),
            DeleteUnit("r-a-1", "PodFailed"),
            ScaleSyncer(0),
        ),
        status=DilocoRunStatus(),
    )
    refused = asyncio.run(actions.apply(run, the_plan, body={}))
    assert refused is None  # nothing was created, so nothing can have been refused
    assert calls == [
        ("suspend", "ns", "r-a-0", True),
        ("delete", "ns", "r-a-1"),
        ("scale", "ns", run.syncer_name, 0),
    ]
