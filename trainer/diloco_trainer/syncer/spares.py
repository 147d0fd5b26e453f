"""Warm spares at the syncer: who is waiting, who covers which unit, and the hand-over.

A spare is a learner process that has imported JAX and compiled its step but has no unit yet
(learner/spare.py). It waits here with a long-poll (`POST /v1/spares/wait`). When a unit's
pods are lost the operator asks for a cover (`POST /v1/spares/cover`): the desk picks the spare
of the unit's group that has waited longest and hands it the unit's identity, with an attempt
between the lost one and the recreated one. The spare then joins as that unit and trains from
the unit's data lease at once, while the unit's own pods are recreated.

When the recreated unit joins with its newer attempt, the cover is over: the syncer refuses the
spare's older attempt from then on (409 `superseded`, registry.py), the spare's learner exits
and the spare waits here again. A cover that ended without being superseded (its process
crashed) is spent: its attempt has joined once, and a second process under the same attempt
would have its counters hidden under the first's, so the same cover is never handed out again.

Nothing here is checkpointed: a restarted syncer hears from every waiting spare within one
long-poll, and a running cover is an ordinary joined attempt of its unit.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from diloco_trainer.status import SpareState, SpareStatus
from diloco_trainer.syncer.fragment import Reject

# A spare not heard from for this long after its last long-poll ended is not counted as idle.
SEEN_WITHIN = 5.0


@dataclass(frozen=True)
class Cover:
    """Unit `unit_name` (global index `unit`, of `num_units`) covered under wire attempt
    `attempt` (attempts.py), handed to the spare at `since`."""

    unit_name: str
    unit: int
    num_units: int
    group: str
    attempt: int
    since: float

    def identity(self, token: str) -> dict[str, Any]:
        """What the spare is told: the keys of learner/standby.py's identity line."""
        return {
            "unit": self.unit,
            "unitName": self.unit_name,
            "numUnits": self.num_units,
            "attempt": self.attempt,
            "group": self.group,
            "token": token,
        }


@dataclass
class Spare:
    name: str
    group: str
    seen: float  # when its last long-poll started or ended
    cover: Cover | None = None
    delivered: bool = False  # the cover reached the spare (a long-poll returned it)
    waiter: asyncio.Future[Cover] | None = field(default=None, repr=False)

    @property
    def waiting(self) -> bool:
        return self.waiter is not None and not self.waiter.done()


class SpareDesk:
    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.spares: dict[str, Spare] = {}
        self.spent: set[tuple[str, int]] = set()  # (unit, attempt) covers that ended

    async def wait(self, name: str, group: str, seconds: float) -> Cover | None:
        """Spare `name` of `group` waits up to `seconds` for a cover; the cover, or None."""
        now = self.clock()
        spare = self.spares.get(name)
        if spare is None or spare.group != group:
            spare = self.spares[name] = Spare(name, group, now)
        spare.seen = now
        if spare.cover is not None and spare.delivered:
            # Back here with a cover handed out: its learner ended (superseded or crashed).
            self.spent.add((spare.cover.unit_name, spare.cover.attempt))
            spare.cover = None
        if spare.cover is not None:  # assigned while it was between two long-polls
            spare.delivered = True
            return spare.cover
        if spare.waiter is not None and not spare.waiter.done():
            spare.waiter.cancel()  # an earlier long-poll of the same spare (its client gave up)
        waiter = spare.waiter = asyncio.get_running_loop().create_future()
        try:
            cover = await asyncio.wait_for(asyncio.shield(waiter), seconds)
        except TimeoutError:
            return None
        finally:
            spare.seen = self.clock()
            if spare.waiter is waiter:
                spare.waiter = None
        spare.delivered = True
        return cover

    def cover(self, wanted: Cover, newest_joined: int | None) -> str:
        """Hand `wanted` to the longest-waiting idle spare of its group; that spare's name.
        Asking again for a cover already handed out answers with the same spare. Reject (409)
        when the unit's newest joined attempt is not older, when this cover ended already, or
        when no spare of the group is waiting."""
        for spare in self.spares.values():
            c = spare.cover
            if c is not None and (c.unit_name, c.attempt) == (wanted.unit_name, wanted.attempt):
                return spare.name
        if newest_joined is not None and newest_joined >= wanted.attempt:
            raise Reject(
                409,
                "superseded",
                f"unit {wanted.unit_name!r} joined as attempt {newest_joined} already: "
                f"no cover under attempt {wanted.attempt}",
            )
        if (wanted.unit_name, wanted.attempt) in self.spent:
            raise Reject(
                409,
                "cover_spent",
                f"the cover of unit {wanted.unit_name!r} under attempt {wanted.attempt} ended",
            )
        idle = [s for s in self.spares.values() if s.group == wanted.group and s.cover is None]
        idle = [s for s in idle if s.waiting]
        if not idle:
            raise Reject(409, "no_spare", f"no spare of group {wanted.group!r} is waiting")
        spare = min(idle, key=lambda s: (s.seen, s.name))
        spare.cover, spare.delivered = wanted, False
        assert spare.waiter is not None
        spare.waiter.set_result(wanted)
        return spare.name

    def release(self, unit: str, attempt: int) -> list[str]:
        """Attempt `attempt` of `unit` joined: every cover of it under an older attempt is over
        (the spares' learners are refused from now on). The spares released."""
        released = []
        for spare in self.spares.values():
            c = spare.cover
            if c is not None and c.unit_name == unit and c.attempt < attempt:
                self.spent.add((c.unit_name, c.attempt))
                spare.cover = None
                released.append(spare.name)
        return released

    def status(self, now: float) -> dict[str, SpareStatus]:
        out = {}
        for spare in self.spares.values():
            c = spare.cover
            state: SpareState
            if c is not None:
                state = "Covering"
            elif spare.waiting:
                state = "Waiting"
            elif now - spare.seen <= SEEN_WITHIN:
                state = "Returning"  # between two long-polls, or its cover just ended
            else:
                state = "Silent"
            out[spare.name] = SpareStatus(
                group=spare.group,
                state=state,
                unit=c.unit_name if c else None,
                attempt=c.attempt if c else None,
                since=c.since if c else None,
            )
        return out
