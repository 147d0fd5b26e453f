"""A seeded generator of DilocoRun manifests: valid ones with random names, quantities, label
keys and periods, and broken ones that pass a naive look but cannot work (the kinds of bad
input an operator user would type). Each broken case carries the field its rejection must name.

Every family draws its bad value at random from a space of them (not a fixed list), so a new
seed explores new spellings; `cases(seed, n)` is deterministic for a seed.
"""

from __future__ import annotations

import copy
import random
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from diloco_operator.api.kubesyntax import HEARTBEATS_PER_OFFLINE, INT64_MAX, MAX_UNITS

Doc = dict[str, Any]


@dataclass(frozen=True)
class Case:
    family: str
    doc: Doc
    field: str  # what the rejection message must name; "" for a valid manifest

    @property
    def valid(self) -> bool:
        return not self.field


LOWER = string.ascii_lowercase
ALNUM = LOWER + string.digits


def _label(rng: random.Random, first: str = ALNUM, size: tuple[int, int] = (1, 12)) -> str:
    n = rng.randint(*size)
    if n == 1:
        return rng.choice(first.replace("-", ""))
    middle = "".join(rng.choice(ALNUM + "-") for _ in range(n - 2))
    return rng.choice(first) + middle + rng.choice(ALNUM)


def _subdomain(rng: random.Random) -> str:
    return ".".join(_label(rng, size=(1, 8)) for _ in range(rng.randint(1, 3)))


def _quantity(rng: random.Random) -> str | int:
    if rng.random() < 0.2:
        return rng.randint(0, 64)
    number = str(rng.randint(0, 4096))
    if rng.random() < 0.3:
        number += "." + str(rng.randint(0, 99))
    return number + rng.choice(["", "m", "k", "M", "G", "Ki", "Mi", "Gi", "Ti", "e3"])


def base(rng: random.Random) -> Doc:
    """A random valid manifest: two groups, resources, selectors, tolerations, chaos."""
    offline = rng.choice([20.0, 30, 60.5, 120])
    backoff_cap = rng.choice([60, 300.0, 900])
    return {
        "apiVersion": "diloco.dev/v1alpha1",
        "kind": "DilocoRun",
        "metadata": {"name": _label(rng, first=LOWER, size=(1, 40))},
        "spec": {
            "image": rng.choice(["trainer:1", "ghcr.io/x/trainer@sha256:" + "a" * 64]),
            "replicas": rng.randint(1, 8),
            "unitGroups": [
                {
                    "name": _label(rng, size=(1, 12)),
                    "resources": {
                        "requests": {"cpu": _quantity(rng), "memory": _quantity(rng)},
                        "limits": {f"{_subdomain(rng)}/gpu": rng.randint(0, 8)},
                    },
                    "nodeSelector": {f"{_subdomain(rng)}/{_label(rng)}": _label(rng)},
                    "tolerations": [
                        {"key": _label(rng), "operator": "Exists", "effect": "NoSchedule"},
                        {
                            "key": f"{_subdomain(rng)}/{_label(rng)}",
                            "operator": "Equal",
                            "value": _label(rng),
                            "effect": "NoExecute",
                            "tolerationSeconds": rng.randint(0, 3600),
                        },
                    ],
                },
                {"name": "second", "replicas": rng.randint(1, 4)},
            ],
            "training": {
                "totalSteps": rng.randint(1, 10**6),
                "heartbeatSeconds": round(rng.uniform(0.1, offline / HEARTBEATS_PER_OFFLINE), 3),
                "compression": {"scheme": "int4", "blockSize": 2 * rng.randint(4, 512)},
                "checkpoint": {"everySeconds": rng.choice([0.1, 5, 30.0])},
                "seed": rng.randint(0, INT64_MAX),
            },
            "syncer": {
                "checkpoint": rng.choice(
                    [
                        {"size": _quantity(rng), "storageClass": _subdomain(rng)},
                        {"path": f"gs://{_label(rng, size=(3, 20))}/{_label(rng)}"},
                        {"path": _subdomain(rng)},
                    ]
                )
            },
            "failurePolicy": {
                "offlineAfterSeconds": offline,
                "restartBackoffSeconds": rng.uniform(0, backoff_cap),
                "maxRestartBackoffSeconds": backoff_cap,
            },
            "serviceAccountName": _subdomain(rng),
            "chaos": {"seed": rng.randint(0, 99), "schedule": [{"atSeconds": 1, "action": "kill"}]},
        },
    }


def _with_junk(rng: random.Random, valid: str, junk: str) -> str:
    """`valid` with one character of `junk` put somewhere in it."""
    i = rng.randint(0, len(valid))
    return valid[:i] + rng.choice(junk) + valid[i:]


