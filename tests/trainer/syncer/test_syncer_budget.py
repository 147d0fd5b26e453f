"""A running run's budget changes with the roster: the syncer alone decides when the run is
complete, so a longer or shorter run is a new roster revision, not a restart. A run that is
already complete stays complete, and a roster is checkpointed before the syncer answers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from diloco_trainer.budget import Budget
from diloco_trainer.syncer.checkpoint import CheckpointStore
from diloco_trainer.syncer.core import Syncer
from diloco_trainer.syncer.roster import Roster
from test_syncer import TOKEN, LiveSyncer, tiny_cfg

UNITS = {"unit-0": "default", "unit-1": "default"}


def roster(revision: int, **budget: int) -> dict[str, Any]:
    doc: dict[str, Any] = {"revision": revision, "units": UNITS}
    if budget:
        doc["budget"] = budget
    return doc


def put(live: LiveSyncer, doc: dict[str, Any]) -> tuple[int, Any]:
    return live.raw("PUT", "/v1/units", json.dumps(doc).encode())


def serve(store: CheckpointStore | None = None) -> LiveSyncer:
    """totalSteps 100 in the config; the roster at start carries no budget of its own."""
    syncer = Syncer(
        tiny_cfg(), TOKEN, run="r", store=store, eval_fn=None, roster=Roster.from_json(roster(0))
    )
    return LiveSyncer(syncer)


def train(live: LiveSyncer, steps_each: int) -> Any:
    """Both units report `steps_each` steps; the last reply."""
    reply = None
    for unit in UNITS:
        c = live.client(unit)
        c.join()
        reply = c.heartbeat(steps_each, steps_each * 64, 1000.0, 3.0)
    return reply


def test_the_budget_round_trips_and_a_bad_one_is_named() -> None:
    doc = roster(3, totalSteps=500)
    assert Roster.from_json(doc).budget == Budget(total_steps=500)
    assert Roster.from_json(doc).to_json() == doc
    assert Roster.from_json(roster(3)).budget is None
    bad = {
        "budget": {},
        "budget.totalSteps": {"totalSteps": 0},
        "budget.totalTokens": {"totalTokens": "9"},
        "totalSteps and/or totalTokens": {"steps": 9},
    }
    for named, budget in bad.items():
        with pytest.raises(ValueError, match=named.replace(".", r"\.")):
            Roster.from_json({**roster(3), "budget": budget})


def test_a_lowered_budget_completes_the_run_and_a_raised_one_extends_it() -> None:
    live = serve()
    try:
        assert not train(live, 30).complete  # 60 of 100
        assert put(live, roster(1, totalSteps=50)) == (200, {"taken": True, "revision": 1})
        reply = live.client("unit-0").heartbeat(30, 30 * 64, 1000.0, 3.0)
        assert reply.complete and reply.budget_done == 1.0
    finally:
        live.close()

    live = serve()
    try:
        train(live, 30)
        assert put(live, roster(1, totalSteps=1000))[0] == 200
        reply = train(live, 60)  # 120: past the config's 100, inside the new budget
        assert not reply.complete and reply.budget_done == pytest.approx(0.12)
        assert not live.client("unit-0").status().complete
    finally:
        live.close()


def test_a_complete_run_stays_complete_when_the_budget_is_raised() -> None:
    live = serve()
    try:
        assert train(live, 50).complete
        assert put(live, roster(1, totalSteps=1000)) == (200, {"taken": True, "revision": 1})
        assert live.syncer.gate.roster_revision == 1
        assert live.syncer.budget == Budget(total_steps=100)
        assert live.client("unit-0").heartbeat(50, 50 * 64, 1000.0, 3.0).complete
    finally:
        live.close()


def test_a_new_budget_is_checkpointed_before_the_answer(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "ck")
    live = serve(store)
    try:
        train(live, 30)
        live.run(live.syncer.save_checkpoint())
        assert put(live, roster(1, totalSteps=1000))[0] == 200
        train(live, 60)  # 120, not checkpointed: counters only reach the periodic checkpoint
    finally:
        live.syncer.store = None  # a crash: no checkpoint on the way out
        live.close()
    # Restarted from the same older units file: the checkpoint's budget holds, so progress past
    # the config's 100 steps does not end the run.
    again = serve(CheckpointStore(tmp_path / "ck"))
    try:
        assert again.syncer.budget == Budget(total_steps=1000)
        assert not train(again, 60).complete
    finally:
        again.close()
