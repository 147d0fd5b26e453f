"""The operator's requests to a run's syncer, with the run secret: its status (each pass), and
the unit roster it admits by (when the spec's units change: trainer's syncer/roster.py)."""

from __future__ import annotations

import logging

import aiohttp
from diloco_trainer.status import SyncerStatus

from diloco_operator.k8s import builders, kube
from diloco_operator.k8s.state import STATE
from diloco_operator.planner.placement import roster_document

log = logging.getLogger("diloco_operator")


def syncer_url(run: builders.Run) -> str:
    return STATE.options.syncer_url.format(
        name=run.syncer_name, namespace=run.namespace, port=run.spec.syncer.port
    )


async def read_run_token(run: builders.Run) -> str | None:
    """The run secret (cached per run): the operator's credential for status reads and the key
    each unit's own token is derived from."""
    key = (run.namespace, run.name)
    token = STATE.tokens.get(key)
    if token is None:
        token = await kube.read_token(run.namespace, run.token_secret, builders.TOKEN_KEY)
        if token is not None:
            STATE.tokens[key] = token
    return token


async def syncer_report(run: builders.Run) -> SyncerStatus | None:
    """GET /v1/status of the run's syncer; None when unreachable (the run keeps reconciling)."""
    token = await read_run_token(run)
    if token is None:
        return None
    if STATE.http is None:
        return None
    try:
        async with STATE.http.get(
            f"{syncer_url(run)}/v1/status", headers={"Authorization": f"Bearer {token}"}
        ) as resp:
            if resp.status != 200:
                log.debug("syncer status run=%s http=%s", run.name, resp.status)
                return None
            return SyncerStatus.from_json(await resp.json())
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        log.debug("syncer unreachable run=%s error=%r", run.name, exc)
        return None


async def hand_roster(run: builders.Run, report: SyncerStatus | None, generation: int) -> bool:
    """PUT the spec's roster when the syncer's is older (or it has none); True when the syncer
    holds this generation's roster afterwards. A syncer that cannot be reached is asked again
    next pass; its checkpoint keeps the roster it took."""
    if report is None:
        return False
    if report.roster_revision is not None and report.roster_revision >= generation:
        return True
    token = await read_run_token(run)
    if token is None or STATE.http is None:
        return False
    try:
        async with STATE.http.put(
            f"{syncer_url(run)}/v1/units",
            json=roster_document(run.name, run.spec, generation),
            headers={"Authorization": f"Bearer {token}"},
        ) as resp:
            if resp.status != 200:
                log.info("roster run=%s http=%s body=%s", run.name, resp.status, await resp.text())
                return False
            log.info(
                "roster run=%s revision=%d units=%d", run.name, generation, run.spec.total_units
            )
            return True
    except (aiohttp.ClientError, TimeoutError) as exc:
        log.debug("roster run=%s error=%r", run.name, exc)
        return False
