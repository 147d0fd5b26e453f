"""The syncer's `GET /v1/status` document (docs/contracts.md) as one typed model.

The syncer builds it and serves `to_json()`; every reader (the operator's handlers, the local
runtime, the trainer's client) parses the JSON with `SyncerStatus.from_json`, so the field names
live here only. Stdlib only, no JAX or numpy: the operator image imports this module.

Parsing is lenient: a missing or mistyped field becomes its default rather than an error, because
a newer or older syncer must never break a supervisor's reconciliation.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, cast

from diloco_trainer.shards import Shard

FinalEval = Literal["waiting", "running", "done", "failed", "off"]
FINAL_EVAL_STATES: tuple[FinalEval, ...] = ("waiting", "running", "done", "failed", "off")


def _int(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return int(value)


def _float(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    out = float(value)
    return out if out == out else None  # NaN is "no value"


@dataclass(frozen=True)
class LearnerStatus:
    """One learner unit as the syncer last heard from it. `age_seconds` is the time since its
    last sign of life (a heartbeat, else a join or push); `step` and `tokens` are summed over
    the unit's attempts, `tokens_per_sec` and `loss` are from its latest heartbeat."""

    attempt: int = 0
    age_seconds: float | None = None
    step: int | None = None
    group: str = "default"
    last_heartbeat: float | None = None
    tokens: int | None = None
    tokens_per_sec: float | None = None
    loss: float | None = None
    # Heartbeats and pushes of this unit refused as impossible (syncer/trust.py), the last one's
    # reason, and the reason its current attempt is quarantined (None: it is not).
    refused: int = 0
    last_refusal: str | None = None
    quarantined: str | None = None
    # Versions its last accepted push was behind the fragment it pushed (syncer/registry.py).
    version_lag: int | None = None
    # Not on the wire: the operator splits a pod's attempt into its recreation (`attempt`) and
    # the restarts in place within it (attempts.py).
    restarts_in_place: int = 0

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> LearnerStatus:
        step = doc.get("step")
        last, quarantined = doc.get("lastRefusal"), doc.get("quarantined")
        return cls(
            attempt=_int(doc.get("attempt")) or 0,
            age_seconds=_float(doc.get("ageSeconds")),
            step=step if isinstance(step, int) and not isinstance(step, bool) else None,
            group=str(doc.get("group") or "default"),
            last_heartbeat=_float(doc.get("lastHeartbeat")),
            tokens=_int(doc.get("tokens")),
            tokens_per_sec=_float(doc.get("tokensPerSec")),
            loss=_float(doc.get("loss")),
            refused=_int(doc.get("refused")) or 0,
            last_refusal=last if isinstance(last, str) else None,
            quarantined=quarantined if isinstance(quarantined, str) else None,
            version_lag=_int(doc.get("versionLag")),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "attempt": self.attempt,
            "group": self.group,
            "lastHeartbeat": self.last_heartbeat,
            "ageSeconds": self.age_seconds,
            "step": self.step,
            "tokens": self.tokens,
            "tokensPerSec": self.tokens_per_sec,
            "loss": self.loss,
            "refused": self.refused,
            "lastRefusal": self.last_refusal,
            "quarantined": self.quarantined,
            "versionLag": self.version_lag,
        }


@dataclass(frozen=True)
class FragmentStatus:
    index: int
    version: int
    last_merge: float | None = None

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> FragmentStatus:
        return cls(
            index=_int(doc.get("index")) or 0,
            version=_int(doc.get("version")) or 0,
            last_merge=_float(doc.get("lastMerge")),
        )

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "version": self.version, "lastMerge": self.last_merge}


@dataclass(frozen=True)
class HealthStatus:
    """What `/readyz` reports: `ready` while the syncer can merge and write checkpoints, else
    `problems` maps each failing component (`merge`, `checkpoint`) to its last error."""

    ready: bool = True
    problems: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> HealthStatus:
        raw = doc.get("problems")
        problems = {str(k): str(v) for k, v in raw.items()} if isinstance(raw, Mapping) else {}
        ready = doc.get("ready")
        return cls(ready=ready if isinstance(ready, bool) else not problems, problems=problems)

    def to_json(self) -> dict[str, Any]:
        return {"ready": self.ready, "problems": dict(self.problems)}


@dataclass(frozen=True)
class CheckpointStatus:
    """`skipped_at_start`: one reason per newer checkpoint the syncer found unusable at its
    start and rolled back past (empty normally)."""

    skipped_at_start: tuple[str, ...] = ()

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> CheckpointStatus:
        raw = doc.get("skippedAtStart")
        skipped = tuple(str(r) for r in raw) if isinstance(raw, list) else ()
        return cls(skipped_at_start=skipped)

    def to_json(self) -> dict[str, Any]:
        return {"skippedAtStart": list(self.skipped_at_start)}


SpareState = Literal["Waiting", "Covering", "Returning", "Silent"]
SPARE_STATES: tuple[SpareState, ...] = ("Waiting", "Covering", "Returning", "Silent")


@dataclass(frozen=True)
class SpareStatus:
    """A warm spare as the syncer sees it (syncer/spares.py): waiting for a unit to cover,
    covering `unit` under wire attempt `attempt` since `since`, between two waits, or silent."""

    group: str = "default"
    state: SpareState = "Silent"
    unit: str | None = None
    attempt: int | None = None
    since: float | None = None

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> SpareStatus:
        state = doc.get("state")
        unit = doc.get("unit")
        return cls(
            group=str(doc.get("group") or "default"),
            state=cast(SpareState, state) if state in SPARE_STATES else "Silent",
            unit=unit if isinstance(unit, str) else None,
            attempt=_int(doc.get("attempt")),
            since=_float(doc.get("since")),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "group": self.group,
            "state": self.state,
            "unit": self.unit,
            "attempt": self.attempt,
            "since": self.since,
        }


