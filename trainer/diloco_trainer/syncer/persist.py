"""Checkpoint side of the syncer: snapshot, restore and version renumbering after a crash."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from typing import TYPE_CHECKING

import numpy as np

from diloco_trainer.config import TrainingConfig
from diloco_trainer.outer import OuterOptimizer
from diloco_trainer.syncer.checkpoint import Snapshot
from diloco_trainer.syncer.data_leases import LeaseBook

if TYPE_CHECKING:
    from diloco_trainer.syncer.core import Syncer

log = logging.getLogger("diloco.syncer")


def restore(s: Syncer, snap: Snapshot) -> None:
    layout = [f.names for f in s.frags]
    if snap.layout != layout:
        raise ValueError(
            "checkpoint layout differs from this config's fragments/model; "
            "use a fresh checkpoint.path for a changed model"
        )
    for f in s.frags:
        for n in f.names:
            if n not in snap.params or tuple(snap.params[n].shape) != s.shapes[n]:
                raise ValueError(f"checkpoint leaf {n}: missing or wrong shape")
        f.params = {n: snap.params[n].astype(np.float32) for n in f.names}
        f.opt_state = s.outer.state_from_leaves(f.params, snap.outer_state[f.index])
        f.version = snap.versions[f.index]
        f.last_merge = (snap.extra.get("lastMerge") or [None] * len(s.frags))[f.index]
    s.learners.load_json(snap.learners, now=time.time())
    # Absent from checkpoints older than data leases: a fresh book. The journal holds the
    # assignments made since the checkpoint.
    s.leases = LeaseBook.from_json(snap.extra.get("dataLeases"), s.cfg.data.shards)
    journal = s.store.recorded_leases() if s.store is not None else None
    if journal is not None:
        s.leases = s.leases.newest(LeaseBook.from_json(journal, s.cfg.data.shards))
    s.eval_loss = snap.extra.get("evalLoss")
    s.final_loss = snap.extra.get("finalLoss")
    s._saved_mark = s._mark()
    log.info(
        "event=restored seq=%d versions=%s outer_step=%d",
        snap.seq,
        snap.versions,
        s.outer_step,
    )


def resume_numbering(s: Syncer) -> list[int]:
    """Versions published before a crash but not checkpointed are lost; their numbers are not
    reused. A fragment whose journal is ahead resumes at journal+1, so every learner sees a
    strictly newer version (carrying the restored content) and installs it."""
    versions = s.versions()
    journal = s.store.recorded_versions() if s.store is not None else None
    if journal is not None and len(journal) == len(versions):
        for f in s.frags:
            if journal[f.index] > f.version:
                log.warning(
                    "event=versions_lost fragment=%d checkpointed=%d published=%d resume=%d",
                    f.index, f.version, journal[f.index], journal[f.index] + 1,
                )  # fmt: skip
                f.version = journal[f.index] + 1
        versions = s.versions()
    if s.store is not None:
        s.store.record_versions(versions)
    return versions


def config_hash(cfg: TrainingConfig) -> str:
    """A short digest of the training block: tells which config a checkpoint (or an export)
    was made under."""
    wire = json.dumps(cfg.to_wire(), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(wire.encode()).hexdigest()[:16]


def snapshot(s: Syncer) -> Snapshot:
    """References to the current state (taken on the loop thread; arrays are never mutated)."""
    params: dict[str, np.ndarray] = {}
    for f in s.frags:
        params.update(f.params)
    return Snapshot(
        params=params,
        outer_state=[OuterOptimizer.state_leaves(f.opt_state) for f in s.frags],
        versions=[f.version for f in s.frags],
        layout=[f.names for f in s.frags],
        outer_step=s.outer_step,
        learners=s.learners.to_json(),
        extra={
            "run": s.run,
            "configHash": config_hash(s.cfg),
            "evalLoss": s.eval_loss,
            "finalLoss": s.final_loss,
            "lastMerge": [f.last_merge for f in s.frags],
            "dataLeases": s.leases.to_json(),
        },
    )
