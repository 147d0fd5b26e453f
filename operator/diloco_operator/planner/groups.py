"""`status.groups`: each unit group summed from its units and the syncer's report. A group is
what one cluster runs, so a home run across clusters reads as its clusters side by side."""

from __future__ import annotations

from collections.abc import Sequence

from diloco_trainer.status import SyncerStatus

from diloco_operator.api import DilocoRunSpec, UnitStatus
from diloco_operator.api.status import GroupStatus
from diloco_operator.planner.goodput import useful_share


def group_summaries(
    spec: DilocoRunSpec,
    units: Sequence[UnitStatus],
    report: SyncerStatus | None,
    before: Sequence[GroupStatus],
) -> list[GroupStatus]:
    """One entry per group of the spec, in its order; an away run's own group only (home's
    run shows them all). Without a report (the syncer did not answer this pass) a group keeps
    the tokens and throughput it last showed."""
    kept = {g.name: g for g in before}
    out = []
    for group in spec.unit_groups:
        if spec.away and group.remote:
            continue
        mine = [u for u in units if u.group == group.name and u.state != "Removing"]
        heard = [report.learners[u.name] for u in mine if report and u.name in report.learners]
        if report is not None:
            tokens = sum(h.tokens or 0 for h in heard) if heard else None
            rate = sum(h.tokens_per_sec or 0.0 for h in heard) if heard else None
        else:
            last = kept.get(group.name)
            tokens, rate = (last.tokens, last.tokens_per_sec) if last else (None, None)
        accounted = [u.goodput for u in mine if u.goodput is not None]
        total = sum(g.total_seconds for g in accounted)
        out.append(
            GroupStatus(
                name=group.name,
                remote=group.remote,
                units=len(mine),
                units_online=sum(u.state == "Online" for u in mine),
                tokens=tokens,
                tokens_per_sec=rate,
                goodput=useful_share(sum(g.useful_seconds for g in accounted), total)
                if total > 0
                else None,
            )
        )
    return out
