"""A warm spare's objects (planner/spares.py): its token Secret and a one-pod Indexed Job.

The pod is a unit pod of its group in every way the hardware and the learner care about (node
pool, resources, template, compile cache, restarts in place, the group's env), with three
differences: it has no unit identity (DILOCO_SPARE names it instead, and the syncer hands it a
unit to cover), it holds a spare's token (good only for waiting at the syncer: the unit's token
comes with the cover), and it is labelled `diloco.dev/spare=true` so that the operator keeps it
apart from the run's units.
"""

from __future__ import annotations

from typing import Any

from diloco_trainer.auth import spare_token

from diloco_operator.api import LABEL_SPARE, LABEL_UNIT
from diloco_operator.api.pod_security import TOKEN_KEY
from diloco_operator.k8s.builders import unit_job
from diloco_operator.k8s.object_meta import LEARNER, child_meta
from diloco_operator.k8s.run_ref import Run
from diloco_operator.planner import CreateSpare, CreateUnit

SPARE_ENV = "DILOCO_SPARE"
# A unit's identity, which a spare gets from its cover instead.
UNIT_IDENTITY_ENV = frozenset(
    {"DILOCO_UNIT", "DILOCO_UNIT_NAME", "DILOCO_ATTEMPT", "TPU_WORKER_ID", "TPU_WORKER_HOSTNAMES"}
)


def spare_token_secret(run: Run, spare: str, run_token: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": child_meta(run, f"{spare}-token", LEARNER, **{LABEL_UNIT: spare}),
        "stringData": {TOKEN_KEY: spare_token(run_token, spare)},
    }


def spare_job(
    run: Run, spare: CreateSpare, kubelet_rule_ok: bool, token_secret: str
) -> dict[str, Any]:
    as_unit = CreateUnit(spare.name, spare.group, spare.index, 0, spare.attempt, spare.num_units, 1)
    job = unit_job(run, as_unit, kubelet_rule_ok, token_secret)
    job["metadata"]["labels"][LABEL_SPARE] = "true"
    template = job["spec"]["template"]
    template["metadata"]["labels"][LABEL_SPARE] = "true"
    pod = template["spec"]
    pod.pop("subdomain", None)  # no headless Service: nothing addresses a one-host spare
    learner = next(c for c in pod["containers"] if c["name"] == LEARNER)
    learner["env"] = [e for e in learner["env"] if e["name"] not in UNIT_IDENTITY_ENV]
    learner["env"].append({"name": SPARE_ENV, "value": spare.name})
    return job


def spare_objects(
    run: Run, spare: CreateSpare, run_token: str, kubelet_rule_ok: bool = True
) -> list[dict[str, Any]]:
    """The spare's token Secret before the Job whose pod mounts it."""
    secret = spare_token_secret(run, spare.name, run_token)
    return [secret, spare_job(run, spare, kubelet_rule_ok, secret["metadata"]["name"])]
