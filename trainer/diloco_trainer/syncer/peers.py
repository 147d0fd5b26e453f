"""The whole model for an evaluation, on a sharded syncer: the fragments this shard holds and the
others read from the shards that hold them (`GET /v1/params` with the run token).

Only the leading shard evaluates. The other shards' values are held for the length of one
evaluation and dropped after it: the leader's memory rises by the model's size while it
evaluates, and is back to its share between evaluations (docs/design.md, "Sharded syncer").
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

import aiohttp
import numpy as np

from diloco_trainer.wire import WireError, decode_params

if TYPE_CHECKING:
    from diloco_trainer.syncer.state import SyncerState

log = logging.getLogger("diloco.syncer")
PEER_TIMEOUT_SECONDS = 120.0


class PeerUnavailable(Exception):
    """A shard did not serve its fragments (down, restarting, or answering garbage)."""


async def model_params(
    s: SyncerState, patience: float = 0.0
) -> tuple[dict[str, np.ndarray], tuple[int, ...]]:
    """Every parameter of the model and the version of each fragment they are of. A shard that
    does not answer is asked again for up to `patience` seconds (its standby takes over within
    one), then PeerUnavailable."""
    deadline = time.monotonic() + patience
    while True:
        try:
            return await _gather(s)
        except PeerUnavailable as exc:
            if time.monotonic() >= deadline:
                raise
            log.warning("event=peer_retry error=%s", exc)
            await asyncio.sleep(1.0)


async def _gather(s: SyncerState) -> tuple[dict[str, np.ndarray], tuple[int, ...]]:
    params, versions = s.global_params(), s.versions()
    if not s.shard.sharded:
        return params, tuple(versions)
    others = [i for i in range(s.shard.count) if i != s.shard.index]
    timeout = aiohttp.ClientTimeout(total=PEER_TIMEOUT_SECONDS)
    # https peers verify against the run's CA bundle (DILOCO_CA_FILE), else the system's.
    connector = aiohttp.TCPConnector(ssl=s.peer_trust.context())
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        got = await asyncio.gather(*(_read_shard(s, session, i) for i in others))
    for index, (tensors, their_versions) in zip(others, got, strict=True):
        for p, owner in enumerate(s.owners):
            if owner != index:
                continue
            missing = [n for n in s.frags[p].names if n not in tensors]
            if missing or p >= len(their_versions):
                raise PeerUnavailable(f"shard {index} did not serve fragment {p}")
            params.update({n: tensors[n] for n in s.frags[p].names})
            versions[p] = their_versions[p]
    return params, tuple(versions)


async def _read_shard(
    s: SyncerState, session: aiohttp.ClientSession, index: int
) -> tuple[dict[str, np.ndarray], list[int]]:
    url = f"{s.peers[index].rstrip('/')}/v1/params"
    try:
        async with session.get(url, headers={"Authorization": f"Bearer {s.token}"}) as reply:
            body = await reply.read()
            if reply.status != 200:
                raise PeerUnavailable(f"shard {index} ({url}): HTTP {reply.status}")
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise PeerUnavailable(f"shard {index} ({url}): {exc!r}") from exc
    try:
        got = await asyncio.get_running_loop().run_in_executor(s.pools.decode, decode_params, body)
    except WireError as exc:
        raise PeerUnavailable(f"shard {index} ({url}): bad payload: {exc}") from exc
    return got.tensors, got.versions