def _spec(doc: Doc) -> Doc:
    spec: Doc = doc["spec"]
    return spec


def _group(doc: Doc) -> Doc:
    group: Doc = doc["spec"]["unitGroups"][0]
    return group


def _total(doc: Doc) -> int:
    spec = _spec(doc)
    return int(spec["replicas"]) + sum(int(g.get("replicas", 0)) for g in spec["unitGroups"][1:])


# Each family breaks one thing of a valid manifest and says which field must be named.
Mutation = Callable[[random.Random, Doc], str]


def bad_run_name(rng: random.Random, doc: Doc) -> str:
    name = doc["metadata"]["name"]
    doc["metadata"]["name"] = rng.choice(
        [
            lambda: _with_junk(rng, name, "._/ " + string.ascii_uppercase),
            lambda: rng.choice(string.digits + "-") + name,
            lambda: name + "-",
            lambda: name + _label(rng, size=(41, 60)),
        ]
    )()
    return "metadata.name"


def bad_quantity(rng: random.Random, doc: Doc) -> str:
    value = str(_quantity(rng))
    _group(doc)["resources"]["requests"]["cpu"] = rng.choice(
        [
            lambda: _with_junk(rng, value, " -+,/xyzKB"),
            lambda: "-" + value,
            lambda: value + rng.choice(["i", "Kb", "mi", "g", "E5x"]),
            lambda: -rng.randint(1, 10**6),
        ]
    )()
    return "resources.requests"


def bad_resource_name(rng: random.Random, doc: Doc) -> str:
    name = rng.choice(
        [
            lambda: _label(rng, first=LOWER),  # no domain: not a standard resource
            lambda: f"{_subdomain(rng)}/{_label(rng)}/{_label(rng)}",
            lambda: _with_junk(rng, f"{_subdomain(rng)}/{_label(rng)}", " *:!"),
        ]
    )()
    if name in ("cpu", "memory"):
        name = "x" + name
    _group(doc)["resources"]["limits"][name] = 1
    return "resources.limits"


def bad_label(rng: random.Random, doc: Doc) -> str:
    selector = _group(doc)["nodeSelector"]
    if rng.random() < 0.5:
        selector[_with_junk(rng, f"{_subdomain(rng)}/{_label(rng)}", " *:!/")] = "x"
    else:
        key = next(iter(selector))
        selector[key] = rng.choice(
            [
                lambda: _with_junk(rng, _label(rng), " */:!"),
                lambda: "-" + _label(rng),
                lambda: _label(rng, size=(64, 80)),
            ]
        )()
    return "nodeSelector"


def bad_storage_class(rng: random.Random, doc: Doc) -> str:
    _spec(doc)["syncer"]["checkpoint"] = {
        "storageClass": rng.choice(
            [
                lambda: _with_junk(rng, _subdomain(rng), "_ /" + string.ascii_uppercase),
                lambda: _subdomain(rng) + ".",
                lambda: "-" + _subdomain(rng),
            ]
        )()
    }
    return "storageClass"


def bad_toleration(rng: random.Random, doc: Doc) -> str:
    tolerations = _group(doc)["tolerations"]
    which = rng.randrange(3)
    if which == 0:
        tolerations[0]["value"] = _label(rng)  # Exists with a value
    elif which == 1:
        tolerations.append({"operator": "Equal", "value": _label(rng)})  # no key, not Exists
    else:
        tolerations[1]["effect"] = rng.choice(["NoSchedule", "PreferNoSchedule"])
    return "tolerations"


def bad_service_account(rng: random.Random, doc: Doc) -> str:
    _spec(doc)["serviceAccountName"] = rng.choice(
        [
            lambda: _with_junk(rng, _subdomain(rng), "_ /:" + string.ascii_uppercase),
            lambda: _subdomain(rng) + "..x",
        ]
    )()
    return "serviceAccountName"


def unpackable_block(rng: random.Random, doc: Doc) -> str:
    """A block that does not fill whole bytes: odd with int4, or 2 mod 4 with int2."""
    compression = _spec(doc)["training"]["compression"]
    packed = rng.choice(["int4", "int2"])
    compression["blockSize"] = 4 * rng.randint(4, 512) + (
        rng.choice([1, 3]) if packed == "int4" else 2
    )
    if rng.random() < 0.5:
        compression.update(scheme="int8", downlink=packed)
    else:
        compression["scheme"] = packed
    return "blockSize"


