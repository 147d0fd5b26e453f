"""A sharded syncer's objects (`spec.syncer.shards: S`): what tells one shard's children from
another's, and what each shard's container is told. Pure functions, like builders.

Shard i has its own Deployment, Service and PodDisruptionBudget (`Run.shard_name`), each with
its own standby container. Their pods all carry the run's syncer labels (the NetworkPolicy, the
monitors and `kubectl logs -l` see one syncer) plus `diloco.dev/syncer-shard`, which every
selector of a shard's objects includes: without it shard 0's Service would send learners to
shard 1's pod, and two budgets over one pod make every eviction of it fail. A run of one shard
carries no shard label, env or folder at all: its objects are the ones it always had.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from diloco_trainer.shards import Shard, shard_checkpoint_path

from diloco_operator.k8s.run_ref import Run
from diloco_operator.planner import ObservedSyncer

LABEL_SHARD = "diloco.dev/syncer-shard"


def shard_labels(run: Run, shard: int) -> dict[str, str]:
    """The label (and selector term) of shard `shard`'s objects; none when unsharded."""
    return {LABEL_SHARD: str(shard)} if run.shards > 1 else {}


def shard_env(run: Run, shard: int) -> list[dict[str, str]]:
    """Which shard this syncer is, and every shard's address (shard 0 reads the others'
    fragments to evaluate the model; the others are given them too, so the containers of all
    shards differ in their index only)."""
    if run.shards == 1:
        return []
    return [
        {"name": "DILOCO_SYNCER_SHARD", "value": str(Shard(shard, run.shards))},
        {"name": "DILOCO_SYNCER_PEERS", "value": ",".join(run.syncer_addresses)},
    ]


def lock_dir(run: Run, shard: int, mount: str) -> str:
    """Where shard `shard` keeps its serving lock on a claim: the shard's own checkpoint folder
    (the one the syncer derives from the same path), so shards that share a claim never wait
    on each other's lock, only on their own pod's predecessor."""
    return shard_checkpoint_path(mount, Shard(shard, run.shards))


class SyncerDeployment(NamedTuple):
    """One syncer Deployment as the operator's watch sees it (handlers.syncer_deployments)."""

    ready: bool
    replicas: int
    shard: int = 0


def shard_of(labels: dict[str, str] | Any) -> int:
    """The shard a syncer Deployment is of (0 without the label: an unsharded syncer)."""
    raw = labels.get(LABEL_SHARD) if labels else None
    return int(raw) if isinstance(raw, str) and raw.isdigit() else 0


def observed_syncer(run: Run, seen: Sequence[SyncerDeployment]) -> ObservedSyncer:
    """The planner's one view of every shard: present when each shard's Deployment exists
    (else CreateSyncer makes the missing ones; the others exist: a no-op), ready when each has
    a ready pod. A replica count the shards disagree on (a scale that reached some of them)
    is reported as one the planner does not want, so it scales again, and ScaleSyncer scales
    every shard."""
    by_shard = {d.shard: d for d in seen if d.shard < run.shards}
    if not by_shard:
        return ObservedSyncer(present=False, ready=False)
    counts = [d.replicas for d in by_shard.values()]
    wanted = 0 if run.spec.suspend else 1
    replicas = counts[0] if len(set(counts)) == 1 else next(c for c in counts if c != wanted)
    return ObservedSyncer(
        present=len(by_shard) == run.shards,
        ready=len(by_shard) == run.shards and all(d.ready for d in by_shard.values()),
        replicas=replicas,
    )
