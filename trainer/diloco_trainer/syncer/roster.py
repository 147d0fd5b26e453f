"""The run's roster: the exact unit identities (and each one's group) the syncer admits.

The run secret can mint a token for any unit name (auth.py), so a credential alone does not say
the unit belongs to the run: without a roster, a hundred invented names would each be a unit,
and each would dilute every honest unit's share of the merges. Whoever creates the units knows
the set: the operator from the DilocoRun's unit groups, the local runtime from the manifest. It
hands the set over as a file at start (`--units-file`) and, when it changes (a scale), with
`PUT /v1/units` (the run token); the newest revision wins, and the checkpoint keeps it.

A unit not on the roster is refused at join and on every request (403 `unknown_unit`); one that
claims another group than the roster's is refused too (403 `wrong_group`).

The roster also carries the ids of revoked join credentials (`revokedCredentials`,
join_credentials.py): the operator already hands the syncer a new revision whenever the run
changes, and the checkpoint keeps it, so a revocation reaches a running syncer at once and
survives its restart without a second channel. Rosters without the field revoke nothing.

And it carries the run's budget (`budget`: totalSteps and/or totalTokens), the one part of the
training block a running run may change: the syncer alone decides when the run is complete
(learners stop when it says so and follow its share of the budget on their LR schedule), so a
longer or shorter run needs no restart. Rosters without it leave the config's budget in force.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diloco_trainer.budget import Budget
from diloco_trainer.join_credentials import ID_PATTERN
from diloco_trainer.syncer.fragment import Reject
from diloco_trainer.wire import MAX_COUNTER

MAX_UNITS = 100_000
MAX_REVOKED = 100_000
REVOKED_FIELD = "revokedCredentials"
BUDGET_FIELD = "budget"


@dataclass(frozen=True)
class Roster:
    revision: int
    units: Mapping[str, str]  # unit name -> group
    revoked: frozenset[str] = frozenset()  # ids of revoked join credentials
    budget: Budget | None = None  # None: the training config's

    @classmethod
    def from_json(cls, doc: Any, where: str = "roster") -> Roster:
        """The roster in `doc` ({"revision": n, "units": {name: group}}); ValueError naming
        the field otherwise."""
        if not isinstance(doc, dict):
            raise ValueError(f"{where}: expected an object with revision and units")
        revision, units = doc.get("revision"), doc.get("units")
        if not isinstance(revision, int) or isinstance(revision, bool):
            raise ValueError(f"{where}.revision: expected an integer, got {revision!r}")
        if not 0 <= revision <= MAX_COUNTER:
            raise ValueError(f"{where}.revision: must be in 0..{MAX_COUNTER}")
        if not isinstance(units, dict) or len(units) > MAX_UNITS:
            raise ValueError(f"{where}.units: expected an object of at most {MAX_UNITS} units")
        for name, group in units.items():
            if not name or len(name) > 253 or not isinstance(group, str) or len(group) > 63:
                raise ValueError(f"{where}.units: bad entry {str(name)[:60]!r}: {group!r}")
        revoked = _revoked(doc.get(REVOKED_FIELD, []), where)
        raw_budget = doc.get(BUDGET_FIELD)
        budget = None if raw_budget is None else _budget(raw_budget, f"{where}.budget")
        return cls(revision, dict(units), revoked, budget)

    @classmethod
    def read(cls, path: str | Path) -> Roster:
        try:
            return cls.from_json(json.loads(Path(path).read_text()), str(path))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: cannot read the units file: {exc}") from exc

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"revision": self.revision, "units": dict(self.units)}
        if self.revoked:  # left out when empty: the roster reads as it did before the field
            doc[REVOKED_FIELD] = sorted(self.revoked)
        if self.budget is not None:
            doc[BUDGET_FIELD] = self.budget.to_json()
        return doc

    def admit(self, unit: str, group: str | None) -> None:
        """Raise Reject unless `unit` is on the roster (in `group`, when given)."""
        known = self.units.get(unit)
        if known is None:
            raise Reject(
                403,
                "unknown_unit",
                f"unit {unit!r} is not one of this run's {len(self.units)} units "
                f"(roster revision {self.revision})",
            )
        if group is not None and group != known:
            raise Reject(403, "wrong_group", f"unit {unit!r} is in group {known!r}, not {group!r}")


def _budget(raw: Any, where: str) -> Budget:
    if not isinstance(raw, dict) or set(raw) - {"totalSteps", "totalTokens"}:
        raise ValueError(f"{where}: expected an object of totalSteps and/or totalTokens")
    values = [raw.get("totalSteps"), raw.get("totalTokens")]
    for key, value in zip(("totalSteps", "totalTokens"), values, strict=True):
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_COUNTER:
            raise ValueError(f"{where}.{key}: expected an integer in 1..{MAX_COUNTER}")
    if values == [None, None]:
        raise ValueError(f"{where}: set totalSteps or totalTokens: a run needs a budget")
    return Budget(*values)


def _revoked(raw: Any, where: str) -> frozenset[str]:
    if not isinstance(raw, list) or len(raw) > MAX_REVOKED:
        raise ValueError(f"{where}.{REVOKED_FIELD}: expected a list of at most {MAX_REVOKED} ids")
    for id in raw:
        if not isinstance(id, str) or not ID_PATTERN.fullmatch(id):
            raise ValueError(f"{where}.{REVOKED_FIELD}: bad credential id {str(id)[:70]!r}")
    return frozenset(raw)


def newest(*rosters: Roster | None) -> Roster | None:
    """The roster of the highest revision (the later one on a tie)."""
    out: Roster | None = None
    for roster in rosters:
        if roster is not None and (out is None or roster.revision >= out.revision):
            out = roster
    return out
