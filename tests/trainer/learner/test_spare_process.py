"""A warm spare (`diloco-learner --spare`) as a real process against a live syncer: it compiles,
waits at the syncer, is handed a unit by the operator's cover request and trains as that unit;
when the unit's recreated attempt joins, the cover is refused, its learner exits 4 and the
spare's supervisor forks the next life, which waits again. Then SIGTERM ends it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from diloco_trainer.attempts import cover_attempt, wire_attempt
from diloco_trainer.auth import spare_token
from diloco_trainer.syncer.core import Syncer

from tests.trainer.learner.test_supervisor_process import children, wait
from tests.trainer.syncer.test_syncer import TOKEN, LiveSyncer, tiny_cfg

pytestmark = pytest.mark.slow

SPARE = "run-default-spare0"
UNIT = "run-default-1"


def test_a_spare_covers_a_unit_until_its_recreated_attempt_joins(tmp_path: Path) -> None:
    cfg = tiny_cfg(totalSteps=10**9, heartbeatSeconds=0.2, innerSteps=5)
    live = LiveSyncer(Syncer(cfg, TOKEN, run="run", store=None, eval_fn=None))
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(cfg.to_wire()))
    log = tmp_path / "spare.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DILOCO_")}
    env |= {
        "JAX_PLATFORMS": "cpu",
        "DILOCO_SYNCER_ADDR": live.url,
        "DILOCO_TOKEN": spare_token(TOKEN, SPARE),
        "DILOCO_SPARE": SPARE,
        "DILOCO_NUM_UNITS": "2",
        "DILOCO_GROUP": "default",
        # What a spare pod carries like any learner pod; a cover's attempt is the syncer's.
        "DILOCO_RESTART_DIR": str(tmp_path),
        "DILOCO_IN_PLACE_RESTARTS": "2",
        "DILOCO_CACHE_DIR": os.environ.get("DILOCO_CACHE_DIR", str(tmp_path / "cache")),
    }
    argv = [sys.executable, "-m", "diloco_trainer.learner.main", "--config", str(config)]
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:

        def state() -> str | None:
            spare = live.syncer.spares.spares.get(SPARE)
            return None if spare is None else live.syncer.status().spares[SPARE].state

        wait("the spare compiled and waits", lambda: state() == "Waiting", proc, log)
        (first_life,) = children(proc.pid)
        body = {"unit": UNIT, "index": 1, "numUnits": 2, "group": "default"}
        asked = time.monotonic()
        status, reply = live.raw(
            "POST", "/v1/spares/cover", json.dumps({**body, "attempt": cover_attempt(0)}).encode()
        )
        assert (status, reply) == (200, {"spare": SPARE})

        def pushed(attempt: int) -> bool:
            record = live.syncer.learners.records.get(UNIT)
            return record is not None and record.pushed.get(attempt, 0) > 0

        wait("the cover trains and pushes as the unit", lambda: pushed(cover_attempt(0)), proc, log)
        print(f"cover asked -> first push of the cover: {time.monotonic() - asked:.2f}s")
        assert live.syncer.status().spares[SPARE].unit == UNIT

        live.client(UNIT, wire_attempt(1, 0)).join()  # the unit's recreated pod
        wait("the spare waits again", lambda: state() == "Waiting", proc, log)
        (next_life,) = children(proc.pid)
        assert next_life != first_life and proc.poll() is None
        text = log.read_text()
        assert "event=superseded action=stop" in text
        assert "event=spare_again exit=4" in text
        assert "restarted_in_place" not in text  # the pod's restart count is not the cover's

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 128 + signal.SIGTERM, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        live.close()
