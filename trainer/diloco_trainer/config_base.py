"""The base of every block of the training schema (config.py): camelCase on the wire, nothing
unknown, bounds a CRD can state. Pure pydantic, importable without JAX (the operator embeds the
schema)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel

# The largest integer bound a CRD schema can state (the API server reads `maximum` as a float64,
# and it must fit an int64): a manifest with a bigger one is refused there, so here too.
INT64_MAX = (1 << 63) - 1024
# The shortest period anything may be scheduled with: a smaller one is a busy loop.
MIN_PERIOD_SECONDS = 0.1


class Strict(BaseModel):
    """Base for every schema block: camelCase aliases, no unknown fields, validated defaults."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        validate_default=True,
        # YAML can spell .inf and .nan; JSON (and so the API server) cannot: refuse them too.
        allow_inf_nan=False,
    )

    def to_wire(self) -> dict[str, Any]:
        """The manifest form: camelCase keys, JSON-compatible values."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)
