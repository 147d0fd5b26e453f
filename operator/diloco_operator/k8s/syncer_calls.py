"""The operator's requests to a run's syncer: its status (each pass), and the unit roster it
admits by (when the spec's units change: trainer's syncer/roster.py). A sharded syncer is asked
shard by shard: every shard reports its own fragments and takes the roster (shard_status.py
gathers the answers).

At home the operator speaks with the run secret, over HTTPS verified with the certificate
Secret's CA when the syncer serves TLS. An away run's operator holds no run secret: it reads the
home syncer's status as the credential's observer (join_credentials.OBSERVER), over HTTPS
verified with the run's CA Secret, and records what it saw (reachable, last error naming the
address) for the run's status."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import ssl
import time
from dataclasses import dataclass, replace

import aiohttp
from diloco_trainer import attempts
from diloco_trainer.auth import UNIT_HEADER
from diloco_trainer.join_credentials import (
    JOIN_HEADER,
    OBSERVER,
    parse_join_credential,
    unit_token_from_credential,
)
from diloco_trainer.status import SyncerStatus

from diloco_operator.api.pod_security import TOKEN_KEY
from diloco_operator.k8s import builders, kube
from diloco_operator.k8s.away import error_reason, refusal_reason
from diloco_operator.k8s.cross_cluster import ca_source
from diloco_operator.k8s.state import STATE, Reach
from diloco_operator.planner import CoverUnit
from diloco_operator.planner.placement import roster_document

log = logging.getLogger("diloco_operator")


def syncer_url(run: builders.Run, shard: int = 0) -> str:
    external = run.spec.syncer.external
    if external is not None:
        return external.address
    url = STATE.options.syncer_url.format(
        name=run.shard_name(shard), namespace=run.namespace, port=run.spec.syncer.port
    )
    if run.spec.syncer.tls is not None and url.startswith("http://"):
        url = "https://" + url.removeprefix("http://")
    return url


async def read_run_token(run: builders.Run) -> str | None:
    """The key units' tokens are derived from (cached per run): the run secret at home, which
    is also the operator's credential for the syncer; an away run's join credential."""
    key = (run.namespace, run.name)
    token = STATE.tokens.get(key)
    if token is None:
        external = run.spec.syncer.external
        secret, field = (
            (external.credential.name, external.credential.key)
            if external is not None
            else (run.token_secret, TOKEN_KEY)
        )
        token = await kube.read_token(run.namespace, secret, field)
        if token is not None:
            STATE.tokens[key] = token
    return token


async def _trust(run: builders.Run) -> ssl.SSLContext | None:
    """The TLS context that verifies this run's syncer, or None for plain HTTP. Cached by the
    CA bundle's content, so a rotated bundle takes effect at the next pass."""
    source = ca_source(run)
    if source is None:
        return None
    secret, field = source
    pem = await kube.read_token(run.namespace, secret, field)
    if pem is None:
        raise ValueError(f"CA bundle: Secret {secret} has no key {field}")
    digest = hashlib.sha256(pem.encode()).hexdigest()
    cached = STATE.trust.get(digest)
    if cached is None:
        cached = STATE.trust[digest] = ssl.create_default_context(cadata=pem)
    return cached


def _headers(run: builders.Run, token: str) -> dict[str, str]:
    if run.spec.syncer.external is None:
        return {"Authorization": f"Bearer {token}"}
    credential = parse_join_credential(token)
    return {
        "Authorization": f"Bearer {unit_token_from_credential(credential, OBSERVER)}",
        UNIT_HEADER: OBSERVER,
        JOIN_HEADER: credential.public,
    }


@dataclass(frozen=True)
class ShardRead:
    """One syncer shard's `GET /v1/status` this pass: its document, or why there is none."""

    shard: int
    url: str
    report: SyncerStatus | None
    error: str | None = None
    reason: str = "Reachable"  # as Reach.reason (k8s/away.py)


async def syncer_report(run: builders.Run) -> SyncerStatus | None:
    """GET /v1/status of the run's syncer (shard 0 of a sharded one); None when unreachable
    (the run keeps reconciling). What happened is kept in STATE.reach for the run's status."""
    return (await read_shards(run, only_lead=True))[0].report


async def read_shards(run: builders.Run, only_lead: bool = False) -> list[ShardRead]:
    """Every shard's status, shard 0 first, read at once (one slow shard delays the pass by
    one timeout, not one per shard). Shard 0's read is the run's in STATE.reach."""
    count = 1 if only_lead else run.shards
    reads = list(await asyncio.gather(*(_read(run, i) for i in range(count))))
    lead = reads[0]
    _saw(run, lead.url, lead.error, lead.reason)
    return reads


