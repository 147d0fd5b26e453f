"""Fields of the syncer's JSON requests: typed, bounded, refused with a 400 naming the field
(never stored when out of range: a 400-digit counter once broke every status read)."""

from __future__ import annotations

import math
from typing import Any

from diloco_trainer.syncer.fragment import Reject
from diloco_trainer.wire import MAX_COUNTER


def field_of(
    data: dict[str, Any],
    name: str,
    kind: type,
    default: Any = ...,
    minimum: float | None = None,
    maximum: float | None = None,
) -> Any:
    if name not in data or data[name] is None:
        if default is ...:
            raise Reject(400, "bad_request", f"{name}: required")
        return default
    value = data[name]
    ok = isinstance(value, kind) and not isinstance(value, bool)
    if kind is float:
        # math.isfinite of an int beyond float's range raises OverflowError: bound it first.
        ok = (isinstance(value, float) and math.isfinite(value)) or (
            isinstance(value, int) and not isinstance(value, bool) and abs(value) <= MAX_COUNTER
        )
    if not ok:
        raise Reject(400, "bad_request", f"{name}: expected {kind.__name__}, got {value!r}")
    if minimum is not None and value < minimum:
        raise Reject(400, "bad_request", f"{name}: must be >= {minimum}, got {short(value)}")
    if maximum is not None and value > maximum:
        raise Reject(400, "bad_request", f"{name}: must be <= {maximum:.0f}, got {short(value)}")
    return float(value) if kind is float else value


def short(value: float) -> str:
    """A number for an error message: huge integers as their digit count (str() of one with
    more than 4300 digits raises)."""
    if isinstance(value, int) and abs(value) > MAX_COUNTER:
        return f"an integer of {value.bit_length() * 30103 // 100000 + 1} digits"
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def counter(data: dict[str, Any], name: str, default: Any = ...) -> int:
    """A step/token/attempt count: an integer in 0..MAX_COUNTER, refused (never stored) else."""
    return int(field_of(data, name, int, default, 0, MAX_COUNTER))
