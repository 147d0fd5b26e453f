"""The CEL rules (x-kubernetes-validations) of the DilocoRun CRD: mirrors of the pydantic
validators, so the API server refuses the manifests the models refuse. `RULES` is keyed by model
($defs) name and crdgen attaches each list to that model's schema node; `root_rules` go on the
object's root, the one place a rule sees both the run's name and its pod templates.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

from diloco_trainer.config import PER_BYTE, CompressionConfig, TrainingConfig

from diloco_operator import api
from diloco_operator.api import capacity, pod_paths, pod_security, pod_template
from diloco_operator.api.accelerators import ACCELERATOR_LABEL, SPOT_LABEL, TOPOLOGY_LABEL
from diloco_operator.api.crd_tpu import tpu_rules
from diloco_operator.api.field_paths import cel_all

_TOTAL_UNITS = (
    "(has(self.replicas) ? self.replicas : 1) + (has(self.unitGroups) ? "
    "self.unitGroups.map(g, has(g.replicas) ? g.replicas : 0).sum() : 0)"
)


def _default(model: type[api.Strict], field: str) -> str:
    """A field's default as a CEL literal: the CRD states no defaults, so rules spell them."""
    return repr(model.model_fields[field].default)


def _or_default(path: str, model: type[api.Strict], field: str) -> str:
    parent = path.rpartition(".")[0]
    guards = " && ".join(f"has({p})" for p in _prefixes(parent)) + f" && has({path})"
    return f"({guards.removeprefix(' && ')} ? {path} : {_default(model, field)})"


def _blocks_fill_bytes(uses: Callable[[str], str], block_size: str) -> list[dict[str, str]]:
    """One rule per packed scheme: where `uses(scheme)` holds, `block_size` is a multiple of the
    values that scheme packs in a byte (CompressionConfig's model check, in CEL)."""
    return [
        {
            "rule": f"!{uses(scheme)} || {block_size} % {per_byte} == 0",
            "message": f"blockSize: must be a multiple of {per_byte} with {scheme} "
            f"({per_byte} values per byte)",
            "fieldPath": ".blockSize",
        }
        for scheme, per_byte in PER_BYTE.items()
        if per_byte > 1
    ]


def _prefixes(path: str) -> list[str]:
    parts = path.split(".")
    return [".".join(parts[: i + 1]) for i in range(1, len(parts))]


_LOCAL_GROUPS = (
    "(has(self.unitGroups) ? self.unitGroups.filter(g, !has(g.remote) || !g.remote).size() : 1)"
)
_ANY_REMOTE = "(has(self.unitGroups) && self.unitGroups.exists(g, has(g.remote) && g.remote))"
_EXPOSED = (
    "(has(self.syncer) && has(self.syncer.expose) && has(self.syncer.expose.type) && "
    "self.syncer.expose.type != 'ClusterIP')"
)

_SHARDS = _or_default("self.syncer.shards", api.SyncerSpec, "shards")
_HEARTBEAT = _or_default("self.training.heartbeatSeconds", TrainingConfig, "heartbeat_seconds")
_OFFLINE = _or_default(
    "self.failurePolicy.offlineAfterSeconds", api.FailurePolicy, "offline_after_seconds"
)

# CEL mirrors of the pydantic validators, keyed by model ($defs) name.
BUDGET_FIELDS = ("totalSteps", "totalTokens")


def _training_fields() -> list[str]:
    return [info.alias or name for name, info in TrainingConfig.model_fields.items()]


def _immutable(field: str) -> dict[str, str]:
    """A transition rule keeping `field` as it was, set or unset."""
    return {
        "rule": f"has(self.{field}) == has(oldSelf.{field}) && "
        f"(!has(self.{field}) || self.{field} == oldSelf.{field})",
        "message": f"training.{field}: immutable once the run exists (only totalSteps and "
        "totalTokens may change); create a new DilocoRun",
        "fieldPath": f".{field}",
    }


