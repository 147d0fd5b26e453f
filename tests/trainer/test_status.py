"""The one typed model of the syncer's /v1/status: the documented example (docs/contracts.md)
round-trips field for field, bad fields degrade to "unknown" instead of failing a supervisor, and
the model stays importable without JAX (the operator image has none)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from diloco_trainer.status import CheckpointStatus, HealthStatus, LearnerStatus, SyncerStatus

CONTRACTS = Path(__file__).resolve().parents[2] / "docs" / "contracts.md"


def documented_example() -> dict[str, Any]:
    text = CONTRACTS.read_text()
    section = text[text.index("`GET /v1/status` (bearer auth") :]
    found = re.search(r"```json\n(.*?)```", section, re.S)
    assert found is not None, "no JSON example under GET /v1/status in docs/contracts.md"
    doc: dict[str, Any] = json.loads(found.group(1))
    return doc


def test_the_documented_document_round_trips_field_for_field() -> None:
    doc = documented_example()
    status = SyncerStatus.from_json(doc)
    assert status.to_json() == doc
    assert status.outer_step == 12 and status.final_eval == "waiting"
    unit = status.learners["unit-0"]
    assert unit == LearnerStatus(
        attempt=0,
        age_seconds=1.2,
        step=1200,
        group="default",
        last_heartbeat=1764499999.0,
        tokens=2457600,
        tokens_per_sec=20480.0,
        loss=2.41,
        version_lag=1,
    )
    assert status.fragments[0].version == 3
    assert status.health == HealthStatus(ready=True, problems={})
    assert status.checkpoint == CheckpointStatus(skipped_at_start=())


def test_missing_and_mistyped_fields_become_unknown() -> None:
    status = SyncerStatus.from_json(
        {
            "outerStep": "12",
            "steps": True,
            "loss": float("nan"),
            "complete": "yes",
            "finalEval": "exploded",
            "fragments": {"0": 1},
            "learners": {"u": {"attempt": 2, "step": 1.5, "ageSeconds": None}, "v": 3},
            "newerField": [1, 2],
        }
    )
    assert status.outer_step is None and status.steps is None and status.loss is None
    assert status.complete is False and status.final_eval is None and status.fragments == ()
    assert status.learners == {"u": LearnerStatus(attempt=2)}
    assert SyncerStatus.from_json({}) == SyncerStatus()


def test_health_and_checkpoint_are_read_leniently() -> None:
    """A syncer older than them sends neither (None: unknown); a failing one names its problems,
    and a problem with a mistyped `ready` still reads as not ready."""
    assert SyncerStatus.from_json({"health": "ok", "checkpoint": 3}).health is None
    failing = SyncerStatus.from_json(
        {
            "health": {"ready": False, "problems": {"merge": "OSError: disk full"}},
            "checkpoint": {"skippedAtStart": ["seq 7: checksum mismatch"]},
        }
    )
    assert failing.health == HealthStatus(False, {"merge": "OSError: disk full"})
    assert failing.checkpoint == CheckpointStatus(("seq 7: checksum mismatch",))
    assert failing.to_json()["health"] == {
        "ready": False,
        "problems": {"merge": "OSError: disk full"},
    }
    mistyped = SyncerStatus.from_json(
        {
            "health": {"ready": "no", "problems": {"checkpoint": "x"}},
            "checkpoint": {"skippedAtStart": "x"},
        }
    )
    assert mistyped.health == HealthStatus(False, {"checkpoint": "x"})
    assert mistyped.checkpoint == CheckpointStatus(())


def test_the_model_imports_without_jax_or_numpy() -> None:
    code = (
        "import sys; import diloco_trainer.status; "
        "print(sorted(m for m in ('jax', 'numpy') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"