async def _read(run: builders.Run, shard: int) -> ShardRead:
    url = syncer_url(run, shard)
    token = await read_run_token(run)
    if token is None or STATE.http is None:
        why = "no credential yet" if token is None else "operator starting"
        return ShardRead(shard, url, None, why, "Unreachable")
    try:
        trust = await _trust(run)
        async with STATE.http.get(
            f"{url}/v1/status", headers=_headers(run, token), ssl=trust if trust else True
        ) as resp:
            if resp.status != 200:
                text = await resp.text()
                why = f"HTTP {resp.status}: {text[:300]}"
                log.debug("syncer status run=%s shard=%d %s", run.name, shard, why)
                if run.spec.syncer.external is not None and resp.status in (401, 403):
                    # a refused join credential may have been replaced in its Secret since:
                    # read it again next pass (units created from then on use the new one)
                    STATE.tokens.pop((run.namespace, run.name), None)
                return ShardRead(shard, url, None, why, refusal_reason(_reason_code(text)))
            report = pod_attempts(SyncerStatus.from_json(await resp.json()))
    except (aiohttp.ClientError, TimeoutError, ValueError, ssl.SSLError) as exc:
        log.debug("syncer unreachable run=%s shard=%d error=%r", run.name, shard, exc)
        return ShardRead(shard, url, None, f"{type(exc).__name__}: {exc}", error_reason(exc))
    return ShardRead(shard, url, report)


def pod_attempts(report: SyncerStatus) -> SyncerStatus:
    """`report` with each learner's attempt read as the operator numbers it: the unit's
    recreations, the restarts in place within the current one apart (the trainer's attempts.py)."""
    learners = {}
    for name, learner in report.learners.items():
        attempt, restarts = attempts.split(learner.attempt)
        learners[name] = replace(learner, attempt=attempt, restarts_in_place=restarts)
    return replace(report, learners=learners)


def _reason_code(body: str) -> object:
    """The `reason` of the syncer's JSON error body (docs/protocol.md), None without one."""
    try:
        doc = json.loads(body)
    except ValueError:
        return None
    return doc.get("reason") if isinstance(doc, dict) else None


def _saw(run: builders.Run, url: str, error: str | None, reason: str) -> None:
    key = (run.namespace, run.name)
    before = STATE.reach.get(key)
    now = time.time()
    contact = now if error is None else (before.last_contact if before else None)
    message = None if error is None else f"{url}: {error}"[:1024]
    since = None
    if error is None:
        since = before.since if before is not None and before.since is not None else now
    STATE.reach[key] = Reach(url, error is None, contact, message, reason, since)


async def hand_rosters(run: builders.Run, reads: list[ShardRead], generation: int) -> bool:
    """The roster to every shard that answered (each admits the units on its own); True when
    every shard holds this generation's roster afterwards."""
    handed = await asyncio.gather(*(hand_roster(run, r.report, generation, r.shard) for r in reads))
    return len(handed) == run.shards and all(handed)


async def hand_roster(
    run: builders.Run, report: SyncerStatus | None, generation: int, shard: int = 0
) -> bool:
    """PUT the spec's roster when the syncer's is older (or it has none); True when the syncer
    holds this generation's roster afterwards. A syncer that cannot be reached is asked again
    next pass; its checkpoint keeps the roster it took. Only the home run hands it over."""
    if report is None or run.spec.syncer.external is not None:
        return False
    if report.roster_revision is not None and report.roster_revision >= generation:
        return True
    roster = roster_document(run.name, run.spec, generation)
    answer = await _send(run, "PUT", "/v1/units", roster, shard)
    if answer is None:
        return False
    status, body = answer
    if status != 200:
        log.info("roster run=%s shard=%d http=%s body=%s", run.name, shard, status, body)
        return False
    log.info(
        "roster run=%s shard=%d revision=%d units=%d",
        run.name,
        shard,
        generation,
        run.spec.total_units,
    )
    return True


async def ask_cover(run: builders.Run, cover: CoverUnit) -> str | None:
    """Ask shard 0 of the run's syncer to hand `cover`'s unit to a waiting spare
    (planner/spares.py); the spare's name, or None when refused or unreachable (the next pass
    asks again while the report still shows a spare waiting)."""
    body = {
        "unit": cover.name,
        "index": cover.global_index,
        "numUnits": cover.num_units,
        "group": cover.group,
        "attempt": cover.attempt,
    }
    answer = await _send(run, "POST", "/v1/spares/cover", body)
    if answer is None:
        return None
    status, text = answer
    if status != 200:
        log.info("cover run=%s unit=%s http=%s body=%s", run.name, cover.name, status, text[:300])
        return None
    try:
        spare = str(json.loads(text).get("spare", ""))
    except (ValueError, AttributeError) as exc:
        log.info("cover run=%s unit=%s error=%r", run.name, cover.name, exc)
        return None
    log.info("cover run=%s unit=%s attempt=%d spare=%s", run.name, cover.name, cover.attempt, spare)
    return spare


async def _send(
    run: builders.Run, method: str, path: str, body: dict[str, object], shard: int = 0
) -> tuple[int, str] | None:
    """A request to a syncer shard under the run's credential: (HTTP status, body), or None
    when there is no credential or session yet, or the syncer cannot be reached (logged)."""
    token = await read_run_token(run)
    if token is None or STATE.http is None:
        return None
    try:
        trust = await _trust(run)
        async with STATE.http.request(
            method,
            f"{syncer_url(run, shard)}{path}",
            json=body,
            headers=_headers(run, token),
            ssl=trust if trust else True,
        ) as resp:
            return resp.status, await resp.text()
    except (aiohttp.ClientError, TimeoutError, ValueError, ssl.SSLError) as exc:
        log.debug("%s %s run=%s shard=%d error=%r", method, path, run.name, shard, exc)
        return None