def heartbeat_near_offline(rng: random.Random, doc: Doc) -> str:
    offline = float(_spec(doc)["failurePolicy"]["offlineAfterSeconds"])
    low = offline / HEARTBEATS_PER_OFFLINE
    _spec(doc)["training"]["heartbeatSeconds"] = round(rng.uniform(low * 1.01, 600), 3)
    return "heartbeatSeconds"


def bad_checkpoint_path(rng: random.Random, doc: Doc) -> str:
    _spec(doc)["syncer"]["checkpoint"] = {
        "path": rng.choice(
            [
                lambda: rng.choice(["s3://", "/", "./", "http://", "gs:/"]) + _label(rng),
                lambda: _with_junk(rng, _subdomain(rng), " _:" + string.ascii_uppercase),
                lambda: "gs://" + rng.choice(["-", "_", "."]) + _label(rng) + "/x",
            ]
        )()
    }
    return "checkpoint.path"


def backoff_above_cap(rng: random.Random, doc: Doc) -> str:
    policy = _spec(doc)["failurePolicy"]
    cap = rng.uniform(0, 600)
    policy.update(maxRestartBackoffSeconds=cap, restartBackoffSeconds=cap + rng.uniform(0.01, 99))
    return "restartBackoffSeconds"


def chaos_unit_out_of_range(rng: random.Random, doc: Doc) -> str:
    unit = rng.randint(_total(doc), MAX_UNITS - 1)
    _spec(doc)["chaos"]["schedule"].append({"atSeconds": 2, "action": "kill", "unit": unit})
    return "chaos.schedule"


def busy_loop_period(rng: random.Random, doc: Doc) -> str:
    tiny = rng.uniform(0.0, 0.099)
    training = _spec(doc)["training"]
    which = rng.randrange(4)
    if which == 0:
        training["heartbeatSeconds"] = tiny
        return "heartbeatSeconds"
    if which == 1:
        training["checkpoint"]["everySeconds"] = tiny
        return "everySeconds"
    if which == 2:
        training["eval"] = {"everySeconds": tiny}
        return "everySeconds"
    _spec(doc)["chaos"]["killEverySeconds"] = rng.uniform(0.0, 0.99)
    return "killEverySeconds"


def image_with_whitespace(rng: random.Random, doc: Doc) -> str:
    _spec(doc)["image"] = _with_junk(rng, _spec(doc)["image"], " \t\n")
    return "image"


def too_many_units(rng: random.Random, doc: Doc) -> str:
    spec = _spec(doc)
    spec["replicas"] = rng.randint(1, MAX_UNITS)
    extra = MAX_UNITS + 1 - spec["replicas"]
    spec["unitGroups"][1]["replicas"] = rng.randint(max(1, extra), MAX_UNITS)
    return "replicas"


def string_for_number(rng: random.Random, doc: Doc) -> str:
    spec = _spec(doc)
    which = rng.randrange(4)
    if which == 0:
        spec["replicas"] = str(spec["replicas"])
        return "replicas"
    if which == 1:
        spec["training"]["totalSteps"] = str(spec["training"]["totalSteps"])
        return "totalSteps"
    if which == 2:
        spec["failurePolicy"]["offlineAfterSeconds"] = str(
            spec["failurePolicy"]["offlineAfterSeconds"]
        )
        return "offlineAfterSeconds"
    spec["syncer"]["port"] = str(rng.randint(1024, 65535))
    return "port"


def beyond_int64(rng: random.Random, doc: Doc) -> str:
    big = INT64_MAX + rng.randint(1, 10**30)
    which = rng.randrange(3)
    if which == 0:
        _spec(doc)["training"]["seed"] = big
        return "seed"
    if which == 1:
        _spec(doc)["chaos"]["seed"] = big
        return "seed"
    _spec(doc)["training"]["totalSteps"] = big
    return "totalSteps"


BROKEN: dict[str, Mutation] = {
    f.__name__: f
    for f in (
        bad_run_name,
        bad_quantity,
        bad_resource_name,
        bad_label,
        bad_storage_class,
        bad_toleration,
        bad_service_account,
        unpackable_block,
        heartbeat_near_offline,
        bad_checkpoint_path,
        backoff_above_cap,
        chaos_unit_out_of_range,
        busy_loop_period,
        image_with_whitespace,
        too_many_units,
        string_for_number,
        beyond_int64,
    )
}


def cases(seed: int, per_family: int) -> list[Case]:
    """`per_family` valid manifests and as many broken ones of every family."""
    rng = random.Random(seed)
    out = [Case("valid", base(rng), "") for _ in range(per_family)]
    for family, mutate in BROKEN.items():
        for _ in range(per_family):
            doc = copy.deepcopy(base(rng))
            field = mutate(rng, doc)
            out.append(Case(family, doc, field))
    return out