@dataclass(frozen=True)
class SyncerStatus:
    """The whole status document. Counters are None when a reader got a document without them
    (the planner then keeps the values it had); `health` and `checkpoint` are None when the
    document has none (a syncer older than them)."""

    run: str = ""
    outer_step: int | None = None
    steps: int | None = None
    tokens: int | None = None
    loss: float | None = None
    train_loss: float | None = None
    complete: bool = False
    final_loss: float | None = None
    final_eval: FinalEval | None = None
    time: float | None = None
    fragments: tuple[FragmentStatus, ...] = ()
    learners: dict[str, LearnerStatus] = field(default_factory=dict)
    bytes_received: int | None = None
    bytes_sent: int | None = None
    health: HealthStatus | None = None
    checkpoint: CheckpointStatus | None = None
    # The revision of the unit roster the syncer admits by (syncer/roster.py); None: it has
    # none and admits any unit the run secret vouches for.
    roster_revision: int | None = None
    # Which syncer shard wrote this document (shards.py); None: an unsharded syncer, or one
    # older than shards. A shard's fragments, outer step and bytes are its own (`gathered`).
    shard: Shard | None = None
    # Warm spares waiting at (or covering a unit for) the syncer, by name (shard 0's alone).
    spares: dict[str, SpareStatus] = field(default_factory=dict)

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> SyncerStatus:
        learners, spares = doc.get("learners"), doc.get("spares")
        fragments = doc.get("fragments")
        final_eval = doc.get("finalEval")
        health, checkpoint = doc.get("health"), doc.get("checkpoint")
        return cls(
            run=str(doc.get("run") or ""),
            outer_step=_int(doc.get("outerStep")),
            steps=_int(doc.get("steps")),
            tokens=_int(doc.get("tokens")),
            loss=_float(doc.get("loss")),
            train_loss=_float(doc.get("trainLoss")),
            complete=doc.get("complete") is True,
            final_loss=_float(doc.get("finalLoss")),
            final_eval=cast(FinalEval, final_eval) if final_eval in FINAL_EVAL_STATES else None,
            time=_float(doc.get("time")),
            fragments=tuple(
                FragmentStatus.from_json(f) for f in fragments or () if isinstance(f, Mapping)
            )
            if isinstance(fragments, list)
            else (),
            learners={
                str(name): LearnerStatus.from_json(entry)
                for name, entry in learners.items()
                if isinstance(entry, Mapping)
            }
            if isinstance(learners, Mapping)
            else {},
            bytes_received=_int(doc.get("bytesReceived")),
            bytes_sent=_int(doc.get("bytesSent")),
            health=HealthStatus.from_json(health) if isinstance(health, Mapping) else None,
            checkpoint=CheckpointStatus.from_json(checkpoint)
            if isinstance(checkpoint, Mapping)
            else None,
            roster_revision=_int(doc.get("rosterRevision")),
            shard=_shard(doc.get("shard")),
            spares={
                str(name): SpareStatus.from_json(entry)
                for name, entry in spares.items()
                if isinstance(entry, Mapping)
            }
            if isinstance(spares, Mapping)
            else {},
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "outerStep": self.outer_step,
            "steps": self.steps,
            "tokens": self.tokens,
            "loss": self.loss,
            "trainLoss": self.train_loss,
            "complete": self.complete,
            "finalLoss": self.final_loss,
            "finalEval": self.final_eval,
            "time": self.time,
            "fragments": [f.to_json() for f in self.fragments],
            "learners": {name: entry.to_json() for name, entry in self.learners.items()},
            "bytesReceived": self.bytes_received,
            "bytesSent": self.bytes_sent,
            "health": self.health.to_json() if self.health else None,
            "checkpoint": self.checkpoint.to_json() if self.checkpoint else None,
            "rosterRevision": self.roster_revision,
            "shard": str(self.shard) if self.shard is not None and self.shard.sharded else None,
            "spares": {name: entry.to_json() for name, entry in self.spares.items()},
        }


def _shard(raw: Any) -> Shard | None:
    if not isinstance(raw, str):
        return None
    try:
        return Shard.parse(raw)
    except ValueError:
        return None


def gathered(shards: Sequence[SyncerStatus]) -> SyncerStatus:
    """The run's status from its syncer shards' documents, shard 0's first: the run-level parts
    (learners, evaluations, completion, roster) are shard 0's; fragments, outer step and bytes
    add up over the shards that answered. An unsharded syncer's document comes back as is."""
    if not shards:
        raise ValueError("gathered: no status documents")
    lead = shards[0]
    if len(shards) == 1:
        return lead
    return replace(
        lead,
        outer_step=_total(s.outer_step for s in shards),
        fragments=tuple(sorted((f for s in shards for f in s.fragments), key=lambda f: f.index)),
        bytes_received=_total(s.bytes_received for s in shards),
        bytes_sent=_total(s.bytes_sent for s in shards),
    )


def _total(values: Iterable[int | None]) -> int | None:
    known = list(values)
    return None if any(v is None for v in known) else sum(v for v in known if v is not None)
