"""The operator brings the DilocoRun CRD up to its own schema when it starts.

Helm installs a chart's crds/ on the first install only and never upgrades them, so after
`helm upgrade` a new operator would run against the previous release's schema: its new fields
pruned or refused by the API server. The operator carries its CRD (generated from the same
models it validates with, api/crdgen.py) and, allowed by the chart's narrow RBAC rule (get and
update of this one CRD by name), replaces the cluster's copy when that copy is older. It never
downgrades: an operator of an older version (a rollback, or the old replica during a rollout)
leaves a newer CRD alone. Docs: docs/operator.md "Upgrades".
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any, Literal

from kubernetes.client.exceptions import ApiException

from diloco_operator.api import crdgen
from diloco_operator.k8s import kube

log = logging.getLogger("diloco_operator.crd")

Verdict = Literal["current", "upgrade", "newer"]


@dataclass(frozen=True)
class Installed:
    """What the cluster's CRD says about itself (absent annotations: a CRD made before they were
    recorded, or by hand)."""

    version: str | None
    schema_hash: str | None


def version_key(version: str) -> tuple[int, ...]:
    """'0.12.3' -> (0, 12, 3); a suffix (rc1, .dev2) does not order, only the numbers before it."""
    numbers = re.match(r"^\s*v?(\d+(?:\.\d+)*)", version)
    return tuple(int(n) for n in numbers.group(1).split(".")) if numbers else ()


def verdict(installed: Installed, version: str, schema_hash: str) -> Verdict:
    """Whether an operator of `version` (whose CRD hashes to `schema_hash`) replaces the CRD."""
    if installed.schema_hash == schema_hash:
        return "current"
    if installed.version is not None and version_key(installed.version) > version_key(version):
        return "newer"
    return "upgrade"


def installed_of(crd: dict[str, Any]) -> Installed:
    notes = crd.get("metadata", {}).get("annotations") or {}
    return Installed(notes.get(crdgen.VERSION_ANNOTATION), notes.get(crdgen.SCHEMA_ANNOTATION))


def upgraded(current: dict[str, Any], wanted: dict[str, Any]) -> dict[str, Any]:
    """The cluster's CRD with our spec and our two annotations; the rest of its metadata (the
    resourceVersion that makes the replace conditional, Helm's labels) kept."""
    meta = dict(current["metadata"])
    meta["annotations"] = {
        **(meta.get("annotations") or {}),
        **wanted["metadata"]["annotations"],
    }
    return {**current, "metadata": meta, "spec": wanted["spec"]}


def ensure_current(attempts: int = 3) -> Verdict | None:
    """Replace the cluster's DilocoRun CRD with ours when older. None when it could not be read
    or written (missing, forbidden, conflicting writers): logged, and the operator goes on with
    the schema it finds, as it did before it managed the CRD."""
    wanted = crdgen.crd()
    name = wanted["metadata"]["name"]
    ours = Installed(
        wanted["metadata"]["annotations"][crdgen.VERSION_ANNOTATION],
        wanted["metadata"]["annotations"][crdgen.SCHEMA_ANNOTATION],
    )
    assert ours.version is not None and ours.schema_hash is not None
    for _ in range(attempts):
        try:
            current = kube.read_crd(name)
            found = installed_of(current)
            decided = verdict(found, ours.version, ours.schema_hash)
            if decided == "upgrade":
                kube.replace_crd(name, upgraded(current, wanted))
                log.info(
                    "CRD %s upgraded from %s to %s",
                    name,
                    found.version or "unversioned",
                    ours.version,
                )
            elif decided == "newer":
                log.warning(
                    "CRD %s is of version %s, newer than this operator (%s): left as it is",
                    name,
                    found.version,
                    ours.version,
                )
            return decided
        except ApiException as exc:
            if exc.status == 409:  # another replica wrote it between our read and write
                continue
            log.warning(
                "CRD %s not upgraded to %s (%s %s): %s",
                name,
                ours.version,
                exc.status,
                exc.reason,
                _why(exc.status),
            )
            return None
    log.warning("CRD %s not upgraded: it kept changing under us (%d tries)", name, attempts)
    return None


def _why(status: int | None) -> str:
    if status == 403:
        return (
            "the operator may not update it (chart value crds.manage=false?); apply crds/ by hand"
        )
    if status == 404:
        return "it is not installed: install the chart, or apply crds/"
    return "the API server refused; apply crds/ by hand"