RULES: dict[str, list[dict[str, str]]] = {
    "DilocoRunSpec": [
        {
            "rule": f"{_TOTAL_UNITS} <= {api.MAX_UNITS}",
            "message": f"replicas: at most {api.MAX_UNITS} units in a run (spec.replicas plus "
            "unitGroups[].replicas)",
        },
        {
            "rule": "!has(self.chaos) || !has(self.chaos.schedule) || "
            f"self.chaos.schedule.all(e, !has(e.unit) || e.unit < {_TOTAL_UNITS})",
            "message": "chaos.schedule[].unit: no such unit (units are numbered 0..units-1)",
        },
        {
            "rule": f"{_HEARTBEAT} * {float(api.HEARTBEATS_PER_OFFLINE)} <= {_OFFLINE}",
            "message": "training.heartbeatSeconds: not well below "
            f"failurePolicy.offlineAfterSeconds (at most 1/{api.HEARTBEATS_PER_OFFLINE} of it)",
        },
        {
            "rule": "!has(self.unitGroups) || !has(self.unitGroups[0].replicas)",
            "message": "unitGroups[0].replicas: the first group is sized by spec.replicas; remove it",
        },
        {
            "rule": "!has(self.unitGroups) || "
            "self.unitGroups.all(g, g.name == self.unitGroups[0].name || has(g.replicas))",
            "message": "unitGroups[].replicas: required for every group but the first",
        },
        {
            "rule": "!has(self.training) || !has(self.training.quorum) || "
            f"self.training.quorum <= {_TOTAL_UNITS}",
            "message": "training.quorum: exceeds the number of units of the run",
        },
        {
            "rule": "!has(self.syncer) || !has(self.syncer.external) || "
            "(!has(self.syncer.expose) && !has(self.syncer.tls))",
            "message": "syncer.external: a run that joins another cluster's syncer sets neither "
            "syncer.expose nor syncer.tls (the home run does)",
        },
        {
            "rule": f"!has(self.syncer) || !has(self.syncer.external) || {_LOCAL_GROUPS} == 1",
            "message": "syncer.external: an away run runs exactly one unit group (the one its "
            "join credential is for); mark the others remote: true",
        },
        {
            "rule": "(has(self.syncer) && (has(self.syncer.external) || has(self.syncer.tls))) || "
            f"!({_ANY_REMOTE} || {_EXPOSED})",
            "message": "syncer.tls: required when a unit group is remote or the syncer is "
            "exposed to other clusters (plain HTTP stays inside the cluster)",
        },
        {
            "rule": f"{_SHARDS} <= "
            + _or_default("self.training.fragments", TrainingConfig, "fragments"),
            "message": "syncer.shards: more shards than training.fragments (every shard holds "
            "at least one fragment)",
            "fieldPath": ".syncer.shards",
        },
        {
            "rule": f"{_SHARDS} == 1 || !(({_ANY_REMOTE}) || (has(self.syncer) && "
            "(has(self.syncer.expose) || has(self.syncer.external))))",
            "message": "syncer.shards: a sharded syncer serves the units of its own cluster only "
            "(no syncer.expose, syncer.external or remote unit groups)",
            "fieldPath": ".syncer.shards",
        },
        {
            "rule": "!has(self.chaos) || !has(self.chaos.slowdown) || "
            "self.chaos.slowdown.all(k, has(self.unitGroups) ? "
            "self.unitGroups.exists(g, g.name == k) : k == 'default')",
            "message": "chaos.slowdown: every key must name a unit group of the run",
        },
    ],
    "SyncerSpec": [
        {
            "rule": "(has(self.shards) ? self.shards : 1) == "
            "(has(oldSelf.shards) ? oldSelf.shards : 1)",
            "message": "syncer.shards: immutable once the run exists (each shard's checkpoints "
            "hold its own fragments); create a new DilocoRun",
            "fieldPath": ".shards",
        }
    ],
    "TpuSpec": tpu_rules(),
    "UnitGroup": [
        {
            "rule": "!has(self.tpu) || !has(self.hostsPerUnit)",
            "message": "hostsPerUnit: a TPU unit's hosts come from tpu.topology; remove "
            "hostsPerUnit",
            "fieldPath": ".hostsPerUnit",
        },
        {
            "rule": "!has(self.spares) || self.spares == 0 || "
            "!has(self.hostsPerUnit) || self.hostsPerUnit == 1",
            "message": "spares: warm spares cover units of one host; remove spares or hostsPerUnit",
            "fieldPath": ".spares",
        },
        {
            "rule": "!has(self.spares) || self.spares == 0 || !has(self.remote) || !self.remote",
            "message": "spares: a remote group's spares belong to its own cluster's run",
            "fieldPath": ".spares",
        },
    ],
    "Toleration": [
        {
            "rule": "!has(self.operator) || self.operator != 'Exists' || !has(self.value) || "
            "self.value == ''",
            "message": "value: must be empty when operator is Exists",
            "fieldPath": ".value",
        },
        {
            "rule": "(has(self.key) && self.key != '') || "
            "(has(self.operator) && self.operator == 'Exists')",
            "message": "operator: must be Exists when key is empty",
        },
        {
            "rule": "!has(self.tolerationSeconds) || (has(self.effect) && "
            "self.effect == 'NoExecute')",
            "message": "effect: must be NoExecute when tolerationSeconds is set",
        },
    ],
    "FailurePolicy": [
        {
            "rule": _or_default(
                "self.restartBackoffSeconds", api.FailurePolicy, "restart_backoff_seconds"
            )
            + " <= "
            + _or_default(
                "self.maxRestartBackoffSeconds", api.FailurePolicy, "max_restart_backoff_seconds"
            ),
            "message": "restartBackoffSeconds: above its cap maxRestartBackoffSeconds",
            "fieldPath": ".restartBackoffSeconds",
        }
    ],
    "CompressionConfig": _blocks_fill_bytes(
        lambda scheme: (
            f"((has(self.scheme) && self.scheme == '{scheme}') || "
            f"(has(self.downlink) && self.downlink == '{scheme}'))"
        ),
        _or_default("self.blockSize", CompressionConfig, "block_size"),
    ),
    "SyncerExposure": [
        {
            "rule": "has(self.gateway) == (has(self.type) && self.type == 'Gateway')",
            "message": "syncer.expose.gateway: required with type Gateway, and only with it",
            "fieldPath": ".gateway",
        }
    ],
    "SyncerTls": [
        {
            "rule": "!has(self.secretName) || (!has(self.dnsNames) && !has(self.ipAddresses))",
            "message": "syncer.tls.dnsNames: names are for the operator-made certificate; a "
            "given secretName's certificate already has its own",
            "fieldPath": ".dnsNames",
        }
    ],
    # A group's own push compression: its own fields here; with the run's fields (a blockSize of
    # the run's against the group's scheme) the operator's spec check (api/__init__.py) and the
    # learner's start refuse the rest.
    "LinkCompression": _blocks_fill_bytes(
        lambda scheme: f"(has(self.scheme) && self.scheme == '{scheme}' && has(self.blockSize))",
        "self.blockSize",
    ),
    "Capacity": [
        {
            "rule": "!has(self.reservation) || !has(self.flexStart) || !self.flexStart",
            "message": "capacity: a reservation or flexStart, not both",
        }
    ],
    "KueueTopology": [
        {
            "rule": "has(self.required) != has(self.preferred)",
            "message": "kueueTopology: set required or preferred (one of them)",
        }
    ],
    "TrainingConfig": [
        {
            "rule": "has(self.totalSteps) || has(self.totalTokens)",
            "message": "set totalSteps or totalTokens: a run needs a budget",
        },
        # Learners and the syncer read it once; fragments or model changes mid-run would make
        # their states incompatible. A different training is a new run. The budget alone may
        # change: only the syncer reads it, and takes a new one with the roster.
        *(_immutable(field) for field in _training_fields() if field not in BUDGET_FIELDS),
    ],
    "DataConfig": [
        {
            "rule": "!has(self.source) || self.source != 'memmap' || has(self.path)",
            "message": "data.path is required when data.source is memmap",
            "fieldPath": ".path",
        }
    ],
    "ModelConfig": [
        {
            "rule": "!has(self.dModel) || !has(self.nHeads) || self.dModel % self.nHeads == 0",
            "message": "dModel must be divisible by nHeads",
        }
    ],
}

