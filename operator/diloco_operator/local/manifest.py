"""Read a DilocoRun manifest (the same file `kubectl apply` takes) for the local runtime.

Validation is the operator's own model (`diloco_operator.api`): one schema, two consumers, so a
manifest the CRD would reject is rejected here with the same field-naming messages, before any
process starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diloco_operator.api import DilocoRunSpec, parse_manifest
from diloco_operator.planner.faults import ChaosSettings, chaos_settings
from diloco_trainer.config import ConfigError, read_document

__all__ = ["LocalRun", "ManifestError", "chaos_settings", "check_chaos_units", "load_manifest"]


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
    if spec.suspend:
        # Nothing would run: the local runtime has no cluster to keep a suspended run in.
        raise ManifestError(
            "spec.suspend: true suspends a run on Kubernetes; `diloco local run` runs the "
            "manifest now, so remove it (or set it to false)"
        )
    for i, group in enumerate(spec.unit_groups):
        if group.hosts_per_unit is not None and group.hosts_per_unit > 1:
            # Every host's coordinator and supervisor would want the same ports on one machine.
            raise ManifestError(
                f"spec.unitGroups.{i}.hostsPerUnit: units of several hosts run on Kubernetes; "
                "the local runtime runs one process per unit (remove it, or set it to 1)"
            )
    name = str(doc["metadata"]["name"])
    return LocalRun(name=name, path=p, document=doc, spec=spec)


def check_chaos_units(settings: ChaosSettings, units: int) -> None:
    """A scheduled fault naming a unit the run does not have, or one the local runtime cannot
    deliver, is a manifest error."""
    for i, fault in enumerate(settings.schedule):
        if fault.kind == "node-not-ready":
            raise ManifestError(
                f"spec.chaos.schedule.{i}.action: nodeNotReady needs Kubernetes nodes; the local "
                "runtime has none (use kill)"
            )
        if fault.unit is not None and fault.unit >= units:
            raise ManifestError(
                f"spec.chaos.schedule.{i}.unit: unit {fault.unit} does not exist "
                f"(the run has units 0..{units - 1})"
            )
