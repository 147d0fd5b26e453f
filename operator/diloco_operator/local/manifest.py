"""Read a DilocoRun manifest (the same file `kubectl apply` takes) for the local runtime.

Validation is the operator's own model (`diloco_operator.api`): one schema, two consumers, so a
manifest the CRD would reject is rejected here with the same field-naming messages, before any
process starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diloco_operator.api import ChaosSpec, DilocoRunSpec, parse_manifest
from diloco_operator.local.chaos import DEFAULT_CHAOS, ChaosSettings, ScheduledFault
from diloco_trainer.config import ConfigError, read_document


class ManifestError(Exception):
    """The manifest cannot be run; the message names the field(s)."""


@dataclass(frozen=True)
class LocalRun:
    name: str
    path: Path
    document: dict[str, Any]
    spec: DilocoRunSpec


def load_manifest(path: str | Path) -> LocalRun:
    """Parse and validate a DilocoRun manifest; raises ManifestError naming the bad fields."""
    p = Path(path)
    try:
        doc = read_document(p)
    except ConfigError as exc:
        raise ManifestError(str(exc)) from exc
    try:
        spec = parse_manifest(doc)
    except ValueError as exc:
        raise ManifestError(str(exc)) from exc
    name = str(doc["metadata"]["name"])
    return LocalRun(name=name, path=p, document=doc, spec=spec)


_ACTIONS = {"kill": "kill", "pause": "pause", "killSyncer": "kill-syncer"}


def chaos_settings(spec: ChaosSpec | None, enabled: bool, seed: int | None = None) -> ChaosSettings:
    """The faults to inject. `enabled` is the --chaos flag: without it nothing is injected; with
    it, the manifest's chaos block decides, or DEFAULT_CHAOS when there is none."""
    if not enabled:
        return ChaosSettings(enabled=False)
    if spec is None or not spec.has_fault_settings:
        base = DEFAULT_CHAOS
        return base if seed is None else ChaosSettings(**{**base.__dict__, "seed": seed})
    schedule = tuple(
        ScheduledFault(
            at=ev.at_seconds,
            kind=_ACTIONS[ev.action],  # type: ignore[arg-type]
            unit=ev.unit,
            pause_seconds=ev.pause_seconds if ev.action == "pause" else None,
        )
        for ev in spec.schedule
    )
    return ChaosSettings(
        enabled=True,
        seed=spec.seed if seed is None else seed,
        start_after_seconds=0.0,
        kill_interval_seconds=spec.kill_every_seconds,
        schedule=schedule,
    )


def check_chaos_units(settings: ChaosSettings, units: int) -> None:
    """A scheduled fault naming a unit the run does not have is a manifest error."""
    for i, fault in enumerate(settings.schedule):
        if fault.unit is not None and fault.unit >= units:
            raise ManifestError(
                f"spec.chaos.schedule.{i}.unit: unit {fault.unit} does not exist "
                f"(the run has units 0..{units - 1})"
            )