# Selector keys the operator sets from `tpu`, `spot` and `capacity`
# (unit_group.UnitGroup._selector_not_owned), and a node that is one kind of capacity only.
_CAPACITY_KEYS = " || ".join(f"{key!r} in self.nodeSelector" for key in capacity.SELECTOR_KEYS)
OWNED_SELECTOR_RULES = [
    {
        "rule": f"!has(self.capacity) || !has(self.nodeSelector) || !({_CAPACITY_KEYS})",
        "message": "nodeSelector: the reservation and flex-start labels are set by the operator "
        "from capacity",
        "fieldPath": ".nodeSelector",
    },
    {
        "rule": "!has(self.spot) || !self.spot || !has(self.capacity) || "
        "!(has(self.capacity.reservation) || (has(self.capacity.flexStart) && "
        "self.capacity.flexStart))",
        "message": "spot: Spot VMs or capacity.reservation/flexStart, not both",
        "fieldPath": ".spot",
    },
    {
        "rule": "!has(self.tpu) || !has(self.nodeSelector) || "
        f"!({ACCELERATOR_LABEL!r} in self.nodeSelector || {TOPOLOGY_LABEL!r} in self.nodeSelector)",
        "message": f"nodeSelector: {ACCELERATOR_LABEL} and {TOPOLOGY_LABEL} are set by the "
        "operator from tpu",
        "fieldPath": ".nodeSelector",
    },
    {
        "rule": "!has(self.spot) || !self.spot || !has(self.nodeSelector) || "
        f"!({SPOT_LABEL!r} in self.nodeSelector)",
        "message": f"nodeSelector: {SPOT_LABEL} is set by the operator from spot",
        "fieldPath": ".nodeSelector",
    },
]
for _model, _rules in {
    **pod_template.CEL_RULES,
    "UnitGroup": OWNED_SELECTOR_RULES,
    "DilocoRunSpec": pod_paths.cel_rules(),
}.items():
    RULES.setdefault(_model, []).extend(_rules)


