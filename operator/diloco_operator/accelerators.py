"""Known GKE TPU accelerators: which topologies exist and how many chips sit on one host.

GKE labels TPU nodes with `cloud.google.com/gke-tpu-accelerator` and
`cloud.google.com/gke-tpu-topology`; a slice of topology AxB(xC) has A*B(*C) chips spread over
hosts with `chipsPerHost` chips each. A learner unit is one slice, so its Job runs one pod per host.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

TPU_RESOURCE = "google.com/tpu"
ACCELERATOR_LABEL = "cloud.google.com/gke-tpu-accelerator"
TOPOLOGY_LABEL = "cloud.google.com/gke-tpu-topology"
TPU_TAINT_KEY = "google.com/tpu"
# GKE labels Spot VM nodes with it; Spot node pools may also carry it as a NoSchedule taint.
SPOT_LABEL = "cloud.google.com/gke-spot"


@dataclass(frozen=True)
class Accelerator:
    name: str
    topologies: tuple[str, ...]
    # Host sizes of the node pools: 4-chip hosts for multi-host slices; the 2D generations also
    # have an 8-chip single host for exactly 8-chip slices. 1x1 slices are single-chip hosts.
    chips_per_host: tuple[int, ...]


_2D = ("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16")
# 3D slices are built from 4-chip hosts (hosts = chips / 4).
# v5p: the slice shapes of https://cloud.google.com/tpu/docs/v5p ("Configurations": 2x2x1 on one
# host up to 16x16x24 = 6144 chips on 1536 hosts, the largest single slice), plus 2x2x4.
_V5P = (
    "2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8", "8x8x8",
    "8x8x16", "8x16x16", "16x16x16", "16x16x24",
)  # fmt: skip
# v4: https://cloud.google.com/tpu/docs/types-topologies gives the rule (AxBxC with A<=B<=C, each
# dimension <= 4 or a multiple of 4; e.g. 2x2x4) and https://cloud.google.com/tpu/docs/v4 the pod
# size (4096 chips). GKE's own per-shape table (plan-tpus) could not be read here, so these are
# v5p's shapes up to the v4 pod size (2x2x1, the one-host slice, as before): not a verified GKE
# list. Ironwood (tpu7x) is not listed: its GKE label value and shapes could not be confirmed.
_V4 = tuple(t for t in _V5P if math.prod(int(d) for d in t.split("x")) <= 4096)

ACCELERATORS: dict[str, Accelerator] = {
    a.name: a
    for a in (
        Accelerator("tpu-v6e-slice", _2D, (4, 8)),
        Accelerator("tpu-v5-lite-podslice", _2D, (4, 8)),
        Accelerator("tpu-v5p-slice", _V5P, (4,)),
        Accelerator("tpu-v4-podslice", _V4, (4,)),
    )
}


def topology_chips(topology: str) -> int:
    """Chips in a slice: the product of the topology's dimensions ('2x2x1' -> 4)."""
    return math.prod(int(d) for d in topology.split("x"))


def allowed_chips_per_host(accelerator: str, topology: str) -> tuple[int, ...]:
    """Host sizes a slice can be built from; the first is the default."""
    chips = topology_chips(topology)
    if chips == 1:
        return (1,)
    sizes = ACCELERATORS[accelerator].chips_per_host
    return tuple(c for c in sizes if c == 4 or c == chips) if chips % 4 == 0 else (chips,)


def default_chips_per_host(accelerator: str, topology: str) -> int:
    return allowed_chips_per_host(accelerator, topology)[0]


def check_tpu(accelerator: str, topology: str, chips_per_host: int | None) -> str | None:
    """None when the combination exists, else a message that names the offending field."""
    acc = ACCELERATORS.get(accelerator)
    if acc is None:
        return f"accelerator: unknown {accelerator!r}; known: {', '.join(sorted(ACCELERATORS))}"
    if topology not in acc.topologies:
        return (
            f"topology: {topology!r} is not a topology of {accelerator}; "
            f"allowed: {', '.join(acc.topologies)}"
        )
    allowed = allowed_chips_per_host(accelerator, topology)
    if chips_per_host is not None and chips_per_host not in allowed:
        return (
            f"chipsPerHost: {chips_per_host} does not fit {accelerator} {topology} "
            f"(allowed: {', '.join(map(str, allowed))})"
        )
    return None


def hosts(accelerator: str, topology: str, chips_per_host: int | None) -> int:
    """Hosts (pods) in one slice."""
    per_host = chips_per_host or default_chips_per_host(accelerator, topology)
    return max(1, topology_chips(topology) // per_host)