def _not_a_run_token(name: str) -> str:
    # pod_security.run_token_pattern with a constant regex: one built from the run's name
    # costs too much in the CRD's static cost estimate.
    run = "self.metadata.name"
    return (
        f"{name} != {run} + '-token' && !({name}.startsWith({run} + '-') && "
        f"{name}.substring(size({run}) + 1).matches('^.+-[0-9]+-token$'))"
    )


def _no_run_token(template: str, paths: list[str]) -> str:
    """CEL: no Secret reference at `paths` of the pod template `template` names a token Secret
    of the run."""
    return " && ".join(cel_all(template, path, _not_a_run_token) for path in paths)


# The run's name is unbounded to the cost estimate, so each name test counts as costly.
RUN_TOKEN_PATHS_PER_RULE = 3


def _run_token_rules() -> list[dict[str, str]]:
    """On the root: only there does a rule see both the run's name and its pod templates. One
    rule per part of a template (volumes, each container list, ...): together they would pass
    the cost budget of one rule."""
    parts: dict[str, list[str]] = {}
    for path in pod_security.SECRET_REFERENCES:
        parts.setdefault(path.split("[", 1)[0], []).append(path)
    rules = []
    for part, paths in parts.items():
        for i in range(0, len(paths), RUN_TOKEN_PATHS_PER_RULE):
            chunk = paths[i : i + RUN_TOKEN_PATHS_PER_RULE]
            groups = _no_run_token("g.template", chunk)
            rules.append(
                {
                    "rule": f"!has(self.spec.unitGroups) || "
                    f"self.spec.unitGroups.all(g, !has(g.template) || ({groups}))",
                    "message": f"spec.unitGroups[].template.{part}: names "
                    f"{pod_security.RUN_TOKEN_WHY}",
                    "fieldPath": ".spec.unitGroups",
                }
            )
    syncer = " && ".join(
        _no_run_token("self.spec.syncer.template", paths) for paths in parts.values()
    )
    rules.append(
        {
            "rule": f"!has(self.spec.syncer) || !has(self.spec.syncer.template) || ({syncer})",
            "message": f"spec.syncer.template: names {pod_security.RUN_TOKEN_WHY}",
            "fieldPath": ".spec.syncer.template",
        }
    )
    return rules


RUN_TOKEN_RULES = _run_token_rules()


def root_rules() -> list[dict[str, str]]:
    """The rules on the object's root: the run's name, and no token Secret of the run named by
    a pod template."""
    return [
        {
            "rule": f"size(self.metadata.name) <= {api.MAX_RUN_NAME}",
            "message": f"metadata.name: at most {api.MAX_RUN_NAME} characters "
            "(it prefixes Job, Service and Pod names)",
        },
        {
            "rule": f"self.metadata.name.matches(r'{api.RUN_NAME}')",
            "message": "metadata.name: lower-case letters, digits and '-', starting with a "
            "letter (it names the run's Services)",
        },
        *copy.deepcopy(RUN_TOKEN_RULES),
    ]
